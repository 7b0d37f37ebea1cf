//! The lean launch path and launch configuration.
//!
//! The bindings' launch builder binds the context (`cuCtxGetCurrent`), collects its
//! arguments in fresh vectors, and, with event tracking on, waits on and records an event per
//! slice argument on every launch. warpdrive's launches ([`launch`], and every op and the
//! MoE layer, through the backend's one launch call) skip all of that: the context is bound once per thread (a
//! thread-local remembers which context this thread last bound; a launch that finds
//! another one current fails and is retried after a full bind), no events are recorded
//! (streams are ordered explicitly where needed), and a lost device is one atomic load.
//!
//! Block sizes come from the occupancy API by default ([`Kernel::config_for`]); the
//! [`tune`](super::tune) module times candidates when that is not good enough.

use std::ffi::c_void;

use crate::device::{Device, Function, LaunchMode, Stream};
use crate::error::{Error, Result};
use crate::kernels::{self, KernelSource};

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
    /// A programmatic dependent launch on Hopper and later (a plain launch before): the
    /// kernel may start while the stream's previous kernel finishes, so it must execute
    /// `wait_prior_grid()` (prelude.cu) before touching anything earlier work writes or
    /// reads. In a captured graph this becomes a programmatic edge, cheaper per node than a
    /// full dependency (bench/NOTES.md, kernel launches).
    pub programmatic: bool,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` blocks of `block` threads, no dynamic shared memory.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
            programmatic: false,
        }
    }
}

/// A kernel of one of warpdrive's sources, loaded on a CUDA device, with its occupancy
/// figures: the handle [`launch`] takes. Cheap to clone.
#[derive(Clone)]
pub struct Kernel {
    device: Device,
    func: Function,
    name: &'static str,
    /// (smallest grid for full occupancy, block size), without dynamic shared memory.
    occupancy: (u32, u32),
    /// The most threads per block it can be launched with.
    max_block: u32,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({} on {:?})", self.name, self.device)
    }
}

impl Kernel {
    /// Loads kernel `name` of `source` on `device` (compiling through the PTX cache on first
    /// use) and asks the occupancy API for its block size. CUDA only: the CPU backend runs
    /// ops, not kernels (`Error::Unsupported`).
    pub fn new(
        device: &Device,
        source: &'static KernelSource,
        name: &'static str,
    ) -> Result<Kernel> {
        let d = device.gpu(&format!(
            "kernel {name} (the CPU backend runs ops, not kernels)"
        ))?;
        let func = kernels::function(d, source, name)?;
        let occupancy = d.occupancy_block_size(&func, 0)?;
        let max_block = d.max_block_threads(&func)?;
        Ok(Kernel {
            device: device.clone(),
            func,
            name,
            occupancy,
            max_block,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The block size that maximises occupancy without dynamic shared memory
    /// (`cuOccupancyMaxPotentialBlockSize`).
    pub fn occupancy_block(&self) -> u32 {
        self.occupancy.1
    }

    /// The most threads per block this kernel can be launched with (its
    /// `__launch_bounds__`); [`launch`] refuses larger blocks before calling the driver.
    pub fn max_block(&self) -> u32 {
        self.max_block
    }

    /// The smallest grid that reaches full occupancy at [`Kernel::occupancy_block`].
    pub fn occupancy_grid(&self) -> u32 {
        self.occupancy.0
    }

    /// (smallest full-occupancy grid, block size) with `shared_mem_bytes` of dynamic shared
    /// memory per block.
    pub fn occupancy_with_shared(&self, shared_mem_bytes: usize) -> Result<(u32, u32)> {
        self.device
            .gpu("kernel occupancy")?
            .occupancy_block_size(&self.func, shared_mem_bytes)
    }

    /// The default configuration for a grid-stride kernel over `n` items: the occupancy
    /// block size, and enough blocks for the items but no more than full occupancy needs.
    pub fn config_for(&self, n: usize) -> LaunchConfig {
        let (min_grid, block) = self.occupancy;
        let wanted = n.div_ceil(block as usize).max(1);
        LaunchConfig::linear(wanted.min(min_grid as usize).max(1) as u32, block)
    }
}

/// Launches `kernel` on `stream` on the lean path.
///
/// # Safety
/// `params` must point at values whose types and order match the kernel's parameters, and
/// every device pointer among them must cover what the kernel reads and writes for this
/// configuration. With `config.programmatic`, the kernel must call `wait_prior_grid()`
/// before it touches anything earlier work on the stream writes or reads.
pub unsafe fn launch(
    stream: &Stream,
    kernel: &Kernel,
    config: LaunchConfig,
    params: &mut [*mut c_void],
) -> Result<()> {
    kernel.device.same_as(stream.device(), "launch")?;
    let q = stream.gpu("a kernel launch")?;
    let (x, y, z) = config.block;
    let threads = (x as u64) * (y as u64) * (z as u64);
    if threads > kernel.max_block as u64 {
        return Err(Error::InvalidArgument(format!(
            "kernel {}: a block of {threads} threads exceeds its limit of {}",
            kernel.name, kernel.max_block
        )));
    }
    // SAFETY: forwarded from this function's contract (with `programmatic`, the caller
    // vouches that the kernel waits for the previous one).
    unsafe {
        q.gpu.launch(
            q.stream,
            &kernel.func,
            config.grid,
            config.block,
            config.shared_mem_bytes,
            params,
            LaunchMode {
                programmatic: config.programmatic,
                ..LaunchMode::default()
            },
        )
    }
}
