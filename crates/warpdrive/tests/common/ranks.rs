//! The ranks of a `dist` test body: the in-process CPU group or NCCL (one GPU a rank), a
//! thread each, and `both_backends!`, which runs one body on each (dist.rs,
//! dist_compress.rs).

use std::time::Duration;

use warpdrive::dist::Comm;
use warpdrive::{Device, Stream};

use super::group;

/// Long enough never to be reached by a healthy call.
pub const PATIENT: Duration = Duration::from_secs(30);

/// Where a test body's ranks run: the in-process CPU group, or NCCL with one GPU a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Nccl,
}

impl Backend {
    /// The world sizes this backend runs here: 1 to 4 on the CPU; on NCCL 1 to the number of
    /// GPUs (at most 4), each rank on its own GPU.
    pub fn worlds(self) -> std::ops::RangeInclusive<usize> {
        match self {
            Backend::Cpu => 1..=4,
            Backend::Nccl => 1..=Device::cuda_count().clamp(1, 4),
        }
    }

    /// A group of `world` ranks, each with its device: a new one on the CPU; on NCCL one
    /// that an earlier case gave back when there is one (making and connecting a
    /// communicator takes far longer than a small case).
    fn ranks(self, world: usize) -> Vec<(Comm, Device)> {
        match self {
            Backend::Cpu => group(world, PATIENT)
                .into_iter()
                .map(|c| (c, Device::cpu()))
                .collect(),
            Backend::Nccl => {
                let mut pool = NCCL_POOL.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(i) = pool.iter().position(|g| g.len() == world) {
                    return pool.swap_remove(i);
                }
                drop(pool);
                let devices: Vec<Device> = (0..world)
                    .map(|i| Device::cuda(i).expect("a GPU per rank"))
                    .collect();
                let comms = Comm::nccl_group(&devices, PATIENT).expect("an NCCL group");
                comms.into_iter().zip(devices).collect()
            }
        }
    }

    /// Keeps a group whose ranks all finished their case cleanly, for the next case.
    fn give_back(self, ranks: Vec<(Comm, Device)>) {
        if self == Backend::Nccl {
            NCCL_POOL
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(ranks);
        }
    }
}

/// NCCL groups given back by finished cases, for the next case of their size.
static NCCL_POOL: std::sync::Mutex<Vec<Vec<(Comm, Device)>>> = std::sync::Mutex::new(Vec::new());

/// Runs `body` on one thread per rank of a `world`-rank group of `backend`, each with a
/// stream of its rank's device; waits for each rank's calls (`Comm::wait`) after the body.
pub fn each_rank_on<R: Send>(
    backend: Backend,
    world: usize,
    body: impl Fn(&Comm, &Stream) -> R + Sync,
) -> Vec<R> {
    let (outs, ranks): (Vec<R>, Vec<(Comm, Device)>) = std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = backend
            .ranks(world)
            .into_iter()
            .map(|(comm, device)| {
                s.spawn(move || {
                    let stream = device.new_stream().expect("a stream");
                    let out = body(&comm, &stream);
                    comm.wait(&stream).expect("the rank's calls finish");
                    (out, (comm, device))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .unzip()
    });
    backend.give_back(ranks);
    outs
}

/// One test body on both backends: `$cpu` runs it on the CPU group, `$gpu` (ignored without
/// a GPU) on NCCL.
#[allow(unused_macros)]
macro_rules! both_backends {
    ($cpu:ident, $gpu:ident, $body:expr) => {
        #[test]
        fn $cpu() {
            let body: fn(Backend) = $body;
            body(Backend::Cpu);
        }

        #[test]
        #[ignore = "needs a CUDA GPU (and NCCL)"]
        fn $gpu() {
            let body: fn(Backend) = $body;
            body(Backend::Nccl);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use both_backends;
