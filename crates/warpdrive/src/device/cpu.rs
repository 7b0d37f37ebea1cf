//! The CPU backend's raw memory: host allocations addressed by integer pointers, so the same
//! `Buffer<T>` (and later the same pool logic) works on both backends. Work on a CPU stream
//! runs at once, on the calling thread.

use std::alloc::Layout;

use crate::error::{Error, Result};

use super::{shared_host, DeviceInfo, LibraryStatus};

/// Alignment of every CPU allocation: enough for 16-byte vectors and cache lines.
pub(crate) const ALIGN: usize = 256;

fn layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes, ALIGN)
        .map_err(|_| Error::InvalidArgument(format!("allocation of {bytes} bytes is too large")))
}

/// Allocates `bytes > 0` of host memory aligned to [`ALIGN`].
pub(crate) fn alloc(bytes: usize) -> Result<u64> {
    let layout = layout(bytes)?;
    // Zeroed, so a buffer's contents are always initialised values even before its first
    // write (every `DType` is valid for any bits).
    // SAFETY: `bytes > 0` (callers never allocate empty ranges), so the layout is non-zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(Error::OutOfMemory {
            requested: bytes,
            detail: "host allocator refused".into(),
        });
    }
    Ok(ptr as u64)
}

/// As [`alloc`], in memory other processes of the host can map ([`shared_host`]) from
/// [`SHARE_FROM`](shared_host::SHARE_FROM) bytes once it is enabled, while the host has that
/// much available (a memory file is not refused up front the way an allocation is).
pub(crate) fn alloc_shareable(bytes: usize) -> Result<u64> {
    if bytes >= shared_host::SHARE_FROM && shared_host::enabled() && bytes <= mem_info().0 {
        if let Some(ptr) = shared_host::alloc(bytes) {
            return Ok(ptr);
        }
    }
    alloc(bytes)
}

/// Frees memory returned by [`alloc`] or [`alloc_shareable`] with the same `bytes`.
pub(crate) fn free(ptr: u64, bytes: usize) {
    if shared_host::free(ptr, bytes) {
        return;
    }
    if let Ok(layout) = layout(bytes) {
        // SAFETY: `ptr` came from `alloc(bytes)` with this layout and is freed once, here.
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
    }
}

/// `bytes > 0` of page-aligned anonymous memory whose pages come from NUMA node `node`
/// (`mbind` with `MPOL_BIND`, before any page is touched). Free with [`unmap`].
pub(crate) fn map_on_node(bytes: usize, node: u32) -> Result<u64> {
    const MASK_WORDS: usize = 16;
    if node as usize >= MASK_WORDS * 64 {
        return Err(Error::InvalidArgument(format!(
            "NUMA node {node} is out of range"
        )));
    }
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing; the
    // result is checked for MAP_FAILED.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::OutOfMemory {
            requested: bytes,
            detail: format!("mmap refused: {}", std::io::Error::last_os_error()),
        });
    }
    let mut mask = [0u64; MASK_WORDS];
    mask[node as usize / 64] |= 1 << (node % 64);
    // SAFETY: `ptr..ptr+bytes` is the mapping made above; the mask holds MASK_WORDS·64 bits.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr,
            bytes,
            libc::MPOL_BIND,
            mask.as_ptr(),
            (MASK_WORDS * 64) as libc::c_ulong,
            0 as libc::c_uint,
        )
    };
    if r != 0 {
        let err = std::io::Error::last_os_error();
        unmap(ptr as u64, bytes);
        return Err(Error::io(format!("mbind to NUMA node {node}"), err));
    }
    Ok(ptr as u64)
}

/// Frees memory from [`map_on_node`] with the same `bytes`.
pub(crate) fn unmap(ptr: u64, bytes: usize) {
    // SAFETY: `ptr` came from `map_on_node(bytes)` and is unmapped once, here.
    if unsafe { libc::munmap(ptr as *mut libc::c_void, bytes) } != 0 {
        tracing::warn!("munmap failed: {}", std::io::Error::last_os_error());
    }
}

/// A shared view of `len` elements at `ptr`.
///
/// # Safety
/// `ptr` must be a live CPU allocation holding `len` initialised `T`s, not written through
/// any other reference for `'a`.
pub(crate) unsafe fn view<'a, T>(ptr: u64, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: forwarded from this function's contract; `ptr` is non-null and aligned.
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// An exclusive view of `len` elements at `ptr`.
///
/// # Safety
/// As [`view`], and no other reference to the range may exist for `'a`.
pub(crate) unsafe fn view_mut<'a, T>(ptr: u64, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) }
}

/// The CPU backend's "DMA": copies `bytes` from host memory at `host` into this backend's
/// memory at `dev` (`to_device`), or back, on the calling thread.
///
/// # Safety
/// `host` and `dev` each hold `bytes` bytes, the two ranges do not overlap, and no other
/// thread writes either of them (nor reads the one written) during the call.
pub(crate) unsafe fn copy_raw(to_device: bool, host: *mut u8, dev: u64, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let (src, dst) = if to_device {
        (host as *const u8, dev as *mut u8)
    } else {
        (dev as *const u8, host)
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
}

fn meminfo_kib(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The CPU's model name from `/proc/cpuinfo` (the architecture where that is unreadable).
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// (available, total) bytes of host memory; zeros when /proc/meminfo cannot be read.
/// Swap space in bytes (`SwapTotal`; 0 where unknown).
pub(crate) fn swap_total_bytes() -> usize {
    meminfo_kib("SwapTotal:").unwrap_or(0) as usize * 1024
}

pub(crate) fn mem_info() -> (usize, usize) {
    let kib = |key| meminfo_kib(key).unwrap_or(0) as usize * 1024;
    (kib("MemAvailable:"), kib("MemTotal:"))
}

pub(crate) fn info(libraries: Vec<LibraryStatus>) -> DeviceInfo {
    DeviceInfo {
        backend: "cpu",
        ordinal: None,
        name: cpu_model(),
        compute_capability: None,
        arch: Some(std::env::consts::ARCH.to_string()),
        sms: None,
        cpu_threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory_total: meminfo_kib("MemTotal:").unwrap_or(0) * 1024,
        memory_free: meminfo_kib("MemAvailable:").unwrap_or(0) * 1024,
        l2_bytes: None,
        pci_bus_id: None,
        pcie_gen: None,
        pcie_width: None,
        numa_node: None,
        numa: super::sysfs::NumaPlacement::default(),
        driver: None,
        cuda: None,
        libraries,
    }
}

/// Row-major `c[m×n] = op(a) · op(b)` in f32 through the `gemm` crate, on all cores:
/// `a` is m×k (k×m when `trans_a`), `b` k×n (n×k when `trans_b`).
pub(crate) fn gemm_f32(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    (trans_a, trans_b): (bool, bool),
) -> Result<()> {
    let need = |what: &str, have: usize, want: Option<usize>| match want {
        Some(w) if have >= w => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "gemm: {what} holds {have} elements, {m}x{n}x{k} needs more"
        ))),
    };
    need("a", a.len(), m.checked_mul(k))?;
    need("b", b.len(), k.checked_mul(n))?;
    need("c", c.len(), m.checked_mul(n))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1);
    // Small products are not worth waking the thread pool for.
    let parallelism = if threads > 1 && m * n * k >= 1 << 18 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // (column stride, row stride) of each operand as stored.
    let (a_cs, a_rs) = if trans_a { (m, 1) } else { (1, k) };
    let (b_cs, b_rs) = if trans_b { (k, 1) } else { (1, n) };
    // SAFETY: the three slices hold at least m·k, k·n and m·n elements (checked above), laid
    // out with the strides given; `c` does not alias `a` or `b` (`&mut`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// The CPU backend's per-device state (there is one CPU device per process).
pub(super) fn state() -> &'static super::DeviceState {
    static STATE: super::DeviceState = super::DeviceState::new();
    &STATE
}
