//! Capture a sequence of ops once as a CUDA graph and replay it: one launch per replay
//! instead of one per op (on the CPU backend the closure is recorded and rerun).
//!
//! `cargo run -p warpdrive --example graph_replay`

use warpdrive::exec::Graph;
use warpdrive::ops::{self, Map};
use warpdrive::{Buffer, Device};

fn main() -> warpdrive::Result<()> {
    let device = Device::best()?;
    let stream = device.new_stream()?;
    let n = 1 << 16;
    let x = Buffer::from_host(&stream, &vec![1.0f32; n])?;
    let mut acc = Buffer::<f32>::zeros(&stream, n)?;
    let mut t = Buffer::<f32>::zeros(&stream, n)?;

    {
        // Buffers are allocated before the capture: allocating inside one is refused.
        let mut step = Graph::capture(&stream, |s| {
            ops::map(s, &Map::affine(2.0, 0.0), &x, &mut t)?; // t = 2x
            ops::axpy(s, 1.0, &t, &mut acc) // acc += t
        })?;
        step.prepare()?; // instantiate now, so the first launch costs no more than the rest
        for _ in 0..10 {
            step.launch()?;
        }
    } // the graph borrows the buffers until it is dropped

    let acc = acc.to_host(&stream)?;
    println!(
        "{}: 10 replays of a 2-op graph, acc[0] = {} (expected 20)",
        device.label(),
        acc[0]
    );
    Ok(())
}
