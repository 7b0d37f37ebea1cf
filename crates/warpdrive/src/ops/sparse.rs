//! Gradient sparsification with error feedback and momentum correction (DGC, Lin et al.
//! 2018): the wire format of `dist`'s top-k all-reduce. Each call adds the gradient to a
//! momentum `u` and `u` to an accumulator `v`; per block of [`SPARSE_BLOCK`] elements the
//! entries of largest |v| go out as (index, value) pairs and are cleared from `v` and `u`,
//! so what is not sent waits in `v` for a later step (nothing is lost, only delayed). A top-k
//! per block rather than over the whole gradient gives every rank a payload of one fixed
//! size (an all-gather, no count exchange) and needs no global selection pass.
//!
//! Both backends give the same bits: the kernels spell out their arithmetic (explicit fused
//! multiply-adds) and break ties by index, as the CPU reference does here.

use super::{fill_grid, grid_for_rows, launch, Args, BLOCK};
use crate::error::{Error, Result};
use crate::kernels::SPARSE;
use crate::memory::{check_len, Buffer};
use crate::Stream;

/// Elements per selection block.
pub const SPARSE_BLOCK: usize = 2048;

/// The index of an unused payload slot (a block shorter than [`SPARSE_BLOCK`] keeps fewer).
pub const UNUSED: u32 = u32::MAX;

/// What a top-k with error feedback keeps: `keep` of every [`SPARSE_BLOCK`] elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sparsity {
    keep: u32,
}

impl Sparsity {
    /// Keeps the fraction `density` (in (0, 1]) of each block, rounded up: at least one.
    pub fn new(density: f64) -> Result<Sparsity> {
        if !(density > 0.0 && density <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "Sparsity::new: density {density} is not in (0, 1]"
            )));
        }
        let keep = (density * SPARSE_BLOCK as f64)
            .ceil()
            .clamp(1.0, SPARSE_BLOCK as f64);
        Ok(Sparsity { keep: keep as u32 })
    }

    /// Elements kept per full block.
    pub fn keep(&self) -> usize {
        self.keep as usize
    }

    /// Payload slots (pairs) for a gradient of `len` elements: [`Sparsity::keep`] per started
    /// block.
    pub fn slots(&self, len: usize) -> Result<usize> {
        len.div_ceil(SPARSE_BLOCK)
            .checked_mul(self.keep())
            .ok_or_else(|| Error::InvalidArgument(format!("Sparsity::slots: {len} overflows")))
    }

    /// Elements a block of `len` (≤ [`SPARSE_BLOCK`]) sends: ⌈len · keep / SPARSE_BLOCK⌉.
    fn kept(&self, len: usize) -> usize {
        (len * self.keep()).div_ceil(SPARSE_BLOCK)
    }
}

/// One step of DGC on a gradient `g`: `u = momentum·u + g`, `v = v + u` per element; then
/// each block of [`SPARSE_BLOCK`] (its last one `len` long) sends its ⌈len · keep / 2048⌉
/// entries of largest |v| (NaN above every number, ties to the lower index) into its slots of
/// `idx` / `val` in index order, unused slots get [`UNUSED`] and 0, and the sent entries of `u`
/// and `v` become 0. `g`, `u` and `v` are equally long (at most `u32::MAX` elements); `idx` and
/// `val` hold [`Sparsity::slots`]. `momentum` 0 is plain error feedback (then `u` is only
/// scratch).
#[allow(clippy::too_many_arguments)]
pub fn topk_ef(
    stream: &Stream,
    g: &Buffer<f32>,
    u: &mut Buffer<f32>,
    v: &mut Buffer<f32>,
    momentum: f32,
    sparsity: Sparsity,
    idx: &mut Buffer<u32>,
    val: &mut Buffer<f32>,
) -> Result<()> {
    const OP: &str = "topk_ef";
    for d in [
        g.device(),
        u.device(),
        v.device(),
        idx.device(),
        val.device(),
    ] {
        d.same_as(stream.device(), OP)?;
    }
    let n = g.len();
    check_len("topk_ef (u)", n, u.len())?;
    check_len("topk_ef (v)", n, v.len())?;
    let slots = sparsity.slots(n)?;
    check_len("topk_ef (idx)", slots, idx.len())?;
    check_len("topk_ef (val)", slots, val.len())?;
    if u32::try_from(n).is_err() {
        return Err(Error::InvalidArgument(format!(
            "{OP}: {n} elements, at most {} (u32 indices)",
            u32::MAX
        )));
    }
    if !momentum.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "{OP}: momentum {momentum} is not finite"
        )));
    }
    if n == 0 {
        return Ok(());
    }
    stream.run(
        (u, v, idx, val),
        |(u, v, idx, val)| {
            let g = g.host_view()?;
            let (u, v) = (u.host_view_mut()?, v.host_view_mut()?);
            let (idx, val) = (idx.host_view_mut()?, val.host_view_mut()?);
            let keep = sparsity.keep();
            let mut order = Vec::with_capacity(SPARSE_BLOCK);
            for (b, start) in (0..n).step_by(SPARSE_BLOCK).enumerate() {
                let at = start..(start + SPARSE_BLOCK).min(n);
                let slots = b * keep..(b + 1) * keep;
                let sent = sparsity.kept(at.len());
                select_block(
                    start as u32,
                    &g[at.clone()],
                    &mut u[at.clone()],
                    &mut v[at.clone()],
                    momentum,
                    sent,
                    &mut idx[slots.clone()],
                    &mut val[slots],
                    &mut order,
                );
            }
            Ok(())
        },
        |(u, v, idx, val), queue| {
            let grid = grid_for_rows(n as u64, SPARSE_BLOCK as u64, OP)?;
            let args = Args::new()
                .buf(g)
                .buf(u)
                .buf(v)
                .f32(momentum)
                .u32(sparsity.keep)
                .buf(idx)
                .buf(val)
                .u64(n as u64);
            // SAFETY: topk_ef(const float* g, float* u, float* v, float momentum, u32 keep,
            // u32* idx, float* val, u64 n): g, u, v hold n elements, idx and val keep slots per
            // started block of 2048 (one CUDA block each, 256 threads); lengths checked above.
            unsafe { launch(queue, (&SPARSE, "topk_ef"), grid, 256, 0, args) }
        },
    )
}

/// One block of [`topk_ef`] on the host, starting at element `start` of the gradient.
#[allow(clippy::too_many_arguments)]
fn select_block(
    start: u32,
    g: &[f32],
    u: &mut [f32],
    v: &mut [f32],
    momentum: f32,
    sent: usize,
    idx: &mut [u32],
    val: &mut [f32],
    order: &mut Vec<u32>,
) {
    for ((&g, u), v) in g.iter().zip(u.iter_mut()).zip(v.iter_mut()) {
        *u = momentum.mul_add(*u, g);
        *v += *u;
    }
    // |v| by its bits, NaN above every number.
    let key = |x: f32| {
        let a = x.abs();
        if a.is_nan() {
            u32::MAX
        } else {
            a.to_bits() | 0x8000_0000
        }
    };
    // The sent-th largest key (sent ≥ 1: a block holds an element); every larger key goes,
    // and the first equal ones in index order until `sent` are taken.
    order.clear();
    order.extend(v.iter().map(|&x| key(x)));
    let (_, &mut cut, _) = order.select_nth_unstable_by(sent - 1, |a, b| b.cmp(a));
    let mut equal = sent - v.iter().filter(|&&x| key(x) > cut).count();
    let mut slot = 0;
    for j in 0..v.len() {
        let k = key(v[j]);
        let take = k > cut || (k == cut && equal > 0);
        if !take {
            continue;
        }
        if k == cut {
            equal -= 1;
        }
        idx[slot] = start + j as u32;
        val[slot] = v[j];
        v[j] = 0.0;
        u[j] = 0.0;
        slot += 1;
    }
    idx[sent..].fill(UNUSED);
    val[sent..].fill(0.0);
}

/// `out` = the sum, in rank order, of `ranks` payloads of [`topk_ef`] laid one after another in
/// `idx` / `val`, each value times `alpha` (one fused multiply-add per pair into `out`, zero
/// elsewhere); `alpha` 1 / ranks averages them. Pairs whose index is not below `out.len()`
/// ([`UNUSED`] among them) are skipped. The indices within one payload are distinct (a payload
/// with repeats adds them in no set order on the GPU).
pub fn densify(
    stream: &Stream,
    idx: &Buffer<u32>,
    val: &Buffer<f32>,
    ranks: usize,
    alpha: f32,
    out: &mut Buffer<f32>,
) -> Result<()> {
    const OP: &str = "densify";
    for d in [idx.device(), val.device(), out.device()] {
        d.same_as(stream.device(), OP)?;
    }
    check_len("densify (val)", idx.len(), val.len())?;
    if ranks == 0 || idx.len() % ranks != 0 {
        return Err(Error::InvalidArgument(format!(
            "{OP}: {} pairs are not {ranks} payloads of one size",
            idx.len()
        )));
    }
    if !alpha.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "{OP}: alpha {alpha} is not finite"
        )));
    }
    let (m, n) = (idx.len() / ranks, out.len());
    super::fill(stream, out, 0.0)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    stream.run(
        out,
        |out| {
            let (idx, val) = (idx.host_view()?, val.host_view()?);
            let out = out.host_view_mut()?;
            for (&i, &x) in idx.iter().zip(val) {
                if let Some(o) = out.get_mut(i as usize) {
                    *o = x.mul_add(alpha, *o);
                }
            }
            Ok(())
        },
        |out, queue| {
            let kernel = (&SPARSE, "sparse_scatter_add");
            let grid = fill_grid(queue.gpu, kernel, m as u64, BLOCK as u64 * 4)?;
            for r in 0..ranks {
                let at = (r * m * 4) as u64;
                let args = Args::new()
                    .ptr(idx.device_ptr() + at)
                    .ptr(val.device_ptr() + at)
                    .f32(alpha)
                    .buf(out)
                    .u64(m as u64)
                    .u64(n as u64);
                // SAFETY: sparse_scatter_add(const u32* idx, const float* val, float alpha,
                // float* out, u64 m, u64 n): payload r's m pairs lie within idx and val (ranks
                // × m each), out holds n elements and the kernel writes only out[i], i < n.
                unsafe { launch(queue, kernel, grid, BLOCK, 0, args)? };
            }
            Ok(())
        },
    )
}
