//! Spans and a Chrome trace: name the phases of your work, then open the file in
//! `chrome://tracing` or <https://ui.perfetto.dev> (host threads and each stream's GPU time).
//!
//! `cargo run -p warpdrive --example trace [-- OUT.json]` (default: a file in the temp dir)

use warpdrive::ops::{self, ReduceOp, Scratch};
use warpdrive::{telemetry, Buffer, Device};

fn main() -> warpdrive::Result<()> {
    let out = std::env::args()
        .nth(1)
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("warpdrive-example-trace.json"));
    let device = Device::best()?;
    let stream = device.new_stream()?;
    // Spans are off by default (one branch each); a trace turns them on.
    telemetry::start_trace();
    for step in 0..3 {
        let _step = telemetry::span("example.step", &stream); // closes when dropped
        let x = {
            let _s = telemetry::span("example.upload", &stream);
            Buffer::from_host(&stream, &vec![step as f32; 1 << 18])?
        };
        let mut total = Buffer::<f32>::zeros(&stream, 1)?;
        let scratch = Scratch::new(&stream, ops::REDUCE_SCRATCH_BYTES)?;
        {
            let _s = telemetry::span("example.sum", &stream);
            ops::reduce_into(&stream, ReduceOp::Sum, &x, &mut total, &scratch)?;
        }
        println!("step {step}: sum = {}", total.to_host(&stream)?[0]);
    }
    let trace = telemetry::finish_trace();
    trace.write(&out)?;
    println!(
        "{}: {} slices written to {}",
        device.label(),
        trace.slices(),
        out.display()
    );
    Ok(())
}
