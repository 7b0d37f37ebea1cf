//! A pipelined transfer: a host array streams through the device in chunks, one chunk's
//! upload, another's compute and a third's download overlapping on several streams.
//!
//! `cargo run -p warpdrive --example pipeline`

use warpdrive::ops::{self, Map};
use warpdrive::transfer::Pipeline;
use warpdrive::Device;

fn main() -> warpdrive::Result<()> {
    let device = Device::best()?;
    let input: Vec<f32> = (0..8 << 20).map(|i| (i % 4096) as f32).collect(); // 32 MiB
    let mut output = vec![0f32; input.len()];

    // 2 streams, chunks of 1 Mi elements, 2 chunks in flight per stream.
    let pipeline = Pipeline::new(&device, 2, 1 << 20, 2)?;
    let stats = pipeline.run(&input, &mut output, |stream, x, y| {
        ops::map(stream, &Map::affine(3.0, 1.0), x, y) // enqueued, not waited for
    })?;

    let wrong = input
        .iter()
        .zip(&output)
        .filter(|(x, y)| **y != 3.0 * **x + 1.0)
        .count();
    println!(
        "{}: {} chunks in {:.1} ms (host copies {:.1} ms, H2D {:.1}, compute {:.1}, D2H {:.1}); \
         overlap efficiency {:.2}; {wrong} wrong values",
        device.label(),
        stats.chunks,
        stats.wall_s * 1e3,
        stats.host_s * 1e3,
        stats.h2d_s * 1e3,
        stats.compute_s * 1e3,
        stats.d2h_s * 1e3,
        stats.overlap_efficiency()
    );
    Ok(())
}
