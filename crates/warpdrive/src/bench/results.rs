//! The results file (`schema: "warpdrive-bench/1"`, see `BENCH.md`): rows, ceilings, the
//! device record, the date, and the plain-text table.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::device::DeviceInfo;
use crate::error::{Error, Result};

use super::stats::Stats;

/// The `schema` value of every results file this version writes.
pub const SCHEMA: &str = "warpdrive-bench/1";

/// One measured case: a time per operation in µs, with derived throughputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub suite: String,
    pub case: String,
    /// The case's main size (bytes, tokens, elements or threads: the suite says which).
    pub size: u64,
    /// `baseline`, `warpdrive[-...]`, `ceiling`, `driver-...`, `torch-...`, `cupy-...`.
    pub variant: String,
    /// Median time of one operation, µs.
    pub median: f64,
    /// 10th percentile time, µs.
    pub p10: f64,
    /// 90th percentile time, µs.
    pub p90: f64,
    /// Always `"us"`.
    #[serde(default = "default_unit")]
    pub unit: String,
    /// Bytes moved per operation / median time, GB/s (10⁹ bytes per second).
    #[serde(default)]
    pub gbps: Option<f64>,
    /// Floating-point operations per operation / median time, TFLOP/s.
    #[serde(default)]
    pub tflops: Option<f64>,
    /// Achieved / the ceiling that bounds the case × 100; `extra.ceiling` names the key.
    #[serde(default)]
    pub pct_of_ceiling: Option<f64>,
    /// Everything else (`ceiling`, `threads`, the derived figures of
    /// [`Derived`](super::Derived), ...).
    #[serde(default)]
    pub extra: Map<String, Value>,
}

fn default_unit() -> String {
    "us".into()
}

impl Row {
    /// A row with these statistics and no derived figures yet.
    pub fn new(
        suite: impl Into<String>,
        case: impl Into<String>,
        size: u64,
        variant: impl Into<String>,
        stats: Stats,
    ) -> Row {
        Row {
            suite: suite.into(),
            case: case.into(),
            size,
            variant: variant.into(),
            median: stats.median,
            p10: stats.p10,
            p90: stats.p90,
            unit: default_unit(),
            gbps: None,
            tflops: None,
            pct_of_ceiling: None,
            extra: Map::new(),
        }
    }

    /// A row from timing samples in µs (sorted in place; see [`Stats::from_samples`]).
    pub fn from_samples(
        suite: impl Into<String>,
        case: impl Into<String>,
        size: u64,
        variant: impl Into<String>,
        samples_us: &mut [f64],
    ) -> Result<Row> {
        Ok(Row::new(
            suite,
            case,
            size,
            variant,
            Stats::from_samples(samples_us)?,
        ))
    }

    /// Sets `gbps` from the bytes one operation moves (as the case counts them).
    pub fn with_bytes(mut self, bytes: f64) -> Row {
        // bytes / (median µs · 1e-6 s) / 1e9
        self.gbps = per_median(bytes, self.median, 1e3);
        self
    }

    /// Sets `tflops` from the floating-point operations of one operation.
    pub fn with_flops(mut self, flops: f64) -> Row {
        // flops / (median µs · 1e-6 s) / 1e12
        self.tflops = per_median(flops, self.median, 1e6);
        self
    }

    /// Adds `extra[key] = value`.
    pub fn with_extra(mut self, key: &str, value: impl Into<Value>) -> Row {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    /// Sets `pct_of_ceiling` against `ceiling` and names it in `extra.ceiling`, when that
    /// ceiling was measured and this row has the figure it bounds; otherwise leaves both.
    pub fn against(mut self, ceiling: Ceiling, ceilings: &Ceilings) -> Row {
        self.apply_ceiling(ceiling, ceilings);
        self
    }

    fn apply_ceiling(&mut self, ceiling: Ceiling, ceilings: &Ceilings) {
        if let Some(pct) = ceilings.get(ceiling).and_then(|c| ceiling.percent(self, c)) {
            self.pct_of_ceiling = Some(pct);
            self.extra
                .insert("ceiling".into(), Value::String(ceiling.key().into()));
            self.set_bandwidth_utilization(ceiling, ceilings);
        }
    }

    /// The ceiling `extra.ceiling` names, if it names a known one.
    pub fn named_ceiling(&self) -> Option<Ceiling> {
        self.extra
            .get("ceiling")
            .and_then(Value::as_str)
            .and_then(Ceiling::from_key)
    }
}

/// `work / (median_us · 1e-6) / (scale · 1e6)`, or `None` for a non-positive time.
fn per_median(work: f64, median_us: f64, scale: f64) -> Option<f64> {
    let v = work / (median_us * scale);
    (median_us > 0.0 && v.is_finite()).then_some(v)
}

/// What a ceiling is measured in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// GB/s; a row's `gbps` is compared with it.
    Gbps,
    /// TFLOP/s; a row's `tflops`.
    Tflops,
    /// GFLOP/s; a row's `tflops` × 1000.
    Gflops,
    /// µs per operation, a lower bound; a row's `median` (pct = ceiling / median × 100).
    Us,
}

/// One of the machine's measured limits (the keys of `ceilings` in a results file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ceiling {
    H2dPinned,
    D2hPinned,
    H2dPageable,
    D2hPageable,
    D2dCopy,
    GemmBf16,
    Launch,
    LaunchSync,
    HostMemcpy,
    CpuGemmF32,
}

impl Ceiling {
    /// Every ceiling, in file order.
    pub const ALL: [Ceiling; 10] = [
        Ceiling::H2dPinned,
        Ceiling::D2hPinned,
        Ceiling::H2dPageable,
        Ceiling::D2hPageable,
        Ceiling::D2dCopy,
        Ceiling::GemmBf16,
        Ceiling::Launch,
        Ceiling::LaunchSync,
        Ceiling::HostMemcpy,
        Ceiling::CpuGemmF32,
    ];

    /// The key in `ceilings` (`h2d_pinned_gbps`, ...).
    pub fn key(self) -> &'static str {
        match self {
            Ceiling::H2dPinned => "h2d_pinned_gbps",
            Ceiling::D2hPinned => "d2h_pinned_gbps",
            Ceiling::H2dPageable => "h2d_pageable_gbps",
            Ceiling::D2hPageable => "d2h_pageable_gbps",
            Ceiling::D2dCopy => "d2d_copy_gbps",
            Ceiling::GemmBf16 => "gemm_bf16_tflops",
            Ceiling::Launch => "launch_us",
            Ceiling::LaunchSync => "launch_sync_us",
            Ceiling::HostMemcpy => "host_memcpy_gbps",
            Ceiling::CpuGemmF32 => "cpu_gemm_f32_gflops",
        }
    }

    /// The case name of the `ceilings` suite's row for it: the key without its unit.
    pub fn case(self) -> &'static str {
        match self {
            Ceiling::H2dPinned => "h2d_pinned",
            Ceiling::D2hPinned => "d2h_pinned",
            Ceiling::H2dPageable => "h2d_pageable",
            Ceiling::D2hPageable => "d2h_pageable",
            Ceiling::D2dCopy => "d2d_copy",
            Ceiling::GemmBf16 => "gemm_bf16",
            Ceiling::Launch => "launch",
            Ceiling::LaunchSync => "launch_sync",
            Ceiling::HostMemcpy => "host_memcpy",
            Ceiling::CpuGemmF32 => "cpu_gemm_f32",
        }
    }

    /// The ceiling with this key.
    pub fn from_key(key: &str) -> Option<Ceiling> {
        Ceiling::ALL.into_iter().find(|c| c.key() == key)
    }

    pub fn metric(self) -> Metric {
        match self {
            Ceiling::GemmBf16 => Metric::Tflops,
            Ceiling::CpuGemmF32 => Metric::Gflops,
            Ceiling::Launch | Ceiling::LaunchSync => Metric::Us,
            _ => Metric::Gbps,
        }
    }

    /// True for the limits of a GPU (null on the CPU backend).
    pub fn is_gpu(self) -> bool {
        !matches!(self, Ceiling::HostMemcpy | Ceiling::CpuGemmF32)
    }

    /// The unit for display (`GB/s`, `TFLOP/s`, `GFLOP/s`, `us`).
    pub fn unit(self) -> &'static str {
        match self.metric() {
            Metric::Gbps => "GB/s",
            Metric::Tflops => "TFLOP/s",
            Metric::Gflops => "GFLOP/s",
            Metric::Us => "us",
        }
    }

    /// The figure of `row` this ceiling bounds, in the ceiling's unit.
    pub fn achieved(self, row: &Row) -> Option<f64> {
        match self.metric() {
            Metric::Gbps => row.gbps,
            Metric::Tflops => row.tflops,
            Metric::Gflops => row.tflops.map(|t| t * 1e3),
            Metric::Us => Some(row.median),
        }
    }

    /// `row`'s figure as a percentage of `value` (this ceiling's measured value).
    pub fn percent(self, row: &Row, value: f64) -> Option<f64> {
        let achieved = self.achieved(row)?;
        if !(value > 0.0 && achieved > 0.0 && value.is_finite() && achieved.is_finite()) {
            return None;
        }
        Some(match self.metric() {
            Metric::Us => value / achieved * 100.0,
            _ => achieved / value * 100.0,
        })
    }

    /// True when `a` is a better figure than `b` for this ceiling (higher throughput, lower
    /// time).
    pub fn better(self, a: f64, b: f64) -> bool {
        match self.metric() {
            Metric::Us => a < b,
            _ => a > b,
        }
    }
}

/// The machine's limits, measured in the same invocation (`warpdrive doctor`). `None` is
/// written as `null`: not measured (a GPU key on the CPU backend) or failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    pub h2d_pinned_gbps: Option<f64>,
    pub d2h_pinned_gbps: Option<f64>,
    pub h2d_pageable_gbps: Option<f64>,
    pub d2h_pageable_gbps: Option<f64>,
    /// Device-to-device copy, counting bytes read + written.
    pub d2d_copy_gbps: Option<f64>,
    pub gemm_bf16_tflops: Option<f64>,
    /// µs per empty-kernel launch, launched back to back.
    pub launch_us: Option<f64>,
    /// µs per empty-kernel launch + stream synchronise round trip.
    pub launch_sync_us: Option<f64>,
    /// Host memcpy, counting bytes copied once (not read + write).
    pub host_memcpy_gbps: Option<f64>,
    pub cpu_gemm_f32_gflops: Option<f64>,
}

impl Ceilings {
    pub fn get(&self, c: Ceiling) -> Option<f64> {
        *self.slot(c)
    }

    pub fn set(&mut self, c: Ceiling, value: Option<f64>) {
        *self.slot_mut(c) = value;
    }

    fn slot(&self, c: Ceiling) -> &Option<f64> {
        match c {
            Ceiling::H2dPinned => &self.h2d_pinned_gbps,
            Ceiling::D2hPinned => &self.d2h_pinned_gbps,
            Ceiling::H2dPageable => &self.h2d_pageable_gbps,
            Ceiling::D2hPageable => &self.d2h_pageable_gbps,
            Ceiling::D2dCopy => &self.d2d_copy_gbps,
            Ceiling::GemmBf16 => &self.gemm_bf16_tflops,
            Ceiling::Launch => &self.launch_us,
            Ceiling::LaunchSync => &self.launch_sync_us,
            Ceiling::HostMemcpy => &self.host_memcpy_gbps,
            Ceiling::CpuGemmF32 => &self.cpu_gemm_f32_gflops,
        }
    }

    fn slot_mut(&mut self, c: Ceiling) -> &mut Option<f64> {
        match c {
            Ceiling::H2dPinned => &mut self.h2d_pinned_gbps,
            Ceiling::D2hPinned => &mut self.d2h_pinned_gbps,
            Ceiling::H2dPageable => &mut self.h2d_pageable_gbps,
            Ceiling::D2hPageable => &mut self.d2h_pageable_gbps,
            Ceiling::D2dCopy => &mut self.d2d_copy_gbps,
            Ceiling::GemmBf16 => &mut self.gemm_bf16_tflops,
            Ceiling::Launch => &mut self.launch_us,
            Ceiling::LaunchSync => &mut self.launch_sync_us,
            Ceiling::HostMemcpy => &mut self.host_memcpy_gbps,
            Ceiling::CpuGemmF32 => &mut self.cpu_gemm_f32_gflops,
        }
    }
}

/// The `device` object of a results file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// `cuda` or `cpu`.
    pub backend: String,
    pub name: String,
    pub compute_capability: Option<String>,
    pub sms: Option<u32>,
    pub memory_bytes: u64,
    pub driver: Option<String>,
    pub cuda: Option<String>,
    /// "gen5 x16".
    pub pcie: Option<String>,
    pub numa_node: Option<i32>,
}

impl DeviceRecord {
    pub fn from_info(info: &DeviceInfo) -> DeviceRecord {
        DeviceRecord {
            backend: info.backend.to_string(),
            name: info.name.clone(),
            compute_capability: info.compute_capability.clone(),
            sms: info.sms,
            memory_bytes: info.memory_total,
            driver: info.driver.clone(),
            cuda: info.cuda.clone(),
            pcie: info.pcie(),
            numa_node: info.numa_node,
        }
    }
}

/// A whole results file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// [`SCHEMA`].
    pub schema: String,
    /// UTC, RFC 3339, whole seconds (`2026-11-22T03:00:00Z`).
    pub date: String,
    /// [`crate::GIT_REV`] of the build that ran.
    pub git_rev: String,
    pub device: DeviceRecord,
    pub ceilings: Ceilings,
    pub rows: Vec<Row>,
}

impl Results {
    /// Results dated now, for the device `info` describes.
    pub fn new(info: &DeviceInfo, ceilings: Ceilings, rows: Vec<Row>) -> Results {
        Results {
            schema: SCHEMA.into(),
            date: now_rfc3339(),
            git_rev: crate::GIT_REV.into(),
            device: DeviceRecord::from_info(info),
            ceilings,
            rows,
        }
    }

    /// Appends rows (e.g. a peer's), filling `pct_of_ceiling` (and `bandwidth_utilization`)
    /// of each row that names a ceiling in `extra.ceiling` but has no percentage yet, from
    /// this file's ceilings.
    pub fn add_rows(&mut self, rows: impl IntoIterator<Item = Row>) {
        for mut row in rows {
            if row.pct_of_ceiling.is_none() {
                if let Some(c) = row.named_ceiling() {
                    if let Some(pct) = self.ceilings.get(c).and_then(|v| c.percent(&row, v)) {
                        row.pct_of_ceiling = Some(pct);
                        row.set_bandwidth_utilization(c, &self.ceilings);
                    }
                }
            }
            self.rows.push(row);
        }
    }

    /// The file's text: pretty-printed JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("results do not serialise to JSON: {e}")))
    }

    /// Parses a results file's text; fails on another schema.
    pub fn from_json(text: &str) -> Result<Results> {
        let results: Results = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("not a results file: {e}")))?;
        if results.schema != SCHEMA {
            return Err(Error::Unsupported(format!(
                "results schema {:?} (this build reads {SCHEMA:?})",
                results.schema
            )));
        }
        Ok(results)
    }

    /// Writes the file atomically (a temporary file beside it renamed into place, see
    /// [`crate::files::write_atomic`]), creating missing parent folders; on failure the file
    /// that was there is left whole.
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut text = self.to_json()?;
        text.push('\n');
        crate::files::write_atomic(path.as_ref(), text.as_bytes())
    }

    /// Reads a file written by [`Results::write_json`].
    pub fn read_json(path: impl AsRef<Path>) -> Result<Results> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Results::from_json(&text)
    }
}

// ---- date ----

/// The current UTC time as RFC 3339 with whole seconds (`2026-11-22T03:00:00Z`).
pub fn now_rfc3339() -> String {
    let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_secs()).unwrap_or(i64::MAX),
    };
    rfc3339_utc(secs)
}

/// Seconds since the Unix epoch as a UTC RFC 3339 timestamp (`1970-01-01T00:00:00Z`).
pub fn rfc3339_utc(unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs_of_day / 3600,
        secs_of_day % 3600 / 60,
        secs_of_day % 60
    )
}

/// Proleptic Gregorian (year, month, day) of `days` since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`: 400-year eras of 146 097 days, years starting in March).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days.saturating_add(719_468);
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let d = doy - (153 * mp + 2) / 5 + 1; // [1, 31]
    let m = if mp < 10 { mp + 3 } else { mp - 9 }; // [1, 12]
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

// ---- table ----

/// A number for the table: about four significant digits, `-` for none.
pub(super) fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if !v.is_finite() => "-".into(),
        Some(v) => {
            let a = v.abs();
            if a >= 1000.0 {
                format!("{v:.0}")
            } else if a >= 100.0 {
                format!("{v:.1}")
            } else if a >= 1.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.3}")
            }
        }
    }
}

/// The first four columns of a row in a table: suite, case, size, variant.
pub(super) fn row_key(r: &Row) -> [String; 4] {
    [
        r.suite.clone(),
        r.case.clone(),
        r.size.to_string(),
        r.variant.clone(),
    ]
}

/// `head` and `cells` as an aligned table: the text columns (suite, case, variant: 0, 1,
/// 3) left-aligned, the others right-aligned, a rule under the head.
pub(super) fn aligned(head: &[&str], cells: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for row in cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cols: &mut dyn Iterator<Item = &str>| -> String {
        let parts: Vec<String> = cols
            .zip(&width)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i == 0 || i == 1 || i == 3 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(&mut head.iter().copied());
    out.push('\n');
    let rule: Vec<String> = width.iter().map(|&w| "-".repeat(w)).collect();
    out.push_str(&rule.join("  "));
    out.push('\n');
    for row in cells {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// The rows as a plain aligned table (text columns left-aligned, numbers right-aligned).
pub fn format_table(results: &Results) -> String {
    const HEAD: [&str; 10] = [
        "suite",
        "case",
        "size",
        "variant",
        "median us",
        "p10 us",
        "p90 us",
        "GB/s",
        "TFLOP/s",
        "% ceiling",
    ];
    let cells: Vec<Vec<String>> = results
        .rows
        .iter()
        .map(|r| {
            let mut cells = row_key(r).to_vec();
            cells.extend(
                [
                    Some(r.median),
                    Some(r.p10),
                    Some(r.p90),
                    r.gbps,
                    r.tflops,
                    r.pct_of_ceiling,
                ]
                .map(num),
            );
            cells
        })
        .collect();
    aligned(&HEAD, &cells)
}

/// The ceilings, one per line: key, value and unit (`null` where not measured).
pub fn format_ceilings(ceilings: &Ceilings) -> String {
    let width = Ceiling::ALL
        .iter()
        .map(|c| c.key().len())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for c in Ceiling::ALL {
        let value = match ceilings.get(c) {
            Some(v) => format!("{:>10} {}", num(Some(v)), c.unit()),
            None => format!("{:>10}", "null"),
        };
        out.push_str(&format!("{:<width$}  {value}\n", c.key()));
    }
    out
}

/// Prints [`format_table`] on stdout, then [`format_derived`](super::format_derived) when
/// some row has those figures.
pub fn print_table(results: &Results) {
    print!("{}", format_table(results));
    let derived = super::format_derived(results);
    if !derived.is_empty() {
        print!("\n{derived}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn keys(v: &Value) -> BTreeSet<String> {
        v.as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Equal up to float parsing (serde_json's default parser may differ in the last ulp).
    fn same(a: &Results, b: &Results) {
        fn close(a: &Value, b: &Value) -> bool {
            match (a, b) {
                (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
                    (Some(x), Some(y)) => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
                    _ => x == y,
                },
                (Value::Array(x), Value::Array(y)) => {
                    x.len() == y.len() && x.iter().zip(y).all(|(x, y)| close(x, y))
                }
                (Value::Object(x), Value::Object(y)) => {
                    x.len() == y.len()
                        && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
                }
                _ => a == b,
            }
        }
        let (va, vb) = (
            serde_json::to_value(a).unwrap(),
            serde_json::to_value(b).unwrap(),
        );
        assert!(close(&va, &vb), "{va:#}\n!=\n{vb:#}");
    }

    fn sample_results() -> Results {
        let info = crate::Device::cpu().info().unwrap();
        let ceilings = Ceilings {
            host_memcpy_gbps: Some(39.6),
            ..Ceilings::default()
        };
        let row = Row::from_samples(
            "transfer",
            "h2d",
            1 << 26,
            "warpdrive",
            &mut [1500.0, 1520.0, 1560.0],
        )
        .unwrap()
        .with_bytes((1u64 << 26) as f64)
        .against(Ceiling::HostMemcpy, &ceilings);
        Results::new(&info, ceilings, vec![row])
    }

    #[test]
    fn json_has_exactly_the_bench_md_keys_and_nulls() {
        let r = sample_results();
        let v: Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
        assert_eq!(
            keys(&v),
            set(&["schema", "date", "git_rev", "device", "ceilings", "rows"])
        );
        assert_eq!(v["schema"], "warpdrive-bench/1");
        assert_eq!(v["git_rev"], crate::GIT_REV);
        assert_eq!(
            keys(&v["device"]),
            set(&[
                "backend",
                "name",
                "compute_capability",
                "sms",
                "memory_bytes",
                "driver",
                "cuda",
                "pcie",
                "numa_node"
            ])
        );
        assert_eq!(v["device"]["backend"], "cpu");
        for k in [
            "compute_capability",
            "sms",
            "driver",
            "cuda",
            "pcie",
            "numa_node",
        ] {
            assert!(
                v["device"][k].is_null(),
                "device.{k} should be null on the CPU"
            );
        }
        assert_eq!(
            keys(&v["ceilings"]),
            Ceiling::ALL.iter().map(|c| c.key().to_string()).collect()
        );
        assert_eq!(v["ceilings"]["host_memcpy_gbps"], 39.6);
        for c in Ceiling::ALL.iter().filter(|c| **c != Ceiling::HostMemcpy) {
            assert!(
                v["ceilings"][c.key()].is_null(),
                "{} should be null",
                c.key()
            );
        }
        let row = &v["rows"][0];
        assert_eq!(
            keys(row),
            set(&[
                "suite",
                "case",
                "size",
                "variant",
                "median",
                "p10",
                "p90",
                "unit",
                "gbps",
                "tflops",
                "pct_of_ceiling",
                "extra"
            ])
        );
        assert_eq!(row["unit"], "us");
        assert_eq!(row["size"], 1u64 << 26);
        assert_eq!(row["median"], 1520.0);
        assert!(row["tflops"].is_null());
        assert!(row["gbps"].as_f64().unwrap() > 44.0);
        assert!(row["pct_of_ceiling"].as_f64().is_some());
        assert_eq!(row["extra"]["ceiling"], "host_memcpy_gbps");
    }

    #[test]
    fn json_field_order_follows_bench_md() {
        let text = sample_results().to_json().unwrap();
        let pos = |k: &str| text.find(&format!("\"{k}\"")).unwrap();
        let top = ["schema", "date", "git_rev", "device", "ceilings", "rows"];
        assert!(top.windows(2).all(|w| pos(w[0]) < pos(w[1])));
        let row = [
            "suite", "case", "size", "variant", "median", "p10", "p90", "unit", "gbps",
        ];
        assert!(row.windows(2).all(|w| pos(w[0]) < pos(w[1])));
    }

    #[test]
    fn json_round_trips_and_checks_schema() {
        let r = sample_results();
        let text = r.to_json().unwrap();
        same(&Results::from_json(&text).unwrap(), &r);
        let other = text.replace("warpdrive-bench/1", "warpdrive-bench/9");
        assert!(Results::from_json(&other).is_err());
    }

    #[test]
    fn write_json_creates_the_file() {
        let dir = std::env::temp_dir().join(format!("wd-results-{}", std::process::id()));
        let path = dir.join("sub").join("r.json");
        let r = sample_results();
        r.write_json(&path).unwrap();
        same(&Results::read_json(&path).unwrap(), &r);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn write_json_replaces_the_file_instead_of_writing_into_it() {
        let dir = std::env::temp_dir().join(format!("wd-results-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.json");
        std::fs::write(&path, "good").unwrap();
        // Another name for the old file: it keeps its text unless the write went into it.
        let old = dir.join("old.json");
        let _ = std::fs::remove_file(&old);
        std::fs::hard_link(&path, &old).unwrap();
        let r = sample_results();
        r.write_json(&path).unwrap();
        same(&Results::read_json(&path).unwrap(), &r);
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "good");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn derived_figures() {
        let stats = Stats {
            median: 1000.0,
            p10: 900.0,
            p90: 1100.0,
        };
        // 1e9 bytes in 1 ms = 1000 GB/s; 2e12 flops in 1 ms = 2000 TFLOP/s.
        let r = Row::new("s", "c", 1, "v", stats)
            .with_bytes(1e9)
            .with_flops(2e12);
        assert!((r.gbps.unwrap() - 1000.0).abs() < 1e-9);
        assert!((r.tflops.unwrap() - 2000.0).abs() < 1e-9);
        let zero = Row::new(
            "s",
            "c",
            1,
            "v",
            Stats {
                median: 0.0,
                ..stats
            },
        )
        .with_bytes(1.0);
        assert_eq!(zero.gbps, None);
    }

    #[test]
    fn percent_of_ceiling_per_metric() {
        let c = Ceilings {
            d2d_copy_gbps: Some(4000.0),
            launch_us: Some(2.0),
            cpu_gemm_f32_gflops: Some(100.0),
            ..Ceilings::default()
        };
        let stats = |m| Stats {
            median: m,
            p10: m,
            p90: m,
        };
        let r = Row::new("s", "c", 1, "v", stats(1.0))
            .with_bytes(2e6)
            .against(Ceiling::D2dCopy, &c);
        assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(r.extra["ceiling"], "d2d_copy_gbps");
        let r = Row::new("s", "c", 1, "v", stats(4.0)).against(Ceiling::Launch, &c);
        assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
        // 5e4 flops in 1 µs = 0.05 TFLOP/s = 50 GFLOP/s.
        let r = Row::new("s", "c", 1, "v", stats(1.0))
            .with_flops(5e4)
            .against(Ceiling::CpuGemmF32, &c);
        assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
        // Unmeasured ceiling: no percentage, no key.
        let r = Row::new("s", "c", 1, "v", stats(1.0))
            .with_bytes(1.0)
            .against(Ceiling::H2dPinned, &c);
        assert_eq!(r.pct_of_ceiling, None);
        assert!(!r.extra.contains_key("ceiling"));
    }

    #[test]
    fn ceiling_keys_round_trip() {
        for c in Ceiling::ALL {
            assert_eq!(Ceiling::from_key(c.key()), Some(c));
            assert!(c.key().starts_with(c.case()));
        }
        assert_eq!(Ceiling::from_key("nope"), None);
        let mut ceilings = Ceilings::default();
        for (i, c) in Ceiling::ALL.into_iter().enumerate() {
            ceilings.set(c, Some(i as f64));
        }
        for (i, c) in Ceiling::ALL.into_iter().enumerate() {
            assert_eq!(ceilings.get(c), Some(i as f64));
        }
    }

    #[test]
    fn add_rows_fills_percentages_from_named_ceilings() {
        let mut r = sample_results();
        r.ceilings.h2d_pinned_gbps = Some(50.0);
        let peer = Row::new(
            "transfer",
            "h2d",
            1,
            "torch-pinned",
            Stats {
                median: 1.0,
                p10: 1.0,
                p90: 1.0,
            },
        )
        .with_bytes(25e3)
        .with_extra("ceiling", "h2d_pinned_gbps");
        r.add_rows([peer]);
        let last = r.rows.last().unwrap();
        assert!((last.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
    }

    #[test]
    fn dates() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(59), "1970-01-01T00:00:59Z");
        assert_eq!(rfc3339_utc(86_399), "1970-01-01T23:59:59Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(951_868_800), "2000-03-01T00:00:00Z");
        assert_eq!(rfc3339_utc(1_709_164_800), "2024-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_735_689_599), "2024-12-31T23:59:59Z");
        assert_eq!(rfc3339_utc(1_795_316_400), "2026-11-22T03:00:00Z");
        assert_eq!(rfc3339_utc(4_107_542_400), "2100-03-01T00:00:00Z");
        assert_eq!(rfc3339_utc(-1), "1969-12-31T23:59:59Z");
        assert_eq!(rfc3339_utc(-86_400 * 365), "1969-01-01T00:00:00Z");
        let now = now_rfc3339();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.ends_with('Z') && now.as_bytes()[10] == b'T');
    }

    #[test]
    fn table_aligns_and_shows_nulls_as_dashes() {
        let t = format_table(&sample_results());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("suite"));
        assert!(lines[0].contains("% ceiling"));
        assert!(lines[2].contains("transfer") && lines[2].contains("warpdrive"));
        assert!(lines[2].contains(" - "), "tflops is null: {}", lines[2]);
        let ceilings = format_ceilings(&sample_results().ceilings);
        assert_eq!(ceilings.lines().count(), 10);
        assert!(ceilings.contains("null"));
    }
}
