//! A persistent pool of host threads that runs one job's parts in parallel: the copy
//! threads behind `transfer`'s staged copies and host conversions. Spawning threads per
//! chunk costs tens of µs each; these are made once, optionally pinned to the CPUs of the
//! GPU's NUMA node. Lending a borrowed closure to long-lived threads needs `unsafe` (one
//! lifetime erasure in [`Workers::run`]'s post, one call through it per part), kept here
//! next to the protocol that makes it sound.
//!
//! A part that panics fails its job with [`Error::WorkerPanicked`]: the panic is caught
//! where the part runs, so the thread that ran it lives on and the pool keeps every thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// The job being run: a borrowed closure with its lifetime erased, on the stack of the
/// [`Workers::run`] call that posted it.
struct Posted(*const (dyn Fn(usize) + Sync));

/// The current job's ticket in one word, so that taking a part (a compare-exchange) fails
/// once the job it was read with is over: generation (32 bits), parts (16), next part (16).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Ticket(u64);

impl Ticket {
    fn new(generation: u64, parts: usize) -> Ticket {
        Ticket((generation << 32) | ((parts as u64) << 16))
    }
    fn generation(self) -> u64 {
        self.0 >> 32
    }
    fn parts(self) -> usize {
        ((self.0 >> 16) & 0xffff) as usize
    }
    fn next(self) -> usize {
        (self.0 & 0xffff) as usize
    }
    /// The same job with parts up to `next` taken.
    fn taken(self, next: usize) -> Ticket {
        Ticket((self.0 & !0xffff) | next as u64)
    }
}

/// The most parts one posted job has (the ticket's 16 bits); [`Workers::run`] posts more
/// as several jobs.
const MAX_PARTS: usize = 0xffff;

struct Shared {
    /// The current job's [`Ticket`].
    ticket: AtomicU64,
    /// The current job (valid while a part of it is taken and unfinished).
    job: AtomicPtr<Posted>,
    /// Parts of the current job not yet finished.
    left: AtomicUsize,
    /// One per copy thread: how the poster wakes it.
    sleepers: Vec<Sleeper>,
    /// Copy threads asleep or about to be (the poster skips the wake-ups when none is).
    asleep: AtomicUsize,
    /// Sleeping threads still to wake: the poster wakes one, and every thread that joins a
    /// job wakes more while this is above zero (see [`pass_wakes`]).
    to_wake: AtomicUsize,
    /// The caller's sleep until every part is done.
    done_lock: Mutex<()>,
    done: Condvar,
    /// The error of the current job's first part that panicked.
    panicked: Mutex<Option<Error>>,
}

/// A copy thread's parking place. Sleepers are unparked one by one (a condition variable's
/// `notify_all` woke them in a chain, each woken thread taking the lock before the next
/// one woke), and the waking is shared: the poster unparks one and starts on the job, each
/// thread that joins unparks more ([`pass_wakes`]), so the poster does not spend its start
/// unparking every sleeper (bench/NOTES.md, copy-thread wake-ups).
#[derive(Default)]
struct Sleeper {
    thread: OnceLock<Thread>,
    /// Set by the thread as it goes to sleep; cleared by whoever claims its wake-up.
    asleep: AtomicBool,
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
    crate::device::sysfs::parse_cpulist(text.trim()).filter(|cpus| !cpus.is_empty())
}

fn pin_to(cpus: &[usize]) {
    if let Err(e) = crate::device::sysfs::pin_current_thread_to(cpus) {
        tracing::debug!("could not pin a copy thread to CPUs {cpus:?}: {e}");
    }
}

impl Workers {
    /// `threads` threads in all (the caller counts as one), pinned to `cpus` when given.
    pub fn new(threads: usize, cpus: Option<Vec<usize>>) -> Workers {
        let shared = Arc::new(Shared {
            ticket: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            left: AtomicUsize::new(0),
            sleepers: (0..threads.max(1)).map(|_| Sleeper::default()).collect(),
            asleep: AtomicUsize::new(0),
            to_wake: AtomicUsize::new(0),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            panicked: Mutex::new(None),
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
                    worker(&shared, i)
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

    /// The pool of NUMA node `node` (`None`: unplaced), made on first use and shared by
    /// every device on that node: one thread per CPU of the node (of the machine when
    /// unplaced or the node's CPUs are unknown), at most 32, pinned to the node's CPUs.
    pub fn for_node(node: Option<i32>) -> &'static Workers {
        static POOLS: Mutex<Vec<(Option<i32>, &'static Workers)>> = Mutex::new(Vec::new());
        let mut pools = POOLS.lock();
        if let Some((_, w)) = pools.iter().find(|(n, _)| *n == node) {
            return w;
        }
        let cpus = node.and_then(node_cpus);
        let n = cpus.as_ref().map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            Vec::len,
        );
        let w: &'static Workers = Box::leak(Box::new(Workers::new(n.min(32), cpus)));
        pools.push((node, w));
        w
    }

    /// Threads in all, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Wakes up to `threads - 1` sleeping copy threads now, ahead of a job about to be
    /// posted, so that their wake-up overlaps the caller's setup: woken, they look for work
    /// for a while before they sleep again.
    pub fn wake(&self, threads: usize) {
        wake(&self.shared, threads.min(self.threads).saturating_sub(1));
    }

    /// `f(dst piece, src piece)` over matching pieces of two equally long slices, on up to
    /// `threads` threads (one piece each). Pieces are at least [`MIN_PIECE_BYTES`] (waking a
    /// thread costs µs) and `dst`'s pieces start at `align`-byte addresses (pages; huge pages
    /// for fresh memory, so no two threads fault the same one). Slices of different lengths
    /// are an [`Error::LengthMismatch`]; a piece whose `f` panics, an
    /// [`Error::WorkerPanicked`] (the other pieces may or may not have run).
    pub fn map<S: Sync, D: Send>(
        &self,
        threads: usize,
        align: usize,
        dst: &mut [D],
        src: &[S],
        f: impl Fn(&mut [D], &[S]) + Sync,
    ) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::LengthMismatch {
                op: "Workers::map",
                left: dst.len(),
                right: src.len(),
            });
        }
        let len = dst.len();
        let size = std::mem::size_of::<D>()
            .max(std::mem::size_of::<S>())
            .max(1);
        let parts = threads
            .min(self.threads)
            .min(len.div_ceil((MIN_PIECE_BYTES / size).max(1)))
            .max(1);
        if parts == 1 {
            return guarded(|| f(dst, src));
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
        })
    }

    /// Runs `f(0)`, ..., `f(parts - 1)` spread over the threads; returns when all are done.
    /// A part that panics (on any thread, the caller's included) makes this an
    /// [`Error::WorkerPanicked`] with the panic's message once the parts in progress have
    /// returned (others may or may not have run); every thread stays in the pool.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> Result<()> {
        if parts <= 1 || self.threads == 1 {
            return (0..parts).try_for_each(|i| guarded(|| f(i)));
        }
        let _one = self.run.lock();
        for first in (0..parts).step_by(MAX_PARTS) {
            let n = MAX_PARTS.min(parts - first);
            if first == 0 {
                self.post(n, f)?;
            } else {
                self.post(n, &|i| f(first + i))?;
            }
        }
        Ok(())
    }

    /// Posts one job of `parts` (at most [`MAX_PARTS`]) parts, works on it, and returns
    /// when every part is done: an error when one of them panicked. The caller holds
    /// `self.run`.
    fn post(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> Result<()> {
        let shared = &*self.shared;
        // SAFETY: the lifetime is erased only while this call runs: a worker calls `f` only
        // for a part whose ticket it took (so the job is not over), `Finish` (also on
        // unwinding) waits until every taken part has returned, and `posted` outlives it.
        let posted = Posted(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                f as *const _,
            )
        });
        let generation = Ticket(shared.ticket.load(Ordering::Relaxed)).generation() + 1;
        shared.left.store(parts, Ordering::Relaxed);
        shared
            .job
            .store(&posted as *const Posted as *mut Posted, Ordering::Relaxed);
        // Publishes `left` and `job` with it; SeqCst against a worker going to sleep (it
        // counts itself in `asleep`, then rereads the ticket).
        shared.ticket.store(
            Ticket::new(generation & 0xffff_ffff, parts).0,
            Ordering::SeqCst,
        );
        // Wakes as many sleepers as there are parts besides the caller's: waking all of them
        // for a two-part copy slowed small uploads (bench/NOTES.md, copy-thread wake-ups).
        wake(shared, parts - 1);
        {
            let _finish = Finish(shared);
            work_on(shared);
        }
        // Every part has returned (`Finish`), its panic recorded before it counted itself;
        // taking it leaves `panicked` empty for the next job.
        match shared.panicked.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Runs one part, a panic in it turned into [`Error::WorkerPanicked`].
fn guarded(part: impl FnOnce()) -> Result<()> {
    catch_unwind(AssertUnwindSafe(part)).map_err(|p| Error::WorkerPanicked(panic_message(&*p)))
}

/// The message a panic was raised with (`panic!`'s formatted text, when it has one).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a part panicked with a non-string payload".to_string()
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

/// Marks the current job's untaken parts done (parts nobody took, should the caller unwind),
/// then waits until every taken part has returned: spinning first (parts take µs), then
/// asleep on `done`.
struct Finish<'a>(&'a Shared);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        let mut t = Ticket(shared.ticket.load(Ordering::Acquire));
        while t.next() < t.parts() {
            match shared.ticket.compare_exchange_weak(
                t.0,
                t.taken(t.parts()).0,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    shared
                        .left
                        .fetch_sub(t.parts() - t.next(), Ordering::AcqRel);
                    break;
                }
                Err(now) => t = Ticket(now),
            }
        }
        let until = Instant::now() + FINISH_SPIN;
        while shared.left.load(Ordering::Acquire) > 0 {
            if Instant::now() >= until {
                let mut guard = shared.done_lock.lock();
                while shared.left.load(Ordering::Acquire) > 0 {
                    shared.done.wait(&mut guard);
                }
                break;
            }
            std::hint::spin_loop();
        }
    }
}

/// How long [`Finish`] spins before it sleeps.
const FINISH_SPIN: Duration = Duration::from_micros(200);

/// True when the current job has a part nobody took. (SeqCst: a worker going to sleep reads
/// this after counting itself in `asleep`.)
fn has_work(shared: &Shared) -> bool {
    let t = Ticket(shared.ticket.load(Ordering::SeqCst));
    t.next() < t.parts()
}

/// Takes parts of the current job until none is left.
fn work_on(shared: &Shared) {
    let mut t = Ticket(shared.ticket.load(Ordering::Acquire));
    while t.next() < t.parts() {
        let i = t.next();
        match shared.ticket.compare_exchange_weak(
            t.0,
            t.taken(i + 1).0,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // The ticket was this job's with part `i` untaken, so the job is not over
                // and `job` (stored before the ticket was published) is its own.
                let posted = shared.job.load(Ordering::Acquire);
                let _done = PartDone(shared);
                // A panic stays in the part: the thread lives on, and the job fails.
                // SAFETY: `posted` and its closure stay alive until `left` reaches 0, which
                // cannot happen before `_done` counts this part (see `Workers::post`).
                if let Err(e) = guarded(|| unsafe { (*(*posted).0)(i) }) {
                    shared.panicked.lock().get_or_insert(e);
                }
                drop(_done);
                t = Ticket(shared.ticket.load(Ordering::Acquire));
            }
            Err(now) => t = Ticket(now),
        }
    }
}

/// Counts a taken part finished when dropped, waking the caller after the last one.
struct PartDone<'a>(&'a Shared);

impl Drop for PartDone<'_> {
    fn drop(&mut self) {
        if self.0.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self.0.done_lock.lock();
            self.0.done.notify_all();
        }
    }
}

/// How long an idle worker keeps looking for the next job before it sleeps: jobs often
/// come in quick succession (chunk after chunk, a DMA apart), and waking a sleeping thread
/// costs tens of µs (bench/NOTES.md, copy-thread wake-ups). It yields now and then while looking,
/// so runnable threads keep their CPUs.
const SPIN: Duration = Duration::from_micros(250);

/// Copy thread `i`'s loop (threads 1.. are spawned; 0 is the caller's).
fn worker(shared: &Shared, i: usize) {
    let me = &shared.sleepers[i];
    // Set before the first sleep, which happens only after this.
    let _ = me.thread.set(std::thread::current());
    loop {
        let until = Instant::now() + SPIN;
        let mut polls = 0u32;
        while !has_work(shared) {
            polls += 1;
            if polls % 64 == 0 {
                if Instant::now() >= until {
                    sleep_until_work(shared, me);
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        work_on(shared);
    }
}

/// Parks until a job with an untaken part is posted or another thread claims this one's
/// wake-up ([`wake`]), then passes wake-ups on. The flag and the count go up before the
/// ticket is reread (all SeqCst, against `post`'s ticket store and its reads of them):
/// either this sees the job or the poster sees the flag and a wake-up is claimed (an unpark
/// before the park makes the park return at once). Parks can also end spuriously, hence the
/// loop.
fn sleep_until_work(shared: &Shared, me: &Sleeper) {
    loop {
        me.asleep.store(true, Ordering::SeqCst);
        shared.asleep.fetch_add(1, Ordering::SeqCst);
        let work = has_work(shared);
        if !work {
            std::thread::park();
        }
        // Still flagged: nobody claimed this wake-up, so the count is this thread's to take.
        let claimed = !me.asleep.swap(false, Ordering::SeqCst);
        if !claimed {
            shared.asleep.fetch_sub(1, Ordering::SeqCst);
        }
        if work || claimed || has_work(shared) {
            break;
        }
    }
    pass_wakes(shared);
}

/// Asks for `n` sleeping threads to be woken: unparks one here and leaves the rest to the
/// threads that wake ([`pass_wakes`]), so that this thread gets on with its own work.
fn wake(shared: &Shared, n: usize) {
    if n == 0 || shared.asleep.load(Ordering::SeqCst) == 0 {
        return;
    }
    shared.to_wake.store(n, Ordering::SeqCst);
    take_wake(shared);
}

/// Wakes sleeping threads while wake-ups are wanted (each woken thread does the same, so
/// the wake-ups spread as a tree rather than a chain of system calls on one thread).
fn pass_wakes(shared: &Shared) {
    while take_wake(shared) {}
}

/// Claims one wanted wake-up and unparks a sleeping thread for it; false when none is
/// wanted or none sleeps.
fn take_wake(shared: &Shared) -> bool {
    let claimed = shared
        .to_wake
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if claimed.is_err() {
        return false;
    }
    for sleeper in &shared.sleepers {
        if sleeper
            .asleep
            .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            shared.asleep.fetch_sub(1, Ordering::SeqCst);
            if let Some(thread) = sleeper.thread.get() {
                thread.unpark();
            }
            return true;
        }
    }
    shared.to_wake.store(0, Ordering::SeqCst);
    false
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
        })
        .unwrap();
        assert!(dst.iter().zip(&src).all(|(d, s)| *d == u64::from(*s) * 3));
    }

    #[test]
    fn map_refuses_slices_of_different_lengths() {
        let w = Workers::new(4, None);
        let src = vec![7u8; 1 << 20];
        for dst_len in [(1 << 20) - 1, (1 << 20) + 1, 0] {
            let mut dst = vec![0u8; dst_len];
            let r = w.map(4, PAGE, &mut dst, &src, |d, s| d.copy_from_slice(s));
            assert!(
                matches!(r, Err(Error::LengthMismatch { left, right, .. })
                    if left == dst_len && right == src.len()),
                "{r:?}"
            );
            assert!(dst.iter().all(|&b| b == 0), "nothing copied");
        }
    }

    #[test]
    fn runs_every_part_once() {
        let w = Workers::new(3, None);
        for parts in [0, 1, 2, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            w.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        // More parts than one ticket holds, after the workers have gone to sleep.
        wait_until_every_copy_thread_sleeps(&w);
        let parts = MAX_PARTS * 2 + 3;
        let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
        w.run(parts, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    /// Returns once every copy thread has counted itself asleep (it parks unless work came
    /// meanwhile); the bound only stops a lost thread from hanging the test.
    fn wait_until_every_copy_thread_sleeps(w: &Workers) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.shared.asleep.load(Ordering::SeqCst) < w.threads() - 1 {
            assert!(
                Instant::now() < deadline,
                "the copy threads never went to sleep"
            );
            std::thread::yield_now();
        }
    }

    /// Runs one part per thread, each waiting until all have started, then `then()`; the
    /// parts that saw every thread at work at once (all of them when every thread is alive
    /// and awake; the bound only stops a lost thread from hanging the test).
    fn all_at_once(w: &Workers, then: impl Fn() + Sync) -> (Result<()>, usize) {
        let (started, met) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = w.run(w.threads(), &|_| {
            started.fetch_add(1, Ordering::SeqCst);
            while started.load(Ordering::SeqCst) < w.threads() && Instant::now() < deadline {
                std::hint::spin_loop();
            }
            if started.load(Ordering::SeqCst) == w.threads() {
                met.fetch_add(1, Ordering::SeqCst);
            }
            then();
        });
        (r, met.load(Ordering::SeqCst))
    }

    fn on_copy_thread() -> bool {
        // The copy threads are named; the caller, which takes parts too, is not.
        let name = std::thread::current().name().map(str::to_owned);
        name.is_some_and(|n| n.starts_with("warpdrive-copy"))
    }

    #[test]
    fn every_sleeping_thread_wakes_for_a_job() {
        let w = Workers::new(6, None);
        for _ in 0..20 {
            wait_until_every_copy_thread_sleeps(&w);
            let (r, met) = all_at_once(&w, || {});
            r.unwrap();
            assert_eq!(met, w.threads());
        }
    }

    #[test]
    fn waking_ahead_of_jobs_loses_no_thread() {
        let w = Workers::new(6, None);
        for round in 0..40 {
            // Woken early, some or all: the threads look for work for a while, then sleep
            // again; every job still gets every thread.
            w.wake(round % 8);
            if round % 2 == 0 {
                w.wake(w.threads());
            }
            let (r, met) = all_at_once(&w, || {});
            r.unwrap();
            assert_eq!(met, w.threads());
        }
    }

    #[test]
    fn callers_on_several_threads_each_get_their_own_job() {
        let w = Workers::new(4, None);
        std::thread::scope(|s| {
            for caller in 0..3u64 {
                let w = &w;
                s.spawn(move || {
                    for round in 0..300u64 {
                        let parts = (round % 9) as usize + 1;
                        let sum = AtomicU64::new(0);
                        w.run(parts, &|i| {
                            sum.fetch_add(caller * 1000 + i as u64, Ordering::Relaxed);
                        })
                        .unwrap();
                        let want: u64 = (0..parts as u64).map(|i| caller * 1000 + i).sum();
                        assert_eq!(sum.load(Ordering::Relaxed), want);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_part_on_the_caller_fails_the_job_and_leaves_the_pool_usable() {
        let w = Workers::new(3, None);
        let caller_took_one = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = w.run(64, &|_| {
            if !on_copy_thread() {
                caller_took_one.store(true, Ordering::SeqCst);
                panic!("a part on the caller");
            }
            // Copy threads hold their parts until the caller has one (bounded against a
            // hang), so they cannot take every part first.
            while !caller_took_one.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::hint::spin_loop();
            }
        });
        assert!(
            matches!(&r, Err(Error::WorkerPanicked(m)) if m == "a part on the caller"),
            "{r:?}"
        );
        let hits = AtomicUsize::new(0);
        w.run(8, &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_panicking_part_on_a_copy_thread_fails_the_job_and_the_pool_keeps_every_thread() {
        let w = Workers::new(4, None);
        // Every copy thread takes a part (each waits for all), and each panics.
        let (r, _) = all_at_once(&w, || {
            if on_copy_thread() {
                panic!("a part on a copy thread");
            }
        });
        assert!(
            matches!(&r, Err(Error::WorkerPanicked(m)) if m == "a part on a copy thread"),
            "{r:?}"
        );
        // The next jobs run every part, on every thread at once.
        for _ in 0..3 {
            let (r, met) = all_at_once(&w, || {});
            r.unwrap();
            assert_eq!(met, w.threads());
        }
        // A single part (run on the caller) and `map` fail the same way.
        let r = w.run(1, &|_| panic!("{}", "formatted"));
        assert!(
            matches!(&r, Err(Error::WorkerPanicked(m)) if m == "formatted"),
            "{r:?}"
        );
        let src = vec![1u8; 4 * MIN_PIECE_BYTES];
        let mut dst = vec![0u8; src.len()];
        let r = w.map(4, PAGE, &mut dst, &src, |_, _| panic!("every piece"));
        assert!(
            matches!(&r, Err(Error::WorkerPanicked(m)) if m == "every piece"),
            "{r:?}"
        );
    }
}
