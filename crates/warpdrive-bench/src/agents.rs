//! The `agents` suite (issue 38): GPU agent simulation.
//!
//! - `circles-N` (size = agents): one step of FLAME GPU 2's Circles model (spatial messages,
//!   radius 2, density 1; `warpdrive::agents::Circles`) from a seeded start, µs per step.
//!   Variants: `warpdrive-graph` (the step's kernels and scan captured once as a CUDA graph,
//!   one graph launch per step) and `warpdrive` (the same launches issued one by one), both
//!   with the default move kernel (`circles_move_fast`); `warpdrive-exact-move` is
//!   `warpdrive` with the precise `circles_move` (the before of the fast force).
//!   `extra`: `agent_steps_per_s` (agents / median), the anchor `flame_gpu_agent_steps_per_s`
//!   (4.7e8: FLAME GPU 2, Circles at 1 M agents on an H100 PCIe, 0.428 s for 200 steps,
//!   run-time compiled agent functions), `x_flame_gpu` (ours / the anchor), the target
//!   `target_agent_steps_per_s` (1e9), `steps` timed (the positions keep evolving between
//!   samples, as a simulation does). Sizes: 1 M and 10 M (`full`), 32 k (`quick`), 2 k (`tiny`).
//! - `vote-N` (size = agents): a single majority vote over N agents' u32 votes (one kernel:
//!   warp ballots, block sums, the last block's decision), µs from the host enqueuing the
//!   vote to the host holding the decision (polling the packed decision word in mapped
//!   memory, no copy, no stream wait): variant `warpdrive`, with `p99_us` in `extra` and the target `target_p99_us`
//!   (10 at 1 M); the same with the decision behind a system fence (the earlier way, the
//!   before of the packed word): `warpdrive-fenced`; and the kernel alone timed by events:
//!   variant `warpdrive-kernel`; and the vote served by a resident kernel
//!   (`agents::ResidentMajority`: the host writes a round number into mapped memory, the
//!   kernel that stays on the GPU counts and writes the decision word; no launch a vote), µs
//!   from the host writing the round to the host seeing the decision, over 2,000 rounds in a
//!   row after 200 (`full`): variant `warpdrive-resident` (`extra`: `p99_us`, `blocks`).
//!   Sizes as `circles`.
//! - `quorum-N`, `averaging-N`, `life-N`, `submit-N`, `steps-N`: the weighted quorum,
//!   iterative averaging, birth and death, job submission and persistent stepping
//!   (`agents/more.rs`).
//! - `tiered-pP-N`: a drift step over a `TieredPopulation` with 0, 50 and 90 % of its
//!   agents parked in pinned host memory, against the PCIe ceiling of the same run
//!   (`agents/tiered.rs`); N is the scale's largest size.

use warpdrive::agents::{Circles, CirclesConfig, Majority, MoveKernel, ResidentMajority};
use warpdrive::error::Result;
use warpdrive::exec::Graph;
use warpdrive::memory::Buffer;

mod more;
mod tiered;

use super::stats::percentile;
use super::timing::{time_gpu, time_host};
use super::{Ctx, Scale};

pub(crate) const SUITE: &str = "agents";

/// FLAME GPU 2's Circles at 1 M agents on an H100 PCIe: 200 steps in 0.428 s.
const FLAME_GPU_AGENT_STEPS_PER_S: f64 = 1e6 * 200.0 / 0.428;
/// Issue 38's target for Circles.
const TARGET_AGENT_STEPS_PER_S: f64 = 1e9;
/// Issue 38's target for a single vote at 1 M agents.
const TARGET_VOTE_P99_US: f64 = 10.0;

fn sizes(scale: Scale) -> &'static [usize] {
    match scale {
        Scale::Full => &[1_000_000, 10_000_000],
        Scale::Quick => &[32_768],
        Scale::Tiny => &[2_000],
    }
}

fn reps(scale: Scale) -> (usize, usize) {
    match scale {
        Scale::Full => (10, 100),
        Scale::Quick => (2, 10),
        Scale::Tiny => (1, 3),
    }
}

fn label(n: usize) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    for &n in sizes(ctx.scale()) {
        circles(ctx, n)?;
    }
    for &n in sizes(ctx.scale()) {
        vote(ctx, n)?;
        more::quorum(ctx, n)?;
        more::averaging(ctx, n)?;
        more::life(ctx, n)?;
        more::submission(ctx, n)?;
        more::stepping(ctx, n)?;
    }
    if let Some(&n) = sizes(ctx.scale()).last() {
        tiered::tiered(ctx, n)?;
    }
    Ok(())
}

fn circles(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let case = format!("circles-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let mut sim = Circles::new(&stream, CirclesConfig::new(n, 0xc1c1e5))?;
    let mut eager = time_gpu(&stream, warm, reps, |s| sim.step(s))?;
    record_circles(ctx, &case, n, "warpdrive", &mut eager, reps)?;
    sim.set_move_kernel(MoveKernel::Exact);
    let mut exact = time_gpu(&stream, warm, reps, |s| sim.step(s))?;
    sim.set_move_kernel(MoveKernel::Fast);
    record_circles(ctx, &case, n, "warpdrive-exact-move", &mut exact, reps)?;
    let mut graph = Graph::capture(&stream, |s| sim.step(s))?;
    graph.prepare()?;
    let mut graphed = time_gpu(&stream, warm, reps, |_| graph.launch())?;
    drop(graph);
    record_circles(ctx, &case, n, "warpdrive-graph", &mut graphed, reps)
}

fn record_circles(
    ctx: &mut Ctx,
    case: &str,
    n: usize,
    variant: &str,
    us: &mut [f64],
    steps: usize,
) -> Result<()> {
    let row = ctx.record_time(case, n as u64, variant, us, None)?;
    let rate = n as f64 / (row.median * 1e-6);
    let rate = if rate.is_finite() { rate } else { 0.0 };
    row.extra.insert("agent_steps_per_s".into(), rate.into());
    row.extra.insert(
        "flame_gpu_agent_steps_per_s".into(),
        FLAME_GPU_AGENT_STEPS_PER_S.into(),
    );
    row.extra.insert(
        "x_flame_gpu".into(),
        (rate / FLAME_GPU_AGENT_STEPS_PER_S).into(),
    );
    row.extra.insert(
        "target_agent_steps_per_s".into(),
        TARGET_AGENT_STEPS_PER_S.into(),
    );
    row.extra.insert("steps".into(), steps.into());
    Ok(())
}

fn vote(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let reps = reps * 10;
    let case = format!("vote-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    // Seeded votes, 51 % yes.
    let votes: Vec<u32> = more::percents(n, 0x5eed)
        .iter()
        .map(|&p| u32::from(p < 51))
        .collect();
    let votes = Buffer::from_host(&stream, &votes)?;
    let mut majority = Majority::new(&stream)?;
    let mut seen = 0u64;
    let mut us = time_host(warm, reps, || {
        majority.run(&stream, &votes)?;
        seen = majority.decision(&stream)?.yes;
        Ok(())
    })?;
    let p99 = percentile(&us, 0.99);
    let row = ctx.record_time(&case, n as u64, "warpdrive", &mut us, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra
        .insert("target_p99_us".into(), TARGET_VOTE_P99_US.into());
    row.extra.insert("yes".into(), seen.into());
    // The earlier publication (three words behind __threadfence_system), the before.
    majority.set_packed(false);
    let mut fenced = time_host(warm, reps, || {
        majority.run(&stream, &votes)?;
        seen = majority.decision(&stream)?.yes;
        Ok(())
    })?;
    majority.set_packed(true);
    let p99 = percentile(&fenced, 0.99);
    let row = ctx.record_time(&case, n as u64, "warpdrive-fenced", &mut fenced, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra
        .insert("target_p99_us".into(), TARGET_VOTE_P99_US.into());
    let mut kernel = time_gpu(&stream, warm, reps, |s| majority.run(s, &votes))?;
    let p99 = percentile(&kernel, 0.99);
    let row = ctx.record_time(&case, n as u64, "warpdrive-kernel", &mut kernel, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    drop(majority);
    // The same votes served by the resident kernel: no launch a vote, many rounds in a row.
    let mut resident = ResidentMajority::start(&stream, votes)?;
    let mut resident_us = time_host(warm * 20, reps * 2, || {
        seen = resident.vote()?.yes;
        Ok(())
    })?;
    let blocks = resident.blocks();
    resident.stop()?;
    let p99 = percentile(&resident_us, 0.99);
    let rounds = resident_us.len();
    let row = ctx.record_time(
        &case,
        n as u64,
        "warpdrive-resident",
        &mut resident_us,
        None,
    )?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra
        .insert("target_p99_us".into(), TARGET_VOTE_P99_US.into());
    row.extra.insert("yes".into(), seen.into());
    row.extra.insert("blocks".into(), blocks.into());
    row.extra.insert("rounds".into(), rounds.into());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::Device;

    #[test]
    fn tiny_run_on_the_cpu_has_every_case_and_variant() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        for (case, variant) in [
            ("circles-2k", "warpdrive"),
            ("circles-2k", "warpdrive-graph"),
            ("circles-2k", "warpdrive-exact-move"),
            ("vote-2k", "warpdrive"),
            ("vote-2k", "warpdrive-kernel"),
            ("vote-2k", "warpdrive-fenced"),
            ("vote-2k", "warpdrive-resident"),
            ("quorum-2k", "warpdrive-resident"),
            ("quorum-2k", "warpdrive"),
            ("averaging-2k", "warpdrive"),
            ("life-2k", "warpdrive"),
            ("submit-2k", "warpdrive-cold"),
            ("submit-2k", "warpdrive-warm"),
            ("steps-2k", "warpdrive-persistent"),
            ("steps-2k", "warpdrive-graph"),
            ("tiered-p0-2k", "warpdrive"),
            ("tiered-p50-2k", "warpdrive"),
            ("tiered-p90-2k", "warpdrive"),
        ] {
            let row = rows
                .iter()
                .find(|r| r.case == case && r.variant == variant)
                .unwrap_or_else(|| panic!("no {case} {variant}"));
            assert_eq!(row.suite, SUITE);
            assert!(row.median > 0.0);
        }
        let c = rows.iter().find(|r| r.case == "circles-2k").unwrap();
        assert!(c.extra["agent_steps_per_s"].as_f64().unwrap() > 0.0);
        assert!(c.extra["flame_gpu_agent_steps_per_s"].as_f64().unwrap() > 4.6e8);
        let t = rows.iter().find(|r| r.case == "tiered-p90-2k").unwrap();
        assert_eq!(t.extra["parked"].as_u64(), Some(1800));
        assert!(t.extra["agent_steps_per_s"].as_f64().unwrap() > 0.0);
        // No pinned ceilings on the CPU backend: no ceiling row to compare with.
        assert!(!rows
            .iter()
            .any(|r| r.case == "tiered-p90-2k" && r.variant == "ceiling"));
        let v = rows.iter().find(|r| r.case == "vote-2k").unwrap();
        assert!(v.extra["p99_us"].as_f64().unwrap() >= v.median);
    }
}
