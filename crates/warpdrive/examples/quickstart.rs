//! Upload a vector, run a fused op on the device, download the result.
//!
//! `cargo run -p warpdrive --example quickstart` (on a GPU if there is one, else the CPU
//! backend; `WARPDRIVE_DEVICE=cpu` forces the CPU).

use warpdrive::ops::{self, Activation, Map};
use warpdrive::{bf16, Buffer, Device};

fn main() -> warpdrive::Result<()> {
    let device = Device::best()?;
    let stream = device.new_stream()?;

    // Upload: the fast path (staged through pinned memory, at the link's speed).
    let x: Vec<f32> = (0..1 << 20)
        .map(|i| (i % 1000) as f32 / 100.0 - 5.0)
        .collect();
    let xd = Buffer::from_host(&stream, &x)?;

    // One fused pass: y = silu(0.5·x + 1), written as bf16.
    let mut yd = Buffer::<bf16>::zeros(&stream, x.len())?;
    let m = Map::affine(0.5, 1.0).then(Activation::Silu);
    ops::map(&stream, &m, &xd, &mut yd)?;

    // Download (waits for the work queued on the stream).
    let y = yd.to_host(&stream)?;
    let silu = |v: f32| v / (1.0 + (-v).exp());
    let worst = x
        .iter()
        .zip(&y)
        .map(|(&a, b)| (b.to_f32() - silu(0.5 * a + 1.0)).abs())
        .fold(0.0f32, f32::max);
    println!(
        "{}: {} elements, silu(0.5x + 1) as bf16, largest error {worst:.4}",
        device.label(),
        y.len()
    );
    Ok(())
}
