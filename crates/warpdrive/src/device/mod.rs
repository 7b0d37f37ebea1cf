//! Devices, streams, events and device information, on two backends: CUDA and the CPU.
//!
//! The CPU backend is real: its buffers live in host memory and its ops compute the same
//! results as the CUDA kernels (it is their reference). Work on a CPU stream runs at once.

pub mod activity;
mod arch;
pub(crate) mod cma;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod dma;
pub(crate) mod lending;
pub(crate) mod mapped;
mod peer;
pub mod probe;
pub(crate) mod shared_host;
mod shared_words;
pub(crate) mod shm;
mod state;
pub mod sysfs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;

use crate::error::{Error, Result};

pub use arch::Arch;
pub(crate) use cpu::cpu_model;
pub(crate) use cuda::AsyncMemPool;
pub use cuda::CudaDevice;
/// The GPU backends' device, as the floors above use it (the CUDA backend's today): its
/// methods take and return only this floor's types.
pub(crate) use cuda::CudaDevice as Gpu;
pub(crate) use cuda::TiledMap;
pub use cuda::RELEASE_AT_EXIT;
pub(crate) use cuda::{at_exit, release_at_exit};
pub(crate) use cuda::{compile_image, compile_options, compile_ptx, nvrtc_version};
pub(crate) use cuda::{nccl_group, nccl_unique_id, NcclCall, NcclComm, NcclReduce, NCCL_ID_BYTES};
pub(crate) use cuda::{
    BiasGemm, Function, GemmCall, GpuStream, GraphExec, LaunchMode, Module, ResidentGuard,
};
pub(crate) use peer::PeerMemory;
pub(crate) use shared_words::SharedWords;
use state::DeviceState;
pub(crate) use state::Slot;

/// The environment variable that overrides [`Device::best`]: `cpu`, `cuda` or `cuda:N`.
pub const DEVICE_ENV: &str = "WARPDRIVE_DEVICE";

/// Where buffers live and work runs. Cheap to clone; every handle of one device shares its
/// state (kernels loaded, pools, tuned configurations). More backends may come: match with a
/// wildcard arm.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Device {
    /// Host memory and host threads: the reference backend.
    Cpu,
    /// A CUDA GPU.
    Cuda(CudaDevice),
}

impl Device {
    /// The CPU backend.
    pub fn cpu() -> Device {
        Device::Cpu
    }

    /// CUDA device `ordinal`. Fails with `NoDriver` when the driver is absent and with
    /// `BadOrdinal` when there is no such device.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        CudaDevice::new(ordinal).map(Device::Cuda)
    }

    /// `WARPDRIVE_DEVICE` when set, else CUDA device 0 when a driver and GPU are present,
    /// else the CPU (with one notice on stderr per process).
    pub fn best() -> Result<Device> {
        let spec = std::env::var(DEVICE_ENV).ok();
        Device::best_with(spec.as_deref())
    }

    /// [`Device::best`] with the override given explicitly instead of read from the environment.
    pub fn best_with(spec: Option<&str>) -> Result<Device> {
        if let Some(spec) = spec.map(str::trim).filter(|s| !s.is_empty()) {
            return Device::from_spec(spec);
        }
        match Device::cuda(0) {
            Ok(d) => Ok(d),
            Err(e) => {
                static NOTICE: Once = Once::new();
                NOTICE.call_once(|| {
                    eprintln!("warpdrive: no usable CUDA device ({e}); running on the CPU backend")
                });
                Ok(Device::Cpu)
            }
        }
    }

    /// Parses `cpu`, `cuda` (device 0) or `cuda:N` and opens that device.
    pub fn from_spec(spec: &str) -> Result<Device> {
        let bad = || Error::BadDeviceSpec {
            value: spec.to_string(),
        };
        match spec.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Device::cuda(0),
            s => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                let ordinal = n.parse::<usize>().map_err(|_| bad())?;
                Device::cuda(ordinal)
            }
        }
    }

    /// The GPU, for work only a GPU does; on the CPU backend `Error::Unsupported` naming
    /// `what`.
    pub(crate) fn gpu(&self, what: &str) -> Result<&Gpu> {
        match self {
            Device::Cuda(d) => Ok(d),
            Device::Cpu => Err(Error::Unsupported(format!("{what} on the CPU backend"))),
        }
    }

    /// `Error::DeviceLost` once the device had a sticky fault (never on the CPU backend).
    pub(crate) fn check_usable(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => d.check_usable(),
        }
    }

    /// Runs `release` when the process exits normally, where this device's backend asks
    /// for cached memory to be handed back before it tears down (CUDA with
    /// [`RELEASE_AT_EXIT`] set); nothing otherwise.
    pub(crate) fn release_at_exit(&self, release: fn()) {
        if matches!(self, Device::Cuda(_)) && release_at_exit() {
            at_exit(release);
        }
    }

    /// `bytes > 0` of managed memory, reachable from the host and the device (host memory on
    /// the CPU backend); free it with [`Device::free_managed`].
    pub(crate) fn alloc_managed(&self, bytes: usize) -> Result<u64> {
        match self {
            Device::Cpu => cpu::alloc(bytes),
            Device::Cuda(d) => d.alloc_managed(bytes),
        }
    }

    /// Frees memory from [`Device::alloc_managed`] (on CUDA after the work that may use it).
    pub(crate) fn free_managed(&self, ptr: u64, bytes: usize) -> Result<()> {
        match self {
            Device::Cpu => {
                cpu::free(ptr, bytes);
                Ok(())
            }
            Device::Cuda(d) => d.free(ptr),
        }
    }

    /// A hint for the managed range `ptr..ptr + bytes`, about device `at` (`None`: the
    /// host); nothing on the CPU backend.
    pub(crate) fn mem_advise(
        &self,
        ptr: u64,
        bytes: usize,
        advice: MemAdvice,
        at: Option<usize>,
    ) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => d.mem_advise(ptr, bytes, advice, at),
        }
    }

    /// True when this device's memory is host memory (the CPU backend): a copy to or from
    /// it is a host copy, with no link to stage through.
    pub fn is_host_memory(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// What a measurement on this device is valid for: `cpu`, or the GPU's name and compute
    /// capability (`NVIDIA H100 80GB HBM3 cc9.0`).
    pub fn model(&self) -> Result<String> {
        match self {
            Device::Cpu => Ok("cpu".into()),
            Device::Cuda(d) => {
                let (major, minor) = d.compute_capability();
                Ok(format!("{} cc{major}.{minor}", d.name()?))
            }
        }
    }

    /// The per-device state of the floors above in `slot`, made by `make` on first use (see
    /// [`Slot`]); every handle of this device gets the same value.
    pub(crate) fn state<T: std::any::Any + Send + Sync>(
        &self,
        slot: Slot,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<&'static T> {
        self.state_holder().get_or_make(slot, make)
    }

    /// The state in `slot` when it was made.
    pub(crate) fn state_if_made<T: std::any::Any + Send + Sync>(
        &self,
        slot: Slot,
    ) -> Result<Option<&'static T>> {
        self.state_holder().get(slot)
    }

    fn state_holder(&self) -> &DeviceState {
        match self {
            Device::Cpu => cpu::state(),
            Device::Cuda(d) => d.state(),
        }
    }

    /// Every device this process has opened, the CPU backend first.
    pub(crate) fn opened() -> Vec<Device> {
        let mut all = vec![Device::Cpu];
        all.extend(cuda::opened().into_iter().map(Device::Cuda));
        all
    }

    /// Number of CUDA devices (0 when there is no driver).
    pub fn cuda_count() -> usize {
        cuda::device_count().unwrap_or(0)
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// True once the device had a sticky fault (never on the CPU backend): every later call
    /// on it returns `Error::DeviceLost`.
    pub fn is_lost(&self) -> bool {
        matches!(self, Device::Cuda(d) if d.is_lost())
    }

    /// `cpu` or `cuda:N`.
    pub fn label(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(d) => format!("cuda:{}", d.ordinal()),
        }
    }

    /// Name, capability, memory, PCIe, NUMA node and library versions.
    pub fn info(&self) -> Result<DeviceInfo> {
        match self {
            Device::Cpu => Ok(cpu::info(cuda::library_statuses())),
            Device::Cuda(d) => d.info(),
        }
    }

    /// A new stream on this device.
    pub fn new_stream(&self) -> Result<Stream> {
        let inner = match self {
            Device::Cpu => StreamInner::Cpu,
            Device::Cuda(d) => StreamInner::Cuda(Arc::new(CudaStreamShared {
                stream: d.new_stream()?,
                handed_out: AtomicU64::new(0),
            })),
        };
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Ok(Stream {
            device: self.clone(),
            inner,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// A new timing-enabled event on this device.
    pub fn new_event(&self) -> Result<Event> {
        let inner = match self {
            Device::Cpu => EventInner::Cpu(Mutex::new(None)),
            Device::Cuda(d) => EventInner::Cuda(d.clone(), d.new_timing_event()?),
        };
        Ok(Event { inner })
    }

    /// A new event for ordering only (timing disabled: cheaper to record and query); it
    /// cannot be used with [`Event::elapsed_ms`].
    pub fn new_sync_event(&self) -> Result<Event> {
        let inner = match self {
            Device::Cpu => EventInner::Cpu(Mutex::new(None)),
            Device::Cuda(d) => EventInner::Cuda(d.clone(), d.new_sync_event()?),
        };
        Ok(Event { inner })
    }

    /// (free, total) bytes of device memory (host memory on the CPU backend).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        match self {
            Device::Cpu => Ok(cpu::mem_info()),
            Device::Cuda(d) => d.mem_info(),
        }
    }

    /// Allocates `bytes > 0` of raw memory on this device; free it with [`Device::free_raw`].
    pub(crate) fn alloc_raw(&self, bytes: usize) -> Result<u64> {
        match self {
            Device::Cpu => cpu::alloc_shareable(bytes),
            Device::Cuda(d) => d.alloc(bytes),
        }
    }

    /// Frees memory from [`Device::alloc_raw`].
    pub(crate) fn free_raw(&self, ptr: u64, bytes: usize) -> Result<()> {
        match self {
            Device::Cpu => {
                cpu::free(ptr, bytes);
                Ok(())
            }
            Device::Cuda(d) => d.free(ptr),
        }
    }

    /// Allocates `bytes > 0` of page-locked host memory the CPU reads fast (not
    /// write-combined), on NUMA node `node` when given (mapped, `mbind`, registered); plain
    /// host memory on the CPU backend (bound to `node` when given). Free with
    /// [`Device::free_pinned_raw`] and the same `bytes` and `node`.
    pub(crate) fn alloc_pinned_raw(&self, bytes: usize, node: Option<u32>) -> Result<u64> {
        match (self, node) {
            (Device::Cpu, None) => cpu::alloc(bytes),
            (Device::Cpu, Some(n)) => cpu::map_on_node(bytes, n),
            (Device::Cuda(d), None) => d.alloc_host(bytes),
            (Device::Cuda(d), Some(n)) => d.alloc_host_on_node(bytes, n),
        }
    }

    /// Frees memory from [`Device::alloc_pinned_raw`].
    pub(crate) fn free_pinned_raw(&self, ptr: u64, bytes: usize, node: Option<u32>) -> Result<()> {
        match (self, node) {
            (Device::Cpu, None) => {
                cpu::free(ptr, bytes);
                Ok(())
            }
            (Device::Cpu, Some(_)) => {
                cpu::unmap(ptr, bytes);
                Ok(())
            }
            (Device::Cuda(d), None) => d.free_host(ptr),
            (Device::Cuda(d), Some(_)) => d.free_host_on_node(ptr, bytes),
        }
    }

    /// Where host memory and staging threads for this device belong (a no-op placement on
    /// the CPU backend, on one-node machines, and where sysfs names no node for the GPU).
    pub fn numa_placement(&self) -> sysfs::NumaPlacement {
        match self {
            Device::Cpu => sysfs::NumaPlacement::default(),
            Device::Cuda(d) => d.numa(),
        }
    }

    /// The GPU ordinal (`None` on the CPU backend).
    pub fn ordinal(&self) -> Option<usize> {
        match self {
            Device::Cpu => None,
            Device::Cuda(d) => Some(d.ordinal()),
        }
    }

    /// True while a resident kernel (the actors' loop) runs on this device: a device-wide
    /// wait would never return, and frees are held back until it ends.
    pub(crate) fn has_resident_kernel(&self) -> bool {
        match self {
            Device::Cpu => false,
            Device::Cuda(d) => d.has_resident(),
        }
    }

    /// Waits until all work on the device has finished.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => d.synchronize(),
        }
    }

    /// `Error::DeviceMismatch` naming `op` unless `other` is this device.
    pub fn same_as(&self, other: &Device, op: &'static str) -> Result<()> {
        if self == other {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                op,
                left: self.label(),
                right: other.label(),
            })
        }
    }
}

/// A hint about managed memory (the driver's `cuMemAdvise` kinds warpdrive uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemAdvice {
    ReadMostly,
    PreferredLocation,
    AccessedBy,
}

/// An ordered queue of work on one device. Clones are the same stream (same [`Stream::id`]).
#[derive(Clone)]
pub struct Stream {
    device: Device,
    inner: StreamInner,
    id: u64,
}

#[derive(Clone)]
enum StreamInner {
    Cpu,
    Cuda(Arc<CudaStreamShared>),
}

struct CudaStreamShared {
    stream: GpuStream,
    /// Bumped each time the driver handle is handed out (every enqueue goes through one of
    /// those accessors): see [`Stream::work_seq`].
    handed_out: AtomicU64,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({} #{})", self.device.label(), self.id)
    }
}

impl Stream {
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This stream's identity: unique in the process, shared by its clones, never reused.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Waits until all work enqueued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        match (&self.device, &self.inner) {
            (Device::Cuda(d), StreamInner::Cuda(s)) => d.synchronize_stream(&s.stream),
            _ => Ok(()),
        }
    }

    /// A count that changes whenever work may have been enqueued on this stream through
    /// warpdrive (any hand-out of its driver handle, a [`wait`](Self::wait)); recording an
    /// event does not change it. Two equal readings mean nothing was enqueued between them,
    /// so an event recorded at the first still marks the same point of the stream. Always 0
    /// on the CPU backend.
    pub(crate) fn work_seq(&self) -> u64 {
        match &self.inner {
            StreamInner::Cuda(s) => s.handed_out.load(Ordering::Acquire),
            StreamInner::Cpu => 0,
        }
    }

    /// The shared CUDA stream, counted as a hand-out (see [`Stream::work_seq`]).
    fn handed_out(&self) -> Option<&CudaStreamShared> {
        match &self.inner {
            StreamInner::Cuda(s) => {
                s.handed_out.fetch_add(1, Ordering::AcqRel);
                Some(s)
            }
            StreamInner::Cpu => None,
        }
    }

    /// Refuses `call` while this stream captures a graph: copies from or to pageable
    /// memory cannot be captured, and the fast path would otherwise fail later, at a pinned
    /// allocation, with a less helpful error.
    pub(crate) fn refuse_if_capturing(&self, call: &'static str) -> Result<()> {
        self.run(
            (),
            |()| Ok(()),
            |(), q| q.gpu.refuse_if_capturing(q.stream, call),
        )
    }

    /// Records `event` at this point of the stream.
    pub fn record(&self, event: &Event) -> Result<()> {
        match (&self.inner, &event.inner) {
            (StreamInner::Cpu, EventInner::Cpu(t)) => {
                *t.lock() = Some(Instant::now());
                Ok(())
            }
            (StreamInner::Cuda(s), EventInner::Cuda(d, e))
                if self.device.ordinal() == Some(d.ordinal()) =>
            {
                d.record_event(e, &s.stream)
            }
            _ => Err(Error::DeviceMismatch {
                op: "Stream::record",
                left: self.device.label(),
                right: event.device_label(),
            }),
        }
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (self.handed_out(), &event.inner) {
            (None, EventInner::Cpu(_)) => Ok(()),
            (Some(s), EventInner::Cuda(d, e)) => d.stream_wait_event(&s.stream, e),
            _ => Err(Error::DeviceMismatch {
                op: "Stream::wait",
                left: self.device.label(),
                right: event.device_label(),
            }),
        }
    }

    /// The driver's handle of this stream (an address; 0 on the CPU backend), which the
    /// device floor's [`activity`] records name.
    pub fn cu_stream(&self) -> u64 {
        self.handed_out().map_or(0, |s| s.stream.cu_stream() as u64)
    }

    /// The GPU queue; `None` on the CPU backend. The one place a stream tells its backend.
    pub(super) fn queue(&self) -> Option<Queue<'_>> {
        match (&self.device, self.handed_out()) {
            (Device::Cuda(d), Some(s)) => Some(Queue {
                gpu: d,
                stream: &s.stream,
            }),
            _ => None,
        }
    }

    /// The stream's GPU and queue, for work only a GPU runs (the CPU backend has no body
    /// for it); on the CPU backend `Error::Unsupported` naming `what`.
    pub(crate) fn gpu(&self, what: &str) -> Result<Queue<'_>> {
        self.queue()
            .ok_or_else(|| Error::Unsupported(format!("{what} on the CPU backend")))
    }

    /// Runs one op on this stream: `host` on the CPU backend, where work runs at once (the
    /// reference), `gpu` with the stream's queue on a GPU, where it is enqueued. `state`
    /// (typically the op's outputs, borrowed mutably) goes to whichever body runs.
    pub(crate) fn run<S, R>(
        &self,
        state: S,
        host: impl FnOnce(S) -> Result<R>,
        gpu: impl FnOnce(S, Queue<'_>) -> Result<R>,
    ) -> Result<R> {
        match self.queue() {
            Some(q) => gpu(state, q),
            None => host(state),
        }
    }
}

/// A stream's GPU and its queue: what an op's GPU body enqueues on.
#[derive(Clone, Copy)]
pub(crate) struct Queue<'s> {
    pub(crate) gpu: &'s Gpu,
    pub(crate) stream: &'s GpuStream,
}

/// A point in a stream; with two, the GPU time between them.
pub struct Event {
    inner: EventInner,
}

enum EventInner {
    Cpu(Mutex<Option<Instant>>),
    Cuda(CudaDevice, cuda::GpuEvent),
}

impl Event {
    fn device_label(&self) -> String {
        match &self.inner {
            EventInner::Cpu(_) => "cpu".into(),
            EventInner::Cuda(d, _) => format!("cuda:{}", d.ordinal()),
        }
    }

    /// Waits until the work before the recorded point has finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner {
            EventInner::Cpu(_) => Ok(()),
            EventInner::Cuda(d, e) => d.event_synchronize(e),
        }
    }

    /// True when the work before the recorded point has finished (or nothing was recorded);
    /// never waits.
    pub fn query(&self) -> Result<bool> {
        match &self.inner {
            EventInner::Cpu(_) => Ok(true),
            EventInner::Cuda(d, e) => d.event_query(e),
        }
    }

    /// Milliseconds from `self` to `end`, both recorded; waits for `end`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        match (&self.inner, &end.inner) {
            (EventInner::Cpu(a), EventInner::Cpu(b)) => match (*a.lock(), *b.lock()) {
                (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
                _ => Err(Error::InvalidArgument(
                    "elapsed_ms on an event that was never recorded".into(),
                )),
            },
            (EventInner::Cuda(d, a), EventInner::Cuda(_, b)) => {
                d.event_synchronize(b)?;
                d.event_elapsed_ms(a, b)
            }
            _ => Err(Error::DeviceMismatch {
                op: "Event::elapsed_ms",
                left: self.device_label(),
                right: end.device_label(),
            }),
        }
    }
}

/// How GPUDirect Storage (cuFile) would move data between files and GPU memory here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum GdsMode {
    /// No cuFile library: POSIX I/O through host memory.
    Absent,
    /// cuFile without the `nvidia-fs` kernel driver: it reads through host bounce buffers
    /// (no faster than POSIX I/O plus a copy; warpdrive claims no speed for it).
    Compatibility,
    /// cuFile with the kernel driver: DMA between the storage and GPU memory.
    Direct,
}

/// What this machine offers for GPUDirect Storage.
pub fn gds_mode() -> GdsMode {
    match (
        cuda::cufile_loads(),
        sysfs::gds_kernel_driver(std::path::Path::new("/")),
    ) {
        (false, _) => GdsMode::Absent,
        (true, false) => GdsMode::Compatibility,
        (true, true) => GdsMode::Direct,
    }
}

/// Whether a CUDA library loads on this machine, and its version.
#[derive(Debug, Clone, Serialize)]
pub struct LibraryStatus {
    pub name: &'static str,
    pub loaded: bool,
    pub version: Option<String>,
}

/// What a device is: identity, capability, memory, link and library versions.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// `cuda` or `cpu`.
    pub backend: &'static str,
    pub ordinal: Option<usize>,
    pub name: String,
    /// "9.0" on Hopper; `None` on the CPU.
    pub compute_capability: Option<String>,
    /// The architecture kernels are built for (`sm_90a`), or the CPU's (`x86_64`).
    pub arch: Option<String>,
    /// Streaming multiprocessors.
    pub sms: Option<u32>,
    pub cpu_threads: usize,
    pub memory_total: u64,
    pub memory_free: u64,
    pub l2_bytes: Option<u64>,
    pub pci_bus_id: Option<String>,
    pub pcie_gen: Option<u32>,
    pub pcie_width: Option<u32>,
    pub numa_node: Option<i32>,
    /// Where host memory and staging threads for this device go; a no-op (`node: None`) on
    /// a one-node machine or where sysfs names no node for the device.
    pub numa: sysfs::NumaPlacement,
    /// Kernel driver version ("580.159.04").
    pub driver: Option<String>,
    /// CUDA version the driver supports ("13.0").
    pub cuda: Option<String>,
    pub libraries: Vec<LibraryStatus>,
}

impl DeviceInfo {
    /// "gen5 x16", when known.
    pub fn pcie(&self) -> Option<String> {
        match (self.pcie_gen, self.pcie_width) {
            (Some(g), Some(w)) => Some(format!("gen{g} x{w}")),
            (Some(g), None) => Some(format!("gen{g}")),
            _ => None,
        }
    }
}
