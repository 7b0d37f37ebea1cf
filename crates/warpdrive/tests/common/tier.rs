//! Shared by the tier store's tests: random blocks, the disk engines this host offers, and
//! a stored block's bytes on disk (found, flipped).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rand::RngCore;
use warpdrive::tier::disk::{DiskIo, IoEngine};

/// A random block of `len` bytes; blocks of even length compressible (runs of zeros).
pub fn block(r: &mut impl RngCore, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.fill_bytes(&mut v);
    if len % 2 == 0 {
        for x in v.iter_mut().step_by(3) {
            *x = 0;
        }
    }
    v
}

/// The thread pool, and io_uring at queue depths 1 and 4 where this host offers it.
pub fn engines_here() -> Vec<DiskIo> {
    let mut ios = vec![DiskIo {
        engine: IoEngine::Threads,
        queue_depth: 4,
    }];
    for queue_depth in [1, 4] {
        let io = DiskIo {
            engine: IoEngine::Uring,
            queue_depth,
        };
        match io.resolve() {
            Ok(_) => ios.push(io),
            Err(e) => eprintln!("skipping io_uring: {e}"),
        }
    }
    ios
}

/// Where the last copy of a block that starts with `head` lies on disk: the newest data
/// segment (`data-<n>.seg`, highest n) directly under `root` holding those bytes, and their
/// offset in it (the last occurrence there).
pub fn block_on_disk(root: &Path, head: &[u8]) -> (PathBuf, u64) {
    let mut segments: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .expect("the store's folder")
        .map(|e| e.expect("a folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .filter_map(|p| {
            let n = p
                .file_stem()?
                .to_str()?
                .strip_prefix("data-")?
                .parse()
                .ok()?;
            Some((n, p))
        })
        .collect();
    segments.sort();
    segments
        .into_iter()
        .rev()
        .find_map(|(_, p)| {
            let bytes = std::fs::read(&p).expect("a segment file");
            let at = bytes.windows(head.len()).rposition(|w| w == head)?;
            Some((p, at as u64))
        })
        .expect("the block in a segment")
}

/// Flips the bits of `mask` in the byte at `at` of `path`, synced: corruption for a read to
/// catch; the same call again restores the byte.
pub fn flip_byte(path: &Path, at: u64, mask: u8) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("the segment file");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("the byte");
    file.write_all_at(&[byte[0] ^ mask], at)
        .expect("the byte written");
    file.sync_data().expect("synced");
}
