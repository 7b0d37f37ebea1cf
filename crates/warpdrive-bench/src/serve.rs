//! The `serve` suite (issue 37): the job service on this suite's device, driven over
//! loopback HTTP by client threads of this process (keep-alive connections).
//!
//! - `submit` (size = rows per job, 1): µs from the request's headers to the job being queued
//!   (the service's own `submit_us`: body, parsing, checks, enqueue), one client sending
//!   one-row jobs back to back; `extra.p99_us`.
//! - `load-1row` (size = concurrent clients, 1 / 8 / 32, each sending one-row jobs back to
//!   back: a closed loop): µs per job as a client sees it; variants `warpdrive-batch-1`
//!   (every job its own batch) and `warpdrive-dynamic` (batches close at 256 rows or 2 ms);
//!   `extra.jobs_per_s`, `extra.p99_us`, `extra.mean_batch_rows`.
//!
//! The model is the MoE layer of `qwen3-30b-a3b` (seeded weights): its full shape on CUDA,
//! the `tiny` scale (hidden 128) on the CPU backend.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use warpdrive::error::{Error, Result};
use warpdrive_serve::{MoeModel, ServeConfig, Server};

use super::stats::percentile;
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "serve";

const PRESET: &str = "qwen3-30b-a3b";
const WAIT: Duration = Duration::from_secs(30);

struct Plan {
    submits: usize,
    load_for: Duration,
    clients: &'static [usize],
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                submits: 5000,
                load_for: Duration::from_secs(2),
                clients: &[1, 8, 32],
            },
            Scale::Quick => Plan {
                submits: 1000,
                load_for: Duration::from_millis(500),
                clients: &[1, 8, 32],
            },
            Scale::Tiny => Plan {
                submits: 30,
                load_for: Duration::from_millis(100),
                clients: &[1, 4],
            },
        }
    }
}

/// A keep-alive HTTP/1.1 connection that posts JSON.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: SocketAddr) -> Result<Client> {
        let io = |e: std::io::Error| Error::InvalidArgument(format!("serve client: {e}"));
        let writer = TcpStream::connect_timeout(&addr, WAIT).map_err(io)?;
        writer.set_read_timeout(Some(WAIT)).map_err(io)?;
        writer.set_nodelay(true).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Client { reader, writer })
    }

    /// POSTs `body` to `path`; the status and the reply's body.
    fn post(&mut self, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
        let io = |e: std::io::Error| Error::InvalidArgument(format!("serve client: {e}"));
        write!(
            self.writer,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .and_then(|()| self.writer.write_all(body))
        .map_err(io)?;
        let mut line = String::new();
        self.reader.read_line(&mut line).map_err(io)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::InvalidArgument(format!("serve client: status line {line:?}")))?;
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line).map_err(io)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut reply = vec![0u8; length];
        self.reader.read_exact(&mut reply).map_err(io)?;
        Ok((status, reply))
    }
}

/// A one-row job of `width` values (the same values each time: the model's work does not
/// depend on them).
fn one_row(width: usize) -> Vec<u8> {
    let data: Vec<f32> = (0..width).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    serde_json::json!({ "rows": 1, "data": data })
        .to_string()
        .into_bytes()
}

/// The reply's `key` as a number.
fn field(reply: &[u8], key: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_slice(reply)
        .map_err(|e| Error::InvalidArgument(format!("serve reply: {e}")))?;
    v[key]
        .as_f64()
        .ok_or_else(|| Error::InvalidArgument(format!("serve reply has no {key}")))
}

fn start(ctx: &Ctx, max_batch_rows: usize, max_delay: Duration) -> Result<(Server, usize)> {
    let scale = if ctx.device().is_cuda() {
        Scale::Full
    } else {
        Scale::Tiny
    };
    let (config, weights, _) = super::moe::case_at(PRESET, 1, scale)?;
    let device = ctx.device().clone();
    let server = Server::start(
        move || Ok(Box::new(MoeModel::new(PRESET, &device, config, weights)?)),
        ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_batch_rows,
            max_delay,
            ..ServeConfig::default()
        },
    )?;
    Ok((server, config.hidden))
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    for (variant, rows, delay) in [
        ("warpdrive-batch-1", 1, Duration::ZERO),
        ("warpdrive-dynamic", 256, Duration::from_millis(2)),
    ] {
        ctx.step(format!("{SUITE}: {variant}"));
        let (server, width) = start(ctx, rows, delay)?;
        let body = one_row(width);
        if variant == "warpdrive-batch-1" {
            let mut client = Client::connect(server.addr)?;
            let mut us = Vec::with_capacity(plan.submits);
            for k in 0..plan.submits + 10 {
                let (status, reply) = client.post("/v1/jobs", &body)?;
                if status != 200 {
                    return Err(Error::InvalidArgument(format!("serve: status {status}")));
                }
                if k >= 10 {
                    us.push(field(&reply, "submit_us")?);
                }
            }
            let tail = percentile(&us, 0.99);
            let row = ctx.record_time("submit", 1, "warpdrive", &mut us, None)?;
            row.extra.insert("p99_us".into(), tail.into());
        }
        for &clients in plan.clients {
            let (mut us, batch_rows) = load(server.addr, &body, clients, plan.load_for)?;
            let jobs = us.len() as f64;
            let tail = percentile(&us, 0.99);
            let mean_batch = batch_rows / jobs.max(1.0);
            let row = ctx.record_time("load-1row", clients as u64, variant, &mut us, None)?;
            row.extra.insert(
                "jobs_per_s".into(),
                (jobs / plan.load_for.as_secs_f64()).into(),
            );
            row.extra.insert("p99_us".into(), tail.into());
            row.extra
                .insert("mean_batch_rows".into(), mean_batch.into());
        }
    }
    Ok(())
}

/// `clients` threads posting `body` back to back for `time`: each job's µs as its client saw
/// it, and the sum of the batch sizes the jobs ran in.
fn load(addr: SocketAddr, body: &[u8], clients: usize, time: Duration) -> Result<(Vec<f64>, f64)> {
    let per_client = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(move || -> Result<(Vec<f64>, f64)> {
                    let mut client = Client::connect(addr)?;
                    let (mut us, mut rows) = (Vec::new(), 0.0);
                    let t0 = Instant::now();
                    while t0.elapsed() < time {
                        let t = Instant::now();
                        let (status, reply) = client.post("/v1/jobs", body)?;
                        if status != 200 {
                            return Err(Error::InvalidArgument(format!("serve: status {status}")));
                        }
                        us.push(t.elapsed().as_secs_f64() * 1e6);
                        rows += field(&reply, "batch_rows")?;
                    }
                    Ok((us, rows))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| Error::WorkerPanicked("a serve client".into()))?
            })
            .collect::<Result<Vec<_>>>()
    })?;
    let mut us = Vec::new();
    let mut rows = 0.0;
    for (u, r) in per_client {
        us.extend(u);
        rows += r;
    }
    if us.is_empty() {
        return Err(Error::InvalidArgument("serve: no job finished".into()));
    }
    Ok((us, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_run_on_the_cpu_records_every_case() {
        let mut ctx = Ctx::new(&warpdrive::Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        assert!(rows.iter().any(|r| r.case == "submit"));
        for variant in ["warpdrive-batch-1", "warpdrive-dynamic"] {
            assert!(rows
                .iter()
                .any(|r| r.case == "load-1row" && r.variant == variant && r.size == 4));
        }
    }
}
