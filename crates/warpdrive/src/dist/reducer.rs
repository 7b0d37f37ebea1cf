//! Gradients all-reduced in buckets, as PyTorch's DDP does: gradients are packed in the
//! order given (the order a backward pass produces them) into buckets of about
//! `bucket_bytes`, and each bucket's all-reduce starts as soon as its last gradient is ready,
//! on a stream of its own, while the work before later gradients' ready events still runs.

use crate::device::{Device, Event, Stream};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::memory::Buffer;

use super::{Comm, ReduceOp};

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Averages gradients over a group in buckets (see the module docs). One per rank.
pub struct Reducer {
    bucket_bytes: usize,
    /// Where packing, the all-reduces and unpacking run.
    stream: Stream,
    /// Recorded after the last unpack; the compute stream waits for it.
    done: Event,
}

/// What one [`Reducer::all_reduce`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReducerStats {
    /// All-reduces launched (one a bucket).
    pub buckets: usize,
    /// Bytes all-reduced, over all buckets.
    pub bytes: usize,
}

impl Reducer {
    /// A reducer for gradients on `device` with buckets of about `bucket_bytes` (a gradient
    /// larger than that gets a bucket of its own). `bucket_bytes` 0 is `InvalidArgument`.
    pub fn new(device: &Device, bucket_bytes: usize) -> Result<Reducer> {
        if bucket_bytes == 0 {
            return Err(Error::InvalidArgument(
                "Reducer::new: buckets must hold at least one byte".into(),
            ));
        }
        Ok(Reducer {
            bucket_bytes,
            stream: device.new_stream()?,
            done: device.new_event()?,
        })
    }

    /// The stream the reducer's copies and all-reduces run on (the communicator's calls of
    /// this reducer go there).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Averages every gradient over `comm`'s ranks, in place. `grads` come in the order they
    /// are produced, each with an event recorded on the compute stream once it is written:
    /// a bucket is packed and all-reduced once its gradients' events have passed, and
    /// `compute` waits for the last unpack before its later work. Every rank must pass
    /// gradients of the same lengths in the same order. Returns once all is enqueued (on
    /// the CPU backend, once done); `comm.wait(reducer.stream())` waits for it with the
    /// group's timeout.
    pub fn all_reduce<T: Float>(
        &mut self,
        comm: &Comm,
        compute: &Stream,
        grads: &mut [(&mut Buffer<T>, &Event)],
    ) -> Result<ReducerStats> {
        const OP: &str = "Reducer::all_reduce";
        let device = self.stream.device();
        compute.device().same_as(device, OP)?;
        let bucket_elems = (self.bucket_bytes / std::mem::size_of::<T>()).max(1);
        let mut stats = ReducerStats {
            buckets: 0,
            bytes: 0,
        };
        let mut start = 0;
        while start < grads.len() {
            // The gradients of this bucket: at least one, then as many as fit.
            let mut end = start + 1;
            let mut elems = grads[start].0.len();
            while end < grads.len() && elems + grads[end].0.len() <= bucket_elems {
                elems += grads[end].0.len();
                end += 1;
            }
            let members = &mut grads[start..end];
            let mut bucket = Buffer::<T>::uninit(&self.stream, elems)?;
            let mut at = 0;
            for (grad, ready) in members.iter() {
                self.stream.wait(ready)?;
                bucket.copy_rows_from(&self.stream, (at, 0), (grad, 0, 0), grad.len(), 1)?;
                at += grad.len();
            }
            comm.all_reduce(&self.stream, &mut bucket, ReduceOp::Average)?;
            let mut at = 0;
            for (grad, _) in members.iter_mut() {
                let n = grad.len();
                grad.copy_rows_from(&self.stream, (0, 0), (&bucket, at, 0), n, 1)?;
                at += n;
            }
            stats.buckets += 1;
            stats.bytes += elems * std::mem::size_of::<T>();
            start = end;
        }
        self.stream.record(&self.done)?;
        compute.wait(&self.done)?;
        Ok(stats)
    }
}
