use std::sync::atomic::AtomicUsize;

use super::grid::Grid;
use super::*;
use crate::device::Device;
use crate::memory::Buffer;
use crate::transfer::hostmem::{stream_copy, FreshVec};

fn plan(chunk_len: usize, part_len: usize) -> RingPlan {
    RingPlan {
        chunk_len,
        slots: 2,
        part_len,
        threads: 4,
        host_align: 1,
        h2d_rate: 0.0,
    }
}

#[test]
fn the_grid_covers_every_element_once_in_order_with_aligned_parts() {
    for (n, chunk, part, lead, align) in [
        (1, 8, 4, 0, 1),
        (100, 8, 3, 0, 1),
        (100, 8, 3, 5, 1),
        (100, 16, 4, 12, 4),
        (64, 16, 16, 0, 1),
        (10, 16, 4, 7, 1),
        (10, 4, 4, 30, 1),
        (1000, 1000, 64, 0, 1),
        (1000, 64, 64, 0, 8),
        (4099, 256, 64, 0, 16),
        (4099, 256, 64, 13, 16),
        (7, 256, 64, 3, 16),
        (64 << 10, 4 << 10, 256, 0, 16),
        (100_003, 2048, 512, 100, 512),
        // Chunks under 32 elements, whose smallest ramp steps round to nothing.
        (100, 7, 3, 0, 1),
        (1000, 20, 4, 0, 1),
    ] {
        check_grid(n, &plan(chunk, part), lead, align);
    }
}

/// Every element in exactly one part, in order; parts within their chunks and at most
/// `plan.part_len` (in whole units); no empty chunk (a download sends a chunk's DMA
/// from the last part of the chunk a ring before it); chunks no longer than a slot
/// holds; every part past the lead on an alignment boundary.
fn check_grid(n: usize, plan: &RingPlan, lead: usize, align: usize) {
    let (chunk, part) = (plan.chunk_len, plan.part_len);
    let g = Grid::new(n, plan, lead, align);
    let what = format!(
        "n {n} chunk {chunk} part {part} lead {lead} align {align} threads {}",
        plan.threads
    );
    let mut next = 0;
    let mut chunks = vec![0usize; g.chunks()];
    for p in 0..g.total_parts() {
        let (c, r) = g.part(p);
        assert_eq!(r.start, next, "{what}: part {p}");
        assert!(
            !r.is_empty() && r.len() <= part.next_multiple_of(align),
            "{what}"
        );
        let cr = g.chunk_range(c);
        assert!(cr.start <= r.start && r.end <= cr.end, "{what}");
        // A ring slot holds a whole chunk: a middle chunk, or the last one with the
        // few elements under one alignment unit that end the copy.
        assert!(
            cr.len() <= chunk.next_multiple_of(align) + align,
            "{what}: chunk {c} {cr:?}"
        );
        // Past the lead, every part starts on an alignment boundary.
        if g.lead > 0 && c == 0 {
            // The lead (and, for a copy shorter than one unit past it, the rest).
            assert!(cr.start == 0 && cr.len() >= g.lead, "{what}");
        } else {
            assert_eq!((r.start - g.lead) % align, 0, "{what}: part {p} {r:?}");
        }
        chunks[c] += 1;
        next = r.end;
    }
    assert_eq!(next, n, "{what}");
    assert!((0..g.chunks()).all(|c| chunks[c] == g.parts_in(c)));
    let empty = (0..g.chunks()).find(|&c| g.chunk_range(c).is_empty());
    assert_eq!(empty, None, "{what}: an empty chunk");
    assert!(
        g.max_chunk() <= chunk.next_multiple_of(align) + align,
        "{what}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    #[test]
    fn random_grids_keep_the_invariants(
        n in 0usize..200_000,
        chunk in 1usize..20_000,
        part in 1usize..3_000,
        lead in 0usize..5_000,
        align_log2 in 0u32..10,
        threads in 1usize..40,
    ) {
        let plan = RingPlan { threads, ..plan(chunk, part) };
        check_grid(n, &plan, lead, 1 << align_log2);
    }
}

#[test]
fn the_grid_ramps_up_and_down_and_spreads_small_chunks_over_the_threads() {
    // 64 MiB of bytes in 4 MiB chunks, 256 KiB parts at most, 16 threads, 4 KiB units.
    let (mib, kib) = (1usize << 20, 1usize << 10);
    let plan = RingPlan {
        chunk_len: 4 * mib,
        slots: 8,
        part_len: 256 * kib,
        threads: 16,
        host_align: 4 * kib,
        h2d_rate: 0.0,
    };
    let g = Grid::new(64 * mib, &plan, 0, 4 * kib);
    let sizes: Vec<usize> = (0..g.chunks())
        .map(|c| g.chunk_range(c).len() / kib)
        .collect();
    // 64 MiB less the two ramps (3.875 MiB each): 14 whole chunks and 256 KiB.
    let mut want = vec![128, 256, 512, 1024, 2048];
    want.extend([4096; 14]);
    want.extend([256, 2048, 1024, 512, 256, 128]);
    assert_eq!(sizes, want);
    // The first chunk's 16 parts: one per thread.
    assert_eq!(g.parts_in(0), 16);
    assert_eq!(g.part(0).1.len(), 8 * kib);
    assert_eq!(g.parts_in(5), 16);
    assert_eq!(g.part(g.first_part[5]).1.len(), 256 * kib);
    // The ramp steps that leave room for a whole chunk between them.
    let g = Grid::new(8 * mib, &plan, 0, 4 * kib);
    let sizes: Vec<usize> = (0..g.chunks())
        .map(|c| g.chunk_range(c).len() / kib)
        .collect();
    assert_eq!(sizes, [128, 256, 512, 1024, 4096, 256, 1024, 512, 256, 128]);
    let g = Grid::new(4 * mib, &plan, 0, 4 * kib);
    assert_eq!(g.chunks(), 1);
}

/// Bytes that differ from their neighbours and from one copy to the next.
fn pattern(n: usize, salt: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_add(salt).wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect()
}

/// Sizes around the parts, the chunks, and the ring (`slots` chunks) of a plan.
fn sizes_around(plan: &RingPlan) -> Vec<usize> {
    let ring = plan.slots * plan.chunk_len;
    let mut sizes = vec![0, 1, 2];
    for edge in [
        plan.part_len,
        plan.chunk_len,
        ring,
        2 * ring,
        3 * ring + plan.chunk_len,
    ] {
        sizes.extend([edge.saturating_sub(1), edge, edge + 1]);
    }
    // An odd number of chunks, and a copy long enough for the ramp at both ends.
    sizes.extend([7 * plan.chunk_len + 3, 64 * plan.chunk_len + 5]);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// Tiny chunks and parts, so a few KiB go round the ring many times: more DMAs than the
/// feed has events, parts that wait for the room a ring's length back, lead chunks.
fn tiny_plans() -> Vec<RingPlan> {
    let p = |chunk_len, slots, part_len, threads, host_align| RingPlan {
        chunk_len,
        slots,
        part_len,
        threads,
        host_align,
        h2d_rate: 0.0,
    };
    vec![
        p(7, 2, 3, 4, 1),
        p(64, 3, 16, 3, 16),
        p(1000, 2, 128, 4, 64),
        p(4096, 1, 512, 2, 4096),
    ]
}

/// The ring on the CPU backend (the CPU's copy as the DMA engine) moves every byte of
/// uploads and downloads at sizes around its part, chunk and ring boundaries, into
/// destinations at odd offsets, and writes nothing outside them.
#[test]
fn the_ring_moves_every_byte_on_the_cpu_at_every_boundary() {
    const GUARD: usize = 4099;
    let s = Device::cpu().new_stream().unwrap();
    let workers = Workers::new(4, None);
    for plan in tiny_plans() {
        for n in sizes_around(&plan) {
            let what = format!("{n} bytes, {plan:?}");
            let src = pattern(n, n as u32);
            let mut dev = Buffer::<u8>::from_host(&s, &vec![0xa5; n]).unwrap();
            ring_upload(&s, &workers, &mut dev, &src, &plan, stream_copy).unwrap();
            assert!(dev.to_host(&s).unwrap() == src, "upload of {what}");
            for at in [GUARD, GUARD + 1, GUARD + 3] {
                let mut host = vec![0x5au8; at + n + GUARD];
                ring_download(
                    &s,
                    &workers,
                    &dev,
                    &mut host[at..at + n],
                    &plan,
                    |_| {},
                    stream_copy,
                )
                .unwrap();
                assert!(host[at..at + n] == src, "download of {what} at {at}");
                assert!(
                    host[..at].iter().chain(&host[at + n..]).all(|&b| b == 0x5a),
                    "download of {what} at {at} wrote outside its destination"
                );
            }
            let mut out = FreshVec::with_capacity(n).unwrap();
            ring_download_fresh(&s, &workers, &dev, &mut out, &plan).unwrap();
            assert!(out.into_vec() == src, "fresh download of {what}");
        }
    }
}

/// Several threads copying through rings at once, each on its own stream, one pool of
/// copy threads between them (their jobs queue): every copy stays intact.
#[test]
fn concurrent_rings_on_the_cpu_stay_intact() {
    let workers = Workers::new(4, None);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let workers = &workers;
            scope.spawn(move || {
                let s = Device::cpu().new_stream().unwrap();
                let plans = tiny_plans();
                for round in 0..24u32 {
                    let plan = plans[(t + round) as usize % plans.len()];
                    let n = 3 * plan.slots * plan.chunk_len + (round * 37 + t) as usize;
                    let src = pattern(n, t << 16 | round);
                    let mut dev = Buffer::<u8>::from_host(&s, &vec![0; n]).unwrap();
                    ring_upload(&s, workers, &mut dev, &src, &plan, stream_copy).unwrap();
                    let mut back = vec![0u8; n];
                    ring_download(&s, workers, &dev, &mut back, &plan, |_| {}, stream_copy)
                        .unwrap();
                    assert!(back == src, "thread {t} round {round}: {n} bytes");
                }
            });
        }
    });
}

/// A part that panics while filling or copying out fails the copy with an error (the
/// other threads stop rather than wait for DMAs it was to send), and the next copy on
/// the same threads is whole.
#[test]
fn a_panicking_part_fails_the_ring_copy_without_hanging() {
    let s = Device::cpu().new_stream().unwrap();
    let workers = Workers::new(4, None);
    let plan = tiny_plans()[1];
    let n = 40 * plan.chunk_len + 3;
    let src = pattern(n, 1);
    let mut dev = Buffer::<u8>::from_host(&s, &vec![0; n]).unwrap();
    let calls = AtomicUsize::new(0);
    let r = ring_upload(&s, &workers, &mut dev, &src, &plan, |d, x| {
        if calls.fetch_add(1, Ordering::Relaxed) == 5 {
            panic!("fill failed on purpose");
        }
        d.copy_from_slice(x);
    });
    assert!(
        matches!(&r, Err(Error::WorkerPanicked(m)) if m.contains("on purpose")),
        "{r:?}"
    );
    calls.store(0, Ordering::Relaxed);
    let mut back = vec![0u8; n];
    let r = ring_download(
        &s,
        &workers,
        &dev,
        &mut back,
        &plan,
        |_| {},
        |d, x| {
            if calls.fetch_add(1, Ordering::Relaxed) == 5 {
                panic!("copy-out failed on purpose");
            }
            d.copy_from_slice(x);
        },
    );
    assert!(
        matches!(&r, Err(Error::WorkerPanicked(m)) if m.contains("on purpose")),
        "{r:?}"
    );
    ring_upload(&s, &workers, &mut dev, &src, &plan, stream_copy).unwrap();
    ring_download(&s, &workers, &dev, &mut back, &plan, |_| {}, stream_copy).unwrap();
    assert!(back == src);
}

#[test]
fn a_copy_of_nothing_has_no_chunks() {
    for lead in [0, 1, 1016] {
        let g = Grid::new(0, &plan(5123, 2135), lead, 1);
        assert_eq!((g.chunks(), g.total_parts()), (0, 0));
        check_grid(0, &plan(5123, 2135), lead, 1);
    }
}
