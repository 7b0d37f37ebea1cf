//! Gradients all-reduced in buckets, as PyTorch's DDP does: gradients are packed in the
//! order given (the order a backward pass produces them) into buckets of about
//! `bucket_bytes`, and each bucket's all-reduce starts as soon as its last gradient is ready,
//! on a stream of its own, while the work before later gradients' ready events still runs.
//!
//! Two rules keep the step short: the last bucket holds at most `bucket_bytes / 16` (its
//! all-reduce is the one nothing hides, so buckets are laid out from the end), and a
//! gradient that fills a bucket alone is all-reduced where it lies, without a pack and an
//! unpack (two extra passes over its bytes that would compete with the backward pass).
//! Its all-reduces run beside the backward pass's kernels: a communicator made with
//! [`Comm::with_cta_policy`] and [`CtaPolicy::Efficiency`](super::CtaPolicy::Efficiency)
//! leaves those more of the GPU (bench/NOTES.md: the MLP's weak scaling on 2×H100).

use std::ops::Range;

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
    /// `None` for a bucket of one gradient (reduced in place).
    buckets: Vec<Option<(Buffer<T>, SegmentTable, SegmentTable)>>,
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
        let size = std::mem::size_of::<T>();
        let lens: Vec<usize> = grads.iter().map(|(g, _)| g.len()).collect();
        let plan = plan_buckets(
            &lens,
            self.bucket_bytes / size,
            self.bucket_bytes / 16 / size,
        );
        let mut stats = ReducerStats {
            buckets: 0,
            bytes: 0,
        };
        if self.buckets.len() < plan.len() {
            self.buckets.resize_with(plan.len(), || None);
        }
        for (b, range) in plan.into_iter().enumerate() {
            let members = &mut grads[range];
            for (_, ready) in members.iter() {
                self.stream.wait(ready)?;
            }
            let elems: usize = members.iter().map(|(g, _)| g.len()).sum();
            if let [(only, _)] = members {
                comm.all_reduce(&self.stream, only, ReduceOp::Average)?;
            } else {
                let kept = &mut self.buckets[b];
                if kept.as_ref().is_none_or(|k| k.0.len() != elems) {
                    let fresh = Buffer::<T>::uninit(&self.stream, elems)?;
                    *kept = Some((fresh, SegmentTable::new(), SegmentTable::new()));
                }
                if let Some((bucket, pack, unpack)) = kept.as_mut() {
                    let parts: Vec<&Buffer<T>> = members.iter().map(|(g, _)| &**g).collect();
                    pack_segments(&self.stream, &parts, bucket, pack)?;
                    comm.all_reduce(&self.stream, bucket, ReduceOp::Average)?;
                    let mut parts: Vec<&mut Buffer<T>> =
                        members.iter_mut().map(|(g, _)| &mut **g).collect();
                    unpack_segments(&self.stream, bucket, &mut parts, unpack)?;
                }
            }
            stats.buckets += 1;
            stats.bytes += elems * size;
        }
        self.stream.record(&self.done)?;
        compute.wait(&self.done)?;
        Ok(stats)
    }
}

/// The buckets for gradients of lengths `lens` in ready order, as ranges of `lens`: laid out
/// from the last gradient back, the last bucket up to `tail_elems`, each other up to
/// `bucket_elems`, every bucket holding at least one gradient.
fn plan_buckets(lens: &[usize], bucket_elems: usize, tail_elems: usize) -> Vec<Range<usize>> {
    let mut plan = Vec::new();
    let mut end = lens.len();
    let mut cap = tail_elems.max(1);
    while end > 0 {
        let mut start = end - 1;
        let mut elems = lens[start];
        while start > 0 && elems.saturating_add(lens[start - 1]) <= cap {
            start -= 1;
            elems += lens[start];
        }
        plan.push(start..end);
        end = start;
        cap = bucket_elems.max(1);
    }
    plan.reverse();
    plan
}

#[cfg(test)]
mod tests {
    use super::plan_buckets;

    #[test]
    fn buckets_are_laid_out_from_the_end_with_a_small_last_one() {
        // Cap 10, tail 3, from the end: [2 1] [11] [1 9] [2 5] [4].
        let plan = plan_buckets(&[4, 2, 5, 1, 9, 11, 2, 1], 10, 3);
        assert_eq!(plan, vec![0..1, 1..3, 3..5, 5..6, 6..8]);
        // Every gradient lands in exactly one bucket, in order, none empty.
        for lens in [vec![], vec![7], vec![1; 40], vec![100, 1, 100, 1]] {
            let plan = plan_buckets(&lens, 8, 2);
            let flat: Vec<usize> = plan.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..lens.len()).collect::<Vec<_>>());
            assert!(plan.iter().all(|r| !r.is_empty()));
        }
        // A zero cap (buckets smaller than one element) still makes progress.
        assert_eq!(plan_buckets(&[3, 3], 0, 0), vec![0..1, 1..2]);
    }
}
