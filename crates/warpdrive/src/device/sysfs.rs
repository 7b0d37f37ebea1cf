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

/// Where host memory and staging threads for a GPU belong: its NUMA node and that node's
/// CPUs. `node: None` means placement is a no-op (one node, or no node named for the GPU).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct NumaPlacement {
    /// NUMA nodes on the machine (0 when sysfs lists none).
    pub nodes: usize,
    /// The GPU's node, when placement applies.
    pub node: Option<i32>,
    /// The node's CPUs (empty when placement is a no-op).
    pub cpus: Vec<usize>,
}

impl NumaPlacement {
    /// Placement for a GPU on `gpu_node` (from [`PciDevice::numa_node`]), with the node
    /// tree read under `root` (`/sys`, or a fake tree in tests).
    pub fn detect(root: &Path, gpu_node: Option<i32>) -> Self {
        let node_dir = root.join("devices/system/node");
        let nodes = std::fs::read_dir(&node_dir)
            .map(|dir| {
                dir.filter_map(|e| e.ok())
                    .filter(|e| {
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        name.strip_prefix("node")
                            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    })
                    .count()
            })
            .unwrap_or(0);
        let cpus = gpu_node
            .filter(|_| nodes > 1)
            .and_then(|n| std::fs::read_to_string(node_dir.join(format!("node{n}/cpulist"))).ok())
            .and_then(|text| parse_cpulist(&text));
        match cpus {
            Some(cpus) if !cpus.is_empty() => NumaPlacement {
                nodes,
                node: gpu_node,
                cpus,
            },
            _ => NumaPlacement {
                nodes,
                node: None,
                cpus: Vec::new(),
            },
        }
    }

    /// True when placement does something (more than one node and the GPU's is known).
    pub fn applies(&self) -> bool {
        self.node.is_some()
    }

    /// Pins the calling thread (a staging thread) to the node's CPUs; a no-op when placement
    /// does not apply. Returns whether it pinned.
    pub fn pin_current_thread(&self) -> crate::error::Result<bool> {
        if !self.applies() {
            return Ok(false);
        }
        pin_current_thread_to(&self.cpus)?;
        Ok(true)
    }
}

/// Pins the calling thread to `cpus` (CPUs at or above `CPU_SETSIZE` are left out).
pub fn pin_current_thread_to(cpus: &[usize]) -> crate::error::Result<()> {
    // SAFETY: `cpu_set_t` is plain bits; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `cpu` is below CPU_SETSIZE, within the set.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the given size.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(crate::error::Error::io(
            "sched_setaffinity",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Parses a sysfs CPU list (`0-3,8,10-11`); `None` when malformed.
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// The largest CPU cache of CPU 0 in bytes (the last level), from
/// `/sys/devices/system/cpu/cpu0/cache/index*/size` under `root`.
pub fn last_level_cache_bytes(root: &Path) -> Option<usize> {
    let dir = root.join("devices/system/cpu/cpu0/cache");
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
}

/// `307200K`, `2048K`, `32M`, `512` (bytes).
fn parse_size(text: &str) -> Option<usize> {
    let (num, unit) = match text.char_indices().last()? {
        (i, 'K') => (&text[..i], 1 << 10),
        (i, 'M') => (&text[..i], 1 << 20),
        (i, 'G') => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(unit)
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

/// Whether the GPUDirect Storage kernel driver (`nvidia-fs`) is loaded under `root` (`/` on
/// a live system): without it cuFile runs in compatibility mode, reading through host
/// bounce buffers.
pub fn gds_kernel_driver(root: &Path) -> bool {
    root.join("proc/driver/nvidia-fs").exists() || root.join("sys/module/nvidia_fs").exists()
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_gds_driver_is_found_under_either_path() {
        let root = std::env::temp_dir().join(format!("warpdrive-gds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        assert!(!gds_kernel_driver(&root));
        std::fs::create_dir_all(root.join("sys/module/nvidia_fs")).unwrap();
        assert!(gds_kernel_driver(&root));
        std::fs::remove_dir_all(root.join("sys")).unwrap();
        std::fs::create_dir_all(root.join("proc/driver/nvidia-fs")).unwrap();
        assert!(gds_kernel_driver(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }
    use super::*;

    #[test]
    fn finds_the_largest_cache() {
        let root = std::env::temp_dir().join(format!("wd-llc-{}", std::process::id()));
        for (i, size) in ["48K", "2048K", "307200K", "32K"].iter().enumerate() {
            let d = root.join(format!("devices/system/cpu/cpu0/cache/index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(last_level_cache_bytes(&root), Some(307_200 << 10));
        assert_eq!(last_level_cache_bytes(&root.join("absent")), None);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size("x1K"), None);
    }

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
    fn numa_on_a_fake_two_node_tree() {
        let root = std::env::temp_dir().join(format!("wd-numa-{}", std::process::id()));
        let dev = root.join("bus/pci/devices/0000:1b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        for (n, cpus) in [(0, "0-3,8\n"), (1, "4-7,9-10\n")] {
            let d = root.join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), cpus).unwrap();
        }
        std::fs::create_dir_all(root.join("devices/system/node/power")).unwrap();
        let gpu = PciDevice::with_root(&root, "0000:1b:00.0").numa_node();
        let p = NumaPlacement::detect(&root, gpu);
        assert_eq!(p.nodes, 2);
        assert_eq!(p.node, Some(1));
        assert_eq!(p.cpus, vec![4, 5, 6, 7, 9, 10]);
        assert!(p.applies());
        // No node for the GPU (a VM's sysfs says -1): the no-op.
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        let gpu = PciDevice::with_root(&root, "0000:1b:00.0").numa_node();
        let p = NumaPlacement::detect(&root, gpu);
        assert_eq!((p.nodes, p.node, p.cpus.len()), (2, None, 0));
        assert!(!p.pin_current_thread().unwrap());
        // One node: the no-op even when the GPU names it.
        std::fs::remove_dir_all(root.join("devices/system/node/node1")).unwrap();
        let p = NumaPlacement::detect(&root, Some(0));
        assert_eq!((p.nodes, p.node), (1, None));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-2,5\n"), Some(vec![0, 1, 2, 5]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn generation_table() {
        assert_eq!(pcie_generation(16.0), Some(4));
        assert_eq!(pcie_generation(8.0), Some(3));
        assert_eq!(pcie_generation(3.0), None);
    }
}
