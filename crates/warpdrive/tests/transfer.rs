//! The transfer floor on both backends: the pageable fast path, the coalescer, the
//! pipeline and wire compression. GPU tests (`gpu_*`) are ignored without a GPU.

mod common;

use common::{cuda, random_f32, rng, seed};
use half::bf16;
use rand::Rng;
use warpdrive::transfer::{
    self, download_f32, upload_f32, upload_with, Batch, Compression, Pipeline, StagingStores,
    TransferConfig, BF16_REL_ERROR, F16_ABS_ERROR, F16_REL_ERROR,
};
use warpdrive::{ops, Buffer, Device, Error};

const KIB: usize = 1 << 10;

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
    // 70_001 f32 lie between ALWAYS_DIRECT and the usual crossover: `to_host`'s single DMA.
    for n in [0, 1, 1023, 70_001, 3 * 64 * KIB + 5, (1 << 20) + 3] {
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

/// Copies from several threads at once, each on its own stream, stay intact.
fn concurrent_body(dev: &Device) {
    let base = seed("concurrent");
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let mut r = rng(base + t);
                let s = dev.new_stream().unwrap();
                for _ in 0..3 {
                    let n = r.random_range(200_000..400_000);
                    let data = random_f32(&mut r, n);
                    let mut buf = Buffer::uninit(&s, n).unwrap();
                    upload_with(&s, &mut buf, &data, &small_chunks()).unwrap();
                    let mut out = vec![f32::NAN; n];
                    transfer::download_with(&s, &buf, &mut out, &small_chunks()).unwrap();
                    assert_eq!(out, data);
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
        let packed = batch.upload(&s).unwrap();
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
                if s.device().is_cuda() {
                    // A random number of extra passes makes each chunk's compute differ.
                    for _ in 0..d * 20 {
                        ops::copy(s, x, y)?;
                    }
                } else {
                    std::thread::sleep(std::time::Duration::from_millis(d));
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

#[test]
fn round_trips() {
    round_trip_body(&Device::cpu());
}
#[test]
fn ring_uploads() {
    ring_upload_body(&Device::cpu());
}
#[test]
fn fresh_downloads() {
    fresh_download_body(&Device::cpu());
}
#[test]
fn wrong_length() {
    wrong_length_body(&Device::cpu());
}
#[test]
fn concurrent_copies() {
    concurrent_body(&Device::cpu());
}
#[test]
fn batches() {
    batch_body(&Device::cpu());
}
#[test]
fn pipeline_order() {
    pipeline_body(&Device::cpu());
}
#[test]
fn compression() {
    compression_body(&Device::cpu());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_round_trips() {
    round_trip_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_ring_uploads() {
    ring_upload_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_fresh_downloads() {
    fresh_download_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_wrong_length() {
    wrong_length_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_concurrent_copies() {
    concurrent_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_batches() {
    batch_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_pipeline_order() {
    pipeline_body(&cuda());
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_transfer_compression() {
    compression_body(&cuda());
}
