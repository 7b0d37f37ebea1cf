//! What sysfs says about a PCI device (link generation and width, NUMA node) and the driver.
//! The root is injectable so the parsing is tested on a fake tree.

use std::path::{Path, PathBuf};

/// A PCI device's sysfs folder, `<root>/bus/pci/devices/<bus id>`.
pub struct PciDevice {
    dir: PathBuf,
}

impl PciDevice {
    /// The device with PCI bus id `bus_id` (e.g. `0000:1b:00.0`) under the real `/sys`.
    pub fn new(bus_id: &str) -> Self {
        Self::with_root(Path::new("/sys"), bus_id)
    }

    /// The device under another sysfs root (tests).
    pub fn with_root(root: &Path, bus_id: &str) -> Self {
        PciDevice {
            dir: root
                .join("bus/pci/devices")
                .join(bus_id.to_ascii_lowercase()),
        }
    }

    fn read(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// PCIe generation from `current_link_speed` ("32.0 GT/s PCIe" is gen 5).
    pub fn link_generation(&self) -> Option<u32> {
        let speed = self.read("current_link_speed")?;
        let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
        pcie_generation(gts)
    }

    /// Lanes from `current_link_width`.
    pub fn link_width(&self) -> Option<u32> {
        self.read("current_link_width")?.parse().ok()
    }

    /// NUMA node, `None` where sysfs says -1 (no affinity) or nothing.
    pub fn numa_node(&self) -> Option<i32> {
        let node: i32 = self.read("numa_node")?.parse().ok()?;
        (node >= 0).then_some(node)
    }
}

/// PCIe generation for a per-lane transfer rate in GT/s.
pub fn pcie_generation(gts: f64) -> Option<u32> {
    const RATES: [(f64, u32); 7] = [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
        (128.0, 7),
    ];
    RATES
        .iter()
        .find(|(rate, _)| (gts - rate).abs() < 0.5)
        .map(|&(_, g)| g)
}

/// The NVIDIA kernel driver's version ("580.159.04"), from sysfs or procfs.
pub fn nvidia_driver_version() -> Option<String> {
    if let Ok(v) = std::fs::read_to_string("/sys/module/nvidia/version") {
        return Some(v.trim().to_string());
    }
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..."
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    text.lines()
        .next()?
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_fake_tree() {
        let root = std::env::temp_dir().join(format!("wd-sysfs-{}", std::process::id()));
        let dir = root.join("bus/pci/devices/0000:1b:00.0");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("current_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dir.join("current_link_width"), "16\n").unwrap();
        std::fs::write(dir.join("numa_node"), "1\n").unwrap();
        let d = PciDevice::with_root(&root, "0000:1B:00.0");
        assert_eq!(d.link_generation(), Some(5));
        assert_eq!(d.link_width(), Some(16));
        assert_eq!(d.numa_node(), Some(1));
        std::fs::write(dir.join("numa_node"), "-1\n").unwrap();
        assert_eq!(d.numa_node(), None);
        let missing = PciDevice::with_root(&root, "0000:ff:00.0");
        assert_eq!(missing.link_generation(), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn generation_table() {
        assert_eq!(pcie_generation(16.0), Some(4));
        assert_eq!(pcie_generation(8.0), Some(3));
        assert_eq!(pcie_generation(3.0), None);
    }
}
