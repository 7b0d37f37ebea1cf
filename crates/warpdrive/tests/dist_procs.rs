//! The CPU group across processes (`dist`, `Comm::cpu_rank`), over shared memory and over
//! TCP: every collective and send / receive at odd sizes (one past a round's slot) on random
//! data against a sequential reference, worlds 2 and 4, with the ranks as threads of this
//! test (each its own rendezvous, links and mapping) and as processes this test binary
//! spawns, started as torchrun starts them; ranks that disagree on lengths get an error on
//! every rank and the group goes on; a rank that exits or never calls, and a wrong
//! `MASTER_PORT`, end in errors within the timeout.
//!
//! Every rank draws every rank's inputs from one seed, so each checks its own results
//! against the reference on its own. Reductions accumulate in f64 in rank order and round
//! once, as the reference does: results are compared exactly.

mod common;

use std::time::Duration;

use common::{free_port, free_ports, is_collective, rng, seed};
use rand::Rng;
use warpdrive::dist::{Comm, LaunchEnv, ReduceOp, Transport};
use warpdrive::{f16, Buffer, Device, Float, Stream};

/// Long enough never to be reached by a healthy call.
const PATIENT: Duration = Duration::from_secs(30);

const TRANSPORTS: [(Transport, &str); 2] =
    [(Transport::SharedMemory, "shm"), (Transport::Tcp, "tcp")];

const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Average,
];

/// A port nothing listens on now (bound, then released).
fn launch(rank: usize, world: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// Runs `body` on `world` ranks of a new group over `transport`, a thread each.
fn each_thread<R: Send>(
    world: usize,
    transport: Transport,
    timeout: Duration,
    body: impl Fn(&Comm, &Stream) -> R + Sync,
) -> Vec<R> {
    let port = free_port();
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let comm = Comm::cpu_rank(&launch(rank, world, port), transport, timeout)
                        .expect("the rank joins");
                    let stream = Device::cpu().new_stream().expect("a CPU stream");
                    body(&comm, &stream)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// The reduction of `values` as the reference computes it: f64, in rank order, rounded once.
fn reduced<T: Float>(op: ReduceOp, values: impl Iterator<Item = T>) -> T {
    let (mut acc, mut count) = (None::<f64>, 0.0);
    for v in values.map(Float::to_f64) {
        count += 1.0;
        acc = Some(match (acc, op) {
            (None, _) => v,
            (Some(a), ReduceOp::Sum | ReduceOp::Average) => a + v,
            (Some(a), ReduceOp::Max) => a.max(v),
            (Some(a), ReduceOp::Min) => a.min(v),
        });
    }
    let acc = acc.unwrap_or(0.0);
    T::from_f64(if op == ReduceOp::Average {
        acc / count
    } else {
        acc
    })
}

/// Every rank's input of one case, uniform in [-1, 1) from `seed` and the case's `tag`
/// (splitmix64: the debug build draws millions of these).
fn inputs<T: common::TestFloat>(seed: u64, tag: u64, world: usize, len: usize) -> Vec<Vec<T>> {
    let mut state = seed ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..world)
        .map(|_| {
            (0..len)
                .map(|_| T::of((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0))
                .collect()
        })
        .collect()
}

fn bits<T: Float>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// Lengths of the checks: empty, one, odd; and (each collective once) odd past one round's
/// 4 MiB slot of f32.
const LENS: [usize; 3] = [0, 1, 1023];
const PAST_A_SLOT: usize = (1 << 20) + 3;

/// Runs every collective on this rank and checks it against the reference, past a slot
/// too when `past_a_slot`; the number of checks.
fn check_all(comm: &Comm, stream: &Stream, seed: u64, past_a_slot: bool) -> usize {
    let (n, me) = (comm.world(), comm.rank());
    // Each rank draws every rank's inputs: the debug build's seconds go there.
    let big = if past_a_slot { PAST_A_SLOT } else { 1023 };
    let mut checks = 0;
    let mut tag = 0u64;
    let mut next = || {
        tag += 1;
        tag
    };
    // all-reduce, every op, f32 at every length and f16 at an odd one.
    for (len, ops) in LENS
        .map(|l| (l, &OPS[..]))
        .into_iter()
        .chain([(big, &OPS[..1])])
    {
        for &op in ops {
            check_all_reduce(comm, stream, seed, next(), len, op);
            checks += 1;
        }
    }
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let all = inputs::<f16>(seed, next(), n, 1001);
        let mut buf = Buffer::from_host(stream, &all[me]).unwrap();
        comm.all_reduce(stream, &mut buf, op).unwrap();
        let want: Vec<f16> = (0..1001)
            .map(|i| reduced(op, all.iter().map(|x| x[i])))
            .collect();
        assert_eq!(
            bits(&buf.to_host(stream).unwrap()),
            bits(&want),
            "f16 all_reduce {op:?}"
        );
        checks += 1;
    }
    // reduce-scatter: part m of the reduction to each rank, m past a round's share.
    let some = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Average];
    for (m, ops) in [
        (0, &some[..]),
        (1, &some),
        (1023, &some),
        (big / n, &some[..1]),
    ] {
        for &op in ops {
            let all = inputs::<f32>(seed, next(), n, n * m);
            let input = Buffer::from_host(stream, &all[me]).unwrap();
            let mut out = Buffer::from_host(stream, &vec![f32::NAN; m]).unwrap();
            comm.reduce_scatter(stream, &input, &mut out, op).unwrap();
            let want: Vec<f32> = (me * m..(me + 1) * m)
                .map(|i| reduced(op, all.iter().map(|x| x[i])))
                .collect();
            assert_eq!(
                bits(&out.to_host(stream).unwrap()),
                bits(&want),
                "reduce_scatter {op:?} m {m}"
            );
            checks += 1;
        }
    }
    // all-gather and broadcast.
    for len in LENS.into_iter().chain([big]) {
        let all = inputs::<f32>(seed, next(), n, len);
        let input = Buffer::from_host(stream, &all[me]).unwrap();
        let mut out = Buffer::from_host(stream, &vec![f32::NAN; n * len]).unwrap();
        comm.all_gather(stream, &input, &mut out).unwrap();
        assert_eq!(
            bits(&out.to_host(stream).unwrap()),
            bits(&all.concat()),
            "all_gather len {len}"
        );
        let root = (len + 1) % n;
        let mut buf = Buffer::from_host(stream, &all[me]).unwrap();
        comm.broadcast(stream, &mut buf, root).unwrap();
        assert_eq!(
            bits(&buf.to_host(stream).unwrap()),
            bits(&all[root]),
            "broadcast len {len}"
        );
        checks += 2;
    }
    // all-to-all: equal chunks, then per-rank counts (one pair past a round's share).
    for c in LENS.into_iter().chain([big / n]) {
        let all = inputs::<f32>(seed, next(), n, n * c);
        let input = Buffer::from_host(stream, &all[me]).unwrap();
        let mut out = Buffer::from_host(stream, &vec![f32::NAN; n * c]).unwrap();
        comm.all_to_all(stream, &input, &mut out).unwrap();
        let want: Vec<f32> = (0..n)
            .flat_map(|q| all[q][me * c..(me + 1) * c].to_vec())
            .collect();
        assert_eq!(
            bits(&out.to_host(stream).unwrap()),
            bits(&want),
            "all_to_all c {c}"
        );
        checks += 1;
    }
    let mut r = rng(seed ^ next());
    let counts: Vec<Vec<usize>> = (0..n)
        .map(|q| {
            (0..n)
                .map(|d| {
                    if q == 1 && d == 0 {
                        300_001
                    } else {
                        r.random_range(0..2000)
                    }
                })
                .collect()
        })
        .collect();
    let tag = next();
    let all: Vec<Vec<f32>> = (0..n)
        .map(|q| inputs::<f32>(seed, tag + q as u64, 1, counts[q].iter().sum())[0].clone())
        .collect();
    let send = counts[me].clone();
    let recv: Vec<usize> = (0..n).map(|q| counts[q][me]).collect();
    let input = Buffer::from_host(stream, &all[me]).unwrap();
    let mut out = Buffer::from_host(stream, &vec![f32::NAN; recv.iter().sum()]).unwrap();
    comm.all_to_all_v(stream, &input, &send, &mut out, &recv)
        .unwrap();
    let want: Vec<f32> = (0..n)
        .flat_map(|q| {
            let from: usize = counts[q][..me].iter().sum();
            all[q][from..from + counts[q][me]].to_vec()
        })
        .collect();
    assert_eq!(
        bits(&out.to_host(stream).unwrap()),
        bits(&want),
        "all_to_all_v {counts:?}"
    );
    checks += 1;
    // send / receive around the ring, lengths differing by pair, one message past 4 MiB.
    for base in [1usize, 777, big] {
        let tag = next();
        let msg = |q: usize| inputs::<f32>(seed, tag + q as u64, 1, base + q)[0].clone();
        let (to, from) = ((me + 1) % n, (me + n - 1) % n);
        comm.send(stream, &Buffer::from_host(stream, &msg(me)).unwrap(), to)
            .unwrap();
        let mut got = Buffer::from_host(stream, &vec![f32::NAN; base + from]).unwrap();
        comm.recv(stream, &mut got, from).unwrap();
        assert_eq!(
            bits(&got.to_host(stream).unwrap()),
            bits(&msg(from)),
            "recv from {from}"
        );
        checks += 1;
    }
    checks
}

/// Every check on worlds 2 and 4 of ranks as threads over `transport`.
fn threads_match_the_reference(transport: Transport, name: &str) {
    let sd = seed(&format!("dist_procs threads {name}"));
    for world in [2, 4] {
        // Rounds past a slot at world 4 (uneven parts); world 2 at the small lengths.
        let checks = each_thread(world, transport, PATIENT, |comm, stream| {
            check_all(comm, stream, sd, world == 4)
        });
        assert!(
            checks.iter().all(|&c| c == checks[0] && c > 0),
            "{name} world {world}: {checks:?}"
        );
        eprintln!("{name} world {world}: {} checks on each rank", checks[0]);
    }
}

/// One f32 all-reduce of `len` against the reference.
fn check_all_reduce(comm: &Comm, stream: &Stream, seed: u64, tag: u64, len: usize, op: ReduceOp) {
    let (n, me) = (comm.world(), comm.rank());
    let all = inputs::<f32>(seed, tag, n, len);
    let mut buf = Buffer::from_host(stream, &all[me]).unwrap();
    comm.all_reduce(stream, &mut buf, op).unwrap();
    let want: Vec<f32> = (0..len)
        .map(|i| reduced(op, all.iter().map(|x| x[i])))
        .collect();
    assert_eq!(
        bits(&buf.to_host(stream).unwrap()),
        bits(&want),
        "all_reduce {op:?} len {len}"
    );
}

#[test]
fn ranks_as_threads_match_the_reference_over_shared_memory() {
    threads_match_the_reference(Transport::SharedMemory, "shm");
}

#[test]
fn ranks_as_threads_match_the_reference_over_tcp() {
    threads_match_the_reference(Transport::Tcp, "tcp");
}

/// `split` of a process group: two sub-groups (even and odd ranks, in reverse order), each
/// reducing among its own ranks only, then the parent group still in step.
#[test]
fn a_split_makes_sub_groups_that_reduce_among_their_own_ranks() {
    for (transport, name) in TRANSPORTS {
        let world = 4;
        let got = each_thread(world, transport, PATIENT, |comm, stream| {
            let me = comm.rank();
            let sub = comm.split(me % 2, world - me).unwrap();
            let mut buf = Buffer::from_host(stream, &[me as f32 + 1.0; 300]).unwrap();
            sub.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
            let mut all = Buffer::from_host(stream, &[1.0f32]).unwrap();
            comm.all_reduce(stream, &mut all, ReduceOp::Sum).unwrap();
            let (sum, total) = (buf.to_host(stream).unwrap(), all.to_host(stream).unwrap());
            (sub.rank(), sub.world(), sum[0], sum[299], total[0])
        });
        for (me, &(rank, world_of, first, last, total)) in got.iter().enumerate() {
            // Even ranks 0, 2 (ranks 1, 0 by key); odd ranks 1, 3 (ranks 1, 0).
            let want = if me % 2 == 0 { 1.0 + 3.0 } else { 2.0 + 4.0 };
            assert_eq!(rank, usize::from(me < 2), "{name}: rank {me}");
            assert_eq!(
                (world_of, first, last),
                (2, want, want),
                "{name}: rank {me}"
            );
            assert_eq!(total, world as f32, "{name}: rank {me}, the parent group");
        }
    }
}

#[test]
fn ranks_that_disagree_get_an_error_on_every_rank_and_the_group_goes_on() {
    for (transport, name) in TRANSPORTS {
        let outs = each_thread(3, transport, PATIENT, |comm, stream| {
            let (disagree, refused, after) = disagree_then_agree(comm, stream);
            (disagree.to_string(), refused.to_string(), after)
        });
        for (rank, (disagree, refused, after)) in outs.iter().enumerate() {
            assert!(
                disagree.contains("disagree") && disagree.contains("× 12"),
                "{name} rank {rank}: {disagree}"
            );
            // Rank 0 gets its own argument error; the others learn that its call was refused.
            let want = if rank == 0 {
                "out of range"
            } else {
                "rank 0's call at step 1 was refused"
            };
            assert!(refused.contains(want), "{name} rank {rank}: {refused}");
            assert_eq!(*after, 6.0, "{name} rank {rank}");
        }
    }
}

/// An all-reduce of a length that differs by rank, a broadcast whose root rank 0 gets out of
/// range, then an all-reduce all agree on: the two errors and the last sum.
fn disagree_then_agree(comm: &Comm, stream: &Stream) -> (warpdrive::Error, warpdrive::Error, f32) {
    let me = comm.rank();
    let mut buf = Buffer::from_host(stream, &vec![1.0f32; 10 + me]).unwrap();
    let disagree = comm
        .all_reduce(stream, &mut buf, ReduceOp::Sum)
        .unwrap_err();
    let root = if me == 0 { comm.world() } else { 0 };
    let refused = comm.broadcast(stream, &mut buf, root).unwrap_err();
    let mut ok = Buffer::from_host(stream, &[me as f32 + 1.0]).unwrap();
    comm.all_reduce(stream, &mut ok, ReduceOp::Sum).unwrap();
    (disagree, refused, ok.to_host(stream).unwrap()[0])
}

#[test]
fn a_rank_that_never_calls_fails_the_others_within_the_timeout() {
    for (transport, name) in TRANSPORTS {
        let given_up = std::sync::Barrier::new(3);
        let outs = each_thread(3, transport, Duration::from_millis(600), |comm, stream| {
            if comm.rank() == 2 {
                // Stays in the group without calling until the others have given up.
                given_up.wait();
                return None;
            }
            let mut buf = Buffer::from_host(stream, &[1.0f32; 5]).unwrap();
            let e = comm
                .all_reduce(stream, &mut buf, ReduceOp::Sum)
                .unwrap_err();
            given_up.wait();
            Some(e)
        });
        // The first to time out names the rank that did not arrive and aborts the group.
        for (rank, e) in outs.iter().enumerate().take(2) {
            let e = e.as_ref().unwrap();
            assert!(
                is_collective(e, "rank 2, which did not") || is_collective(e, "aborted"),
                "{name} rank {rank}: {e}"
            );
        }
    }
}

/// Set in the environment of a rank this test binary spawns as a separate process: what the
/// rank does (`check`: every collective against the reference; `disagree`: the lengths
/// that differ, then a call all agree on; `exit`: rank 1 leaves at once, the others call).
const SPAWNED: &str = "WARPDRIVE_DIST_PROCS_SPAWNED";

/// In the "exit" case a surviving rank stays a while after its error before its own exit
/// closes its connections: otherwise the other survivor may see it leave before rank 1.
fn linger_after_exit_error() {
    std::thread::sleep(Duration::from_secs(2));
}

/// The body of a spawned rank; without `WARPDRIVE_DIST_PROCS_SPAWNED` it has nothing to do.
#[test]
fn spawned_rank_body() {
    let Ok(mode) = std::env::var(SPAWNED) else {
        return;
    };
    let timeout = match std::env::var("WARPDRIVE_DIST_TIMEOUT_MS") {
        Ok(ms) => Duration::from_millis(ms.parse().unwrap()),
        Err(_) => PATIENT,
    };
    let joined = Comm::cpu_from_env(timeout);
    if mode == "port" {
        println!(
            "\nJOIN {}",
            joined.err().map_or("ok".to_string(), |e| e.to_string())
        );
        return;
    }
    // Rank 1 of "exit" leaves as soon as its own join is done; a rank still joining then
    // learns of it there rather than in its first collective.
    let joined = match joined {
        Err(e) if mode == "exit" => {
            println!("\nEXIT {e}");
            linger_after_exit_error();
            return;
        }
        other => other,
    };
    let comm = joined.unwrap();
    let stream = Device::cpu().new_stream().unwrap();
    match mode.as_str() {
        "check" => {
            let sd: u64 = std::env::var("WARPDRIVE_TEST_SEED")
                .unwrap()
                .parse()
                .unwrap();
            // Rounds past a slot are checked by the threads' test (same code, quicker).
            println!(
                "\nCHECKED {} {comm:?}",
                check_all(&comm, &stream, sd, false)
            );
        }
        "large" => {
            let sd: u64 = std::env::var("WARPDRIVE_TEST_SEED")
                .unwrap()
                .parse()
                .unwrap();
            // Twice: the second call finds the others' buffers where the first left them.
            for (tag, op) in [(1, ReduceOp::Sum), (2, ReduceOp::Average)] {
                check_all_reduce(&comm, &stream, sd, tag, PAST_A_SLOT, op);
            }
            println!("\nLARGE ok {comm:?}");
        }
        "disagree" => {
            let (disagree, refused, after) = disagree_then_agree(&comm, &stream);
            println!("\nDISAGREE {disagree}\nREFUSED {refused}\nAFTER {after}");
        }
        "exit" => {
            if comm.rank() == 1 {
                std::process::exit(0);
            }
            let mut buf = Buffer::from_host(&stream, &[1.0f32; 100]).unwrap();
            let e = comm
                .all_reduce(&stream, &mut buf, ReduceOp::Sum)
                .unwrap_err();
            println!("\nEXIT {e}");
            linger_after_exit_error();
        }
        other => panic!("{SPAWNED}={other}?"),
    }
}

/// Runs `world` copies of this test binary's `spawned_rank_body`, one a rank, as torchrun
/// would start them, each with `vars` (per rank); the stdout of each, in rank order. Each is
/// killed after a minute; every rank must exit cleanly.
fn spawn_ranks(
    world: usize,
    mode: &str,
    vars: &dyn Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<String> {
    use std::process::{Command, Stdio};
    let port = free_port().to_string();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "spawned_rank_body",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(SPAWNED, mode)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(vars(rank))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for child in &mut children {
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "a spawned rank failed: {text}");
            text
        })
        .collect()
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in {out}"))
}

#[test]
fn ranks_as_processes_match_the_reference_over_shared_memory_and_tcp() {
    let sd = seed("dist_procs processes");
    // Shared memory as it comes (with cross-memory attach where the host allows it), without
    // it, and TCP.
    let configs = [
        ("shm", "1", "shared memory"),
        ("shm", "0", "shared memory)"),
        ("tcp", "1", "TCP"),
    ];
    for (name, cma, how) in configs {
        for world in [2, 4] {
            let outs = spawn_ranks(world, "check", &|_| {
                vec![
                    ("WARPDRIVE_DIST_TRANSPORT", name.to_string()),
                    ("WARPDRIVE_DIST_CMA", cma.to_string()),
                    ("WARPDRIVE_TEST_SEED", sd.to_string()),
                ]
            });
            for (rank, out) in outs.iter().enumerate() {
                let checked = line(out, "CHECKED ");
                let want = format!("rank {rank} of {world}, across processes, {how}");
                assert!(checked.contains(&want), "{checked}");
                eprintln!("{name} (cma {cma}) world {world} rank {rank}: {checked}");
            }
        }
    }
}

/// Large all-reduces (one process a rank, over shared memory) on each path: the ranks'
/// buffers lent (mapped by the others), copied through cross-memory attach, staged through
/// the segment; and ranks that differ (one that does not lend, so none does, with and
/// without cross-memory attach).
#[test]
fn large_all_reduces_between_processes_match_the_reference_on_every_path() {
    let sd = seed("dist_procs large");
    // (world, WARPDRIVE_DIST_LEND by rank, WARPDRIVE_DIST_CMA)
    let configs = [
        (4, ["1"; 4], "1"),
        (2, ["1"; 4], "0"),
        (4, ["0"; 4], "1"),
        (2, ["0"; 4], "0"),
        (4, ["1", "1", "0", "1"], "1"),
        (2, ["1", "0", "1", "1"], "0"),
    ];
    for (i, (world, lend, cma)) in configs.into_iter().enumerate() {
        let outs = spawn_ranks(world, "large", &|rank| {
            vec![
                ("WARPDRIVE_DIST_TRANSPORT", "shm".to_string()),
                ("WARPDRIVE_DIST_LEND", lend[rank].to_string()),
                ("WARPDRIVE_DIST_CMA", cma.to_string()),
                ("WARPDRIVE_TEST_SEED", sd.to_string()),
            ]
        });
        for (rank, out) in outs.iter().enumerate() {
            let done = line(out, "LARGE ok ");
            assert!(done.contains(&format!("rank {rank} of {world}")), "{done}");
            eprintln!("config {i}, world {world}, rank {rank}: {done}");
        }
    }
}

#[test]
fn processes_that_disagree_get_an_error_on_every_rank_and_go_on() {
    for (_, name) in TRANSPORTS {
        let outs = spawn_ranks(2, "disagree", &|_| {
            vec![("WARPDRIVE_DIST_TRANSPORT", name.to_string())]
        });
        for (rank, out) in outs.iter().enumerate() {
            assert!(
                line(out, "DISAGREE ").contains("the ranks disagree"),
                "{name}: {out}"
            );
            let want = if rank == 0 { "out of range" } else { "refused" };
            assert!(line(out, "REFUSED ").contains(want), "{name}: {out}");
            assert_eq!(line(out, "AFTER "), "3", "{name}: {out}");
        }
    }
}

#[test]
fn a_process_that_exits_fails_the_others_at_once() {
    for (_, name) in TRANSPORTS {
        let outs = spawn_ranks(3, "exit", &|_| {
            vec![
                ("WARPDRIVE_DIST_TRANSPORT", name.to_string()),
                // Long: the others learn of the exit from its closed connections, not a timeout.
                ("WARPDRIVE_DIST_TIMEOUT_MS", "20000".to_string()),
            ]
        });
        for rank in [0, 2] {
            let e = line(&outs[rank], "EXIT ");
            assert!(
                e.contains("rank 1 left the group"),
                "{name} rank {rank}: {e}"
            );
        }
    }
}

#[test]
fn a_wrong_master_port_fails_within_the_timeout() {
    // Picked together, so the wrong port is never the right one (each rank's overrides
    // spawn_ranks' own port).
    let [port, wrong] = free_ports();
    let outs = spawn_ranks(2, "port", &|rank| {
        let master = if rank == 1 { wrong } else { port };
        vec![
            ("WARPDRIVE_DIST_TIMEOUT_MS", "1500".to_string()),
            ("MASTER_PORT", master.to_string()),
        ]
    });
    let (zero, one) = (line(&outs[0], "JOIN "), line(&outs[1], "JOIN "));
    assert!(zero.contains("ranks [1] never came"), "{zero}");
    assert!(one.contains("MASTER_PORT"), "{one}");
}
