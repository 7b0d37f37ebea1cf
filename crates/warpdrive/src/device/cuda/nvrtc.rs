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

/// PTX of `text` (the source `kernel`, whole: prelude and fragments included) for `arch`
/// with NVRTC `options` ([`compile_options`]); a rejected source returns NVRTC's log.
pub(crate) fn compile_ptx(
    kernel: &str,
    text: String,
    arch: Arch,
    options: Vec<String>,
) -> Result<String> {
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
        options,
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

/// PTX and the cubin (machine code for `arch` itself: `arch` names a real architecture) of
/// `text` from one NVRTC compile, so a later start can load the cubin without the driver's
/// JIT; a rejected source returns NVRTC's log.
pub(crate) fn compile_image(kernel: &str, text: String, arch: Arch) -> Result<(String, Vec<u8>)> {
    use cudarc::nvrtc::{result, sys};
    nvrtc_version()?;
    let fail = |log: String| Error::Compile {
        kernel: kernel.into(),
        arch: arch.name(),
        log,
    };
    let src =
        std::ffi::CString::new(text).map_err(|_| fail("source contains a NUL byte".into()))?;
    let name = std::ffi::CString::new(format!("{kernel}.cu"))
        .map_err(|_| fail("name contains a NUL byte".into()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    /// Destroys the program however this function returns.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created by create_program above and destroyed only here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    let options = compile_options(arch, false);
    // SAFETY: `prog.0` is a live program (created above, destroyed at the end of this call).
    if let Err(e) = unsafe { result::compile_program(prog.0, &options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|_| format!("{e:?}"));
        return Err(fail(log));
    }
    // SAFETY: as above; the program compiled.
    let ptx =
        unsafe { result::get_ptx(prog.0) }.map_err(|e| fail(format!("nvrtcGetPTX: {e:?}")))?;
    let mut size = 0usize;
    // SAFETY: as above; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size).result() }
        .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: as above; `cubin` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()).result() }
        .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
    Ok((c_chars_to_string(&ptx), cubin))
}

/// A NUL-terminated C string from NVRTC as text.
fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// NVRTC's options for `arch` (part of the PTX cache's key); `relocatable` code may call
/// functions defined elsewhere (the device runtime's graph launches), resolved when the
/// driver links it ([`CudaDevice::load_module_with_device_runtime`]).
///
/// [`CudaDevice::load_module_with_device_runtime`]: super::CudaDevice::load_module_with_device_runtime
pub(crate) fn compile_options(arch: Arch, relocatable: bool) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    if relocatable {
        options.push("--relocatable-device-code=true".into());
    }
    options
}
