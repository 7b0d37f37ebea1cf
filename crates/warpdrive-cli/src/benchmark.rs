//! `warpdrive bench`: the suites, their peers, the table, and what ran where.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use warpdrive::telemetry;
use warpdrive_bench as bench;

use crate::flags::{DeviceOpt, ScaleOpt};
use crate::results_file::{absolute, check_output, save_results};

/// `bench`, recording a trace (and sampling NVML when it is there) with `--trace`. The
/// suites, the output paths and the replay trace are checked before anything runs.
pub(crate) fn bench_traced(
    names: &[String],
    device: (&DeviceOpt, &ScaleOpt),
    path: &Path,
    options: &bench::Options,
    trace: Option<&Path>,
) -> Result<()> {
    let suites = bench::select_suites(names)?;
    if let Some(replay) = &options.memory_trace {
        if !suites.iter().any(|s| s.name == "memory") {
            bail!(
                "--replay {} is for the memory suite, which is not selected",
                replay.display()
            );
        }
        options
            .check()
            .with_context(|| format!("--replay {}", replay.display()))?;
    }
    check_output(path)?;
    if let Some(trace_path) = trace {
        check_output(trace_path)?;
    }
    let Some(trace_path) = trace else {
        return bench_cmd(&suites, device, path, options);
    };
    telemetry::start_trace();
    let sampler = match telemetry::Sampler::start(0, std::time::Duration::from_millis(100)) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("note: {e}");
            None
        }
    };
    let ran = bench_cmd(&suites, device, path, options);
    drop(sampler);
    let recorded = telemetry::finish_trace();
    recorded
        .write(trace_path)
        .with_context(|| format!("writing {}", trace_path.display()))?;
    println!(
        "trace written to {} ({} slices)",
        absolute(trace_path).display(),
        recorded.slices()
    );
    ran
}

pub(crate) fn bench_cmd(
    suites: &[&'static bench::Suite],
    (device, scale): (&DeviceOpt, &ScaleOpt),
    path: &Path,
    options: &bench::Options,
) -> Result<()> {
    let started = Instant::now();
    let device = device.open()?;
    let scale = scale.on(&device);
    println!(
        "benchmarking on {} ({} sizes)",
        device.label(),
        scale.name()
    );
    if scale.quick() {
        println!(
            "note: {} sizes are smaller than a full GPU run's; MoE cases named PRESET/N have \
             the preset's hidden and intermediate sizes divided by N",
            scale.name()
        );
    }
    let bench::Outcome {
        mut results,
        ran,
        failed,
        peer_env,
    } = bench::run_suites_with(&device, suites, scale, options)?;
    let peer_rows = bench::run_peers(&ran, &device, &peer_env);
    if !peer_rows.is_empty() {
        println!(
            "{} peer row(s) from {}",
            peer_rows.len(),
            bench::peers_dir().display()
        );
    }
    results.add_rows(peer_rows);
    // Comparisons that need the peers' rows (the serve suite's throughput at equal p99).
    let versus = bench::versus_peer(&results.rows);
    results.add_rows(versus);
    println!();
    bench::print_table(&results);
    println!();
    let saved = save_results(&results, &failed, path);
    // What ran, how long it took and where the results are: the last lines of a run.
    println!(
        "ran {} in {:.1} s",
        ran.join(", "),
        started.elapsed().as_secs_f64()
    );
    println!("results written to {}", saved?.display());
    Ok(())
}

pub(crate) fn list_suites() {
    let width = bench::suites()
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0);
    for s in bench::suites() {
        println!("{:<width$}  {}", s.name, s.about);
    }
}
