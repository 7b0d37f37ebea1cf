//! `warpdrive`: the command line of the warpdrive runtime.
//!
//! - `warpdrive doctor`: lists the devices and measures the machine's ceilings.
//! - `warpdrive bench [SUITES...]`: runs benchmark suites (and their peers) and writes a
//!   results file (`BENCH.md`); `--trace out.json` records a Chrome trace of the run.
//! - `warpdrive report RESULTS.json [-o DIR]`: the table, SVG charts and one HTML page.
//! - `warpdrive moe --preset NAME --tokens N [--weights PATH --layer N]`: one MoE layer
//!   forward pass with per-stage timing, on seeded weights or one layer of a checkpoint.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use warpdrive::moe::WeightsFile;
use warpdrive::{telemetry, Device, DeviceInfo};
use warpdrive_bench::{self as bench, Results, Scale};

/// The results file `bench` writes when `--json` is not given.
const DEFAULT_RESULTS: &str = "warpdrive-results.json";

/// warpdrive: GPU performance runtime. `doctor` checks the machine, `bench` benchmarks
/// it, `report` renders a results file, `moe` runs one MoE layer.
#[derive(Debug, Parser)]
#[command(name = "warpdrive", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the devices (identity, memory, PCIe, NUMA, library versions) and measure the
    /// machine's ceilings on the chosen one.
    Doctor {
        #[command(flatten)]
        device: DeviceOpt,
        #[command(flatten)]
        scale: ScaleOpt,
        #[command(flatten)]
        output: OutputOpt,
    },
    /// Run benchmark suites (all when none is named), after measuring the ceilings, with
    /// their PyTorch/CuPy peers when available; print a table and write a results file.
    Bench {
        /// Suites to run (see `--list`); every registered suite when none is given.
        #[arg(value_name = "SUITE")]
        suites: Vec<String>,
        /// List the registered suites and exit.
        #[arg(long)]
        list: bool,
        /// Allocation trace for the `memory` suite to replay (the JSON form its peer reads,
        /// see bench/peers/README.md) instead of its generated one.
        #[arg(long, value_name = "TRACE.json")]
        replay: Option<PathBuf>,
        /// Record spans, kernel launches, copies and NVML counters of the run as a Chrome
        /// trace (opens in Perfetto) at this path.
        #[arg(long, value_name = "OUT.json")]
        trace: Option<PathBuf>,
        #[command(flatten)]
        device: DeviceOpt,
        #[command(flatten)]
        scale: ScaleOpt,
        #[command(flatten)]
        output: OutputOpt,
    },
    /// Render a results file: the table on stdout, SVG charts and one self-contained HTML
    /// page (`DIR/report.html`).
    Report {
        /// A `warpdrive-bench/1` results file.
        #[arg(value_name = "RESULTS.json")]
        results: PathBuf,
        /// Output folder (default `warpdrive-report`).
        #[arg(short = 'o', long = "out", value_name = "DIR")]
        out: Option<PathBuf>,
    },
    /// Run one MoE layer forward pass (bf16; the `moe` bench suite's seeded weights, or one
    /// layer of a checkpoint with `--weights`, and N(0,1) input for that preset and token
    /// count) and print the time of each stage of one staged pass and their sum, then the
    /// time per pass of `--reps` passes as `forward` runs them.
    Moe {
        /// Layer shape: mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-slice or gpt-oss-120b.
        #[arg(long, value_name = "NAME")]
        preset: String,
        /// Tokens in the batch (at least 1; more than the host or device can hold is an
        /// error).
        #[arg(long, value_name = "N", default_value_t = 1)]
        tokens: usize,
        /// Implementation on CUDA: auto, device or cublas.
        #[arg(long, value_name = "PATH", default_value = "auto")]
        path: String,
        /// Back-to-back passes the whole-pass time averages over (many show how the pass
        /// holds up under sustained load).
        #[arg(long, value_name = "N", default_value_t = 20,
              value_parser = clap::value_parser!(u32).range(1..))]
        reps: u32,
        /// Keep every GEMM tile on the mma.sync kernels (what GPUs before Hopper run) instead
        /// of Hopper's warpgroup MMA.
        #[arg(long)]
        no_wgmma: bool,
        /// Run a one-token pass on the router, GEMM and combine kernels of larger batches
        /// instead of the one-kernel decode.
        #[arg(long)]
        no_decode_kernel: bool,
        /// Layer size: `full` (the preset's shape, the default), `quick` or `tiny` (hidden
        /// and intermediate divided by 8 or 16, as the `moe` bench suite runs on the CPU; the
        /// output names the layer PRESET/8 or PRESET/16).
        #[arg(long, value_name = "SCALE", default_value = "full",
              value_parser = ["full", "quick", "tiny"])]
        scale: String,
        #[command(flatten)]
        weights: WeightsOpt,
        #[command(flatten)]
        device: DeviceOpt,
    },
}

/// Where the MoE layer's weights come from.
#[derive(Debug, Args)]
struct WeightsOpt {
    /// Read the layer's weights from a safetensors checkpoint (a file, a sharded checkpoint's
    /// model.safetensors.index.json, or the folder holding it) instead of seeded random ones;
    /// the preset still gives the shape, which the tensors must match.
    #[arg(long, value_name = "PATH")]
    weights: Option<PathBuf>,
    /// The MoE block to read, by the prefix of its tensor names (e.g. model.layers.3.mlp.);
    /// needed when the checkpoint holds several.
    #[arg(
        long,
        value_name = "PREFIX",
        requires = "weights",
        conflicts_with = "layer"
    )]
    prefix: Option<String>,
    /// The MoE block to read, by layer index (the block whose prefix has N as one part).
    #[arg(long, value_name = "N", requires = "weights")]
    layer: Option<usize>,
    /// Refuse weights that hold NaN or infinity (by default each such tensor is a warning).
    #[arg(long, requires = "weights")]
    strict: bool,
}

impl WeightsOpt {
    /// The checkpoint to read, when `--weights` names one.
    fn file(&self) -> Option<WeightsFile> {
        let mut file = WeightsFile::new(self.weights.as_ref()?).strict(self.strict);
        if let Some(prefix) = &self.prefix {
            file = file.prefix(prefix.as_str());
        }
        if let Some(layer) = self.layer {
            file = file.layer(layer);
        }
        Some(file)
    }
}

/// Which device to run on.
#[derive(Debug, Args)]
struct DeviceOpt {
    /// Device to use: `cpu`, `cuda` or `cuda:N` (default: `WARPDRIVE_DEVICE`, else CUDA
    /// device 0 when present, else the CPU).
    #[arg(long, value_name = "SPEC")]
    device: Option<String>,
}

impl DeviceOpt {
    fn open(&self) -> Result<Device> {
        match &self.device {
            // The library's message names WARPDRIVE_DEVICE, which this value did not come from.
            Some(spec) => Device::from_spec(spec).map_err(|e| match e {
                warpdrive::Error::BadDeviceSpec { .. } => anyhow::anyhow!(
                    "--device {spec:?} is not a device: expected `cpu`, `cuda` or `cuda:N`"
                ),
                e => anyhow::Error::new(e).context(format!("opening --device {spec}")),
            }),
            None => Device::best().context("choosing a device"),
        }
    }
}

/// How large the benchmark inputs are.
#[derive(Debug, Args)]
struct ScaleOpt {
    /// Input sizes: `full` (the sizes BENCH.md names; the default on CUDA), `quick` (smaller;
    /// the default on the CPU) or `tiny` (just enough to run every case once: a smoke test).
    #[arg(long, value_name = "SCALE", value_parser = ["full", "quick", "tiny"])]
    scale: Option<String>,
}

impl ScaleOpt {
    /// The scale asked for, else the device's default.
    fn on(&self, device: &Device) -> Scale {
        match self.scale.as_deref() {
            Some(name) => scale_named(name),
            None => Scale::for_device(device),
        }
    }
}

/// The scale clap accepted by name (`full`, `quick` or `tiny`).
fn scale_named(name: &str) -> Scale {
    match name {
        "quick" => Scale::Quick,
        "tiny" => Scale::Tiny,
        _ => Scale::Full,
    }
}

/// Where to write the results file.
#[derive(Debug, Args)]
struct OutputOpt {
    /// Write a results file (`warpdrive-bench/1` JSON) here; `bench` writes
    /// `warpdrive-results.json` when this is not given.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    init_logging();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, `what: why: ...`, leaving out a cause whose text
/// the line already holds (library errors repeat their source's message), and no backtrace.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Doctor {
            device,
            scale,
            output,
        } => doctor(&device, &scale, output.json.as_deref()),
        Command::Bench {
            suites,
            list,
            replay,
            trace,
            device,
            scale,
            output,
        } => {
            if list {
                list_suites();
                return Ok(());
            }
            let path = output
                .json
                .unwrap_or_else(|| PathBuf::from(DEFAULT_RESULTS));
            let options = bench::Options {
                memory_trace: replay,
            };
            bench_traced(
                &suites,
                (&device, &scale),
                &path,
                &options,
                trace.as_deref(),
            )
        }
        Command::Report { results, out } => report(&results, out.as_deref()),
        Command::Moe {
            preset,
            tokens,
            path,
            reps,
            no_wgmma,
            no_decode_kernel,
            scale,
            weights,
            device,
        } => moe(
            (&preset, scale_named(&scale)),
            tokens,
            &path,
            reps,
            (!no_wgmma, !no_decode_kernel),
            weights.file(),
            &device,
        ),
    }
}

fn moe(
    (preset, scale): (&str, Scale),
    tokens: usize,
    path: &str,
    reps: u32,
    (wgmma, decode): (bool, bool),
    file: Option<WeightsFile>,
    device: &DeviceOpt,
) -> Result<()> {
    use warpdrive::moe::{MoeLayer, MoePath, MoeWeights};
    let path = match path {
        "auto" => MoePath::Auto,
        "device" => MoePath::Device,
        "cublas" => MoePath::Cublas,
        other => bail!("--path {other}: expected auto, device or cublas"),
    };
    // No tokens is no pass to time: refused rather than an empty profile.
    if tokens == 0 {
        bail!("--tokens 0: a pass needs at least one token");
    }
    let progress = bench::Progress::lines();
    let (config, mut weights, x) = bench::moe::case_at(preset, tokens, scale)?;
    let layer_name = bench::moe::case_name(preset, scale);
    let source = match file {
        Some(file) => {
            let source = file.path().display().to_string();
            weights = MoeWeights::File(file);
            source
        }
        None => "seeded weights".into(),
    };
    let device = device.open()?;
    let stream = device.new_stream()?;
    progress.step(format!(
        "loading the {layer_name} layer on {} ({source})",
        device.label()
    ));
    let mut layer = MoeLayer::<half::bf16>::new(&stream, config, weights)
        .with_context(|| format!("loading the {layer_name} layer from {source}"))?;
    layer.set_path(path);
    layer.set_warpgroup_mma(wgmma);
    layer.set_decode_kernel(decode);
    let x = warpdrive::Buffer::from_host(&stream, &x)?;
    let mut y = warpdrive::Buffer::<half::bf16>::uninit(&stream, x.len())?;
    progress.step("warm-up pass (kernel loads)".into());
    layer.profile(&x, &mut y)?;
    progress.step("one pass timed stage by stage".into());
    let stages = layer.profile(&x, &mut y)?;
    progress.step(format!("{reps} passes as forward runs them"));
    layer.forward_into(&x, &mut y)?;
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        layer.forward_into(&x, &mut y)?;
    }
    stream.synchronize()?;
    let per_pass = t.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
    let stats = layer.last_stats();
    println!(
        "{layer_name} (hidden {}, intermediate {}), {tokens} tokens on {} ({source}, {path:?}{}{}):",
        config.hidden,
        config.intermediate,
        device.label(),
        if wgmma { "" } else { ", no wgmma" },
        if decode { "" } else { ", no decode kernel" }
    );
    for (name, us) in &stages {
        println!("  {name:<16} {us:>10.1} us");
    }
    let total: f64 = stages.iter().map(|(_, us)| us).sum();
    println!(
        "  {:<16} {total:>10.1} us (one eager pass, timed stage by stage)",
        "stages total"
    );
    println!(
        "  {:<16} {per_pass:>10.1} us per pass as forward runs it, {reps} back to back (graph: {}, host syncs: {}, launches: {})",
        "whole pass",
        stats.graph,
        stats.host_syncs,
        stats.launches
    );
    Ok(())
}

/// `bench`, recording a trace (and sampling NVML when it is there) with `--trace`. The
/// suites, the output paths and the replay trace are checked before anything runs.
fn bench_traced(
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

fn report(results: &Path, out: Option<&Path>) -> Result<()> {
    let loaded =
        Results::read_json(results).with_context(|| format!("reading {}", results.display()))?;
    bench::print_table(&loaded);
    let dir = out.unwrap_or(Path::new("warpdrive-report"));
    let html = bench::write_report(&loaded, dir)?;
    println!("report written to {}", html.display());
    Ok(())
}

/// Logs on stderr, filtered by `WARPDRIVE_LOG` (e.g. `warpdrive=debug`); warnings by default.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("WARPDRIVE_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: in a log file or a pipe they are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

fn list_suites() {
    let width = bench::suites()
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0);
    for s in bench::suites() {
        println!("{:<width$}  {}", s.name, s.about);
    }
}

fn doctor(device: &DeviceOpt, scale: &ScaleOpt, json: Option<&Path>) -> Result<()> {
    if let Some(path) = json {
        check_output(path)?;
    }
    // Opened first: a bad --device fails before the report starts.
    let device = device.open()?;
    println!(
        "warpdrive {} (git {})",
        env!("CARGO_PKG_VERSION"),
        warpdrive::GIT_REV
    );
    let count = Device::cuda_count();
    println!("CUDA devices: {count}");
    if count == 0 {
        println!();
        println!("cpu");
        print_info(&Device::cpu().info()?);
    }
    for n in 0..count {
        println!();
        println!("cuda:{n}");
        match Device::cuda(n).and_then(|d| d.info()) {
            Ok(info) => print_info(&info),
            Err(e) => println!("  error: {e}"),
        }
    }

    let scale = scale.on(&device);
    println!();
    println!(
        "measuring ceilings on {} ({} sizes)...",
        device.label(),
        scale.name()
    );
    if scale.quick() {
        println!(
            "note: {} sizes are smaller than a full GPU run's",
            scale.name()
        );
    }
    let ceilings = bench::select_suites(&["ceilings"])?;
    let outcome = bench::run_suites(&device, &ceilings, scale)?;
    println!();
    println!("ceilings on {}:", device.label());
    print!(
        "{}",
        indent(&bench::format_ceilings(&outcome.results.ceilings))
    );
    match json {
        Some(path) => {
            let saved = save_results(&outcome.results, &outcome.failed, path)?;
            println!("results written to {}", saved.display());
            Ok(())
        }
        None => fail_on(&outcome.failed),
    }
}

/// Every field of `info`, one per line, then the libraries.
fn print_info(info: &DeviceInfo) {
    let Ok(Value::Object(mut fields)) = serde_json::to_value(info) else {
        println!("  {info:?}");
        return;
    };
    fields.insert(
        "pcie".into(),
        info.pcie().map_or(Value::Null, Value::String),
    );
    fields.insert("numa".into(), Value::String(numa_line(&info.numa)));
    let width = fields.keys().map(String::len).max().unwrap_or(0);
    for (key, value) in &fields {
        if key == "libraries" {
            continue;
        }
        println!("  {key:<width$}  {}", show(value));
    }
    println!("  libraries:");
    let lib_width = info
        .libraries
        .iter()
        .map(|l| l.name.len())
        .max()
        .unwrap_or(0);
    for lib in &info.libraries {
        let state = match (lib.loaded, lib.version.as_deref()) {
            (true, Some(version)) => format!("loaded   {version}"),
            (true, None) => "loaded   (version not reported)".into(),
            (false, _) => format!("missing  ({})", missing_library(lib.name)),
        };
        println!("    {:<lib_width$}  {state}", lib.name);
    }
}

/// Where host memory and staging threads go, in words.
fn numa_line(numa: &warpdrive::device::sysfs::NumaPlacement) -> String {
    let nodes = format!("{} node(s) on this machine", numa.nodes);
    match numa.node {
        Some(node) => format!(
            "node {node} ({} CPUs; {nodes}): host memory and staging threads go there",
            numa.cpus.len()
        ),
        None => format!("no placement ({nodes}, or none named for this device)"),
    }
}

/// Why a CUDA library is missing and what goes without it.
fn missing_library(name: &str) -> &'static str {
    match name {
        "driver" => "libcuda.so could not be loaded: no NVIDIA driver; no CUDA device",
        "nvrtc" => "libnvrtc.so could not be loaded: no CUDA toolkit; kernels cannot compile",
        "cublas" => "libcublas.so could not be loaded: GEMMs through cuBLAS unavailable",
        "cublaslt" => "libcublasLt.so could not be loaded: cuBLASLt GEMMs unavailable",
        "nccl" => "libnccl.so could not be loaded: multi-GPU collectives unavailable",
        "cufile" => "libcufile.so could not be loaded: GPUDirect Storage unavailable",
        _ => "could not be loaded",
    }
}

/// A JSON value as plain text (`-` for null, strings unquoted).
fn show(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

fn bench_cmd(
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

/// Fails, naming `path` and why, when the results or trace file could not be written there:
/// checked before a run, so a bad path never costs the run.
fn check_output(path: &Path) -> Result<()> {
    warpdrive::files::check_writable(path)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `results` to `path` when every suite succeeded. After a failure they go to a
/// `.partial` file beside it instead (see [`partial_path`]), so a failed run never replaces
/// a good results file, and the run fails naming the suites.
/// Returns the absolute path written.
fn save_results(
    results: &Results,
    failed: &[(&str, warpdrive::Error)],
    path: &Path,
) -> Result<PathBuf> {
    let path = absolute(path);
    if failed.is_empty() {
        return write_results(results, &path);
    }
    let partial = partial_path(&path);
    write_results(results, &partial)?;
    bail!(
        "{}; the results so far are in {} ({} was left as it was)",
        failures(failed),
        partial.display(),
        path.display()
    )
}

/// `path` from the filesystem root, so that the line naming it works from any folder.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn fail_on(failed: &[(&str, warpdrive::Error)]) -> Result<()> {
    if failed.is_empty() {
        return Ok(());
    }
    bail!("{}", failures(failed))
}

/// `N suite(s) failed: suite: error; ...`.
fn failures(failed: &[(&str, warpdrive::Error)]) -> String {
    let list: Vec<String> = failed.iter().map(|(s, e)| format!("{s}: {e}")).collect();
    format!("{} suite(s) failed: {}", failed.len(), list.join("; "))
}

/// `dir/name.partial.json` for `dir/name.json` (`name.partial` without an extension).
fn partial_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.partial.{}", ext.to_string_lossy()),
        None => format!("{stem}.partial"),
    };
    path.with_file_name(name)
}

/// Writes `results` atomically (a failed write leaves the file that was there whole).
fn write_results(results: &Results, path: &Path) -> Result<PathBuf> {
    results
        .write_json(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("warpdrive").chain(args.iter().copied()))
    }

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn doctor_args() {
        let cli = parse(&["doctor"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Doctor { ref device, ref output, ref scale }
                if device.device.is_none() && output.json.is_none() && scale.scale.is_none()
        ));
        let cli = parse(&[
            "doctor", "--json", "d.json", "--device", "cuda:1", "--scale", "tiny",
        ])
        .unwrap();
        let Command::Doctor {
            device,
            output,
            scale,
        } = cli.command
        else {
            panic!("not doctor")
        };
        assert_eq!(scale.on(&Device::cpu()), Scale::Tiny);
        assert_eq!(device.device.as_deref(), Some("cuda:1"));
        assert_eq!(output.json, Some(PathBuf::from("d.json")));
    }

    #[test]
    fn bench_args() {
        let cli = parse(&["bench"]).unwrap();
        let Command::Bench {
            suites,
            list,
            replay,
            trace,
            device,
            scale,
            output,
        } = cli.command
        else {
            panic!("not bench")
        };
        assert!(suites.is_empty() && !list && device.device.is_none() && output.json.is_none());
        // The device's default scale: quick on the CPU.
        assert_eq!(scale.on(&Device::cpu()), Scale::Quick);
        assert!(parse(&["bench", "--scale", "huge"]).is_err());
        assert!(replay.is_none() && trace.is_none());
        let cli = parse(&["bench", "telemetry", "--trace", "out.json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Bench { trace: Some(ref p), .. } if p == Path::new("out.json")
        ));
        let cli = parse(&["report", "r.json", "-o", "dir"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Report { ref results, out: Some(ref o) }
                if results == Path::new("r.json") && o == Path::new("dir")
        ));
        let cli = parse(&["bench", "memory", "--replay", "t.json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Bench { replay: Some(ref p), .. } if p == Path::new("t.json")
        ));

        let cli = parse(&[
            "bench",
            "ceilings",
            "transfer",
            "--json",
            "out/r.json",
            "--device=cpu",
        ])
        .unwrap();
        let Command::Bench {
            suites,
            device,
            output,
            ..
        } = cli.command
        else {
            panic!("not bench")
        };
        assert_eq!(suites, ["ceilings", "transfer"]);
        assert_eq!(device.device.as_deref(), Some("cpu"));
        assert_eq!(output.json, Some(PathBuf::from("out/r.json")));

        let cli = parse(&["bench", "--list"]).unwrap();
        assert!(matches!(cli.command, Command::Bench { list: true, .. }));
    }

    #[test]
    fn moe_args() {
        let cli = parse(&["moe", "--preset", "mixtral-8x7b"]).unwrap();
        let Command::Moe {
            preset,
            tokens,
            path,
            reps,
            no_wgmma,
            ..
        } = cli.command
        else {
            panic!("not moe");
        };
        assert_eq!(
            (preset.as_str(), tokens, path.as_str(), reps, no_wgmma),
            ("mixtral-8x7b", 1, "auto", 20, false)
        );
        let cli = parse(&["moe", "--preset", "q", "--tokens", "64", "--reps", "500"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                tokens: 64,
                reps: 500,
                ..
            }
        ));
        let cli = parse(&["moe", "--preset", "q", "--no-wgmma"]).unwrap();
        assert!(matches!(cli.command, Command::Moe { no_wgmma: true, .. }));
        let cli = parse(&["moe", "--preset", "q", "--no-decode-kernel"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                no_decode_kernel: true,
                no_wgmma: false,
                ..
            }
        ));
        assert!(parse(&["moe", "--preset", "q", "--reps", "0"]).is_err());
        assert!(parse(&["moe"]).is_err());
    }

    #[test]
    fn moe_weights_args() {
        let weights = |args: &[&str]| {
            let mut all = vec!["moe", "--preset", "q"];
            all.extend(args);
            match parse(&all)?.command {
                Command::Moe { weights, .. } => Ok::<_, clap::Error>(weights.file()),
                _ => panic!("not moe"),
            }
        };
        assert_eq!(weights(&[]).unwrap(), None);
        assert_eq!(
            weights(&["--weights", "ckpt", "--layer", "3", "--strict"]).unwrap(),
            Some(WeightsFile::new("ckpt").layer(3).strict(true))
        );
        assert_eq!(
            weights(&[
                "--weights",
                "a.safetensors",
                "--prefix",
                "model.layers.1.mlp"
            ])
            .unwrap(),
            Some(WeightsFile::new("a.safetensors").prefix("model.layers.1.mlp."))
        );
        // A layer or prefix needs --weights, and only one of them names the block.
        assert!(weights(&["--layer", "3"]).is_err());
        assert!(weights(&["--strict"]).is_err());
        assert!(weights(&["--weights", "c", "--layer", "1", "--prefix", "p."]).is_err());
    }

    #[test]
    fn bad_args_are_rejected() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["frobnicate"]).is_err());
        assert!(parse(&["doctor", "--json"]).is_err());
        assert!(parse(&["bench", "--nope"]).is_err());
        assert!(parse(&["doctor", "extra"]).is_err());
    }

    #[test]
    fn a_failed_run_keeps_the_good_results_file() {
        let dir = std::env::temp_dir().join(format!("wd-cli-save-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.json");
        std::fs::write(&path, "good").unwrap();
        let info = Device::cpu().info().unwrap();
        let results = Results::new(&info, bench::Ceilings::default(), Vec::new());
        let failed = [("memory", warpdrive::Error::InvalidArgument("boom".into()))];
        let err = save_results(&results, &failed, &path)
            .unwrap_err()
            .to_string();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "good");
        let partial = dir.join("r.partial.json");
        assert!(
            err.contains("memory") && err.contains(&*absolute(&partial).to_string_lossy()),
            "{err}"
        );
        assert_eq!(Results::read_json(&partial).unwrap().rows, results.rows);
        // A run without failures replaces it.
        save_results(&results, &[], &path).unwrap();
        assert!(Results::read_json(&path).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let lib = warpdrive::Error::io(Path::new("r.json"), io);
        let e = anyhow::Error::new(lib).context("reading r.json");
        let line = error_line(&e);
        assert_eq!(line.matches("gone").count(), 1, "{line}");
        assert!(line.starts_with("reading r.json: "), "{line}");
    }

    #[test]
    fn partial_paths_sit_beside_the_results_file() {
        assert_eq!(
            partial_path(Path::new("out/r.json")),
            Path::new("out/r.partial.json")
        );
        assert_eq!(partial_path(Path::new("r")), Path::new("r.partial"));
    }

    #[test]
    fn unknown_suite_lists_the_known_ones() {
        let err = bench::select_suites(&["nope"]).unwrap_err().to_string();
        assert!(err.contains("ceilings"), "{err}");
    }
}
