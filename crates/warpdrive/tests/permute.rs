//! Permutation primitives on both backends, checked exactly against references written here:
//! histogram, exclusive scan, stable sort by key (counts, offsets, order, rank), gather and
//! scatter of rows. Outputs are poisoned (0xffffffff / NaN) first.

mod common;

use common::{device_test, poisoned, rng, seed};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;
use warpdrive::ops::{self, KeySort, MAX_BINS};
use warpdrive::{Buffer, DType, Device, Error};

/// Keys in 0..bins + extra (keys >= bins are out of range).
fn keys(r: &mut StdRng, n: usize, bins: usize, extra: usize) -> Vec<u32> {
    (0..n)
        .map(|_| r.random_range(0..(bins + extra) as u32))
        .collect()
}

fn histogram_body(dev: &Device, seed: u64) -> Vec<Vec<u32>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (n, bins) in [
        (0, 3),
        (1, 1),
        (1000, 8),
        (100_003, 256),
        (4099, MAX_BINS),
        (70_000, 5),
    ] {
        let ks = keys(&mut r, n, bins, 3);
        let k = Buffer::from_host(&s, &ks).unwrap();
        let mut counts = poisoned::<u32>(&s, bins, u32::MAX);
        ops::histogram(&s, &k, &mut counts).unwrap();
        let got = counts.to_host(&s).unwrap();
        let mut want = vec![0u32; bins];
        for &x in &ks {
            if (x as usize) < bins {
                want[x as usize] += 1;
            }
        }
        assert_eq!(got, want, "histogram n={n} bins={bins}");
        outs.push(got);
    }
    outs
}

fn scan_body(dev: &Device, seed: u64) -> Vec<Vec<u32>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    // Past 65,536 the GPU scans a tile a block; past 4,194,304 a thread holds two tiles
    // of sums.
    for n in [
        0, 1, 1023, 4095, 4096, 4097, 65_536, 65_537, 100_003, 4_194_305,
    ] {
        let xs: Vec<u32> = (0..n).map(|_| r.random_range(0..1000)).collect();
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut out = poisoned::<u32>(&s, n + 1, u32::MAX);
        ops::exclusive_scan(&s, &x, &mut out).unwrap();
        let got = out.to_host(&s).unwrap();
        let mut run = 0u32;
        for i in 0..n {
            assert_eq!(got[i], run, "scan n={n} at {i}");
            run += xs[i];
        }
        assert_eq!(got[n], run, "scan total n={n}");
        outs.push(got);
    }
    outs
}

/// How a sort case draws its keys.
#[derive(Clone, Copy, Debug)]
enum Keys {
    /// Uniform in 0..bins + 2 (some past the last bin).
    Random,
    /// Every key the same valid bin.
    AllEqual,
    /// Every key >= bins (all in the overflow bucket), u32::MAX among them.
    AllOver,
}

/// (n, bins, keys): empty, one, decode-size batches, MoE prefill shapes (4096 tokens × k = 8
/// or 4 slots into 128 or 256 experts), tile boundaries (256 keys a tile; past 1024 tiles
/// the tile doubles: 262,144 and 262,145 keys, 1M), many bins (a warp scan each: 40,000 keys
/// into 4096), skewed keys.
const SORT_SHAPES: [(usize, usize, Keys); 26] = [
    (0, 4, Keys::Random),
    (1, 1, Keys::Random),
    (1, 128, Keys::Random),
    (7, 256, Keys::Random),
    (64, 128, Keys::Random),
    (255, 257, Keys::Random),
    (256, 128, Keys::Random),
    (257, 1, Keys::Random),
    (1000, 8, Keys::Random),
    (1023, 128, Keys::Random),
    (1024, 64, Keys::Random),
    (1025, 257, Keys::Random),
    (16384, 128, Keys::Random),
    (32768, 128, Keys::Random),
    (32768, 256, Keys::Random),
    (32769, 257, Keys::Random),
    (32768, 128, Keys::AllEqual),
    (32769, 256, Keys::AllOver),
    (1025, 1, Keys::AllEqual),
    (300, 256, Keys::AllOver),
    (16384 * 8, 256, Keys::Random),
    (262_144, 128, Keys::Random),
    (262_145, 128, Keys::Random),
    (1 << 20, 256, Keys::Random),
    (5000, MAX_BINS, Keys::Random),
    (40_000, MAX_BINS, Keys::Random),
];

fn sort_body(dev: &Device, seed: u64) -> Vec<[Vec<u32>; 4]> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (n, bins, kind) in SORT_SHAPES {
        let ks = match kind {
            Keys::Random => keys(&mut r, n, bins, 2),
            Keys::AllEqual => vec![r.random_range(0..bins as u32); n],
            Keys::AllOver => keys(&mut r, n, 5, 0)
                .into_iter()
                .map(|x| if x == 4 { u32::MAX } else { bins as u32 + x })
                .collect(),
        };
        let k = Buffer::from_host(&s, &ks).unwrap();
        let mut sort = KeySort::new(&s, n, bins).unwrap();
        for b in [
            &mut sort.counts,
            &mut sort.offsets,
            &mut sort.order,
            &mut sort.rank,
        ] {
            ops::fill(&s, b, u32::MAX).unwrap();
        }
        ops::sort_by_key(&s, &k, &mut sort).unwrap();
        let counts = sort.counts.to_host(&s).unwrap();
        let offsets = sort.offsets.to_host(&s).unwrap();
        let order = sort.order.to_host(&s).unwrap();
        let rank = sort.rank.to_host(&s).unwrap();
        // Reference: a stable sort of (bucket, index), keys >= bins in one last bucket.
        let bucket = |x: u32| (x as usize).min(bins);
        let mut want_order: Vec<u32> = (0..n as u32).collect();
        want_order.sort_by_key(|&i| bucket(ks[i as usize]));
        let mut want_counts = vec![0u32; bins];
        for &x in &ks {
            if (x as usize) < bins {
                want_counts[x as usize] += 1;
            }
        }
        let mut want_offsets = vec![0u32; bins + 1];
        for b in 0..bins {
            want_offsets[b + 1] = want_offsets[b] + want_counts[b];
        }
        assert_eq!(
            counts, want_counts,
            "sort counts n={n} bins={bins} {kind:?}"
        );
        assert_eq!(
            offsets, want_offsets,
            "sort offsets n={n} bins={bins} {kind:?}"
        );
        assert_eq!(order, want_order, "sort order n={n} bins={bins} {kind:?}");
        for (p, &i) in order.iter().enumerate() {
            assert_eq!(rank[i as usize] as usize, p, "rank is the inverse of order");
        }
        outs.push([counts, offsets, order, rank]);
    }
    outs
}

fn bits<T: DType>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits_u64()).collect()
}

/// Gathers and scatters rows of `T`, `cols` wide; indices include out-of-range ones.
fn move_rows<T: DType>(
    s: &warpdrive::Stream,
    r: &mut StdRng,
    cols: usize,
    value: fn(u64) -> T,
) -> (Vec<T>, Vec<T>) {
    let (src_rows, m) = (37, 53);
    let src: Vec<T> = (0..src_rows * cols).map(|_| value(r.random())).collect();
    let idx: Vec<u32> = (0..m)
        .map(|_| r.random_range(0..src_rows as u32 + 4))
        .collect();
    let sb = Buffer::from_host(s, &src).unwrap();
    let ib = Buffer::from_host(s, &idx).unwrap();
    let mut gathered = poisoned::<T>(s, m * cols, value(u64::MAX));
    ops::gather_rows(s, &sb, cols, &ib, &mut gathered).unwrap();
    let g = gathered.to_host(s).unwrap();
    for (i, &j) in idx.iter().enumerate() {
        let got = &g[i * cols..(i + 1) * cols];
        if (j as usize) < src_rows {
            let want = &src[j as usize * cols..(j as usize + 1) * cols];
            assert_eq!(bits(got), bits(want), "gather row {i}");
        } else {
            assert!(
                got.iter().all(|v| v.to_bits_u64() == 0),
                "out-of-range gather is zeros"
            );
        }
    }
    // Scatter a permutation of 0..dst_rows plus a few indices past the end.
    let dst_rows = 41;
    let mut perm: Vec<u32> = (0..dst_rows as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.random_range(0..=i));
    }
    perm.truncate(30);
    perm.extend([dst_rows as u32, dst_rows as u32 + 9]);
    let rows_in: Vec<T> = (0..perm.len() * cols).map(|_| value(r.random())).collect();
    let before: Vec<T> = (0..dst_rows * cols).map(|_| value(r.random())).collect();
    let pb = Buffer::from_host(s, &perm).unwrap();
    let inb = Buffer::from_host(s, &rows_in).unwrap();
    let mut dst = Buffer::from_host(s, &before).unwrap();
    ops::scatter_rows(s, &inb, cols, &pb, &mut dst).unwrap();
    let d = dst.to_host(s).unwrap();
    let mut want = before.clone();
    for (i, &p) in perm.iter().enumerate() {
        if (p as usize) < dst_rows {
            want[p as usize * cols..(p as usize + 1) * cols]
                .copy_from_slice(&rows_in[i * cols..(i + 1) * cols]);
        }
    }
    assert_eq!(bits(&d), bits(&want), "scatter rows of {cols}");
    (g, d)
}

fn gather_scatter_body(dev: &Device, seed: u64) -> Vec<Vec<u64>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    let mut keep = |(a, b): (Vec<u64>, Vec<u64>)| {
        outs.push(a);
        outs.push(b);
    };
    fn as_bits<T: DType>((a, b): (Vec<T>, Vec<T>)) -> (Vec<u64>, Vec<u64>) {
        (bits(&a), bits(&b))
    }
    // Rows of 4, 12, 16, 20 and 256 bytes (units of 4 and 16), 24 (8), 3 and 16 (1 and 16),
    // 14 and 16 bytes of bf16 (2 and 16).
    for cols in [1, 3, 4, 5, 64] {
        keep(as_bits(move_rows::<f32>(&s, &mut r, cols, |u| {
            f32::from_bits(u as u32)
        })));
    }
    keep(as_bits(move_rows::<u64>(&s, &mut r, 3, |u| u)));
    keep(as_bits(move_rows::<u8>(&s, &mut r, 3, |u| u as u8)));
    keep(as_bits(move_rows::<u8>(&s, &mut r, 16, |u| u as u8)));
    keep(as_bits(move_rows::<bf16>(&s, &mut r, 7, |u| {
        bf16::from_bits(u as u16)
    })));
    keep(as_bits(move_rows::<bf16>(&s, &mut r, 8, |u| {
        bf16::from_bits(u as u16)
    })));
    outs
}

fn errors_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let k = Buffer::<u32>::zeros(&s, 10).unwrap();
    let mut none = Buffer::<u32>::zeros(&s, 0).unwrap();
    let mut too_many = Buffer::<u32>::zeros(&s, MAX_BINS + 1).unwrap();
    assert!(matches!(
        ops::histogram(&s, &k, &mut none),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::histogram(&s, &k, &mut too_many),
        Err(Error::InvalidArgument(_))
    ));
    let mut short = Buffer::<u32>::zeros(&s, 10).unwrap();
    assert!(matches!(
        ops::exclusive_scan(&s, &k, &mut short),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(KeySort::new(&s, 10, 0).is_err());
    assert!(KeySort::new(&s, 10, MAX_BINS + 1).is_err());
    let mut sort = KeySort::new(&s, 9, 4).unwrap();
    assert!(matches!(
        ops::sort_by_key(&s, &k, &mut sort),
        Err(Error::LengthMismatch { .. })
    ));
    let src = Buffer::<f32>::zeros(&s, 12).unwrap();
    let idx = Buffer::<u32>::zeros(&s, 2).unwrap();
    let mut dst = Buffer::<f32>::zeros(&s, 8).unwrap();
    assert!(matches!(
        ops::gather_rows(&s, &src, 5, &idx, &mut dst),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::gather_rows(&s, &src, 3, &idx, &mut dst),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        ops::gather_rows(&s, &src, 0, &idx, &mut dst),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::scatter_rows(&s, &src, 4, &idx, &mut dst),
        Err(Error::LengthMismatch { .. })
    ));
}

// Each on `dev`, checked in its body; on CUDA the CPU backend runs it on the same inputs and
// gives bit-identical results.

fn histogram_and_scan_test(dev: &Device) {
    let sd = seed("histogram_and_scan");
    let (histograms, scans) = (histogram_body(dev, sd), scan_body(dev, sd));
    if dev.is_cuda() {
        assert_eq!(histograms, histogram_body(&Device::cpu(), sd));
        assert_eq!(scans, scan_body(&Device::cpu(), sd));
    }
}

fn sort_test(dev: &Device) {
    let sd = seed("sort_by_key");
    let sorted = sort_body(dev, sd);
    if dev.is_cuda() {
        assert_eq!(sorted, sort_body(&Device::cpu(), sd));
    }
}

fn gather_scatter_test(dev: &Device) {
    let sd = seed("gather_scatter");
    let moved = gather_scatter_body(dev, sd);
    if dev.is_cuda() {
        assert_eq!(moved, gather_scatter_body(&Device::cpu(), sd));
    }
}

device_test!(
    cpu_histogram_and_scan,
    gpu_smem_histogram_and_scan_match_cpu,
    histogram_and_scan_test
);
device_test!(cpu_sort_by_key, gpu_smem_sort_by_key_matches_cpu, sort_test);
device_test!(
    cpu_gather_scatter,
    gpu_gather_scatter_matches_cpu,
    gather_scatter_test
);
device_test!(cpu_permute_errors, gpu_permute_errors, errors_body);
