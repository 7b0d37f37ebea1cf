//! Gradients all-reduced in buckets, as PyTorch's DDP does: gradients are packed in the
//! order given (the order a backward pass produces them) into buckets of about
//! `bucket_bytes`, and each bucket's all-reduce starts as soon as its last gradient is ready,
//! on a stream of its own, while the work before later gradients' ready events still runs.

use crate::device::{Device, Event, Stream};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops::segments::{pack_segments, unpack_segments, SegmentTable};

use super::{Comm, ReduceOp};

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Averages gradients of element type `T` over a group in buckets (see the module docs).
/// One per rank.
pub struct Reducer<T: Float = f32> {
    bucket_bytes: usize,
    /// Where packing, the all-reduces and unpacking run.
    stream: Stream,
    /// Recorded after the last unpack; the compute stream waits for it.
    done: Event,
    /// The buckets, kept from call to call (each reused while its length holds), with the
    /// tables their packing and unpacking read (uploaded again only when the gradients are
    /// other buffers): a step allocates and uploads nothing once the first has run.
    buckets: Vec<(Buffer<T>, SegmentTable, SegmentTable)>,
}

/// What one [`Reducer::all_reduce`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReducerStats {
    /// All-reduces launched (one a bucket).
    pub buckets: usize,
    /// Bytes all-reduced, over all buckets.
    pub bytes: usize,
}

impl<T: Float> Reducer<T> {
    /// A reducer for gradients on `device` with buckets of about `bucket_bytes` (a gradient
    /// larger than that gets a bucket of its own). `bucket_bytes` 0 is `InvalidArgument`.
    pub fn new(device: &Device, bucket_bytes: usize) -> Result<Reducer<T>> {
        if bucket_bytes == 0 {
            return Err(Error::InvalidArgument(
                "Reducer::new: buckets must hold at least one byte".into(),
            ));
        }
        Ok(Reducer {
            bucket_bytes,
            stream: device.new_stream()?,
            done: device.new_event()?,
            buckets: Vec::new(),
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
    pub fn all_reduce(
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
            let b = stats.buckets;
            if self.buckets.get(b).is_none_or(|k| k.0.len() != elems) {
                let fresh = Buffer::<T>::uninit(&self.stream, elems)?;
                match self.buckets.get_mut(b) {
                    Some(kept) => kept.0 = fresh,
                    None => self
                        .buckets
                        .push((fresh, SegmentTable::new(), SegmentTable::new())),
                }
            }
            let (bucket, pack, unpack) = &mut self.buckets[b];
            for (_, ready) in members.iter() {
                self.stream.wait(ready)?;
            }
            let parts: Vec<&Buffer<T>> = members.iter().map(|(g, _)| &**g).collect();
            pack_segments(&self.stream, &parts, bucket, pack)?;
            comm.all_reduce(&self.stream, bucket, ReduceOp::Average)?;
            let mut parts: Vec<&mut Buffer<T>> =
                members.iter_mut().map(|(g, _)| &mut **g).collect();
            unpack_segments(&self.stream, bucket, &mut parts, unpack)?;
            stats.buckets += 1;
            stats.bytes += elems * std::mem::size_of::<T>();
            start = end;
        }
        self.stream.record(&self.done)?;
        compute.wait(&self.done)?;
        Ok(stats)
    }
}
