//! The CUDA backend: every call into the driver, NVRTC, cuBLAS, NCCL and cuFile goes through
//! this folder, so this is where warpdrive's `unsafe` lives (besides kernel launch sites).
//!
//! Libraries are loaded at run time (cudarc's `dynamic-loading`); cudarc panics when a call
//! reaches a library that is absent, so each library's presence is checked once, before its
//! first call, and reported as an [`Error`] instead.

use super::{cpu, sysfs};

mod blas;
mod blaslt;
mod context;
mod exit;
mod graph;
mod info;
mod launch;
mod libraries;
mod link;
mod memory;
mod nccl;
mod nvrtc;
mod peer;
mod probe;
mod resident;
mod stream;
mod tensor_map;
mod vmm;

pub(crate) use blas::GemmCall;
pub(crate) use blaslt::BiasGemm;
pub(crate) use context::opened;
pub(crate) use context::thread_is_capturing;
pub use context::CudaDevice;
pub use exit::RELEASE_AT_EXIT;
pub(crate) use exit::{at_exit, release_at_exit};
pub(crate) use graph::GraphExec;
pub(crate) use launch::{Function, LaunchMode, Module};
pub(crate) use libraries::{cufile_loads, device_count, library_statuses};
pub(crate) use memory::AsyncMemPool;
pub(crate) use nccl::{nccl_group, nccl_unique_id, NcclCall, NcclComm, NcclReduce, NCCL_ID_BYTES};
pub(crate) use nvrtc::{compile_image, compile_options, compile_ptx, nvrtc_version};
pub use probe::ReferenceLaunches;
pub(crate) use resident::{MappedWords, ResidentGuard};
pub(crate) use stream::{GpuEvent, GpuStream};
pub(crate) use tensor_map::TiledMap;
pub(crate) use vmm::PeerMappedAlloc;
