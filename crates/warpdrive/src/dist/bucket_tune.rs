//! The Reducer's bucket size for a topology, tuned once and kept in the autotune cache:
//! the smallest bucket whose all-reduce reaches
//! [`KNEE_FRACTION`](crate::exec::tune::KNEE_FRACTION) of the best throughput
//! measured from 1 to 64 MiB. Smaller buckets start their all-reduce sooner and leave less
//! unhidden after the backward pass; past the knee a larger one gains little bandwidth.
//! Every rank times the same all-reduces (a collective), and all ranks take rank 0's
//! result, so their buckets always match.

use std::time::Instant;

use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::Result;
use crate::exec::tune::{batch_knee, Autotuner, CandidateTime, TuneKey};
use crate::memory::Buffer;

use super::{Comm, ReduceOp, Reducer};

/// Bucket sizes tried, in bytes.
pub const BUCKET_CANDIDATES: [usize; 7] = [
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
    16 << 20,
    32 << 20,
    64 << 20,
];

/// Timed all-reduces per candidate (after one warm-up); the median counts.
const REPS: usize = 5;

impl Comm {
    /// The bucket size for a [`Reducer`] on this group and `stream`'s device: kept in the
    /// autotune cache per (device, world size, host), measured when any rank lacks it (see
    /// the module docs). Every rank calls it; all get rank 0's size.
    pub fn tuned_bucket_bytes(&self, stream: &Stream) -> Result<usize> {
        let key = TuneKey::new(
            stream.device(),
            &format!("reducer-bucket-w{}", self.world()),
            DTypeKind::F32,
            self.world(),
        )?;
        let tuner = Autotuner::global();
        let kept = tuner
            .get(&key)
            .and_then(|r| r.winner.parse::<usize>().ok())
            .filter(|b| BUCKET_CANDIDATES.contains(b))
            .unwrap_or(0);
        // Tune unless every rank has a kept size: a rank that tuned alone would wait for
        // partners in its all-reduces.
        let everyone_has = self.agree(stream, kept as f64, ReduceOp::Min)? > 0.0;
        let mine = if everyone_has {
            kept
        } else {
            let sweep = batch_knee(&BUCKET_CANDIDATES, |bytes| {
                self.time_all_reduce(stream, bytes)
            })?;
            let candidates = sweep
                .points
                .iter()
                .map(|p| CandidateTime {
                    config: p.batch.to_string(),
                    us: p.us,
                })
                .collect();
            tuner.keep(&key, self.world(), sweep.knee.to_string(), candidates);
            sweep.knee
        };
        let mut root = Buffer::from_host(stream, &[mine as f64])?;
        self.broadcast(stream, &mut root, 0)?;
        self.wait(stream)?;
        Ok(root.to_host(stream)?.first().copied().unwrap_or(0.0) as usize)
    }

    /// `value` reduced over the ranks with `op`.
    fn agree(&self, stream: &Stream, value: f64, op: ReduceOp) -> Result<f64> {
        let mut v = Buffer::from_host(stream, &[value])?;
        self.all_reduce(stream, &mut v, op)?;
        self.wait(stream)?;
        Ok(v.to_host(stream)?.first().copied().unwrap_or(0.0))
    }

    /// Median µs of an all-reduce of `bytes` of f32 on this group.
    fn time_all_reduce(&self, stream: &Stream, bytes: usize) -> Result<f64> {
        let mut buf = Buffer::<f32>::zeros(stream, bytes / 4)?;
        self.all_reduce(stream, &mut buf, ReduceOp::Sum)?;
        self.wait(stream)?;
        let mut us = Vec::with_capacity(REPS);
        for _ in 0..REPS {
            let t = Instant::now();
            self.all_reduce(stream, &mut buf, ReduceOp::Sum)?;
            self.wait(stream)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        us.sort_by(f64::total_cmp);
        // The slowest rank's median: the knee must not depend on which rank looked.
        let median = us[REPS / 2].max(f64::MIN_POSITIVE);
        self.agree(stream, median, ReduceOp::Max)
    }
}

impl<T: Float> Reducer<T> {
    /// A reducer on `stream`'s device with the bucket size tuned for `comm`
    /// ([`Comm::tuned_bucket_bytes`]). Every rank calls it.
    pub fn tuned(comm: &Comm, stream: &Stream) -> Result<Reducer<T>> {
        let bytes = comm.tuned_bucket_bytes(stream)?;
        Reducer::new(stream.device(), bytes)
    }
}
