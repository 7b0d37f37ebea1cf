//! A streaming pipeline: chunks of a host input go through H2D, a user-enqueued compute and
//! D2H on N streams in turn, so one chunk's upload, another's compute and a third's
//! download overlap; output chunk `i` is always input chunk `i`'s result.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{par_copy, workers};
use crate::device::{Device, Event, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::{check_len, host_vec, Buffer, PinnedBuf};

/// Busy time per stage and the wall time of one [`Pipeline::run`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineStats {
    pub chunks: usize,
    pub wall_s: f64,
    /// Host copies between the caller's slices and the pinned blocks.
    pub host_s: f64,
    /// Time the staging thread had no host copy to do, waiting for a chunk's download to
    /// complete or for the calling thread to enqueue; of `wall_s − host_s`, the rest is
    /// its bookkeeping (pinned blocks, channels) and reading the last chunk's timings.
    pub wait_s: f64,
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

/// Each chunk's H2D, compute and D2H intervals (seconds from the run's start).
type StageIntervals = [Vec<(f64, f64)>; 3];

/// A chunk staged in pinned memory, on its way to the stream.
struct Staged<T: DType> {
    index: usize,
    input: PinnedBuf<T>,
}

/// A chunk whose H2D, compute and D2H are enqueued: its output block and the events
/// around its stages (before H2D, after H2D, after compute, after D2H).
struct InFlight<T: DType, U: DType> {
    index: usize,
    _input: PinnedBuf<T>,
    out: PinnedBuf<U>,
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
        // Chunks in flight (streams × buffering) must count, and the streams' list fit.
        crate::size::product("Pipeline chunks in flight", &[streams, buffering])?;
        let mut list = host_vec("Pipeline streams", streams)?;
        for _ in 0..streams {
            list.push(device.new_stream()?);
        }
        Ok(Pipeline {
            device: device.clone(),
            streams: list,
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
    ///
    /// The calling thread enqueues work (H2D, `compute`, D2H) and reads finished chunks'
    /// stage timings. A staging thread does every host copy on the copy threads at the same
    /// time: it fills the next chunk's pinned block and empties finished ones into `output`
    /// (oldest first), keeping up to streams × buffering chunks in flight, so host copies
    /// overlap the GPU's work and the calling thread's launches.
    pub fn run<T: DType, U: DType>(
        &self,
        input: &[T],
        output: &mut [U],
        mut compute: impl FnMut(&Stream, &Buffer<T>, &mut Buffer<U>) -> Result<()>,
    ) -> Result<PipelineStats> {
        check_len("Pipeline::run", input.len(), output.len())?;
        let start = Instant::now();
        let t0 = self.device.new_event()?;
        self.streams[0].record(&t0)?;
        for s in &self.streams[1..] {
            s.wait(&t0)?;
        }
        let n = input.len().div_ceil(self.chunk_len);
        let t0 = &t0;
        let mut intervals = StageIntervals::default();
        let (host, enqueued, timed) = std::thread::scope(|scope| {
            // Made here, so unwinding drops them and the staging thread stops.
            let (staged_tx, staged_rx) = mpsc::channel::<Staged<T>>();
            let (enqueued_tx, enqueued_rx) = mpsc::channel::<InFlight<T, U>>();
            let (finished_tx, finished_rx) = mpsc::channel::<[Event; 4]>();
            let stager =
                scope.spawn(move || self.stage(input, output, staged_tx, enqueued_rx, finished_tx));
            // Each finished chunk's stage events, read on this thread between its launches
            // (four reads a chunk, several µs each, which on the staging thread sat on the
            // slowest stage or after it; bench/NOTES.md, pipeline).
            let mut read = |events: [Event; 4]| read_intervals(t0, &events, &mut intervals);
            let mut enqueue_all = || -> Result<()> {
                // Device buffers per in-flight slot, reused by every full chunk of that slot:
                // slot k always runs on stream k % streams (the window is a multiple of the
                // streams), so reuse is ordered on one stream. (A pair per chunk from the
                // pool let one stream's allocation wait for another's free, and the stages
                // ran one after another; bench/NOTES.md, pipeline.)
                let window = self.streams.len() * self.buffering;
                let full = input.len() / self.chunk_len;
                let mut slots = (0..window.min(full))
                    .map(|k| {
                        let s = &self.streams[k % self.streams.len()];
                        Ok((
                            Buffer::<T>::uninit(s, self.chunk_len)?,
                            Buffer::<U>::uninit(s, self.chunk_len)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                for index in 0..n {
                    // A closed channel means the staging thread failed: its error wins.
                    let Ok(Staged { index: got, input }) = staged_rx.recv() else {
                        return Ok(());
                    };
                    debug_assert_eq!(got, index);
                    let f = if index < full {
                        let (d_in, d_out) = &mut slots[index % window];
                        self.enqueue(index, input, d_in, d_out, &mut compute)?
                    } else {
                        // The shorter last chunk: buffers of its own length.
                        let stream = &self.streams[index % self.streams.len()];
                        let len = input.len();
                        let (mut d_in, mut d_out) =
                            (Buffer::uninit(stream, len)?, Buffer::uninit(stream, len)?);
                        self.enqueue(index, input, &mut d_in, &mut d_out, &mut compute)?
                    };
                    if enqueued_tx.send(f).is_err() {
                        return Ok(());
                    }
                    finished_rx.try_iter().try_for_each(&mut read)?;
                }
                Ok(())
            };
            let enqueued = enqueue_all();
            // Stops the staging thread early when this one failed.
            drop((enqueued_tx, staged_rx));
            // Until the staging thread is done and drops its sender.
            let timed = finished_rx.iter().try_for_each(&mut read);
            let host = stager
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (host, enqueued, timed)
        });
        let (host_s, wait_s) = host?;
        enqueued?;
        timed?;
        let mut stats = PipelineStats {
            chunks: n,
            host_s,
            wait_s,
            ..PipelineStats::default()
        };
        stats.wall_s = start.elapsed().as_secs_f64();
        if !self.device.is_host_memory() {
            let [h2d, compute, d2h] = intervals.map(union_length);
            stats.h2d_s = h2d;
            stats.compute_s = compute;
            stats.d2h_s = d2h;
        }
        Ok(stats)
    }

    /// Enqueues chunk `index`'s H2D, compute and D2H on its stream (on the calling thread),
    /// through `d_in` and `d_out` (the chunk's length, used on that stream only).
    fn enqueue<T: DType, U: DType>(
        &self,
        index: usize,
        mut input: PinnedBuf<T>,
        d_in: &mut Buffer<T>,
        d_out: &mut Buffer<U>,
        compute: &mut impl FnMut(&Stream, &Buffer<T>, &mut Buffer<U>) -> Result<()>,
    ) -> Result<InFlight<T, U>> {
        let stream = &self.streams[index % self.streams.len()];
        let len = input.len();
        let events = [
            self.device.new_event()?,
            self.device.new_event()?,
            self.device.new_event()?,
            self.device.new_event()?,
        ];
        stream.record(&events[0])?;
        d_in.copy_from_pinned(stream, &mut input)?;
        stream.record(&events[1])?;
        compute(stream, d_in, d_out)?;
        stream.record(&events[2])?;
        let mut out = PinnedBuf::<U>::new(&self.device, len)?;
        d_out.copy_to_pinned(stream, &mut out)?;
        stream.record(&events[3])?;
        Ok(InFlight {
            index,
            _input: input,
            out,
            events,
        })
    }

    /// The staging thread: fills pinned blocks from `input` and sends them to the calling
    /// thread; empties the enqueued chunks it gets back into `output`, oldest first, as
    /// their D2H completes, and sends their stage events back to be read. Returns the host
    /// copy time and the time spent waiting.
    fn stage<T: DType, U: DType>(
        &self,
        input: &[T],
        output: &mut [U],
        staged: mpsc::Sender<Staged<T>>,
        enqueued: mpsc::Receiver<InFlight<T, U>>,
        finished: mpsc::Sender<[Event; 4]>,
    ) -> Result<(f64, f64)> {
        let workers = workers(&self.device);
        let threads = workers.threads();
        let chunk = self.chunk_len;
        let n = input.len().div_ceil(chunk);
        let window = self.streams.len() * self.buffering;
        let (mut host_s, mut wait_s) = (0.0, 0.0);
        let mut pending: VecDeque<InFlight<T, U>> = VecDeque::new();
        let (mut next, mut drained) = (0, 0);
        while drained < n {
            pending.extend(enqueued.try_iter());
            let in_flight = next - drained;
            let drain_now = match pending.front() {
                Some(f) => in_flight == window || next == n || f.events[3].query()?,
                None => false,
            };
            if drain_now {
                let Some(f) = pending.pop_front() else {
                    continue;
                };
                let lo = f.index * chunk;
                let piece = &mut output[lo..(lo + chunk).min(input.len())];
                let t = Instant::now();
                while !f.out.ready()? {
                    std::hint::spin_loop();
                }
                let host = f.out.wait_slice()?;
                wait_s += t.elapsed().as_secs_f64();
                let t = Instant::now();
                par_copy(workers, threads, piece, &host[..piece.len()])?;
                host_s += t.elapsed().as_secs_f64();
                // A closed channel means the calling thread stopped (its error is returned).
                let _ = finished.send(f.events);
                drained += 1;
            } else if next < n && in_flight < window {
                let piece = &input[next * chunk..((next + 1) * chunk).min(input.len())];
                let mut block = PinnedBuf::<T>::new(&self.device, piece.len())?;
                let t = Instant::now();
                par_copy(workers, threads, block.wait_slice_mut()?, piece)?;
                host_s += t.elapsed().as_secs_f64();
                if staged
                    .send(Staged {
                        index: next,
                        input: block,
                    })
                    .is_err()
                {
                    break; // the calling thread stopped (its error is returned)
                }
                next += 1;
            } else {
                // Everything staged is with the calling thread: wait for it, spinning first
                // (it enqueues within tens of µs; a sleeping thread takes about as long to
                // wake).
                let t = Instant::now();
                let got = recv_soon(&enqueued, RECV_SPIN);
                wait_s += t.elapsed().as_secs_f64();
                match got {
                    Some(f) => pending.push_back(f),
                    None => break,
                }
            }
        }
        Ok((host_s, wait_s))
    }
}

/// How long the staging thread spins for an enqueued chunk before it sleeps.
const RECV_SPIN: Duration = Duration::from_micros(200);

/// The next message, looked for during `spin` before sleeping on it; `None` once the
/// sender is gone.
fn recv_soon<M>(rx: &mpsc::Receiver<M>, spin: Duration) -> Option<M> {
    let until = Instant::now() + spin;
    while Instant::now() < until {
        match rx.try_recv() {
            Ok(m) => return Some(m),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
    rx.recv().ok()
}

/// Adds a finished chunk's H2D, compute and D2H intervals (seconds from `t0`) from its
/// four events.
fn read_intervals(t0: &Event, events: &[Event; 4], intervals: &mut StageIntervals) -> Result<()> {
    let mut ts = [0.0; 4];
    for (t, e) in ts.iter_mut().zip(events) {
        *t = f64::from(t0.elapsed_ms(e)?) * 1e-3;
    }
    for (k, iv) in intervals.iter_mut().enumerate() {
        iv.push((ts[k], ts[k + 1]));
    }
    Ok(())
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
            wait_s: 0.0,
            chunks: 3,
        };
        assert!((s.overlap_efficiency() - 1.0).abs() < 1e-12);
        let s = PipelineStats { wall_s: 3.0, ..s };
        assert!(s.overlap_efficiency().abs() < 1e-12);
    }
}
