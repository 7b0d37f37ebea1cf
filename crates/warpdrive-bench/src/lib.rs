//! The benchmark harness behind `warpdrive bench` and `warpdrive doctor` (method and file
//! format: `docs/BENCH.md`).
//!
//! - [`suites`]: the registered [`Suite`]s; each runs its cases on a [`Ctx`] and records
//!   [`Row`]s. [`run_suites`] always runs the `ceilings` suite first, so later rows can cite
//!   the measured [`Ceilings`] in `pct_of_ceiling`.
//! - [`time_gpu`] times stream work with events (GPU events on CUDA, host instants on the
//!   CPU backend); [`time_host`] times host work, [`time_host_rounds`] several kinds of it
//!   side by side; [`Stats`] summarises the samples.
//! - [`measure_ceilings`]: the doctor's measurements.
//! - [`run_peers`]: rows of the PyTorch/CuPy scripts in `bench/peers/`.
//! - [`Results`]: the results file, [`print_table`] its plain-text view.
//! - [`Derived`]: the seed-001 figures rows carry in `extra` (bandwidth utilization, transfer
//!   overhead, overlap efficiency, memory efficiency), set through `Row` methods.

#![forbid(unsafe_code)]

mod actors;
mod agents;
mod ceilings;
mod derived;
mod device_launch;
mod dist;
mod exec;
mod fuse;
mod fuse_gemm;
mod kernels;
pub mod memory;
pub mod moe;
mod peers;
mod progress;
mod report;
mod results;
mod serve;
mod serve_peer;
mod stats;
mod telemetry;
mod tier;
mod timing;
mod transfer;
mod unified;

use std::path::PathBuf;

use warpdrive::device::{Device, DeviceInfo, Stream};
use warpdrive::error::{Error, Result};

pub use ceilings::{measure_ceilings, measure_ceilings_at};
pub use derived::{format_derived, Derived};
pub use peers::{parse_peer_rows, peers_dir, run_peers, PEERS_DIR_ENV, PEER_TIMEOUT_ENV};
pub use progress::Progress;
pub use report::{render_report, write_report, Report};
pub use results::{
    format_ceilings, format_table, now_rfc3339, print_table, rfc3339_utc, Ceiling, Ceilings,
    DeviceRecord, Metric, Results, Row, SCHEMA,
};
pub use serve_peer::versus_peer;
pub use stats::{percentile, Stats};
pub use timing::{time_gpu, time_host, time_host_rounds};

/// How large the benchmark inputs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// The sizes `docs/BENCH.md` and the issues name (1 GiB copies, 8192³ GEMM): CUDA.
    Full,
    /// Smaller sizes, so a run finishes quickly: the CPU backend.
    Quick,
    /// Just enough to exercise every code path: unit tests in debug builds.
    Tiny,
}

impl Scale {
    /// `Full` on CUDA, `Quick` on the CPU backend.
    pub fn for_device(device: &Device) -> Scale {
        if device.is_cuda() {
            Scale::Full
        } else {
            Scale::Quick
        }
    }

    /// True for anything smaller than [`Scale::Full`].
    pub fn quick(self) -> bool {
        self != Scale::Full
    }

    /// `full`, `quick`, `tiny`.
    pub fn name(self) -> &'static str {
        match self {
            Scale::Full => "full",
            Scale::Quick => "quick",
            Scale::Tiny => "tiny",
        }
    }
}

/// A named group of benchmark cases.
#[derive(Debug, Clone, Copy)]
pub struct Suite {
    /// The name on the command line and in each row's `suite`.
    pub name: &'static str,
    /// One line for `warpdrive bench --list`.
    pub about: &'static str,
    /// Runs every case, recording rows on the context.
    pub run: fn(&mut Ctx) -> Result<()>,
}

static SUITES: &[Suite] = &[
    Suite {
        name: ceilings::SUITE,
        about: "the machine's limits (PCIe copies, device copy, bf16 GEMM, launch cost, \
                host memcpy, CPU GEMM); one row per ceiling",
        run: ceilings::run_suite,
    },
    Suite {
        name: memory::SUITE,
        about: "device and pinned pools: alloc+free cost vs the driver and CUDA's async \
                pool, fragmentation on a seeded trace (reserved / peak live)",
        run: memory::run_suite,
    },
    Suite {
        name: kernels::SUITE,
        about: "fused a*x+b and sum over 1 GiB of f32 against the copy ceiling (scalar vs \
                16-byte loads), the fused MoE router (bf16), GEMM through cuBLAS (bf16 8192³; 40 \
                f32 256³ looped vs strided-batched) and kernel launch cost (builder, lean, graph)",
        run: run_kernels_suite,
    },
    Suite {
        name: fuse::SUITE,
        about: "kernel fusion: chains of 2, 5 and 10 elementwise ops and two activations over \
                256 MiB (f32, bf16) as one generated kernel vs one kernel per op vs the copy \
                ceiling; first NVRTC compile and cached start (peer: torch eager and \
                torch.compile); softmax cross-entropy; filters at 1 % and 50 %; \
                bf16 4096³ GEMM + bias + GELU (+ residual) with a fused epilogue kernel",
        run: fuse::run_suite,
    },
    Suite {
        name: device_launch::SUITE,
        about: "work launched from the device: decision-to-start latency (device-launched \
                graph, host-launched graph, host launch after a round trip), dispatcher \
                decisions per second, and the MoE layer dispatched from the device at 1-256 \
                tokens against its host-launched graph",
        run: device_launch::run_suite,
    },
    Suite {
        name: transfer::SUITE,
        about: "host<->device copies from pageable memory (driver, pinned ceiling, the \
                staged fast path), host copy rate, coalescing 1000 small copies, the \
                3-stream pipeline's overlap, wire compression (bf16/f16/auto)",
        run: transfer::run_suite,
    },
    Suite {
        name: unified::SUITE,
        about: "first device touch of host-written memory: managed (faulting, prefetched) vs \
                UnifiedBuffer mirror vs pinned copy, 256 MiB and 4 GiB; allocation profiler \
                overhead per alloc+free",
        run: unified::run_suite,
    },
    Suite {
        name: telemetry::SUITE,
        about: "span overhead on the host: telemetry disabled (one branch) and enabled (GPU \
                events shared between span boundaries, pool bytes, histogram)",
        run: telemetry::run_suite,
    },
    Suite {
        name: tier::SUITE,
        about: "the tiered store: lz4 / zstd with and without the bf16 byte shuffle (GB/s per \
                core, ratio) on weights, activations and text; block migrations between GPU, \
                pinned host and disk (p50 / p99)",
        run: tier::run_suite,
    },
    Suite {
        name: dist::SUITE,
        about: "collectives of the CPU backend's in-process group: all-reduce of f32 over 4 \
                ranks (1 MiB to 256 MiB), algorithm and bus bandwidth, share of the \
                minimal-traffic bound from the host memcpy ceiling",
        run: dist::run_suite,
    },
    Suite {
        name: actors::SUITE,
        about: "persistent actors: round trip (64 / 256 B) against a doorbell, a kernel and a \
                graph per message; round trips under load; messages per second by batch and \
                producers; a two-actor device pipeline; terminate",
        run: actors::run_suite,
    },
    Suite {
        name: agents::SUITE,
        about: "GPU agents: Circles (FLAME GPU 2's benchmark model, spatial messages) agent-steps \
                per second at 1 M and 10 M agents, one CUDA graph per step vs eager launches, \
                against FLAME GPU 2's H100 figure; single-vote consensus latency p50 / p99",
        run: agents::run_suite,
    },
    Suite {
        name: serve::SUITE,
        about: "the job service over loopback HTTP: submission latency; latency, \
                throughput and busy fraction of 1-row and 256-row MoE jobs from several \
                clients and against offered load (open loop), with batch-1 serving, dynamic \
                batching (when idle, and Triton's window), the controller and two workers; \
                an asyncio + PyTorch peer",
        run: serve::run_suite,
    },
    Suite {
        name: moe::SUITE,
        about: "the MoE layer forward pass per preset (mixtral, qwen3, deepseek slice, \
                gpt-oss) and token count: the default path (device-driven grouped GEMMs in a graph \
                up to 256 tokens) vs the cuBLAS path vs PyTorch; the router + permutation \
                stages alone",
        run: moe::run_suite,
    },
];

/// The `kernels` suite: the streaming and router cases, then the exec floor's GEMM and
/// launch cases (issue: GEMM, graphs, lean launch), which share it.
fn run_kernels_suite(ctx: &mut Ctx) -> Result<()> {
    kernels::run_suite(ctx)?;
    exec::run_cases(ctx)
}

/// Settings of a run beyond the suites and the scale.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// An allocation trace for the `memory` suite to replay instead of its generated one
    /// (`warpdrive bench memory --replay TRACE.json`).
    pub memory_trace: Option<PathBuf>,
    /// Block sizes for the `tier` suite's disk cases alone (`warpdrive bench tier
    /// --tier-disk-sizes 67108864`): when not empty, the suite runs only those cases, at
    /// these sizes (64 MiB disk rows on a machine where the full scale takes too long).
    pub tier_disk_sizes: Vec<usize>,
}

impl Options {
    /// Reads and checks the files these options name (the `memory_trace`), so a missing or
    /// malformed one fails before any suite runs; the error names the file and why.
    pub fn check(&self) -> Result<()> {
        if let Some(path) = &self.memory_trace {
            memory::Trace::read(path)?;
        }
        Ok(())
    }
}

/// Every registered suite, in run order.
pub fn suites() -> &'static [Suite] {
    SUITES
}

/// The suite called `name`.
pub fn find_suite(name: &str) -> Option<&'static Suite> {
    SUITES.iter().find(|s| s.name == name)
}

/// The suites `names` name, in that order without repeats, or every suite when `names` is
/// empty; an unknown name is an error that lists the known ones.
pub fn select_suites<S: AsRef<str>>(names: &[S]) -> Result<Vec<&'static Suite>> {
    if names.is_empty() {
        return Ok(SUITES.iter().collect());
    }
    let mut out: Vec<&'static Suite> = Vec::new();
    for name in names.iter().map(AsRef::as_ref) {
        let suite = find_suite(name).ok_or_else(|| {
            let known: Vec<&str> = SUITES.iter().map(|s| s.name).collect();
            Error::InvalidArgument(format!(
                "unknown benchmark suite {name:?}; known suites: {}",
                known.join(", ")
            ))
        })?;
        if !out.iter().any(|s| s.name == suite.name) {
            out.push(suite);
        }
    }
    Ok(out)
}

/// What a suite runs with: the device and a stream on it, the measured ceilings, the size
/// scale, its [`Progress`], and the rows recorded so far.
pub struct Ctx {
    device: Device,
    stream: Stream,
    info: DeviceInfo,
    scale: Scale,
    ceilings: Ceilings,
    progress: Progress,
    suite: &'static str,
    rows: Vec<Row>,
    options: Options,
    peer_env: Vec<(String, String)>,
}

impl Ctx {
    /// A context on `device` (a new stream) with no ceilings, no rows and a hidden bar.
    pub fn new(device: &Device, scale: Scale) -> Result<Ctx> {
        Ok(Ctx {
            device: device.clone(),
            stream: device.new_stream()?,
            info: device.info()?,
            scale,
            ceilings: Ceilings::default(),
            progress: Progress::hidden(),
            suite: "",
            rows: Vec::new(),
            options: Options::default(),
            peer_env: Vec::new(),
        })
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Sets an environment variable for the peer scripts run after the suites (e.g. the
    /// path of a file the peer must read too).
    pub fn set_peer_env(&mut self, key: &str, value: &str) {
        self.peer_env.retain(|(k, _)| k != key);
        self.peer_env.push((key.to_string(), value.to_string()));
    }

    pub fn peer_env(&self) -> &[(String, String)] {
        &self.peer_env
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device's description, read when the context was made.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn scale(&self) -> Scale {
        self.scale
    }

    /// True when cases use smaller sizes than the issues name (the CPU backend, tests).
    pub fn quick(&self) -> bool {
        self.scale.quick()
    }

    /// The ceilings measured so far in this run (all `None` before the `ceilings` suite).
    pub fn ceilings(&self) -> &Ceilings {
        &self.ceilings
    }

    pub fn set_ceilings(&mut self, ceilings: Ceilings) {
        self.ceilings = ceilings;
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    pub fn set_progress(&mut self, progress: Progress) {
        self.progress = progress;
    }

    /// The suite now running (each row's `suite`).
    pub fn suite(&self) -> &'static str {
        self.suite
    }

    /// Shows `message` as the current step (a line when stderr is not a terminal).
    pub fn step(&self, message: impl Into<String>) {
        self.progress.step(message.into());
    }

    /// Prints `warning: <message>` on stderr without breaking the progress bar.
    pub fn warn(&self, message: &str) {
        self.progress.warn(message);
    }

    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// The last row recorded, to add to its `extra`.
    pub fn rows_mut_last(&mut self) -> Option<&mut Row> {
        self.rows.last_mut()
    }

    /// Records a row as it is.
    pub fn push(&mut self, row: Row) -> &mut Row {
        self.rows.push(row);
        let last = self.rows.len() - 1;
        &mut self.rows[last]
    }

    /// Records a case of the current suite that moves `bytes` per operation (as the case
    /// counts them): `gbps = bytes / median`, and `pct_of_ceiling` against `ceiling`.
    pub fn record_bytes(
        &mut self,
        case: &str,
        size: u64,
        variant: &str,
        samples_us: &mut [f64],
        bytes: f64,
        ceiling: Option<Ceiling>,
    ) -> Result<&mut Row> {
        let row = Row::from_samples(self.suite, case, size, variant, samples_us)?.with_bytes(bytes);
        Ok(self.push(self.cite(row, ceiling)))
    }

    /// Records a case of the current suite that does `flops` floating-point operations per
    /// operation: `tflops = flops / median`, and `pct_of_ceiling` against `ceiling`.
    pub fn record_flops(
        &mut self,
        case: &str,
        size: u64,
        variant: &str,
        samples_us: &mut [f64],
        flops: f64,
        ceiling: Option<Ceiling>,
    ) -> Result<&mut Row> {
        let row = Row::from_samples(self.suite, case, size, variant, samples_us)?.with_flops(flops);
        Ok(self.push(self.cite(row, ceiling)))
    }

    /// Records a case of the current suite measured by time alone (`pct_of_ceiling` against a
    /// time ceiling such as [`Ceiling::Launch`], if given).
    pub fn record_time(
        &mut self,
        case: &str,
        size: u64,
        variant: &str,
        samples_us: &mut [f64],
        ceiling: Option<Ceiling>,
    ) -> Result<&mut Row> {
        let row = Row::from_samples(self.suite, case, size, variant, samples_us)?;
        Ok(self.push(self.cite(row, ceiling)))
    }

    /// `row` against `ceiling`. A suite's own `ceiling` row (the ceiling's work measured
    /// again beside its cases) cites none, naming it in `extra.remeasures` instead: against
    /// itself it would read 100 % by construction, or more on a fast run.
    fn cite(&self, row: Row, ceiling: Option<Ceiling>) -> Row {
        match ceiling {
            Some(c) if row.variant == ceilings::VARIANT && self.suite != ceilings::SUITE => {
                row.with_extra("remeasures", c.key())
            }
            Some(c) => row.against(c, &self.ceilings),
            None => row,
        }
    }

    /// The results file of this context: its device, ceilings and rows, dated now.
    pub fn into_results(self) -> Results {
        Results::new(&self.info, self.ceilings, self.rows)
    }
}

/// What [`run_suites`] produced: the results of every suite that ran, and the suites that
/// failed part-way (their rows up to the failure are kept).
#[derive(Debug)]
pub struct Outcome {
    pub results: Results,
    /// The suites that ran, in order (`ceilings` first).
    pub ran: Vec<&'static str>,
    pub failed: Vec<(&'static str, Error)>,
    /// Environment the suites set for their peer scripts (pass it to [`run_peers`]).
    pub peer_env: Vec<(String, String)>,
}

/// Runs the `ceilings` suite and then `suites` (in order, `ceilings` once) on `device` at
/// `scale`, with a progress bar on stderr (a line per step when stderr is not a terminal). A suite that fails is
/// reported in [`Outcome::failed`] and the others still run; it fails outright only when no
/// stream or device information can be had, or (before any suite runs) when
/// [`Options::check`] fails.
pub fn run_suites(device: &Device, suites: &[&'static Suite], scale: Scale) -> Result<Outcome> {
    run_suites_with(device, suites, scale, &Options::default())
}

/// [`run_suites`] with [`Options`].
pub fn run_suites_with(
    device: &Device,
    suites: &[&'static Suite],
    scale: Scale,
    options: &Options,
) -> Result<Outcome> {
    options.check()?;
    let mut order: Vec<&'static Suite> = Vec::with_capacity(suites.len() + 1);
    if let Some(c) = find_suite(ceilings::SUITE) {
        order.push(c);
    }
    for s in suites {
        if !order.iter().any(|o| o.name == s.name) {
            order.push(s);
        }
    }
    let mut ctx = Ctx::new(device, scale)?;
    ctx.options = options.clone();
    ctx.set_progress(Progress::on_stderr(order.len() as u64));
    let mut failed = Vec::new();
    let ran: Vec<&'static str> = order.iter().map(|s| s.name).collect();
    let count = order.len();
    for (i, suite) in order.into_iter().enumerate() {
        ctx.suite = suite.name;
        ctx.step(format!("{} (suite {} of {count})", suite.name, i + 1));
        // A span per suite on the bench stream (recorded only while telemetry is on).
        let span = warpdrive::telemetry::span(suite.name, &ctx.stream);
        let ran = (suite.run)(&mut ctx);
        drop(span);
        if let Err(e) = ran {
            ctx.warn(&format!("suite {} failed: {e}", suite.name));
            failed.push((suite.name, e));
        }
        ctx.progress.inc();
    }
    ctx.progress.finish();
    let peer_env = std::mem::take(&mut ctx.peer_env);
    Ok(Outcome {
        results: ctx.into_results(),
        ran,
        failed,
        peer_env,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_has_ceilings_and_selection_checks_names() {
        assert!(suites().iter().any(|s| s.name == "ceilings"));
        let names: Vec<&str> = suites().iter().map(|s| s.name).collect();
        let mut unique = names.clone();
        unique.dedup();
        assert_eq!(names, unique);
        assert_eq!(select_suites::<&str>(&[]).unwrap().len(), suites().len());
        let picked = select_suites(&["ceilings", "ceilings"]).unwrap();
        assert_eq!(picked.len(), 1);
        let err = select_suites(&["nope"]).unwrap_err().to_string();
        assert!(err.contains("nope") && err.contains("ceilings"), "{err}");
    }

    #[test]
    fn scale_follows_the_backend() {
        assert_eq!(Scale::for_device(&Device::cpu()), Scale::Quick);
        assert!(Scale::Quick.quick() && Scale::Tiny.quick() && !Scale::Full.quick());
    }

    #[test]
    fn tiny_run_on_the_cpu_records_ceiling_rows() {
        let suites = select_suites(&["ceilings"]).unwrap();
        let out = run_suites(&Device::cpu(), &suites, Scale::Tiny).unwrap();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        assert_eq!(out.ran, ["ceilings"]);
        let r = &out.results;
        assert_eq!(r.device.backend, "cpu");
        assert!(r.ceilings.host_memcpy_gbps.is_some());
        assert!(r.ceilings.cpu_gemm_f32_gflops.is_some());
        let cases: Vec<&str> = r.rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(cases, ["host_memcpy", "cpu_gemm_f32"]);
        for row in &r.rows {
            assert_eq!(
                (row.suite.as_str(), row.variant.as_str()),
                ("ceilings", "ceiling")
            );
            assert!(row.p10 <= row.median && row.median <= row.p90);
            let pct = row.pct_of_ceiling.unwrap();
            assert!((pct - 100.0).abs() < 1e-6, "{pct}");
            let c = row.named_ceiling().unwrap();
            assert_eq!(row.case, c.case());
        }
        assert!(r.rows[0].gbps.is_some() && r.rows[0].tflops.is_none());
        assert!(r.rows[1].tflops.is_some() && r.rows[1].gbps.is_none());
    }

    #[test]
    fn ctx_record_helpers_cite_the_ceilings() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = "demo";
        ctx.set_ceilings(Ceilings {
            host_memcpy_gbps: Some(10.0),
            cpu_gemm_f32_gflops: Some(100.0),
            ..Ceilings::default()
        });
        // 5e3 bytes in 1 µs = 5 GB/s = 50 % of 10 GB/s.
        let row = ctx
            .record_bytes(
                "copy",
                5000,
                "warpdrive",
                &mut [1.0],
                5e3,
                Some(Ceiling::HostMemcpy),
            )
            .unwrap();
        assert_eq!(row.suite, "demo");
        assert!((row.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
        let row = ctx
            .record_flops(
                "mm",
                8,
                "baseline",
                &mut [2.0, 2.0],
                1e5,
                Some(Ceiling::CpuGemmF32),
            )
            .unwrap();
        // 1e5 flops in 2 µs = 50 GFLOP/s = 50 %.
        assert!((row.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
        let row = ctx
            .record_time("t", 1, "baseline", &mut [3.0], None)
            .unwrap();
        assert_eq!(row.pct_of_ceiling, None);
        assert!(ctx.record_time("t", 1, "baseline", &mut [], None).is_err());
        // A suite's own re-measurement of a ceiling does not cite it (it would read 100 % or
        // more against itself): it names it instead.
        let row = ctx
            .record_bytes(
                "copy",
                5000,
                "ceiling",
                &mut [0.1],
                5e3,
                Some(Ceiling::HostMemcpy),
            )
            .unwrap();
        assert_eq!(row.pct_of_ceiling, None);
        assert_eq!(row.named_ceiling(), None);
        assert_eq!(row.extra["remeasures"], "host_memcpy_gbps");
        assert_eq!(ctx.rows().len(), 4);
        assert_eq!(ctx.into_results().rows.len(), 4);
    }
}
