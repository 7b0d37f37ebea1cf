//! The baselines the actors are measured against (suite `actors`): a doorbell — one GPU
//! thread polling one mapped word and answering, no queue: the ceiling of a round trip —
//! and a one-message kernel for the launch-per-message ways (a launch, or a graph, then a
//! synchronize, per message). On the CPU backend a host thread plays the doorbell and the
//! kernel runs on the host.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::{ResidentGuard, SharedWords};
use crate::error::{Error, Result};
use crate::kernels::{self, ACTOR_PROBE};
use crate::ops::{self, Args};
use crate::{Device, Event, Stream};

const RING: usize = 0;
const STOP: usize = 1;
const ANSWER: usize = 2;

/// A running doorbell (see the module docs). Stops when dropped.
pub struct Doorbell {
    words: Arc<SharedWords>,
    next: u64,
    running: DoorbellRun,
}

enum DoorbellRun {
    Host(Option<JoinHandle<()>>),
    Gpu {
        done: Event,
        _stream: Stream,
        guard: Option<ResidentGuard>,
    },
}

impl Doorbell {
    /// Starts a doorbell on `device`.
    pub fn start(device: &Device) -> Result<Doorbell> {
        let words = Arc::new(device.shared_words(4)?);
        let running = if device.is_host_memory() {
            let w = words.clone();
            let t = std::thread::Builder::new()
                .name("warpdrive-doorbell".into())
                .spawn(move || host_doorbell(w.words()))
                .map_err(|e| Error::Actor {
                    actor: "doorbell".into(),
                    detail: format!("thread did not start: {e}"),
                })?;
            DoorbellRun::Host(Some(t))
        } else {
            let gpu = device.gpu("the doorbell")?;
            // Loaded first, so the eager load below covers its module too.
            kernels::function(gpu, &ACTOR_PROBE, "doorbell")?;
            kernels::load_eagerly(gpu, false)?;
            let stream = device.new_stream()?;
            let done = device.new_sync_event()?;
            let guard = gpu.resident_guard();
            let q = stream.gpu("the doorbell")?;
            let args = Args::new().ptr(words.device_ptr());
            // SAFETY: the kernel takes (u64* words): four mapped words that live in `words`
            // until the kernel has ended (`Drop` waits for it, or leaks them).
            unsafe { ops::launch(q, (&ACTOR_PROBE, "doorbell"), 1, 32, 0, args)? };
            stream.record(&done)?;
            DoorbellRun::Gpu {
                done,
                _stream: stream,
                guard: Some(guard),
            }
        };
        Ok(Doorbell {
            words,
            next: 0,
            running,
        })
    }

    /// Rings once and waits for the answer, up to `timeout`.
    pub fn ring(&mut self, timeout: Duration) -> Result<()> {
        self.next += 1;
        let w = self.words.words();
        w[RING].store(self.next, Ordering::Release);
        let t0 = Instant::now();
        while w[ANSWER].load(Ordering::Acquire) != self.next {
            if t0.elapsed() > timeout {
                return Err(Error::Timeout {
                    what: "the doorbell's answer".into(),
                    after_ms: timeout.as_millis() as u64,
                });
            }
            std::hint::spin_loop();
        }
        Ok(())
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        self.words.words()[STOP].store(1, Ordering::Release);
        match &mut self.running {
            DoorbellRun::Host(t) => {
                if let Some(t) = t.take() {
                    let _ = t.join();
                }
            }
            DoorbellRun::Gpu { done, guard, .. } => {
                let t0 = Instant::now();
                loop {
                    match done.query() {
                        Ok(true) => {
                            guard.take();
                            return;
                        }
                        Ok(false) if t0.elapsed() < Duration::from_secs(5) => {
                            std::hint::spin_loop()
                        }
                        _ => break,
                    }
                }
                // The kernel may still write its words: leak them.
                tracing::warn!("the doorbell kernel did not end; its memory is leaked");
                std::mem::forget(self.words.clone());
                if let Some(g) = guard.take() {
                    std::mem::forget(g);
                }
            }
        }
    }
}

fn host_doorbell(w: &[AtomicU64]) {
    let mut last = 0;
    let mut idle = super::host::Backoff::new();
    while w[STOP].load(Ordering::Acquire) != 1 {
        let v = w[RING].load(Ordering::Acquire);
        if v != last {
            last = v;
            w[ANSWER].store(v, Ordering::Release);
            idle = super::host::Backoff::new();
        } else {
            idle.pause();
        }
    }
}

/// A message of up to 256 bytes in mapped memory and a kernel that answers it once per
/// enqueue (`out = 3 in + 1` per 32-bit word): the launch-per-message baselines.
pub struct OneShot {
    device: Device,
    input: SharedWords,
    output: SharedWords,
    words: usize,
}

impl OneShot {
    /// A one-message kernel for messages of `bytes` (a multiple of 8, 8 to 256).
    pub fn new(device: &Device, bytes: usize) -> Result<OneShot> {
        if bytes == 0 || bytes % 8 != 0 || bytes > super::MAX_MESSAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "one-shot messages of {bytes} bytes: a multiple of 8, up to {}",
                super::MAX_MESSAGE_BYTES
            )));
        }
        Ok(OneShot {
            device: device.clone(),
            input: device.shared_words(bytes / 8)?,
            output: device.shared_words(bytes / 8)?,
            words: bytes / 8,
        })
    }

    /// Sets the message (`bytes` long, as made).
    pub fn write(&self, msg: &[u8]) {
        for (w, chunk) in self.input.words().iter().zip(msg.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            w.store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
    }

    /// The answer, once the enqueued kernel has run (after a synchronize).
    pub fn read(&self, out: &mut [u8]) {
        for (w, chunk) in self.output.words().iter().zip(out.chunks_mut(8)) {
            let b = w.load(Ordering::Acquire).to_le_bytes();
            let n = chunk.len();
            chunk.copy_from_slice(&b[..n]);
        }
    }

    /// Enqueues the kernel on `stream` (capturable in a graph).
    pub fn enqueue(&self, stream: &Stream) -> Result<()> {
        self.device.same_as(stream.device(), "OneShot::enqueue")?;
        let n = (self.words * 2) as u32;
        stream.run(
            (),
            |_| {
                let (i, o) = (self.input.words(), self.output.words());
                for (src, dst) in i.iter().zip(o) {
                    let v = src.load(Ordering::Acquire);
                    let lo = (v as u32).wrapping_mul(3).wrapping_add(1) as u64;
                    let hi = ((v >> 32) as u32).wrapping_mul(3).wrapping_add(1) as u64;
                    dst.store(hi << 32 | lo, Ordering::Release);
                }
                Ok(())
            },
            |_, q| {
                let args = Args::new()
                    .ptr(self.input.device_ptr())
                    .ptr(self.output.device_ptr())
                    .u32(n);
                // SAFETY: the kernel takes (const u32* in, u32* out, u32 n): both blocks hold
                // n u32 words and live as long as `self`, which the caller keeps past the
                // stream's work (it synchronizes before reading).
                unsafe { ops::launch(q, (&ACTOR_PROBE, "echo_once"), 1, 32, 0, args) }
            },
        )
    }
}
