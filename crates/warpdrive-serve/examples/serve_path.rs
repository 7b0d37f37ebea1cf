//! The request path's stage breakdown, with the [`Echo`] stand-in (no model in the way) at
//! the qwen3 layer's width: submission latency (headers → queued) of one-row jobs, and where
//! a 256-row job's time goes, JSON against the binary tensor body. What bench/NOTES.md's
//! breakdowns of the job service come from:
//! `cargo run --release -p warpdrive-serve --example serve_path [WIDTH]`.

use std::time::{Duration, Instant};

use warpdrive_serve::load::{self, Arrivals, LoadConfig};
use warpdrive_serve::wire::{self, Dtype, Format, JsonReply};
use warpdrive_serve::{Client, ClientConfig, Echo, JobSpec, ServeConfig, Server};

fn pct(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The median µs of `f` over `n` calls.
fn time_us(n: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    pct(&mut t, 0.5)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let width: usize = std::env::args()
        .nth(1)
        .map(|w| w.parse())
        .transpose()?
        .unwrap_or(2048);
    let server = Server::start(
        move || Ok(Box::new(Echo::new(width))),
        ServeConfig {
            addr: "127.0.0.1:0".parse()?,
            max_batch_rows: 256,
            max_delay: Duration::ZERO,
            ..ServeConfig::default()
        },
    )?;
    let formats = [
        ("json", Format::Json),
        ("binary", Format::Binary(Dtype::F32)),
    ];

    println!("submission (headers -> queued), one client, one-row jobs of {width} values:");
    for (name, format) in formats {
        let cfg = LoadConfig {
            rows: 1,
            max_jobs: Some(3000),
            threads: 1,
            format,
            ..LoadConfig::new(server.addr, Arrivals::Clients(1), Duration::from_secs(60))
        };
        load::run(&LoadConfig {
            max_jobs: Some(200),
            ..cfg.clone()
        })?;
        let mut r = load::run(&cfg)?;
        println!(
            "  {name:>6}: submit p50 {:.1} us, p99 {:.1} us; end to end p50 {:.1} us ({} jobs, {} failed)",
            pct(&mut r.submit_us, 0.5),
            pct(&mut r.submit_us, 0.99),
            pct(&mut r.latency_us, 0.5),
            r.answered(),
            r.failed()
        );
    }

    let rows = 256;
    let data: Vec<f32> = (0..rows * width)
        .map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    println!(
        "\n{rows}-row jobs ({} values), in-process stages (median µs):",
        data.len()
    );
    let json = wire::encode_json(rows, &data);
    let bin = wire::encode_binary(Dtype::F32, rows, &data).ok_or("encode")?;
    let reply = JsonReply {
        rows,
        data: data.clone(),
        batch_rows: rows,
        submit_us: 1.0,
        queue_us: 1.0,
        run_us: 1.0,
        accepted_unix_us: Some(1),
        replied_unix_us: Some(1),
    };
    let reply_json = serde_json::to_vec(&reply)?;
    println!(
        "  json:   body {} B; encode {:.0}, decode {:.0}, reply encode {:.0}, reply decode {:.0}",
        json.len(),
        time_us(10, || drop(wire::encode_json(rows, &data))),
        time_us(10, || drop(wire::decode(Format::Json, &json, width))),
        time_us(10, || drop(serde_json::to_vec(&reply))),
        time_us(10, || drop(serde_json::from_slice::<JsonReply>(
            &reply_json
        )))
    );
    println!(
        "  binary: body {} B; encode {:.0}, decode {:.0}",
        bin.len(),
        time_us(20, || drop(wire::encode_binary(Dtype::F32, rows, &data))),
        time_us(20, || drop(wire::decode(
            Format::Binary(Dtype::F32),
            &bin,
            width
        ))),
    );
    println!(
        "  copies: one memcpy of the rows {:.0}",
        time_us(20, || drop(std::hint::black_box(data.clone())))
    );

    println!("\n{rows}-row jobs through the service, one client, back to back (median µs):");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    for (name, format) in formats {
        let client = Client::new(
            server.addr,
            ClientConfig {
                format,
                ..ClientConfig::default()
            },
        );
        let job = JobSpec {
            rows,
            data: data.clone(),
            ..JobSpec::default()
        };
        let (mut e2e, mut submit, mut queue, mut run) = (vec![], vec![], vec![], vec![]);
        for k in 0..45 {
            let t0 = Instant::now();
            let r = rt.block_on(client.submit(&job))?;
            if k >= 5 {
                e2e.push(t0.elapsed().as_secs_f64() * 1e6);
                submit.push(r.submit_us);
                queue.push(r.queue_us);
                run.push(r.run_us);
            }
        }
        let (e, s, q, m) = (
            pct(&mut e2e, 0.5),
            pct(&mut submit, 0.5),
            pct(&mut queue, 0.5),
            pct(&mut run, 0.5),
        );
        println!(
            "  {name:>6}: end to end {e:.0}; submit (body, decode, queue) {s:.0}, queue {q:.0}, run {m:.0}, \
             the rest (client encode and send, headers, scatter, reply encode and send, client decode) {:.0}",
            e - s - q - m
        );
    }
    server.stop();
    Ok(())
}
