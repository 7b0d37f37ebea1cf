//! The `serve` suite (issue 37): the job service on this suite's device, driven over
//! loopback HTTP by `warpdrive-serve`'s load generator (pooled keep-alive connections) in
//! this process.
//!
//! - `submit` (size = rows per job, 1): µs from the request's headers to the job being queued
//!   (the service's own `submit_us`: body, parsing, checks, enqueue), one client (a
//!   one-thread runtime) sending one-row jobs back to back to a service of the `Echo`
//!   stand-in at the qwen3 layer's full width (2048 values a row on either backend: the path
//!   does not touch the model, and the body's size is what it costs); variants `warpdrive`
//!   (JSON bodies) and `warpdrive-binary` (the binary f32 tensor); `extra.p99_us`,
//!   `extra.width`.
//! - `path-256row` (size = rows per job, 256): the same stand-in, one client sending 256-row
//!   jobs back to back: µs per job end to end; variants `warpdrive-json` and
//!   `warpdrive-binary`; the stages as medians in `extra`: `submit_us` (headers to queued:
//!   body, decode, checks), `queue_us`, `run_us` (the model: here a copy), and `rest_us` (the
//!   rest: the client's send, the reply's encoding and transfer, the client's decoding).
//! - `load-1row` (size = concurrent clients, 1 / 8 / 32, each sending one-row jobs back to
//!   back: a closed loop): µs per job as a client sees it; variants `warpdrive-batch-1`
//!   (every job its own batch), `warpdrive-dynamic` (batches close at 256 rows or as soon
//!   as the device is idle), `warpdrive-controller` (the batch sweep at start, then the
//!   controller steering rows from the knee up to the best size found, at most 1024, and
//!   the delay up to 2 ms toward a p99 of 10 ms; `extra.tuned_knee`, `extra.tuned_best`),
//!   `warpdrive-dynamic-2w` (dynamic batching on two batcher threads, each with its own
//!   copy of the layer and its own stream; a job waits up to 2 ms for company while the
//!   other thread runs a batch) and `warpdrive-window` (Triton's rule: a batch closes at
//!   256 rows or when its oldest job has waited 2 ms, idle device or not), and
//!   `warpdrive-dynamic-binary` (`warpdrive-dynamic` with its one-row jobs sent as binary
//!   f32 tensors in this case, the curve and its 80 % point: the JSON body's ~210 µs of
//!   HTTP-side CPU a job gone; it has no `load-256row` rows, which would repeat
//!   `warpdrive-dynamic`'s); `extra.jobs_per_s`, `extra.p99_us`,
//!   `extra.p999_us`, `extra.mean_batch_rows`, `extra.failed`, `extra.busy` (the fraction
//!   of the run the model ran, per batcher thread, from the service's totals), and the knobs at the end
//!   (`extra.batch_rows_knob`, `extra.delay_us_knob`).
//! - `load-256row` (size = concurrent clients, 1 / 8): the same with 256-row jobs (the
//!   device's work dominates), sent as binary f32 tensors (as the Python peer sends them).
//! - `curve-1row` (size = offered jobs/s): open-loop Poisson arrivals of one-row jobs at
//!   20 / 50 / 80 / 100 / 120 % of the variant's own closed-loop throughput at the most
//!   clients (in the variant's own body format); µs per job from the moment it was due; `extra.offered_per_s`,
//!   `extra.load_fraction`, `extra.service_us` (the median run time of the batches its
//!   jobs ran in) and the `load-1row` extras.
//!   Every load row also splits a job's time as the service saw it: `extra.queue_us` and
//!   `extra.queue_p99_us` (arrival in the queue to its batch starting), `extra.run_p99_us`
//!   and `extra.submit_p99_us`; the rest of `p99_us` is the HTTP side and the client.
//! - `p99-at-80pct` (size = offered jobs/s): the target read off each variant's
//!   curve: the p99 latency (µs, as median, p10 and p90) of the curve's 80 % point against
//!   `extra.bound_us` = 3 × its `service_us`; `extra.verdict` is `met` or `missed`. Beside
//!   it `extra.inside_service_p99_us` (each job's submission + queue + run, the part the
//!   batcher controls) and `extra.floor_bound_us` = 3 × `extra.unloaded_us` (the variant's
//!   one-client median: the request path with a batch of one) with `extra.floor_verdict`.
//!
//! Every variant's service runs its model once on the powers of two up to the most rows a
//! batch can hold before any row is timed (`ServeConfig::warm_rows`): on CUDA the first pass
//! down a path compiles its kernels or loads cuBLAS, seconds that no timed job should wait
//! for.
//!
//! The model is the MoE layer of `qwen3-30b-a3b` (seeded weights): its full shape on CUDA,
//! the `tiny` scale (hidden 128) on the CPU backend.

use std::net::SocketAddr;
use std::time::Duration;

use warpdrive::error::{Error, Result};
use warpdrive::moe::MoeConfig;
use warpdrive_serve::load::{self, Arrivals, LoadConfig, LoadReport};
use warpdrive_serve::wire::{Dtype, Format};
use warpdrive_serve::{ControllerConfig, Dispatch, Echo, MoeModel, ServeConfig, Server};

use super::stats::percentile;
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "serve";

const PRESET: &str = "qwen3-30b-a3b";
const WAIT: Duration = Duration::from_secs(30);

struct Plan {
    submits: u64,
    path_jobs: u64,
    load_for: Duration,
    clients: &'static [usize],
    clients_256: &'static [usize],
    curve: &'static [f64],
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                submits: 5000,
                path_jobs: 40,
                load_for: Duration::from_secs(2),
                clients: &[1, 8, 32],
                clients_256: &[1, 8],
                curve: &[0.2, 0.5, 0.8, 1.0, 1.2],
            },
            Scale::Quick => Plan {
                submits: 1000,
                path_jobs: 20,
                load_for: Duration::from_millis(500),
                clients: &[1, 8, 32],
                clients_256: &[1, 8],
                curve: &[0.2, 0.5, 0.8, 1.0],
            },
            Scale::Tiny => Plan {
                submits: 30,
                path_jobs: 3,
                load_for: Duration::from_millis(100),
                clients: &[1, 4],
                clients_256: &[1],
                curve: &[0.8],
            },
        }
    }
}

/// A way of serving the suite compares.
struct Variant {
    name: &'static str,
    max_batch_rows: usize,
    max_delay: Duration,
    controller: Option<ControllerConfig>,
    tune_batch: bool,
    workers: usize,
    dispatch: Dispatch,
    /// How its one-row jobs travel (closed loop, curve and 80 % point alike).
    format: Format,
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "warpdrive-batch-1",
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        controller: None,
        tune_batch: false,
        workers: 1,
        dispatch: Dispatch::WhenIdle,
        format: Format::Json,
    },
    Variant {
        name: "warpdrive-dynamic",
        max_batch_rows: 256,
        max_delay: Duration::from_millis(2),
        controller: None,
        tune_batch: false,
        workers: 1,
        dispatch: Dispatch::WhenIdle,
        format: Format::Json,
    },
    Variant {
        name: "warpdrive-controller",
        max_batch_rows: 256,
        max_delay: Duration::from_millis(2),
        controller: Some(ControllerConfig {
            p99_target: Duration::from_millis(10),
            max_batch_rows: 1024,
            max_delay: Duration::from_millis(2),
        }),
        tune_batch: true,
        workers: 1,
        dispatch: Dispatch::WhenIdle,
        format: Format::Json,
    },
    Variant {
        name: "warpdrive-dynamic-2w",
        max_batch_rows: 256,
        max_delay: Duration::from_millis(2),
        controller: None,
        tune_batch: false,
        workers: 2,
        dispatch: Dispatch::WhenIdle,
        format: Format::Json,
    },
    Variant {
        name: "warpdrive-window",
        max_batch_rows: 256,
        max_delay: Duration::from_millis(2),
        controller: None,
        tune_batch: false,
        workers: 1,
        dispatch: Dispatch::Window,
        format: Format::Json,
    },
    // `warpdrive-dynamic` with its one-row jobs as binary f32 tensors: the JSON job's ~210 µs
    // of HTTP-side CPU gone (f32: one copy each way, the reply read in place; bf16 would
    // convert every value and round the job's inputs), so its curve shows the batching
    // rule's tail apart from the host's JSON saturation.
    Variant {
        name: ONE_ROW_BINARY_VARIANT,
        max_batch_rows: 256,
        max_delay: Duration::from_millis(2),
        controller: None,
        tune_batch: false,
        workers: 1,
        dispatch: Dispatch::WhenIdle,
        format: ONE_ROW_BINARY,
    },
];

/// The variant whose one-row jobs are binary (the peer's are JSON: the peer comparison
/// leaves it out), and how they travel.
pub(crate) const ONE_ROW_BINARY_VARIANT: &str = "warpdrive-dynamic-binary";
const ONE_ROW_BINARY: Format = Format::Binary(Dtype::F32);

/// How often the service steps its controller and publishes its status here.
const INTERVAL: Duration = Duration::from_millis(50);

/// The rows of the 256-row jobs.
const BIG_ROWS: usize = 256;

/// How 256-row jobs travel (the Python peer sends them so too).
const BIG_FORMAT: Format = Format::Binary(Dtype::F32);

/// The batch sizes `v`'s service warms up: the powers of two up to the most rows a batch
/// can hold, and that most. They take every path of the layer (the one-row kernel, the
/// graph sizes up to 256, cuBLAS above), so each kernel compiles and each library loads
/// before timing; not every size, because the layer keeps 32 graphs (least recently used
/// first), so warming all 256 graph sizes would leave only the last 32 captured.
fn warm_rows(v: &Variant) -> Vec<usize> {
    let most = v
        .controller
        .map_or(v.max_batch_rows, |c| c.max_batch_rows.max(v.max_batch_rows))
        .max(BIG_ROWS);
    let mut rows: Vec<usize> = std::iter::successors(Some(1usize), |r| r.checked_mul(2))
        .take_while(|&r| r <= most)
        .collect();
    rows.push(most);
    rows.sort_unstable();
    rows.dedup();
    rows
}

fn start(ctx: &Ctx, v: &Variant) -> Result<Server> {
    let scale = if ctx.device().is_cuda() {
        Scale::Full
    } else {
        Scale::Tiny
    };
    let (config, weights, _) = super::moe::case_at(PRESET, 1, scale)?;
    let device = ctx.device().clone();
    Server::start_workers(
        move || {
            Ok(Box::new(MoeModel::new(
                PRESET,
                &device,
                config,
                weights.clone(),
            )?))
        },
        ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_batch_rows: v.max_batch_rows,
            max_delay: v.max_delay,
            dispatch: v.dispatch,
            controller: v.controller,
            tune_batch: v.tune_batch,
            workers: v.workers,
            interval: INTERVAL,
            warm_rows: warm_rows(v),
            ..ServeConfig::default()
        },
    )
}

/// Runs `config`; a run with a failed job is an error (the suite measures a service that
/// answers everything).
fn offer(config: &LoadConfig) -> Result<LoadReport> {
    let r = load::run(config).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    if r.answered() == 0 || r.failed() > 0 {
        return Err(Error::InvalidArgument(format!(
            "serve: {} of {} jobs failed ({:?}): {}",
            r.failed(),
            r.sent,
            r.failures,
            r.first_failure.as_deref().unwrap_or("none answered")
        )));
    }
    Ok(r)
}

fn closed(addr: SocketAddr, clients: usize, rows: usize, time: Duration) -> LoadConfig {
    LoadConfig {
        rows,
        timeout: WAIT,
        ..LoadConfig::new(addr, Arrivals::Clients(clients), time)
    }
}

/// `config` offered to `server`, and the fraction of the run the model ran (from the
/// service's busy total, once every answered job's batch is in it).
fn offer_busy(server: &Server, config: &LoadConfig) -> Result<(LoadReport, f64)> {
    let (busy0, answered0) = (server.busy_seconds_total(), server.jobs_answered());
    let r = offer(config)?;
    let t0 = std::time::Instant::now();
    while server.jobs_answered() < answered0 + r.answered() && t0.elapsed() < WAIT {
        std::thread::yield_now();
    }
    let workers = server.status().workers.max(1) as f64;
    let busy = (server.busy_seconds_total() - busy0) / (r.elapsed.as_secs_f64() * workers);
    Ok((r, busy.clamp(0.0, 1.0)))
}

/// Records `r` as a row of `case` at `size` with the load extras.
fn record(
    ctx: &mut Ctx,
    case: &str,
    size: u64,
    variant: &str,
    (r, busy, server): (&LoadReport, f64, &Server),
) -> Result<()> {
    let mut us = r.latency_us.clone();
    let (p99, p999) = (percentile(&us, 0.99), percentile(&us, 0.999));
    let row = ctx.record_time(case, size, variant, &mut us, None)?;
    let service = percentile(&r.run_us, 0.5);
    for (k, v) in [
        ("service_us", service),
        ("run_p99_us", percentile(&r.run_us, 0.99)),
        ("queue_us", percentile(&r.queue_us, 0.5)),
        ("queue_p99_us", percentile(&r.queue_us, 0.99)),
        ("submit_p99_us", percentile(&r.submit_us, 0.99)),
        ("jobs_per_s", r.jobs_per_s()),
        ("p99_us", p99),
        ("p999_us", p999),
        ("mean_batch_rows", r.mean_batch_rows()),
        ("failed", r.failed() as f64),
        ("busy", busy),
        ("batch_rows_knob", server.status().batch_rows as f64),
        ("delay_us_knob", server.status().delay_us),
    ] {
        row.extra.insert(k.into(), v.into());
    }
    let status = server.status();
    for (k, v) in [
        ("tuned_knee", status.tuned_knee),
        ("tuned_best", status.tuned_best),
    ] {
        if let Some(v) = v {
            row.extra.insert(k.into(), (v as f64).into());
        }
    }
    if let Some(o) = r.offered_per_s {
        row.extra.insert("offered_per_s".into(), o.into());
    }
    Ok(())
}

/// The `submit` and `path-256row` rows: a service of the [`Echo`] stand-in at the
/// preset's full width, JSON against the binary tensor body.
fn request_path(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    let width = MoeConfig::preset(PRESET)?.hidden;
    let server = Server::start(
        move || Ok(Box::new(Echo::new(width))),
        ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_batch_rows: BIG_ROWS,
            max_delay: Duration::ZERO,
            interval: INTERVAL,
            ..ServeConfig::default()
        },
    )?;
    let addr = server.addr;
    for (variant, format) in [
        ("warpdrive", Format::Json),
        ("warpdrive-binary", BIG_FORMAT),
    ] {
        let one = LoadConfig {
            format,
            threads: 1,
            ..closed(addr, 1, 1, WAIT)
        };
        offer(&LoadConfig {
            max_jobs: Some(20),
            ..one.clone()
        })?;
        let r = offer(&LoadConfig {
            max_jobs: Some(plan.submits),
            ..one
        })?;
        let mut us = r.submit_us.clone();
        let tail = percentile(&us, 0.99);
        let row = ctx.record_time("submit", 1, variant, &mut us, None)?;
        row.extra.insert("p99_us".into(), tail.into());
        row.extra.insert("width".into(), (width as f64).into());
    }
    for (variant, format) in [
        ("warpdrive-json", Format::Json),
        ("warpdrive-binary", BIG_FORMAT),
    ] {
        let big = LoadConfig {
            format,
            threads: 1,
            ..closed(addr, 1, BIG_ROWS, WAIT)
        };
        offer(&LoadConfig {
            max_jobs: Some(3),
            ..big.clone()
        })?;
        let r = offer(&LoadConfig {
            max_jobs: Some(plan.path_jobs),
            ..big
        })?;
        let mut us = r.latency_us.clone();
        let stage = |v: &[f64]| percentile(v, 0.5);
        let (submit, queue, run) = (stage(&r.submit_us), stage(&r.queue_us), stage(&r.run_us));
        let row = ctx.record_time("path-256row", BIG_ROWS as u64, variant, &mut us, None)?;
        let rest = row.median - submit - queue - run;
        for (k, v) in [
            ("submit_us", submit),
            ("queue_us", queue),
            ("run_us", run),
            ("rest_us", rest),
            ("width", width as f64),
        ] {
            row.extra.insert(k.into(), v.into());
        }
    }
    server.stop();
    Ok(())
}

/// The target read off a variant's curve (the run at 80 % of its maximum): the
/// p99 latency against 3 × the batch service time at that load. Beside it, what the bound
/// leaves out: the p99 of each job's time inside the service (submission + queue + run), and
/// the same p99 against 3 × `unloaded_us`, the variant's one-client median (the request
/// path with a batch of one: a floor no load can go below).
fn p99_at_80pct(
    ctx: &mut Ctx,
    variant: &str,
    (rate, unloaded_us): (f64, f64),
    r: &LoadReport,
) -> Result<()> {
    let p99 = percentile(&r.latency_us, 0.99);
    let bound = 3.0 * percentile(&r.run_us, 0.5);
    let inside: Vec<f64> = r
        .submit_us
        .iter()
        .zip(&r.queue_us)
        .zip(&r.run_us)
        .map(|((s, q), x)| s + q + x)
        .collect();
    let floor_bound = 3.0 * unloaded_us;
    let mut tail = [p99];
    let row = ctx.record_time(
        "p99-at-80pct",
        rate.round() as u64,
        variant,
        &mut tail,
        None,
    )?;
    let verdict = if p99 <= bound { "met" } else { "missed" };
    for (k, v) in [
        ("bound_us", bound.into()),
        ("service_us", percentile(&r.run_us, 0.5).into()),
        ("queue_p99_us", percentile(&r.queue_us, 0.99).into()),
        ("offered_per_s", rate.into()),
        ("jobs_per_s", r.jobs_per_s().into()),
        ("verdict", verdict.into()),
        ("inside_service_p99_us", percentile(&inside, 0.99).into()),
        ("unloaded_us", unloaded_us.into()),
        ("floor_bound_us", floor_bound.into()),
        (
            "floor_verdict",
            if p99 <= floor_bound { "met" } else { "missed" }.into(),
        ),
    ] {
        row.extra.insert(k.into(), v);
    }
    Ok(())
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    ctx.step(format!("{SUITE}: the request path"));
    request_path(ctx, &plan)?;
    for v in VARIANTS {
        ctx.step(format!("{SUITE}: {}", v.name));
        let server = start(ctx, v)?;
        let addr = server.addr;
        let mut most = 0.0f64;
        let mut unloaded = f64::NAN;
        for &clients in plan.clients {
            let one = LoadConfig {
                format: v.format,
                ..closed(addr, clients, 1, plan.load_for)
            };
            let (r, busy) = offer_busy(&server, &one)?;
            most = most.max(r.jobs_per_s());
            if clients == 1 {
                unloaded = percentile(&r.latency_us, 0.5);
            }
            record(
                ctx,
                "load-1row",
                clients as u64,
                v.name,
                (&r, busy, &server),
            )?;
        }
        // The binary variant's 256-row rows would repeat `warpdrive-dynamic`'s: those jobs
        // travel as binary f32 tensors for every variant.
        let clients_256 = if v.format == Format::Json {
            plan.clients_256
        } else {
            &[]
        };
        for &clients in clients_256 {
            let big = LoadConfig {
                format: BIG_FORMAT,
                ..closed(addr, clients, BIG_ROWS, plan.load_for)
            };
            let (r, busy) = offer_busy(&server, &big)?;
            record(
                ctx,
                "load-256row",
                clients as u64,
                v.name,
                (&r, busy, &server),
            )?;
        }
        for &fraction in plan.curve {
            let rate = most * fraction;
            let (r, busy) = offer_busy(
                &server,
                &LoadConfig {
                    timeout: WAIT,
                    format: v.format,
                    ..LoadConfig::new(addr, Arrivals::Poisson { per_s: rate }, plan.load_for)
                },
            )?;
            record(
                ctx,
                "curve-1row",
                rate.round() as u64,
                v.name,
                (&r, busy, &server),
            )?;
            if let Some(row) = ctx.rows_mut_last() {
                row.extra.insert("load_fraction".into(), fraction.into());
            }
            if fraction == 0.8 {
                p99_at_80pct(ctx, v.name, (rate, unloaded), &r)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Python peer's own check of its service, batching and clients (no torch needed),
    /// where python3 is installed.
    #[test]
    fn the_python_peer_passes_its_self_test() {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers/serve.py");
        let out = match std::process::Command::new("python3")
            .arg(&script)
            .arg("--self-test")
            .output()
        {
            Ok(o) => o,
            Err(e) => {
                eprintln!("no python3 ({e}): the peer's self-test is skipped");
                return;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(" 0 failed"),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn tiny_run_on_the_cpu_records_every_case() {
        let mut ctx = Ctx::new(&warpdrive::Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        for variant in ["warpdrive", "warpdrive-binary"] {
            assert!(rows
                .iter()
                .any(|r| r.case == "submit" && r.variant == variant));
        }
        for variant in ["warpdrive-json", "warpdrive-binary"] {
            assert!(rows.iter().any(|r| r.case == "path-256row"
                && r.variant == variant
                && r.extra.contains_key("rest_us")));
        }
        for variant in [
            "warpdrive-batch-1",
            "warpdrive-dynamic",
            "warpdrive-controller",
            "warpdrive-dynamic-2w",
            "warpdrive-window",
            "warpdrive-dynamic-binary",
        ] {
            assert!(rows
                .iter()
                .any(|r| r.case == "load-1row" && r.variant == variant && r.size == 4));
            assert!(rows
                .iter()
                .any(|r| r.case == "curve-1row" && r.variant == variant));
            assert!(rows.iter().any(|r| r.case == "p99-at-80pct"
                && r.variant == variant
                && r.extra.contains_key("bound_us")
                && matches!(r.extra["verdict"].as_str(), Some("met" | "missed"))));
            // The 80 % point is 80 % of the variant's own closed-loop maximum.
            let most = rows
                .iter()
                .filter(|r| r.case == "load-1row" && r.variant == variant)
                .filter_map(|r| r.extra["jobs_per_s"].as_f64())
                .fold(0.0, f64::max);
            assert!(rows.iter().any(|r| r.case == "p99-at-80pct"
                && r.variant == variant
                && r.size == (0.8 * most).round() as u64));
        }
        // The binary variant leaves the 256-row case to the others (the same jobs).
        assert!(!rows
            .iter()
            .any(|r| r.case == "load-256row" && r.variant == "warpdrive-dynamic-binary"));
        assert!(rows.iter().any(|r| r.case == "load-256row"));
    }
}
