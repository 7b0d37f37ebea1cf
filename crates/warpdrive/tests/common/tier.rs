//! Shared by the tier store's tests: random blocks and the disk engines this host offers.

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
