//! The ranks of a `dist` test body: the in-process CPU group or NCCL (one GPU a rank), a
//! thread each, and `both_backends!`, which runs one body on each (dist.rs,
//! dist_compress.rs).

use std::time::Duration;

use warpdrive::dist::{Comm, LaunchEnv, Transport};
use warpdrive::{Device, Stream};

use super::group;

/// Long enough never to be reached by a healthy call.
pub const PATIENT: Duration = Duration::from_secs(30);

/// Where a test body's ranks run: the in-process CPU group, NCCL with one GPU a rank, or the
/// CPU group across processes over a transport (its ranks threads here, each with its own
/// rendezvous, links and mapping: they share nothing but the transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Nccl,
    Procs(Transport),
}

impl Backend {
    /// The world sizes this backend runs here: 1 to 4 on the CPU; on NCCL 1 to the number of
    /// GPUs (at most 4), each rank on its own GPU.
    pub fn worlds(self) -> std::ops::RangeInclusive<usize> {
        match self {
            Backend::Cpu | Backend::Procs(_) => 1..=4,
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
            Backend::Procs(transport) => {
                if let Some(ranks) = self.pooled(world) {
                    return ranks;
                }
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .expect("a free port")
                    .port();
                std::thread::scope(|s| {
                    let joins: Vec<_> = (0..world)
                        .map(|rank| {
                            s.spawn(move || {
                                let env = LaunchEnv {
                                    rank,
                                    world,
                                    local_rank: rank,
                                    master_addr: "127.0.0.1".into(),
                                    master_port: port,
                                };
                                Comm::cpu_rank(&env, transport, PATIENT).expect("a rank joins")
                            })
                        })
                        .collect();
                    joins
                        .into_iter()
                        .map(|h| (h.join().expect("a rank joins"), Device::cpu()))
                        .collect()
                })
            }
            Backend::Nccl => {
                if let Some(ranks) = self.pooled(world) {
                    return ranks;
                }
                let devices: Vec<Device> = (0..world)
                    .map(|i| Device::cuda(i).expect("a GPU per rank"))
                    .collect();
                let comms = Comm::nccl_group(&devices, PATIENT).expect("an NCCL group");
                comms.into_iter().zip(devices).collect()
            }
        }
    }

    /// A group of this backend and size that an earlier case gave back.
    fn pooled(self, world: usize) -> Option<Vec<(Comm, Device)>> {
        let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
        let i = pool
            .iter()
            .position(|(b, g)| *b == self && g.len() == world)?;
        Some(pool.swap_remove(i).1)
    }

    /// Keeps a group whose ranks all finished their case cleanly, for the next case.
    fn give_back(self, ranks: Vec<(Comm, Device)>) {
        if self != Backend::Cpu {
            POOL.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((self, ranks));
        }
    }
}

/// Groups given back by finished cases (NCCL, and the CPU group across processes), for the
/// next case of their backend and size: making one takes far longer than a small case.
type Pooled = (Backend, Vec<(Comm, Device)>);
static POOL: std::sync::Mutex<Vec<Pooled>> = std::sync::Mutex::new(Vec::new());

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
/// a GPU) on NCCL, and `$procs` (when named) on the CPU group across processes, over shared
/// memory and over TCP.
#[allow(unused_macros)]
macro_rules! both_backends {
    ($cpu:ident, $gpu:ident, $procs:ident, $body:expr) => {
        both_backends!($cpu, $gpu, $body);

        #[test]
        fn $procs() {
            let body: fn(Backend) = $body;
            body(Backend::Procs(::warpdrive::dist::Transport::SharedMemory));
            body(Backend::Procs(::warpdrive::dist::Transport::Tcp));
        }
    };
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
