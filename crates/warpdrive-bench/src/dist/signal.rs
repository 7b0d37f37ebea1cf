//! The `peer-signal` rows: the one-way latency of a device-initiated signal through
//! peer-mapped memory (`dist::SignalPingPong`: a kernel on each side bounces a counter, the
//! flags in the polling side's memory), between two streams of the suite's device (variant
//! `warpdrive-same-device`) and, on hosts with two GPUs or more, between cuda:0 and cuda:1
//! (`warpdrive`). µs one way, each sample the mean of a run of round trips.

use std::time::Duration;

use warpdrive::dist::SignalPingPong;
use warpdrive::error::Result;
use warpdrive::Device;

use super::SUITE;
use crate::{Ctx, Scale};

/// Round trips a sample.
const ROUNDS: u64 = 1000;

pub(super) fn signal_rows(ctx: &mut Ctx) -> Result<()> {
    let samples = match ctx.scale() {
        Scale::Full => 20,
        Scale::Quick => 10,
        Scale::Tiny => 2,
    };
    let here = ctx.device().clone();
    let mut pairs = vec![("warpdrive-same-device", here.clone(), here)];
    if Device::cuda_count() >= 2 {
        let (a, b) = (Device::cuda(0)?, Device::cuda(1)?);
        if a.can_access_peer(&b)? && b.can_access_peer(&a)? {
            pairs.push(("warpdrive", a, b));
        }
    }
    for (variant, a, b) in pairs {
        ctx.step(format!("{SUITE}: device signal ping-pong, {variant}"));
        let (sa, sb) = (a.new_stream()?, b.new_stream()?);
        let mut pp = SignalPingPong::new(&a, &b)?;
        let timeout = Duration::from_secs(10);
        // The first run loads the kernels and maps the flags on both sides.
        pp.run(&sa, &sb, ROUNDS, timeout)?;
        let mut us = (0..samples)
            .map(|_| Ok(pp.run(&sa, &sb, ROUNDS, timeout)?.as_secs_f64() * 1e6))
            .collect::<Result<Vec<f64>>>()?;
        let row = ctx.record_time("peer-signal", 8, variant, &mut us, None)?;
        row.extra.insert(
            "pair".into(),
            format!("{} <-> {}", a.label(), b.label()).into(),
        );
        row.extra.insert("rounds_per_sample".into(), ROUNDS.into());
    }
    Ok(())
}
