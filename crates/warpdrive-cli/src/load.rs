//! `warpdrive load`: the load generator of `warpdrive-serve` against a running service, and
//! its summary (percentiles by `warpdrive-bench`'s interpolation, as the bench rows).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use warpdrive_bench::percentile;
use warpdrive_serve::load::{self, Arrivals, LoadConfig, LoadReport};
use warpdrive_serve::wire::{Dtype, Format};

use crate::flags::LoadArgs;

pub(crate) fn load(args: &LoadArgs) -> Result<()> {
    for (name, v) in [("--seconds", args.seconds), ("--timeout", args.timeout)] {
        if !(v.is_finite() && v > 0.0 && v < 1e7) {
            bail!("{name} {v}: expected more than 0");
        }
    }
    if !(args.warmup.is_finite() && (0.0..1e7).contains(&args.warmup)) {
        bail!("--warmup {}: expected 0 or more seconds", args.warmup);
    }
    let arrivals = match (args.rate, args.clients) {
        (Some(r), _) if !(r.is_finite() && r > 0.0) => bail!("--rate {r}: expected more than 0"),
        (Some(r), _) => Arrivals::Poisson { per_s: r },
        (None, c) => Arrivals::Clients(c.unwrap_or(1) as usize),
    };
    let format = match args.format.as_str() {
        "f32" => Format::Binary(Dtype::F32),
        "bf16" => Format::Binary(Dtype::Bf16),
        _ => Format::Json,
    };
    let config = LoadConfig {
        rows: args.rows as usize,
        max_jobs: args.jobs,
        connections: args.connections as usize,
        timeout: Duration::from_secs_f64(args.timeout),
        format,
        priority: args.priority,
        tenant: args.tenant.clone(),
        threads: args
            .threads
            .map_or_else(load::default_threads, |n| n as usize),
        event_interval: args
            .event_interval
            .unwrap_or(warpdrive_serve::DEFAULT_EVENT_INTERVAL),
        warmup: Duration::from_secs_f64(args.warmup),
        ..LoadConfig::new(args.addr, arrivals, Duration::from_secs_f64(args.seconds))
    };
    let report = load::run(&config)?;
    print!("{}", summary(&report));
    if let Some(path) = &args.jobs_csv {
        std::fs::write(path, jobs_csv(&report, args.jobs_csv_min_us))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if report.answered() == 0 {
        bail!(
            "no job was answered: {}",
            report.first_failure.as_deref().unwrap_or("none was sent")
        );
    }
    Ok(())
}

/// One line per answered job that took at least `min_latency_us`: when it was due or sent
/// (s), its latency, the generator's lag, the client's wait for a connection, the service's
/// submission, queue and run, and the two legs between the processes by the host's wall
/// clock: `to_service_us` (the generator handing the request to its connection → the
/// service accepting its headers) and `from_service_us` (the service handing the reply to
/// hyper → the generator having read it), then `pace_us` (the part of `lag_us` before the
/// pacing thread handed the job to the generator's runtime), all µs.
fn jobs_csv(r: &LoadReport, min_latency_us: f64) -> String {
    let mut out = String::from(
        "sent_s,latency_us,lag_us,connect_us,submit_us,queue_us,run_us,to_service_us,from_service_us,pace_us\n",
    );
    for i in 0..r.latency_us.len() {
        if r.latency_us[i] < min_latency_us {
            continue;
        }
        let at = |v: &[f64]| v.get(i).copied().unwrap_or(f64::NAN);
        out += &format!(
            "{:.6},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1}\n",
            at(&r.sent_at_s),
            r.latency_us[i],
            at(&r.lag_us),
            at(&r.connect_us),
            at(&r.submit_us),
            at(&r.queue_us),
            at(&r.run_us),
            at(&r.to_service_us),
            at(&r.from_service_us),
            at(&r.pace_us)
        );
    }
    out
}

/// Generator stalls printed at most (the rest are counted).
const MAX_STALL_LINES: usize = 40;

/// The report in a few lines: jobs, throughput, latency percentiles, the generator's
/// stalls, failures by kind.
fn summary(r: &LoadReport) -> String {
    let pct = |v: &[f64], q: f64| {
        if v.is_empty() {
            "-".to_string()
        } else {
            format!("{:.0}", percentile(v, q))
        }
    };
    let mut out = String::new();
    let offered = r
        .offered_per_s
        .map_or(String::new(), |o| format!(" (offered {o:.1} jobs/s)"));
    out += &format!(
        "jobs: {} sent, {} answered, {} failed in {:.2} s{offered}\n",
        r.sent,
        r.answered(),
        r.failed(),
        r.elapsed.as_secs_f64()
    );
    out += &format!(
        "throughput: {:.1} jobs/s, {:.2} rows a batch on average\n",
        r.jobs_per_s(),
        r.mean_batch_rows()
    );
    let l = &r.latency_us;
    out += &format!(
        "latency µs: p50 {} p90 {} p99 {} p99.9 {} max {}\n",
        pct(l, 0.5),
        pct(l, 0.9),
        pct(l, 0.99),
        pct(l, 0.999),
        pct(l, 1.0)
    );
    let s = &r.submit_us;
    out += &format!(
        "submission µs (service side): p50 {} p99 {}\n",
        pct(s, 0.5),
        pct(s, 0.99)
    );
    if r.started_unix_us > 0 {
        out += &format!(
            "started at unix {:.6} s (sent_s in --jobs-csv counts from here)\n",
            r.started_unix_us as f64 * 1e-6
        );
    }
    // The generator's own stalls (its probes: a thread, and a task on its runtime), each
    // with when it ended, as sent_s counts, to line up with the slow jobs.
    out += &stall_lines(r, "generator stall", "the run");
    if !r.failures.is_empty() {
        let kinds: Vec<String> = r
            .failures
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        out += &format!("failures: {}\n", kinds.join(", "));
        if let Some(f) = &r.first_failure {
            out += &format!("first failure: {f}\n");
        }
    }
    // The warm-up last, so the run's lines read as they did without one: a fresh process's
    // once-a-run stall shows here instead of above when a warm-up takes it.
    if let Some(w) = &r.warmup {
        out += &format!(
            "warm-up (not counted): {} sent, {} answered, {} failed in {:.2} s; latency µs p99 {} max {}\n",
            w.sent,
            w.answered(),
            w.failed(),
            w.elapsed.as_secs_f64(),
            pct(&w.latency_us, 0.99),
            pct(&w.latency_us, 1.0)
        );
        out += &stall_lines(w, "warm-up stall", "the warm-up");
    }
    out
}

/// A line for each of `r`'s stalls (at most `MAX_STALL_LINES`, then a count), with when it
/// ended, counted from `r`'s start, and the threads a runtime stall found.
fn stall_lines(r: &LoadReport, what: &str, of: &str) -> String {
    let mut out = String::new();
    for s in r.stalls.iter().take(MAX_STALL_LINES) {
        let ended = s.until_unix_us.saturating_sub(r.started_unix_us) as f64 * 1e-6;
        out += &format!(
            "{what} ({}): {:.1} ms, ended {ended:.4} s into {of}\n",
            s.probe.name(),
            s.gap_us * 1e-3
        );
        // The generator's threads as the runtime stall found them (name/tid state wchan
        // syscall cpu).
        if let Some(t) = &s.threads {
            out += &format!("  threads: {t}\n");
        }
    }
    if r.stalls.len() > MAX_STALL_LINES {
        out += &format!("{what}s: {} more\n", r.stalls.len() - MAX_STALL_LINES);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive_serve::probe::{Stall, Where};

    #[test]
    fn the_summary_names_percentiles_and_failures() {
        let mut r = LoadReport {
            latency_us: (1..=1000).map(f64::from).collect(),
            sent: 1003,
            elapsed: Duration::from_secs(2),
            ..LoadReport::default()
        };
        r.failures.insert("503".into(), 3);
        r.first_failure = Some("status 503: the queue is full".into());
        r.started_unix_us = 1_795_762_280_000_000;
        r.stalls.push(Stall {
            probe: Where::Runtime,
            until_unix_us: 1_795_762_281_512_300,
            gap_us: 8_250.0,
            threads: Some("warpdrive-load/7 S futex_wait_queue sys=202 cpu=1".into()),
        });
        let s = summary(&r);
        assert!(s.contains("1003 sent, 1000 answered, 3 failed"), "{s}");
        assert!(s.contains("started at unix 1795762280.000000 s"), "{s}");
        assert!(
            s.contains("generator stall (runtime): 8.2 ms, ended 1.5123 s into the run"),
            "{s}"
        );
        assert!(
            s.contains("  threads: warpdrive-load/7 S futex_wait_queue sys=202 cpu=1\n"),
            "{s}"
        );
        // Missing per-job figures are written as NaN, not dropped or misaligned.
        let csv = jobs_csv(&r, 0.0);
        assert_eq!(csv.lines().count(), 1001);
        assert_eq!(
            csv.lines().nth(2),
            Some("NaN,2.0,NaN,NaN,NaN,NaN,NaN,NaN,NaN,NaN")
        );
        // Only the slow ones, each still on its own figures.
        let slow = jobs_csv(&r, 990.0);
        assert_eq!(slow.lines().count(), 12);
        assert_eq!(
            slow.lines().nth(1),
            Some("NaN,990.0,NaN,NaN,NaN,NaN,NaN,NaN,NaN,NaN")
        );
        assert!(s.contains("500.0 jobs/s"), "{s}");
        assert!(s.contains("p99 990"), "{s}");
        assert!(s.contains("503: 3"), "{s}");
        assert!(!s.contains("warm-up"), "{s}");
        // A warm-up's lines come after the run's, its stalls counted from its own start.
        let mut w = LoadReport {
            latency_us: vec![100.0, 9000.0],
            sent: 2,
            elapsed: Duration::from_secs(1),
            started_unix_us: 1_795_762_270_000_000,
            ..LoadReport::default()
        };
        w.stalls.push(Stall {
            probe: Where::Runtime,
            until_unix_us: 1_795_762_270_250_000,
            gap_us: 14_000.0,
            threads: None,
        });
        r.warmup = Some(Box::new(w));
        let s = summary(&r);
        let warm = s.find("warm-up (not counted): 2 sent, 2 answered, 0 failed in 1.00 s; latency µs p99 8911 max 9000\n");
        assert!(warm > s.find("first failure"), "{s}");
        assert!(
            s.contains("warm-up stall (runtime): 14.0 ms, ended 0.2500 s into the warm-up\n"),
            "{s}"
        );
    }
}
