//! A persistent pool of host threads that runs one job's parts in parallel: the copy
//! threads behind `transfer`'s staged copies and host conversions. Spawning threads per
//! chunk costs tens of µs each; these are made once, optionally pinned to the CPUs of the
//! GPU's NUMA node. It lives here (the backend floor) because lending a borrowed closure to
//! long-lived threads needs `unsafe`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// A job: a borrowed closure with its lifetime erased (see [`Workers::run`]).
#[derive(Clone, Copy)]
struct RawJob(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync` and outlives every use (see `Workers::run`).
unsafe impl Send for RawJob {}

#[derive(Default)]
struct State {
    generation: u64,
    job: Option<RawJob>,
    parts: usize,
    next: usize,
    left: usize,
}

struct Shared {
    /// `State::generation`, readable without the lock (for spinning workers).
    posted: AtomicU64,
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// Persistent host threads that run the parts of one job at a time (the caller works too).
pub struct Workers {
    shared: Arc<Shared>,
    threads: usize,
    /// One job at a time; concurrent callers queue here.
    run: Mutex<()>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Workers({} threads)", self.threads)
    }
}

/// The CPUs of NUMA node `node` (from `/sys/devices/system/node/nodeN/cpulist`).
pub fn node_cpus(node: i32) -> Option<Vec<usize>> {
    let text =
        std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    super::sysfs::parse_cpulist(text.trim()).filter(|cpus| !cpus.is_empty())
}

fn pin_to(cpus: &[usize]) {
    if let Err(e) = super::sysfs::pin_current_thread_to(cpus) {
        tracing::debug!("could not pin a copy thread to CPUs {cpus:?}: {e}");
    }
}

impl Workers {
    /// `threads` threads in all (the caller counts as one), pinned to `cpus` when given.
    pub fn new(threads: usize, cpus: Option<Vec<usize>>) -> Workers {
        let shared = Arc::new(Shared {
            posted: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let threads = threads.max(1);
        let mut started = 1;
        for i in 1..threads {
            let shared = shared.clone();
            let cpus = cpus.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("warpdrive-copy-{i}"))
                .spawn(move || {
                    if let Some(c) = &cpus {
                        pin_to(c);
                    }
                    worker(&shared)
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!("could not start copy thread {i}: {e}");
                    break;
                }
            }
        }
        Workers {
            shared,
            threads: started,
            run: Mutex::new(()),
        }
    }

    /// The process-wide pool: one thread per available CPU (at most 32), pinned to the
    /// CPUs of NUMA node `numa()` (asked once, by the first caller) when it is known.
    pub fn global(numa: impl FnOnce() -> Option<i32>) -> &'static Workers {
        static POOL: OnceLock<Workers> = OnceLock::new();
        POOL.get_or_init(|| {
            let cpus = numa().and_then(node_cpus);
            let n = cpus.as_ref().map_or_else(
                || std::thread::available_parallelism().map_or(1, |n| n.get()),
                Vec::len,
            );
            Workers::new(n.min(32), cpus)
        })
    }

    /// Threads in all, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// `f(dst piece, src piece)` over matching pieces of two equally long slices, on up to
    /// `threads` threads (one piece each). Pieces are at least [`MIN_PIECE_BYTES`] (waking a
    /// thread costs µs) and `dst`'s pieces start at `align`-byte addresses (pages; huge pages
    /// for fresh memory, so no two threads fault the same one).
    pub fn map<S: Sync, D: Send>(
        &self,
        threads: usize,
        align: usize,
        dst: &mut [D],
        src: &[S],
        f: impl Fn(&mut [D], &[S]) + Sync,
    ) {
        debug_assert_eq!(dst.len(), src.len());
        let len = dst.len().min(src.len());
        let size = std::mem::size_of::<D>()
            .max(std::mem::size_of::<S>())
            .max(1);
        let parts = threads
            .min(self.threads)
            .min(len.div_ceil((MIN_PIECE_BYTES / size).max(1)))
            .max(1);
        if parts == 1 {
            f(dst, src);
            return;
        }
        let cuts = cuts(
            dst.as_ptr() as usize,
            std::mem::size_of::<D>(),
            len,
            parts,
            align,
        );
        let mut jobs = Vec::with_capacity(cuts.len());
        let (mut d, mut s) = (dst, src);
        for w in cuts.windows(2) {
            let (dh, dt) = std::mem::take(&mut d).split_at_mut(w[1] - w[0]);
            let (sh, st) = s.split_at(w[1] - w[0]);
            jobs.push(Mutex::new((dh, sh)));
            (d, s) = (dt, st);
        }
        self.run(jobs.len(), &|i| {
            let mut job = jobs[i].lock();
            let (d, s) = &mut *job;
            f(d, s);
        });
    }

    /// Runs `f(0)`, ..., `f(parts - 1)` spread over the threads; returns when all are done.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        if parts <= 1 || self.threads == 1 {
            (0..parts).for_each(f);
            return;
        }
        let _one = self.run.lock();
        // SAFETY: the lifetime is erased only while this call runs: `Finish` (also on
        // unwinding) waits until every part has returned and clears the job before `f`'s
        // borrow ends, and workers read the job only under the lock while it is set.
        let raw = RawJob(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                f as *const _,
            )
        });
        {
            let mut st = self.shared.state.lock();
            st.generation += 1;
            st.job = Some(raw);
            st.parts = parts;
            st.next = 0;
            st.left = parts;
            self.shared.posted.store(st.generation, Ordering::Release);
        }
        self.shared.work.notify_all();
        let _finish = Finish(&self.shared);
        work_on(&self.shared);
    }
}

/// The base page size: [`Workers::map`]'s alignment for memory that is already mapped.
pub const PAGE: usize = 4 << 10;

/// The smallest piece [`Workers::map`] hands a thread.
pub const MIN_PIECE_BYTES: usize = 128 << 10;

/// Element indices `0 = c₀ < c₁ < … = len` cutting `len` elements of `elem` bytes at address
/// `base` into about `parts` equal pieces, each inner cut at an `align`-byte address.
fn cuts(base: usize, elem: usize, len: usize, parts: usize, align: usize) -> Vec<usize> {
    let elem = elem.max(1);
    let mut out = vec![0];
    for k in 1..parts {
        let target = base + k * (len / parts) * elem;
        let cut = (target.next_multiple_of(align.max(1)) - base).div_ceil(elem);
        if cut < len && cut > out[out.len() - 1] {
            out.push(cut);
        }
    }
    if len > 0 {
        out.push(len);
    }
    out
}

/// Waits for every part of the current job, then clears it.
struct Finish<'a>(&'a Shared);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        // Parts nobody took (the caller unwound) are dropped; taken ones finish.
        let untaken = st.parts - st.next;
        st.next = st.parts;
        st.left -= untaken;
        while st.left > 0 {
            self.0.done.wait(&mut st);
        }
        st.job = None;
    }
}

/// Takes parts of the current job until none is left. The job is read under the lock
/// together with the part, so a part is never run with another job's closure.
fn work_on(shared: &Shared) {
    loop {
        let (job, i) = {
            let mut st = shared.state.lock();
            match st.job {
                Some(job) if st.next < st.parts => {
                    st.next += 1;
                    (job, st.next - 1)
                }
                _ => return,
            }
        };
        // SAFETY: the job is live until `left` reaches 0 (see `Workers::run`), which cannot
        // happen before this part is counted below.
        unsafe { (*job.0)(i) };
        let mut st = shared.state.lock();
        st.left -= 1;
        if st.left == 0 {
            shared.done.notify_all();
        }
    }
}

/// How long an idle worker keeps looking for the next job before it sleeps: jobs often
/// come in quick succession (chunk after chunk, a DMA apart), and waking a sleeping thread
/// costs tens of µs. It yields while looking, so runnable threads keep their CPUs.
const SPIN: Duration = Duration::from_micros(250);

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let until = Instant::now() + SPIN;
        while shared.posted.load(Ordering::Acquire) == seen && Instant::now() < until {
            std::thread::yield_now();
        }
        {
            let mut st = shared.state.lock();
            while st.generation == seen || st.job.is_none() || st.next >= st.parts {
                seen = st.generation;
                shared.work.wait(&mut st);
            }
            seen = st.generation;
        }
        work_on(shared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn cuts_fall_on_aligned_addresses_and_cover_everything() {
        for (base, elem, len, parts, align) in [
            (0x1010, 4, 1_000_003, 7, 4096),
            (0x20_0000 + 16, 1, 64 << 20, 16, 2 << 20),
            (0x1000, 8, 10, 4, 4096),
            (0x1000, 2, 0, 4, 4096),
        ] {
            let c = cuts(base, elem, len, parts, align);
            assert_eq!(c[0], 0);
            assert_eq!(*c.last().unwrap(), len);
            assert!(c.len() <= parts + 1 && c.windows(2).all(|w| w[0] < w[1]) || len == 0);
            for &cut in c.iter().skip(1).take(c.len().saturating_sub(2)) {
                assert_eq!((base + cut * elem) % align, 0, "{base:#x} {elem} {cut}");
            }
        }
    }

    #[test]
    fn map_visits_matching_pieces() {
        let w = Workers::new(4, None);
        let src: Vec<u32> = (0..300_001).collect();
        let mut dst = vec![0u64; src.len()];
        w.map(4, 4096, &mut dst, &src, |d, s| {
            for (d, s) in d.iter_mut().zip(s) {
                *d = u64::from(*s) * 3;
            }
        });
        assert!(dst.iter().zip(&src).all(|(d, s)| *d == u64::from(*s) * 3));
    }

    #[test]
    fn runs_every_part_once() {
        let w = Workers::new(3, None);
        for parts in [0, 1, 2, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            w.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }
}
