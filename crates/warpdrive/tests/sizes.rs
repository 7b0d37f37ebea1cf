//! Sizes computed from caller input (issue 26, item 4): shapes, lengths and counts whose
//! element or byte counts overflow `usize`, or exceed what the device or host can hold, fail
//! with an error value before anything is allocated — never a wrapped size (release), an
//! overflow panic (debug) or an allocation abort. GPU variants (ignored without a GPU) run the
//! same bodies on CUDA.

mod common;

use common::{cuda, device_test};
use proptest::prelude::*;
use warpdrive::exec::tune::size_bucket;
use warpdrive::exec::{Autotuner, TuneKey};
use warpdrive::memory::UnifiedBuffer;
use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights};
use warpdrive::transfer::Batch;
use warpdrive::{ops, Buffer, DTypeKind, Device, Error};

fn moe_config(hidden: usize, intermediate: usize, experts: usize, top_k: usize) -> MoeConfig {
    MoeConfig {
        hidden,
        intermediate,
        experts,
        top_k,
        ..MoeConfig::default()
    }
}

#[test]
fn moe_config_whose_bytes_overflow_is_rejected_by_validate() {
    // 3 · 2⁴⁰ · 2⁴⁰ · 2 bytes per expert: far past usize.
    let huge = moe_config(1 << 40, 1 << 40, 8, 2);
    let err = huge.validate().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("1099511627776"), "{err}");
    assert!(matches!(
        huge.expert_bytes(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        huge.weight_bytes(),
        Err(Error::InvalidArgument(_))
    ));
    // The router alone overflows too (experts · hidden · 2).
    let wide = moe_config(usize::MAX / 2, 8, 8, 2);
    assert!(matches!(wide.validate(), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        wide.router_bytes(),
        Err(Error::InvalidArgument(_))
    ));
    // intermediate is padded to a multiple of 8 inside the layer: that must not wrap either.
    let padded = moe_config(8, usize::MAX, 1, 1);
    assert!(matches!(padded.validate(), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        padded.weight_bytes(),
        Err(Error::InvalidArgument(_))
    ));
    let q = MoeConfig::preset("qwen3-30b-a3b").unwrap();
    assert_eq!(q.expert_bytes().unwrap(), 3 * 2048 * 768 * 2);
    assert_eq!(q.router_bytes().unwrap(), 128 * 2048 * 2);
}

/// A config whose sizes fit `usize` but whose weights no machine holds (≈ 0.9 EB): the layer
/// refuses it before allocating anything (it used to abort the process on the CPU backend:
/// `memory allocation of 36028797018963968 bytes failed`).
fn absurd_layer_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let c = moe_config(1 << 46, 8, 256, 8);
    c.validate().unwrap();
    let bytes = c.weight_bytes().unwrap();
    for weights in [
        MoeWeights::Random { seed: 1 },
        MoeWeights::File(warpdrive::moe::WeightsFile::new(
            "/nonexistent/weights.safetensors",
        )),
    ] {
        let err = MoeLayer::<half::bf16>::new(&s, c, weights).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { requested, .. } if requested == bytes),
            "{err}"
        );
    }
}

device_test!(
    cpu_moe_layer_refuses_weights_beyond_the_host,
    gpu_moe_layer_refuses_weights_beyond_the_device,
    absurd_layer_body
);

/// Rows of `cols` elements where `idx.len() · cols` overflows: an error, not a panic.
fn gather_scatter_huge_cols_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let src = Buffer::<f32>::zeros(&s, 0).unwrap();
    let idx = Buffer::<u32>::zeros(&s, 2).unwrap();
    let mut dst = Buffer::<f32>::zeros(&s, 0).unwrap();
    for cols in [usize::MAX, usize::MAX / 2 + 1] {
        let err = ops::gather_rows(&s, &src, cols, &idx, &mut dst).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = ops::scatter_rows(&s, &src, cols, &idx, &mut dst).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}

device_test!(
    cpu_gather_scatter_with_huge_cols_is_invalid_argument,
    gpu_gather_scatter_with_huge_cols_is_invalid_argument,
    gather_scatter_huge_cols_body
);

/// Size buckets are `ceil(log2(size))` up to `usize::MAX` (it used to overflow there:
/// a panic in debug builds, bucket 0 in release).
#[test]
fn tune_at_usize_max_keys_the_top_bucket() {
    assert_eq!(size_bucket(usize::MAX), usize::BITS);
    assert_eq!(size_bucket((1 << 63) + 1), 64);
    assert_eq!(size_bucket(1 << 63), 63);
    let s = Device::cpu().new_stream().unwrap();
    let key = TuneKey::new(s.device(), "sizes-test", DTypeKind::F32, usize::MAX).unwrap();
    assert_eq!(key.bucket, 64);
    let dir = std::env::temp_dir().join(format!("wd-sizes-tune-{}", std::process::id()));
    let tuner = Autotuner::at(dir.join("autotune.toml"));
    let best = tuner
        .tune(&s, &key, usize::MAX, &[1u32, 2], |_, _| Ok(()))
        .unwrap();
    assert!([1, 2].contains(&best));
    assert_eq!(tuner.get(&key).unwrap().size, usize::MAX as u64);
    let _ = std::fs::remove_dir_all(dir);
}

fn unified_zeros_huge_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    for len in [usize::MAX, usize::MAX / 4, 1 << 60] {
        assert!(UnifiedBuffer::<f32>::zeros(&s, len).is_err(), "{len}");
    }
    let u = UnifiedBuffer::<f32>::zeros(&s, 5).unwrap();
    assert_eq!(u.host().unwrap(), &[0.0; 5]);
}

device_test!(
    cpu_unified_zeros_beyond_memory_is_an_error,
    gpu_unified_zeros_beyond_memory_is_an_error,
    unified_zeros_huge_body
);

#[test]
fn batch_with_capacity_for_huge_counts_is_an_error() {
    let dev = Device::cpu();
    for slices in [usize::MAX, 1 << 60] {
        let err = Batch::<f32>::with_capacity(&dev, 0, slices).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::OutOfMemory { .. }),
            "{err}"
        );
    }
    assert!(Batch::<f32>::with_capacity(&dev, usize::MAX, 0).is_err());
}

/// A dimension: small, a power of two up to 2⁶³, or near `usize::MAX`.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        1usize..5000,
        (0u32..64).prop_map(|b| 1usize << b),
        (0usize..64).prop_map(|d| usize::MAX - d),
        any::<usize>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// `validate` either refuses a shape or every byte count the config reports is exact.
    #[test]
    fn moe_config_byte_counts_never_wrap(
        h in dim(),
        i in dim(),
        e in prop_oneof![1usize..=4096, dim()],
        k in 1usize..=16,
        dtype in prop_oneof![
            Just(DTypeKind::F32),
            Just(DTypeKind::F16),
            Just(DTypeKind::BF16),
        ],
    ) {
        let c = MoeConfig { dtype, ..moe_config(h, i, e, k) };
        // Exact in u128 where that holds them (None: past u128, so past usize too).
        let (h, i, e, size) = (h as u128, i as u128, e as u128, dtype.size() as u128);
        let prod = |xs: &[u128]| xs.iter().try_fold(1u128, |a, &x| a.checked_mul(x));
        let expert = prod(&[3, h, i, size]);
        let router = prod(&[e, h, size]);
        // gate [E, H], w13 [E, 2·pad8(I), H], w2 [E, H, I].
        let weights = (|| {
            let elems = prod(&[e, h])?
                .checked_add(prod(&[e, 2, i.div_ceil(8) * 8, h])?)?
                .checked_add(prod(&[e, h, i])?)?;
            elems.checked_mul(size)
        })();
        let fits = |v: Option<u128>| v.is_some_and(|v| v <= usize::MAX as u128);
        match c.validate() {
            Ok(()) => {
                prop_assert_eq!(Some(c.expert_bytes().unwrap() as u128), expert);
                prop_assert_eq!(Some(c.router_bytes().unwrap() as u128), router);
                prop_assert_eq!(Some(c.weight_bytes().unwrap() as u128), weights);
            }
            Err(err) => {
                prop_assert!(matches!(err, Error::InvalidArgument(_)), "{}", err);
                let shape_ok = e <= 4096 && k as u128 <= e && h % 8 == 0 && i % 8 == 0;
                prop_assert!(
                    !(shape_ok && fits(expert) && fits(router) && fits(weights)),
                    "a shape whose sizes fit was refused: {}", err
                );
            }
        }
    }
}

/// CUDA's stream-ordered pool, like the caching one, refuses a request beyond the device's
/// total memory without asking the driver.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_async_pool_refuses_more_than_the_device_holds() {
    use warpdrive::memory::{DevicePool, PoolStrategy};
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let pool = DevicePool::new(&dev, PoolStrategy::CudaAsync).unwrap();
    let (_, total) = dev.mem_info().unwrap();
    let err = Buffer::<u8>::uninit_in(&pool, &s, total + 1).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { ref detail, .. } if detail.contains("total memory")),
        "{err}"
    );
    assert!(Buffer::<u8>::uninit_in(&pool, &s, 1 << 20).is_ok());
}

/// A pipeline's stream count sizes its stream list and, times the buffering, its window.
#[test]
fn pipelines_with_absurd_stream_counts_are_refused() {
    use warpdrive::transfer::Pipeline;
    let dev = Device::cpu();
    for (streams, buffering) in [(usize::MAX, 2), (1 << 62, 1), (usize::MAX / 2, 3)] {
        let err = Pipeline::new(&dev, streams, 1, buffering).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    assert_eq!(Pipeline::new(&dev, 2, 1, 2).unwrap().streams().len(), 2);
}
