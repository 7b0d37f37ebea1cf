//! Cross-memory attach (Linux `process_vm_readv` / `process_vm_writev`): a rank on the same
//! host copies straight from and into another rank's buffer, as the in-process group's
//! lending lets threads do. The shared-memory group's all-reduce uses it for buffers the
//! ranks cannot map from one another (`shared_host.rs`) where the kernel allows it (same user, no ptrace restriction, a seccomp profile that permits the calls):
//! each element is then read once and written once a rank, not staged through the segment.
//! The group tries it once when it starts ([`probe`]) and keeps the segment's path otherwise.
//! As with every collective, a rank that fails mid-call (a peer gone, the timeout) leaves its
//! buffer's contents unspecified: a slower peer may still be writing its part of it.

use std::io;

/// Copies `local.len()` bytes at address `remote` of process `pid` into `local`.
pub(crate) fn read(pid: i32, remote: usize, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let rest = &mut local[done..];
        let mine = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        let theirs = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `mine` covers `rest`, which this function borrows mutably for the call; the
        // kernel checks `theirs` against the other process's mappings (EFAULT otherwise).
        let n = unsafe { libc::process_vm_readv(pid, &mine, 1, &theirs, 1, 0) };
        done += advanced(n)?;
    }
    Ok(())
}

/// Copies `local` to address `remote` of process `pid`.
pub(crate) fn write(pid: i32, remote: usize, local: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let rest = &local[done..];
        let mine = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        let theirs = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `mine` covers `rest`, which the kernel only reads; it checks `theirs`
        // against the other process's mappings (EFAULT otherwise).
        let n = unsafe { libc::process_vm_writev(pid, &mine, 1, &theirs, 1, 0) };
        done += advanced(n)?;
    }
    Ok(())
}

/// Bytes a call moved, or its error (none moved is an error too: the loop would not end).
fn advanced(n: isize) -> io::Result<usize> {
    match usize::try_from(n) {
        Ok(0) => Err(io::Error::new(io::ErrorKind::WriteZero, "no bytes moved")),
        Ok(n) => Ok(n),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

/// Whether this process can read `pid`'s word at `remote`, which holds `expect`.
pub(crate) fn probe(pid: i32, remote: usize, expect: u64) -> bool {
    let mut word = [0u8; 8];
    read(pid, remote, &mut word).is_ok() && u64::from_le_bytes(word) == expect
}

/// This process's id, as the calls above take it.
pub(crate) fn pid() -> i32 {
    i32::try_from(std::process::id()).unwrap_or(-1)
}
