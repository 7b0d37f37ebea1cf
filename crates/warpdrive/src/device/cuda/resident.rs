//! Living beside a resident kernel: one that runs until told to stop (the actor loop).
//!
//! While such a kernel runs, calls that wait for the whole device never return: a
//! device-wide synchronize, and the driver's frees (`cuMemFree`, `cuMemFreeHost` and
//! `cuMemHostUnregister` wait for the device). So while a [`ResidentGuard`] lives, frees are
//! held back and done when the last guard goes, and a device-wide synchronize is refused
//! with an error. Lazily loaded kernels may also need the device idle to load, so a guard
//! is made only after every module this process will use is loaded eagerly
//! ([`CudaDevice::load_module_eagerly`]). Unloading a module waits for its kernels too: the
//! device keeps every library module loaded, and the resident kernel holds its own.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use crate::error::{Error, Result};

use super::context::{no_alloc_in_capture, CudaDevice};
use super::launch::Module;

/// A free held back while a resident kernel runs.
#[derive(Debug)]
pub(super) enum HeldFree {
    Device(u64),
    Host(u64),
    HostOnNode(u64, usize),
}

/// The resident kernels of one device and the frees they hold back.
#[derive(Default)]
pub(crate) struct Resident {
    running: AtomicUsize,
    held: Mutex<Vec<HeldFree>>,
}

/// Marks a resident kernel as running on its device until dropped.
pub(crate) struct ResidentGuard {
    device: CudaDevice,
}

impl std::fmt::Debug for ResidentGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResidentGuard({:?})", self.device)
    }
}

impl Drop for ResidentGuard {
    fn drop(&mut self) {
        let r = &self.device.inner.resident;
        if r.running.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let held = std::mem::take(&mut *r.held.lock());
        for free in held {
            let done = match free {
                HeldFree::Device(p) => self.device.free(p),
                HeldFree::Host(p) => self.device.free_host(p),
                HeldFree::HostOnNode(p, bytes) => self.device.free_host_on_node(p, bytes),
            };
            if let Err(e) = done {
                tracing::warn!("a free held back by a resident kernel failed: {e}");
            }
        }
    }
}

impl CudaDevice {
    /// Declares a resident kernel about to start; the caller drops the guard once the
    /// kernel has ended (or, if it never ends, never).
    pub(crate) fn resident_guard(&self) -> ResidentGuard {
        self.inner.resident.running.fetch_add(1, Ordering::AcqRel);
        ResidentGuard {
            device: self.clone(),
        }
    }

    /// True while a resident kernel runs on this device.
    pub(crate) fn has_resident(&self) -> bool {
        self.inner.resident.running.load(Ordering::Acquire) > 0
    }

    /// Holds `free` back when a resident kernel runs (true), else leaves it to the caller.
    pub(super) fn hold_free(&self, free: HeldFree) -> bool {
        if !self.has_resident() {
            return false;
        }
        self.inner.resident.held.lock().push(free);
        true
    }

    /// `Error::Unsupported` for `call` (a wait on the whole device) while a resident kernel
    /// runs: it would never return.
    pub(super) fn refuse_while_resident(&self, call: &str) -> Result<()> {
        if self.has_resident() {
            return Err(Error::Unsupported(format!(
                "{call} while a resident kernel (actors) runs on {self:?}: it would never \
                 return; wait on a stream or an event instead"
            )));
        }
        Ok(())
    }

    /// Loads every kernel of `module` now, not at its first launch: with lazy loading (the
    /// driver's default) a first launch may wait for the device to go idle, which it never
    /// does while a resident kernel runs. `ptx` is the module's text (its entry names).
    pub(crate) fn load_module_eagerly(&self, module: &Module, ptx: &str) -> Result<usize> {
        self.bind()?;
        let mut loaded = 0;
        for name in entry_names(ptx) {
            let f = self.check("cuModuleGetFunction", module.0.load_function(name))?;
            // SAFETY: the function handle is alive (its module is held by `module`).
            let r = unsafe { sys::cuFuncLoad(f.cu_function()).result() };
            self.check("cuFuncLoad", r)?;
            loaded += 1;
        }
        Ok(loaded)
    }
}

/// The names of the kernels (`.entry`) a PTX text defines.
fn entry_names(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|l| {
        let rest = l
            .trim_start()
            .strip_prefix(".visible .entry ")
            .or_else(|| l.trim_start().strip_prefix(".entry "))?;
        let name = rest.split(['(', ' ']).next()?.trim();
        (!name.is_empty()).then_some(name)
    })
}

/// Page-locked host memory mapped into the GPU's address space, seen by the host as 64-bit
/// words it loads and stores atomically: the rings and control words a resident kernel and
/// host threads share. Zeroed when made.
pub(crate) struct MappedWords {
    device: CudaDevice,
    host: *mut AtomicU64,
    device_ptr: u64,
    len: usize,
}

// SAFETY: the memory is owned by this value and only reached through atomics.
unsafe impl Send for MappedWords {}
// SAFETY: as above: every access is an atomic load or store.
unsafe impl Sync for MappedWords {}

impl std::fmt::Debug for MappedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedWords[{} on {:?}]", self.len, self.device)
    }
}

impl MappedWords {
    /// `len > 0` zeroed words on `device`.
    pub(crate) fn new(device: &CudaDevice, len: usize) -> Result<MappedWords> {
        let bytes = len
            .checked_mul(8)
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("{len} mapped words")))?;
        no_alloc_in_capture("cuMemHostAlloc")?;
        device.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is bound; the pointer is owned by the value made below, which
        // frees it on drop.
        let host = match unsafe { result::malloc_host(bytes, flags) } {
            Ok(p) => p as *mut AtomicU64,
            Err(e) => return device.check("cuMemHostAlloc", Err(e)),
        };
        let mut words = MappedWords {
            device: device.clone(),
            host,
            device_ptr: 0,
            len,
        };
        // SAFETY: `host` points at `bytes` writable bytes nobody else sees yet.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; `dptr` is a valid local.
        let r = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0).result()
        };
        device.check("cuMemHostGetDevicePointer", r)?;
        words.device_ptr = dptr;
        Ok(words)
    }

    /// The words, as the host reaches them.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // SAFETY: `host` points at `len` initialised words owned by `self`; AtomicU64 has
        // u64's layout and every access goes through it.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    /// The address a kernel reaches the words at.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.device_ptr
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        if let Err(e) = self.device.free_host(self.host as u64) {
            tracing::warn!("freeing mapped host memory failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::entry_names;

    #[test]
    fn entry_names_come_from_ptx() {
        let ptx = ".version 8.0\n.visible .entry fill_f32(\n\t.param .u64 a\n)\n.entry local_k (\n";
        assert_eq!(
            entry_names(ptx).collect::<Vec<_>>(),
            ["fill_f32", "local_k"]
        );
    }
}
