//! NVRTC: CUDA C to PTX, on the host (no GPU needed).

use crate::device::Arch;
use crate::error::{Error, Result};

use super::libraries::libraries;

/// NVRTC's version as `major.minor`, or an error saying how to make it available.
pub(crate) fn nvrtc_version() -> Result<(i32, i32)> {
    let missing = || Error::LibraryMissing {
        library: "NVRTC",
        hint: "libnvrtc.so.13 not found; put CUDA's lib64 (or the folder from \
               `eval \"$(scripts/setup-nvrtc)\"`) on LD_LIBRARY_PATH"
            .into(),
    };
    if !libraries().nvrtc {
        return Err(missing());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (checked above); both out-pointers are valid locals.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        Ok((major, minor))
    } else {
        Err(missing())
    }
}

/// PTX of `text` (the source `kernel`, whole: prelude and fragments included) for `arch`; a
/// rejected source returns NVRTC's log.
pub(crate) fn compile_ptx(kernel: &str, text: String, arch: Arch) -> Result<String> {
    nvrtc_version()?;
    let fail = |log: String| Error::Compile {
        kernel: kernel.into(),
        arch: arch.name(),
        log,
    };
    if text.contains('\0') {
        return Err(fail("source contains a NUL byte".into()));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: compile_options(arch),
        name: Some(format!("{kernel}.cu")),
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(text, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
            Err(fail(log.to_string_lossy().into_owned()))
        }
        Err(e) => Err(fail(format!("{e:?}"))),
    }
}

/// NVRTC's options for `arch` (part of the PTX cache's key).
pub(crate) fn compile_options(arch: Arch) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}
