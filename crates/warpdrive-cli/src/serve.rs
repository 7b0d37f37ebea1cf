//! `warpdrive serve`: the job service (`warpdrive-serve`) on a model of seeded weights.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use warpdrive_bench::moe::case_at;
use warpdrive_serve::{Budget, ControllerConfig, Dispatch, MoeModel, ServeConfig, Server};

use crate::flags::{scale_named, ServeArgs};

pub(crate) fn serve(args: &ServeArgs) -> Result<()> {
    let Some(preset) = args.model.strip_prefix("moe:") else {
        bail!("--model {}: expected moe:PRESET", args.model);
    };
    let positive = |name: &str, v: f64| -> Result<()> {
        if !(v.is_finite() && v > 0.0 && v < 1e9) {
            bail!("{name} {v}: expected more than 0");
        }
        Ok(())
    };
    if let Some(s) = args.seconds {
        positive("--seconds", s)?;
    }
    if let Some(t) = args.p99_target_ms {
        positive("--p99-target-ms", t)?;
    }
    if let Some(r) = args.tenant_rate {
        positive("--tenant-rate", r)?;
    }
    positive("--tenant-burst", args.tenant_burst)?;
    if args.max_delay_ms > 60_000 {
        bail!("--max-delay-ms {}: at most 60000", args.max_delay_ms);
    }
    let device = args.device.open()?;
    let (config, weights, _) = case_at(preset, 1, scale_named(&args.scale))
        .with_context(|| format!("--model {}", args.model))?;
    let name = args.model.clone();
    let max_delay = Duration::from_millis(args.max_delay_ms);
    let serve_config = ServeConfig {
        addr: args.addr,
        max_batch_rows: args.max_batch_rows as usize,
        max_delay,
        dispatch: if args.window {
            Dispatch::Window
        } else {
            Dispatch::WhenIdle
        },
        controller: args.p99_target_ms.map(|t| ControllerConfig {
            p99_target: Duration::from_secs_f64(t / 1e3),
            max_batch_rows: args.controller_max_rows as usize,
            max_delay,
        }),
        tune_batch: args.tune_batch,
        workers: args.workers as usize,
        queue_jobs: args.queue_jobs as usize,
        max_connections: args.max_connections as usize,
        budget: Budget {
            jobs_in_flight: args.tenant_jobs as usize,
            bytes_in_flight: (args.tenant_mib as usize).saturating_mul(1 << 20),
            rate_per_s: args.tenant_rate.unwrap_or(f64::INFINITY),
            burst: args.tenant_burst,
            device_bytes: args
                .tenant_device_mib
                .map_or(usize::MAX, |m| (m as usize).saturating_mul(1 << 20)),
        },
        warm_rows: warm_rows(args.warm_rows.unwrap_or_else(|| {
            let controlled = args.p99_target_ms.map_or(0, |_| args.controller_max_rows);
            args.max_batch_rows.max(controlled)
        }) as usize),
        http_threads: args
            .http_threads
            .map_or_else(|| ServeConfig::default().http_threads, |n| n as usize),
        http_event_interval: args
            .http_event_interval
            .unwrap_or(warpdrive_serve::DEFAULT_EVENT_INTERVAL),
        ..ServeConfig::default()
    };
    let d = device.clone();
    let server = Server::start_workers(
        move || Ok(Box::new(MoeModel::new(&name, &d, config, weights.clone())?)),
        serve_config,
    )
    .context("starting the service")?;
    println!(
        "serving {} ({} wide rows) on http://{} with {}: POST /v1/jobs {{\"rows\": R, \"data\": [...]}}; dashboard at http://{}/",
        args.model,
        config.hidden,
        server.addr,
        device.label(),
        server.addr,
    );
    server.run_until_stopped(args.seconds.map(Duration::from_secs_f64));
    println!("stopped");
    Ok(())
}

/// The powers of two up to `most`, and `most` (none for 0): each path of the layer once,
/// within the 32 graphs a layer keeps.
fn warm_rows(most: usize) -> Vec<usize> {
    let mut rows: Vec<usize> = std::iter::successors(Some(1usize), |r| r.checked_mul(2))
        .take_while(|&r| r <= most)
        .collect();
    if most > 0 && rows.last() != Some(&most) {
        rows.push(most);
    }
    rows
}
