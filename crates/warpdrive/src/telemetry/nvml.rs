//! The NVML sampler: a background thread reading the GPU's counters at a set interval into
//! `metrics` gauges and, while a trace records, into its counter tracks.
//!
//! NVML's "utilization" is the share of time in which *any* kernel ran: a single tiny kernel
//! in flight reads 100 %. It is reported as `busy_any_kernel_pct` and must never be used
//! alone to judge how well the GPU is used.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::Nvml;
use parking_lot::Mutex;

use super::span::us_since_epoch;
use super::trace::push_counter;
use crate::error::{Error, Result};

/// One reading; a field is `None` when the GPU does not report it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NvmlReading {
    /// Percent of the last period in which any kernel ran (NVML's "GPU utilization").
    pub busy_any_kernel_pct: Option<f64>,
    pub memory_used_bytes: Option<f64>,
    pub power_watts: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub temperature_c: Option<f64>,
    pub pcie_tx_bytes_per_s: Option<f64>,
    pub pcie_rx_bytes_per_s: Option<f64>,
}

/// A running sampler; it stops when dropped.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    last: Arc<Mutex<Option<NvmlReading>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sampler(running: {})", self.thread.is_some())
    }
}

fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::LibraryMissing {
        library: "nvml",
        hint: format!("NVML is unavailable, so no GPU counters are sampled: {e}"),
    }
}

impl Sampler {
    /// Samples GPU `index` every `interval`. `Err(LibraryMissing { library: "nvml", .. })`
    /// when NVML cannot be loaded or the GPU is not found (no driver, a CPU-only host).
    pub fn start(index: u32, interval: Duration) -> Result<Sampler> {
        Sampler::start_with(Nvml::init().map_err(unavailable)?, index, interval)
    }

    /// [`Sampler::start`] with NVML loaded from `lib_path` (e.g. a driver in a non-standard
    /// place).
    pub fn start_with_library(
        lib_path: &std::path::Path,
        index: u32,
        interval: Duration,
    ) -> Result<Sampler> {
        let nvml = Nvml::builder()
            .lib_path(lib_path.as_os_str())
            .init()
            .map_err(unavailable)?;
        Sampler::start_with(nvml, index, interval)
    }

    fn start_with(nvml: Nvml, index: u32, interval: Duration) -> Result<Sampler> {
        // Fail now, not on the thread, when the GPU is not there.
        let first = read(&nvml, index)?;
        publish(&first);
        let stop = Arc::new(AtomicBool::new(false));
        let last = Arc::new(Mutex::new(Some(first)));
        let (stop2, last2) = (stop.clone(), last.clone());
        let thread = std::thread::Builder::new()
            .name("warpdrive-nvml".into())
            .spawn(move || {
                let mut next = Instant::now() + interval;
                while !stop2.load(Ordering::Relaxed) {
                    // Short naps so a drop does not wait a whole interval.
                    let now = Instant::now();
                    if now < next {
                        std::thread::sleep((next - now).min(Duration::from_millis(20)));
                        continue;
                    }
                    next += interval;
                    match read(&nvml, index) {
                        Ok(r) => {
                            publish(&r);
                            *last2.lock() = Some(r);
                        }
                        Err(e) => tracing::debug!("nvml sample failed: {e}"),
                    }
                }
            })
            .map_err(|e| unavailable(format!("cannot start the sampler thread: {e}")))?;
        Ok(Sampler {
            stop,
            last,
            thread: Some(thread),
        })
    }

    /// The latest reading.
    pub fn last(&self) -> Option<NvmlReading> {
        *self.last.lock()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read(nvml: &Nvml, index: u32) -> Result<NvmlReading> {
    let d = nvml.device_by_index(index).map_err(unavailable)?;
    let f = |v: std::result::Result<u32, _>| v.ok().map(f64::from);
    Ok(NvmlReading {
        busy_any_kernel_pct: d.utilization_rates().ok().map(|u| f64::from(u.gpu)),
        memory_used_bytes: d.memory_info().ok().map(|m| m.used as f64),
        power_watts: f(d.power_usage()).map(|mw| mw / 1e3),
        sm_clock_mhz: f(d.clock_info(Clock::SM)),
        temperature_c: f(d.temperature(TemperatureSensor::Gpu)),
        // NVML reports KB/s.
        pcie_tx_bytes_per_s: f(d.pcie_throughput(PcieUtilCounter::Send)).map(|k| k * 1e3),
        pcie_rx_bytes_per_s: f(d.pcie_throughput(PcieUtilCounter::Receive)).map(|k| k * 1e3),
    })
}

fn publish(r: &NvmlReading) {
    let ts = us_since_epoch(Instant::now());
    let fields: [(&'static str, Option<f64>); 7] = [
        ("nvml_busy_any_kernel_pct", r.busy_any_kernel_pct),
        ("nvml_memory_used_bytes", r.memory_used_bytes),
        ("nvml_power_watts", r.power_watts),
        ("nvml_sm_clock_mhz", r.sm_clock_mhz),
        ("nvml_temperature_celsius", r.temperature_c),
        ("nvml_pcie_tx_bytes_per_second", r.pcie_tx_bytes_per_s),
        ("nvml_pcie_rx_bytes_per_second", r.pcie_rx_bytes_per_s),
    ];
    for (name, v) in fields {
        if let Some(v) = v {
            metrics::gauge!(name).set(v);
            if metrics_recording() {
                push_counter(name, ts, v);
            }
        }
    }
}

/// True while a trace records (counter samples only go to the timeline then).
fn metrics_recording() -> bool {
    super::enabled()
}
