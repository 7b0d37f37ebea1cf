//! Kernels: loading modules and functions, occupancy, and launches.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{result, CudaFunction, CudaModule};

use crate::device::Arch;
use crate::error::{Error, Result};

use super::super::activity::{self, ActivityKind};
use super::context::CudaDevice;
use super::stream::GpuStream;

/// A kernel loaded on a GPU: what launches take. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Function {
    f: CudaFunction,
    /// (module, kernel) names: the key of the occupancy cache.
    key: (&'static str, &'static str),
}

impl std::ops::Deref for Function {
    type Target = CudaFunction;
    fn deref(&self) -> &CudaFunction {
        &self.f
    }
}

/// PTX loaded on a GPU: where [`CudaDevice::function`] finds its kernels.
pub(crate) struct Module(pub(super) Arc<CudaModule>);

impl CudaDevice {
    // ---- kernels ----

    /// The architecture this device compiles for.
    pub(crate) fn arch(&self) -> Arch {
        let (major, minor) = self.inner.compute_capability;
        Arch::from_compute_capability(major as u32, minor as u32)
    }

    /// Kernel `name` of module `module`, loaded on first use: `load` gives the module the
    /// first time one of its kernels is asked for (the kernel floor compiles it through its
    /// cache and [`load_module`](Self::load_module)).
    pub(crate) fn function(
        &self,
        module: &'static str,
        name: &'static str,
        load: impl FnOnce() -> Result<Module>,
    ) -> Result<Function> {
        let key = (module, name);
        if let Some(f) = self.inner.functions.lock().get(&key) {
            return Ok(f.clone());
        }
        let m = self.module(module, load)?.0;
        self.bind()?;
        let r = m.load_function(name);
        let f = Function {
            f: self.check("cuModuleGetFunction", r)?,
            key,
        };
        self.inner.functions.lock().insert(key, f.clone());
        Ok(f)
    }

    /// Module `module`, loaded by `load` the first time it is asked for.
    pub(crate) fn module(
        &self,
        module: &'static str,
        load: impl FnOnce() -> Result<Module>,
    ) -> Result<Module> {
        if let Some(m) = self.inner.modules.lock().get(module) {
            return Ok(Module(m.clone()));
        }
        let m = load()?.0;
        self.inner.modules.lock().insert(module, m.clone());
        Ok(Module(m))
    }

    /// True when module `module` is loaded on this device.
    pub(crate) fn has_module(&self, module: &str) -> bool {
        self.inner.modules.lock().contains_key(module)
    }

    /// Kernel `name` of a module made at run time (not in the device's table), loaded now.
    pub(crate) fn generated_function(&self, module: &Module, name: &str) -> Result<Function> {
        self.bind()?;
        let f = self.check("cuModuleGetFunction", module.0.load_function(name))?;
        // SAFETY: the function handle is alive (its module is held by `module` and by `f`).
        let r = unsafe { sys::cuFuncLoad(f.cu_function()).result() };
        self.check("cuFuncLoad", r)?;
        Ok(Function {
            f,
            key: ("generated", "generated"),
        })
    }

    /// Loads `ptx` on this device.
    pub(crate) fn load_module(&self, ptx: &str) -> Result<Module> {
        self.bind()?;
        let r = self
            .inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()));
        self.check("cuModuleLoadData", r).map(Module)
    }

    /// Loads a cubin (machine code built for this device's architecture) on this device: no
    /// JIT, unlike PTX.
    pub(crate) fn load_module_image(&self, cubin: &[u8]) -> Result<Module> {
        self.bind()?;
        let r = self
            .inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()));
        self.check("cuModuleLoadData", r).map(Module)
    }

    /// How many blocks of `block` threads (with `shared_bytes` of dynamic shared memory) of
    /// `f` fit on one SM at once (at least 1), from the driver's occupancy calculator;
    /// cached per kernel and shape. Grid-stride kernels launch SMs × this.
    pub(crate) fn resident_blocks(
        &self,
        f: &Function,
        block: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        let key = (f.key.0, f.key.1, block, shared_bytes);
        if let Some(&n) = self.inner.occupancy.lock().get(&key) {
            return Ok(n);
        }
        self.bind()?;
        // The calculator counts no block that asks for more than the function is opted in
        // to (what a launch of this size sets anyway).
        self.opt_in_dynamic_shared(f, shared_bytes)?;
        let r =
            f.occupancy_max_active_blocks_per_multiprocessor(block, shared_bytes as usize, None);
        let n = self
            .check("cuOccupancyMaxActiveBlocksPerMultiprocessor", r)?
            .max(1);
        self.inner.occupancy.lock().insert(key, n);
        Ok(n)
    }

    /// Launches `f` on `stream` as `mode` says (see [`LaunchMode`]).
    ///
    /// # Safety
    /// `params` must point at values whose types and order match the kernel's parameters,
    /// and every device pointer among them must cover what the kernel reads and writes
    /// for this grid. With `mode.programmatic`, the kernel must execute `griddepcontrol.wait`
    /// before it reads anything earlier work on the stream writes, or writes anything that
    /// work reads (before the wait it may only read data no earlier work writes, such as
    /// weights, and only through L2).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch(
        &self,
        stream: &GpuStream,
        f: &Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        params: &mut [*mut c_void],
        mode: LaunchMode,
    ) -> Result<()> {
        let LaunchMode {
            programmatic,
            cluster,
            cooperative,
        } = mode;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || block.0 == 0 || block.1 == 0 || block.2 == 0
        {
            return Err(Error::InvalidArgument(format!(
                "empty launch: grid {grid:?}, block {block:?}"
            )));
        }
        if cluster > 1 && (self.compute_capability().0 < 9 || cluster > 8 || grid.0 % cluster != 0)
        {
            return Err(Error::InvalidArgument(format!(
                "clusters of {cluster} blocks: need compute capability 9.0 (have {:?}), at most 8 \
                 blocks and a grid.x ({}) they divide",
                self.compute_capability(),
                grid.0
            )));
        }
        // The lean path: no cuCtxGetCurrent when this thread already bound this context,
        // no events (warpdrive orders streams explicitly where it must).
        let t = activity::begin();
        self.opt_in_dynamic_shared(f, shared_mem_bytes)?;
        let programmatic = programmatic && self.compute_capability().0 >= 9;
        if programmatic || cluster > 1 || cooperative {
            // SAFETY: an all-zero CUlaunchAttribute is a valid value (plain integers and a
            // union of them); ids and values are set right after.
            let mut attrs: [sys::CUlaunchAttribute; 3] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if programmatic {
                attrs[n].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if cluster > 1 {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attrs[n].value.clusterDim.x = cluster;
                attrs[n].value.clusterDim.y = 1;
                attrs[n].value.clusterDim.z = 1;
                n += 1;
            }
            if cooperative {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
                attrs[n].value.cooperative = 1;
                n += 1;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: shared_mem_bytes,
                hStream: stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            self.lean("cuLaunchKernelEx", || {
                // SAFETY: forwarded from this function's contract; `config` and `attrs` live
                // across the call; the function handle is alive (its module is held by `f`).
                unsafe {
                    sys::cuLaunchKernelEx(
                        &config,
                        f.cu_function(),
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                    .result()
                }
            })?;
        } else {
            self.lean("cuLaunchKernel", || {
                // SAFETY: forwarded from this function's contract; the function handle is
                // alive (its module is held by `f`).
                unsafe {
                    result::launch_kernel(
                        f.cu_function(),
                        grid,
                        block,
                        shared_mem_bytes,
                        stream.cu_stream(),
                        params,
                    )
                }
            })?;
        }
        activity::end(t, ActivityKind::Launch, stream.cu_stream() as u64, 0);
        Ok(())
    }

    /// The block size that maximises occupancy for `f` with `shared_mem_bytes` of dynamic
    /// shared memory per block (`cuOccupancyMaxPotentialBlockSize`), and the smallest grid
    /// that reaches it: (min grid, block).
    pub(crate) fn occupancy_block_size(
        &self,
        f: &Function,
        shared_mem_bytes: usize,
    ) -> Result<(u32, u32)> {
        self.bind()?;
        // SAFETY: the function handle is alive (its module is held by `f`); no callback.
        let r = unsafe {
            result::occupancy::max_potential_block_size(f.cu_function(), None, shared_mem_bytes, 0)
        };
        let (grid, block) = self.check("cuOccupancyMaxPotentialBlockSize", r)?;
        Ok((grid.max(1) as u32, block.max(1) as u32))
    }

    /// The most threads per block `f` can be launched with (its `__launch_bounds__`, or
    /// what its registers allow).
    pub(crate) fn max_block_threads(&self, f: &Function) -> Result<u32> {
        let r = f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
        Ok(self.check("cuFuncGetAttribute", r)?.max(1) as u32)
    }
}

/// How [`CudaDevice::launch`] starts a kernel beyond its shape. The default is a plain launch.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LaunchMode {
    /// A programmatic dependent launch (Hopper and later; ignored before compute capability
    /// 9.0): the kernel's blocks may start while the stream's previous kernel finishes (in a
    /// captured graph, a programmatic edge).
    pub programmatic: bool,
    /// Above 1, every `cluster` consecutive blocks along x form a thread-block cluster
    /// (compute capability 9.0 and later; at most 8, dividing grid.x).
    pub cluster: u32,
    /// A cooperative launch: every block is resident at once (the driver refuses a grid
    /// that cannot be), so blocks may wait for each other.
    pub cooperative: bool,
}
