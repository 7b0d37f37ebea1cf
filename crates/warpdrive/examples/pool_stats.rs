//! The device pool: a freed buffer's memory is kept and serves the next request, so an
//! allocation is paid for once; `stats()` shows it, `trim()` gives the cache back.
//!
//! `cargo run -p warpdrive --example pool_stats`

use warpdrive::memory::device_pool;
use warpdrive::{Buffer, Device};

fn main() -> warpdrive::Result<()> {
    let device = Device::best()?;
    let stream = device.new_stream()?;
    let pool = device_pool(&device)?;

    // A training-loop shape: the same buffers every step.
    for step in 0..3 {
        let a = Buffer::<f32>::zeros(&stream, 4 << 20)?; // 16 MiB
        let b = Buffer::<f32>::zeros(&stream, 1000)?; // packed into a small segment
        let s = pool.stats()?;
        println!(
            "step {step}: {} + {} bytes; in use {} B, reserved {} B, driver allocations {}",
            a.size_bytes(),
            b.size_bytes(),
            s.in_use,
            s.reserved,
            s.driver_allocs
        );
    } // dropped: back to the pool, not to the driver

    let s = pool.stats()?;
    println!(
        "after the loop: {} requests served by {} driver allocations; peak in use {} B, \
         fragmentation {:.2}",
        s.allocations, s.driver_allocs, s.peak_in_use, s.fragmentation
    );
    let freed = pool.trim()?;
    println!(
        "trim() returned {freed} cached bytes; reserved now {} B",
        pool.stats()?.reserved
    );
    Ok(())
}
