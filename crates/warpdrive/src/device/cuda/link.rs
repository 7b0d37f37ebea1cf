//! The driver's linker: relocatable PTX linked with the CUDA device runtime
//! (`libcudadevrt.a`), the code kernels that launch graphs from the device need. No nvcc: the
//! driver links (`cuLink*`), the library comes from the CUDA installation.

use std::ffi::{c_void, CString};
use std::path::PathBuf;

use cudarc::driver::sys::{self, CUjitInputType, CUjit_option};

use crate::error::{Error, Result};

use super::context::CudaDevice;
use super::launch::Module;

/// Where the device runtime library is looked for, in order: `$CUDA_HOME` and `$CUDA_PATH`,
/// then `/usr/local/cuda`, each with its `lib64` and `targets/<arch>-linux/lib` folders.
fn candidates() -> Vec<PathBuf> {
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda")));
    let target = format!("targets/{}-linux/lib", std::env::consts::ARCH);
    roots
        .flat_map(|r| [r.join("lib64"), r.join(&target)])
        .map(|d| d.join("libcudadevrt.a"))
        .collect()
}

/// The CUDA device runtime library, or an error naming where it was looked for.
pub(crate) fn device_runtime_library() -> Result<PathBuf> {
    let tried = candidates();
    tried
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| Error::LibraryMissing {
            library: "CUDA device runtime (libcudadevrt.a)",
            hint: format!(
                "kernels that launch work from the device link with it; looked in {}; set \
                 CUDA_HOME to the CUDA installation that has it",
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
}

/// A link in progress, destroyed however the link ends.
struct LinkState(sys::CUlinkState);

impl Drop for LinkState {
    fn drop(&mut self) {
        // SAFETY: created by cuLinkCreate and destroyed only here; the cubin it produced has
        // been copied out before.
        let _ = unsafe { sys::cuLinkDestroy(self.0) };
    }
}

impl CudaDevice {
    /// Links relocatable `ptx` with the device runtime library and loads the result on this
    /// device. A failed link returns the linker's log.
    pub(crate) fn load_module_with_device_runtime(&self, ptx: &str) -> Result<Module> {
        let library = device_runtime_library()?;
        let cubin = self.link_with_device_runtime(ptx, &library)?;
        self.load_module_image(&cubin)
    }

    fn link_with_device_runtime(&self, ptx: &str, library: &std::path::Path) -> Result<Vec<u8>> {
        self.bind()?;
        let fail = |step: &str, log: &[u8]| {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            Error::Compile {
                kernel: "device runtime link".into(),
                arch: self.arch().name(),
                log: format!("{step}: {}", String::from_utf8_lossy(&log[..end])),
            }
        };
        let ptx = CString::new(ptx).map_err(|_| fail("PTX", b"contains a NUL byte"))?;
        let path = CString::new(library.as_os_str().as_encoded_bytes())
            .map_err(|_| fail("library path", b"contains a NUL byte"))?;
        let mut log = vec![0u8; 16 * 1024];
        let mut options = [
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ];
        // The driver reads option values as pointer-sized words: a pointer, then a size.
        let mut values = [log.as_mut_ptr().cast::<c_void>(), log.len() as *mut c_void];
        let mut state: sys::CUlinkState = std::ptr::null_mut();
        // SAFETY: two options with their values (the log buffer outlives the link state,
        // dropped at the end of this function before `log`); `state` is a valid out-pointer.
        let r = unsafe {
            sys::cuLinkCreate_v2(2, options.as_mut_ptr(), values.as_mut_ptr(), &mut state)
        };
        self.check("cuLinkCreate", r.result())?;
        let state = LinkState(state);
        let name = c"device_launch.ptx";
        // SAFETY: the link state is live; the PTX is NUL-terminated and its size counts the
        // NUL as the driver expects for text input; no per-input options.
        let r = unsafe {
            sys::cuLinkAddData_v2(
                state.0,
                CUjitInputType::CU_JIT_INPUT_PTX,
                ptx.as_ptr() as *mut c_void,
                ptx.as_bytes_with_nul().len(),
                name.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if r.result().is_err() {
            return Err(fail("adding the PTX", &log));
        }
        // SAFETY: the link state is live; the path is NUL-terminated; no per-input options.
        let r = unsafe {
            sys::cuLinkAddFile_v2(
                state.0,
                CUjitInputType::CU_JIT_INPUT_LIBRARY,
                path.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if r.result().is_err() {
            return Err(fail(&format!("adding {}", library.display()), &log));
        }
        let mut cubin: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: the link state is live; both out-pointers are valid locals.
        let r = unsafe { sys::cuLinkComplete(state.0, &mut cubin, &mut size) };
        if r.result().is_err() || cubin.is_null() {
            return Err(fail("linking", &log));
        }
        // SAFETY: the driver owns `size` bytes at `cubin` until the link state is destroyed
        // (after this copy).
        let bytes = unsafe { std::slice::from_raw_parts(cubin.cast::<u8>(), size) }.to_vec();
        Ok(bytes)
    }
}
