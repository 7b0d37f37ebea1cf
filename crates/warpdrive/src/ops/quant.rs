//! Gradient compression: int8 block quantization with error feedback (the wire format of
//! `dist`'s compressed all-reduce). Blocks of [`QUANT_BLOCK`] elements share one f32 scale;
//! values travel as int8 (two's complement bytes in a `Buffer<u8>`), ~3.9× smaller than f32.
//! The part each quantization loses is kept in an error buffer and added to the next call's
//! input, so over many steps nothing is lost, only delayed (error feedback).
//!
//! Both backends give the same bits: the kernels spell out their arithmetic (IEEE division,
//! explicit fused multiply-adds, round half to even) as the CPU reference does here.

use super::{fill_grid, launch, Args, BLOCK};
use crate::error::{Error, Result};
use crate::kernels::QUANT;
use crate::memory::{check_len, Buffer};
use crate::Stream;

/// Elements per quantization block (one scale each).
pub const QUANT_BLOCK: usize = 256;

/// Scales for `len` elements: one per started block.
pub fn quant_blocks(len: usize) -> usize {
    len.div_ceil(QUANT_BLOCK)
}

/// Quantizes `grad + error` to int8 in blocks of [`QUANT_BLOCK`]: `scales[b]` = the block's
/// largest magnitude / 127, `q[i]` = round(x / scale) (int8 bits), and `error` becomes what
/// that lost, `x − q·scale`. A block holding a non-finite value gets a NaN scale (its
/// dequantized values are NaN: the fault shows) and keeps `x` whole in `error`, as does a
/// block too small for its scale to be a normal number's 1/127. `grad`, `error` and `q` are
/// equally long, `scales` holds [`quant_blocks`] of that.
pub fn quantize_int8_ef(
    stream: &Stream,
    grad: &Buffer<f32>,
    error: &mut Buffer<f32>,
    q: &mut Buffer<u8>,
    scales: &mut Buffer<f32>,
) -> Result<()> {
    const OP: &str = "quantize_int8_ef";
    for b in [grad.device(), error.device(), scales.device()] {
        b.same_as(stream.device(), OP)?;
    }
    q.check_stream(stream, OP)?;
    let n = grad.len();
    check_len("quantize_int8_ef (error)", n, error.len())?;
    check_len("quantize_int8_ef (q)", n, q.len())?;
    check_len("quantize_int8_ef (scales)", quant_blocks(n), scales.len())?;
    if n == 0 {
        return Ok(());
    }
    stream.run(
        (error, q, scales),
        |(error, q, scales)| {
            let g = grad.host_view()?;
            let (e, q, s) = (
                error.host_view_mut()?,
                q.host_view_mut()?,
                scales.host_view_mut()?,
            );
            for (b, scale) in s.iter_mut().enumerate() {
                let at = b * QUANT_BLOCK..((b + 1) * QUANT_BLOCK).min(n);
                *scale = quantize_block(&g[at.clone()], &mut e[at.clone()], &mut q[at]);
            }
            Ok(())
        },
        |(error, q, scales), queue| {
            let grid = fill_grid(
                queue.gpu,
                (&QUANT, "quantize_int8_ef"),
                n as u64,
                QUANT_BLOCK as u64 * 8,
            )?;
            let args = Args::new()
                .buf(grad)
                .buf(error)
                .buf(q)
                .buf(scales)
                .u64(n as u64);
            // SAFETY: quantize_int8_ef(const float* g, float* e, signed char* q, float* scales,
            // u64 n): g, e and q hold n elements, scales one per started block of 256.
            unsafe { launch(queue, (&QUANT, "quantize_int8_ef"), grid, BLOCK, 0, args) }
        },
    )
}

/// One block of [`quantize_int8_ef`] on the host; returns its scale.
fn quantize_block(g: &[f32], e: &mut [f32], q: &mut [u8]) -> f32 {
    let mut x = [0.0f32; QUANT_BLOCK];
    let x = &mut x[..g.len()];
    let (mut amax, mut bad) = (0.0f32, false);
    for ((x, &g), &e) in x.iter_mut().zip(g).zip(e.iter()) {
        *x = g + e;
        let a = x.abs();
        bad |= !a.is_finite();
        if a > amax {
            amax = a;
        }
    }
    let scale = if bad { f32::NAN } else { amax / 127.0 };
    let keep = bad || scale == 0.0;
    for ((&x, e), q) in x.iter().zip(e.iter_mut()).zip(q.iter_mut()) {
        let r = if keep {
            0.0
        } else {
            (x / scale).round_ties_even().clamp(-127.0, 127.0)
        };
        *q = (r as i8) as u8;
        *e = if keep { x } else { (-r).mul_add(scale, x) };
    }
    scale
}

/// `out = Σ_r q_r · (scale_r · alpha)` per element, over `ranks` payloads of
/// [`quantize_int8_ef`] laid one after another (`q` holds `ranks × out.len()` values, `scales`
/// `ranks ×` [`quant_blocks`]`(out.len())`), summed in rank order; `alpha` 1 / ranks averages
/// them, and one payload with `alpha` 1 is plain dequantization.
pub fn dequantize_int8(
    stream: &Stream,
    q: &Buffer<u8>,
    scales: &Buffer<f32>,
    ranks: usize,
    alpha: f32,
    out: &mut Buffer<f32>,
) -> Result<()> {
    const OP: &str = "dequantize_int8";
    q.check_stream(stream, OP)?;
    scales.device().same_as(stream.device(), OP)?;
    out.device().same_as(stream.device(), OP)?;
    let n = out.len();
    let times = |what: &str, per: usize| {
        per.checked_mul(ranks).ok_or_else(|| {
            Error::InvalidArgument(format!("{OP}: {ranks} ranks × {per} {what} overflow"))
        })
    };
    check_len("dequantize_int8 (q)", times("values", n)?, q.len())?;
    check_len(
        "dequantize_int8 (scales)",
        times("scales", quant_blocks(n))?,
        scales.len(),
    )?;
    let ranks32 = u32::try_from(ranks)
        .ok()
        .filter(|&r| r > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{OP}: {ranks} ranks")))?;
    if !alpha.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "{OP}: alpha {alpha} is not finite"
        )));
    }
    if n == 0 {
        return Ok(());
    }
    stream.run(
        out,
        |out| {
            let (q, s) = (q.host_view()?, scales.host_view()?);
            let blocks = quant_blocks(n);
            for (i, o) in out.host_view_mut()?.iter_mut().enumerate() {
                *o = (0..ranks).fold(0.0f32, |acc, r| {
                    let scale = s[r * blocks + i / QUANT_BLOCK];
                    f32::from(q[r * n + i] as i8).mul_add(scale * alpha, acc)
                });
            }
            Ok(())
        },
        |out, queue| {
            let grid = fill_grid(
                queue.gpu,
                (&QUANT, "dequantize_int8"),
                n as u64,
                BLOCK as u64 * 4,
            )?;
            let args = Args::new()
                .buf(q)
                .buf(scales)
                .u32(ranks32)
                .f32(alpha)
                .buf(out)
                .u64(n as u64);
            // SAFETY: dequantize_int8(const signed char* q, const float* scales, u32 ranks,
            // float alpha, float* out, u64 n): q holds ranks·n values, scales ranks scales per
            // started block of 256 of n, out n elements (lengths checked above).
            unsafe { launch(queue, (&QUANT, "dequantize_int8"), grid, BLOCK, 0, args) }
        },
    )
}
