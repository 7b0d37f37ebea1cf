//! The job service with the [`Echo`] stand-in (each row answered with itself, no model in
//! the way) at the qwen3 layer's width, until Ctrl-C / SIGTERM: a service that costs next
//! to nothing a job, so `warpdrive load` against it measures the generator itself (its
//! stalls, its tails) at rates a model on the CPU backend cannot reach:
//! `cargo run --release -p warpdrive-serve --example echo_serve [ADDR [WIDTH [SECONDS]]]`.

use std::time::Duration;

use warpdrive_serve::{Echo, ServeConfig, Server};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:8080".into());
    let width: usize = args.next().map(|w| w.parse()).transpose()?.unwrap_or(2048);
    let seconds: Option<f64> = args.next().map(|s| s.parse()).transpose()?;
    let server = Server::start(
        move || Ok(Box::new(Echo::new(width))),
        ServeConfig {
            addr: addr.parse()?,
            max_delay: Duration::ZERO,
            ..ServeConfig::default()
        },
    )?;
    println!("serving echo ({width} wide rows) on http://{}", server.addr);
    server.run_until_stopped(
        seconds
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64),
    );
    Ok(())
}
