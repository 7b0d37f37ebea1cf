//! The transfer floor on both backends: the pageable fast path, the coalescer, the
//! pipeline and wire compression. GPU tests (`gpu_*`) are ignored without a GPU. Every
//! destination lies between guard regions of poison that are checked untouched.

mod common;

use std::fmt::Debug;
use std::sync::Arc;

use common::{device_test, random_f32, rng, seed};
use half::bf16;
use rand::distr::{Distribution, StandardUniform};
use rand::Rng;
use warpdrive::memory::{round_size, DevicePool, PinnedBuf, PoolConfig, PoolStrategy, SMALL_MAX};
use warpdrive::transfer::{
    self, download_f32, upload_f32, upload_with, Batch, Compression, Pipeline, StagingStores,
    TransferConfig, BF16_REL_ERROR, F16_ABS_ERROR, F16_REL_ERROR,
};
use warpdrive::{ops, Buffer, DType, Device, Error, Stream};

const KIB: usize = 1 << 10;

/// Poisoned elements before and after every destination (odd, and over a page of bytes).
const GUARD: usize = 4099;

/// Asserts that `v` holds `poison` everywhere but `v[at..at + n]`.
fn assert_guards<T: PartialEq + Copy + Debug>(v: &[T], at: usize, n: usize, poison: T, what: &str) {
    let before = v[..at].iter().rposition(|x| *x != poison);
    let after = v[at + n..].iter().position(|x| *x != poison);
    assert!(
        before.is_none() && after.is_none(),
        "{what}: wrote outside its destination ({before:?} before it, {after:?} past it)"
    );
}

/// A device destination of `n` elements between two guard buffers, all three back to
/// back in one segment of a fresh caching pool (which splits a segment in address order),
/// so a copy that runs over either end of its destination (beyond the destination
/// block's own rounding to 512 bytes) lands in a guard. Destinations from 10 MiB get
/// segments of their own and cannot be guarded so.
struct DeviceGuarded<T: DType> {
    before: Buffer<T>,
    dst: Buffer<T>,
    after: Buffer<T>,
    _pool: Arc<DevicePool>,
}

impl<T: DType + PartialEq + Debug> DeviceGuarded<T> {
    fn new(s: &Stream, n: usize, poison: T) -> DeviceGuarded<T> {
        let pool =
            DevicePool::new(s.device(), PoolStrategy::Caching(PoolConfig::default())).unwrap();
        let size = std::mem::size_of::<T>();
        // Guards from the destination's own kind of segment: small ones up to SMALL_MAX.
        let guard = if n * size <= SMALL_MAX {
            GUARD
        } else {
            SMALL_MAX / size + GUARD
        };
        let poisoned = |len: usize| {
            let mut b = Buffer::<T>::uninit_in(&pool, s, len).unwrap();
            b.copy_from_host(s, &vec![poison; len]).unwrap();
            b
        };
        let (before, dst, after) = (poisoned(guard), poisoned(n), poisoned(guard));
        let end = |b: &Buffer<T>| b.device_ptr() + round_size(b.size_bytes()).unwrap() as u64;
        if n > 0 {
            assert!(
                dst.device_ptr() == end(&before) && after.device_ptr() == end(&dst),
                "the pool no longer places blocks back to back: the guards need another layout"
            );
        }
        DeviceGuarded {
            before,
            dst,
            after,
            _pool: pool,
        }
    }

    fn check_guards(&self, s: &Stream, poison: T, what: &str) {
        for (side, g) in [("before", &self.before), ("past", &self.after)] {
            let v = g.to_host(s).unwrap();
            let bad = v.iter().position(|x| *x != poison);
            assert!(
                bad.is_none(),
                "{what}: wrote {side} its device destination ({bad:?})"
            );
        }
    }
}

/// Small chunks, so modest sizes still take many chunks through every path.
fn small_chunks() -> TransferConfig {
    TransferConfig {
        chunk_bytes: 64 * KIB,
        threads: 3,
        depth: 2,
        direct_below: 0,
        stores: StagingStores::NonTemporal,
    }
}

fn random_bytes(rng: &mut impl Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

/// Uploads into device destinations and downloads into host destinations at odd offsets,
/// every one between guards, at sizes around the chunk and ring boundaries (the small
/// configuration's 64 KiB chunks, two or three a ring) and odd numbers of chunks, on the
/// direct, staged and default paths: bit-exact, and no guard touched.
fn guarded_body(dev: &Device) {
    let mut r = rng(seed("guarded"));
    let s = dev.new_stream().unwrap();
    let staged = small_chunks();
    let configs = [
        Some(TransferConfig {
            direct_below: usize::MAX,
            ..staged
        }),
        Some(staged),
        Some(TransferConfig {
            threads: 4,
            depth: 3,
            stores: StagingStores::Demoted,
            ..staged
        }),
        None,
    ];
    let chunk = staged.chunk_bytes;
    let mut sizes = vec![
        0,
        1,
        3,
        4095,
        4097,
        3 * chunk + 5,
        7 * chunk - 3,
        (3 << 20) + 7,
    ];
    for edge in [chunk, 2 * chunk, 3 * chunk, 6 * chunk] {
        sizes.extend([edge - 1, edge, edge + 1]);
    }
    for cfg in &configs {
        for &bytes in &sizes {
            let what = format!("{bytes} bytes with {cfg:?}");
            guarded_copies::<u8>(&s, cfg.as_ref(), &mut r, bytes, 0xa5, &what);
            let n = bytes.div_ceil(4);
            guarded_copies::<u32>(&s, cfg.as_ref(), &mut r, n, 0xa5a5_5a5a, &what);
        }
    }
}

fn guarded_copies<T>(
    s: &Stream,
    cfg: Option<&TransferConfig>,
    r: &mut impl Rng,
    n: usize,
    poison: T,
    what: &str,
) where
    T: DType + PartialEq + Debug,
    StandardUniform: Distribution<T>,
{
    let what = format!("{what}, {n} {}", T::KIND.name());
    let data: Vec<T> = (0..n).map(|_| r.random()).collect();
    let mut d = DeviceGuarded::new(s, n, poison);
    match cfg {
        Some(cfg) => upload_with(s, &mut d.dst, &data, cfg).unwrap(),
        None => transfer::upload(s, &mut d.dst, &data).unwrap(),
    }
    assert!(d.dst.to_host(s).unwrap() == data, "{what}: upload");
    d.check_guards(s, poison, &what);
    for skew in [0, 1, 3] {
        let at = GUARD + skew;
        let mut host = vec![poison; at + n + GUARD];
        let dst = &mut host[at..at + n];
        match cfg {
            Some(cfg) => transfer::download_with(s, &d.dst, dst, cfg).unwrap(),
            None => transfer::download(s, &d.dst, dst).unwrap(),
        }
        assert!(host[at..at + n] == data[..], "{what}: download at +{skew}");
        assert_guards(
            &host,
            at,
            n,
            poison,
            &format!("{what}: download at +{skew}"),
        );
    }
    assert!(
        transfer::to_host(s, &d.dst).unwrap() == data,
        "{what}: to_host"
    );
}

/// Pinned copies at device offsets other than 0, both ways, write their own range only:
/// the device buffer around it and the pinned block past it keep their poison.
fn device_offsets_body(dev: &Device) {
    const POISON: u32 = 0xdead_beef;
    let mut r = rng(seed("device_offsets"));
    let s = dev.new_stream().unwrap();
    let n = 10_007;
    let data: Vec<u32> = (0..n).map(|_| r.random()).collect();
    let full = Buffer::from_host(&s, &data).unwrap();
    for (offset, len) in [
        (0, n),
        (1, n - 1),
        (7, 1),
        (3, 4096),
        (n - 5, 5),
        (n / 2 + 1, n / 2 - 3),
        (n, 0),
    ] {
        let what = format!("{len} u32 at device offset {offset}");
        let mut dst = Buffer::from_host(&s, &vec![POISON; n]).unwrap();
        let mut src = PinnedBuf::<u32>::new(dev, len + GUARD).unwrap();
        src.wait_slice_mut().unwrap()[..len].copy_from_slice(&data[..len]);
        dst.copy_from_pinned_at(&s, offset, &mut src, len).unwrap();
        let got = dst.to_host(&s).unwrap();
        assert!(
            got[offset..offset + len] == data[..len],
            "{what}: to the device"
        );
        assert_guards(&got, offset, len, POISON, &format!("{what}: to the device"));
        let mut back = PinnedBuf::<u32>::new(dev, len + GUARD).unwrap();
        back.wait_slice_mut().unwrap().fill(POISON);
        full.copy_to_pinned_at(&s, offset, &mut back, len).unwrap();
        let back = back.wait_slice().unwrap();
        assert!(
            back[..len] == data[offset..offset + len],
            "{what}: to the host"
        );
        assert_guards(back, 0, len, POISON, &format!("{what}: to the host"));
    }
    // A range past the buffer's end is an error, and writes nothing.
    let mut dst = Buffer::from_host(&s, &vec![POISON; n]).unwrap();
    let mut src = PinnedBuf::<u32>::from_slice(dev, &data[..2]).unwrap();
    let res = dst.copy_from_pinned_at(&s, n - 1, &mut src, 2);
    assert!(matches!(res, Err(Error::InvalidArgument(_))), "{res:?}");
    assert!(dst.to_host(&s).unwrap().iter().all(|&x| x == POISON));
}

/// Staged and direct round trips are bit-exact at odd sizes and from unaligned sub-slices.
fn round_trip_body(dev: &Device) {
    let mut r = rng(seed("round_trip"));
    let s = dev.new_stream().unwrap();
    let cfg = small_chunks();
    // Every copy one DMA, without chunks (a pinned block the copy threads fill from 256 KiB).
    let direct = TransferConfig {
        direct_below: usize::MAX,
        ..cfg
    };
    // 70_001 and 140_001 f32 lie between ALWAYS_DIRECT and the usual crossover: `to_host`'s
    // single DMA, read into the new Vec by the caller (under FRESH_THREADS_FROM) or by the
    // copy threads.
    for n in [0, 1, 1023, 70_001, 140_001, 3 * 64 * KIB + 5, (1 << 20) + 3] {
        let data = random_bytes(&mut r, n + 1);
        let src = &data[1..]; // unaligned
        let mut buf = Buffer::<u8>::uninit(&s, n).unwrap();
        upload_with(&s, &mut buf, src, &direct).unwrap();
        assert_eq!(buf.to_host(&s).unwrap(), src, "direct upload of {n} bytes");
        upload_with(&s, &mut buf, src, &cfg).unwrap();
        assert_eq!(buf.to_host(&s).unwrap(), src, "upload of {n} bytes");
        let mut back = vec![0xffu8; n + 3];
        transfer::download_with(&s, &buf, &mut back[3..], &cfg).unwrap();
        assert_eq!(&back[3..], src, "download of {n} bytes");
        // The default path (tuned on CUDA) and a fresh Vec.
        let floats = random_f32(&mut r, n);
        let buf = transfer::from_host(&s, &floats).unwrap();
        let out = transfer::to_host(&s, &buf).unwrap();
        assert!(out
            .iter()
            .zip(&floats)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        // The default path from and into unaligned slices (under ALWAYS_DIRECT: one pinned
        // block).
        let mut padded = vec![f32::NAN; n + 1];
        transfer::download(&s, &buf, &mut padded[1..]).unwrap();
        assert!(padded[1..]
            .iter()
            .zip(&floats)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut again = Buffer::<u8>::uninit(&s, n).unwrap();
        transfer::upload(&s, &mut again, src).unwrap();
        assert_eq!(
            again.to_host(&s).unwrap(),
            src,
            "default upload of {n} bytes"
        );
    }
    // bf16 elements through a chunk that is not a multiple of the element count.
    let halves: Vec<bf16> = random_f32(&mut r, 100_003)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let mut buf = Buffer::uninit(&s, halves.len()).unwrap();
    upload_with(&s, &mut buf, &halves, &cfg).unwrap();
    let mut out = vec![bf16::NAN; halves.len()];
    transfer::download_with(&s, &buf, &mut out, &cfg).unwrap();
    assert!(out
        .iter()
        .zip(&halves)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Uploads and downloads through the staging ring with several parts per chunk, a ring
/// shorter than the chunk count (so parts wait for earlier DMAs) and either kind of staging
/// store, and a default-path upload of many chunks, are bit-exact.
fn ring_upload_body(dev: &Device) {
    let mut r = rng(seed("ring_upload"));
    let s = dev.new_stream().unwrap();
    for stores in [StagingStores::NonTemporal, StagingStores::Demoted] {
        let cfg = TransferConfig {
            chunk_bytes: 1 << 20,
            threads: 4,
            depth: 2,
            direct_below: 0,
            stores,
        };
        for n in [(9 << 20) / 4 + 7, (1 << 20) / 4 - 1, 3] {
            let data: Vec<u32> = (0..n).map(|_| r.random()).collect();
            let mut buf = Buffer::<u32>::uninit(&s, n).unwrap();
            ops::fill(&s, &mut buf, 0xdead_beef).unwrap();
            upload_with(&s, &mut buf, &data, &cfg).unwrap();
            assert!(buf.to_host(&s).unwrap() == data, "{n} u32, {stores:?}");
            // And back through the download ring, into an unaligned slice.
            let mut back = vec![0u32; n + 1];
            transfer::download_with(&s, &buf, &mut back[1..], &cfg).unwrap();
            assert!(back[1..] == data[..], "download of {n} u32");
        }
    }
    let n = (16 << 20) + 4099;
    let data = random_bytes(&mut r, n);
    let mut buf = Buffer::<u8>::uninit(&s, n).unwrap();
    ops::fill(&s, &mut buf, 0x5a).unwrap();
    transfer::upload(&s, &mut buf, &data).unwrap();
    assert!(
        buf.to_host(&s).unwrap() == data,
        "default upload of {n} bytes"
    );
}

/// `to_host` into a fresh `Vec` past the huge-page threshold (32 MiB), at an odd length and
/// from a buffer taken by the tuned (not the small-chunk) configuration, is bit-exact.
fn fresh_download_body(dev: &Device) {
    let mut r = rng(seed("fresh_download"));
    let s = dev.new_stream().unwrap();
    for n in [(9 << 20) + 7, (1 << 20) - 1] {
        let data: Vec<u32> = (0..n).map(|_| r.random()).collect();
        let buf = transfer::from_host(&s, &data).unwrap();
        let out = transfer::to_host(&s, &buf).unwrap();
        assert_eq!(out.len(), n);
        assert!(out == data, "to_host of {n} u32");
    }
}

/// A destination of the wrong length is an error, not a panic.
fn wrong_length_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let cfg = small_chunks();
    let buf = Buffer::<f32>::zeros(&s, 300_000).unwrap();
    let mut small = vec![0f32; 299_999];
    for res in [
        transfer::download(&s, &buf, &mut small),
        transfer::download_with(&s, &buf, &mut small, &cfg),
    ] {
        assert!(matches!(res, Err(Error::LengthMismatch { .. })), "{res:?}");
    }
    let mut buf = buf;
    let res = upload_with(&s, &mut buf, &small, &cfg);
    assert!(matches!(res, Err(Error::LengthMismatch { .. })), "{res:?}");
}

/// Copies from several threads at once, each on its own stream, stay intact and inside
/// their destinations, at sizes around the ring's length and random ones.
fn concurrent_body(dev: &Device) {
    let base = seed("concurrent");
    // The small configuration's ring: two 64 KiB chunks, in f32.
    let ring = 2 * small_chunks().chunk_bytes / 4;
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let mut r = rng(base + t);
                let s = dev.new_stream().unwrap();
                for round in 0..6 {
                    let n = match round % 3 {
                        0 => ring - 1 + (t as usize % 3),
                        1 => 3 * ring + 1,
                        _ => r.random_range(200_000..400_000),
                    };
                    let data = random_f32(&mut r, n);
                    let mut buf = Buffer::uninit(&s, n).unwrap();
                    upload_with(&s, &mut buf, &data, &small_chunks()).unwrap();
                    let at = GUARD + t as usize;
                    let mut out = vec![f32::NAN; at + n + GUARD];
                    transfer::download_with(&s, &buf, &mut out[at..at + n], &small_chunks())
                        .unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(bits(&out[at..at + n]) == bits(&data), "thread {t}: {n} f32");
                    let out = bits(&out);
                    assert_guards(&out, at, n, f32::NAN.to_bits(), &format!("thread {t}"));
                }
            });
        }
    });
}

/// Slices pushed into a batch come back whole; the device offsets table matches.
fn batch_body(dev: &Device) {
    let mut r = rng(seed("batch"));
    let s = dev.new_stream().unwrap();
    // Round 1 has slices large enough that the gather and the split back run on several
    // copy threads, with slices straddling their pieces.
    for (round, max) in [(0, 300), (1, 40_000)] {
        let slices: Vec<Vec<f32>> = (0..257)
            .map(|i| {
                let n = if i % 50 == 0 {
                    0
                } else {
                    r.random_range(1..max)
                };
                random_f32(&mut r, n)
            })
            .collect();
        let mut batch = Batch::<f32>::new(dev).unwrap();
        batch.push(&slices[1]);
        batch.clear();
        assert!(batch.is_empty() && batch.slices() == 0);
        let handles: Vec<_> = slices.iter().map(|x| batch.push(x)).collect();
        assert_eq!(batch.len(), slices.iter().map(Vec::len).sum::<usize>());
        let packed = batch.pack(&s).unwrap();
        let all = packed.buffer().to_host(&s).unwrap();
        let table = packed.offsets().to_host(&s).unwrap();
        assert_eq!(table.len(), slices.len() + 1);
        for ((h, x), w) in handles.iter().zip(&slices).zip(table.windows(2)) {
            let range = packed.range(*h).unwrap();
            assert_eq!((range.start as u64, range.end as u64), (w[0], w[1]));
            assert_eq!(&all[range], x.as_slice(), "round {round}");
        }
        assert_eq!(packed.download(&s).unwrap(), slices);
    }
}

/// Output chunk i is input chunk i's result, whatever each chunk's compute takes.
fn pipeline_body(dev: &Device) {
    let mut r = rng(seed("pipeline"));
    for (streams, chunk, buffering) in [(1, 1000, 2), (2, 777, 2), (3, 4096, 3)] {
        let p = Pipeline::new(dev, streams, chunk, buffering).unwrap();
        let input = random_f32(&mut r, 20 * chunk + 13);
        let mut output = vec![f32::NAN; input.len()];
        let delays: Vec<u64> = (0..25).map(|_| r.random_range(0..4)).collect();
        let mut i = 0;
        let stats = p
            .run(&input, &mut output, |s, x, y| {
                let d = delays[i % delays.len()];
                i += 1;
                // A random number of extra passes makes each chunk's compute differ.
                for _ in 0..d * 20 {
                    ops::copy(s, x, y)?;
                }
                ops::map(s, &ops::Map::affine(2.0, 0.0), x, y)
            })
            .unwrap();
        assert_eq!(stats.chunks, input.len().div_ceil(chunk));
        let want: Vec<f32> = input.iter().map(|v| v * 2.0).collect();
        assert_eq!(output, want, "{streams} streams");
        let e = stats.overlap_efficiency();
        assert!((0.0..=1.0).contains(&e), "{stats:?}");
    }
    assert!(Pipeline::new(dev, 0, 10, 2).is_err());
    // A compute that fails part-way: its error comes back (nothing hangs).
    let p = Pipeline::new(dev, 2, 1000, 2).unwrap();
    let input = random_f32(&mut r, 20_000);
    let mut output = vec![f32::NAN; input.len()];
    let mut calls = 0;
    let res = p.run(&input, &mut output, |s, x, y| {
        calls += 1;
        if calls == 7 {
            return Err(Error::InvalidArgument("compute failed on purpose".into()));
        }
        ops::copy(s, x, y)
    });
    assert!(
        matches!(&res, Err(Error::InvalidArgument(m)) if m.contains("on purpose")),
        "{res:?}"
    );
}

/// The pipeline at sizes 0, 1, chunk - 1, chunk, chunk + 1 and odd numbers of chunks
/// (more than it keeps in flight) writes every output element, its own input's result,
/// and nothing outside the output.
fn pipeline_sizes_body(dev: &Device) {
    let mut r = rng(seed("pipeline_sizes"));
    let poison = f32::from_bits(0x7fc0_dead);
    for (streams, chunk, buffering) in [(1, 1000, 1), (2, 777, 2), (3, 4096, 3)] {
        let p = Pipeline::new(dev, streams, chunk, buffering).unwrap();
        for n in [
            0,
            1,
            chunk - 1,
            chunk,
            chunk + 1,
            3 * chunk,
            7 * chunk - 1,
            13 * chunk + 5,
        ] {
            let what = format!("{n} f32 in chunks of {chunk} on {streams} streams");
            let input = random_f32(&mut r, n);
            let mut out = vec![poison; GUARD + n + GUARD];
            let stats = p
                .run(&input, &mut out[GUARD..GUARD + n], |s, x, y| {
                    ops::map(s, &ops::Map::affine(2.0, 1.0), x, y)
                })
                .unwrap();
            assert_eq!(stats.chunks, n.div_ceil(chunk), "{what}");
            let want: Vec<u32> = input.iter().map(|v| (v * 2.0 + 1.0).to_bits()).collect();
            let out: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert!(out[GUARD..GUARD + n] == want[..], "{what}");
            assert_guards(&out, GUARD, n, poison.to_bits(), &what);
        }
    }
}

/// Compressed transfers stay within their documented bounds; `None` stays exact.
fn compression_body(dev: &Device) {
    let mut r = rng(seed("compression"));
    let s = dev.new_stream().unwrap();
    let n = (1 << 18) + 7; // over the direct-copy threshold
    let data: Vec<f32> = random_f32(&mut r, n)
        .into_iter()
        .map(|v| v * 1000.0)
        .collect();
    for (c, bound) in [
        (Compression::None, 0.0),
        (Compression::Bf16, BF16_REL_ERROR),
        (Compression::F16, F16_REL_ERROR),
        (Compression::Auto, BF16_REL_ERROR),
    ] {
        let check = |got: &[f32], what: &str| {
            for (g, w) in got.iter().zip(&data) {
                let err = (f64::from(*g) - f64::from(*w)).abs();
                // f16's subnormal range below 6.1e-5 has an absolute floor instead.
                assert!(
                    err <= bound * f64::from(w.abs()) + 1e-7,
                    "{c:?} {what}: {g} vs {w}"
                );
            }
        };
        let mut buf = Buffer::<f32>::uninit(&s, n).unwrap();
        ops::fill(&s, &mut buf, f32::NAN).unwrap();
        upload_f32(&s, &mut buf, &data, c).unwrap();
        check(&buf.to_host(&s).unwrap(), "upload");
        let exact = Buffer::from_host(&s, &data).unwrap();
        let mut out = vec![f32::NAN; n];
        download_f32(&s, &exact, &mut out, c).unwrap();
        check(&out, "download");
        let mut short = vec![0f32; n - 1];
        assert!(download_f32(&s, &exact, &mut short, c).is_err());
    }
    // Values far outside f16's range: whatever `Auto` picked (f16 included), every value
    // stays within bf16's relative bound or f16's absolute one (never ±inf).
    let wide: Vec<f32> = data
        .iter()
        .enumerate()
        .map(|(i, v)| v * [1e-6, 1.0, 1e3, 1e9][i % 4])
        .collect();
    let mut buf = Buffer::<f32>::uninit(&s, n).unwrap();
    ops::fill(&s, &mut buf, f32::NAN).unwrap();
    upload_f32(&s, &mut buf, &wide, Compression::Auto).unwrap();
    for (g, w) in buf.to_host(&s).unwrap().iter().zip(&wide) {
        let err = (f64::from(*g) - f64::from(*w)).abs();
        assert!(
            err <= BF16_REL_ERROR * f64::from(w.abs()) || err <= F16_ABS_ERROR,
            "auto: {g} vs {w}"
        );
    }
}

device_test!(
    guarded_copies_at_chunk_and_ring_boundaries,
    gpu_transfer_guarded_copies_at_chunk_and_ring_boundaries,
    guarded_body
);
device_test!(
    device_offsets,
    gpu_transfer_device_offsets,
    device_offsets_body
);
device_test!(
    pipeline_sizes,
    gpu_transfer_pipeline_sizes,
    pipeline_sizes_body
);
device_test!(round_trips, gpu_transfer_round_trips, round_trip_body);
device_test!(ring_uploads, gpu_transfer_ring_uploads, ring_upload_body);
device_test!(
    fresh_downloads,
    gpu_transfer_fresh_downloads,
    fresh_download_body
);
device_test!(wrong_length, gpu_transfer_wrong_length, wrong_length_body);
device_test!(
    concurrent_copies,
    gpu_transfer_concurrent_copies,
    concurrent_body
);
device_test!(batches, gpu_transfer_batches, batch_body);
device_test!(pipeline_order, gpu_transfer_pipeline_order, pipeline_body);
device_test!(compression, gpu_transfer_compression, compression_body);
