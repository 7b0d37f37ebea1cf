//! Launch autotuning with a persisted cache, and the batch-size knee.
//!
//! [`Autotuner::tune`] times each candidate configuration of a kernel once per
//! [`TuneKey`] — (kernel, dtype, power-of-two bucket of the main dimension, device, host)
//! — and
//! keeps every candidate's time and the winner in a TOML file under the cache directory
//! (`$XDG_CACHE_HOME/warpdrive/autotune.toml`, fallback `~/.cache/...`), read on the next
//! start. Every field has a default, so files written by older versions still load; a file
//! that does not parse is ignored with a warning (and replaced on the next save). A save
//! holds an exclusive lock on `autotune.toml.lock` beside the file (waiting at most
//! [`SAVE_LOCK_TIMEOUT`]), merges with what the file holds then (the newer record of a key
//! wins), and writes atomically (temp file + rename), so processes tuning at the same time
//! keep each other's records.
//!
//! [`batch_knee`] sweeps batch sizes and returns the knee: the smallest batch whose
//! throughput reaches [`KNEE_FRACTION`] of the best measured.

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::device::{Device, Stream};
use crate::dtype::DTypeKind;
use crate::error::{Error, Result};

/// The version written in new files.
pub const FILE_VERSION: u32 = 1;
/// Timed runs per candidate at least (after one warm-up run); the median is kept.
pub const TUNE_REPS: usize = 5;
/// Timed runs per candidate at most: quick candidates get more rounds, up to about
/// [`TUNE_BUDGET_S`] of timing, since their medians drift more between few runs (few rounds
/// picked the slower of two compressions; bench/NOTES.md, autotuning).
pub const TUNE_REPS_MAX: usize = 101;
/// The timing a tuning aims for (seconds), as measured by a pass after the warm-up: a tuning runs
/// once per device, kernel and size bucket and is kept, so a pick made on a noisy stretch
/// costs every later call.
pub const TUNE_BUDGET_S: f64 = 0.25;
/// How long a save waits for another process's save (which holds the file's lock for the
/// few milliseconds of a read and a write) before giving up on this one.
pub const SAVE_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// The knee of a batch sweep: the smallest batch reaching this fraction of the best
/// throughput.
pub const KNEE_FRACTION: f64 = 0.95;

/// What a tuning result is kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TuneKey {
    pub kernel: String,
    pub dtype: String,
    /// `ceil(log2(size))` of the main dimension (0 for sizes 0 and 1).
    pub bucket: u32,
    /// The device's name and architecture (`NVIDIA H200 sm_90a`), or `cpu`.
    pub device: String,
    /// The host's CPU model and thread count ([`host_fingerprint`]): the tunings so far
    /// (copy threads and chunks, compression) depend on the host as much as on the GPU, and
    /// a cache file can travel with a home directory or container image to another machine.
    pub host: String,
}

impl TuneKey {
    /// The key of `kernel` on `dtype` at main dimension `size` on `device`.
    pub fn new(device: &Device, kernel: &str, dtype: DTypeKind, size: usize) -> Result<TuneKey> {
        let device = device.model()?;
        Ok(TuneKey {
            kernel: kernel.to_string(),
            dtype: dtype.name().to_string(),
            bucket: size_bucket(size),
            device,
            host: host_fingerprint().to_string(),
        })
    }
}

/// This host as tunings key it: the CPU model and the threads available to the process
/// (`Intel(R) Xeon(R) Processor x16`); read once.
pub fn host_fingerprint() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        format!("{} x{threads}", crate::device::cpu_model())
    })
}

/// `ceil(log2(size))`: sizes in (2ᵇ⁻¹, 2ᵇ] share bucket `b`; exact up to `usize::MAX`
/// (bucket 64 on 64-bit hosts), where rounding up to a power of two would overflow.
pub fn size_bucket(size: usize) -> u32 {
    match size {
        0 | 1 => 0,
        n => usize::BITS - (n - 1).leading_zeros(),
    }
}

/// One candidate's time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CandidateTime {
    /// The candidate as it displays (`256`, `128x4`, ...).
    pub config: String,
    /// Median µs per run.
    pub us: f64,
}

/// Every candidate's time and the winner for one key, as the file keeps it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TuneRecord {
    pub kernel: String,
    pub dtype: String,
    pub bucket: u32,
    pub device: String,
    /// The host it was tuned on (empty in files from before hosts were recorded: those
    /// records serve any host until retuned).
    pub host: String,
    /// The size the candidates were timed at.
    pub size: u64,
    pub winner: String,
    pub candidates: Vec<CandidateTime>,
    /// When it was tuned (seconds since the Unix epoch).
    pub tuned_unix: u64,
}

impl TuneRecord {
    fn matches(&self, key: &TuneKey) -> bool {
        self.kernel == key.kernel
            && self.dtype == key.dtype
            && self.bucket == key.bucket
            && self.device == key.device
            && (self.host.is_empty() || self.host == key.host)
    }

    /// True when `self` stands for `other` in the file: the same kernel, dtype, bucket and
    /// device, tuned on the same host or `other` serves any host (as [`Autotuner::tune`]
    /// replaces what `matches` its key).
    fn covers(&self, other: &TuneRecord) -> bool {
        self.kernel == other.kernel
            && self.dtype == other.dtype
            && self.bucket == other.bucket
            && self.device == other.device
            && (self.host == other.host || other.host.is_empty())
    }
}

/// `disk` with `ours` merged in: of two records for one key, the newer stays (ours on a tie).
fn merge(disk: Vec<TuneRecord>, ours: Vec<TuneRecord>) -> Vec<TuneRecord> {
    let mut merged = disk;
    for r in ours {
        if merged
            .iter()
            .any(|m| m.covers(&r) && m.tuned_unix > r.tuned_unix)
        {
            continue;
        }
        merged.retain(|m| !(r.covers(m) && r.tuned_unix >= m.tuned_unix));
        merged.push(r);
    }
    merged
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct TuneFile {
    version: u32,
    records: Vec<TuneRecord>,
}

/// Tuning results in memory and on disk. Thread-safe.
pub struct Autotuner {
    path: Option<PathBuf>,
    records: Mutex<Vec<TuneRecord>>,
    tunings: AtomicUsize,
}

impl std::fmt::Debug for Autotuner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Autotuner({:?})", self.path)
    }
}

/// The default file: `$XDG_CACHE_HOME/warpdrive/autotune.toml` (or under `~/.cache`).
pub fn default_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("warpdrive").join("autotune.toml"))
}

impl Autotuner {
    /// The process-wide tuner on the default file.
    pub fn global() -> &'static Autotuner {
        static TUNER: OnceLock<Autotuner> = OnceLock::new();
        TUNER.get_or_init(|| Autotuner::load(default_path()))
    }

    /// A tuner on `path`, reading what it holds (a fresh value behaves like a new process).
    pub fn at(path: impl Into<PathBuf>) -> Autotuner {
        Autotuner::load(Some(path.into()))
    }

    fn load(path: Option<PathBuf>) -> Autotuner {
        let records = path.as_deref().map(read_file).unwrap_or_default();
        Autotuner {
            path,
            records: Mutex::new(records),
            tunings: AtomicUsize::new(0),
        }
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// How many times this tuner has timed candidates (a cache hit times nothing).
    pub fn tunings(&self) -> usize {
        self.tunings.load(Ordering::Relaxed)
    }

    /// The record kept for `key`, if any.
    pub fn get(&self, key: &TuneKey) -> Option<TuneRecord> {
        self.records.lock().iter().find(|r| r.matches(key)).cloned()
    }

    /// Every record kept.
    pub fn records(&self) -> Vec<TuneRecord> {
        self.records.lock().clone()
    }

    /// The best of `candidates` for `key`: the kept winner when it is among them, else each
    /// candidate is run by `run` on `stream` (one warm-up each, then [`TUNE_REPS`] to
    /// [`TUNE_REPS_MAX`] rounds, as many as fit [`TUNE_BUDGET_S`] by the time of a second,
    /// untimed pass,
    /// timing every candidate once, with events on the stream), the fastest median wins, and
    /// the record is saved. A candidate whose run fails is skipped (its error is returned only when every
    /// candidate fails). `size` is the main dimension the runs use (kept in the record).
    pub fn tune<C: Display + Clone>(
        &self,
        stream: &Stream,
        key: &TuneKey,
        size: usize,
        candidates: &[C],
        run: impl FnMut(&Stream, &C) -> Result<()>,
    ) -> Result<C> {
        self.tune_within(stream, key, size, candidates, TUNE_BUDGET_S, run)
    }

    /// [`Autotuner::tune`] with `budget_s` seconds of timing rounds instead of
    /// [`TUNE_BUDGET_S`]: for host-bound candidates whose times scatter on a busy host.
    pub fn tune_within<C: Display + Clone>(
        &self,
        stream: &Stream,
        key: &TuneKey,
        size: usize,
        candidates: &[C],
        budget_s: f64,
        mut run: impl FnMut(&Stream, &C) -> Result<()>,
    ) -> Result<C> {
        if candidates.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "autotune {}: no candidates",
                key.kernel
            )));
        }
        if let Some(kept) = self.get(key) {
            if let Some(c) = candidates.iter().find(|c| c.to_string() == kept.winner) {
                return Ok(c.clone());
            }
        }
        self.tunings.fetch_add(1, Ordering::Relaxed);
        let mut last_error = None;
        // One warm-up each; a candidate that fails is dropped.
        let mut alive: Vec<&C> = Vec::with_capacity(candidates.len());
        for c in candidates {
            match run(stream, c).and_then(|()| stream.synchronize()) {
                Ok(()) => alive.push(c),
                Err(e) => {
                    tracing::debug!("autotune {}: candidate {c} failed: {e}", key.kernel);
                    last_error = Some(e);
                }
            }
        }
        // The rounds are sized by a second pass: the warm-up's time holds first-use costs
        // (a generated kernel's compile), which left quick candidates the fewest rounds.
        let warm = std::time::Instant::now();
        for c in &alive {
            // A failure here shows again in the timed rounds, which drop the candidate.
            let _ = run(stream, c);
        }
        stream.synchronize()?;
        // Rounds that time every candidate once, so a slow stretch of the machine lands on
        // all of them rather than on one (each after every other equally often); the median
        // per candidate decides.
        let device = stream.device();
        let (start, end) = (device.new_event()?, device.new_event()?);
        let rounds = tune_rounds(budget_s, warm.elapsed().as_secs_f64());
        let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); alive.len()];
        let mut failed = vec![false; alive.len()];
        for round in 0..rounds {
            for i in round_order(round, alive.len()) {
                let c = alive[i];
                if failed[i] {
                    continue;
                }
                let timed = stream
                    .record(&start)
                    .and_then(|()| run(stream, c))
                    .and_then(|()| stream.record(&end))
                    .and_then(|()| start.elapsed_ms(&end));
                match timed {
                    Ok(ms) => samples[i].push(f64::from(ms) * 1e3),
                    Err(e) => {
                        tracing::debug!("autotune {}: candidate {c} failed: {e}", key.kernel);
                        failed[i] = true;
                        last_error = Some(e);
                    }
                }
            }
        }
        let times: Vec<(&C, f64)> = alive
            .iter()
            .zip(samples)
            .zip(&failed)
            .filter(|(_, &f)| !f)
            .map(|((c, us), _)| (*c, median(us)))
            .collect();
        let Some(best) = fastest(&times) else {
            return Err(last_error.unwrap_or_else(|| {
                Error::InvalidArgument(format!("autotune {}: nothing timed", key.kernel))
            }));
        };
        let candidates = times
            .iter()
            .map(|(c, us)| CandidateTime {
                config: c.to_string(),
                us: *us,
            })
            .collect();
        self.keep(key, size, best.to_string(), candidates);
        let best = best.clone();
        Ok(best)
    }

    /// Keeps `winner` and every candidate's time for `key` (replacing what it held) and
    /// saves the file (a failed save is a warning: the result still serves this process).
    /// For tunings that measure their candidates themselves (a collective's, timed on every
    /// rank at once), as [`tune`](Self::tune) does for kernels.
    pub fn keep(&self, key: &TuneKey, size: usize, winner: String, candidates: Vec<CandidateTime>) {
        let record = TuneRecord {
            kernel: key.kernel.clone(),
            dtype: key.dtype.clone(),
            bucket: key.bucket,
            device: key.device.clone(),
            host: key.host.clone(),
            size: size as u64,
            winner,
            candidates,
            tuned_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        {
            let mut records = self.records.lock();
            records.retain(|r| !r.matches(key));
            records.push(record);
        }
        if let Err(e) = self.save() {
            tracing::warn!("could not save autotune results: {e}");
        }
    }

    /// Writes every record to the file (nothing without a file), merged with the records
    /// other processes saved there since (which this tuner then keeps too). Holds the file's
    /// lock meanwhile; fails when another process held it for [`SAVE_LOCK_TIMEOUT`].
    pub fn save(&self) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let _lock = lock_exclusive(&lock_path(path), SAVE_LOCK_TIMEOUT)?;
        let on_disk = read_file(path);
        let records = {
            let mut records = self.records.lock();
            *records = merge(on_disk, std::mem::take(&mut *records));
            records.clone()
        };
        let file = TuneFile {
            version: FILE_VERSION,
            records,
        };
        let text = toml::to_string(&file)
            .map_err(|e| Error::InvalidArgument(format!("autotune file: {e}")))?;
        crate::files::write_atomic(path, text.as_bytes())
    }
}

/// [`Autotuner::tune`] on the process-wide tuner, keyed by `kernel`, `dtype`, `size` and the
/// stream's device.
pub fn autotune<C: Display + Clone>(
    stream: &Stream,
    kernel: &str,
    dtype: DTypeKind,
    size: usize,
    candidates: &[C],
    run: impl FnMut(&Stream, &C) -> Result<()>,
) -> Result<C> {
    autotune_within(stream, kernel, dtype, size, candidates, TUNE_BUDGET_S, run)
}

/// [`autotune`] with `budget_s` seconds of timing rounds (see [`Autotuner::tune_within`]).
pub fn autotune_within<C: Display + Clone>(
    stream: &Stream,
    kernel: &str,
    dtype: DTypeKind,
    size: usize,
    candidates: &[C],
    budget_s: f64,
    run: impl FnMut(&Stream, &C) -> Result<()>,
) -> Result<C> {
    let key = TuneKey::new(stream.device(), kernel, dtype, size)?;
    Autotuner::global().tune_within(stream, &key, size, candidates, budget_s, run)
}

/// The order of `round` among `n` variants (or candidates): a Williams design, rows of a
/// Latin square in which each variant directly follows each other one once per `n` rounds
/// (even `n`), or once per `2n` with the rows also reversed (odd `n`).
pub fn round_order(round: usize, n: usize) -> Vec<usize> {
    // 0, 1, n-1, 2, n-2, ...: consecutive differences cover every nonzero step once.
    let base = (0..n).map(|j| {
        if j % 2 == 1 {
            j.div_ceil(2)
        } else {
            (n - j / 2) % n
        }
    });
    let row = round % n.max(1);
    let mut order: Vec<usize> = base.map(|b| (b + row) % n).collect();
    if n % 2 == 1 && (round / n) % 2 == 1 {
        order.reverse();
    }
    order
}

/// The middle sample (the upper one of an even count); `samples` is not empty.
fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The candidate with the least time (the first of equals); `None` when none was timed.
fn fastest<C: Copy>(times: &[(C, f64)]) -> Option<C> {
    times
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|&(c, _)| c)
}

/// Timing rounds within `budget_s` for candidates whose steady-state pass took `warm_s`
/// seconds.
fn tune_rounds(budget_s: f64, warm_s: f64) -> usize {
    let fit = budget_s / warm_s.max(1e-9);
    (fit.min(TUNE_REPS_MAX as f64).round() as usize).clamp(TUNE_REPS, TUNE_REPS_MAX)
}

/// The records in `path`; none when it is absent, and none with a warning when it does not
/// parse.
fn read_file(path: &Path) -> Vec<TuneRecord> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(
                "autotune file {} unreadable ({e}); ignoring it",
                path.display()
            );
            return Vec::new();
        }
    };
    match toml::from_str::<TuneFile>(&text) {
        Ok(f) => f.records,
        Err(e) => {
            tracing::warn!(
                "autotune file {} is corrupt ({e}); ignoring it",
                path.display()
            );
            Vec::new()
        }
    }
}

/// The lock file of the tune file `path`: `<path>.lock` (the file itself is replaced by each
/// save, so a lock on it would not be seen by the next opener).
fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

/// An exclusive lock on `path` (created if absent), held until the returned file is dropped;
/// waits at most `timeout` for another process or thread. `None` where the file system does
/// not support locks (the save then goes ahead unlocked, merging all the same).
fn lock_exclusive(path: &Path, timeout: Duration) -> Result<Option<std::fs::File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let deadline = Instant::now() + timeout;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let held = format!("held by another process or thread for over {timeout:?}");
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, held);
                return Err(Error::io(path, e));
            }
            Err(std::fs::TryLockError::Error(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
                return Ok(None)
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(path, e)),
        }
    }
}

/// One point of a batch sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchPoint {
    pub batch: usize,
    /// µs per batch.
    pub us: f64,
    /// Items per second.
    pub per_second: f64,
}

/// A batch-size sweep and its knee.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSweep {
    /// The batches measured, in the order given (a sweep stops at the first batch that
    /// runs out of memory).
    pub points: Vec<BatchPoint>,
    /// The batch with the highest throughput.
    pub best: usize,
    /// The smallest batch reaching [`KNEE_FRACTION`] of the best throughput.
    pub knee: usize,
}

/// Measures each of `batches` with `measure` (µs per batch of that size) and returns the
/// knee. A batch that runs out of memory ends the sweep (larger ones would too); other
/// errors are returned. Fails when no batch could be measured.
pub fn batch_knee(
    batches: &[usize],
    mut measure: impl FnMut(usize) -> Result<f64>,
) -> Result<BatchSweep> {
    let mut points = Vec::with_capacity(batches.len());
    for &batch in batches {
        if batch == 0 {
            return Err(Error::InvalidArgument("batch_knee: a batch of 0".into()));
        }
        let us = match measure(batch) {
            Ok(us) => us,
            Err(Error::OutOfMemory { .. }) if !points.is_empty() => break,
            Err(e) => return Err(e),
        };
        if !(us > 0.0 && us.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "batch_knee: batch {batch} took {us} µs"
            )));
        }
        points.push(BatchPoint {
            batch,
            us,
            per_second: batch as f64 / (us * 1e-6),
        });
    }
    let best = points
        .iter()
        .max_by(|a, b| a.per_second.total_cmp(&b.per_second))
        .copied()
        .ok_or_else(|| Error::InvalidArgument("batch_knee: no batch sizes".into()))?;
    let knee = points
        .iter()
        .filter(|p| p.per_second >= KNEE_FRACTION * best.per_second)
        .map(|p| p.batch)
        .min()
        .unwrap_or(best.batch);
    Ok(BatchSweep {
        points,
        best: best.batch,
        knee,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_balance_positions_and_predecessors() {
        for n in 1..=6 {
            let rounds = if n % 2 == 0 { n } else { 2 * n };
            let mut first = vec![0; n];
            let mut follows = vec![vec![0; n]; n];
            for r in 0..rounds {
                let o = round_order(r, n);
                let mut sorted = o.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n={n} round {r}: {o:?}");
                first[o[0]] += 1;
                for w in o.windows(2) {
                    follows[w[0]][w[1]] += 1;
                }
            }
            assert!(first.iter().all(|&f| f == rounds / n), "n={n}: {first:?}");
            for (a, row) in follows.iter().enumerate() {
                for (b, &c) in row.iter().enumerate() {
                    let want = if a == b { 0 } else { rounds / n };
                    assert_eq!(c, want, "n={n}: {b} after {a}");
                }
            }
        }
    }

    #[test]
    fn the_candidate_with_the_least_median_time_wins() {
        // One slow stretch (an outlier) does not cost 64 the win; 256's steady times do not
        // win it either.
        let times = [
            (64u32, median(vec![9.0, 1.0, 1.1, 1.0, 1.2])),
            (128, median(vec![2.0, 2.1, 1.9, 2.0, 2.2])),
            (256, median(vec![1.5, 1.5, 1.5, 1.5, 1.5])),
        ];
        assert_eq!(times.map(|t| t.1), [1.1, 2.0, 1.5]);
        assert_eq!(fastest(&times), Some(64));
        assert_eq!(fastest(&[(1u32, 3.0), (2, 3.0)]), Some(1));
        assert_eq!(fastest::<u32>(&[]), None);
    }

    #[test]
    fn quick_candidates_get_more_rounds_within_bounds() {
        assert_eq!(tune_rounds(TUNE_BUDGET_S, 1.0), TUNE_REPS);
        assert_eq!(tune_rounds(TUNE_BUDGET_S, TUNE_BUDGET_S / 10.0), 10);
        assert_eq!(tune_rounds(TUNE_BUDGET_S, 1e-7), TUNE_REPS_MAX);
        assert_eq!(tune_rounds(TUNE_BUDGET_S, 0.0), TUNE_REPS_MAX);
        assert_eq!(tune_rounds(1.0, 0.04), 25);
    }

    #[test]
    fn a_held_lock_times_out_and_a_released_one_is_taken() {
        let dir = std::env::temp_dir().join(format!("wd-tune-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = lock_path(&dir.join("autotune.toml"));
        assert_eq!(path, dir.join("autotune.toml.lock"));
        let holder = lock_exclusive(&path, SAVE_LOCK_TIMEOUT).unwrap().unwrap();
        let err = lock_exclusive(&path, Duration::from_millis(20)).unwrap_err();
        assert!(
            matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::TimedOut),
            "{err}"
        );
        drop(holder);
        assert!(lock_exclusive(&path, SAVE_LOCK_TIMEOUT).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn merging_keeps_the_newer_record_of_a_key_and_every_other_key() {
        let record = |kernel: &str, host: &str, winner: &str, tuned_unix: u64| TuneRecord {
            kernel: kernel.into(),
            host: host.into(),
            winner: winner.into(),
            tuned_unix,
            ..TuneRecord::default()
        };
        let disk = vec![
            record("a", "h", "disk", 10),
            record("b", "h", "disk", 10),
            record("c", "", "old file", 1),
        ];
        let ours = vec![
            record("a", "h", "ours", 5),
            record("b", "h", "ours", 10),
            record("c", "h", "ours", 2),
            record("d", "h", "ours", 1),
        ];
        let mut merged: Vec<(String, String)> = merge(disk, ours)
            .into_iter()
            .map(|r| (r.kernel, r.winner))
            .collect();
        merged.sort();
        let want = [("a", "disk"), ("b", "ours"), ("c", "ours"), ("d", "ours")];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, w)| (k.to_string(), w.to_string()))
            .collect();
        assert_eq!(merged, want);
    }

    #[test]
    fn buckets_are_ceil_log2() {
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(1), 0);
        assert_eq!(size_bucket(2), 1);
        assert_eq!(size_bucket(3), 2);
        assert_eq!(size_bucket(1024), 10);
        assert_eq!(size_bucket(1025), 11);
    }

    #[test]
    fn the_knee_is_the_smallest_batch_within_five_percent_of_the_best() {
        // Throughput rises then saturates: 100 µs fixed cost + 1 µs per item.
        let sweep = batch_knee(&[1, 8, 64, 512, 4096, 32768], |b| Ok(100.0 + b as f64)).unwrap();
        assert_eq!(sweep.best, 32768);
        // 4096 / 4196 µs = 0.976 items/µs vs 32768 / 32868 = 0.997: 97.9 % ≥ 95 %.
        assert_eq!(sweep.knee, 4096);
        assert_eq!(sweep.points.len(), 6);
        // OOM ends the sweep; what was measured still gives a knee.
        let sweep = batch_knee(&[1, 2, 4, 8], |b| {
            if b >= 4 {
                Err(Error::OutOfMemory {
                    requested: b,
                    detail: "test".into(),
                })
            } else {
                Ok(10.0)
            }
        })
        .unwrap();
        assert_eq!((sweep.best, sweep.knee, sweep.points.len()), (2, 2, 2));
        assert!(batch_knee(&[], |_| Ok(1.0)).is_err());
        assert!(batch_knee(&[0], |_| Ok(1.0)).is_err());
        assert!(batch_knee(&[4], |_| Ok(f64::NAN)).is_err());
    }
}
