//! The work of the launch-cost benchmarks, launched safely on the lean path: `basic.cu`'s
//! one-element fill into memory the probe owns, and its empty kernel. Safe wrappers over
//! [`launch`], so the benchmark crate needs no `unsafe`.

use std::ffi::c_void;

use crate::device::probe::ReferenceLaunches;
use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::{PtxCache, BASIC};
use crate::memory::Buffer;

use super::launch::{launch, Kernel, LaunchConfig};

/// `fill_u32` on one element it owns and `empty_kernel`, loaded on one CUDA stream's
/// device, for timing launches.
pub struct LaunchProbe {
    fill: Kernel,
    empty: Kernel,
    out: Buffer<u32>,
    stream_id: u64,
}

impl LaunchProbe {
    /// Loads both kernels and allocates the fill's element (zeroed) on `stream`, the only
    /// stream the probe launches on. CUDA only: the CPU backend runs ops, not kernels.
    pub fn new(stream: &Stream) -> Result<LaunchProbe> {
        let fill = Kernel::new(stream.device(), &BASIC, "fill_u32")?;
        let empty = Kernel::new(stream.device(), &BASIC, "empty_kernel")?;
        Ok(LaunchProbe {
            fill,
            empty,
            out: Buffer::zeros(stream, 1)?,
            stream_id: stream.id(),
        })
    }

    /// Launches `fill_u32` writing `value` to the probe's element with `config` (any grid:
    /// the kernel writes element 0 only; it waits for the previous kernel first, so
    /// `config.programmatic` is allowed). Inside a capture on the probe's stream it becomes
    /// a graph node.
    pub fn fill(&self, stream: &Stream, value: u32, config: LaunchConfig) -> Result<()> {
        self.check_stream(stream)?;
        let (mut out, mut value, mut n) = (self.out.device_ptr(), value, 1u64);
        let mut params = [
            &mut out as *mut u64 as *mut c_void,
            &mut value as *mut u32 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
        ];
        // SAFETY: fill_u32(u32* out, u32 value, u64 n): `out` is the probe's one element,
        // which outlives the launch (the buffer is freed in stream order on the same
        // stream); the fill runs wait_prior_grid() before it writes.
        unsafe { launch(stream, &self.fill, config, &mut params) }
    }

    /// Launches `empty_kernel` with `config` (it touches no memory, so any configuration
    /// and `config.programmatic` are allowed).
    pub fn empty(&self, stream: &Stream, config: LaunchConfig) -> Result<()> {
        self.check_stream(stream)?;
        // SAFETY: `empty_kernel` takes no parameters and touches no memory.
        unsafe { launch(stream, &self.empty, config, &mut []) }
    }

    /// The element the fills wrote (0 before any), waiting for the stream.
    pub fn value(&self, stream: &Stream) -> Result<u32> {
        self.check_stream(stream)?;
        let v = self.out.to_host(stream)?;
        v.first().copied().ok_or_else(|| {
            Error::InvalidArgument("LaunchProbe: the fill's element is missing".into())
        })
    }

    fn check_stream(&self, stream: &Stream) -> Result<()> {
        if stream.id() == self.stream_id {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "LaunchProbe: launched on {stream:?}, made for stream #{}",
                self.stream_id
            )))
        }
    }
}

impl ReferenceLaunches {
    /// Loads `basic.cu`'s `fill_u32` for both references on `stream`'s device (see
    /// [`ReferenceLaunches`]). CUDA only.
    pub fn new(stream: &Stream) -> Result<ReferenceLaunches> {
        let gpu = stream.device().gpu("reference launches")?;
        let ptx = PtxCache::global().ptx(&BASIC, BASIC.arch_for(gpu.arch())?)?;
        ReferenceLaunches::with_ptx(stream, &ptx)
    }
}
