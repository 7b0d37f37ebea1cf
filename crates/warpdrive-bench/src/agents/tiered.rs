//! The `agents` rows of a tiered population (a GPU tier and a pinned-host tier).
//!
//! - `tiered-pP-N` (size = agents, P = 0, 50, 90): one `StepFn::run_tiered` of a drift step
//!   (`x += v * p0`, two f32 fields: 8 bytes an agent each way) over N agents with P % of
//!   them parked in pinned host memory (the rest on the GPU), the parked ones streamed
//!   through the GPU in chunks of N / 10 agents (at most `DEFAULT_CHUNK`) on two streams;
//!   µs per step timed by events on the caller's stream. Variant `warpdrive`: `gbps` is the
//!   PCIe bytes a step moves (both fields of every parked agent, up and back) / median,
//!   `extra`: `agent_steps_per_s`, `parked`, `chunk`, `pcie_bytes`; with parked agents and
//!   measured pinned ceilings, `pct_of_ceiling` against the `ceiling` row. Variant
//!   `ceiling` (parked agents only, GPU runs only: the pinned ceilings are null on the CPU
//!   backend): the time the link needs for those bytes at this run's measured pinned
//!   ceilings, both directions at once (`max(up / h2d_pinned_gbps, down /
//!   d2h_pinned_gbps)`; `extra.serial_us`: one direction after the other) — computed from
//!   the `ceilings` suite of the same invocation, not timed again.

use warpdrive::agents::{StepFn, StepInputs, TierBudget, TieredPopulation, DEFAULT_CHUNK};
use warpdrive::error::Result;

use super::more::percents;
use super::{label, reps, SUITE};
use crate::results::Ceiling;
use crate::timing::time_gpu;
use crate::Ctx;

/// Percentages of the population parked on the host.
const PARKED_PCT: [usize; 3] = [0, 50, 90];
/// Bytes of the drift step's fields, an agent (x and v, f32).
const AGENT_BYTES: usize = 8;

fn drift() -> StepFn {
    StepFn::new("tiered-drift", "x[i] += v[i] * p[0];", |i, f, p| {
        f.f32[0][i] += f.f32[1][i] * p[0];
    })
}

pub(super) fn tiered(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let stream = ctx.stream().clone();
    let x: Vec<f32> = percents(n, 0x71).iter().map(|&v| v as f32).collect();
    let v: Vec<f32> = percents(n, 0x72).iter().map(|&v| v as f32 / 1e4).collect();
    let chunk = (n / 10).clamp(1, DEFAULT_CHUNK);
    let step = drift();
    let none = StepInputs::new();
    for pct in PARKED_PCT {
        let case = format!("tiered-p{pct}-{}", label(n));
        ctx.step(format!("{SUITE}: {case}"));
        let parked = n * pct / 100;
        let budget = TierBudget::new(n - parked, parked);
        let mut pop = TieredPopulation::with_chunk(n, budget, chunk)?;
        pop.add_f32(&stream, "x", &x)?;
        pop.add_f32(&stream, "v", &v)?;
        let mut us = time_gpu(&stream, warm, reps, |s| {
            step.run_tiered(s, &mut pop, &none, &[1e-3])
        })?;
        let bytes = (parked * AGENT_BYTES) as f64;
        let pcie = 2.0 * bytes;
        let ceiling_us = pcie_us(ctx, bytes);
        let row = ctx.record_bytes(&case, n as u64, "warpdrive", &mut us, pcie, None)?;
        let rate = n as f64 / (row.median * 1e-6);
        let rate = if rate.is_finite() { rate } else { 0.0 };
        row.extra.insert("agent_steps_per_s".into(), rate.into());
        row.extra.insert("parked".into(), parked.into());
        row.extra.insert("chunk".into(), chunk.into());
        row.extra.insert("pcie_bytes".into(), pcie.into());
        let Some((duplex, serial)) = ceiling_us.filter(|_| parked > 0) else {
            continue;
        };
        let pct_of = duplex / row.median * 100.0;
        if pct_of.is_finite() {
            row.pct_of_ceiling = Some(pct_of);
            row.extra
                .insert("ceiling".into(), "h2d_pinned_gbps+d2h_pinned_gbps".into());
        }
        let row = ctx.record_bytes(&case, n as u64, "ceiling", &mut [duplex], pcie, None)?;
        row.extra.insert("serial_us".into(), serial.into());
        row.extra.insert(
            "agent_steps_per_s".into(),
            (n as f64 / (duplex * 1e-6)).into(),
        );
        row.extra.insert(
            "op".into(),
            "the parked fields' bytes up and back at this run's pinned ceilings (computed, \
             not timed)"
                .into(),
        );
    }
    Ok(())
}

/// µs the link needs for `bytes` each way at this run's pinned ceilings: (both directions
/// at once, one after the other); `None` when either ceiling was not measured.
fn pcie_us(ctx: &Ctx, bytes: f64) -> Option<(f64, f64)> {
    let c = ctx.ceilings();
    let (up, down) = (c.get(Ceiling::H2dPinned)?, c.get(Ceiling::D2hPinned)?);
    if !(up > 0.0 && down > 0.0) {
        return None;
    }
    // GB/s is 10^3 bytes a µs.
    let (h2d, d2h) = (bytes / (up * 1e3), bytes / (down * 1e3));
    Some((h2d.max(d2h), h2d + d2h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::Ceilings;
    use crate::{Ctx, Scale};
    use warpdrive::Device;

    #[test]
    fn the_ceiling_row_is_the_parked_bytes_at_the_pinned_ceilings() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        // 50 GB/s up, 25 down: 1,800 parked agents move 14,400 bytes each way.
        ctx.set_ceilings(Ceilings {
            h2d_pinned_gbps: Some(50.0),
            d2h_pinned_gbps: Some(25.0),
            ..Ceilings::default()
        });
        tiered(&mut ctx, 2_000).unwrap();
        let rows = ctx.rows();
        let find = |case: &str, variant: &str| {
            rows.iter()
                .find(|r| r.case == case && r.variant == variant)
                .unwrap_or_else(|| panic!("no {case} {variant}"))
        };
        let c = find("tiered-p90-2k", "ceiling");
        let (up, down) = (14_400.0 / 50e3, 14_400.0 / 25e3);
        assert!((c.median - down).abs() < 1e-9, "{}", c.median);
        assert!((c.extra["serial_us"].as_f64().unwrap() - (up + down)).abs() < 1e-9);
        let w = find("tiered-p90-2k", "warpdrive");
        let pct = w.pct_of_ceiling.unwrap();
        assert!((pct - down / w.median * 100.0).abs() < 1e-9);
        assert_eq!(w.extra["pcie_bytes"].as_f64(), Some(28_800.0));
        assert!(find("tiered-p50-2k", "ceiling").median < c.median);
        // Nothing parked: nothing crosses the link, no ceiling row.
        assert!(!rows
            .iter()
            .any(|r| r.case == "tiered-p0-2k" && r.variant == "ceiling"));
        assert!(find("tiered-p0-2k", "warpdrive").pct_of_ceiling.is_none());
    }
}
