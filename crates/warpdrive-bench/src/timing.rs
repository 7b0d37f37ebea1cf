//! Timing helpers: device work timed with events on its stream, host work with the monotonic
//! clock.

use std::time::Instant;

use warpdrive::device::Stream;
use warpdrive::error::{Error, Result};
use warpdrive::exec::tune::round_order;

fn check_reps(reps: usize) -> Result<()> {
    if reps == 0 {
        Err(Error::InvalidArgument(
            "timing needs at least one rep".into(),
        ))
    } else {
        Ok(())
    }
}

/// Times `reps` runs of `work` on `stream` after `warmup` untimed ones; returns µs per rep,
/// in order.
///
/// One code path for both backends: it records timing events
/// ([`Device::new_event`](warpdrive::Device::new_event), [`Stream::record`],
/// [`Event::elapsed_ms`](warpdrive::Event::elapsed_ms)) between reps. On CUDA they are GPU
/// events, so a rep's time is the GPU's time from the end of the previous rep to the end of
/// this one; on the CPU backend they record host instants and work runs synchronously.
///
/// The stream is synchronised after the first warm-up (module loads, NVRTC and handle
/// creation stay out of the numbers); later warm-ups are left in flight so the timed reps
/// start on a busy stream. The reps are enqueued back to back between a chain of
/// `reps + 1` events and the host waits only at the end, so enqueue gaps do not count as
/// long as the host keeps ahead of the device.
pub fn time_gpu<F>(stream: &Stream, warmup: usize, reps: usize, mut work: F) -> Result<Vec<f64>>
where
    F: FnMut(&Stream) -> Result<()>,
{
    check_reps(reps)?;
    for i in 0..warmup {
        work(stream)?;
        if i == 0 {
            stream.synchronize()?;
        }
    }
    let device = stream.device();
    let events = (0..=reps)
        .map(|_| device.new_event())
        .collect::<Result<Vec<_>>>()?;
    let mut marks = events.iter();
    if let Some(first) = marks.next() {
        stream.record(first)?;
    }
    for mark in marks {
        work(stream)?;
        stream.record(mark)?;
    }
    let mut out = Vec::with_capacity(reps);
    for pair in events.windows(2) {
        if let [start, end] = pair {
            out.push(f64::from(start.elapsed_ms(end)?) * 1e3);
        }
    }
    Ok(out)
}

/// Times `reps` runs of host work `work` with the monotonic clock after `warmup` untimed
/// ones; returns µs per rep. The work must be synchronous (finish before it returns).
pub fn time_host<F>(warmup: usize, reps: usize, mut work: F) -> Result<Vec<f64>>
where
    F: FnMut() -> Result<()>,
{
    check_reps(reps)?;
    for _ in 0..warmup {
        work()?;
    }
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        work()?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(out)
}

/// Times `variants` kinds of host work side by side: `work(i)` runs variant `i`. After
/// `warmup` untimed rounds, each of `reps` rounds times every variant once, so a slow
/// stretch of the machine lands on all of them rather than on whichever ran then; the
/// rounds' orders ([`round_order`]) also give every variant every other one as its
/// predecessor equally often (what one leaves in caches and pools may slow the next). Each
/// round starts with an untimed run of its own first variant, so every variant follows
/// itself once per round of rounds: otherwise the last of one round precedes the first of
/// the next, pairs the rounds' orders leave unbalanced, and a fixed variant run there
/// instead favours whichever it slows least (bench/NOTES.md, bench sampling). Returns µs per
/// rep for each variant.
pub fn time_host_rounds<F>(
    warmup: usize,
    reps: usize,
    variants: usize,
    mut work: F,
) -> Result<Vec<Vec<f64>>>
where
    F: FnMut(usize) -> Result<()>,
{
    check_reps(reps)?;
    for _ in 0..warmup {
        for i in 0..variants {
            work(i)?;
        }
    }
    let mut out = vec![Vec::with_capacity(reps); variants];
    for round in 0..reps {
        let order = round_order(round, variants);
        if variants > 1 {
            work(order[0])?;
        }
        for i in order {
            let t = Instant::now();
            work(i)?;
            out[i].push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::{ops, Buffer, Device};

    #[test]
    fn time_gpu_on_the_cpu_backend_runs_every_rep_and_returns_times() {
        let stream = Device::cpu().new_stream().unwrap();
        let src = Buffer::from_host(&stream, &[1.0f32; 4096]).unwrap();
        let mut dst = Buffer::<f32>::uninit(&stream, 4096).unwrap();
        let mut calls = 0;
        let t = time_gpu(&stream, 2, 5, |s| {
            calls += 1;
            ops::copy(s, &src, &mut dst)
        })
        .unwrap();
        assert_eq!(calls, 7);
        assert_eq!(t.len(), 5);
        assert!(t.iter().all(|v| v.is_finite() && *v >= 0.0));
        assert_eq!(dst.to_host(&stream).unwrap(), vec![1.0f32; 4096]);
    }

    #[test]
    fn errors_propagate_and_zero_reps_is_an_error() {
        let stream = Device::cpu().new_stream().unwrap();
        assert!(time_gpu(&stream, 0, 0, |_| Ok(())).is_err());
        assert!(time_host(0, 0, || Ok(())).is_err());
        let r = time_gpu(&stream, 0, 3, |_| {
            Err(Error::InvalidArgument("boom".into()))
        });
        assert!(matches!(r, Err(Error::InvalidArgument(m)) if m == "boom"));
    }

    #[test]
    fn time_host_rounds_times_every_variant_every_round() {
        let mut order = Vec::new();
        let t = time_host_rounds(1, 3, 3, |i| {
            order.push(i);
            Ok(())
        })
        .unwrap();
        assert_eq!(t.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3]);
        // The warm-up round, then each timed round after an untimed run of its first.
        let want: Vec<usize> = [vec![0, 1, 2]]
            .into_iter()
            .chain((0..3).map(|r| {
                let o = round_order(r, 3);
                [vec![o[0]], o].concat()
            }))
            .flatten()
            .collect();
        assert_eq!(order, want);
        // With four variants over four rounds, every timed run's predecessor: each other
        // variant once within the rounds, and itself once (before it opens a round).
        let mut order = Vec::new();
        time_host_rounds(0, 4, 4, |i| {
            order.push(i);
            Ok(())
        })
        .unwrap();
        let mut before = [[0; 4]; 4];
        for round in order.chunks(5) {
            for w in round.windows(2) {
                before[w[1]][w[0]] += 1;
            }
        }
        for (v, row) in before.iter().enumerate() {
            for (u, &count) in row.iter().enumerate() {
                assert_eq!(count, 1, "{u} before {v}");
            }
        }
        assert!(time_host_rounds(0, 0, 2, |_| Ok(())).is_err());
        let failing = time_host_rounds(0, 2, 2, |i| {
            if i == 1 {
                Err(Error::InvalidArgument("variant 1 fails".into()))
            } else {
                Ok(())
            }
        });
        assert!(failing.is_err());
    }

    #[test]
    fn time_host_counts_reps() {
        let mut calls = 0;
        let t = time_host(1, 4, || {
            calls += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((calls, t.len()), (5, 4));
    }
}
