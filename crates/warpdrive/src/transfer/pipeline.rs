//! A streaming pipeline: chunks of a host input go through H2D, a user-enqueued compute and
//! D2H on N streams in turn, so one chunk's upload, another's compute and a third's
//! download overlap; output chunk `i` is always input chunk `i`'s result.

use std::collections::VecDeque;
use std::time::Instant;

use super::{par_copy, workers, TransferConfig};
use crate::device::{Device, Event, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::{check_len, Buffer, PinnedBuf};

/// Busy time per stage and the wall time of one [`Pipeline::run`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineStats {
    pub chunks: usize,
    pub wall_s: f64,
    /// Host copies between the caller's slices and the pinned blocks.
    pub host_s: f64,
    /// Time the H2D copies kept the link busy (union of their intervals).
    pub h2d_s: f64,
    pub compute_s: f64,
    pub d2h_s: f64,
}

impl PipelineStats {
    /// Σ stages.
    pub fn stage_sum_s(&self) -> f64 {
        self.host_s + self.h2d_s + self.compute_s + self.d2h_s
    }

    /// The slowest stage's total.
    pub fn max_stage_s(&self) -> f64 {
        self.host_s
            .max(self.h2d_s)
            .max(self.compute_s)
            .max(self.d2h_s)
    }

    /// (Σ stage − wall) / (Σ stage − max stage): 1 when the wall time is the slowest
    /// stage's, 0 when the stages ran one after another.
    pub fn overlap_efficiency(&self) -> f64 {
        let hidden = self.stage_sum_s() - self.max_stage_s();
        if hidden <= 0.0 {
            return 1.0;
        }
        ((self.stage_sum_s() - self.wall_s) / hidden).clamp(0.0, 1.0)
    }
}

/// Streams chunks of `chunk_len` elements through N streams.
pub struct Pipeline {
    device: Device,
    streams: Vec<Stream>,
    chunk_len: usize,
    /// Chunks in flight per stream (2: double buffering, 3: triple).
    buffering: usize,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pipeline({} streams x{}, chunks of {})",
            self.streams.len(),
            self.buffering,
            self.chunk_len
        )
    }
}

/// One chunk in flight: its output block and the events around its stages.
struct InFlight<U: DType> {
    index: usize,
    out: PinnedBuf<U>,
    /// Before H2D, after H2D, after compute, after D2H.
    events: [Event; 4],
}

impl Pipeline {
    /// `streams` new streams on `device`, chunks of `chunk_len` elements, `buffering`
    /// (2 or 3) chunks in flight per stream.
    pub fn new(
        device: &Device,
        streams: usize,
        chunk_len: usize,
        buffering: usize,
    ) -> Result<Pipeline> {
        if streams == 0 || chunk_len == 0 || !(1..=3).contains(&buffering) {
            return Err(Error::InvalidArgument(format!(
                "Pipeline: {streams} streams, chunks of {chunk_len}, buffering {buffering} \
                 (need ≥ 1 stream, chunks ≥ 1, buffering 1..=3)"
            )));
        }
        Ok(Pipeline {
            device: device.clone(),
            streams: (0..streams)
                .map(|_| device.new_stream())
                .collect::<Result<_>>()?,
            chunk_len,
            buffering,
        })
    }

    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }

    /// Runs every chunk of `input` through `compute(stream, chunk in, chunk out)` (which
    /// enqueues work on `stream` and must fill the output) into the same chunk of
    /// `output` (as long as `input`); returns when all is done.
    pub fn run<T: DType, U: DType>(
        &self,
        input: &[T],
        output: &mut [U],
        mut compute: impl FnMut(&Stream, &Buffer<T>, &mut Buffer<U>) -> Result<()>,
    ) -> Result<PipelineStats> {
        check_len("Pipeline::run", input.len(), output.len())?;
        let workers = workers(&self.device);
        let threads = TransferConfig::default().threads;
        let start = Instant::now();
        let t0 = self.device.new_event()?;
        self.streams[0].record(&t0)?;
        for s in &self.streams[1..] {
            s.wait(&t0)?;
        }
        let mut stats = PipelineStats::default();
        let mut intervals: [Vec<(f64, f64)>; 3] = Default::default();
        let mut queue: VecDeque<InFlight<U>> = VecDeque::new();
        let window = self.streams.len() * self.buffering;
        let chunk = self.chunk_len;
        let mut drain =
            |f: InFlight<U>, output: &mut [U], stats: &mut PipelineStats| -> Result<()> {
                let lo = f.index * chunk;
                let hi = (lo + chunk).min(output.len());
                let piece = &mut output[lo..hi];
                let host = f.out.as_slice()?;
                let t = Instant::now();
                par_copy(workers, threads, piece, &host[..piece.len()]);
                stats.host_s += t.elapsed().as_secs_f64();
                let at = |e: &Event| -> Result<f64> { Ok(f64::from(t0.elapsed_ms(e)?) * 1e-3) };
                let ts = [
                    at(&f.events[0])?,
                    at(&f.events[1])?,
                    at(&f.events[2])?,
                    at(&f.events[3])?,
                ];
                for (k, iv) in intervals.iter_mut().enumerate() {
                    iv.push((ts[k], ts[k + 1]));
                }
                Ok(())
            };
        for (index, piece) in input.chunks(chunk).enumerate() {
            if queue.len() >= window {
                if let Some(f) = queue.pop_front() {
                    drain(f, output, &mut stats)?;
                }
            }
            let stream = &self.streams[index % self.streams.len()];
            let mut staged = PinnedBuf::<T>::new(&self.device, piece.len())?;
            let t = Instant::now();
            par_copy(workers, threads, staged.as_mut_slice()?, piece);
            stats.host_s += t.elapsed().as_secs_f64();
            let events = [
                self.device.new_event()?,
                self.device.new_event()?,
                self.device.new_event()?,
                self.device.new_event()?,
            ];
            let mut d_in = Buffer::<T>::uninit(stream, piece.len())?;
            let mut d_out = Buffer::<U>::uninit(stream, piece.len())?;
            stream.record(&events[0])?;
            d_in.copy_from_pinned(stream, &mut staged)?;
            stream.record(&events[1])?;
            compute(stream, &d_in, &mut d_out)?;
            stream.record(&events[2])?;
            let mut out = PinnedBuf::<U>::new(&self.device, piece.len())?;
            d_out.copy_to_pinned(stream, &mut out)?;
            stream.record(&events[3])?;
            queue.push_back(InFlight { index, out, events });
            stats.chunks += 1;
        }
        while let Some(f) = queue.pop_front() {
            drain(f, output, &mut stats)?;
        }
        stats.wall_s = start.elapsed().as_secs_f64();
        if self.device.is_cuda() {
            let [h2d, compute, d2h] = intervals.map(union_length);
            stats.h2d_s = h2d;
            stats.compute_s = compute;
            stats.d2h_s = d2h;
        }
        Ok(stats)
    }
}

/// Total length covered by a set of intervals.
fn union_length(mut iv: Vec<(f64, f64)>) -> f64 {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (a, b) in iv {
        match cur {
            Some((ca, cb)) if a <= cb => cur = Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += cb - ca;
                cur = Some((a, b));
            }
            None => cur = Some((a, b)),
        }
    }
    if let Some((a, b)) = cur {
        total += b - a;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_of_intervals() {
        assert_eq!(union_length(vec![]), 0.0);
        assert_eq!(union_length(vec![(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]), 3.0);
    }

    #[test]
    fn efficiency() {
        let s = PipelineStats {
            wall_s: 1.0,
            host_s: 1.0,
            h2d_s: 1.0,
            compute_s: 1.0,
            d2h_s: 0.0,
            chunks: 3,
        };
        assert!((s.overlap_efficiency() - 1.0).abs() < 1e-12);
        let s = PipelineStats { wall_s: 3.0, ..s };
        assert!(s.overlap_efficiency().abs() < 1e-12);
    }
}
