//! The derived figures of seed `001_*` that rows carry in `extra`, each a fraction (1 = the
//! ideal), computed here only:
//!
//! - `bandwidth_utilization`: achieved GB/s / the GB/s ceiling the row cites (the same
//!   ratio as `pct_of_ceiling` / 100). Set on every row that cites a bandwidth ceiling.
//! - `transfer_overhead`: transfer time left exposed / total time (0 = hidden entirely).
//! - `overlap_efficiency`: (Σ stage busy times − wall) / (Σ stage busy times − the slowest
//!   stage's): 1 when the wall time is the slowest stage's, 0 when the stages ran one after
//!   another. (The seed divides the overlap by the longest stage, which cannot reach 1
//!   unless the stages are balanced; this divides by the overlap that was possible.)
//! - `memory_efficiency`: useful bytes / bytes moved.
//!
//! A figure whose inputs are not positive and finite is left out.

use serde_json::Value;

use super::results::{aligned, num, row_key, Ceiling, Ceilings, Metric, Results, Row};

/// The derived figures, in the order tables show them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Derived {
    BandwidthUtilization,
    TransferOverhead,
    OverlapEfficiency,
    MemoryEfficiency,
}

impl Derived {
    pub const ALL: [Derived; 4] = [
        Derived::BandwidthUtilization,
        Derived::TransferOverhead,
        Derived::OverlapEfficiency,
        Derived::MemoryEfficiency,
    ];

    /// The key in a row's `extra`.
    pub fn key(self) -> &'static str {
        match self {
            Derived::BandwidthUtilization => "bandwidth_utilization",
            Derived::TransferOverhead => "transfer_overhead",
            Derived::OverlapEfficiency => "overlap_efficiency",
            Derived::MemoryEfficiency => "memory_efficiency",
        }
    }

    /// This figure of `row`, if it has it.
    pub fn of(self, row: &Row) -> Option<f64> {
        row.extra.get(self.key()).and_then(Value::as_f64)
    }
}

/// `num / den` when both are finite, `num ≥ 0` and `den > 0`.
fn ratio(num: f64, den: f64) -> Option<f64> {
    (num.is_finite() && den.is_finite() && num >= 0.0 && den > 0.0).then(|| num / den)
}

impl Row {
    fn set_derived(&mut self, d: Derived, value: Option<f64>) -> &mut Row {
        if let Some(v) = value {
            self.extra.insert(d.key().into(), v.into());
        }
        self
    }

    /// Sets `bandwidth_utilization` from `gbps` and `ceiling`'s measured value, when the
    /// ceiling is a bandwidth (called wherever a row cites a ceiling).
    pub(super) fn set_bandwidth_utilization(
        &mut self,
        ceiling: Ceiling,
        ceilings: &Ceilings,
    ) -> &mut Row {
        let value = match (ceiling.metric(), ceilings.get(ceiling)) {
            (Metric::Gbps, Some(limit)) => ceiling.percent(self, limit).map(|p| p / 100.0),
            _ => None,
        };
        self.set_derived(Derived::BandwidthUtilization, value)
    }

    /// Sets `transfer_overhead` = `transfer_s / total_s` (the transfer time left exposed, in
    /// the same unit as the total).
    pub fn set_transfer_overhead(&mut self, transfer_s: f64, total_s: f64) -> &mut Row {
        let value = ratio(transfer_s, total_s).map(|v| v.min(1.0));
        self.set_derived(Derived::TransferOverhead, value)
    }

    /// Sets `overlap_efficiency` from the busy time of each stage and the wall time of the
    /// whole (see the module docs); 1 when a single stage leaves nothing to overlap.
    pub fn set_overlap_efficiency(&mut self, stages_s: &[f64], wall_s: f64) -> &mut Row {
        let ok = wall_s.is_finite()
            && wall_s > 0.0
            && !stages_s.is_empty()
            && stages_s.iter().all(|s| s.is_finite() && *s >= 0.0);
        let value = ok.then(|| {
            let sum: f64 = stages_s.iter().sum();
            let max = stages_s.iter().copied().fold(0.0, f64::max);
            let possible = sum - max;
            if possible <= 0.0 {
                1.0
            } else {
                ((sum - wall_s) / possible).clamp(0.0, 1.0)
            }
        });
        self.set_derived(Derived::OverlapEfficiency, value)
    }

    /// Sets `memory_efficiency` = `useful_bytes / moved_bytes`.
    pub fn set_memory_efficiency(&mut self, useful_bytes: f64, moved_bytes: f64) -> &mut Row {
        self.set_derived(Derived::MemoryEfficiency, ratio(useful_bytes, moved_bytes))
    }
}

/// The rows with a derived figure beyond `bandwidth_utilization` (which `% ceiling` already
/// shows) as an aligned table headed `derived figures`; empty when there are none.
pub fn format_derived(results: &Results) -> String {
    let cells: Vec<Vec<String>> = results
        .rows
        .iter()
        .filter(|r| Derived::ALL[1..].iter().any(|d| d.of(r).is_some()))
        .map(|r| {
            let mut cells = row_key(r).to_vec();
            cells.extend(Derived::ALL.map(|d| num(d.of(r))));
            cells
        })
        .collect();
    if cells.is_empty() {
        return String::new();
    }
    let mut head = vec!["suite", "case", "size", "variant"];
    head.extend(Derived::ALL.map(Derived::key));
    format!("derived figures (fractions)\n{}", aligned(&head, &cells))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row::from_samples("s", "c", 1, "warpdrive", &mut [10.0]).unwrap()
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-12)
    }

    #[test]
    fn bandwidth_utilization_is_achieved_over_a_bandwidth_ceiling() {
        let ceilings = Ceilings {
            h2d_pinned_gbps: Some(50.0),
            launch_us: Some(2.0),
            ..Ceilings::default()
        };
        // 4e5 bytes in 10 µs = 40 GB/s of 50.
        let r = row().with_bytes(4e5).against(Ceiling::H2dPinned, &ceilings);
        assert!(close(Derived::BandwidthUtilization.of(&r), 0.8));
        assert!(close(r.pct_of_ceiling.map(|p| p / 100.0), 0.8));
        // A time ceiling, an unmeasured one, a row without GB/s: not a bandwidth figure.
        for r in [
            row().against(Ceiling::Launch, &ceilings),
            row().with_bytes(4e5).against(Ceiling::D2hPinned, &ceilings),
            row().against(Ceiling::H2dPinned, &ceilings),
        ] {
            assert_eq!(Derived::BandwidthUtilization.of(&r), None, "{r:?}");
        }
    }

    #[test]
    fn overlap_efficiency_spans_serial_to_perfect() {
        let mut r = row();
        // Stages 3 + 2 + 1 = 6 s; the slowest is 3 s.
        assert!(close(
            Derived::OverlapEfficiency.of(r.set_overlap_efficiency(&[3.0, 2.0, 1.0], 6.0)),
            0.0
        ));
        assert!(close(
            Derived::OverlapEfficiency.of(r.set_overlap_efficiency(&[3.0, 2.0, 1.0], 3.0)),
            1.0
        ));
        assert!(close(
            Derived::OverlapEfficiency.of(r.set_overlap_efficiency(&[3.0, 2.0, 1.0], 4.5)),
            0.5
        ));
        // Wall below the slowest stage (clock noise) clamps; one stage has nothing to hide.
        assert!(close(
            Derived::OverlapEfficiency.of(r.set_overlap_efficiency(&[3.0, 2.0], 2.0)),
            1.0
        ));
        assert!(close(
            Derived::OverlapEfficiency.of(r.set_overlap_efficiency(&[3.0], 5.0)),
            1.0
        ));
        let mut fresh = row();
        fresh.set_overlap_efficiency(&[1.0, f64::NAN], 1.0);
        fresh.set_overlap_efficiency(&[], 1.0);
        fresh.set_overlap_efficiency(&[1.0, 1.0], 0.0);
        assert_eq!(Derived::OverlapEfficiency.of(&fresh), None);
    }

    #[test]
    fn the_derived_table_lists_rows_with_figures_beyond_bandwidth() {
        let ceilings = Ceilings {
            h2d_pinned_gbps: Some(50.0),
            ..Ceilings::default()
        };
        let copy = row().with_bytes(4e5).against(Ceiling::H2dPinned, &ceilings);
        let mut pipe = Row::from_samples("s", "pipeline", 8, "streams-2", &mut [10.0]).unwrap();
        pipe.set_overlap_efficiency(&[1.0, 1.0], 1.5)
            .set_transfer_overhead(0.5, 1.5);
        let info = warpdrive::device::Device::cpu().info().unwrap();
        let mut results = Results::new(&info, ceilings, vec![copy]);
        assert_eq!(format_derived(&results), "");
        results.add_rows([pipe]);
        let text = format_derived(&results);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[1].contains("overlap_efficiency") && lines[1].contains("memory_efficiency"));
        assert!(lines[3].starts_with("s ") && lines[3].contains("pipeline"));
        assert!(
            lines[3].contains("0.500") && lines[3].contains("0.333"),
            "{text}"
        );
    }

    /// The transfer and kernels suites on the CPU backend, citing made-up GPU ceilings (the
    /// CPU backend measures none): their rows carry the figures where they apply.
    #[test]
    fn suite_rows_carry_the_derived_figures() {
        use crate::{find_suite, Ctx, Scale};
        let mut ctx = Ctx::new(&warpdrive::device::Device::cpu(), Scale::Tiny).unwrap();
        ctx.set_ceilings(Ceilings {
            h2d_pinned_gbps: Some(50.0),
            d2h_pinned_gbps: Some(50.0),
            d2d_copy_gbps: Some(1000.0),
            host_memcpy_gbps: Some(10.0),
            ..Ceilings::default()
        });
        for suite in ["transfer", "kernels"] {
            ctx.suite = find_suite(suite).unwrap().name;
            (find_suite(suite).unwrap().run)(&mut ctx).unwrap();
        }
        let rows = ctx.rows();
        let find = |case: &str, variant: &str| -> &Row {
            rows.iter()
                .find(|r| r.case == case && r.variant == variant)
                .unwrap_or_else(|| panic!("{case} {variant} missing"))
        };
        let in_unit = |v: Option<f64>| v.is_some_and(|v| (0.0..=1.0).contains(&v));
        // Every row citing a bandwidth ceiling: GB/s / ceiling.
        for r in rows
            .iter()
            .filter(|r| r.named_ceiling().is_some_and(|c| c.unit() == "GB/s"))
        {
            let got = Derived::BandwidthUtilization.of(r).unwrap();
            let c = r.named_ceiling().unwrap();
            let want = r.gbps.unwrap() / ctx.ceilings().get(c).unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "{} {}",
                r.case,
                r.variant
            );
        }
        for (case, variant) in [
            ("host-copy-rate", "memcpy"),
            ("scale-1MiB", "warpdrive"),
            ("sum-1MiB", "warpdrive-scalar"),
        ] {
            assert!(
                Derived::BandwidthUtilization
                    .of(find(case, variant))
                    .is_some(),
                "{case} {variant}"
            );
        }
        // On the CPU backend h2d and d2h are host memcpys small enough for the caches: no
        // ceiling bounds them, and they say so.
        for variant in ["driver-pageable", "warpdrive"] {
            let r = find("h2d", variant);
            assert_eq!(r.named_ceiling(), None, "{r:?}");
            assert!(r.extra.contains_key("unbounded"), "{r:?}");
            assert_eq!(Derived::BandwidthUtilization.of(r), None);
        }
        for streams in 1..=3 {
            let r = find("pipeline", &format!("streams-{streams}"));
            assert!(in_unit(Derived::OverlapEfficiency.of(r)), "{r:?}");
        }
        // 1000 slices of 4 KiB and an offsets table of 1001 u64.
        let coalesced = find("coalesce-1000x4KiB", "warpdrive");
        let want = 4096e3 / (4096e3 + 1001.0 * 8.0);
        assert!((Derived::MemoryEfficiency.of(coalesced).unwrap() - want).abs() < 1e-12);
    }

    #[test]
    fn transfer_overhead_and_memory_efficiency_are_plain_ratios() {
        let mut r = row();
        r.set_transfer_overhead(1.0, 4.0)
            .set_memory_efficiency(4096.0, 4104.0);
        assert!(close(Derived::TransferOverhead.of(&r), 0.25));
        assert!(close(Derived::MemoryEfficiency.of(&r), 4096.0 / 4104.0));
        // Exposed transfer longer than the total (clock noise) is all of it.
        r.set_transfer_overhead(5.0, 4.0);
        assert!(close(Derived::TransferOverhead.of(&r), 1.0));
        let mut fresh = row();
        fresh
            .set_transfer_overhead(1.0, 0.0)
            .set_memory_efficiency(-1.0, 4.0)
            .set_memory_efficiency(1.0, f64::INFINITY);
        assert_eq!(Derived::TransferOverhead.of(&fresh), None);
        assert_eq!(Derived::MemoryEfficiency.of(&fresh), None);
    }
}
