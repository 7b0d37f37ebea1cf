//! Peer-mapped buffers and device-initiated puts and signals: memory on one GPU that
//! kernels on other GPUs store into directly, a kernel that copies a buffer into it and then
//! raises a signal word, and a kernel that waits for that word — data and its "ready" cross
//! between GPUs with no host in the loop.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::device::{Device, PeerMemory, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::PEER;
use crate::memory::Buffer;
use crate::ops::{fill_grid, launch, Args};
use crate::size::bytes_of;

/// `len` elements of `T` in one device's memory, mapped for kernels of the devices named
/// when it was made (CUDA virtual memory management; host memory on the CPU backend).
/// Zeroed when made. Dropping it first waits for the streams that put into it or waited on
/// it.
///
/// ```
/// use std::time::Duration;
/// use warpdrive::dist::{put_signal, wait_signal, PeerMapped};
/// use warpdrive::{Buffer, Device};
///
/// # fn main() -> warpdrive::Result<()> {
/// let dev = Device::cpu();
/// let s = dev.new_stream()?;
/// let inbox = PeerMapped::<f32>::new(&dev, 8, &[])?;
/// let ready = PeerMapped::<u64>::new(&dev, 1, &[])?;
/// let data = Buffer::from_host(&s, &[1.0f32, 2.0, 3.0])?;
/// put_signal(&s, &data, &inbox, 2, &ready, 0, 1)?;
/// wait_signal(&s, &ready, 0, 1, Duration::from_secs(1))?.finish(&s)?;
/// assert_eq!(inbox.read(&s, 0, 5)?, [0.0, 0.0, 1.0, 2.0, 3.0]);
/// # Ok(())
/// # }
/// ```
pub struct PeerMapped<T: DType> {
    owner: Device,
    reach: Vec<Device>,
    mem: PeerMemory,
    len: usize,
    /// Streams that enqueued work on it: waited for before the memory goes.
    used_on: Mutex<Vec<Stream>>,
    _t: PhantomData<T>,
}

impl<T: DType> std::fmt::Debug for PeerMapped<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PeerMapped<{}>[{}] on {}",
            T::KIND.name(),
            self.len,
            self.owner.label()
        )
    }
}

impl<T: DType> PeerMapped<T> {
    /// `len > 0` zeroed elements in `owner`'s memory, reached by kernels of `owner` and of
    /// every device in `reach`. Devices of another backend, or GPUs without peer access to
    /// `owner`, are `Unsupported`.
    pub fn new(owner: &Device, len: usize, reach: &[Device]) -> Result<Self> {
        let bytes = bytes_of::<T>("peer-mapped buffer", len)?;
        let mem = owner.peer_memory(bytes, reach)?;
        Ok(PeerMapped {
            owner: owner.clone(),
            reach: reach.to_vec(),
            mem,
            len,
            used_on: Mutex::new(Vec::new()),
            _t: PhantomData,
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements (never: `new` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device whose memory this is.
    pub fn owner(&self) -> &Device {
        &self.owner
    }

    /// Its first element's address, the same on every device that reaches it (for kernels
    /// of your own).
    pub fn device_ptr(&self) -> u64 {
        self.mem.device_ptr()
    }

    /// Whether kernels of `device` reach this memory.
    pub fn reaches(&self, device: &Device) -> bool {
        *device == self.owner || self.reach.contains(device)
    }

    fn check_reach(&self, stream: &Stream, what: &str) -> Result<()> {
        if self.reaches(stream.device()) {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{what}: {} does not reach this peer-mapped memory of {} (name it in `reach` \
             when making the buffer)",
            stream.device().label(),
            self.owner.label()
        )))
    }

    fn check_span(&self, what: &str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{what}: elements {offset}..+{len} of a peer-mapped buffer of {}",
                self.len
            ))),
        }
    }

    fn used_on(&self, stream: &Stream) {
        let mut used = self.used_on.lock();
        if !used.iter().any(|s| s.id() == stream.id()) {
            used.push(stream.clone());
        }
    }

    /// Copies `data` into elements `offset..` from the host, done on return, through
    /// `stream` (of a device that reaches it).
    pub fn write(&self, stream: &Stream, offset: usize, data: &[T]) -> Result<()> {
        self.check_reach(stream, "PeerMapped::write")?;
        self.check_span("PeerMapped::write", offset, data.len())?;
        let at = bytes_of::<T>("peer-mapped offset", offset)?;
        self.mem.write(stream, at, bytemuck::cast_slice(data))
    }

    /// Elements `offset..offset + len` copied to the host, through `stream` (of a device
    /// that reaches it); waits for the copy, not for other work.
    pub fn read(&self, stream: &Stream, offset: usize, len: usize) -> Result<Vec<T>> {
        self.check_reach(stream, "PeerMapped::read")?;
        self.check_span("PeerMapped::read", offset, len)?;
        let at = bytes_of::<T>("peer-mapped offset", offset)?;
        let mut out = vec![T::default(); len];
        self.mem
            .read(stream, at, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }
}

impl<T: DType> Drop for PeerMapped<T> {
    fn drop(&mut self) {
        for s in self.used_on.get_mut().drain(..) {
            if let Err(e) = s.synchronize() {
                tracing::warn!("a stream that used a peer-mapped buffer failed: {e}");
            }
        }
    }
}

/// Enqueues on `stream` a kernel that copies `src` (on `stream`'s device) into elements
/// `offset..` of `dst`, then — once every byte has landed — stores `value` into
/// `signal[slot]`, both through peer mappings when they are another GPU's memory. Whoever
/// sees the signal (a [`wait_signal`] on any device that reaches it) sees the data. Done on
/// return on the CPU backend.
pub fn put_signal<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &PeerMapped<T>,
    offset: usize,
    signal: &PeerMapped<u64>,
    slot: usize,
    value: u64,
) -> Result<()> {
    src.check_stream(stream, "put_signal")?;
    dst.check_reach(stream, "put_signal")?;
    signal.check_reach(stream, "put_signal (the signal)")?;
    dst.check_span("put_signal", offset, src.len())?;
    signal.check_span("put_signal (the signal)", slot, 1)?;
    let at = bytes_of::<T>("peer-mapped offset", offset)?;
    let bytes = src.size_bytes();
    dst.used_on(stream);
    signal.used_on(stream);
    if let Some(words) = signal.mem.host_words() {
        dst.mem
            .write(stream, at, bytemuck::cast_slice(src.host_view()?))?;
        words[slot].store(value, Ordering::Release);
        return Ok(());
    }
    let ticket = Buffer::<u32>::zeros(stream, 1)?;
    stream.run(
        (),
        |()| {
            Err(Error::Unsupported(
                "put_signal from a CPU stream into GPU memory".into(),
            ))
        },
        |(), q| {
            let dst_ptr = dst.device_ptr() + at as u64;
            let aligned = (src.device_ptr() | dst_ptr) % 16 == 0;
            let kernel = (&PEER, "peer_put_signal");
            let grid = fill_grid(q.gpu, kernel, (bytes as u64).div_ceil(16).max(1), 256)?;
            let args = Args::new()
                .buf(src)
                .ptr(dst_ptr)
                .u64(bytes as u64)
                .u32(u32::from(aligned))
                .buf(&ticket)
                .ptr(signal.device_ptr() + 8 * slot as u64)
                .u64(value);
            // SAFETY: peer_put_signal(const u8* src, u8* dst, u64 bytes, u32 aligned16,
            // u32* ticket, u64* flag, u64 value), blocks of 256: src holds `bytes` on this
            // stream's device; dst + bytes lies inside the peer mapping (span checked), which
            // this device reaches (checked) and which outlives the stream's use (its Drop
            // waits for this stream); the ticket is one zeroed word freed in stream order;
            // the flag is slot `slot` of the signal mapping (checked), reached likewise.
            unsafe { launch(q, kernel, grid, 256, 0, args) }
        },
    )
}

/// A wait enqueued by [`wait_signal`]: [`finish`](SignalWait::finish) says whether the
/// signal came in time.
#[derive(Debug)]
#[must_use = "a wait that is never finished hides a timeout"]
pub struct SignalWait {
    status: Buffer<u32>,
    slot: usize,
    value: u64,
    timeout: Duration,
}

impl SignalWait {
    /// Waits for `stream` (the one the wait was enqueued on) and returns `Timeout` if the
    /// signal did not reach its value in time.
    pub fn finish(self, stream: &Stream) -> Result<()> {
        let status = self.status.to_host(stream)?;
        if status.first() == Some(&0) {
            return Ok(());
        }
        Err(Error::Timeout {
            what: format!(
                "waiting for signal slot {} to reach {}",
                self.slot, self.value
            ),
            after_ms: self.timeout.as_millis().min(u64::MAX as u128) as u64,
        })
    }
}

/// Enqueues on `stream` a wait (one GPU thread) until `signal[slot] >= value` or `timeout`
/// has passed; work enqueued after it on `stream` sees everything the signalling
/// [`put_signal`] wrote. On the CPU backend the calling thread waits. Call
/// [`SignalWait::finish`] to learn whether it timed out.
pub fn wait_signal(
    stream: &Stream,
    signal: &PeerMapped<u64>,
    slot: usize,
    value: u64,
    timeout: Duration,
) -> Result<SignalWait> {
    signal.check_reach(stream, "wait_signal")?;
    signal.check_span("wait_signal", slot, 1)?;
    signal.used_on(stream);
    let timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
    let status = match signal.mem.host_words() {
        Some(words) => {
            let start = Instant::now();
            let mut arrived = words[slot].load(Ordering::Acquire) >= value;
            while !arrived && start.elapsed() < timeout {
                std::thread::yield_now();
                arrived = words[slot].load(Ordering::Acquire) >= value;
            }
            Buffer::from_host(stream, &[u32::from(!arrived)])?
        }
        None => {
            let status = Buffer::<u32>::uninit(stream, 1)?;
            stream.run(
                (),
                |()| {
                    Err(Error::Unsupported(
                        "wait_signal from a CPU stream on GPU memory".into(),
                    ))
                },
                |(), q| {
                    let args = Args::new()
                        .ptr(signal.device_ptr() + 8 * slot as u64)
                        .u64(value)
                        .u64(timeout_ns)
                        .buf(&status);
                    // SAFETY: peer_wait(const u64* flag, u64 value, u64 timeout_ns,
                    // u32* status), one block of 32: the flag is slot `slot` of a mapping
                    // this device reaches (checked) and which outlives the stream's use; the
                    // status is one word on this stream's device, freed in stream order.
                    unsafe { launch(q, (&PEER, "peer_wait"), 1, 32, 0, args) }
                },
            )?;
            status
        }
    };
    Ok(SignalWait {
        status,
        slot,
        value,
        timeout,
    })
}

/// Two signal words, one in each of two devices' memory, that a kernel on each side bounces
/// a counter through: the round-trip latency of a device-initiated signal between them.
#[derive(Debug)]
pub struct SignalPingPong {
    /// Polled by the first device, stored by the second.
    at_first: PeerMapped<u64>,
    /// Polled by the second device, stored by the first.
    at_second: PeerMapped<u64>,
    /// Rounds run so far (the flags keep counting up).
    rounds: u64,
}

impl SignalPingPong {
    /// The two flags for devices `first` and `second` (the same device works too: two
    /// kernels on two streams of it).
    pub fn new(first: &Device, second: &Device) -> Result<Self> {
        Ok(SignalPingPong {
            at_first: PeerMapped::new(first, 1, std::slice::from_ref(second))?,
            at_second: PeerMapped::new(second, 1, std::slice::from_ref(first))?,
            rounds: 0,
        })
    }

    /// Runs `rounds > 0` round trips between a kernel on `first` (a stream of the first
    /// device) and one on `second` (of the second), each side giving up after `timeout`;
    /// returns the mean one-way latency (time of the first side's kernel / 2 · rounds).
    pub fn run(
        &mut self,
        first: &Stream,
        second: &Stream,
        rounds: u64,
        timeout: Duration,
    ) -> Result<Duration> {
        if rounds == 0 {
            return Err(Error::InvalidArgument("a ping-pong of 0 rounds".into()));
        }
        if first.id() == second.id() {
            return Err(Error::InvalidArgument(
                "a ping-pong needs two streams (its two kernels wait for each other)".into(),
            ));
        }
        if first.device() != self.at_first.owner() || second.device() != self.at_second.owner() {
            return Err(Error::InvalidArgument(
                "ping-pong streams must be of its first and second devices, in that order".into(),
            ));
        }
        let base = self.rounds;
        let end = base
            .checked_add(rounds)
            .ok_or_else(|| Error::InvalidArgument("ping-pong rounds overflow".into()))?;
        self.at_first.used_on(first);
        self.at_second.used_on(second);
        let took = match (
            self.at_first.mem.host_words(),
            self.at_second.mem.host_words(),
        ) {
            (Some(a), Some(b)) => host_pingpong(a, b, base, end, timeout)?,
            _ => self.gpu_pingpong(first, second, base, rounds, timeout)?,
        };
        self.rounds = end;
        Ok(Duration::from_secs_f64(
            took.as_secs_f64() / (2.0 * rounds as f64),
        ))
    }

    fn gpu_pingpong(
        &self,
        first: &Stream,
        second: &Stream,
        base: u64,
        rounds: u64,
        timeout: Duration,
    ) -> Result<Duration> {
        let timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        let side = |s: &Stream, mine: u64, theirs: u64, serve_first: bool| -> Result<Buffer<u32>> {
            let status = Buffer::<u32>::uninit(s, 1)?;
            s.run(
                (),
                |()| {
                    Err(Error::Unsupported(
                        "a ping-pong between a CPU and a GPU".into(),
                    ))
                },
                |(), q| {
                    let args = Args::new()
                        .ptr(mine)
                        .ptr(theirs)
                        .u64(base)
                        .u64(rounds)
                        .u32(u32::from(serve_first))
                        .u64(timeout_ns)
                        .buf(&status);
                    // SAFETY: peer_pingpong(const u64* mine, u64* theirs, u64 base, u64
                    // rounds, u32 serve_first, u64 timeout_ns, u32* status), one block of
                    // 32: both flags are one-word peer mappings reached by this device (made
                    // so in `new`, checked devices) that outlive the streams' use (their Drop
                    // waits); status is one word on this device, freed in stream order.
                    unsafe { launch(q, (&PEER, "peer_pingpong"), 1, 32, 0, args) }
                },
            )?;
            Ok(status)
        };
        let (at_first, at_second) = (self.at_first.device_ptr(), self.at_second.device_ptr());
        // The answering side first, so the serving side rarely waits for it to start.
        let answer = side(second, at_second, at_first, false)?;
        let dev = first.device();
        let (start, stop) = (dev.new_event()?, dev.new_event()?);
        first.record(&start)?;
        let serve = side(first, at_first, at_second, true)?;
        first.record(&stop)?;
        let statuses = [serve.to_host(first)?, answer.to_host(second)?];
        if statuses.iter().any(|s| s.first() != Some(&0)) {
            return Err(Error::Timeout {
                what: "a device signal ping-pong".into(),
                after_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
            });
        }
        let ms = start.elapsed_ms(&stop)?;
        Ok(Duration::from_secs_f64(f64::from(ms) / 1e3))
    }
}

/// Spins a side of the CPU backend's ping-pong waits before it yields between looks.
const SPINS_BEFORE_YIELD: u32 = 1000;

/// The CPU backend's ping-pong: the second side on a thread of its own.
fn host_pingpong(
    at_first: &[std::sync::atomic::AtomicU64],
    at_second: &[std::sync::atomic::AtomicU64],
    base: u64,
    end: u64,
    timeout: Duration,
) -> Result<Duration> {
    let side = |mine: &std::sync::atomic::AtomicU64,
                theirs: &std::sync::atomic::AtomicU64,
                serve_first: bool|
     -> bool {
        let start = Instant::now();
        for r in base + 1..=end {
            if serve_first {
                theirs.store(r, Ordering::Release);
            }
            let mut spins = 0u32;
            while mine.load(Ordering::Acquire) < r {
                if start.elapsed() > timeout {
                    return false;
                }
                // Spin a while, then give the CPU away: on a host with fewer free cores than
                // the two sides, a side that only spins holds up the other for a time slice
                // a round (1000 rounds on 2 busy cores ran past 10 s).
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if !serve_first {
                theirs.store(r, Ordering::Release);
            }
        }
        true
    };
    let start = Instant::now();
    let (served, answered) = std::thread::scope(|scope| {
        let answer = scope.spawn(|| side(&at_second[0], &at_first[0], false));
        let served = side(&at_first[0], &at_second[0], true);
        (served, answer.join().unwrap_or(false))
    });
    let took = start.elapsed();
    if !(served && answered) {
        return Err(Error::Timeout {
            what: "a signal ping-pong on the CPU backend".into(),
            after_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        });
    }
    Ok(took)
}
