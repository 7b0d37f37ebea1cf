//! The command line: the commands and their flags, each defined once with its docs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use warpdrive::moe::WeightsFile;
use warpdrive::Device;
use warpdrive_bench::Scale;

/// warpdrive: GPU performance runtime. `doctor` checks the machine, `bench` benchmarks
/// it, `report` renders a results file, `moe` runs one MoE layer,
/// `actors` runs persistent actors with live counters, `serve` serves jobs over HTTP,
/// `load` offers load to a running service.
#[derive(Debug, Parser)]
#[command(name = "warpdrive", version)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
        /// The `tier` suite's disk cases alone, at these block sizes in bytes
        /// (comma-separated, e.g. 67108864): the 64 MiB disk rows without the full scale.
        #[arg(long, value_name = "BYTES,...", value_delimiter = ',')]
        tier_disk_sizes: Vec<usize>,
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
    /// Serve jobs over HTTP (an MoE layer forward per job) with dynamic batching, priority
    /// classes, tenant budgets and an optional latency controller: POST /v1/jobs
    /// (?async=true: fetch later from GET /v1/jobs/ID), GET / (the dashboard), /v1/status,
    /// /v1/events, /v1/model, /health, /metrics. Ctrl-C or SIGTERM stops it after answering
    /// every accepted job.
    Serve(ServeArgs),
    /// Offer load to a running `warpdrive serve` on this machine: Poisson arrivals at a rate
    /// (open loop) or N clients each with one job outstanding (closed loop), bounded in jobs
    /// and time; prints latency percentiles, throughput and failures by kind.
    Load(LoadArgs),
    /// Run persistent actors with live counters: echo actors in one resident loop, host
    /// threads sending to them, then round trips and the time to terminate.
    Actors(ActorsArgs),
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
        /// Run every warpgroup-MMA tile on its overlap kernel (MMAs in flight across
        /// stages; issue 40) instead of the plan's choice per projection (overlap where a
        /// block runs at least 2560 deep).
        #[arg(long, conflicts_with = "no_wgmma_overlap")]
        wgmma_overlap: bool,
        /// Run every warpgroup-MMA tile on the kernel that drains its MMAs every stage
        /// instead of the plan's choice per projection.
        #[arg(long)]
        no_wgmma_overlap: bool,
        /// Run every warpgroup-MMA tile as the wide tile (192 token rows, one block per SM;
        /// issue 40) instead of the plan's choice (wide where an expert's rows overflow one
        /// 96-row tile and 192-row tiles pad them at most 10 % more); `--wgmma-wide-on both`.
        #[arg(long, conflicts_with_all = ["no_wgmma_wide", "wgmma_wide_on"])]
        wgmma_wide: bool,
        /// Run every warpgroup-MMA tile on the 64- and 96-row tiles instead of the plan's
        /// choice; `--wgmma-wide-on none`.
        #[arg(long, conflicts_with = "wgmma_wide_on")]
        no_wgmma_wide: bool,
        /// Run the wide tile on these projections' warpgroup-MMA tiles and the 64- or 96-row
        /// tiles on the other's, instead of the plan's choice: `none`, `gate-up` (the first
        /// GEMM, K = hidden), `down` (K = intermediate) or `both`.
        #[arg(long, value_name = "PROJECTIONS",
              value_parser = ["none", "gate-up", "down", "both"])]
        wgmma_wide_on: Option<String>,
        /// Run every warpgroup-MMA tile on its warp-specialized kernel (a producer warp
        /// loading the weights by TMA, mbarriers; issue 40) instead of the plan's choice (where
        /// one tile holds an expert's rows); the 256-weight-row tile's (a producer warpgroup,
        /// setmaxnreg) only with this flag.
        #[arg(long, conflicts_with = "no_wgmma_tma")]
        wgmma_tma: bool,
        /// Keep every warpgroup-MMA tile off the warp-specialized TMA kernel.
        #[arg(long)]
        no_wgmma_tma: bool,
        /// Weight rows per warpgroup-MMA tile forced: `128` (the 128-weight-row tiles) or `256`
        /// (the 256-weight-row tile, one block per SM, on both projections or those of
        /// `--wgmma-weight-rows-on`), instead of the plan's choice (256 where an expert gets
        /// 128 rows or more; issue 40).
        #[arg(long, value_name = "ROWS", value_parser = ["128", "256"])]
        wgmma_weight_rows: Option<String>,
        /// With `--wgmma-weight-rows 256`: the projections that take it, `gate-up`, `down` or
        /// `both` (the default); the other keeps the plan's tile.
        #[arg(long, value_name = "PROJECTIONS", requires = "wgmma_weight_rows",
              value_parser = ["gate-up", "down", "both"])]
        wgmma_weight_rows_on: Option<String>,
        /// With `--wgmma-weight-rows 256`: its token rows, `128` (the default) or `96`.
        #[arg(long, value_name = "ROWS", requires = "wgmma_weight_rows",
              value_parser = ["96", "128"])]
        wgmma_token_rows: Option<String>,
        /// Run every grouped GEMM's tiles column block by column block, the work items fastest,
        /// instead of the plan's order (item by item where an expert's tiles fit one wave of
        /// blocks, else items fastest).
        #[arg(long, conflicts_with = "no_gemm_items_fastest")]
        gemm_items_fastest: bool,
        /// Run every grouped GEMM's tiles item by item (an item's column blocks side by side)
        /// instead of the plan's order.
        #[arg(long)]
        no_gemm_items_fastest: bool,
        /// Route through the prefill router (cuBLAS logits, routing one warp per token, a
        /// many-block dispatch; issue 40) instead of the plan's choice (from 512 tokens).
        #[arg(long, conflicts_with = "no_prefill_router")]
        prefill_router: bool,
        /// Route through the fused router kernel (logits, routing and a one-block dispatch)
        /// instead of the plan's choice.
        #[arg(long)]
        no_prefill_router: bool,
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

/// What `warpdrive serve` serves.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// The model: `moe:PRESET` (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-slice, gpt-oss-120b
    /// or tiny) with seeded weights.
    #[arg(long, value_name = "MODEL", default_value = "moe:qwen3-30b-a3b")]
    pub(crate) model: String,
    /// Where to listen (loopback unless told otherwise).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub(crate) addr: std::net::SocketAddr,
    /// A batch closes at this many rows (tokens)...
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_batch_rows: u32,
    /// ...or as soon as the device is idle, or when its oldest job has waited this many
    /// milliseconds while the device is busy (a second worker then takes it).
    #[arg(long, value_name = "MS", default_value_t = 10)]
    pub(crate) max_delay_ms: u64,
    /// Close a batch only at --max-batch-rows or after --max-delay-ms, idle device or not
    /// (Triton's max_queue_delay), instead of as soon as the device is idle.
    #[arg(long)]
    pub(crate) window: bool,
    /// Turn the controller on: it steers the batch rows (up to --controller-max-rows) and
    /// the delay (up to --max-delay-ms) to keep the p99 latency under this many milliseconds.
    #[arg(long, value_name = "MS")]
    pub(crate) p99_target_ms: Option<f64>,
    /// Batcher threads, each with its own copy of the layer (its own stream and weights), so
    /// one batch's copies overlap another's kernels.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(crate) workers: u32,
    /// Time the layer on batches of 1, 2, 4, ... rows at start and prefer the sizes it runs
    /// efficiently (batches stop at the best size; the controller starts at the knee).
    #[arg(long)]
    pub(crate) tune_batch: bool,
    /// The most rows the controller lets a batch hold.
    #[arg(long, value_name = "N", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) controller_max_rows: u32,
    /// Jobs waiting at most (past it, 503).
    #[arg(long, value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) queue_jobs: u32,
    /// Connections open at most (one past it is closed at once).
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_connections: u32,
    /// Each tenant's (x-warpdrive-tenant) jobs in flight at most (past it, 429).
    #[arg(long, value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) tenant_jobs: u32,
    /// Each tenant's job data in flight at most, MiB (input and output as f32).
    #[arg(long, value_name = "MIB", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) tenant_mib: u32,
    /// Each tenant's jobs a second at most, with bursts of --tenant-burst (default: no limit).
    #[arg(long, value_name = "JOBS_PER_S")]
    pub(crate) tenant_rate: Option<f64>,
    #[arg(long, value_name = "N", default_value_t = 16.0)]
    pub(crate) tenant_burst: f64,
    /// Each tenant's device memory held by its running jobs at most, MiB (default: no
    /// limit); a job past it fails with 429 (413 when it alone is larger) and the rest of
    /// its batch runs.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) tenant_device_mib: Option<u32>,
    /// Before serving, run the layer once on batches of 1, 2, 4, ... up to this many rows
    /// and this many (the first pass down a path compiles its kernels or loads cuBLAS; 0:
    /// none). Default: the most rows a batch can hold (--max-batch-rows, or
    /// --controller-max-rows with a controller), so no job pays a first pass.
    #[arg(long, value_name = "ROWS")]
    pub(crate) warm_rows: Option<u32>,
    /// Threads of the HTTP side (parsing, decoding, replies; default: the cores, 2 to 8).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) http_threads: Option<u32>,
    /// Task polls between a busy HTTP thread's looks at the sockets (tokio's event
    /// interval; default: warpdrive_serve::DEFAULT_EVENT_INTERVAL).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) http_event_interval: Option<u32>,
    /// Stop after this many seconds (default: serve until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "S")]
    pub(crate) seconds: Option<f64>,
    /// Layer size: `full` (the preset's shape), `quick` or `tiny` (hidden and intermediate
    /// divided by 8 or 16).
    #[arg(long, value_name = "SCALE", default_value = "full",
          value_parser = ["full", "quick", "tiny"])]
    pub(crate) scale: String,
    #[command(flatten)]
    pub(crate) device: DeviceOpt,
}

/// What `warpdrive load` offers.
#[derive(Debug, Args)]
pub(crate) struct LoadArgs {
    /// The service (a loopback address).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub(crate) addr: std::net::SocketAddr,
    /// Open loop: Poisson arrivals at this many jobs a second.
    #[arg(long, value_name = "JOBS_PER_S", conflicts_with = "clients")]
    pub(crate) rate: Option<f64>,
    /// Closed loop: this many clients, each sending its next job when the last is answered
    /// (the default, with 1, when no --rate is given).
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) clients: Option<u32>,
    /// Rows (tokens) per job.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) rows: u32,
    /// Send at most this many jobs.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) jobs: Option<u64>,
    /// Send jobs for this many seconds.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub(crate) seconds: f64,
    /// Connections at most (open loop; a closed loop has one per client).
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) connections: u32,
    /// Body format: json, f32 or bf16 (the binary tensor body).
    #[arg(long, value_name = "FORMAT", default_value = "json",
          value_parser = ["json", "f32", "bf16"])]
    pub(crate) format: String,
    /// Priority class of the jobs, 0 (lowest) to 3 (the service's default when not given).
    #[arg(long, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=3))]
    pub(crate) priority: Option<u8>,
    /// Tenant the jobs are counted against (the service's budgets).
    #[arg(long, value_name = "NAME")]
    pub(crate) tenant: Option<String>,
    /// The longest one job may take, in seconds.
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    pub(crate) timeout: f64,
    /// Threads of the generator (default: a quarter of the cores, 2 to 8): enough that the
    /// generator is not what saturates.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) threads: Option<u32>,
    /// Task polls between a busy generator thread's looks at the sockets (tokio's event
    /// interval; default: warpdrive_serve::DEFAULT_EVENT_INTERVAL).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) event_interval: Option<u32>,
    /// Before the run, the same load for this many seconds on the same generator, not counted
    /// (a fresh process grows its heaps and buffers to the load's high-water mark once;
    /// default 0: none); its summary and stalls are printed after the run's.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub(crate) warmup: f64,
    /// Write every answered job to this CSV file: when it was due or sent (seconds into the
    /// run), its latency, the generator's lag and connection wait, the service's submission,
    /// queue and batch run times, and the legs to and from the service by the host's wall
    /// clock and the pacer's part of the lag (to_service_us, from_service_us, pace_us; µs).
    #[arg(long, value_name = "PATH")]
    pub(crate) jobs_csv: Option<std::path::PathBuf>,
    /// Only jobs that took at least this long go to --jobs-csv (µs; default 0: every job):
    /// the slow ones of a long run at a high rate, in a file small enough to carry.
    #[arg(long, value_name = "US", default_value_t = 0.0, requires = "jobs_csv")]
    pub(crate) jobs_csv_min_us: f64,
}

/// What `warpdrive actors` runs.
#[derive(Debug, Args)]
pub(crate) struct ActorsArgs {
    /// Echo actors hosted by the resident loop.
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) actors: u32,
    /// Host threads sending messages (round robin over the actors).
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) producers: u32,
    /// Most messages each actor handles per loop iteration (1 to 256).
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(crate) batch: u32,
    /// How long the demo runs, in seconds.
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    pub(crate) seconds: f64,
    #[command(flatten)]
    pub(crate) device: DeviceOpt,
}

/// Where the MoE layer's weights come from.
#[derive(Debug, Args)]
pub(crate) struct WeightsOpt {
    /// Read the layer's weights from a safetensors checkpoint (a file, a sharded checkpoint's
    /// model.safetensors.index.json, or the folder holding it) instead of seeded random ones;
    /// the preset still gives the shape, which the tensors must match.
    #[arg(long, value_name = "PATH")]
    pub(crate) weights: Option<PathBuf>,
    /// The MoE block to read, by the prefix of its tensor names (e.g. model.layers.3.mlp.);
    /// needed when the checkpoint holds several.
    #[arg(
        long,
        value_name = "PREFIX",
        requires = "weights",
        conflicts_with = "layer"
    )]
    pub(crate) prefix: Option<String>,
    /// The MoE block to read, by layer index (the block whose prefix has N as one part).
    #[arg(long, value_name = "N", requires = "weights")]
    pub(crate) layer: Option<usize>,
    /// Refuse weights that hold NaN or infinity (by default each such tensor is a warning).
    #[arg(long, requires = "weights")]
    pub(crate) strict: bool,
}

impl WeightsOpt {
    /// The checkpoint to read, when `--weights` names one.
    pub(crate) fn file(&self) -> Option<WeightsFile> {
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
pub(crate) struct DeviceOpt {
    /// Device to use: `cpu`, `cuda` or `cuda:N` (default: `WARPDRIVE_DEVICE`, else CUDA
    /// device 0 when present, else the CPU).
    #[arg(long, value_name = "SPEC")]
    pub(crate) device: Option<String>,
}

impl DeviceOpt {
    pub(crate) fn open(&self) -> Result<Device> {
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
pub(crate) struct ScaleOpt {
    /// Input sizes: `full` (the sizes docs/BENCH.md names; the default on CUDA), `quick` (smaller;
    /// the default on the CPU) or `tiny` (just enough to run every case once: a smoke test).
    #[arg(long, value_name = "SCALE", value_parser = ["full", "quick", "tiny"])]
    pub(crate) scale: Option<String>,
}

impl ScaleOpt {
    /// The scale asked for, else the device's default.
    pub(crate) fn on(&self, device: &Device) -> Scale {
        match self.scale.as_deref() {
            Some(name) => scale_named(name),
            None => Scale::for_device(device),
        }
    }
}

/// The scale clap accepted by name (`full`, `quick` or `tiny`).
pub(crate) fn scale_named(name: &str) -> Scale {
    match name {
        "quick" => Scale::Quick,
        "tiny" => Scale::Tiny,
        _ => Scale::Full,
    }
}

/// Where to write the results file.
#[derive(Debug, Args)]
pub(crate) struct OutputOpt {
    /// Write a results file (`warpdrive-bench/1` JSON) here; `bench` writes
    /// `warpdrive-results.json` when this is not given.
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::path::Path;

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
            tier_disk_sizes,
            trace,
            device,
            scale,
            output,
        } = cli.command
        else {
            panic!("not bench")
        };
        assert!(tier_disk_sizes.is_empty());
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
        let cli = parse(&["bench", "tier", "--tier-disk-sizes", "65536,67108864"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Bench { ref tier_disk_sizes, .. } if tier_disk_sizes == &[65536, 67108864]
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
    fn actors_args() {
        let cli = parse(&["actors"]).unwrap();
        let Command::Actors(a) = cli.command else {
            panic!("not actors");
        };
        assert_eq!((a.actors, a.producers, a.batch, a.seconds), (4, 2, 64, 3.0));
        assert!(parse(&["actors", "--batch", "300"]).is_err());
        assert!(parse(&["actors", "--actors", "0"]).is_err());
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
        let cli = parse(&["moe", "--preset", "q", "--wgmma-overlap"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_overlap: true,
                ..
            }
        ));
        let cli = parse(&["moe", "--preset", "q", "--no-wgmma-overlap", "--wgmma-wide"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_overlap: false,
                no_wgmma_overlap: true,
                wgmma_wide: true,
                ..
            }
        ));
        assert!(parse(&[
            "moe",
            "--preset",
            "q",
            "--wgmma-overlap",
            "--no-wgmma-overlap"
        ])
        .is_err());
        let cli = parse(&["moe", "--preset", "q", "--no-wgmma-wide"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_wide: false,
                no_wgmma_wide: true,
                ..
            }
        ));
        assert!(parse(&["moe", "--preset", "q", "--wgmma-wide", "--no-wgmma-wide"]).is_err());
        for which in ["none", "gate-up", "down", "both"] {
            let cli = parse(&["moe", "--preset", "q", "--wgmma-wide-on", which]).unwrap();
            assert!(matches!(
                cli.command,
                Command::Moe {
                    wgmma_wide: false,
                    no_wgmma_wide: false,
                    wgmma_wide_on: Some(ref w),
                    ..
                } if w == which
            ));
        }
        assert!(parse(&["moe", "--preset", "q", "--wgmma-wide-on", "up"]).is_err());
        for other in ["--wgmma-wide", "--no-wgmma-wide"] {
            assert!(parse(&["moe", "--preset", "q", "--wgmma-wide-on", "down", other]).is_err());
        }
        let cli = parse(&["moe", "--preset", "q", "--wgmma-tma"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_tma: true,
                no_wgmma_tma: false,
                ..
            }
        ));
        let cli = parse(&["moe", "--preset", "q", "--no-wgmma-tma"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_tma: false,
                no_wgmma_tma: true,
                ..
            }
        ));
        assert!(parse(&["moe", "--preset", "q", "--wgmma-tma", "--no-wgmma-tma"]).is_err());
        let cli = parse(&["moe", "--preset", "q", "--wgmma-weight-rows", "256"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_weight_rows: Some(ref r),
                wgmma_weight_rows_on: None,
                wgmma_token_rows: None,
                gemm_items_fastest: false,
                no_gemm_items_fastest: false,
                ..
            } if r == "256"
        ));
        let cli = parse(&[
            "moe",
            "--preset",
            "q",
            "--wgmma-weight-rows",
            "256",
            "--wgmma-weight-rows-on",
            "down",
            "--wgmma-token-rows",
            "96",
            "--gemm-items-fastest",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                wgmma_weight_rows_on: Some(ref on),
                wgmma_token_rows: Some(ref rows),
                gemm_items_fastest: true,
                ..
            } if on == "down" && rows == "96"
        ));
        let cli = parse(&["moe", "--preset", "q", "--no-gemm-items-fastest"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                gemm_items_fastest: false,
                no_gemm_items_fastest: true,
                ..
            }
        ));
        for bad in [
            &["--wgmma-weight-rows", "192"][..],
            &["--wgmma-weight-rows", "256", "--wgmma-token-rows", "64"],
            &[
                "--wgmma-weight-rows",
                "256",
                "--wgmma-weight-rows-on",
                "none",
            ],
            &["--wgmma-token-rows", "96"],
            &["--wgmma-weight-rows-on", "both"],
            &["--gemm-items-fastest", "--no-gemm-items-fastest"],
        ] {
            let mut args = vec!["moe", "--preset", "q"];
            args.extend(bad);
            assert!(parse(&args).is_err(), "{bad:?}");
        }
        let cli = parse(&["moe", "--preset", "q", "--no-prefill-router"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Moe {
                prefill_router: false,
                no_prefill_router: true,
                ..
            }
        ));
        assert!(parse(&[
            "moe",
            "--preset",
            "q",
            "--prefill-router",
            "--no-prefill-router"
        ])
        .is_err());
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
}
