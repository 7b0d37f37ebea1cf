//! The ceilings model of a results file: which limits there are ([`Ceiling`]), what each
//! is measured in ([`Metric`]) and the measured values ([`Ceilings`]). The doctor measures
//! them in `ceilings.rs`.

use serde::{Deserialize, Serialize};

use super::schema::Row;

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
