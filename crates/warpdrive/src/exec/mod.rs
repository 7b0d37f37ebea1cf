//! Execution: CUDA graphs, the lean launch path, launch configuration and autotuning, and
//! the recovery policy. Above `device`, `kernels` and `memory`; beside `ops`.
//!
//! - [`graph`]: [`Graph::capture`] / [`Graph::launch`], following DESIGN.md's capture rules.
//! - [`launch`](mod@launch): [`Kernel`] handles and the lean [`launch`](launch::launch) path; block
//!   sizes from the occupancy API.
//! - [`probe`]: [`probe::LaunchProbe`], the launch benchmarks' kernels behind a safe API.
//! - [`dispatch`]: [`Dispatcher`], work routed and launched from the device (graphs launched
//!   by a kernel), and [`device_probe`]'s latency probe of that path.
//! - [`tune`]: [`autotune`] with a persisted TOML cache, and the batch-size knee.
//! - [`recovery`]: [`run_with_backoff`], the opt-in CPU fallback, and device loss.

pub mod device_probe;
pub mod dispatch;
pub mod graph;
pub mod launch;
pub mod probe;
pub mod recovery;
pub mod tune;

pub use device_probe::{DeviceLaunchProbe, LaunchPath, LaunchTimes};
pub use dispatch::{Decision, DispatchReport, Dispatcher};
pub use graph::{capturing, Graph, GraphState};
pub use launch::{launch, Kernel, LaunchConfig};
pub use recovery::{
    recoverable_on_cpu, run_with_backoff, run_with_fallback, Backoff, Fallback, Recovered,
};
pub use tune::{autotune, batch_knee, Autotuner, BatchSweep, TuneKey, TuneRecord};
