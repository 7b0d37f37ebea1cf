//! The `serve` suite against its Python peer at equal p99 (issue 37: ≥ 5× the peer's
//! throughput with 1-token requests, ≥ 1.5× with 256-token requests). Built from the rows
//! once the peer's are in: for each regime (`load-1row`, `load-256row`), the peer's point of
//! most jobs/s, and warpdrive's point of most jobs/s among those of the same case whose p99
//! is at most the peer's there (none: the one with the lowest p99, and the verdict says so).
//! Only warpdrive's rows with the peer's bodies count: not `warpdrive-dynamic-binary`'s
//! one-row jobs (binary tensors; the peer's one-row jobs are JSON).
//!
//! Row `vs-peer-1row` / `vs-peer-256row` (size = rows per job, variant `warpdrive`): median,
//! p10 and p90 are warpdrive's p99 at its point (µs); `extra.jobs_per_s`,
//! `extra.peer_jobs_per_s`, `extra.peer_p99_us`, `extra.ratio` (warpdrive's jobs/s over the
//! peer's), `extra.bar`, `extra.verdict` (`met`, `missed`, or `no-point` where no warpdrive
//! point of the case has a p99 at or under the peer's), and which variants and client counts
//! the two points are (`extra.warpdrive_variant`, `extra.peer_variant`, `extra.clients`,
//! `extra.peer_clients`).

use super::results::Row;
use super::stats::Stats;

/// (case, rows per job, the bar).
const REGIMES: [(&str, u64, f64); 2] = [("load-1row", 1, 5.0), ("load-256row", 256, 1.5)];

fn figure(row: &Row, key: &str) -> Option<f64> {
    row.extra
        .get(key)
        .and_then(|v| v.as_f64())
        .filter(|v| v.is_finite())
}

/// (jobs/s, p99 µs) of a load row.
fn point(row: &Row) -> Option<(f64, f64)> {
    Some((figure(row, "jobs_per_s")?, figure(row, "p99_us")?))
}

/// The comparison rows for `rows` (a run's rows, the peer's among them); none for a regime
/// the peer has no row of.
pub fn versus_peer(rows: &[Row]) -> Vec<Row> {
    let mut out = Vec::new();
    for (case, job_rows, bar) in REGIMES {
        let of_case = |peer: bool| {
            rows.iter().filter(move |r| {
                r.suite == super::serve::SUITE
                    && r.case == case
                    && r.variant.starts_with("torch-") == peer
                    && (peer
                        || (r.variant.starts_with("warpdrive")
                            && r.variant != super::serve::ONE_ROW_BINARY_VARIANT))
            })
        };
        let most = |a: &&Row, b: &&Row| {
            let (x, y) = (point(a).map_or(0.0, |p| p.0), point(b).map_or(0.0, |p| p.0));
            x.total_cmp(&y)
        };
        let Some(peer) = of_case(true).filter(|r| point(r).is_some()).max_by(most) else {
            continue;
        };
        let Some((peer_jobs, peer_p99)) = point(peer) else {
            continue;
        };
        let under = of_case(false)
            .filter(|r| point(r).is_some_and(|(_, p99)| p99 <= peer_p99))
            .max_by(most);
        // Where no point is under the peer's p99, the one nearest it (the lowest p99).
        let nearest = || {
            of_case(false)
                .filter(|r| point(r).is_some())
                .min_by(|a, b| {
                    let p99 = |r: &&Row| point(r).map_or(f64::INFINITY, |p| p.1);
                    p99(a).total_cmp(&p99(b))
                })
        };
        let Some(ours) = under.or_else(nearest) else {
            continue;
        };
        let Some((jobs, p99)) = point(ours) else {
            continue;
        };
        let verdict = match under {
            None => "no-point",
            Some(_) if jobs >= bar * peer_jobs => "met",
            Some(_) => "missed",
        };
        let stats = Stats {
            median: p99,
            p10: p99,
            p90: p99,
        };
        let name = format!("vs-peer-{}", case.trim_start_matches("load-"));
        let row = Row::new(super::serve::SUITE, name, job_rows, "warpdrive", stats)
            .with_extra("jobs_per_s", jobs)
            .with_extra("peer_jobs_per_s", peer_jobs)
            .with_extra("peer_p99_us", peer_p99)
            .with_extra("ratio", jobs / peer_jobs)
            .with_extra("bar", bar)
            .with_extra("verdict", verdict)
            .with_extra("peer_variant", peer.variant.as_str())
            .with_extra("peer_clients", peer.size as f64)
            .with_extra("warpdrive_variant", ours.variant.as_str())
            .with_extra("clients", ours.size as f64);
        out.push(row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(case: &str, variant: &str, clients: u64, jobs: f64, p99: f64) -> Row {
        let stats = Stats {
            median: 1.0,
            p10: 1.0,
            p90: 1.0,
        };
        Row::new("serve", case, clients, variant, stats)
            .with_extra("jobs_per_s", jobs)
            .with_extra("p99_us", p99)
    }

    #[test]
    fn warpdrive_is_read_at_the_peers_p99_and_a_regime_without_a_peer_is_left_out() {
        let rows = [
            load("load-1row", "torch-asyncio-dynamic", 32, 400.0, 90_000.0),
            load("load-1row", "torch-asyncio-batch-1", 32, 300.0, 120_000.0),
            // The most jobs/s, but past the peer's p99: not the point compared.
            load("load-1row", "warpdrive-dynamic", 32, 9000.0, 95_000.0),
            load("load-1row", "warpdrive-dynamic", 8, 2400.0, 10_000.0),
            load("load-1row", "warpdrive-batch-1", 8, 800.0, 20_000.0),
            // Under the peer's p99 with more jobs/s, but with binary bodies: not compared.
            load("load-1row", "warpdrive-dynamic-binary", 8, 5000.0, 9_000.0),
            load("load-256row", "warpdrive-dynamic", 8, 25.0, 400_000.0),
        ];
        let out = versus_peer(&rows);
        assert_eq!(out.len(), 1, "no peer row of load-256row");
        let r = &out[0];
        assert_eq!((r.case.as_str(), r.size), ("vs-peer-1row", 1));
        assert_eq!(r.median, 10_000.0);
        assert_eq!(r.extra["ratio"].as_f64(), Some(6.0));
        assert_eq!(r.extra["verdict"], "met");
        assert_eq!(r.extra["peer_variant"], "torch-asyncio-dynamic");
        assert_eq!(r.extra["clients"].as_f64(), Some(8.0));
    }

    #[test]
    fn no_warpdrive_point_under_the_peers_p99_says_so() {
        let rows = [
            load("load-256row", "torch-asyncio-dynamic", 8, 2.0, 1000.0),
            load("load-256row", "warpdrive-dynamic", 8, 25.0, 4000.0),
        ];
        let out = versus_peer(&rows);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].extra["verdict"], "no-point");
        assert_eq!(out[0].median, 4000.0, "the nearest point");
        assert_eq!(out[0].extra["bar"].as_f64(), Some(1.5));
    }
}
