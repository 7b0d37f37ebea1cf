//! The fused MoE router: softmax → top-k → renormalize in one kernel, from logits (f32 / f16
//! / bf16) to f32 weights and u32 expert indices.
//!
//! Experts are chosen in the order of [`topk`](super::topk) (by logit, which is the order of
//! the softmax probabilities; NaN first; ties to the lower index). With `renormalize`, the k
//! weights are the softmax restricted to the chosen experts (they sum to 1); without, they are
//! the chosen experts' softmax probabilities over the whole row. Logits should be finite: a
//! NaN or +inf in a row makes its weights NaN (as the softmax itself would).

use crate::device::{Queue, Stream};
use crate::dtype::Float;
use crate::error::Result;
use crate::memory::{check_len, Buffer};

use super::topk::{check_k, launch_rows, top_indices, variant, variants};
use super::{cols_u32, float_index, rows_of, Args};

/// What [`route`] computes: `k` of `experts` per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    pub experts: usize,
    pub k: usize,
    /// Divide the chosen probabilities by their sum (Mixtral-style), or keep them as they are.
    pub renormalize: bool,
}

const ROUTE_NAMES: [[&str; 3]; 9] = variants!("route");

/// Routes each token (row of `logits`, `route.experts` wide): `weights[t·k + r]` and
/// `indices[t·k + r]` for its `r`-th expert.
///
/// Errors: k = 0, k > 16 or k > experts (`InvalidArgument`); logits not whole rows
/// (`InvalidArgument`); outputs not tokens·k long (`LengthMismatch`).
pub fn route<T: Float>(
    stream: &Stream,
    route: &Route,
    logits: &Buffer<T>,
    weights: &mut Buffer<f32>,
    indices: &mut Buffer<u32>,
) -> Result<()> {
    logits.check_stream(stream, "route")?;
    weights.check_stream(stream, "route")?;
    indices.check_stream(stream, "route")?;
    let (e, k) = (route.experts, route.k);
    let tokens = rows_of("route", logits.len(), e)?;
    cols_u32("route", e)?;
    check_k("route", k, e)?;
    check_len("route (weights)", weights.len(), tokens * k)?;
    check_len("route (indices)", indices.len(), tokens * k)?;
    float_index::<T>("route")?;
    if tokens == 0 {
        return Ok(());
    }
    stream.run(
        (indices, weights),
        |(indices, weights)| {
            let xs = logits.host_view()?;
            let w = weights.host_view_mut()?;
            let idx = indices.host_view_mut()?;
            for (r, row) in xs.chunks_exact(e).enumerate() {
                let chosen = top_indices(row, k);
                let m = row[chosen[0] as usize].to_f64();
                let exps: Vec<f64> = chosen
                    .iter()
                    .map(|&i| (row[i as usize].to_f64() - m).exp())
                    .collect();
                let denom: f64 = if route.renormalize {
                    exps.iter().sum()
                } else {
                    row.iter().map(|v| (v.to_f64() - m).exp()).sum()
                };
                for (j, (&i, x)) in chosen.iter().zip(&exps).enumerate() {
                    w[r * k + j] = (x / denom) as f32;
                    idx[r * k + j] = i;
                }
            }
            Ok(())
        },
        |(indices, weights), q| {
            // SAFETY: logits hold tokens·experts elements of T, weights and indices tokens·k each
            // (checked above).
            unsafe {
                route_raw::<T>(
                    q,
                    route,
                    logits.device_ptr(),
                    tokens,
                    weights.device_ptr(),
                    indices.device_ptr(),
                )
            }
        },
    )
}

/// [`route`] on raw device addresses, for callers that route part of a larger workspace
/// (the MoE layer). `route` must have passed `check_k`.
///
/// # Safety
/// `logits` must hold `tokens·route.experts` elements of `T`, `weights` (f32) and `indices`
/// (u32) `tokens·route.k` each, all live on the stream's device.
pub(crate) unsafe fn route_raw<T: Float>(
    q: Queue<'_>,
    route: &Route,
    logits: u64,
    tokens: usize,
    weights: u64,
    indices: u64,
) -> Result<()> {
    let t = float_index::<T>("route")?;
    let cols32 = cols_u32("route", route.experts)?;
    let (v, per_block) = variant(route.experts);
    let args = Args::new()
        .ptr(logits)
        .u64(tokens as u64)
        .u32(cols32)
        .u32(route.k as u32)
        .i32(i32::from(route.renormalize))
        .ptr(weights)
        .ptr(indices);
    // SAFETY: route_*_<T>(const T* x, u64 rows, u32 cols, u32 k, int renorm, float* w,
    // u32* idx): sizes as this function's contract states.
    unsafe { launch_rows(q, ROUTE_NAMES[v][t], tokens, per_block, args) }
}
