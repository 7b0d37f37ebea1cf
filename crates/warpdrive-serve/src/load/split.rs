//! The open loop on split runtimes ([`LoadConfig::split`]): one single-threaded tokio runtime
//! on each generator thread, each with a client of its own (its share of the connections),
//! its own timer wheel and socket driver, the pacer dealing the jobs to them in turn (each
//! lane's dispatcher task spawns them there) and the answers gathered on the calling thread.
//!
//! A multi-threaded runtime shares its run queue (the pacer pushes every job into it), one
//! timer wheel (every job's timeout goes in and out of it under one lock) and one socket
//! driver (polled by whichever thread parks on it): one thread that stops while it holds any
//! of them stops every job, which is how a stall of the generator's whole runtime looks.
//! Split, a stopped thread holds up its own share of the jobs; no lock of the runtime is
//! shared between threads, and a job's task is allocated and freed on its lane's thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{
    count_unanswered, expected_jobs, one_job, pace, prepare, Done, LoadConfig, LoadError,
    LoadReport,
};
use crate::client::{Client, ClientConfig};
use crate::probe::{Probes, Where};

/// One runtime and the thread that drives it until dropped.
struct Lane {
    handle: tokio::runtime::Handle,
    client: Client,
    quit: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(q) = self.quit.take() {
            let _ = q.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lane(config: &LoadConfig, i: usize, connections: usize) -> Result<Lane, LoadError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .event_interval(config.event_interval.max(1))
        .enable_all()
        .build()
        .map_err(|e| LoadError(format!("tokio runtime: {e}")))?;
    let handle = rt.handle().clone();
    let (quit, quit_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("warpdrive-load{i}"))
        .spawn(move || {
            let _ = rt.block_on(quit_rx);
        })
        .map_err(|e| LoadError(format!("a generator thread: {e}")))?;
    let client = Client::new(
        config.addr,
        ClientConfig {
            max_connections: connections,
            timeout: config.timeout,
            format: config.format,
        },
    );
    Ok(Lane {
        handle,
        client,
        quit: Some(quit),
        thread: Some(thread),
    })
}

/// [`super::run`]'s open loop at `per_s` on `config.threads` split runtimes.
pub(super) fn run(config: &LoadConfig, per_s: f64) -> Result<LoadReport, LoadError> {
    let k = config.threads.clamp(1, 64);
    let per_lane = config.connections.div_ceil(k).max(1);
    let lanes = (0..k)
        .map(|i| lane(config, i, per_lane))
        .collect::<Result<Vec<_>, _>>()?;
    let (job, rng) = lanes[0]
        .handle
        .block_on(prepare(config, &lanes[0].client))?;
    let mut report = LoadReport::with_capacity(expected_jobs(config));
    report.offered_per_s = Some(per_s);
    let probes: Vec<Probes> = config.stall_probe.map_or_else(Vec::new, |t| {
        lanes
            .iter()
            .map(|l| Probes::start(&l.handle, t, |_| {}))
            .collect()
    });
    let start = Instant::now();
    report.started_unix_us = crate::wire::unix_us_now();
    let stop = crate::later(start, config.duration);
    let max_jobs = config.max_jobs.unwrap_or(u64::MAX);
    let (tx, answers) = std::sync::mpsc::channel::<Done>();
    let sent = Arc::new(AtomicU64::new(0));
    let going = Arc::new(AtomicBool::new(true));
    // Each lane's dispatcher spawns the jobs the pacer deals it, so a job's task is allocated
    // (and freed) on its lane's thread: spawned from the pacer, every task would come from
    // the pacer's malloc arena, and that arena grows a page at a time (an `mprotect` each,
    // under its lock) whenever more jobs are in flight than ever before (strace, build VM).
    let deal: Vec<_> = lanes
        .iter()
        .map(|l| {
            let (jobs, mut dealt) = tokio::sync::mpsc::unbounded_channel::<(Instant, Instant)>();
            let (client, job, tx) = (l.client.clone(), job.clone(), tx.clone());
            l.handle.spawn(async move {
                while let Some(times) = dealt.recv().await {
                    let (client, job, tx) = (client.clone(), job.clone(), tx.clone());
                    tokio::spawn(async move {
                        let _ = tx.send(one_job(client, job, times).await);
                    });
                }
            });
            jobs
        })
        .collect();
    // The answers' channel ends when the dispatchers and every job's task are done with it.
    drop(tx);
    let (paced, still) = (sent.clone(), going.clone());
    let pacer = std::thread::Builder::new()
        .name("warpdrive-load-pacer".into())
        .spawn(move || {
            let mut next = 0usize;
            let going = || still.load(Ordering::Relaxed);
            pace(
                per_s,
                rng,
                (start, stop),
                (max_jobs, &paced),
                going,
                |due, handed| {
                    let _ = deal[next % deal.len()].send((due, handed));
                    next = next.wrapping_add(1);
                },
            );
        })
        .map_err(|e| LoadError(format!("the pacing thread: {e}")))?;
    // Every job's task ends within the client's timeout; this bounds the whole drain too.
    let drain = crate::later(stop, config.timeout.saturating_add(Duration::from_secs(1)));
    let mut got = 0u64;
    loop {
        let wait = drain.saturating_duration_since(Instant::now());
        match answers.recv_timeout(wait) {
            Ok((due, handed, began, answered, outcome)) => {
                got += 1;
                report.record(start, (due, handed, began, answered), outcome);
            }
            Err(_) => break,
        }
    }
    going.store(false, Ordering::Relaxed);
    let _ = pacer.join();
    report.sent = sent.load(Ordering::Acquire);
    count_unanswered(&mut report, got);
    report.elapsed = start.elapsed();
    // Each runtime's task probe; the thread probes all watch the one process: the first's.
    let mut stalls: Vec<_> = probes
        .into_iter()
        .enumerate()
        .flat_map(|(i, p)| {
            p.finish()
                .into_iter()
                .filter(move |s| i == 0 || s.probe == Where::Runtime)
        })
        .collect();
    stalls.sort_by_key(|s| s.until_unix_us);
    report.stalls = stalls;
    drop(lanes);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Arrivals;

    /// The point of splitting: a lane whose thread is stuck holds up its own tasks only.
    #[test]
    fn a_stuck_lane_holds_up_its_own_tasks_only() {
        let config = LoadConfig::new(
            "127.0.0.1:9".parse().unwrap(),
            Arrivals::Poisson { per_s: 1.0 },
            Duration::from_secs(1),
        );
        let lanes: Vec<Lane> = (0..2).map(|i| lane(&config, i, 1).unwrap()).collect();
        let (tx, rx) = std::sync::mpsc::channel::<(usize, Instant)>();
        // Lane 0's only thread is stuck in a blocking call for 300 ms.
        lanes[0]
            .handle
            .spawn(async { std::thread::sleep(Duration::from_millis(300)) });
        std::thread::sleep(Duration::from_millis(20));
        let dealt = Instant::now();
        for i in 0..20 {
            let tx = tx.clone();
            lanes[i % 2].handle.spawn(async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                let _ = tx.send((i % 2, Instant::now()));
            });
        }
        drop(tx);
        let done: Vec<(usize, Instant)> = rx.iter().collect();
        assert_eq!(done.len(), 20);
        let took = |lane: usize| {
            done.iter()
                .filter(|(l, _)| *l == lane)
                .map(|(_, t)| t.duration_since(dealt))
                .max()
                .unwrap()
        };
        assert!(took(1) < Duration::from_millis(150), "{:?}", took(1));
        assert!(took(0) >= Duration::from_millis(200), "{:?}", took(0));
    }
}
