//! Compressed all-reduce: gradients averaged through int8 block quantization with error
//! feedback ([`Int8Reducer`], [`ops::quant`](crate::ops::quant)) or through top-k with error
//! feedback and momentum correction ([`TopkReducer`], [`ops::sparse`](crate::ops::sparse)).
//!
//! Low rank: [`PowerSgdReducer`] (PowerSGD with error feedback).
//!
//! Int8: each rank quantizes its gradient plus the
//! error it carries, the int8 payloads and their scales are all-gathered, and every rank
//! dequantizes the average of all of them in rank order, so every rank holds the same result.
//! A rank sends ~1/3.9 of the f32 bytes once (an all-gather), where a ring all-reduce sends
//! 2(n−1)/n of them: it pays off where the link, not the memory, is the bottleneck (the
//! `dist` bench's `int8-all-reduce` rows give the link rate below which it wins).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::memory::{check_len, Buffer};
use crate::ops::quant::{dequantize_int8, quant_blocks, quantize_int8_ef};
use crate::ops::sparse::{densify, topk_ef, Sparsity};
use crate::size::product;
use crate::Stream;

use super::{Comm, ReduceOp};

/// Averages gradients of one length over a group through int8 (see the module docs); one per
/// rank and gradient, holding that rank's carried error and the exchange's buffers.
pub struct Int8Reducer {
    error: Buffer<f32>,
    q: Buffer<u8>,
    scales: Buffer<f32>,
    all_q: Buffer<u8>,
    all_scales: Buffer<f32>,
}

impl Int8Reducer {
    /// A reducer for gradients of `len` elements on `comm` (its error starts at zero), with
    /// its buffers on `stream`'s device.
    pub fn new(comm: &Comm, stream: &Stream, len: usize) -> Result<Int8Reducer> {
        let blocks = quant_blocks(len);
        let all = |n: usize| product("Int8Reducer::new: ranks × elements", &[comm.world(), n]);
        Ok(Int8Reducer {
            error: Buffer::zeros(stream, len)?,
            q: Buffer::uninit(stream, len)?,
            scales: Buffer::uninit(stream, blocks)?,
            all_q: Buffer::uninit(stream, all(len)?)?,
            all_scales: Buffer::uninit(stream, all(blocks)?)?,
        })
    }

    /// The gradient length it takes.
    pub fn len(&self) -> usize {
        self.error.len()
    }

    pub fn is_empty(&self) -> bool {
        self.error.is_empty()
    }

    /// Bytes one rank sends per call: its int8 values and f32 scales.
    pub fn wire_bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }

    /// Forgets the carried error (after a step whose gradient was not finite, say: a NaN
    /// stays in the error until then).
    pub fn reset(&mut self, stream: &Stream) -> Result<()> {
        crate::ops::fill(stream, &mut self.error, 0.0)
    }

    /// Replaces `grad` with the average over `comm`'s ranks of every rank's quantized
    /// `grad + error`, and keeps what this rank's quantization lost for the next call.
    /// Enqueued on `stream` (on the CPU backend, done on return); `comm.wait(stream)` waits
    /// with the group's timeout. Every rank calls it with gradients of the same length.
    pub fn all_reduce(
        &mut self,
        comm: &Comm,
        stream: &Stream,
        grad: &mut Buffer<f32>,
    ) -> Result<()> {
        check_len("Int8Reducer::all_reduce", self.len(), grad.len())?;
        quantize_int8_ef(stream, grad, &mut self.error, &mut self.q, &mut self.scales)?;
        comm.group(|comm| {
            comm.all_gather(stream, &self.q, &mut self.all_q)?;
            comm.all_gather(stream, &self.scales, &mut self.all_scales)
        })?;
        let world = comm.world();
        dequantize_int8(
            stream,
            &self.all_q,
            &self.all_scales,
            world,
            1.0 / world as f32,
            grad,
        )
    }
}

/// Averages gradients of one length over a group through top-k sparsification with error
/// feedback and momentum correction (DGC, [`ops::sparse`](crate::ops::sparse)): each rank
/// sends the (index, value) pairs of the largest accumulated entries of every block, the
/// pairs are all-gathered, and every rank sums them in rank order, so every rank holds the
/// same result. At density 1% a rank sends ~2% of the f32 bytes (4-byte index and value).
/// The momentum is applied here, before the exchange: the optimizer then takes the averaged
/// result as plain SGD does (momentum 0 is plain error feedback).
pub struct TopkReducer {
    sparsity: Sparsity,
    momentum: f32,
    u: Buffer<f32>,
    v: Buffer<f32>,
    idx: Buffer<u32>,
    val: Buffer<f32>,
    all_idx: Buffer<u32>,
    all_val: Buffer<f32>,
}

impl TopkReducer {
    /// A reducer for gradients of `len` elements on `comm` keeping `sparsity` of each block,
    /// with `momentum` (0: none), its state zero and its buffers on `stream`'s device.
    pub fn new(
        comm: &Comm,
        stream: &Stream,
        len: usize,
        sparsity: Sparsity,
        momentum: f32,
    ) -> Result<TopkReducer> {
        if !momentum.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "TopkReducer::new: momentum {momentum} is not finite"
            )));
        }
        let slots = sparsity.slots(len)?;
        let all = product("TopkReducer::new: ranks × pairs", &[comm.world(), slots])?;
        Ok(TopkReducer {
            sparsity,
            momentum,
            u: Buffer::zeros(stream, len)?,
            v: Buffer::zeros(stream, len)?,
            idx: Buffer::uninit(stream, slots)?,
            val: Buffer::uninit(stream, slots)?,
            all_idx: Buffer::uninit(stream, all)?,
            all_val: Buffer::uninit(stream, all)?,
        })
    }

    /// The gradient length it takes.
    pub fn len(&self) -> usize {
        self.v.len()
    }

    pub fn is_empty(&self) -> bool {
        self.v.is_empty()
    }

    /// Bytes one rank sends per call: its index and value per payload slot.
    pub fn wire_bytes(&self) -> usize {
        8 * self.idx.len()
    }

    /// Forgets the momentum and the accumulated entries not yet sent.
    pub fn reset(&mut self, stream: &Stream) -> Result<()> {
        crate::ops::fill(stream, &mut self.u, 0.0)?;
        crate::ops::fill(stream, &mut self.v, 0.0)
    }

    /// Replaces `grad` with the average over `comm`'s ranks of what each rank's top-k sent
    /// this step (its momentum and carried entries included), and keeps the rest for later
    /// calls. Enqueued on `stream` (on the CPU backend, done on return); `comm.wait(stream)`
    /// waits with the group's timeout. Every rank calls it with gradients of the same length.
    pub fn all_reduce(
        &mut self,
        comm: &Comm,
        stream: &Stream,
        grad: &mut Buffer<f32>,
    ) -> Result<()> {
        check_len("TopkReducer::all_reduce", self.len(), grad.len())?;
        topk_ef(
            stream,
            grad,
            &mut self.u,
            &mut self.v,
            self.momentum,
            self.sparsity,
            &mut self.idx,
            &mut self.val,
        )?;
        comm.group(|comm| {
            comm.all_gather(stream, &self.idx, &mut self.all_idx)?;
            comm.all_gather(stream, &self.val, &mut self.all_val)
        })?;
        let world = comm.world();
        densify(
            stream,
            &self.all_idx,
            &self.all_val,
            world,
            1.0 / world as f32,
            grad,
        )
    }
}

/// Averages a gradient viewed as an `rows × cols` matrix through PowerSGD at rank `r`
/// (Vogels et al. 2019) with error feedback: each rank's `M = grad + error` is projected as
/// `P = M·Q`, the `P`s are averaged and orthonormalized, `Q = Mᵀ·P̂` is averaged, and every
/// rank returns the same `P̂·Qᵀ`; what that misses of `M` stays in the rank's error. A rank
/// sends `(rows + cols)·r` values instead of `rows·cols`. `Q` carries over from step to step
/// (one power iteration a step), starting from the same seeded values on every rank. The
/// orthonormalization is a shifted Cholesky QR done three times: `PᵀP` (r×r) comes to the
/// host each time, which waits for the stream there.
pub struct PowerSgdReducer {
    rows: usize,
    cols: usize,
    rank: usize,
    error: Buffer<f32>,
    p: Buffer<f32>,
    p_hat: Buffer<f32>,
    q: Buffer<f32>,
    gram: Buffer<f32>,
    inv: Buffer<f32>,
}

impl PowerSgdReducer {
    /// A reducer for `rows × cols` gradients at rank `rank` (1 ≤ rank ≤ min(rows, cols)),
    /// its error zero, its `Q` seeded, its buffers on `stream`'s device.
    pub fn new(stream: &Stream, rows: usize, cols: usize, rank: usize) -> Result<PowerSgdReducer> {
        if rank == 0 || rank > rows.min(cols) {
            return Err(Error::InvalidArgument(format!(
                "PowerSgdReducer::new: rank {rank} for a {rows}×{cols} gradient (1 to {})",
                rows.min(cols)
            )));
        }
        let len = |a: usize, b: usize| product("PowerSgdReducer::new", &[a, b]);
        // Seeded, identical on every rank; any full-rank start works.
        let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        let q0: Vec<f32> = (0..len(cols, rank)?)
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        Ok(PowerSgdReducer {
            rows,
            cols,
            rank,
            error: Buffer::zeros(stream, len(rows, cols)?)?,
            p: Buffer::uninit(stream, len(rows, rank)?)?,
            p_hat: Buffer::uninit(stream, len(rows, rank)?)?,
            q: Buffer::from_host(stream, &q0)?,
            gram: Buffer::uninit(stream, rank * rank)?,
            inv: Buffer::uninit(stream, rank * rank)?,
        })
    }

    /// Values one rank sends per call: `P` and `Q`.
    pub fn wire_values(&self) -> usize {
        (self.rows + self.cols) * self.rank
    }

    /// The error carried to the next call: what this rank's gradients so far have not
    /// delivered.
    pub fn carried(&self) -> &Buffer<f32> {
        &self.error
    }

    /// Forgets the carried error.
    pub fn reset(&mut self, stream: &Stream) -> Result<()> {
        crate::ops::fill(stream, &mut self.error, 0.0)
    }

    /// Replaces `grad` (`rows × cols`, row-major) with the rank-`r` average described in the
    /// type's docs. Every rank calls it with gradients of the same shape.
    pub fn all_reduce(
        &mut self,
        comm: &Comm,
        stream: &Stream,
        grad: &mut Buffer<f32>,
    ) -> Result<()> {
        use crate::ops::gemm::{matmul, matmul_with, GemmOptions};
        check_len("PowerSgdReducer::all_reduce", self.error.len(), grad.len())?;
        let (n, m, r) = (self.rows, self.cols, self.rank);
        // M = grad + error, kept in `error`.
        crate::ops::axpy(stream, 1.0, grad, &mut self.error)?;
        matmul(stream, &self.error, &self.q, &mut self.p, (n, r, m))?;
        comm.all_reduce(stream, &mut self.p, ReduceOp::Average)?;
        // Shifted Cholesky QR, then twice unshifted (sCholeskyQR3): PᵀP (+ shift) = L·Lᵀ,
        // P ← P·L⁻ᵀ. One pass in f32 breaks down once P's condition number nears 1e4 (its
        // square is the Gram matrix's); the shift bounds the first pass's, the next two make
        // the columns orthonormal.
        let t = GemmOptions::default().trans_a();
        comm.wait(stream)?;
        for pass in 0..3 {
            matmul_with(stream, &self.p, &self.p, &mut self.gram, (r, r, n), t)?;
            let mut gram = self.gram.to_host(stream)?;
            if pass == 0 {
                let trace: f32 = (0..r).map(|i| gram[i * r + i]).sum();
                (0..r).for_each(|i| gram[i * r + i] += 1e-5 * trace);
            }
            let inv = inverse_cholesky_transposed(&gram, r);
            crate::transfer::upload(stream, &mut self.inv, &inv)?;
            matmul(stream, &self.p, &self.inv, &mut self.p_hat, (n, r, r))?;
            std::mem::swap(&mut self.p, &mut self.p_hat);
        }
        std::mem::swap(&mut self.p, &mut self.p_hat);
        matmul_with(stream, &self.error, &self.p_hat, &mut self.q, (m, r, n), t)?;
        comm.all_reduce(stream, &mut self.q, ReduceOp::Average)?;
        let tb = GemmOptions::default().trans_b();
        matmul_with(stream, &self.p_hat, &self.q, grad, (n, m, r), tb)?;
        // error = M − P̂·Qᵀ.
        crate::ops::axpy(stream, -1.0, grad, &mut self.error)
    }
}

/// `L⁻ᵀ` (r×r, row-major) for the Cholesky factor `L` of the symmetric `gram`, in f64; a
/// pivot that is not clearly positive (a rank-deficient `P`: zero gradients, say) gets a
/// floor, so the columns it would have normalized come out zero-ish rather than infinite.
fn inverse_cholesky_transposed(gram: &[f32], r: usize) -> Vec<f32> {
    let g = |i: usize, j: usize| f64::from(gram[i * r + j]);
    let scale = (0..r)
        .map(|i| g(i, i))
        .fold(0.0f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let floor = scale * 1e-12;
    let mut l = vec![0.0f64; r * r];
    for j in 0..r {
        let d = g(j, j) - (0..j).map(|k| l[j * r + k] * l[j * r + k]).sum::<f64>();
        let pivot = if d > floor { d.sqrt() } else { f64::INFINITY };
        l[j * r + j] = pivot;
        for i in j + 1..r {
            let s = g(i, j) - (0..j).map(|k| l[i * r + k] * l[j * r + k]).sum::<f64>();
            l[i * r + j] = if pivot.is_finite() { s / pivot } else { 0.0 };
        }
    }
    // Invert the lower-triangular L by forward substitution, column by column.
    let mut inv = vec![0.0f64; r * r];
    for c in 0..r {
        for i in c..r {
            let s: f64 = (c..i).map(|k| l[i * r + k] * inv[k * r + c]).sum();
            let rhs = if i == c { 1.0 } else { 0.0 };
            inv[i * r + c] = (rhs - s) / l[i * r + i];
        }
    }
    // L⁻ᵀ: element (i, j) = L⁻¹(j, i).
    (0..r * r)
        .map(|x| {
            let v = inv[(x % r) * r + x / r];
            if v.is_finite() {
                v as f32
            } else {
                0.0
            }
        })
        .collect()
}
