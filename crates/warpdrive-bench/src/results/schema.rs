//! The results file itself: [`SCHEMA`], its rows ([`Row`]), the device record and
//! [`Results`], with its JSON reading and writing.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use warpdrive::device::DeviceInfo;
use warpdrive::error::{Error, Result};

use super::super::stats::Stats;
use super::ceiling_model::{Ceiling, Ceilings};
use super::date::now_rfc3339;

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
    /// [`Derived`](super::super::Derived), ...).
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
    /// [`warpdrive::GIT_REV`] of the build that ran.
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
            git_rev: warpdrive::GIT_REV.into(),
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
    /// [`warpdrive::files::write_atomic`]), creating missing parent folders; on failure the file
    /// that was there is left whole.
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut text = self.to_json()?;
        text.push('\n');
        warpdrive::files::write_atomic(path.as_ref(), text.as_bytes())
    }

    /// Reads a file written by [`Results::write_json`].
    pub fn read_json(path: impl AsRef<Path>) -> Result<Results> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Results::from_json(&text)
    }
}
