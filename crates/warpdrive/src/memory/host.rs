//! Host memory sized from caller input: refused as an error value (never an abort) when
//! the machine cannot hold it.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::device::cpu;
use crate::error::{Error, Result};

/// The host's memory and swap in bytes (`MemTotal` + `SwapTotal`; 0 where unknown): the
/// kernel's own bound on one allocation under its default overcommit policy. Kept from the
/// last read; [`check_host_bytes`] reads again before refusing, since a VM's memory can
/// grow while it runs (Firecracker VMs start small).
fn host_total_bytes(fresh: bool) -> usize {
    static TOTAL: AtomicUsize = AtomicUsize::new(usize::MAX);
    let kept = TOTAL.load(Ordering::Relaxed);
    if !fresh && kept != usize::MAX {
        return kept;
    }
    let total = cpu::mem_info().1.saturating_add(cpu::swap_total_bytes());
    TOTAL.store(total, Ordering::Relaxed);
    total
}

/// Refuses `bytes` of host memory for `what` (`InvalidArgument`) when the machine has less
/// memory and swap in total: the kernel would refuse such a request too, and trying it with
/// a `Vec` aborts the process.
pub(crate) fn check_host_bytes(what: &str, bytes: usize) -> Result<()> {
    if bytes <= host_total_bytes(false) {
        return Ok(());
    }
    let total = host_total_bytes(true);
    if total > 0 && bytes > total {
        return Err(Error::InvalidArgument(format!(
            "{what}: {bytes} bytes, more than this host's {total} bytes of memory and swap"
        )));
    }
    Ok(())
}

/// An empty `Vec` with room for `len` elements of `T`, sized from caller input: refused
/// before it is tried as `check_host_bytes` says, and `OutOfMemory` when the allocator
/// refuses — an error value where `Vec::with_capacity` would abort the process.
pub fn host_vec<T>(what: &str, len: usize) -> Result<Vec<T>> {
    let bytes = crate::size::bytes_of::<T>(what, len)?;
    check_host_bytes(what, bytes)?;
    let mut vec = Vec::new();
    vec.try_reserve_exact(len).map_err(|e| Error::OutOfMemory {
        requested: bytes,
        detail: format!("{what}: the host allocator refused ({e})"),
    })?;
    Ok(vec)
}

/// `len` zero bytes, refused as [`host_vec`] refuses: large ones come from the allocator as
/// fresh zero pages (`calloc`), faulted in by whoever first writes them, with no zeroing
/// pass of their own (a buffer for a read to land in, page by page, on several threads).
pub(crate) fn host_zeroed(what: &str, len: usize) -> Result<Vec<u8>> {
    check_host_bytes(what, len)?;
    Ok(vec![0u8; len])
}

/// `len` copies of `value` in a [`host_vec`] (the fallible `vec![value; len]`).
pub(crate) fn host_filled<T: Clone>(what: &str, len: usize, value: T) -> Result<Vec<T>> {
    let mut vec = host_vec(what, len)?;
    vec.resize(len, value);
    Ok(vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_vecs_beyond_the_machine_are_errors_not_aborts() {
        for len in [usize::MAX, usize::MAX / 8, 1 << 60] {
            let err = host_vec::<u64>("test", len).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{len}: {err}");
            assert!(
                err.to_string().starts_with("invalid argument: test:"),
                "{err}"
            );
        }
        let total = host_total_bytes(true);
        if total > 0 {
            assert!(host_vec::<u8>("test", total + 1).is_err());
        }
        assert_eq!(host_filled("test", 3, 7u16).unwrap(), [7, 7, 7]);
        assert!(host_vec::<u32>("test", 1000).unwrap().capacity() >= 1000);
    }
}
