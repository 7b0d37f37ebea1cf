//! A layer's tensors from a checkpoint straight to the device: the mapped file's bytes go
//! through the staging ring of the pageable fast path (`transfer::upload`), kept in their
//! dtype when it is the layer's and converted on the copy threads when not, with no host
//! copy of the layer in between. Each expert's slice lands in a staging buffer on the
//! device first, then in its place (w1 and w3 interleaved into w13 by a strided copy).

use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use safetensors::Dtype;

use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::moe::layer::inter_pad;
use crate::moe::MoeConfig;
use crate::transfer::upload_converted;

use super::checkpoint::{Checkpoint, Located};
use super::WeightsFile;

/// A layer's tensors on the device, in the layer's layout.
pub(crate) struct DeviceTensors<T: Float> {
    pub(crate) gate: Buffer<T>,
    pub(crate) gate_bias: Option<Buffer<f32>>,
    /// w1 and w3 interleaved in blocks of 8 rows: [E, 2I, H] (`w13_source`).
    pub(crate) w13: Buffer<T>,
    pub(crate) w2: Buffer<T>,
}

impl WeightsFile {
    /// The tensors `config` needs on `stream`'s device as `T` (see [`WeightsFile`]): the
    /// same values as [`load`](Self::load) gives, the same errors, and the same check of
    /// non-finite values (counted while the copy threads move the bytes).
    pub(crate) fn upload<T: Float>(
        &self,
        stream: &Stream,
        config: &MoeConfig,
    ) -> Result<DeviceTensors<T>> {
        let (ckpt, t) = self.locate(config)?;
        let (h, i, e) = (config.hidden, config.intermediate, config.experts);
        let ip = inter_pad(i);
        let size = |dims: &[usize]| crate::size::product("MoE weights", dims);
        let mut gate = Buffer::<T>::uninit(stream, size(&[e, h])?)?;
        self.upload_tensor(stream, &ckpt, &t.gate, &mut gate)?;
        let gate_bias = match &t.gate_bias {
            Some(b) => {
                let host = self.read(&ckpt, std::slice::from_ref(b))?;
                Some(Buffer::from_host(stream, &host)?)
            }
            None => None,
        };
        let w13_len = size(&[e, 2 * ip, h])?;
        // The CPU backend pads the intermediate size with zero rows (CUDA needs none).
        let mut w13 = if ip == i {
            Buffer::<T>::uninit(stream, w13_len)?
        } else {
            Buffer::<T>::zeros(stream, w13_len)?
        };
        let mut w2 = Buffer::<T>::uninit(stream, size(&[e, h, i])?)?;
        let expert = size(&[i, h])?;
        let mut stage = Buffer::<T>::uninit(stream, expert)?;
        for (tensors, w3) in [(&t.w1, false), (&t.w3, true)] {
            self.upload_experts(stream, &ckpt, tensors, e, &mut stage, |stage, x| {
                // Rows 8q.. of w1 go to rows 16q.. of the expert's w13 block, w3's to 16q + 8..
                let first = (x * 2 * ip + if w3 { 8 } else { 0 }) * h;
                let blocks = i / 8;
                w13.copy_rows_from(stream, (first, 16 * h), (stage, 0, 8 * h), 8 * h, blocks)?;
                let rest = i % 8;
                w13.copy_rows_from(
                    stream,
                    (first + blocks * 16 * h, 0),
                    (stage, blocks * 8 * h, 0),
                    rest * h,
                    1,
                )
            })?;
        }
        self.upload_experts(stream, &ckpt, &t.w2, e, &mut stage, |stage, x| {
            w2.copy_rows_from(stream, (x * expert, 0), (stage, 0, 0), expert, 1)
        })?;
        stream.synchronize()?;
        Ok(DeviceTensors {
            gate,
            gate_bias,
            w13,
            w2,
        })
    }

    /// Uploads the slices of `experts` experts, one after another, into `stage`, calling
    /// `place(stage, expert)` after each; `tensors` is one stacked tensor or one per expert.
    /// Non-finite values are checked per tensor.
    fn upload_experts<T: Float>(
        &self,
        stream: &Stream,
        ckpt: &Checkpoint,
        tensors: &[Located],
        experts: usize,
        stage: &mut Buffer<T>,
        mut place: impl FnMut(&Buffer<T>, usize) -> Result<()>,
    ) -> Result<()> {
        let per_tensor = experts / tensors.len().max(1);
        for (n, t) in tensors.iter().enumerate() {
            let bytes = ckpt.bytes(t)?;
            let slice = bytes.len() / per_tensor.max(1);
            let mut bad = 0;
            for k in 0..per_tensor {
                bad += upload_bytes(stream, t.dtype, &bytes[k * slice..(k + 1) * slice], stage)?;
                place(stage, n * per_tensor + k)?;
            }
            self.non_finite(t, bad)?;
        }
        Ok(())
    }

    /// Uploads the whole tensor `t` into `dst`, checking its non-finite values.
    fn upload_tensor<T: Float>(
        &self,
        stream: &Stream,
        ckpt: &Checkpoint,
        t: &Located,
        dst: &mut Buffer<T>,
    ) -> Result<()> {
        let bad = upload_bytes(stream, t.dtype, ckpt.bytes(t)?, dst)?;
        self.non_finite(t, bad)
    }
}

/// Uploads little-endian elements of `dtype` into `dst` (as many), converted to `T` on the
/// copy threads; returns how many are NaN or infinite.
fn upload_bytes<T: Float>(
    stream: &Stream,
    dtype: Dtype,
    bytes: &[u8],
    dst: &mut Buffer<T>,
) -> Result<usize> {
    let bad = AtomicUsize::new(0);
    let count = |n: usize| {
        if n > 0 {
            bad.fetch_add(n, Ordering::Relaxed);
        }
    };
    let whole = |rest: &[u8]| -> Result<()> {
        if rest.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "MoE weights: {} bytes are not whole {dtype:?} elements",
                bytes.len()
            )))
        }
    };
    match dtype {
        Dtype::F32 => {
            let (elems, rest) = bytes.as_chunks::<4>();
            whole(rest)?;
            upload_converted(stream, dst, elems, |d, s| count(decode(dtype, d, s)))?;
        }
        Dtype::F16 | Dtype::BF16 => {
            let (elems, rest) = bytes.as_chunks::<2>();
            whole(rest)?;
            upload_converted(stream, dst, elems, |d, s| count(decode(dtype, d, s)))?;
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "MoE weights: dtype {other:?} is not f32, f16 or bf16"
            )))
        }
    }
    Ok(bad.into_inner())
}

/// How many of the little-endian `dtype` elements in `src` are NaN or infinite (all exponent
/// bits set).
fn non_finite<const W: usize>(dtype: Dtype, src: &[[u8; W]]) -> usize {
    let bytes = src.as_flattened();
    match dtype {
        Dtype::F32 => count(bytes.as_chunks::<4>().0, |w| {
            u32::from_le_bytes(*w) & 0x7f80_0000 == 0x7f80_0000
        }),
        Dtype::F16 => count(bytes.as_chunks::<2>().0, |h| {
            u16::from_le_bytes(*h) & 0x7c00 == 0x7c00
        }),
        Dtype::BF16 => count(bytes.as_chunks::<2>().0, |h| {
            u16::from_le_bytes(*h) & 0x7f80 == 0x7f80
        }),
        _ => 0,
    }
}

/// How many of `items` satisfy `hit`, tallied in runs short enough for 16 bits (a loop the
/// compiler vectorizes).
fn count<I>(items: &[I], hit: impl Fn(&I) -> bool) -> usize {
    items
        .chunks(1 << 15)
        .map(|run| {
            let mut n = 0u16;
            for item in run {
                n += u16::from(hit(item));
            }
            usize::from(n)
        })
        .sum()
}

/// The layer dtype a file dtype is, if any.
fn kind_of(dtype: Dtype) -> Option<DTypeKind> {
    match dtype {
        Dtype::F32 => Some(DTypeKind::F32),
        Dtype::F16 => Some(DTypeKind::F16),
        Dtype::BF16 => Some(DTypeKind::BF16),
        _ => None,
    }
}

/// Decodes little-endian elements of `dtype` into `dst`: their bits when `T` is `dtype`,
/// else through f32 as [`WeightsFile::load`] reads them (so both give the same values);
/// returns how many are NaN or infinite.
pub(super) fn decode<T: Float, const W: usize>(
    dtype: Dtype,
    dst: &mut [T],
    src: &[[u8; W]],
) -> usize {
    let bits = |s: &[u8; W]| {
        let mut b = [0u8; 8];
        b[..W].copy_from_slice(s);
        u64::from_le_bytes(b)
    };
    if kind_of(dtype) == Some(T::KIND) && size_of::<T>() == W && dst.len() == src.len() {
        // The file's bits are the layer's: a byte copy, and a count the compiler
        // vectorizes (the per-element path below ran at half the copy threads' rate).
        let bad = non_finite(dtype, src);
        bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(src.as_flattened());
        return bad;
    }
    let mut bad = 0;
    for (d, s) in dst.iter_mut().zip(src) {
        let b = bits(s);
        let v = match dtype {
            Dtype::F32 => f32::from_bits(b as u32),
            Dtype::F16 => f16::from_bits(b as u16).to_f32(),
            _ => bf16::from_bits(b as u16).to_f32(),
        };
        bad += usize::from(!v.is_finite());
        *d = T::from_f64(v as f64);
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The vectorized count and byte copy give what the per-element conversion gives, over
    /// more than one counting run, with NaNs and infinities sprinkled in.
    #[test]
    fn same_dtype_decode_matches_the_per_element_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let n = (1 << 16) + 77;
        let mut b16 = vec![[0u8; 2]; n];
        let mut b32 = vec![[0u8; 4]; n];
        for (h, w) in b16.iter_mut().zip(b32.iter_mut()) {
            let special = rng.random_range(0..50) == 0;
            *h = if special {
                // Every exponent bit set (infinity or NaN in bf16 and f16), either sign.
                let sign = u16::from(rng.random::<bool>()) << 15;
                (sign | 0x7f80 | rng.random_range(0..2u16)).to_le_bytes()
            } else {
                rng.random::<u16>().to_le_bytes()
            };
            *w = rng.random::<u32>().to_le_bytes();
        }
        let expect16 = |exp: u16| {
            b16.iter()
                .filter(|h| u16::from_le_bytes(**h) & exp == exp)
                .count()
        };
        let expect32 = b32
            .iter()
            .filter(|w| !f32::from_le_bytes(**w).is_finite())
            .count();

        let mut out = vec![bf16::from_f32(3.0); n];
        assert_eq!(decode(Dtype::BF16, &mut out, &b16), expect16(0x7f80));
        assert!(out
            .iter()
            .zip(&b16)
            .all(|(o, h)| o.to_bits() == u16::from_le_bytes(*h)));
        let mut out = vec![f16::from_f32(3.0); n];
        assert_eq!(decode(Dtype::F16, &mut out, &b16), expect16(0x7c00));
        assert!(out
            .iter()
            .zip(&b16)
            .all(|(o, h)| o.to_bits() == u16::from_le_bytes(*h)));
        let mut out = vec![3.0f32; n];
        assert_eq!(decode(Dtype::F32, &mut out, &b32), expect32);
        assert!(out
            .iter()
            .zip(&b32)
            .all(|(o, w)| o.to_bits() == u32::from_le_bytes(*w)));
        // A converting decode counts the same values.
        let mut out = vec![3.0f32; n];
        assert_eq!(decode(Dtype::BF16, &mut out, &b16), expect16(0x7f80));
    }
}
