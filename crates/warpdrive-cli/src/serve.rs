//! `warpdrive serve`: the job service (`warpdrive-serve`) on a model of seeded weights.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use warpdrive_bench::moe::case_at;
use warpdrive_serve::{MoeModel, ServeConfig, Server};

use crate::flags::{scale_named, ServeArgs};

pub(crate) fn serve(args: &ServeArgs) -> Result<()> {
    let Some(preset) = args.model.strip_prefix("moe:") else {
        bail!("--model {}: expected moe:PRESET", args.model);
    };
    if let Some(s) = args.seconds {
        if !(s.is_finite() && s > 0.0) {
            bail!("--seconds {s}: expected more than 0");
        }
    }
    let device = args.device.open()?;
    let (config, weights, _) = case_at(preset, 1, scale_named(&args.scale))
        .with_context(|| format!("--model {}", args.model))?;
    let name = args.model.clone();
    let serve_config = ServeConfig {
        addr: args.addr,
        max_batch_rows: args.max_batch_rows as usize,
        max_delay: Duration::from_millis(args.max_delay_ms),
        ..ServeConfig::default()
    };
    let d = device.clone();
    let server = Server::start(
        move || Ok(Box::new(MoeModel::new(&name, &d, config, weights)?)),
        serve_config,
    )
    .context("starting the service")?;
    println!(
        "serving {} ({} wide rows) on http://{} with {}: POST /v1/jobs {{\"rows\": R, \"data\": [...]}}, GET /health",
        args.model,
        config.hidden,
        server.addr,
        device.label()
    );
    match args.seconds {
        Some(s) => std::thread::sleep(Duration::from_secs_f64(s)),
        None => loop {
            std::thread::park();
        },
    }
    drop(server);
    println!("stopped");
    Ok(())
}
