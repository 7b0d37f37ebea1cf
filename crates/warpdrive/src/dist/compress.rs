//! Compressed all-reduce: gradients averaged through int8 block quantization with error
//! feedback ([`ops::quant`](crate::ops::quant)). Each rank quantizes its gradient plus the
//! error it carries, the int8 payloads and their scales are all-gathered, and every rank
//! dequantizes the average of all of them in rank order, so every rank holds the same result.
//! A rank sends ~1/3.9 of the f32 bytes once (an all-gather), where a ring all-reduce sends
//! 2(n−1)/n of them: it pays off where the link, not the memory, is the bottleneck (the
//! `dist` bench's `int8-all-reduce` rows give the link rate below which it wins).

use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops::quant::{dequantize_int8, quant_blocks, quantize_int8_ef};
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
