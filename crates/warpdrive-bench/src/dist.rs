//! The `dist` suite: collectives of the CPU backend's in-process group (the NCCL path comes
//! with its communicators).
//!
//! - `all-reduce-w4` (size = bytes of f32 per rank): a sum over four ranks, each a thread of
//!   this process; µs per call, the slowest rank's time of each round. `gbps` is the
//!   algorithm bandwidth (bytes per rank / time), `extra.bus_gbps` the bus bandwidth in the
//!   nccl-tests convention (× 2(n−1)/n), `extra.pct_of_bound` the share of the
//!   minimal-traffic bound: in shared memory every rank's input must be read once and its
//!   output written once, n × bytes copied at the host memcpy ceiling.

use std::time::{Duration, Instant};

use warpdrive::dist::{Comm, ReduceOp};
use warpdrive::error::{Error, Result};
use warpdrive::{Buffer, Device};

use super::ceilings::random_f32;
use super::{Ceiling, Ctx, Scale};

pub(crate) const SUITE: &str = "dist";

const WORLD: usize = 4;
const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let (sizes, rounds): (&[usize], usize) = match ctx.scale() {
        Scale::Full => (&[MIB, 16 * MIB, 256 * MIB], 10),
        Scale::Quick => (&[MIB, 16 * MIB, 256 * MIB], 5),
        Scale::Tiny => (&[64 * KIB], 2),
    };
    let copy_gbps = ctx.ceilings().get(Ceiling::HostMemcpy);
    for &bytes in sizes {
        ctx.step(format!(
            "{SUITE}: all-reduce over {WORLD} ranks of {bytes} B"
        ));
        let mut us = all_reduce_rounds(bytes / 4, rounds)?;
        let row = ctx.record_bytes(
            "all-reduce-w4",
            bytes as u64,
            "warpdrive-cpu",
            &mut us,
            bytes as f64,
            None,
        )?;
        let median = row.median;
        let bus = bytes as f64 / (median * 1e3) * 2.0 * (WORLD - 1) as f64 / WORLD as f64;
        row.extra.insert("bus_gbps".into(), bus.into());
        row.extra.insert("ranks".into(), WORLD.into());
        if let Some(copy) = copy_gbps {
            let bound_us = (WORLD * bytes) as f64 / (copy * 1e3);
            row.extra
                .insert("pct_of_bound".into(), (100.0 * bound_us / median).into());
        }
    }
    Ok(())
}

/// µs of each of `rounds` all-reduces of `len` f32 (after one warm-up), the slowest rank's.
fn all_reduce_rounds(len: usize, rounds: usize) -> Result<Vec<f64>> {
    let comms = Comm::local_group(WORLD, Duration::from_secs(120))?;
    let per_rank: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || -> Result<Vec<f64>> {
                    let stream = Device::cpu().new_stream()?;
                    let input = random_f32(len, 0xd157 + rank as u64);
                    let mut buf = Buffer::from_host(&stream, &input)?;
                    comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
                    (0..rounds)
                        .map(|_| {
                            let start = Instant::now();
                            comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
                            Ok(start.elapsed().as_secs_f64() * 1e6)
                        })
                        .collect()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| {
                r.join().unwrap_or_else(|_| {
                    Err(Error::WorkerPanicked("a rank of the dist suite".into()))
                })
            })
            .collect()
    });
    let per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((0..rounds)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_records_the_bus_bandwidth() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let row = &ctx.rows()[0];
        assert_eq!((row.case.as_str(), row.size), ("all-reduce-w4", 64 * 1024));
        assert!(row.extra["bus_gbps"].as_f64().unwrap() > 0.0);
    }
}
