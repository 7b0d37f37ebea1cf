//! The `mlp-scaling` rows (issue 36): the GEMMs of a data-parallel training step of a
//! compute-bound MLP, alone (one rank) and on every GPU, its gradients averaged by a
//! `Reducer` while the backward pass runs.
//!
//! The MLP: `depth` square layers of `width` (no activation: the GEMMs are the compute), bf16
//! with f32 accumulation, `batch` rows per rank. A step is the forward pass
//! (`x_{l+1} = x_l · W_l`), then per layer from the last, the weight gradient
//! (`dW_l = x_lᵀ · dy`, handed to the Reducer as soon as it is enqueued) and the input
//! gradient (`dy ← dy · W_lᵀ`), with the last activations standing in for the loss gradient:
//! 6 · batch · width² · depth FLOPs a rank. Weak scaling: every rank keeps its batch, so the
//! ideal step time on N ranks is the one-rank time; `extra.scaling` = one-rank step / N-rank
//! step (the bar: ≥ 95% at 2 GPUs).

use std::time::Instant;

use warpdrive::bf16;
use warpdrive::dist::{Comm, CtaPolicy, Reducer, DEFAULT_BUCKET_BYTES};
use warpdrive::error::{Error, Result};
use warpdrive::ops::gemm::{matmul, matmul_with, GemmOptions};
use warpdrive::{Buffer, Device, Event, Stream};

use super::{barrier, on_rank_threads, slowest, TIMEOUT};
use crate::ceilings::random_f32;

/// The MLP's shape and how many timed steps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub width: usize,
    pub depth: usize,
    pub batch: usize,
    pub rounds: usize,
}

impl Shape {
    fn flops(&self) -> f64 {
        6.0 * self.batch as f64 * (self.width * self.width) as f64 * self.depth as f64
    }
}

/// µs per step (the slowest rank's, each round) of `comms[i]` on `devices[i]`, the gradients
/// averaged over a communicator of `policy`.
pub(super) fn step_times(
    comms: Vec<Comm>,
    devices: Vec<Device>,
    shape: Shape,
    policy: CtaPolicy,
) -> Result<Vec<f64>> {
    let world = comms.len();
    let sync = Comm::local_group(world, TIMEOUT)?;
    let ranks = comms.into_iter().zip(sync).zip(devices).collect();
    let mut per_rank = on_rank_threads(ranks, |_, ((comm, sync), device)| {
        let comm = match policy {
            CtaPolicy::Default => comm,
            other => comm.with_cta_policy(other)?,
        };
        rank(&comm, &sync, &device, shape)
    })?;
    per_rank
        .pop()
        .ok_or_else(|| Error::InvalidArgument("no rank ran".into()))
}

/// One rank's steps: one warm-up, then `rounds` timed.
fn rank(comm: &Comm, sync: &Comm, device: &Device, shape: Shape) -> Result<Vec<f64>> {
    let Shape {
        width: w,
        depth,
        batch: b,
        rounds,
    } = shape;
    let compute = device.new_stream()?;
    let host = Device::cpu().new_stream()?;
    let bf = |n: usize, seed: u64| -> Result<Buffer<bf16>> {
        let v: Vec<bf16> = random_f32(n, seed)
            .into_iter()
            .map(|x| bf16::from_f32(x * 0.02))
            .collect();
        Buffer::from_host(&compute, &v)
    };
    let seed = 0x3191 + comm.rank() as u64 * 1000;
    let weights = (0..depth)
        .map(|l| bf(w * w, seed + l as u64))
        .collect::<Result<Vec<_>>>()?;
    let mut acts = (0..=depth)
        .map(|l| bf(b * w, seed + 100 + l as u64))
        .collect::<Result<Vec<_>>>()?;
    let mut grads = (0..depth)
        .map(|_| Buffer::<bf16>::zeros(&compute, w * w))
        .collect::<Result<Vec<_>>>()?;
    let mut dy = Buffer::<bf16>::zeros(&compute, b * w)?;
    let mut dx = Buffer::<bf16>::zeros(&compute, b * w)?;
    let events = (0..depth)
        .map(|_| device.new_event())
        .collect::<Result<Vec<Event>>>()?;
    let mut reducer = Reducer::<bf16>::new(device, DEFAULT_BUCKET_BYTES)?;
    let mut times = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        barrier(sync, &host)?;
        let t = Instant::now();
        step(
            &compute,
            &weights,
            &mut acts,
            &mut grads,
            (&mut dy, &mut dx),
            &events,
            (w, b),
        )?;
        // Gradients become ready last layer first: hand them over in that order.
        let mut pairs: Vec<_> = grads.iter_mut().zip(&events).rev().collect();
        reducer.all_reduce(comm, &compute, &mut pairs)?;
        comm.wait(reducer.stream())?;
        compute.synchronize()?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        let us = slowest(sync, &host, us)?;
        if round > 0 {
            times.push(us);
        }
    }
    Ok(times)
}

/// Enqueues one step's GEMMs on `s`, recording `events[l]` once `grads[l]` is enqueued.
fn step(
    s: &Stream,
    weights: &[Buffer<bf16>],
    acts: &mut [Buffer<bf16>],
    grads: &mut [Buffer<bf16>],
    (dy, dx): (&mut Buffer<bf16>, &mut Buffer<bf16>),
    events: &[Event],
    (w, b): (usize, usize),
) -> Result<()> {
    let depth = weights.len();
    for l in 0..depth {
        let (done, rest) = acts.split_at_mut(l + 1);
        matmul(s, &done[l], &weights[l], &mut rest[0], (b, w, w))?;
    }
    let mut dy: &mut Buffer<bf16> = dy;
    let mut dx: &mut Buffer<bf16> = dx;
    let mut first = true;
    for l in (0..depth).rev() {
        let grad_out = if first { &acts[depth] } else { &*dy };
        matmul_with(
            s,
            &acts[l],
            grad_out,
            &mut grads[l],
            (w, w, b),
            GemmOptions::default().trans_a(),
        )?;
        s.record(&events[l])?;
        matmul_with(
            s,
            grad_out,
            &weights[l],
            dx,
            (b, w, w),
            GemmOptions::default().trans_b(),
        )?;
        std::mem::swap(&mut dy, &mut dx);
        first = false;
    }
    Ok(())
}

/// TFLOP/s of one rank at `step_us`.
pub(super) fn tflops(shape: Shape, step_us: f64) -> f64 {
    shape.flops() / (step_us * 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_run_on_a_cpu_group() {
        let shape = Shape {
            width: 32,
            depth: 3,
            batch: 16,
            rounds: 2,
        };
        let comms = Comm::local_group(2, TIMEOUT).unwrap();
        let cpus = vec![Device::cpu(), Device::cpu()];
        let us = step_times(comms, cpus, shape, CtaPolicy::Efficiency).unwrap();
        assert_eq!(us.len(), 2);
        assert!(us.iter().all(|t| *t > 0.0));
        assert!(tflops(shape, us[0]) > 0.0);
    }
}
