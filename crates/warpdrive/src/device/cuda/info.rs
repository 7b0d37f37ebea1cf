//! Device information (`DeviceInfo`).

use std::ffi::c_int;

use cudarc::driver::sys::{self, CUdevice_attribute as Attr};

use crate::error::Result;

use super::super::DeviceInfo;
use super::context::CudaDevice;
use super::libraries::library_statuses;

impl CudaDevice {
    // ---- device information ----

    pub(crate) fn info(&self) -> Result<DeviceInfo> {
        self.bind()?;
        let name = self.check("cuDeviceGetName", self.inner.ctx.name())?;
        let (free, total) = self.mem_info()?;
        let sms = self.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let l2 = self.l2_cache_bytes()?;
        let bus_id = self.pci_bus_id().ok();
        let sysfs = bus_id.as_deref().map(super::sysfs::PciDevice::new);
        let (pcie_gen, pcie_width) = sysfs
            .as_ref()
            .map(|d| (d.link_generation(), d.link_width()))
            .unwrap_or((None, None));
        let numa_node = sysfs.as_ref().and_then(|d| d.numa_node());
        let numa = super::sysfs::NumaPlacement::detect(std::path::Path::new("/sys"), numa_node);
        let mut cuda_version = 0;
        // SAFETY: the driver is loaded; the out-pointer is a valid local.
        let r = unsafe { sys::cuDriverGetVersion(&mut cuda_version).result() };
        self.check("cuDriverGetVersion", r)?;
        let (major, minor) = self.inner.compute_capability;
        Ok(DeviceInfo {
            backend: "cuda",
            ordinal: Some(self.inner.ordinal),
            name,
            compute_capability: Some(format!("{major}.{minor}")),
            arch: Some(self.arch().name().to_string()),
            sms: Some(sms.max(0) as u32),
            cpu_threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_total: total as u64,
            memory_free: free as u64,
            l2_bytes: Some(l2 as u64),
            pci_bus_id: bus_id,
            pcie_gen,
            pcie_width,
            numa_node,
            numa,
            driver: super::sysfs::nvidia_driver_version(),
            cuda: Some(format!(
                "{}.{}",
                cuda_version / 1000,
                (cuda_version % 1000) / 10
            )),
            libraries: library_statuses(),
        })
    }

    pub(super) fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is valid for its stated length; the driver NUL-terminates it.
        let r = unsafe {
            sys::cuDeviceGetPCIBusId(
                buf.as_mut_ptr(),
                buf.len() as c_int,
                self.inner.ctx.cu_device(),
            )
            .result()
        };
        self.check("cuDeviceGetPCIBusId", r)?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).to_lowercase())
    }
}
