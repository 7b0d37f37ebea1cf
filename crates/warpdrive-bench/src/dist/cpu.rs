//! The `all-reduce-w4` rows: the CPU backend's groups — in one process (buffers lent between
//! the rank threads), across processes over shared memory and over TCP — all-reducing f32
//! over four ranks, with the bus bandwidth and the share of the minimal-traffic bound.

use std::time::Instant;

use warpdrive::dist::{Comm, LaunchEnv, ReduceOp, Transport};
use warpdrive::error::{Error, Result};
use warpdrive::{Buffer, Device};

use super::{on_rank_threads, MIB, SUITE, TIMEOUT, WORLD};
use crate::ceilings::random_f32;
use crate::{Ceiling, Ctx};

/// The rows at each of `sizes` (bytes a rank), `rounds` timed all-reduces each.
pub(super) fn all_reduce_rows(ctx: &mut Ctx, sizes: &[usize], rounds: usize) -> Result<()> {
    let copy_gbps = ctx.ceilings().get(Ceiling::HostMemcpy);
    let groups = [
        (CpuGroup::InProcess, "warpdrive-cpu", "in process"),
        (
            CpuGroup::Procs(Transport::SharedMemory),
            "warpdrive-cpu-shm",
            "shared memory",
        ),
        (CpuGroup::Procs(Transport::Tcp), "warpdrive-cpu-tcp", "TCP"),
    ];
    for (group, variant, how) in groups {
        for &bytes in sizes {
            // TCP on loopback is the reference across hosts, not a fast path: up to 16 MiB.
            if matches!(group, CpuGroup::Procs(Transport::Tcp)) && bytes > 16 * MIB {
                continue;
            }
            ctx.step(format!(
                "{SUITE}: all-reduce over {WORLD} ranks ({how}) of {bytes} B"
            ));
            let mut us = all_reduce_rounds(bytes / 4, rounds, group)?;
            let row = ctx.record_bytes(
                "all-reduce-w4",
                bytes as u64,
                variant,
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
    }
    Ok(())
}

/// µs of each of `rounds` all-reduces of `len` f32 (after one warm-up), the slowest rank's.
fn all_reduce_rounds(len: usize, rounds: usize, group: CpuGroup) -> Result<Vec<f64>> {
    let body = |rank: usize, comm: Comm| -> Result<Vec<f64>> {
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
    };
    let per_rank = match group {
        CpuGroup::InProcess => {
            let comms = Comm::local_group(WORLD, TIMEOUT)?;
            on_rank_threads(comms, body)?
        }
        CpuGroup::Procs(transport) => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| Error::InvalidArgument(format!("no free port for the ranks: {e}")))?
                .port();
            on_rank_threads((0..WORLD).collect(), |rank, _: usize| {
                let env = LaunchEnv {
                    rank,
                    world: WORLD,
                    local_rank: rank,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                };
                body(rank, Comm::cpu_rank(&env, transport, TIMEOUT)?)
            })?
        }
    };
    Ok((0..rounds)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect())
}

/// Which CPU group an `all-reduce-w4` row runs on.
#[derive(Clone, Copy)]
enum CpuGroup {
    /// `Comm::local_group`: the ranks' buffers lent to one another.
    InProcess,
    /// `Comm::cpu_rank` over a transport: ranks that share nothing but the transport (here
    /// threads of this process, each with its own rendezvous, links and mapping).
    Procs(Transport),
}
