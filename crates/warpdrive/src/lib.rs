//! warpdrive: a GPU performance runtime between raw CUDA bindings and an
//! application. It keeps data on the GPU, moves it at the link's speed, never pays for an
//! allocation twice, launches work without overhead, and measures each claim against the
//! machine's physical limits.
//!
//! Every public type works on two backends, CUDA ([`Device::cuda`]) and the CPU ([`Device::cpu`]); the CPU
//! backend is the reference every kernel is tested against.
//!
//! # Quick start
//!
//! Upload, one fused op, download, on the CPU backend (`Device::best()` picks the GPU where
//! there is one):
//!
//! ```
//! use warpdrive::ops::{self, Activation, Map};
//! use warpdrive::{bf16, Buffer, Device};
//!
//! # fn main() -> warpdrive::Result<()> {
//! let stream = Device::cpu().new_stream()?;
//! let x = Buffer::from_host(&stream, &[-1.0f32, 0.0, 1.0, 2.0])?;
//! let mut y = Buffer::<bf16>::zeros(&stream, x.len())?;
//! // y = silu(2·x + 1), cast to bf16, in one pass.
//! ops::map(&stream, &Map::affine(2.0, 1.0).then(Activation::Silu), &x, &mut y)?;
//! let y = y.to_host(&stream)?;
//! let silu = |v: f32| v / (1.0 + (-v).exp());
//! for (got, v) in y.iter().zip([-1.0f32, 1.0, 3.0, 5.0]) {
//!     assert!((got.to_f32() - silu(v)).abs() < 0.05);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! More in `crates/warpdrive/examples/` (`cargo run -p warpdrive --example NAME`):
//! `quickstart`, `pool_stats` (the caching pool and its statistics), `graph_replay` (capture
//! once, replay), `pipeline` (a pipelined transfer), `trace` (spans and a Chrome trace) and
//! `moe_safetensors` (an MoE layer from a safetensors file).
//!
//! Floors (nothing imports upward): `device` + `kernels` → `memory` → `ops`, `exec`,
//! `transfer` → `telemetry`, `fuse` → `moe`, `actor`, `agents`, `tier`, `dist`. The benchmark harness lives in the
//! `warpdrive-bench` crate, above this one.

pub mod actor;
pub mod agents;
pub mod device;
pub mod dist;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod files;
pub mod fuse;
pub mod kernels;
pub mod memory;
pub mod moe;
pub mod ops;
pub mod size;
pub mod telemetry;
#[cfg(test)]
mod test_support;
pub mod tier;
pub mod transfer;

pub use device::{Device, DeviceInfo, Event, Stream};
pub use dtype::{DType, DTypeKind, Float};
pub use error::{Error, Result};
/// The 16-bit float types of `Buffer<bf16>`, `MoeLayer::<f16>` and so on (the `half` crate's),
/// so a user needs no dependency of their own to name them.
pub use half::{bf16, f16};
pub use memory::Buffer;

/// The git revision this build came from (baked in by `build.rs`; `unknown` without git).
pub const GIT_REV: &str = env!("WARPDRIVE_GIT_REV");
