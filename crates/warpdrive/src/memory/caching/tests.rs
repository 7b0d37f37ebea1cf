//! The pool core against a shadow model: a counting raw allocator, fences the test
//! completes by hand, and property tests over random alloc / free / fence / trim sequences.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;

use proptest::prelude::*;

use super::*;

const MIB: usize = 1 << 20;

/// Hands out address ranges from a counter, with gaps so segments are never adjacent, up
/// to `cap` bytes at once.
#[derive(Default)]
struct FakeRaw {
    next: u64,
    cap: usize,
    live: BTreeMap<u64, usize>,
    syncs: usize,
    /// Fences that a device-wide wait completes (the work they mark has finished then).
    done_by_sync: Vec<Flag>,
}

impl FakeRaw {
    fn with_cap(cap: usize) -> Self {
        FakeRaw {
            next: 1 << 40,
            cap,
            ..Default::default()
        }
    }
    fn used(&self) -> usize {
        self.live.values().sum()
    }
}

impl RawAlloc for FakeRaw {
    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        if self.used() + bytes > self.cap {
            return Err(Error::OutOfMemory {
                requested: bytes,
                detail: "fake".into(),
            });
        }
        let addr = self.next;
        self.next += bytes as u64 + 4096;
        self.live.insert(addr, bytes);
        Ok(addr)
    }
    fn free(&mut self, addr: u64, bytes: usize) -> Result<()> {
        assert_eq!(
            self.live.remove(&addr),
            Some(bytes),
            "freed what was not allocated"
        );
        Ok(())
    }
    fn synchronize(&mut self) -> Result<bool> {
        self.syncs += 1;
        self.done_by_sync.drain(..).for_each(|f| f.0.set(true));
        Ok(true)
    }
    fn mem_info(&self) -> Option<(usize, usize)> {
        Some((self.cap - self.used(), self.cap))
    }
    fn capacity(&mut self) -> Option<usize> {
        Some(self.cap)
    }
}

/// A fence the test completes.
#[derive(Clone, Default)]
struct Flag(Rc<Cell<bool>>);

impl Fence for Flag {
    fn is_done(&self) -> Result<bool> {
        Ok(self.0.get())
    }
}

type TestCore = Core<FakeRaw, Flag>;

fn core(cap: usize) -> TestCore {
    Core::new(FakeRaw::with_cap(cap), PoolConfig::default())
}

/// A core that never releases cached segments to make room (so tests see the cache).
fn keeping_core(cap: usize) -> TestCore {
    let cfg = PoolConfig {
        release_before_growth: false,
        ..PoolConfig::default()
    };
    Core::new(FakeRaw::with_cap(cap), cfg)
}

fn no_overlap(ranges: &mut [(u64, usize)]) -> bool {
    ranges.sort_unstable();
    ranges.windows(2).all(|w| w[0].0 + w[0].1 as u64 <= w[1].0)
}

#[test]
fn sizes_round_to_512_and_pick_segments() {
    assert_eq!(round_size(0), Some(512));
    assert_eq!(round_size(1), Some(512));
    assert_eq!(round_size(512), Some(512));
    assert_eq!(round_size(513), Some(1024));
    assert_eq!(round_size(usize::MAX), None);
    assert_eq!(segment_size(512), SMALL_SEGMENT);
    assert_eq!(segment_size(MIB), SMALL_SEGMENT);
    assert_eq!(segment_size(MIB + 512), MID_SEGMENT);
    assert_eq!(segment_size(10 * MIB), 10 * MIB);
    assert_eq!(segment_size(10 * MIB + 512), 12 * MIB);
}

#[test]
fn small_requests_pack_into_one_segment_and_coalesce_back() {
    let mut c = core(1 << 30);
    let grants: Vec<Grant> = (0..8).map(|_| c.alloc(1000, 1).unwrap()).collect();
    assert_eq!(c.stats().driver_allocs, 1, "all in one 2 MiB segment");
    assert_eq!(c.stats().reserved, SMALL_SEGMENT as u64);
    assert!(grants.iter().all(|g| g.size == 1024));
    let mut r: Vec<_> = grants.iter().map(|g| (g.addr, g.size)).collect();
    assert!(no_overlap(&mut r));
    assert_eq!(c.stats().in_use, 8 * 1024);
    // Free out of order; the segment ends as one free block.
    for i in [3, 0, 7, 1, 5, 2, 6, 4] {
        c.free(grants[i].block, vec![]).unwrap();
    }
    assert_eq!(c.layout(), vec![(grants[0].addr, SMALL_SEGMENT, false)]);
    let s = c.stats();
    assert_eq!(
        (s.in_use, s.largest_free, s.total_free),
        (0, 2 * MIB as u64, 2 * MIB as u64)
    );
    assert_eq!(s.fragmentation, 0.0);
    assert_eq!(s.peak_in_use, 8 * 1024);
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits() {
    let mut c = core(1 << 30);
    let a = c.alloc(4096, 1).unwrap();
    let _b = c.alloc(512, 1).unwrap();
    let d = c.alloc(8192, 1).unwrap();
    let _e = c.alloc(512, 1).unwrap();
    c.free(d.block, vec![]).unwrap();
    c.free(a.block, vec![]).unwrap();
    // Free: 4 KiB at a, 8 KiB at d, and the segment's tail. 3 KiB fits a best.
    let f = c.alloc(3000, 1).unwrap();
    assert_eq!(f.addr, a.addr);
    let g = c.alloc(6000, 1).unwrap();
    assert_eq!(g.addr, d.addr);
    let frag = c.stats().fragmentation;
    assert!(frag > 0.0 && frag < 0.01, "{frag}");
}

#[test]
fn large_requests_split_segments_and_respect_the_never_split_threshold() {
    let mut c = core(1 << 34);
    let a = c.alloc(2 * MIB, 1).unwrap();
    let b = c.alloc(3 * MIB, 1).unwrap();
    assert_eq!(c.stats().segments, 1, "both in one 20 MiB segment");
    assert_eq!(b.addr, a.addr + 2 * MIB as u64);
    c.free(a.block, vec![]).unwrap();
    c.free(b.block, vec![]).unwrap();

    let cfg = PoolConfig {
        max_split_bytes: 64 * MIB,
        release_before_growth: false,
    };
    let mut c: TestCore = Core::new(FakeRaw::with_cap(1 << 34), cfg);
    let big = c.alloc(100 * MIB, 1).unwrap();
    c.free(big.block, vec![]).unwrap();
    // A request under the threshold does not take (or split) the oversize block.
    let small = c.alloc(30 * MIB, 1).unwrap();
    assert_ne!(small.addr, big.addr);
    assert_eq!(c.stats().segments, 2);
    // One within the slack takes it whole.
    let near = c.alloc(90 * MIB, 1).unwrap();
    assert_eq!((near.addr, near.size), (big.addr, 100 * MIB));
    c.free(near.block, vec![]).unwrap();
    // One far below it (beyond the slack) does not.
    let far = c.alloc(70 * MIB, 1).unwrap();
    assert_ne!(far.addr, big.addr);
}

#[test]
fn streams_have_their_own_free_lists() {
    let mut c = keeping_core(1 << 30);
    let a = c.alloc(4096, 1).unwrap();
    c.free(a.block, vec![]).unwrap();
    let b = c.alloc(4096, 2).unwrap();
    assert_eq!(
        c.stats().segments,
        2,
        "stream 2 does not reuse stream 1's block"
    );
    assert_ne!(a.addr, b.addr);
    let again = c.alloc(4096, 1).unwrap();
    assert_eq!(again.addr, a.addr, "stream 1 reuses its own block at once");
}

#[test]
fn a_block_used_on_other_streams_waits_for_their_fences() {
    let mut c = core(1 << 30);
    let a = c.alloc(MIB, 1).unwrap();
    let (f1, f2) = (Flag::default(), Flag::default());
    c.free(a.block, vec![f1.clone(), f2.clone()]).unwrap();
    assert_eq!(c.stats().pending, MIB as u64);
    let b = c.alloc(MIB, 1).unwrap();
    assert_ne!(b.addr, a.addr, "pending block handed out");
    f1.0.set(true);
    let d = c.alloc(MIB, 1).unwrap();
    assert_ne!(d.addr, a.addr, "handed out with one fence still pending");
    f2.0.set(true);
    let e = c.alloc(MIB, 1).unwrap();
    assert_eq!(e.addr, a.addr, "reusable once every fence completed");
    assert_eq!(c.stats().pending, 0);
    assert!(c.take_spent_fence().is_some() && c.take_spent_fence().is_some());
    assert!(c.take_spent_fence().is_none());
}

#[test]
fn double_free_is_an_error() {
    let mut c = core(1 << 30);
    let a = c.alloc(512, 1).unwrap();
    c.free(a.block, vec![]).unwrap();
    assert!(matches!(
        c.free(a.block, vec![]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(c.free(9999, vec![]).is_err());
}

#[test]
fn oom_releases_cached_segments_and_retries_once_then_reports() {
    let mut c = core(40 * MIB);
    let a = c.alloc(30 * MIB, 1).unwrap();
    c.free(a.block, vec![]).unwrap();
    // 30 MiB cached; 20 MiB more does not fit until the cache is released.
    let cfg = PoolConfig {
        release_before_growth: false,
        ..PoolConfig::default()
    };
    let mut c2: TestCore = Core::new(FakeRaw::with_cap(40 * MIB), cfg);
    let a2 = c2.alloc(30 * MIB, 1).unwrap();
    c2.free(a2.block, vec![]).unwrap();
    let b2 = c2.alloc(2 * MIB, 2).unwrap();
    assert_eq!(c2.stats().driver_frees, 1, "the cached 30 MiB went back");
    assert_eq!(c2.stats().reserved, MID_SEGMENT as u64);
    c2.free(b2.block, vec![]).unwrap();

    let b = c.alloc(50 * MIB, 1);
    let Err(Error::OutOfMemory { requested, detail }) = b else {
        panic!("expected OutOfMemory, got {b:?}");
    };
    assert_eq!(requested, 50 * MIB);
    for word in ["in use", "reserved", "largest free block", "device free"] {
        assert!(detail.contains(word), "{detail}");
    }
    // Still usable afterwards.
    let d = c.alloc(MIB, 1).unwrap();
    c.free(d.block, vec![]).unwrap();

    // Within the capacity but refused even after releasing the cache: the retry fails too.
    let mut c3 = keeping_core(40 * MIB);
    let live = c3.alloc(20 * MIB, 1).unwrap();
    let cached = c3.alloc(2 * MIB, 1).unwrap();
    c3.free(cached.block, vec![]).unwrap();
    let err = c3.alloc(30 * MIB, 1).unwrap_err().to_string();
    assert!(err.contains("refused"), "{err}");
    assert_eq!(
        c3.stats().driver_frees,
        1,
        "the cached segment went back before the retry"
    );
    assert_eq!(c3.raw().syncs, 1, "waited for the device before releasing");
    c3.free(live.block, vec![]).unwrap();
}

/// PyTorch's record_stream OOM case: the driver refuses, the pool waits for the device,
/// and a block that was pending on another stream is handed out although its segment cannot
/// go back to the driver (other blocks in it are live).
#[test]
fn oom_waits_for_pending_blocks_and_reuses_one_that_fits() {
    let mut c = core(24 * MIB);
    // One 20 MiB segment on stream 1, full: 6 + 6 + 8 MiB.
    let a = c.alloc(6 * MIB, 1).unwrap();
    let b = c.alloc(6 * MIB, 1).unwrap();
    let d = c.alloc(8 * MIB, 1).unwrap();
    assert_eq!(c.stats().segments, 1);
    // `a` was used on another stream whose work is still queued.
    let fence = Flag::default();
    c.free(a.block, vec![fence.clone()]).unwrap();
    c.raw.done_by_sync.push(fence);
    // A second 20 MiB segment does not fit in 24 MiB: only the wait frees a block.
    let again = c.alloc(6 * MIB, 1).unwrap();
    assert_eq!(again.addr, a.addr, "the block the wait completed is reused");
    let s = c.stats();
    assert_eq!((s.pending, s.segments, c.raw().syncs), (0, 1, 1));
    assert_eq!(s.in_use, 20 * MIB as u64);
    for g in [again, b, d] {
        c.free(g.block, vec![]).unwrap();
    }
    assert_eq!(c.trim().unwrap(), MID_SEGMENT as u64);
}

#[test]
fn release_before_growth_keeps_reserved_at_its_peak() {
    let mut c = core(1 << 34);
    let a = c.alloc(100 * MIB, 1).unwrap();
    c.free(a.block, vec![]).unwrap();
    // Stream 2 misses; stream 1's free 100 MiB segment goes back first.
    let b = c.alloc(60 * MIB, 2).unwrap();
    let s = c.stats();
    assert_eq!(s.reserved, 60 * MIB as u64);
    assert_eq!(s.peak_reserved, 100 * MIB as u64);
    assert_eq!(s.driver_frees, 1);
    c.free(b.block, vec![]).unwrap();
    // Growth under the old peak keeps the cache.
    let d = c.alloc(30 * MIB, 3).unwrap();
    assert_eq!(c.stats().driver_frees, 1);
    assert_eq!(c.stats().reserved, 90 * MIB as u64);
    c.free(d.block, vec![]).unwrap();
    assert_eq!(c.trim().unwrap(), 90 * MIB as u64);
    assert_eq!(c.stats().reserved, 0);
    assert!(c.raw().live.is_empty());
}

#[test]
fn capture_mode_serves_only_held_blocks_and_reserves_them_for_the_graph() {
    let mut c = core(1 << 30);
    // Warm up: one 2 MiB segment on stream 1.
    let w = c.alloc(4096, 1).unwrap();
    c.free(w.block, vec![]).unwrap();
    let g = c.begin_capture(1).unwrap();
    assert!(c.is_capturing(1));
    assert!(c.begin_capture(1).is_err(), "one capture per stream");
    let a = c.alloc(4096, 1).unwrap();
    let b = c.alloc(MIB, 1).unwrap();
    assert_eq!(c.stats().driver_allocs, 1, "no driver call during capture");
    // Nothing fits: a clear error, not a driver call.
    let err = c.alloc(4 * MIB, 1).unwrap_err().to_string();
    assert!(err.contains("captured"), "{err}");
    assert_eq!(c.stats().driver_allocs, 1);
    // Other streams still allocate (from the driver if needed).
    let other = c.alloc(4096, 2).unwrap();
    // Freed during capture: reserved for the graph, reused by it.
    c.free(a.block, vec![]).unwrap();
    let a2 = c.alloc(4096, 1).unwrap();
    assert_eq!(a2.addr, a.addr);
    c.end_capture(g);
    assert!(!c.is_capturing(1));
    c.free(a2.block, vec![]).unwrap();
    c.free(b.block, vec![]).unwrap();
    let s = c.stats();
    assert_eq!(s.graph_reserved, (4096 + MIB) as u64);
    // While the graph lives, stream 1's ordinary allocations do not get its blocks.
    let n = c.alloc(MIB, 1).unwrap();
    assert!(n.addr != b.addr && n.addr != a.addr);
    c.free(n.block, vec![]).unwrap();
    assert_eq!(
        c.trim().unwrap(),
        SMALL_SEGMENT as u64,
        "only n's segment goes: the graph's is held, the other stream's is in use"
    );
    c.release_graph(g);
    assert_eq!(c.stats().graph_reserved, 0);
    c.free(other.block, vec![]).unwrap();
    // Everything coalesced back: each segment is one free block.
    assert!(c
        .layout()
        .iter()
        .all(|&(_, size, used)| !used && size == SMALL_SEGMENT));
    assert!(c.trim().unwrap() > 0);
    assert_eq!(c.stats().reserved, 0);
}

#[test]
fn a_graph_released_while_its_blocks_are_live_gets_them_back_on_free() {
    let mut c = core(1 << 30);
    let w = c.alloc(8192, 1).unwrap();
    c.free(w.block, vec![]).unwrap();
    let g = c.begin_capture(1).unwrap();
    let a = c.alloc(4096, 1).unwrap();
    c.end_capture(g);
    c.release_graph(g);
    c.free(a.block, vec![]).unwrap();
    assert_eq!(c.stats().graph_reserved, 0);
    assert_eq!(c.layout(), vec![(a.addr, SMALL_SEGMENT, false)]);
}

// ---- property tests ----

#[derive(Debug, Clone)]
enum Op {
    Alloc { bytes: usize, stream: u64 },
    Free { pick: usize, fences: usize },
    Complete { pick: usize },
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    let bytes = prop_oneof![
        6 => 1usize..=4096,
        3 => 4097usize..=MIB,
        2 => (MIB + 1)..=(12 * MIB),
        1 => (12 * MIB)..=(64 * MIB),
    ];
    prop_oneof![
        10 => (bytes, 1u64..=3).prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        8 => (any::<usize>(), prop_oneof![4 => Just(0usize), 1 => 1usize..=2])
            .prop_map(|(pick, fences)| Op::Free { pick, fences }),
        3 => any::<usize>().prop_map(|pick| Op::Complete { pick }),
        1 => Just(Op::Trim),
    ]
}

/// A block in the model: handed out (`fences` empty) or freed and waiting.
struct Held {
    grant: Grant,
    stream: u64,
    fences: Vec<Flag>,
}

fn check(c: &TestCore, held: &[Held], owners: &BTreeMap<u64, (usize, u64)>) {
    // Live (and pending) blocks never overlap and lie in a segment of their stream.
    let mut ranges: Vec<(u64, usize)> = held.iter().map(|h| (h.grant.addr, h.grant.size)).collect();
    assert!(no_overlap(&mut ranges), "overlapping blocks");
    for h in held {
        let (&base, &(len, stream)) = owners
            .range(..=h.grant.addr)
            .next_back()
            .expect("a block outside every segment");
        assert!(h.grant.addr + h.grant.size as u64 <= base + len as u64);
        assert_eq!(stream, h.stream, "a block from another stream's segment");
    }
    // Stats match the model.
    let s = c.stats();
    let in_use: u64 = held
        .iter()
        .filter(|h| h.fences.is_empty())
        .map(|h| h.grant.size as u64)
        .sum();
    assert_eq!(s.in_use, in_use);
    assert!(s.peak_in_use >= s.in_use && s.peak_reserved >= s.reserved);
    assert_eq!(s.reserved, c.raw().used() as u64);
    assert_eq!(s.segments, c.raw().live.len() as u64);
    assert_eq!(s.driver_allocs - s.driver_frees, s.segments);
    assert_eq!(s.in_use + s.pending + s.total_free, s.reserved);
    // Segments are tiled by their blocks, and no two free neighbours are left apart.
    let mut layout = c.layout();
    layout.sort_unstable();
    let mut i = 0;
    for (&base, &(len, _)) in owners {
        let mut at = base;
        let mut prev_free = false;
        while at < base + len as u64 {
            let (addr, size, used) = layout[i];
            assert_eq!(addr, at, "gap or overlap in a segment");
            assert!(!prev_free || used, "free neighbours not coalesced");
            prev_free = !used;
            at += size as u64;
            i += 1;
        }
        assert_eq!(at, base + len as u64);
    }
    assert_eq!(i, layout.len());
}

fn run(ops: Vec<Op>) {
    let mut c = core(1 << 31);
    let mut held: Vec<Held> = Vec::new();
    // Segment base → (size, stream), mirrored from the fake driver.
    let mut owners: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
    let sync = |c: &TestCore, owners: &mut BTreeMap<u64, (usize, u64)>, stream: u64| {
        owners.retain(|a, _| c.raw().live.contains_key(a));
        for (&a, &len) in &c.raw().live {
            owners.entry(a).or_insert((len, stream));
        }
    };
    for op in ops {
        match op {
            Op::Alloc { bytes, stream } => match c.alloc(bytes, stream) {
                Ok(grant) => {
                    assert!(grant.size >= bytes && grant.size % ROUND == 0);
                    sync(&c, &mut owners, stream);
                    held.push(Held {
                        grant,
                        stream,
                        fences: vec![],
                    });
                }
                Err(Error::OutOfMemory { .. }) => sync(&c, &mut owners, stream),
                Err(e) => panic!("{e}"),
            },
            Op::Free { pick, fences } => {
                let live: Vec<usize> = (0..held.len())
                    .filter(|&i| held[i].fences.is_empty())
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let i = live[pick % live.len()];
                let flags: Vec<Flag> = (0..fences).map(|_| Flag::default()).collect();
                c.free(held[i].grant.block, flags.clone()).unwrap();
                if flags.is_empty() {
                    held.swap_remove(i);
                } else {
                    held[i].fences = flags;
                }
            }
            Op::Complete { pick } => {
                let waiting: Vec<usize> = (0..held.len())
                    .filter(|&i| !held[i].fences.is_empty())
                    .collect();
                if waiting.is_empty() {
                    continue;
                }
                let i = waiting[pick % waiting.len()];
                for f in &held[i].fences {
                    f.0.set(true);
                }
                held.swap_remove(i);
            }
            Op::Trim => {
                c.trim().unwrap();
                sync(&c, &mut owners, 0);
            }
        }
        check(&c, &held, &owners);
    }
    // Free everything, complete every fence: all memory coalesces back, then trims to zero.
    for h in held.drain(..) {
        if h.fences.is_empty() {
            c.free(h.grant.block, vec![]).unwrap();
        } else {
            h.fences.iter().for_each(|f| f.0.set(true));
        }
    }
    c.poll(true).unwrap();
    let s = c.stats();
    assert_eq!((s.in_use, s.pending), (0, 0));
    let layout = c.layout();
    assert_eq!(
        layout.len() as u64,
        s.segments,
        "every segment coalesced to one block"
    );
    assert!(layout.iter().all(|&(_, _, used)| !used));
    c.trim().unwrap();
    assert_eq!(c.stats().reserved, 0);
    assert!(c.raw().live.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_sequences_keep_the_invariants(ops in prop::collection::vec(op(), 1..300)) {
        run(ops);
    }
}
