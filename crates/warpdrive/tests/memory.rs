//! Device pools, buffers from them, and the pinned pool, on both backends. GPU tests
//! (`gpu_*`) are ignored without a GPU; the pool's policy itself is property-tested on its
//! own in the library (`memory::caching`).

mod common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{cuda, device_test, rng, seed};
use parking_lot::Mutex;
use proptest::prelude::*;
use rand::Rng;
use warpdrive::memory::{
    device_pool, pinned_class, DevicePool, PinnedBuf, PinnedPool, PoolConfig, PoolStrategy,
    SMALL_MAX,
};
use warpdrive::{ops, Buffer, Device, Error, Event, Stream};

const MIB: usize = 1 << 20;

fn caching_pool(dev: &Device) -> Arc<DevicePool> {
    DevicePool::new(dev, PoolStrategy::Caching(PoolConfig::default())).unwrap()
}

// ---- one body per behaviour, run on each backend ----

/// Buffers come from the pool, go back on drop, are reused on their stream, and the stats
/// follow; trim returns everything.
fn reuse_body(dev: &Device) {
    let pool = caching_pool(dev);
    let s = dev.new_stream().unwrap();
    let a = Buffer::<f32>::uninit_in(&pool, &s, 1000).unwrap();
    let st = pool.stats().unwrap();
    assert_eq!(
        (st.in_use, st.reserved, st.driver_allocs),
        (4096, 2 * MIB as u64, 1)
    );
    let a_ptr = a.device_ptr();
    assert_eq!(a.pool().strategy_name(), "caching");
    drop(a);
    assert_eq!(pool.stats().unwrap().in_use, 0);
    let b = Buffer::<u8>::uninit_in(&pool, &s, 3000).unwrap();
    assert_eq!(
        b.device_ptr(),
        a_ptr,
        "the freed block is reused at once on its stream"
    );
    // Live buffers never overlap, and their contents stay their own.
    let mut bufs: Vec<Buffer<u32>> = (0..20u32)
        .map(|i| {
            let mut x = Buffer::<u32>::uninit_in(&pool, &s, 1 + 997 * i as usize).unwrap();
            ops::fill(&s, &mut x, 0xA000_0000 | i).unwrap();
            x
        })
        .collect();
    bufs.retain(|x| x.len() % 2 == 0);
    for x in &bufs {
        let v = x.to_host(&s).unwrap();
        assert!(v.iter().all(|&e| e == v[0]) && v[0] >> 28 == 0xA);
    }
    let large = Buffer::<u8>::uninit_in(&pool, &s, 3 * MIB).unwrap();
    assert!(
        pool.stats().unwrap().segments >= 2,
        "large requests get their own segments"
    );
    drop((b, bufs, large));
    let st = pool.stats().unwrap();
    assert_eq!(st.in_use, 0);
    assert!(st.peak_in_use > 0 && st.allocations == 23);
    // Everything coalesced back: the largest free block is the whole large segment.
    assert_eq!(st.total_free, st.reserved);
    assert_eq!(st.largest_free, 20 * MIB as u64);
    assert_eq!(pool.trim().unwrap(), st.reserved);
    assert_eq!(pool.stats().unwrap().reserved, 0);
}

/// The default pool serves `Buffer::uninit`; empty buffers take nothing.
fn default_pool_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let pool = device_pool(dev).unwrap();
    let e = Buffer::<f64>::uninit(&s, 0).unwrap();
    assert!(e.is_empty() && e.device_ptr() == 0);
    let x = Buffer::from_host(&s, &[1.5f64, 2.5, -3.0]).unwrap();
    assert!(Arc::ptr_eq(x.pool(), pool));
    assert!(pool.stats().unwrap().in_use >= 512);
    assert_eq!(x.to_host(&s).unwrap(), [1.5, 2.5, -3.0]);
    // A stream of another device is refused.
    let other = if dev.is_cuda() {
        Device::cpu()
    } else {
        dev.clone()
    };
    if other != *dev {
        let os = other.new_stream().unwrap();
        assert!(matches!(
            Buffer::<f32>::uninit_in(pool, &os, 4),
            Err(Error::DeviceMismatch { .. })
        ));
    }
    // Handing the cache back keeps what is in use and leaves the pool serving.
    drop(Buffer::<u8>::uninit(&s, 3 << 20).unwrap());
    s.synchronize().unwrap();
    warpdrive::memory::release_cached().unwrap();
    assert_eq!(x.to_host(&s).unwrap(), [1.5, 2.5, -3.0]);
    assert_eq!(
        Buffer::from_host(&s, &[7u32]).unwrap().to_host(&s).unwrap(),
        [7]
    );
}

/// Capture mode: allocations on the capturing stream come only from held blocks.
fn capture_body(dev: &Device) {
    let pool = caching_pool(dev);
    let s = dev.new_stream().unwrap();
    drop(Buffer::<u8>::uninit_in(&pool, &s, 64 * 1024).unwrap());
    let reserved = pool.stats().unwrap().reserved;
    let graph = pool.begin_capture(&s).unwrap();
    assert!(pool.begin_capture(&s).is_err());
    let a = Buffer::<u8>::uninit_in(&pool, &s, 32 * 1024).unwrap();
    let err = Buffer::<u8>::uninit_in(&pool, &s, 8 * MIB).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { detail, .. } if detail.contains("captured")),
        "{err}"
    );
    graph.end_capture();
    drop(a);
    let st = pool.stats().unwrap();
    assert_eq!(st.reserved, reserved, "no driver allocation during capture");
    assert_eq!(
        st.graph_reserved,
        32 * 1024,
        "the graph's block stays reserved"
    );
    drop(graph);
    assert_eq!(pool.stats().unwrap().graph_reserved, 0);
    assert_eq!(pool.trim().unwrap(), reserved);
}

/// More than the device has is `OutOfMemory` with the figures; the pool works afterwards.
fn oom_body(dev: &Device) {
    let request = if dev.is_cuda() {
        let total = dev.info().unwrap().memory_total as usize;
        total + total / 2
    } else {
        // More than any address space: the host allocator refuses it.
        1 << 50
    };
    let pool = caching_pool(dev);
    let s = dev.new_stream().unwrap();
    let keep = Buffer::<u8>::uninit_in(&pool, &s, MIB).unwrap();
    drop(Buffer::<u8>::uninit_in(&pool, &s, 16 * MIB).unwrap());
    let err = Buffer::<u8>::uninit_in(&pool, &s, request).unwrap_err();
    let Error::OutOfMemory { requested, detail } = &err else {
        panic!("expected OutOfMemory, got {err}");
    };
    assert_eq!(*requested, request);
    for word in ["in use", "reserved", "largest free block", "device free"] {
        assert!(detail.contains(word), "{detail}");
    }
    assert_eq!(pool.stats().unwrap().in_use, MIB as u64);
    let mut x = Buffer::<u32>::uninit_in(&pool, &s, 4 * MIB).unwrap();
    ops::fill(&s, &mut x, 7).unwrap();
    assert_eq!(
        ops::sum_to_host(&s, &Buffer::<f32>::from_host(&s, &[1.0; 3]).unwrap()).unwrap(),
        3.0
    );
    assert!(x.to_host(&s).unwrap().iter().all(|&v| v == 7));
    drop(keep);
}

/// Pinned buffers: size classes, reuse after drop, prewarm, copies both ways.
fn pinned_body(dev: &Device, seed: u64) {
    let pool = PinnedPool::new(dev);
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let data: Vec<f32> = (0..100_003).map(|_| r.random_range(-1.0..1.0)).collect();
    let mut src = PinnedBuf::<f32>::new_in(&pool, data.len()).unwrap();
    src.wait_slice_mut().unwrap().copy_from_slice(&data);
    let mut dev_buf = Buffer::<f32>::from_host(&s, &vec![f32::NAN; data.len()]).unwrap();
    dev_buf.copy_from_pinned(&s, &mut src).unwrap();
    let mut dst = PinnedBuf::<f32>::new_in(&pool, data.len()).unwrap();
    dst.wait_slice_mut().unwrap().fill(f32::NAN);
    dev_buf.copy_to_pinned(&s, &mut dst).unwrap();
    assert!(dst.wait_slice().unwrap() == &data[..], "pinned round trip");
    let st = pool.stats();
    let class = pinned_class(data.len() * 4) as u64;
    assert_eq!(
        (st.in_use, st.reserved, st.driver_allocs),
        (2 * class, 2 * class, 2)
    );
    let p = src.host_ptr();
    drop(src);
    s.synchronize().unwrap();
    let again = PinnedBuf::<f32>::new_in(&pool, data.len() - 5).unwrap();
    assert_eq!(
        again.host_ptr(),
        p,
        "same class, reused after its copy completed"
    );
    assert_eq!(pool.stats().driver_allocs, 2);
    pool.prewarm(MIB).unwrap();
    let warm = PinnedBuf::<u8>::new_in(&pool, MIB).unwrap();
    assert_eq!(
        pool.stats().driver_allocs,
        3,
        "prewarmed block served the request"
    );
    drop((again, dst, warm));
    assert_eq!(pool.stats().in_use, 0);
    assert!(pool.trim().unwrap() > 0);
    assert_eq!(pool.stats().reserved, 0);
    // The default pinned pool, and a mismatched device.
    let x = PinnedBuf::from_slice(dev, &[1u8, 2, 3]).unwrap();
    assert_eq!(x.wait_slice().unwrap(), [1, 2, 3]);
    assert!(PinnedBuf::<u8>::new(dev, 0).unwrap().is_empty());
}

device_test!(
    buffers_come_from_the_pool_and_are_reused_on_cpu,
    gpu_buffers_come_from_the_pool_and_are_reused,
    reuse_body
);

device_test!(
    the_default_pool_serves_buffers_on_cpu,
    gpu_the_default_pool_serves_buffers,
    default_pool_body
);

device_test!(
    capture_mode_uses_only_held_blocks_on_cpu,
    gpu_capture_mode_uses_only_held_blocks,
    capture_body
);

device_test!(
    oom_is_an_error_and_the_pool_recovers_on_cpu,
    gpu_more_than_the_card_has_is_out_of_memory_and_the_pool_recovers,
    oom_body
);

device_test!(
    pinned_buffers_round_trip_and_are_reused_on_cpu,
    gpu_pinned_buffers_round_trip_and_are_reused,
    |dev| pinned_body(dev, seed("pinned"))
);

#[test]
fn the_async_strategy_needs_cuda() {
    assert!(matches!(
        DevicePool::new(&Device::cpu(), PoolStrategy::CudaAsync),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn record_stream_checks_the_device() {
    let s = Device::cpu().new_stream().unwrap();
    let s2 = Device::cpu().new_stream().unwrap();
    let mut x = Buffer::<f32>::uninit(&s, 8).unwrap();
    x.record_stream(&s2).unwrap();
    x.record_stream(&s).unwrap();
    if let Ok(g) = Device::cuda(0) {
        let gs = g.new_stream().unwrap();
        assert!(x.record_stream(&gs).is_err());
    }
}

proptest! {
    #[test]
    fn pinned_classes_waste_at_most_an_eighth(bytes in 1usize..(1 << 40)) {
        let c = pinned_class(bytes);
        prop_assert!(c >= bytes);
        prop_assert!((c - bytes) * 8 <= bytes, "{bytes} -> {c}");
        prop_assert!(pinned_class(bytes + 1) >= c);
        prop_assert_eq!(pinned_class(c), c);
    }
}

/// 8 threads × 100k operations on one pool, two streams each, buffers handed between
/// threads: every live buffer keeps its own contents (no block handed out twice), live
/// ranges never overlap, and at the end everything is back and trims to zero (none lost).
#[test]
fn eight_threads_never_share_or_lose_a_block() {
    const THREADS: usize = 8;
    const OPS: usize = 100_000;
    let dev = Device::cpu();
    let pool = caching_pool(&dev);
    let live: Arc<Mutex<BTreeMap<u64, usize>>> = Arc::default();
    let base_seed = seed("stress");
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..THREADS)
        .map(|_| mpsc::channel::<(u64, Buffer<u64>)>())
        .unzip();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let (pool, live, dev) = (pool.clone(), live.clone(), dev.clone());
            let next = senders[(t + 1) % THREADS].clone();
            std::thread::spawn(move || {
                let mut r = rng(base_seed ^ t as u64);
                let streams: Vec<Stream> = (0..2).map(|_| dev.new_stream().unwrap()).collect();
                let mut mine: Vec<(u64, Buffer<u64>)> = Vec::new();
                let check_and_forget = |tag: u64, b: Buffer<u64>, s: &Stream| {
                    let v = b.to_host(s).unwrap();
                    let n = v.len();
                    assert!(
                        [v[0], v[n / 2], v[n - 1]] == [tag; 3],
                        "block contents overwritten"
                    );
                    assert!(live.lock().remove(&b.device_ptr()).is_some());
                    drop(b);
                };
                for op in 0..OPS {
                    let s = &streams[r.random_range(0..2)];
                    while let Ok((tag, b)) = inbox.try_recv() {
                        check_and_forget(tag, b, s);
                    }
                    if mine.len() < 4 || (mine.len() < 48 && r.random_bool(0.5)) {
                        let len = match r.random_range(0..1000) {
                            0..=2 => r.random_range(SMALL_MAX / 8 + 1..=SMALL_MAX / 4),
                            3..=27 => r.random_range(257..=16384),
                            _ => r.random_range(1..=256),
                        };
                        let mut b = Buffer::<u64>::uninit_in(&pool, s, len).unwrap();
                        let tag = ((t as u64) << 48) | op as u64;
                        ops::fill(s, &mut b, tag).unwrap();
                        {
                            let mut l = live.lock();
                            let (p, n) = (b.device_ptr(), b.size_bytes());
                            if let Some((&q, &m)) = l.range(..=p).next_back() {
                                assert!(q + m as u64 <= p, "overlapping live blocks");
                            }
                            if let Some((&q, _)) = l.range(p..).next() {
                                assert!(p + n as u64 <= q, "overlapping live blocks");
                            }
                            l.insert(p, n);
                        }
                        mine.push((tag, b));
                    } else {
                        let (tag, b) = mine.swap_remove(r.random_range(0..mine.len()));
                        if op % 10 == 0 {
                            // Freed by the next thread, later.
                            if let Err(mpsc::SendError(m)) = next.send((tag, b)) {
                                check_and_forget(m.0, m.1, s);
                            }
                        } else {
                            check_and_forget(tag, b, s);
                        }
                    }
                }
                for (tag, b) in mine {
                    check_and_forget(tag, b, &streams[0]);
                }
                drop(next);
                // Drain what the previous thread still sends until it is done.
                for (tag, b) in inbox {
                    check_and_forget(tag, b, &streams[0]);
                }
            })
        })
        .collect();
    drop(senders);
    for h in handles {
        h.join().expect("a stress thread panicked");
    }
    assert!(live.lock().is_empty());
    let st = pool.stats().unwrap();
    assert_eq!(st.in_use, 0, "{st:?}");
    assert_eq!(st.pending, 0);
    assert_eq!(
        st.total_free, st.reserved,
        "every byte is back in the cache"
    );
    assert_eq!(pool.trim().unwrap(), st.reserved);
    assert_eq!(pool.stats().unwrap().reserved, 0);
}

/// How long a test waits for one of its threads before calling it hung.
const THREAD_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `f` on a new thread; its result, or its panic, arrives on `done`.
fn spawn_reporting<T: Send + 'static>(
    done: &mpsc::Sender<std::thread::Result<T>>,
    f: impl FnOnce() -> T + Send + 'static,
) {
    let done = done.clone();
    std::thread::spawn(move || {
        let _ = done.send(std::panic::catch_unwind(AssertUnwindSafe(f)));
    });
}

/// The results of `n` threads started with [`spawn_reporting`]; a panic in one is re-raised
/// here, and a thread silent for [`THREAD_TIMEOUT`] fails the test.
fn results<T>(done: mpsc::Receiver<std::thread::Result<T>>, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| match done.recv_timeout(THREAD_TIMEOUT) {
            Ok(Ok(v)) => v,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(e) => panic!("a test thread hung ({e})"),
        })
        .collect()
}

/// A buffer on its way from the thread that allocated and wrote it to the one that frees it.
struct Parcel {
    expected: Vec<u32>,
    buf: Buffer<u32>,
    /// Recorded on the producer's stream after its write.
    written: Event,
}

/// RMM's `test_allocate_free_different_threads`: producer threads allocate on streams of
/// their own and write fresh random data; consumer threads, on other streams, read each
/// buffer back, overwrite it (work still queued when they drop it, marked with
/// `record_stream`) and free it. Every buffer arrives holding its own data (no block handed
/// out again while another stream still used it); at the end every allocation was counted
/// once and none is in use.
fn cross_thread_body(dev: &Device, pool: &Arc<DevicePool>, seed: u64) {
    const PRODUCERS: usize = 3;
    const CONSUMERS: usize = 3;
    const PER_PRODUCER: usize = 150;
    let allocations_before = pool.stats().unwrap().allocations;
    let (inboxes, outboxes): (Vec<_>, Vec<_>) =
        (0..CONSUMERS).map(|_| mpsc::channel::<Parcel>()).unzip();
    let (done_tx, done_rx) = mpsc::channel();
    for p in 0..PRODUCERS {
        let (dev, pool, inboxes) = (dev.clone(), pool.clone(), inboxes.clone());
        spawn_reporting(&done_tx, move || {
            let mut r = rng(seed ^ p as u64);
            let s = dev.new_stream().unwrap();
            let mut sent = 0u64;
            for _ in 0..PER_PRODUCER {
                let len = match r.random_range(0..100) {
                    0..=4 => r.random_range(SMALL_MAX / 4..=2 * SMALL_MAX),
                    5..=29 => r.random_range(1025..=64 * 1024),
                    _ => r.random_range(1..=1024),
                };
                let expected: Vec<u32> = (0..len).map(|_| r.random()).collect();
                let mut buf = Buffer::<u32>::uninit_in(&pool, &s, len).unwrap();
                buf.copy_from_host(&s, &expected).unwrap();
                let written = dev.new_sync_event().unwrap();
                s.record(&written).unwrap();
                let to = r.random_range(0..CONSUMERS);
                let parcel = Parcel {
                    expected,
                    buf,
                    written,
                };
                if inboxes[to].send(parcel).is_err() {
                    break; // That consumer panicked: its report is the one to read.
                }
                sent += 1;
            }
            (sent, 0)
        });
    }
    drop(inboxes);
    for outbox in outboxes {
        let dev = dev.clone();
        spawn_reporting(&done_tx, move || {
            let s = dev.new_stream().unwrap();
            let mut received = 0u64;
            loop {
                let Parcel {
                    expected,
                    mut buf,
                    written,
                } = match outbox.recv_timeout(THREAD_TIMEOUT) {
                    Ok(parcel) => parcel,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return (0, received),
                    Err(e) => panic!("no buffer from the producers ({e})"),
                };
                s.wait(&written).unwrap();
                let got = buf.to_host(&s).unwrap();
                assert!(
                    got == expected,
                    "a buffer of {} elements lost its data on the way",
                    expected.len()
                );
                // Still queued when the buffer is dropped: its block must wait for this.
                ops::fill(&s, &mut buf, 0xDEAD_BEEF).unwrap();
                buf.record_stream(&s).unwrap();
                drop(buf);
                received += 1;
            }
        });
    }
    drop(done_tx);
    // (sent, received) by each thread, in the order they finished.
    let counts = results(done_rx, PRODUCERS + CONSUMERS);
    let sent: u64 = counts.iter().map(|c| c.0).sum();
    let received: u64 = counts.iter().map(|c| c.1).sum();
    assert_eq!((sent, received), ((PRODUCERS * PER_PRODUCER) as u64, sent));
    dev.synchronize().unwrap();
    let st = pool.stats().unwrap();
    assert_eq!(st.allocations - allocations_before, sent, "{st:?}");
    assert_eq!(st.in_use, 0, "{st:?}");
}

/// Caching pool: after the cross-thread run, every byte is back in the cache (the pending
/// ones once trim has waited for their streams) and trims to nothing.
fn cross_thread_caching_body(dev: &Device, seed: u64) {
    let pool = caching_pool(dev);
    cross_thread_body(dev, &pool, seed);
    let st = pool.stats().unwrap();
    assert_eq!(
        st.in_use + st.pending + st.total_free,
        st.reserved,
        "{st:?}"
    );
    assert_eq!(st.driver_allocs - st.driver_frees, st.segments, "{st:?}");
    assert_eq!(pool.trim().unwrap(), st.reserved);
    let st = pool.stats().unwrap();
    assert_eq!(
        (st.reserved, st.pending, st.total_free),
        (0, 0, 0),
        "{st:?}"
    );
}

device_test!(
    buffers_allocated_and_freed_on_different_threads_on_cpu,
    gpu_buffers_allocated_and_freed_on_different_threads,
    |dev| cross_thread_caching_body(dev, seed("cross_thread"))
);

// ---- GPU ----

/// One pinned block read back chunk after chunk over two streams (a staged download's
/// pattern): each host view shows its own chunk, though the block forgets the finished
/// uses of earlier chunks as it records new ones.
fn pinned_reuse_body(dev: &Device, seed: u64) {
    let mut r = rng(seed);
    let streams = [dev.new_stream().unwrap(), dev.new_stream().unwrap()];
    let chunk = 4_099;
    let data: Vec<f32> = (0..chunk * 97).map(|_| r.random_range(-1e3..1e3)).collect();
    let mut src = Buffer::<f32>::uninit(&streams[0], data.len()).unwrap();
    src.copy_from_host(&streams[0], &data).unwrap();
    streams[0].synchronize().unwrap();
    let mut block = PinnedBuf::<f32>::new(dev, chunk).unwrap();
    block.wait_slice_mut().unwrap().fill(f32::NAN);
    for k in 0..97 {
        let s = &streams[r.random_range(0..2)];
        src.copy_to_pinned_at(s, k * chunk, &mut block, chunk)
            .unwrap();
        if r.random_bool(0.3) {
            // Two uses in flight on different streams: the view waits for both.
            let o = &streams[r.random_range(0..2)];
            src.copy_to_pinned_at(o, k * chunk, &mut block, chunk)
                .unwrap();
        }
        assert_eq!(
            block.wait_slice().unwrap(),
            &data[k * chunk..(k + 1) * chunk],
            "chunk {k}"
        );
    }
}

/// 8 threads on one pinned pool, each holding several buffers of mixed size classes at
/// once: every buffer taken gets a pattern of its own thread and take, checked before it
/// goes back (so no block is with two holders at once, nor comes back with another's
/// bytes); some go to the device and back first, and are dropped while that copy may still
/// run (the block waits for it before reuse). At the end every block is back in the cache.
fn pinned_stress_body(dev: &Device, seed: u64) {
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 2_000;
    let pool = PinnedPool::new(dev);
    let pattern = |tag: u64, len: usize| (0..len as u64).map(move |i| tag ^ i.wrapping_mul(0x9e37));
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let pool = &pool;
            scope.spawn(move || {
                let mut r = rng(seed ^ t);
                let s = dev.new_stream().unwrap();
                let mut held: Vec<(u64, PinnedBuf<u64>)> = Vec::new();
                let check = |tag: u64, b: &PinnedBuf<u64>| {
                    let ok = b
                        .wait_slice()
                        .unwrap()
                        .iter()
                        .copied()
                        .eq(pattern(tag, b.len()));
                    assert!(
                        ok,
                        "thread {t}: a {}-element block lost its pattern",
                        b.len()
                    );
                };
                for round in 0..ROUNDS {
                    if held.is_empty() || (held.len() < 6 && r.random_bool(0.55)) {
                        let len = match r.random_range(0..6) {
                            0 => 1,
                            1 => 511,
                            2 => 4_099,
                            3 => 65_537,
                            _ => r.random_range(1..20_000),
                        };
                        let mut b = PinnedBuf::<u64>::new_in(pool, len).unwrap();
                        let tag = (t << 56) | (round << 24);
                        for (x, v) in b
                            .wait_slice_mut()
                            .unwrap()
                            .iter_mut()
                            .zip(pattern(tag, len))
                        {
                            *x = v;
                        }
                        held.push((tag, b));
                    } else {
                        let (tag, mut b) = held.swap_remove(r.random_range(0..held.len()));
                        check(tag, &b);
                        if round % 16 == 0 {
                            // To the device and back; the source goes back to the pool at
                            // once, its copy perhaps still running.
                            let mut d = Buffer::<u64>::uninit(&s, b.len()).unwrap();
                            d.copy_from_pinned(&s, &mut b).unwrap();
                            drop(b);
                            let mut back = PinnedBuf::<u64>::new_in(pool, d.len()).unwrap();
                            d.copy_to_pinned(&s, &mut back).unwrap();
                            check(tag, &back);
                        }
                    }
                }
                for (tag, b) in &held {
                    check(*tag, b);
                }
                drop(held);
                s.synchronize().unwrap();
            });
        }
    });
    let st = pool.stats();
    assert_eq!((st.in_use, st.pending), (0, 0), "{st:?}");
    assert!(
        st.driver_allocs < st.allocations,
        "blocks were reused: {st:?}"
    );
    assert_eq!(pool.trim().unwrap(), st.reserved);
    assert_eq!(pool.stats().reserved, 0);
}

device_test!(
    eight_threads_share_one_pinned_pool_without_mixing_contents,
    gpu_eight_threads_share_one_pinned_pool_without_mixing_contents,
    |dev| pinned_stress_body(dev, seed("pinned_stress"))
);

device_test!(
    pinned_block_reused_chunk_after_chunk,
    gpu_pinned_block_reused_chunk_after_chunk,
    |dev| pinned_reuse_body(dev, seed("pinned_reuse"))
);

/// Heavy churn over two streams (some buffers written on the other stream and marked with
/// `record_stream`): every live buffer, filled by a kernel with its own pattern, still
/// holds it at the end.
fn churn_body(dev: &Device, pool: &Arc<DevicePool>, seed: u64) {
    let mut r = rng(seed);
    let streams = [dev.new_stream().unwrap(), dev.new_stream().unwrap()];
    let mut live: Vec<(u32, Buffer<u32>)> = Vec::new();
    for op in 0..4_000u32 {
        if live.len() < 8 || (live.len() < 200 && r.random_bool(0.55)) {
            let s = &streams[r.random_range(0..2)];
            let len = match r.random_range(0..10) {
                0 => r.random_range(SMALL_MAX / 4..=16 * SMALL_MAX / 4),
                1..=3 => r.random_range(1024..SMALL_MAX / 4),
                _ => r.random_range(1..1024),
            };
            let mut b = Buffer::<u32>::uninit_in(pool, s, len).unwrap();
            let pattern = 0x5000_0000 | op;
            if r.random_bool(0.2) {
                // Written on the other stream: order it after the allocation, mark it.
                let other =
                    &streams[(streams.iter().position(|x| x.id() == s.id()).unwrap() + 1) % 2];
                let e = dev.new_sync_event().unwrap();
                s.record(&e).unwrap();
                other.wait(&e).unwrap();
                ops::fill(other, &mut b, pattern).unwrap();
                b.record_stream(other).unwrap();
                // Later reads on `s` are ordered after the fill.
                let done = dev.new_sync_event().unwrap();
                other.record(&done).unwrap();
                s.wait(&done).unwrap();
            } else {
                ops::fill(s, &mut b, pattern).unwrap();
            }
            live.push((pattern, b));
        } else {
            let i = r.random_range(0..live.len());
            drop(live.swap_remove(i));
        }
    }
    for (pattern, b) in &live {
        let v = b.to_host(&streams[0]).unwrap();
        assert!(
            v.iter().all(|&x| x == *pattern),
            "buffer {pattern:#x} was overwritten"
        );
    }
    drop(live);
    for s in &streams {
        s.synchronize().unwrap();
    }
    let st = pool.stats().unwrap();
    assert_eq!(st.in_use, 0, "{st:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_every_live_buffer_keeps_its_pattern_through_churn() {
    let dev = cuda();
    let pool = caching_pool(&dev);
    churn_body(&dev, &pool, seed("gpu_churn"));
    assert!(pool.trim().unwrap() > 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_the_async_strategy_keeps_patterns_through_churn() {
    let dev = cuda();
    let pool = DevicePool::new(&dev, PoolStrategy::CudaAsync).unwrap();
    assert_eq!(pool.strategy_name(), "cuda-async");
    churn_body(&dev, &pool, seed("gpu_async_churn"));
    assert!(pool.stats().unwrap().peak_reserved > 0);
    pool.trim().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_the_async_strategy_frees_buffers_on_other_threads() {
    let dev = cuda();
    let pool = DevicePool::new(&dev, PoolStrategy::CudaAsync).unwrap();
    cross_thread_body(&dev, &pool, seed("cross_thread_gpu_async"));
    pool.trim().unwrap();
}

/// `Buffer::zeros` at odd sizes of every width: all bits zero, also in a block the pool hands
/// back after a poisoned buffer of the same size was dropped into it.
fn zeros_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    fn check<T: warpdrive::DType + PartialEq + std::fmt::Debug>(s: &warpdrive::Stream, poison: T) {
        for len in [1usize, 3, 1023, 4097, 262_147] {
            drop(Buffer::from_host(s, &vec![poison; len]).unwrap());
            let z = Buffer::<T>::zeros(s, len).unwrap();
            let host = z.to_host(s).unwrap();
            assert!(host.iter().all(|v| *v == T::default()), "{len} elements");
        }
    }
    check::<u8>(&s, 0xa5);
    check::<warpdrive::f16>(&s, warpdrive::f16::from_f32(-3.5));
    check::<f32>(&s, -7.25);
    check::<u64>(&s, u64::MAX);
}

device_test!(
    zeros_are_zero_bits_on_cpu,
    gpu_zeros_are_zero_bits,
    zeros_body
);
