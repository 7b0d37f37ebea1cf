//! Which engine runs [`OsDisk`](super::OsDisk)'s direct I/O: io_uring where the kernel
//! offers it, else a thread pool of blocking `pread` / `pwrite`. The choice is made at run
//! time: a ring that cannot be set up (`ENOSYS` on an old kernel, `EPERM` under a seccomp
//! filter or `io_uring_disabled`, any other error) falls back to the threads under `Auto`.

use crate::error::{Error, Result};

use super::uring;

/// The engine a configuration asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// io_uring when a ring can be set up and runs reads and writes, else the threads.
    Auto,
    /// io_uring, or an error when the kernel does not offer it.
    Uring,
    /// The thread pool, whatever the kernel offers: the default, as it measured faster than
    /// the ring on the GPU hosts (H100 VM, same run: 64 KiB writes 72.7 against 95.9 µs, 64 MiB
    /// reads 50.3 against 62.0 ms; bench/NOTES.md, tier engines).
    #[default]
    Threads,
}

/// How a disk runs its direct I/O: the engine asked for and the pieces of one split I/O
/// kept in flight at once (the ring's depth; the thread pool keeps its own
/// [`QUEUE_DEPTH`](super::QUEUE_DEPTH) threads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskIo {
    pub engine: IoEngine,
    pub queue_depth: usize,
}

impl Default for DiskIo {
    fn default() -> Self {
        DiskIo {
            engine: IoEngine::default(),
            queue_depth: super::QUEUE_DEPTH,
        }
    }
}

/// The most pieces a ring keeps in flight (a ring of more entries pins more kernel memory
/// than a split I/O of at most [`MAX_BLOCK`](crate::tier::MAX_BLOCK) can use).
pub const MAX_QUEUE_DEPTH: usize = 256;

/// The engine a disk runs on, once [`IoEngine`] is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Uring,
    Threads,
}

impl Engine {
    /// `uring` or `threads` (metric labels, bench variants).
    pub fn name(self) -> &'static str {
        match self {
            Engine::Uring => "uring",
            Engine::Threads => "threads",
        }
    }
}

/// A resolved [`DiskIo`]: the engine in use and its queue depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Io {
    pub engine: Engine,
    pub queue_depth: usize,
}

impl Io {
    /// The thread pool at its own depth (what [`DirectFile::open`](super::DirectFile::open)
    /// uses).
    pub fn threads() -> Io {
        Io {
            engine: Engine::Threads,
            queue_depth: super::QUEUE_DEPTH,
        }
    }
}

impl DiskIo {
    /// The engine this asks for on this kernel: a ring is set up and probed for reads and
    /// writes once per call.
    pub fn resolve(self) -> Result<Io> {
        self.resolve_after(uring::probe())
    }

    /// As [`resolve`](Self::resolve) with `probe`'s outcome given (a test forces a kernel
    /// without io_uring with it): `Auto` falls back to the threads on any error, `Uring`
    /// returns it.
    pub fn resolve_after(self, probe: std::io::Result<()>) -> Result<Io> {
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return Err(Error::InvalidArgument(format!(
                "tier disk: a queue depth of {} (1 to {MAX_QUEUE_DEPTH})",
                self.queue_depth
            )));
        }
        let engine = match (self.engine, probe) {
            (IoEngine::Threads, _) => Engine::Threads,
            (_, Ok(())) => Engine::Uring,
            (IoEngine::Uring, Err(e)) => {
                return Err(Error::Unsupported(format!(
                    "tier disk: io_uring asked for but not offered by this kernel: {e}"
                )))
            }
            (IoEngine::Auto, Err(e)) => {
                tracing::info!("tier disk: io_uring unavailable ({e}); direct I/O on threads");
                Engine::Threads
            }
        };
        Ok(Io {
            engine,
            queue_depth: self.queue_depth,
        })
    }
}
