//! Memory that host threads and a resident kernel share: 64-bit words the host loads and
//! stores atomically and a kernel reaches at [`SharedWords::device_ptr`] (page-locked,
//! mapped host memory on CUDA; plain host memory on the CPU backend, whose "kernel" is a
//! host thread).

use std::sync::atomic::AtomicU64;

use super::cuda::MappedWords;
use super::Device;
use crate::error::{Error, Result};

/// Zeroed words shared by the host and a kernel (see the module docs).
#[derive(Debug)]
pub(crate) enum SharedWords {
    Host(Box<[AtomicU64]>),
    Mapped(MappedWords),
}

impl SharedWords {
    /// The words, as host threads reach them.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        match self {
            SharedWords::Host(w) => w,
            SharedWords::Mapped(m) => m.words(),
        }
    }

    /// Where a kernel reaches the words (0 on the CPU backend, which has no kernels).
    pub(crate) fn device_ptr(&self) -> u64 {
        match self {
            SharedWords::Host(_) => 0,
            SharedWords::Mapped(m) => m.device_ptr(),
        }
    }
}

impl Device {
    /// `len > 0` zeroed words shared by the host and this device's kernels.
    pub(crate) fn shared_words(&self, len: usize) -> Result<SharedWords> {
        if len == 0 {
            return Err(Error::InvalidArgument("0 shared words".into()));
        }
        match self {
            Device::Cpu => Ok(SharedWords::Host(
                (0..len).map(|_| AtomicU64::new(0)).collect(),
            )),
            Device::Cuda(d) => MappedWords::new(d, len).map(SharedWords::Mapped),
        }
    }
}
