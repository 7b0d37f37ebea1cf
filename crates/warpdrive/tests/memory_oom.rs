//! The device pool on a full card: requests the driver refuses while blocks freed with
//! `record_stream` still wait for another stream (the idea of PyTorch's
//! `test_caching_allocator_record_stream_oom`), with real driver allocations. A test binary
//! of its own: cargo runs test binaries one at a time, so no other test allocates while
//! this one fills the card.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::{cuda, random_f32, rng, seed};
use warpdrive::exec::{self, Kernel, LaunchConfig};
use warpdrive::memory::{DevicePool, PinnedBuf, PoolStrategy};
use warpdrive::{kernels, ops, Buffer, Device, Error, Stream};

const MIB: usize = 1 << 20;
/// The card is filled with buffers of this size (over 10 MiB: each has a segment of its own).
const CHUNK: usize = 512 * MIB;
/// Polls of the host flag (each a read of host memory plus a ~1 µs sleep) before the gate
/// kernel gives up: far longer than the host needs between closing the gate and asking.
const GATE_POLLS: u64 = 2_000_000;

/// Holds a stream: a kernel that waits for a host flag which stays 0, and gives up after
/// [`GATE_POLLS`] polls; work enqueued behind it on the stream waits as long. Its status
/// word (host memory, read without waiting) is 0 while it waits and 2 once it gave up.
struct Gate {
    kernel: Kernel,
    stream: Stream,
    flag: PinnedBuf<u32>,
    status: PinnedBuf<u32>,
    out: Buffer<u32>,
}

impl Gate {
    /// Loads the kernel and runs it once with the flag set, so that nothing its launches
    /// need is allocated later, when the card is full.
    fn new(dev: &Device, stream: &Stream) -> Gate {
        let mut gate = Gate {
            kernel: Kernel::new(dev, &kernels::BASIC, "wait_flag_then_fill").unwrap(),
            stream: stream.clone(),
            flag: PinnedBuf::from_slice(dev, &[1u32]).unwrap(),
            status: PinnedBuf::from_slice(dev, &[0u32]).unwrap(),
            out: Buffer::uninit(stream, 256).unwrap(),
        };
        gate.launch();
        stream.synchronize().unwrap();
        assert_eq!(gate.status(), 1, "the warm-up run saw the flag");
        gate.flag.wait_slice_mut().unwrap()[0] = 0;
        gate
    }

    /// Enqueues a kernel that holds the stream for [`GATE_POLLS`] polls.
    fn close(&mut self) {
        self.status.wait_slice_mut().unwrap()[0] = 0;
        self.launch();
    }

    fn status(&self) -> u32 {
        self.status.wait_slice().unwrap()[0]
    }

    fn launch(&mut self) {
        let (mut flag, mut out, mut value, mut n, mut limit, mut status) = (
            self.flag.host_ptr(),
            self.out.device_ptr(),
            0x6A7E_u32,
            self.out.len() as u64,
            GATE_POLLS,
            self.status.host_ptr(),
        );
        let mut params = [
            &mut flag as *mut u64 as *mut c_void,
            &mut out as *mut u64 as *mut c_void,
            &mut value as *mut u32 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut limit as *mut u64 as *mut c_void,
            &mut status as *mut u64 as *mut c_void,
        ];
        // SAFETY: wait_flag_then_fill(const u32* flag, u32* out, u32 value, u64 n, u64 limit,
        // u32* status), block size 256: `flag` and `status` are live page-locked words
        // (device-visible under unified addressing), `out` holds n u32s, and all three
        // outlive the kernel (dropping the gate waits for its stream).
        unsafe {
            exec::launch(
                &self.stream,
                &self.kernel,
                LaunchConfig::linear(1, 256),
                &mut params,
            )
        }
        .unwrap();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The kernel reads and writes the gate's memory until it ends.
        let _ = self.stream.synchronize();
    }
}

/// Allocates `CHUNK`-byte buffers on `s` until the driver refuses one: the refusal is an
/// `OutOfMemory` carrying the figures, and the pool keeps working.
fn fill_card(pool: &Arc<DevicePool>, s: &Stream, live: &mut Vec<Buffer<u32>>) {
    let most = pool.device().mem_info().unwrap().1 / CHUNK + 1;
    for _ in 0..most {
        match Buffer::<u32>::uninit_in(pool, s, CHUNK / 4) {
            Ok(b) => live.push(b),
            Err(Error::OutOfMemory { requested, detail }) => {
                assert_eq!(requested, CHUNK);
                for word in ["refused", "in use", "reserved", "device free"] {
                    assert!(detail.contains(word), "{detail}");
                }
                return;
            }
            Err(e) => panic!("filling the card: {e}"),
        }
    }
    panic!("the driver never refused a {CHUNK}-byte segment in {most} tries");
}

/// Frees `chunk` while work on `s2` (queued behind the closed gate) still writes it.
/// Returns its address.
fn free_while_used_on(s2: &Stream, mut chunk: Buffer<u32>) -> u64 {
    // Nothing on the allocating stream touched it, so s2 needs no wait before writing.
    ops::fill(s2, &mut chunk, 0xC0DE_C0DE).unwrap();
    chunk.record_stream(s2).unwrap();
    let addr = chunk.device_ptr();
    drop(chunk);
    addr
}

/// The card full of live buffers and of buffers freed while another stream may still use
/// them. A request the driver refuses makes the pool wait for the device and then (1) give
/// the pending segments back and ask the driver again, for a request larger than any of
/// them, or (2) hand out a pending block that fits. Either way it is served only after the
/// kernel holding the other stream has ended. At the end every byte goes back to the
/// driver and the device still works.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_a_refused_request_waits_for_blocks_pending_on_another_stream() {
    let dev = cuda();
    let pool = DevicePool::new(&dev, PoolStrategy::default()).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mut gate = Gate::new(&dev, &s2);
    // Load the fill kernel now too.
    ops::fill(&s2, &mut gate.out, 0).unwrap();
    s2.synchronize().unwrap();
    let free_at_start = dev.mem_info().unwrap().0;
    let mut live = Vec::new();
    fill_card(&pool, &s1, &mut live);
    assert!(live.len() > 4, "room for only {} chunks", live.len());

    // (1) Three chunks pending behind the gate; 1 GiB is more than the driver has left and
    // than any cached block.
    gate.close();
    for _ in 0..3 {
        free_while_used_on(&s2, live.pop().unwrap());
    }
    let before = pool.stats().unwrap();
    assert_eq!(before.pending, 3 * CHUNK as u64);
    assert_eq!(
        gate.status(),
        0,
        "the gate gave up too early: raise GATE_POLLS"
    );
    let big = Buffer::<u32>::uninit_in(&pool, &s1, 2 * CHUNK / 4).unwrap();
    assert_eq!(
        gate.status(),
        2,
        "served before the kernel holding s2 ended"
    );
    let st = pool.stats().unwrap();
    assert_eq!(st.pending, 0, "{st:?}");
    assert_eq!(
        st.driver_frees - before.driver_frees,
        3,
        "the pending segments went back to the driver"
    );

    // (2) Full again, one chunk pending behind the gate, and a request of its size.
    fill_card(&pool, &s1, &mut live);
    gate.close();
    let pending = free_while_used_on(&s2, live.pop().unwrap());
    let before = pool.stats().unwrap();
    assert_eq!(
        gate.status(),
        0,
        "the gate gave up too early: raise GATE_POLLS"
    );
    let mut again = Buffer::<u32>::uninit_in(&pool, &s1, CHUNK / 4).unwrap();
    assert_eq!(
        gate.status(),
        2,
        "served before the kernel holding s2 ended"
    );
    assert_eq!(again.device_ptr(), pending, "the block the wait completed");
    let st = pool.stats().unwrap();
    assert_eq!(st.pending, 0, "{st:?}");
    assert_eq!(
        (st.driver_allocs, st.driver_frees),
        (before.driver_allocs, before.driver_frees),
        "served from the cache"
    );
    // Its new contents stay (s2's fill of it ran before it was handed out).
    ops::fill(&s1, &mut again, 0x600D_F00D).unwrap();
    dev.synchronize().unwrap();
    assert!(again
        .to_host(&s1)
        .unwrap()
        .iter()
        .all(|&x| x == 0x600D_F00D));

    // Everything back to the driver; the device still serves allocations and copies.
    drop((live, big, again));
    let st = pool.stats().unwrap();
    assert_eq!((st.in_use, st.pending), (0, 0), "{st:?}");
    assert_eq!(pool.trim().unwrap(), st.reserved);
    assert_eq!(pool.stats().unwrap().reserved, 0);
    assert!(
        dev.mem_info().unwrap().0 + CHUNK >= free_at_start,
        "the card's memory came back"
    );
    let data = random_f32(&mut rng(seed("memory_oom")), (1 << 20) + 3);
    let x = Buffer::from_host(&s1, &data).unwrap();
    assert!(x.to_host(&s1).unwrap() == data);
    let mut y = Buffer::<u32>::uninit_in(&pool, &s1, CHUNK / 4).unwrap();
    ops::fill(&s1, &mut y, 7).unwrap();
    assert!(y.to_host(&s1).unwrap().iter().all(|&v| v == 7));
    drop(y);
    pool.trim().unwrap();
}
