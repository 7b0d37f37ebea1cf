//! Compressed all-reduce: gradients averaged through int8 block quantization with error
//! feedback ([`Int8Reducer`], [`ops::quant`](crate::ops::quant)) or through top-k with error
//! feedback and momentum correction ([`TopkReducer`], [`ops::sparse`](crate::ops::sparse)).
//!
//! Int8: each rank quantizes its gradient plus the
//! error it carries, the int8 payloads and their scales are all-gathered, and every rank
//! dequantizes the average of all of them in rank order, so every rank holds the same result.
//! A rank sends ~1/3.9 of the f32 bytes once (an all-gather), where a ring all-reduce sends
//! 2(n−1)/n of them: it pays off where the link, not the memory, is the bottleneck (the
//! `dist` bench's `int8-all-reduce` rows give the link rate below which it wins).

use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops::quant::{dequantize_int8, quant_blocks, quantize_int8_ef};
use crate::ops::sparse::{densify, topk_ef, Sparsity};
use crate::Stream;

use super::Comm;

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
        let world = comm.world();
        let blocks = quant_blocks(len);
        let times = |n: usize| {
            n.checked_mul(world).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "Int8Reducer::new: {world} ranks × {n} elements overflow"
                ))
            })
        };
        Ok(Int8Reducer {
            error: Buffer::zeros(stream, len)?,
            q: Buffer::uninit(stream, len)?,
            scales: Buffer::uninit(stream, blocks)?,
            all_q: Buffer::uninit(stream, times(len)?)?,
            all_scales: Buffer::uninit(stream, times(blocks)?)?,
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
        if grad.len() != self.len() {
            return Err(Error::LengthMismatch {
                op: "Int8Reducer::all_reduce",
                left: self.len(),
                right: grad.len(),
            });
        }
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
        let all = slots.checked_mul(comm.world()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "TopkReducer::new: {} ranks × {slots} pairs overflow",
                comm.world()
            ))
        })?;
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
        if grad.len() != self.len() {
            return Err(Error::LengthMismatch {
                op: "TopkReducer::all_reduce",
                left: self.len(),
                right: grad.len(),
            });
        }
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
