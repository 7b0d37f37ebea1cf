//! Host memory that other processes of this host can map: once a process has joined a CPU
//! process group over shared memory ([`enable`]), the CPU backend's raw allocations from
//! [`SHARE_FROM`] bytes (a `Buffer`'s pool segments) are memory files (`memfd`) mapped
//! shared, so the group can work on its ranks' buffers in place, as the in-process group's
//! threads do (the lent all-reduce in `dist/procs.rs`), with no copy into a common area or
//! through the kernel. Other processes keep ordinary memory (anonymous memory may get
//! transparent huge pages where shared memory does not); where a memory file cannot be made
//! the allocation is ordinary memory and the group keeps its other paths.
//!
//! A peer finds a region by the owner's process id and descriptor (`/proc/PID/fd/FD`, which
//! needs the same permission as reading the owner's memory) and checks the file's name, which
//! carries a token drawn for the region: a descriptor number reused by a newer region never
//! passes for an older one.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Raw allocations from this many bytes are made shareable.
pub(crate) const SHARE_FROM: usize = 1 << 20;
/// Regions alive at once at most: each holds a descriptor, and the process's other files
/// and sockets need theirs (a quarter of the soft limit, at most this many).
const MAX_REGIONS: usize = 256;

struct Region {
    fd: OwnedFd,
    len: usize,
    token: u64,
}

/// This process's shareable regions by start address.
static REGIONS: Mutex<BTreeMap<usize, Region>> = Mutex::new(BTreeMap::new());
/// Whether the CPU backend's large allocations are made shareable ([`enable`]).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// From now on, the CPU backend's large allocations are shareable: this process is a rank of
/// a process group over shared memory.
pub(crate) fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Where a range of this process's memory lives, as a peer needs it to map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shown {
    pub fd: i32,
    pub token: u64,
    /// Bytes of the whole region.
    pub len: usize,
    /// Where the range starts in the region.
    pub offset: usize,
}

fn name(token: u64) -> String {
    format!("warpdrive-{token:016x}")
}

/// `bytes` of zeroed, page-aligned memory in a memory file mapped shared, or `None` where
/// one cannot be made (no `memfd`, out of descriptors): the caller allocates otherwise.
pub(crate) fn alloc(bytes: usize) -> Option<u64> {
    if REGIONS.lock().len() >= region_limit() {
        return None;
    }
    let token = rand::random::<u64>();
    let cname = std::ffi::CString::new(name(token)).ok()?;
    // SAFETY: a NUL-terminated name and valid flags; the result is checked.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a descriptor this call just opened and nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let size = libc::off_t::try_from(bytes).ok()?;
    // SAFETY: `fd` is open for writing; the result is checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return None;
    }
    let ptr = map(&fd, bytes, false).ok()?;
    REGIONS.lock().insert(
        ptr,
        Region {
            fd,
            len: bytes,
            token,
        },
    );
    Some(ptr as u64)
}

/// How many regions may be alive at once: [`MAX_REGIONS`], or a quarter of the descriptors
/// the process may open when that is fewer.
fn region_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid rlimit for the call to fill; the result is checked.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
        let quarter = usize::try_from(lim.rlim_cur / 4).unwrap_or(usize::MAX);
        if ok {
            quarter.min(MAX_REGIONS)
        } else {
            0
        }
    })
}

/// Frees `ptr` if [`alloc`] made it (`true`), else leaves it to the caller (`false`).
pub(crate) fn free(ptr: u64, bytes: usize) -> bool {
    let Some(region) = REGIONS.lock().remove(&(ptr as usize)) else {
        return false;
    };
    debug_assert_eq!(region.len, bytes);
    unmap(ptr as usize, region.len);
    true
}

/// The region holding `bytes` from `ptr` of this process, if [`alloc`] made one.
pub(crate) fn find(ptr: usize, bytes: usize) -> Option<Shown> {
    let regions = REGIONS.lock();
    let (&start, region) = regions.range(..=ptr).next_back()?;
    let offset = ptr - start;
    (offset.checked_add(bytes)? <= region.len).then(|| Shown {
        fd: region.fd.as_raw_fd(),
        token: region.token,
        len: region.len,
        offset,
    })
}

/// Another process's region mapped into this one (unmapped on drop).
pub(crate) struct PeerRegion {
    ptr: usize,
    len: usize,
    token: u64,
    /// The owner's process and descriptor, to tell whether it still holds the region.
    pid: i32,
    fd: i32,
}

/// Whether `/proc/PID/fd/FD` is the file of the region with `token`.
fn names(path: &str, token: u64) -> Option<bool> {
    let link = std::fs::read_link(path).ok()?;
    Some(
        link.to_string_lossy()
            .starts_with(&format!("/memfd:{}", name(token))),
    )
}

impl PeerRegion {
    /// Maps the region process `pid` showed (`shown.offset` aside), after checking that its
    /// descriptor is still that region's file.
    pub(crate) fn open(pid: i32, shown: &Shown) -> Result<PeerRegion> {
        let path = format!("/proc/{pid}/fd/{}", shown.fd);
        let io = |what: &str, e: std::io::Error| Error::io(format!("{what} {path}"), e);
        if names(&path, shown.token) != Some(true) {
            return Err(Error::InvalidArgument(format!(
                "{path} is not the region shown ({})",
                name(shown.token)
            )));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io("opening", e))?;
        let len = file.metadata().map_err(|e| io("reading", e))?.len();
        if len != shown.len as u64 {
            return Err(Error::InvalidArgument(format!(
                "{path} holds {len} bytes, not the {} shown",
                shown.len
            )));
        }
        let fd = OwnedFd::from(file);
        // Populated now: the first call that touches it would fault page by page otherwise.
        let ptr = map(&fd, shown.len, true).map_err(|e| io("mapping", e))?;
        Ok(PeerRegion {
            ptr,
            len: shown.len,
            token: shown.token,
            pid,
            fd: shown.fd,
        })
    }

    pub(crate) fn token(&self) -> u64 {
        self.token
    }

    /// Whether the owner still holds the region: once it has freed it, this mapping is all
    /// that keeps its memory, and should go.
    pub(crate) fn owner_holds(&self) -> bool {
        names(&format!("/proc/{}/fd/{}", self.pid, self.fd), self.token) == Some(true)
    }
}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        unmap(self.ptr, self.len);
    }
}

/// One rank's buffer as the lent all-reduce sees it: a peer's, in a mapped region from
/// byte `offset`, or this rank's own.
pub(crate) enum Lent<'a, T> {
    Peer(&'a PeerRegion, usize),
    Own(&'a mut [T]),
}

/// Runs `work` on the elements `range` of every buffer in `buffers` (each `len` elements of
/// `T`), in their order.
///
/// The caller's protocol must hold what makes this sound (the process group's rounds do):
/// every peer's buffer stays mapped in its owner, which is inside the same collective and
/// touches none of `range` until this returns and the caller says so; no other rank works on
/// an overlapping range meanwhile.
pub(crate) fn with_lent<T: bytemuck::Pod, R>(
    buffers: Vec<Lent<'_, T>>,
    len: usize,
    range: std::ops::Range<usize>,
    work: impl FnOnce(&mut [&mut [T]]) -> R,
) -> Result<R> {
    let size = size_of::<T>();
    let bad = || Error::InvalidArgument(format!("elements {range:?} of a buffer of {len}"));
    if range.start > range.end || range.end > len {
        return Err(bad());
    }
    let mut parts = Vec::with_capacity(buffers.len());
    for b in buffers {
        match b {
            Lent::Own(own) => parts.push(own.get_mut(range.clone()).ok_or_else(bad)?),
            Lent::Peer(region, offset) => {
                let fits = len
                    .checked_mul(size)
                    .and_then(|b| b.checked_add(offset))
                    .is_some_and(|end| end <= region.len);
                if !fits {
                    return Err(bad());
                }
                let at = region.ptr + offset + range.start * size;
                if at % align_of::<T>() != 0 {
                    return Err(bad());
                }
                // SAFETY: `at .. at + range.len() × size` lies in the mapping (checked against
                // the region's length above) and is aligned for `T` (`Pod`: any bits valid);
                // the caller's protocol (this function's contract) makes it the only
                // reference to those bytes anywhere while `work` runs.
                parts.push(unsafe {
                    std::slice::from_raw_parts_mut(at as *mut T, range.end - range.start)
                });
            }
        }
    }
    Ok(work(&mut parts))
}

/// Maps `len` bytes of `fd` shared, read-write (populated when asked).
fn map(fd: &OwnedFd, len: usize, populate: bool) -> std::io::Result<usize> {
    let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
    // SAFETY: a new mapping at an address of the kernel's choosing over an open file of at
    // least `len` bytes; the result is checked for MAP_FAILED.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // Huge pages where the host gives them to shared memory (`shmem_enabled` advise or
    // always): anonymous memory may get them, and without them every 4 KiB is a TLB entry.
    // SAFETY: the mapping just made; advice only, its result does not matter.
    let _ = unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
    Ok(ptr as usize)
}

fn unmap(ptr: usize, len: usize) {
    // SAFETY: `ptr..ptr+len` is a mapping `map` made, unmapped once, by its one owner.
    if unsafe { libc::munmap(ptr as *mut libc::c_void, len) } != 0 {
        tracing::warn!(
            "munmap of a shared region failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_maps_into_a_peer_by_its_descriptor_and_token() {
        let bytes = SHARE_FROM;
        let ptr = alloc(bytes).expect("a memory file on Linux") as usize;
        let shown = find(ptr + 64, 128).unwrap();
        assert_eq!((shown.offset, shown.len), (64, bytes));
        assert!(find(ptr + bytes - 8, 16).is_none(), "past the region");
        let pid = i32::try_from(std::process::id()).unwrap();
        let peer = PeerRegion::open(pid, &shown).unwrap();
        let mut own = vec![0u32; 4];
        with_lent(
            vec![Lent::Peer(&peer, 64), Lent::Own(&mut own)],
            32,
            1..3,
            |parts| {
                parts[0].copy_from_slice(&[7, 8]);
                parts[1].copy_from_slice(&[1, 2]);
            },
        )
        .unwrap();
        // Written through the peer's mapping, read through the owner's.
        let mut word = [0u8; 4];
        word.copy_from_slice(&unsafe_read(ptr + 64 + 4));
        assert_eq!(u32::from_le_bytes(word), 7);
        assert_eq!(own, [0, 1, 2, 0]);
        let wrong = Shown {
            token: shown.token ^ 1,
            ..shown
        };
        assert!(PeerRegion::open(pid, &wrong).is_err(), "another token");
        let too_long = with_lent(
            vec![Lent::Peer(&peer, 64)],
            bytes,
            0..1,
            |_: &mut [&mut [u32]]| (),
        );
        assert!(too_long.is_err());
        assert!(peer.owner_holds());
        assert!(free(ptr as u64, bytes));
        assert!(!peer.owner_holds(), "the owner freed it");
        drop(peer);
        assert!(find(ptr, 8).is_none());
        assert!(!free(ptr as u64, bytes), "freed once");
    }

    fn unsafe_read(at: usize) -> [u8; 4] {
        // SAFETY: `at` is inside the region the test allocated and still holds.
        unsafe { std::ptr::read(at as *const [u8; 4]) }
    }
}
