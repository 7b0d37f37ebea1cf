//! Stall probes inside a process: a thread of its own and a task on a tokio runtime, each
//! waking every millisecond and noting every wake-up later than a threshold. A probe in a
//! separate process sees the host stall; these tell a stall of this process (every thread:
//! the thread probe, e.g. page faults queued behind the memory map's lock) from one of its
//! runtime alone (the task probe: no worker polled a task or looked at the timer). While the
//! task probe is late, the thread probe takes two snapshots of every thread's state
//! (`snapshot::threads`), at the threshold and at twice it, and the runtime stall
//! carries them: what the workers were blocked in, and which threads ran or waited for a CPU
//! in between.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often each probe wakes.
const TICK: Duration = Duration::from_millis(1);

/// Stalls kept and reported at most (the first ones: a saturated host would otherwise log
/// up to hundreds a second; one that stalls this often has said so by then).
const MAX_STALLS: usize = 1024;

/// Which probe saw a stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// The probe thread: the whole process (or the host) was not run.
    Thread,
    /// The probe task: the runtime ran none of its tasks.
    Runtime,
}

impl Where {
    pub fn name(self) -> &'static str {
        match self {
            Where::Thread => "thread",
            Where::Runtime => "runtime",
        }
    }
}

/// A wake-up later than the threshold.
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    pub probe: Where,
    /// The wall clock when the late wake-up came (µs since the Unix epoch).
    pub until_unix_us: u64,
    /// The time since the wake-up before, µs.
    pub gap_us: f64,
    /// A runtime stall's snapshots of the process's threads, taken while it lasted (at the
    /// threshold, then ` | then ` at twice it; `snapshot::threads`; `None` for a
    /// thread stall, or where none was taken).
    pub threads: Option<String>,
}

/// Both probes, running until dropped (or [`Probes::finish`]).
pub(crate) struct Probes {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    seen: Arc<Mutex<Vec<Stall>>>,
}

/// What the two probes share: the task probe's last wake-up (µs since `base`) and the
/// snapshot the thread probe took while the task probe was late.
struct Shared {
    base: Instant,
    task_woke_us: AtomicU64,
    snapshot: Mutex<Option<String>>,
}

impl Shared {
    fn now_us(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

impl Probes {
    /// Starts the thread probe and a task probe on `runtime`, each noting gaps over
    /// `threshold`; `report` is called with each stall kept, as it is seen (from the probe).
    pub(crate) fn start(
        runtime: &tokio::runtime::Handle,
        threshold: Duration,
        report: fn(&Stall),
    ) -> Probes {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::with_capacity(64)));
        let shared = Arc::new(Shared {
            base: Instant::now(),
            task_woke_us: AtomicU64::new(0),
            snapshot: Mutex::new(None),
        });
        let (s, v, sh) = (stop.clone(), seen.clone(), shared.clone());
        let threshold_us = u64::try_from(threshold.as_micros()).unwrap_or(u64::MAX);
        // A probe that cannot start leaves the run unprobed, not failed.
        let thread = std::thread::Builder::new()
            .name("warpdrive-stall-probe".into())
            .spawn(move || {
                let mut prev = Instant::now();
                // The task probe's wake-up the snapshots were taken after, and how many.
                let (mut snapped_after, mut snaps) = (u64::MAX, 0);
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    prev = note(&v, Where::Thread, prev, threshold, report, None);
                    let woke = sh.task_woke_us.load(Ordering::Acquire);
                    if woke != snapped_after {
                        (snapped_after, snaps) = (woke, 0);
                    }
                    let late = sh.now_us().saturating_sub(woke);
                    if snaps < 2 && late > threshold_us.saturating_mul(snaps + 1) {
                        snaps += 1;
                        let now = crate::snapshot::threads();
                        let mut kept = sh.snapshot.lock();
                        *kept = Some(match kept.take() {
                            Some(first) if snaps == 2 => format!("{first} | then {now}"),
                            _ => now,
                        });
                    }
                }
            })
            .ok();
        let (v, sh) = (seen.clone(), shared);
        let task = runtime.spawn(async move {
            let mut prev = Instant::now();
            sh.task_woke_us.store(sh.now_us(), Ordering::Release);
            loop {
                tokio::time::sleep(TICK).await;
                sh.task_woke_us.store(sh.now_us(), Ordering::Release);
                prev = note(
                    &v,
                    Where::Runtime,
                    prev,
                    threshold,
                    report,
                    Some(&sh.snapshot),
                );
            }
        });
        Probes {
            stop,
            thread,
            task: Some(task),
            seen,
        }
    }

    /// Stops both probes and returns what they saw, in the order seen.
    pub(crate) fn finish(mut self) -> Vec<Stall> {
        self.halt();
        std::mem::take(&mut *self.seen.lock())
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.task.take() {
            t.abort();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Notes a stall when `prev` is more than `threshold` ago, with the snapshot in `snapshot`
/// (taken during this gap: an older one was taken by a gap this probe has noted); returns
/// now.
fn note(
    seen: &Mutex<Vec<Stall>>,
    probe: Where,
    prev: Instant,
    threshold: Duration,
    report: fn(&Stall),
    snapshot: Option<&Mutex<Option<String>>>,
) -> Instant {
    let now = Instant::now();
    let gap = now.saturating_duration_since(prev);
    let threads = snapshot.and_then(|s| s.lock().take());
    if gap > threshold {
        let stall = Stall {
            probe,
            until_unix_us: crate::wire::unix_us_now(),
            gap_us: gap.as_secs_f64() * 1e6,
            threads,
        };
        let mut v = seen.lock();
        if v.len() < MAX_STALLS {
            v.push(stall.clone());
            drop(v);
            report(&stall);
        }
    }
    now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_runtime_is_seen_by_the_task_probe_alone() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("probe-test-w")
            .enable_all()
            .build()
            .unwrap();
        let probes = Probes::start(rt.handle(), Duration::from_millis(20), |_| {});
        // Let the task probe run once, then block the runtime's only worker for 120 ms.
        std::thread::sleep(Duration::from_millis(30));
        rt.block_on(async {
            tokio::spawn(async { std::thread::sleep(Duration::from_millis(120)) })
                .await
                .unwrap();
        });
        // The probe notes the stall when it next runs, which a busy host may put off: wait for
        // the note (the bound only stops a lost probe from hanging the test).
        let noted = |seen: &[Stall]| {
            seen.iter()
                .any(|s| s.probe == Where::Runtime && s.gap_us >= 100_000.0)
        };
        let t0 = Instant::now();
        while !noted(&probes.seen.lock()) && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let seen = probes.finish();
        let stall = seen
            .iter()
            .find(|s| s.probe == Where::Runtime && s.gap_us >= 100_000.0);
        assert!(stall.is_some(), "{seen:?}");
        // Taken while the worker slept: it names the runtime's thread, asleep (S), twice.
        #[cfg(target_os = "linux")]
        {
            let threads = stall.and_then(|s| s.threads.clone()).unwrap_or_default();
            let asleep = threads
                .split("; ")
                .filter(|t| t.starts_with("probe-test-w/") && t.contains(" S "))
                .count();
            assert_eq!(asleep, 2, "{threads}");
            assert!(threads.contains(" | then "), "{threads}");
        }
    }
}
