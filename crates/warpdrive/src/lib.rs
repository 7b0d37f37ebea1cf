//! warpdrive: a GPU performance runtime between raw CUDA bindings (`cudarc`) and an
//! application. It keeps data on the GPU, moves it at the link's speed, never pays for an
//! allocation twice, launches work without overhead, and measures each claim against the
//! machine's physical limits.
//!
//! Every public type works on two backends, [`Device::Cuda`] and [`Device::Cpu`]; the CPU
//! backend is the reference every kernel is tested against.
//!
//! Floors (nothing imports upward): `device` + `kernels` → `memory` → `ops`, `exec`,
//! `transfer` → `telemetry` → `moe`. The benchmark harness lives in the `warpdrive-bench`
//! crate, above this one.

pub mod device;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod files;
pub mod kernels;
pub mod memory;
pub mod moe;
pub mod ops;
pub mod size;
pub mod telemetry;
#[cfg(test)]
mod test_support;
pub mod transfer;

pub use device::{Device, DeviceInfo, Event, Stream};
pub use dtype::{DType, DTypeKind, Float};
pub use error::{Error, Result};
pub use memory::Buffer;

/// The git revision this build came from (baked in by `build.rs`; `unknown` without git).
pub const GIT_REV: &str = env!("WARPDRIVE_GIT_REV");
