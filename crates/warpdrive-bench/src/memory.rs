//! The `memory` suite: what an allocation costs, and how much memory a pool holds for what
//! is live.
//!
//! - `alloc-free` (size = bytes): µs per allocate + free pair on one stream, host clock over
//!   many pairs, median over repeats. `driver-cuMemAlloc` (`cuMemAlloc` + `cuMemFree`),
//!   `driver-async-pool` (`cuMemAllocFromPoolAsync` + `cuMemFreeAsync`, release threshold at
//!   the max), `warpdrive` (`Buffer::uninit` + drop on the caching pool) and
//!   `warpdrive-cuda-async` (the same through the CUDA-async strategy). On the CPU backend:
//!   `baseline` (the host allocator) and `warpdrive`. Peers: `torch-empty`,
//!   `torch-caching-allocator`.
//! - `fragmentation-trace` (size = allocations in the trace): a seeded trace of mixed
//!   allocations freed out of order ([`generate_trace`], format in `bench/peers/README.md`)
//!   replayed on a fresh pool; median = µs per allocation (its free included), and
//!   `extra.reserved_over_peak` = peak reserved / peak live requested bytes. The trace file
//!   is handed to the peer script (`torch-caching-allocator`) through [`TRACE_ENV`].
//!   `warpdrive bench memory --replay TRACE.json` replays a given trace instead.
//! - `pinned-alloc-free` (size = bytes): `driver-cuMemHostAlloc` (`cuMemHostAlloc` flags 0 +
//!   `cuMemFreeHost`) vs `warpdrive` (`PinnedBuf::new` + drop); `baseline` on the CPU.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use warpdrive::device::probe::{self, DriverPool};
use warpdrive::device::Stream;
use warpdrive::error::{Error, Result};
use warpdrive::memory::{Buffer, DevicePool, PinnedBuf, PinnedPool, PoolStrategy};

use super::{Ctx, Row, Scale};

pub(crate) const SUITE: &str = "memory";

/// The trace file the peer script replays: set for it by this suite.
pub const TRACE_ENV: &str = "WARPDRIVE_MEMORY_TRACE";
/// The `format` of a trace file.
pub const TRACE_FORMAT: &str = "warpdrive-alloc-trace/1";
/// The seed of the generated trace.
pub const TRACE_SEED: u64 = 0x5eed_a110c;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The sizes of `alloc-free` and `pinned-alloc-free`.
const SIZES: [usize; 5] = [512, 64 * KIB, MIB, 16 * MIB, 256 * MIB];

/// One step of an allocation trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `bytes` under `id` (ids are `0..allocations`, each allocated once).
    Alloc { id: usize, bytes: usize },
    /// Free what `id` holds.
    Free { id: usize },
}

/// A sequence of allocations and frees, as `--replay` and the peer script read it.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub seed: u64,
    pub ops: Vec<TraceOp>,
}

impl Trace {
    pub fn allocations(&self) -> usize {
        self.ops
            .iter()
            .filter(|o| matches!(o, TraceOp::Alloc { .. }))
            .count()
    }

    /// The most requested bytes live at once (the trace's own figure, the same for every
    /// allocator that replays it).
    pub fn peak_live_bytes(&self) -> u64 {
        let mut sizes = vec![0usize; self.allocations()];
        let (mut live, mut peak) = (0u64, 0u64);
        for op in &self.ops {
            match *op {
                TraceOp::Alloc { id, bytes } => {
                    if let Some(s) = sizes.get_mut(id) {
                        *s = bytes;
                    }
                    // Saturating: a trace read from a file may ask for more than u64 holds.
                    live = live.saturating_add(bytes as u64);
                    peak = peak.max(live);
                }
                TraceOp::Free { id } => {
                    live = live.saturating_sub(sizes.get(id).copied().unwrap_or(0) as u64)
                }
            }
        }
        peak
    }

    /// The JSON form: `{"format", "seed", "allocations", "peak_live_bytes", "ops"}` with
    /// `ops` as `["a", id, bytes]` and `["f", id]`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(self.ops.len() * 16 + 128);
        let _ = write!(
            out,
            "{{\"format\": \"{TRACE_FORMAT}\", \"seed\": {}, \"allocations\": {}, \
             \"peak_live_bytes\": {}, \"ops\": [",
            self.seed,
            self.allocations(),
            self.peak_live_bytes()
        );
        for (i, op) in self.ops.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = match *op {
                TraceOp::Alloc { id, bytes } => write!(out, "{sep}\n[\"a\",{id},{bytes}]"),
                TraceOp::Free { id } => write!(out, "{sep}\n[\"f\",{id}]"),
            };
        }
        out.push_str("\n]}\n");
        out
    }

    /// Parses the JSON form, checking that the ids are `0..allocations`, each allocated once
    /// before it is freed, and freed at most once.
    pub fn from_json(text: &str) -> Result<Trace> {
        let bad = |m: String| Error::InvalidArgument(format!("allocation trace: {m}"));
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if v["format"] != TRACE_FORMAT {
            return Err(bad(format!(
                "format is {}, expected {TRACE_FORMAT:?}",
                v["format"]
            )));
        }
        let seed = v["seed"].as_u64().unwrap_or(0);
        let list = v["ops"]
            .as_array()
            .ok_or_else(|| bad("no `ops` array".into()))?;
        let allocations = list
            .iter()
            .filter(|op| op.get(0).and_then(Value::as_str) == Some("a"))
            .count();
        let mut ops = Vec::with_capacity(list.len());
        let mut state = vec![0u8; allocations]; // 0 unseen, 1 live, 2 freed
        for (i, op) in list.iter().enumerate() {
            let parts = op.as_array().map(Vec::as_slice).unwrap_or(&[]);
            let num = |j: usize| {
                parts
                    .get(j)
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "op {i}: expected [\"a\", id, bytes] or [\"f\", id]"
                        ))
                    })
            };
            let id = num(1)?;
            if id >= allocations {
                return Err(bad(format!(
                    "op {i}: id {id} is not below the trace's {allocations} allocations"
                )));
            }
            match parts.first().and_then(Value::as_str) {
                Some("a") if parts.len() == 3 && state[id] == 0 => {
                    state[id] = 1;
                    ops.push(TraceOp::Alloc { id, bytes: num(2)? });
                }
                Some("f") if parts.len() == 2 && state[id] == 1 => {
                    state[id] = 2;
                    ops.push(TraceOp::Free { id });
                }
                _ => {
                    return Err(bad(format!(
                        "op {i} is malformed, reuses id {id} or frees it while not live"
                    )))
                }
            }
        }
        Ok(Trace { seed, ops })
    }

    /// Reads and parses a trace file; every error names the file.
    pub fn read(path: &Path) -> Result<Trace> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Trace::from_json(&text).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|e| Error::io(path, e))
    }
}

/// A seeded trace of `allocations` allocations shaped like an LLM server's: mostly small
/// short-lived tensors (256 B–1 MiB), some medium ones (1–32 MiB, KV blocks and
/// activations), a few large long-lived ones (32–512 MiB), each freed after a random
/// lifetime, so frees come out of order; everything still live is freed at the end in
/// random order. Sizes are divided by `size_div` (1 on a GPU; more on the CPU backend).
pub fn generate_trace(allocations: usize, seed: u64, size_div: usize) -> Trace {
    let mut rng = SmallRng::seed_from_u64(seed);
    let log_uniform = |rng: &mut SmallRng, lo: usize, hi: usize| -> usize {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        rng.random_range(a..b).exp() as usize
    };
    // (death step, id), kept sorted by death so the due ones come off the front.
    let mut due: std::collections::BTreeSet<(u64, usize)> = Default::default();
    let mut ops = Vec::with_capacity(allocations * 2);
    for id in 0..allocations {
        let step = id as u64;
        let mut now: Vec<usize> = Vec::new();
        while let Some(&(death, victim)) = due.first() {
            if death > step {
                break;
            }
            due.pop_first();
            now.push(victim);
        }
        // Frees that fall due together come in random order.
        for i in (1..now.len()).rev() {
            now.swap(i, rng.random_range(0..=i));
        }
        ops.extend(now.into_iter().map(|id| TraceOp::Free { id }));
        let (bytes, mean_life) = match rng.random_range(0..100) {
            0..=74 => (log_uniform(&mut rng, 256, MIB), 40.0),
            75..=96 => (log_uniform(&mut rng, MIB, 32 * MIB), 400.0),
            _ => (log_uniform(&mut rng, 32 * MIB, 512 * MIB), 2500.0),
        };
        let life = (-rng.random_range(f64::EPSILON..1.0f64).ln() * mean_life) as u64 + 1;
        ops.push(TraceOp::Alloc {
            id,
            bytes: (bytes / size_div.max(1)).max(1),
        });
        due.insert((step + life, id));
    }
    let mut rest: Vec<usize> = due.into_iter().map(|(_, id)| id).collect();
    for i in (1..rest.len()).rev() {
        rest.swap(i, rng.random_range(0..=i));
    }
    ops.extend(rest.into_iter().map(|id| TraceOp::Free { id }));
    Trace { seed, ops }
}

/// Replays `trace` on `pool` with buffers on `stream`; returns µs per allocation (frees
/// included) on the host clock.
pub fn replay(pool: &std::sync::Arc<DevicePool>, stream: &Stream, trace: &Trace) -> Result<f64> {
    let mut live: Vec<Option<Buffer<u8>>> = Vec::new();
    live.resize_with(trace.allocations(), || None);
    let t = Instant::now();
    for op in &trace.ops {
        match *op {
            TraceOp::Alloc { id, bytes } => {
                let slot = live
                    .get_mut(id)
                    .ok_or_else(|| Error::InvalidArgument(format!("trace id {id} out of range")))?;
                *slot = Some(Buffer::uninit_in(pool, stream, bytes)?);
            }
            TraceOp::Free { id } => drop(live.get_mut(id).and_then(Option::take)),
        }
    }
    drop(live);
    stream.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / trace.allocations().max(1) as f64)
}

/// Repetitions and pair counts at one scale.
struct Plan {
    repeats: usize,
    pool_pairs: usize,
    driver_pairs: usize,
    async_pairs: usize,
    host_pinned_pairs: usize,
    trace_allocations: usize,
    trace_repeats: usize,
    trace_size_div: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                repeats: 9,
                pool_pairs: 20_000,
                driver_pairs: 30,
                async_pairs: 2_000,
                host_pinned_pairs: 10,
                trace_allocations: 100_000,
                trace_repeats: 3,
                trace_size_div: 1,
            },
            Scale::Quick => Plan {
                repeats: 7,
                pool_pairs: 5_000,
                driver_pairs: 30,
                async_pairs: 500,
                host_pinned_pairs: 10,
                trace_allocations: 10_000,
                trace_repeats: 3,
                trace_size_div: 16,
            },
            Scale::Tiny => Plan {
                repeats: 3,
                pool_pairs: 100,
                driver_pairs: 3,
                async_pairs: 10,
                host_pinned_pairs: 2,
                trace_allocations: 1_000,
                trace_repeats: 1,
                trace_size_div: 256,
            },
        }
    }
}

/// µs per operation, `repeats` samples of `pairs` operations each after one warm-up.
fn samples(repeats: usize, mut once: impl FnMut() -> Result<f64>) -> Result<Vec<f64>> {
    once()?;
    (0..repeats.max(1)).map(|_| once()).collect()
}

/// µs per call of `f`, over `pairs` calls on the host clock.
fn per_pair(pairs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let pairs = pairs.max(1);
    let t = Instant::now();
    for _ in 0..pairs {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / pairs as f64)
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    alloc_free(ctx, &plan)?;
    fragmentation(ctx, &plan)?;
    pinned(ctx, &plan)
}

/// Every size on a GPU; up to 16 MiB on the CPU backend (its allocator zeroes memory, so
/// 256 MiB pairs take a quarter of a second each); three in unit tests.
fn sizes(scale: Scale) -> &'static [usize] {
    match scale {
        Scale::Full => &SIZES,
        Scale::Quick => &SIZES[..4],
        Scale::Tiny => &SIZES[..3],
    }
}

fn alloc_free(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "alloc-free";
    let device = ctx.device().clone();
    let stream = ctx.stream().clone();
    let pool = DevicePool::new(&device, PoolStrategy::default())?;
    let async_pool = match device.is_cuda() {
        true => Some(DevicePool::new(&device, PoolStrategy::CudaAsync)?),
        false => None,
    };
    for &size in sizes(ctx.scale()) {
        ctx.step(format!("{SUITE}: {CASE} at {size} B"));
        let driver_name = if device.is_cuda() {
            "driver-cuMemAlloc"
        } else {
            "baseline"
        };
        let mut driver = samples(plan.repeats, || {
            per_pair(plan.driver_pairs, || probe::alloc_free_pair(&device, size))
        })?;
        let row = ctx.record_time(CASE, size as u64, driver_name, &mut driver, None)?;
        let driver_median = with_timer(row, plan.driver_pairs).median;

        let mut async_median = None;
        if async_pool.is_some() {
            let raw = DriverPool::new(&device)?;
            // Host clock over the pairs and one stream synchronise at the end.
            let mut t = samples(plan.repeats, || {
                let pairs = plan.async_pairs.max(1);
                let t = Instant::now();
                for _ in 0..pairs {
                    raw.alloc_free_pair(&stream, size)?;
                }
                stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64() * 1e6 / pairs as f64)
            })?;
            let row = ctx.record_time(CASE, size as u64, "driver-async-pool", &mut t, None)?;
            async_median = Some(with_timer(row, plan.async_pairs).median);
        }

        for (variant, p) in [
            ("warpdrive", Some(&pool)),
            ("warpdrive-cuda-async", async_pool.as_ref()),
        ] {
            let Some(p) = p else { continue };
            let pairs = if variant == "warpdrive" {
                plan.pool_pairs
            } else {
                plan.async_pairs
            };
            let mut t = samples(plan.repeats, || {
                let r = per_pair(pairs, || {
                    drop(Buffer::<u8>::uninit_in(p, &stream, size)?);
                    Ok(())
                });
                stream.synchronize()?;
                r
            })?;
            let row = ctx.record_time(CASE, size as u64, variant, &mut t, None)?;
            let median = with_timer(row, pairs).median;
            row.extra.insert(
                format!("x_faster_than_{driver_name}"),
                (driver_median / median).into(),
            );
            if let Some(a) = async_median {
                row.extra.insert(
                    "x_faster_than_driver-async-pool".into(),
                    (a / median).into(),
                );
            }
        }
    }
    pool.trim()?;
    if let Some(p) = &async_pool {
        p.trim()?;
    }
    Ok(())
}

/// Names the host-clock method of a per-pair timing in the row's `extra`.
fn with_timer(row: &mut Row, pairs: usize) -> &mut Row {
    row.extra.insert("timer".into(), "host clock".into());
    row.extra.insert("pairs_per_sample".into(), pairs.into());
    row
}

/// The trace to replay: `--replay PATH`, or a generated one written to a temporary file.
fn trace_for(ctx: &mut Ctx, plan: &Plan) -> Result<(Trace, PathBuf)> {
    if let Some(path) = ctx.options().memory_trace.clone() {
        return Ok((Trace::read(&path)?, path));
    }
    let trace = generate_trace(plan.trace_allocations, TRACE_SEED, plan.trace_size_div);
    let path = std::env::temp_dir().join(format!(
        "warpdrive-memory-trace-{}-{}.json",
        plan.trace_allocations,
        std::process::id()
    ));
    trace.write(&path)?;
    Ok((trace, path))
}

fn fragmentation(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "fragmentation-trace";
    ctx.step(format!("{SUITE}: {CASE}"));
    let (trace, path) = trace_for(ctx, plan)?;
    ctx.set_peer_env(TRACE_ENV, &path.to_string_lossy());
    let device = ctx.device().clone();
    let stream = ctx.stream().clone();
    let n = trace.allocations() as u64;
    let peak_live = trace.peak_live_bytes().max(1);
    let mut strategies = vec![("warpdrive", PoolStrategy::default())];
    if device.is_cuda() {
        strategies.push(("warpdrive-cuda-async", PoolStrategy::CudaAsync));
    }
    for (variant, strategy) in strategies {
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..plan.trace_repeats.max(1) {
            let pool = DevicePool::new(&device, strategy.clone())?;
            times.push(replay(&pool, &stream, &trace)?);
            last = Some(pool.stats()?);
            pool.trim()?;
        }
        let Some(stats) = last else { continue };
        let row = ctx.record_time(CASE, n, variant, &mut times, None)?;
        let e = &mut row.extra;
        e.insert(
            "reserved_over_peak".into(),
            (stats.peak_reserved as f64 / peak_live as f64).into(),
        );
        e.insert("peak_reserved_bytes".into(), stats.peak_reserved.into());
        e.insert("peak_live_bytes".into(), peak_live.into());
        e.insert("peak_in_use_bytes".into(), stats.peak_in_use.into());
        if variant == "warpdrive" {
            // The async strategy's segment traffic happens inside the driver, unseen.
            e.insert("driver_allocs".into(), stats.driver_allocs.into());
            e.insert("driver_frees".into(), stats.driver_frees.into());
        }
        e.insert("trace_seed".into(), trace.seed.into());
        e.insert(
            "timer".into(),
            "host clock, µs per allocation incl. its free".into(),
        );
    }
    Ok(())
}

fn pinned(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "pinned-alloc-free";
    let device = ctx.device().clone();
    let pool = PinnedPool::new(&device);
    for &size in sizes(ctx.scale()) {
        ctx.step(format!("{SUITE}: {CASE} at {size} B"));
        let pairs = if size >= 16 * MIB {
            (plan.host_pinned_pairs / 3).max(2)
        } else {
            plan.host_pinned_pairs
        };
        let (name, repeats) = match device.is_cuda() {
            true => ("driver-cuMemHostAlloc", plan.repeats.min(5)),
            false => ("baseline", plan.repeats),
        };
        let mut t = samples(repeats, || {
            per_pair(pairs, || probe::pinned_alloc_free_pair(&device, size))
        })?;
        let row = ctx.record_time(CASE, size as u64, name, &mut t, None)?;
        let driver_median = with_timer(row, pairs).median;
        let mut t = samples(plan.repeats, || {
            per_pair(plan.pool_pairs, || {
                drop(PinnedBuf::<u8>::new_in(&pool, size)?);
                Ok(())
            })
        })?;
        let row = ctx.record_time(CASE, size as u64, "warpdrive", &mut t, None)?;
        let median = with_timer(row, plan.pool_pairs).median;
        row.extra.insert(
            format!("x_faster_than_{name}"),
            (driver_median / median).into(),
        );
    }
    pool.trim()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_traces_are_seeded_valid_and_round_trip_through_json() {
        let t = generate_trace(2000, 7, 1);
        assert_eq!(t, generate_trace(2000, 7, 1));
        assert_ne!(t, generate_trace(2000, 8, 1));
        assert_eq!(t.allocations(), 2000);
        assert_eq!(t.ops.len(), 4000, "every allocation is freed");
        let back = Trace::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
        // Out of order: some free comes before an earlier allocation's free.
        let frees: Vec<usize> = t
            .ops
            .iter()
            .filter_map(|o| match o {
                TraceOp::Free { id } => Some(*id),
                _ => None,
            })
            .collect();
        assert!(frees.windows(2).any(|w| w[0] > w[1]));
        let small = t
            .ops
            .iter()
            .filter(|o| matches!(o, TraceOp::Alloc { bytes, .. } if *bytes <= MIB))
            .count();
        assert!(small > 1200 && small < 1800, "{small}");
        assert!(t.peak_live_bytes() > 0);
    }

    #[test]
    fn bad_traces_are_errors() {
        let ok = r#"{"format": "warpdrive-alloc-trace/1", "ops": [["a",0,10],["f",0]]}"#;
        assert_eq!(Trace::from_json(ok).unwrap().peak_live_bytes(), 10);
        for bad in [
            "nope",
            r#"{"format": "other", "ops": []}"#,
            r#"{"format": "warpdrive-alloc-trace/1"}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["f",0]]}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["a",0,1],["a",0,1]]}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["a",0,1],["f",0],["f",0]]}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["x",0]]}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["a",1,1],["f",1]]}"#,
            r#"{"format": "warpdrive-alloc-trace/1", "ops": [["a",18446744073709551615,1]]}"#,
        ] {
            assert!(Trace::from_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tiny_memory_suite_on_the_cpu_records_every_case() {
        let mut ctx = Ctx::new(&warpdrive::Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        let find = |case: &str, variant: &str| {
            rows.iter()
                .filter(|r| r.case == case && r.variant == variant)
                .count()
        };
        assert_eq!(find("alloc-free", "warpdrive"), 3);
        assert_eq!(find("alloc-free", "baseline"), 3);
        assert_eq!(find("pinned-alloc-free", "warpdrive"), 3);
        assert_eq!(find("fragmentation-trace", "warpdrive"), 1);
        let trace_row = rows
            .iter()
            .find(|r| r.case == "fragmentation-trace")
            .unwrap();
        let ratio = trace_row.extra["reserved_over_peak"].as_f64().unwrap();
        assert!(ratio >= 1.0, "{ratio}");
        let path = ctx
            .peer_env()
            .iter()
            .find(|(k, _)| k == TRACE_ENV)
            .unwrap()
            .1
            .clone();
        let trace = Trace::read(Path::new(&path)).unwrap();
        assert_eq!(trace.allocations() as u64, trace_row.size);
        let _ = std::fs::remove_file(path);
        assert!(rows.iter().all(|r| r.p10 <= r.median && r.median <= r.p90));
    }
}
