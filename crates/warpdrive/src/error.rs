//! The one error type of warpdrive. Every fallible call returns [`Result`].

use std::path::PathBuf;

/// Everything that can go wrong in warpdrive, with what was asked and what was available.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (libcuda) is absent or reports no usable device.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    /// A CUDA library other than the driver (NVRTC, cuBLAS, NCCL, cuFile) is absent.
    #[error("CUDA library {library} is not available: {hint}")]
    LibraryMissing { library: &'static str, hint: String },

    /// `Device::cuda(n)` with `n` at or past the device count.
    #[error("CUDA device ordinal {ordinal} is out of range: {count} device(s) present")]
    BadOrdinal { ordinal: usize, count: usize },

    /// `WARPDRIVE_DEVICE` holds something other than `cpu` or `cuda:N`.
    #[error("WARPDRIVE_DEVICE={value:?} is not valid: expected `cpu`, `cuda` or `cuda:N`")]
    BadDeviceSpec { value: String },

    /// Two buffers that must have equal lengths do not.
    #[error("length mismatch in {op}: {left} vs {right}")]
    LengthMismatch {
        op: &'static str,
        left: usize,
        right: usize,
    },

    /// Buffers or streams from different devices were mixed in one call.
    #[error("device mismatch in {op}: {left} vs {right}")]
    DeviceMismatch {
        op: &'static str,
        left: String,
        right: String,
    },

    /// A caller-supplied argument is invalid (zero-sized grid, bad shape, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The requested operation is not available for this device or data type.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// The device could not satisfy an allocation, even after flushing caches.
    #[error("out of device memory: requested {requested} bytes; {detail}")]
    OutOfMemory { requested: usize, detail: String },

    /// A CUDA driver call failed; the context is still usable.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },

    /// A sticky device fault (illegal address, trap): the context is unusable from now on.
    #[error("device lost after {call}: {message}")]
    DeviceLost { call: &'static str, message: String },

    /// NVRTC rejected a kernel source; `log` is the compiler's log.
    #[error("kernel {kernel} failed to compile for {arch}:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },

    /// A kernel module did not load: PTX from the cache was rejected, and so was the PTX
    /// compiled anew in its place (or the compile failed); both attempts' errors.
    #[error(
        "kernel {kernel} for {arch} did not load: from the PTX cache: {cached}; \
         compiled anew: {recompiled}"
    )]
    ModuleLoad {
        kernel: String,
        arch: String,
        cached: String,
        recompiled: String,
    },

    /// Something a stream capture does not allow (a driver allocation, an event query or
    /// synchronise, a copy from pageable memory) was asked for while the calling thread or
    /// the stream was capturing a graph; the call was refused before reaching the driver.
    #[error("{call} is not allowed during a graph capture: {hint}")]
    Capture { call: &'static str, hint: String },

    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {message}")]
    Blas { call: &'static str, message: String },

    /// A part of a job on the host copy threads panicked (a bug in the work it ran): the
    /// job's output is incomplete. The thread that ran it stays in the pool.
    #[error("a part of a job on the copy threads panicked: {0}")]
    WorkerPanicked(String),

    /// Stored data failed its checksum or its framing: it is never returned.
    #[error("corrupt data for {key}: {detail}")]
    Corrupt { key: String, detail: String },

    /// No such key in a store.
    #[error("no entry {key}")]
    NotFound { key: String },

    /// A collective or point-to-point call of a `dist` communicator group failed: ranks
    /// that disagree on the call, a rank that did not arrive in time, a rank that left.
    #[error("collective {op} failed: {detail}")]
    Collective { op: &'static str, detail: String },

    /// An actor's inbox is full and its backpressure policy is `Reject`.
    #[error("actor {actor}: inbox lane {lane} is full ({capacity} messages)")]
    QueueFull {
        actor: String,
        lane: usize,
        capacity: usize,
    },

    /// A wait ran out of time.
    #[error("{what}: no answer within {after_ms} ms")]
    Timeout { what: String, after_ms: u64 },

    /// An actor or its system cannot do what was asked: not started, terminated, hung.
    #[error("actor {actor}: {detail}")]
    Actor { actor: String, detail: String },

    /// A file could not be read or written.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with warpdrive's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] naming `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// True when the device context can no longer be used (a sticky fault).
    pub fn is_device_lost(&self) -> bool {
        matches!(self, Error::DeviceLost { .. })
    }
}
