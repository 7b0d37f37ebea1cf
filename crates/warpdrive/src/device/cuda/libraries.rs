//! Which CUDA libraries load here (checked once), their versions, and the device count.

use std::sync::OnceLock;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};

use crate::error::{Error, Result};

use super::super::LibraryStatus;
use super::context::describe;

/// Which dynamically loaded CUDA libraries can be opened on this machine. Checked once.
pub(crate) struct Libraries {
    pub driver: bool,
    pub nvrtc: bool,
    pub cublas: bool,
    pub cublaslt: bool,
    pub nccl: bool,
    pub cufile: bool,
}

pub(crate) fn libraries() -> &'static Libraries {
    static LIBS: OnceLock<Libraries> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen each candidate name and drops the handle.
    LIBS.get_or_init(|| unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
            cublaslt: cudarc::cublaslt::sys::is_culib_present(),
            nccl: cudarc::nccl::sys::is_culib_present(),
            cufile: cudarc::cufile::sys::is_culib_present(),
        }
    })
}

/// Initialises the driver and returns the number of CUDA devices.
pub(crate) fn device_count() -> Result<usize> {
    if !libraries().driver {
        return Err(Error::NoDriver(
            "libcuda.so could not be loaded (is the NVIDIA driver installed?)".into(),
        ));
    }
    result::init().map_err(|e| Error::NoDriver(describe(e)))?;
    let n = result::device::get_count().map_err(|e| Error::NoDriver(describe(e)))?;
    Ok(n.max(0) as usize)
}

/// Whether each CUDA library loads here, and its version when it does.
pub(crate) fn library_statuses() -> Vec<LibraryStatus> {
    let libs = libraries();
    let status = |name: &'static str, loaded: bool, version: Option<String>| LibraryStatus {
        name,
        loaded,
        version,
    };
    let driver_version = libs.driver.then(|| {
        let mut v = 0;
        // SAFETY: the driver library is loaded; the out-pointer is a valid local.
        let ok = unsafe { sys::cuDriverGetVersion(&mut v) } == CUresult::CUDA_SUCCESS;
        ok.then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
    });
    let cublas_version = libs.cublas.then(|| {
        use cudarc::cublas::sys::{cublasGetProperty, cublasStatus_t, libraryPropertyType};
        let mut parts = [0; 3];
        let kinds = [
            libraryPropertyType::MAJOR_VERSION,
            libraryPropertyType::MINOR_VERSION,
            libraryPropertyType::PATCH_LEVEL,
        ];
        for (slot, kind) in parts.iter_mut().zip(kinds) {
            // SAFETY: libcublas is loaded; the out-pointer is a valid local.
            if unsafe { cublasGetProperty(kind, slot) } != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return None;
            }
        }
        Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
    });
    let cublaslt_version = libs.cublaslt.then(|| {
        // SAFETY: libcublasLt is loaded; the call takes no arguments.
        let v = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    });
    let nccl_version = libs.nccl.then(|| {
        super::nccl::nccl_version_code()
            .ok()
            .map(|v| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    });
    let cufile_version = libs.cufile.then(|| {
        let mut v = 0;
        // SAFETY: libcufile is loaded; the out-pointer is a valid local.
        let r = unsafe { cudarc::cufile::sys::cuFileGetVersion(&mut v) };
        (r.err == cudarc::cufile::sys::CUfileOpError::CU_FILE_SUCCESS)
            .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
    });
    vec![
        status("driver", libs.driver, driver_version.flatten()),
        status(
            "nvrtc",
            libs.nvrtc,
            super::nvrtc::nvrtc_version()
                .ok()
                .map(|(a, b)| format!("{a}.{b}")),
        ),
        status("cublas", libs.cublas, cublas_version.flatten()),
        status("cublaslt", libs.cublaslt, cublaslt_version.flatten()),
        status("nccl", libs.nccl, nccl_version.flatten()),
        status("cufile", libs.cufile, cufile_version.flatten()),
    ]
}

/// Whether libcufile loads here.
pub(crate) fn cufile_loads() -> bool {
    libraries().cufile
}
