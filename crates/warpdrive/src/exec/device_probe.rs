//! The device-launch benchmark's probe: the time from a decision on the GPU to the start of
//! the work it launches, three ways (CUDA only).
//!
//! - [`LaunchPath::Device`]: a kernel decides and launches the work graph itself
//!   (`cudaGraphLaunch`, fire and forget).
//! - [`LaunchPath::DeviceTail`]: the same as the graph's tail launch (it starts when the
//!   deciding kernel's graph ends).
//! - [`LaunchPath::DeviceKernel`]: the deciding kernel launches the work's kernel itself
//!   (a device-side kernel launch, no graph): the floor of a launch from the device.
//! - [`LaunchPath::HostGraph`]: the host launched the work graph in advance, right behind the
//!   deciding kernel on its stream (no decision reaches the host: the floor of a stream).
//! - [`LaunchPath::HostRoundTrip`]: the kernel writes its decision to mapped host memory,
//!   a host thread sees it and launches the work graph.
//!
//! Every path stamps `%globaltimer` at the decision and at the start of the work graph's first
//! kernel, so the three compare on one clock.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::device::{SharedWords, Stream};
use crate::error::{Error, Result};
use crate::kernels::DEVICE_LAUNCH;
use crate::memory::Buffer;

use super::graph::Graph;
use super::launch::{launch, Kernel, LaunchConfig};

/// How the work is launched after the decision (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchPath {
    Device,
    DeviceTail,
    DeviceKernel,
    HostGraph,
    HostRoundTrip,
}

/// One measurement: per launch, nanoseconds from the decision to the start of the work, and
/// (launches from a graph kernel only) to the return of the launch call.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchTimes {
    pub to_start: Vec<u64>,
    /// Empty for the paths where the host or a kernel launch starts the work.
    pub in_call: Vec<u64>,
}

/// How long the host waits for one decision to reach it before giving up.
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(2);

/// The probe's kernels, buffers and graphs (see the module docs).
pub struct DeviceLaunchProbe {
    stream: Stream,
    capacity: usize,
    decide: Kernel,
    fire_kernel: Kernel,
    slot: Buffer<u32>,
    status: Buffer<i32>,
    decided: Buffer<u64>,
    returned: Buffer<u64>,
    starts: Buffer<u64>,
    flag: SharedWords,
    /// Declared before the buffers their kernels use: dropped first. The deciding graphs:
    /// fire-and-forget, then tail launch.
    parents: [Graph<'static>; 2],
    child: Graph<'static>,
}

impl std::fmt::Debug for DeviceLaunchProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceLaunchProbe({:?})", self.stream)
    }
}

/// `params` as the kernel parameter array a launch takes.
fn param<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

impl DeviceLaunchProbe {
    /// A probe on `stream` for up to `capacity - 1` launches a measurement.
    pub fn new(stream: &Stream, capacity: usize) -> Result<Self> {
        if !(2..=1 << 24).contains(&capacity) {
            return Err(Error::InvalidArgument(format!(
                "a launch probe holds 2 to 2^24 samples, not {capacity}"
            )));
        }
        let device = stream.device();
        let started = Kernel::new(device, &DEVICE_LAUNCH, "dl_started")?;
        let fire = Kernel::new(device, &DEVICE_LAUNCH, "dl_fire_one")?;
        let decide = Kernel::new(device, &DEVICE_LAUNCH, "dl_decide")?;
        let fire_kernel = Kernel::new(device, &DEVICE_LAUNCH, "dl_fire_kernel")?;
        let slot = Buffer::<u32>::zeros(stream, 1)?;
        let status = Buffer::<i32>::zeros(stream, 1)?;
        let decided = Buffer::<u64>::zeros(stream, capacity)?;
        let returned = Buffer::<u64>::zeros(stream, capacity)?;
        let starts = Buffer::<u64>::zeros(stream, capacity)?;
        let flag = device.shared_words(1)?;
        let cap = capacity as u32;
        let (starts_ptr, slot_ptr) = (starts.device_ptr(), slot.device_ptr());
        let mut child = Graph::capture(stream, move |s| {
            let (mut a, mut b, mut c) = (starts_ptr, slot_ptr, cap);
            let mut params = [param(&mut a), param(&mut b), param(&mut c)];
            // SAFETY: dl_started(u64* starts, const u32* slot, u32 capacity): `starts` holds
            // `capacity` stamps, `slot` one word; both owned by the probe, which outlives the
            // graph.
            unsafe { launch(s, &started, LaunchConfig::linear(1, 32), &mut params) }
        })?;
        let child_handle = child.prepare_device_launch()?;
        let (decided_ptr, status_ptr) = (decided.device_ptr(), status.device_ptr());
        let returned_ptr = returned.device_ptr();
        let parent = |tail: u32| {
            let fire = fire.clone();
            let mut g = Graph::capture(stream, move |s| {
                let (mut g, mut sl, mut d, mut r, mut st, mut c, mut t) = (
                    child_handle,
                    slot_ptr,
                    decided_ptr,
                    returned_ptr,
                    status_ptr,
                    cap,
                    tail,
                );
                let mut params = [
                    param(&mut g),
                    param(&mut sl),
                    param(&mut d),
                    param(&mut r),
                    param(&mut st),
                    param(&mut c),
                    param(&mut t),
                ];
                // SAFETY: dl_fire_one(cudaGraphExec_t child, u32* slot, u64* decided,
                // u64* returned, int* status, u32 capacity, u32 tail): `child` is the
                // device-launchable child graph (owned by the probe, dropped after this
                // graph), `decided` and `returned` hold `capacity` stamps, `slot` and `status`
                // one word each.
                unsafe { launch(s, &fire, LaunchConfig::linear(1, 32), &mut params) }
            })?;
            g.prepare_device_launch()?;
            Ok::<_, Error>(g)
        };
        let parents = [parent(0)?, parent(1)?];
        Ok(DeviceLaunchProbe {
            stream: stream.clone(),
            capacity,
            decide,
            fire_kernel,
            slot,
            status,
            decided,
            returned,
            starts,
            flag,
            parents,
            child,
        })
    }

    /// `n` decisions and launches on `path`, one after another (see [`LaunchTimes`]).
    pub fn measure(&mut self, path: LaunchPath, n: usize) -> Result<LaunchTimes> {
        if n == 0 || n >= self.capacity {
            return Err(Error::InvalidArgument(format!(
                "a measurement of 1 to {} launches, not {n}",
                self.capacity - 1
            )));
        }
        // Slot u32::MAX: the first decision takes slot 0.
        self.slot.driver_copy_from_host(&self.stream, &[u32::MAX])?;
        self.status.driver_copy_from_host(&self.stream, &[0])?;
        self.flag.words()[0].store(u64::from(u32::MAX), Ordering::Release);
        for i in 0..n {
            match path {
                LaunchPath::Device => self.parents[0].launch()?,
                LaunchPath::DeviceTail => self.parents[1].launch()?,
                LaunchPath::DeviceKernel => self.fire_kernel_on_gpu()?,
                LaunchPath::HostGraph => {
                    self.decide_on_gpu(false)?;
                    self.child.launch()?;
                }
                LaunchPath::HostRoundTrip => {
                    self.decide_on_gpu(true)?;
                    self.wait_for_decision(i as u64)?;
                    self.child.launch()?;
                }
            }
        }
        let mut status = [0i32];
        self.status.driver_copy_to_host(&self.stream, &mut status)?;
        if status[0] != 0 {
            return Err(Error::Unsupported(format!(
                "a graph launch from the device failed with cudaError {}",
                status[0]
            )));
        }
        let read = |b: &Buffer<u64>| {
            let mut v = vec![0u64; self.capacity];
            b.driver_copy_to_host(&self.stream, &mut v).map(|()| v)
        };
        let (decided, starts) = (read(&self.decided)?, read(&self.starts)?);
        let since = |t: &[u64]| (0..n).map(|i| t[i].saturating_sub(decided[i])).collect();
        let in_call = match path {
            LaunchPath::Device | LaunchPath::DeviceTail => since(&read(&self.returned)?),
            _ => Vec::new(),
        };
        Ok(LaunchTimes {
            to_start: since(&starts),
            in_call,
        })
    }

    /// Enqueues the deciding kernel; with `signal`, it also writes its slot to the mapped
    /// flag the host waits on.
    fn decide_on_gpu(&mut self, signal: bool) -> Result<()> {
        let mut slot = self.slot.device_ptr();
        let mut decided = self.decided.device_ptr();
        let mut flag = if signal { self.flag.device_ptr() } else { 0 };
        let mut cap = self.capacity as u32;
        let mut params = [
            param(&mut slot),
            param(&mut decided),
            param(&mut flag),
            param(&mut cap),
        ];
        // SAFETY: dl_decide(u32* slot, u64* decided, volatile u32* flag, u32 capacity):
        // `decided` holds `capacity` stamps, `slot` one word, `flag` null or the first word
        // of the probe's mapped words (the kernel writes its low half).
        unsafe {
            launch(
                &self.stream,
                &self.decide,
                LaunchConfig::linear(1, 32),
                &mut params,
            )
        }
    }

    /// Enqueues the kernel that decides and launches the stamping kernel itself.
    fn fire_kernel_on_gpu(&mut self) -> Result<()> {
        let mut slot = self.slot.device_ptr();
        let mut decided = self.decided.device_ptr();
        let mut starts = self.starts.device_ptr();
        let mut status = self.status.device_ptr();
        let mut cap = self.capacity as u32;
        let mut params = [
            param(&mut slot),
            param(&mut decided),
            param(&mut starts),
            param(&mut status),
            param(&mut cap),
        ];
        // SAFETY: dl_fire_kernel(u32* slot, u64* decided, u64* starts, int* status,
        // u32 capacity): `decided` and `starts` hold `capacity` stamps, `slot` and `status`
        // one word each, all owned by the probe.
        unsafe {
            launch(
                &self.stream,
                &self.fire_kernel,
                LaunchConfig::linear(1, 32),
                &mut params,
            )
        }
    }

    /// Spins until the deciding kernel has published slot `i`, within a timeout.
    fn wait_for_decision(&self, i: u64) -> Result<()> {
        let word = &self.flag.words()[0];
        let deadline = Instant::now() + ROUND_TRIP_TIMEOUT;
        while word.load(Ordering::Acquire) & 0xffff_ffff != i {
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("decision {i} of the round-trip probe reaching the host"),
                    after_ms: ROUND_TRIP_TIMEOUT.as_millis() as u64,
                });
            }
            std::hint::spin_loop();
        }
        Ok(())
    }
}
