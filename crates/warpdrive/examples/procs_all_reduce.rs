//! The CPU group's all-reduce with one process a rank (spawned here as `torchrun` would,
//! over shared memory) against the in-process group (a thread a rank), on the same sizes:
//! the median ms of the slowest rank and the process group's time over the in-process one.
//!
//! `cargo run --release -p warpdrive --example procs_all_reduce -- [WORLD] [MIB] [ROUNDS]`
//! (defaults 4, 256, 5). `WARPDRIVE_DIST_LEND=0` or `WARPDRIVE_DIST_CMA=0` in the
//! environment turn those paths off for the process group.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use warpdrive::dist::{Comm, ReduceOp};
use warpdrive::{Buffer, Device, Error, Result};

const TIMEOUT: Duration = Duration::from_secs(120);

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| -> Result<usize> {
        args.get(i).map_or(Ok(default), |a| {
            a.parse()
                .map_err(|_| Error::InvalidArgument(format!("argument {a:?} is not a number")))
        })
    };
    let (world, mib, rounds) = (arg(0, 4)?, arg(1, 256)?, arg(2, 5)?.max(1));
    let len = (mib << 20) / 4;
    if std::env::var("RANK").is_ok() {
        // A spawned rank: rank 0 prints the slowest rank's median.
        let comm = Comm::cpu_from_env(TIMEOUT)?;
        let ms = rounds_ms(&comm, len, rounds)?;
        if comm.rank() == 0 {
            println!("{ms}");
        }
        return Ok(());
    }
    let threads = std::thread::scope(|s| {
        let handles: Vec<_> = Comm::local_group(world, TIMEOUT)?
            .into_iter()
            .map(|comm| s.spawn(move || rounds_ms(&comm, len, rounds)))
            .collect();
        let mut ms = 0.0f64;
        for h in handles {
            let t = h
                .join()
                .map_err(|_| Error::WorkerPanicked("a rank thread".into()))??;
            ms = ms.max(t);
        }
        Ok::<f64, Error>(ms)
    })?;
    let procs = spawned(world, mib, rounds)?;
    println!(
        "{world} ranks, {mib} MiB a rank: in process {threads:.2} ms, processes (shared \
         memory) {procs:.2} ms, {:.1}% of the in-process speed",
        100.0 * threads / procs
    );
    Ok(())
}

/// The median ms of `rounds` all-reduces of `len` f32 (after a warm-up), the slowest rank's.
fn rounds_ms(comm: &Comm, len: usize, rounds: usize) -> Result<f64> {
    let stream = Device::cpu().new_stream()?;
    let host: Vec<f32> = (0..len).map(|i| (i % 1013) as f32 * 0.25).collect();
    let mut buf = Buffer::from_host(&stream, &host)?;
    comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
    let mut ms = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
        let mut t = Buffer::from_host(&stream, &[start.elapsed().as_secs_f32() * 1e3])?;
        comm.all_reduce(&stream, &mut t, ReduceOp::Max)?;
        ms.push(f64::from(t.to_host(&stream)?[0]));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// Runs `world` copies of this program as the ranks of a process group; rank 0's answer.
fn spawned(world: usize, mib: usize, rounds: usize) -> Result<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::InvalidArgument(format!("no free port: {e}")))?
        .port();
    let exe = std::env::current_exe()
        .map_err(|e| Error::InvalidArgument(format!("this program's path: {e}")))?;
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        let child = Command::new(&exe)
            .args([world, mib, rounds].map(|a| a.to_string()))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("WARPDRIVE_DIST_TRANSPORT", "shm")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::InvalidArgument(format!("spawning rank {rank}: {e}")))?;
        children.push(child);
    }
    // Every rank gives up after TIMEOUT, so each wait ends.
    let spawned = children.into_iter().map(|c| c.wait_with_output());
    let mut answer = None;
    for (rank, out) in spawned.into_iter().enumerate() {
        let out = out.map_err(|e| Error::InvalidArgument(format!("rank {rank}: {e}")))?;
        if !out.status.success() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        if rank == 0 {
            answer = String::from_utf8_lossy(&out.stdout).trim().parse().ok();
        }
    }
    answer.ok_or_else(|| Error::InvalidArgument("rank 0 printed no time".into()))
}
