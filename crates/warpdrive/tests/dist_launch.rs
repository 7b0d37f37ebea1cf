//! Starting ranks the way `torchrun` does (`dist`): `LaunchEnv` read from the environment and
//! the NCCL id served over TCP (wrong port, missing rank, disagreeing world size), NCCL ranks
//! from a shared id, and ranks as separate processes of this test binary (also the training
//! check, one process per GPU).

mod common;

use std::time::Duration;

use common::{free_port, free_ports, is_collective, mlp};
use warpdrive::dist::{Comm, LaunchEnv, NcclId, ReduceOp};
use warpdrive::{Buffer, Device, Error};

/// Steps of the training check run by spawned ranks.
const TRAIN_STEPS: usize = 40;

/// Long enough never to be reached by a healthy call.
const PATIENT: Duration = Duration::from_secs(30);

#[test]
#[ignore = "needs a CUDA GPU (and NCCL)"]
fn gpu_nccl_rank_from_a_shared_id_and_a_rank_that_never_joins() {
    let device = common::cuda();
    // One rank of one: joins at once.
    let id = NcclId::new().unwrap();
    let comm = Comm::nccl_rank(&device, &id, 1, 0, PATIENT).unwrap();
    let stream = device.new_stream().unwrap();
    let mut buf = Buffer::from_host(&stream, &[2.5f32, -1.0, 3.0]).unwrap();
    comm.all_reduce(&stream, &mut buf, ReduceOp::Average)
        .unwrap();
    comm.wait(&stream).unwrap();
    assert_eq!(buf.to_host(&stream).unwrap(), [2.5f32, -1.0, 3.0]);
    // Rank 0 of two, and rank 1 never comes: an error within the timeout, not a hang.
    let id = NcclId::new().unwrap();
    let start = std::time::Instant::now();
    let e = Comm::nccl_rank(&device, &id, 2, 0, Duration::from_secs(3)).unwrap_err();
    assert!(is_collective(&e, "never joined"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn launch_env_reads_torchrun_variables_and_names_what_is_wrong() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        LaunchEnv::from_lookup(move |k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    };
    let ok = env(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(
        (ok.rank, ok.world, ok.local_rank, ok.master_port),
        (2, 4, 2, 29500)
    );
    let bad = |vars, needle: &str| {
        let e = env(vars).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains(needle)),
            "{e}"
        );
    };
    bad(&[("RANK", "0")], "WORLD_SIZE is not set");
    bad(
        &[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        "RANK=\"x\"",
    );
    bad(
        &[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        "out of range",
    );
    bad(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ],
        "MASTER_PORT",
    );
}

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

#[test]
fn every_rank_gets_rank_zeros_id_over_tcp() {
    let port = free_port();
    let mut bytes = [0u8; 128];
    bytes
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i * 7 + 3) as u8);
    let id = NcclId::from_bytes(bytes);
    // Ranks start in any order: the others retry until rank 0 listens.
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .rev()
            .map(|rank| {
                s.spawn(move || {
                    let mine = (rank == 0).then_some(id);
                    launch(rank, 4, port).share_id(mine, PATIENT)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert_eq!(g.unwrap(), id);
    }
}

#[test]
fn a_wrong_port_or_a_missing_rank_fails_within_the_timeout() {
    let [port, wrong] = free_ports();
    let id = NcclId::from_bytes([9u8; 128]);
    let timeout = Duration::from_millis(800);
    let start = std::time::Instant::now();
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(move || launch(0, 2, port).share_id(Some(id), timeout));
        let one = s.spawn(move || launch(1, 2, wrong).share_id(None, timeout));
        (zero.join().unwrap(), one.join().unwrap())
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    let zero = zero.unwrap_err();
    assert!(is_collective(&zero, "ranks [1] never came"), "{zero}");
    let one = one.unwrap_err();
    assert!(is_collective(&one, "MASTER_PORT"), "{one}");
}

#[test]
fn ranks_that_disagree_on_the_world_size_are_refused() {
    let port = free_port();
    let id = NcclId::from_bytes([1u8; 128]);
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(move || launch(0, 2, port).share_id(Some(id), PATIENT));
        let one = s.spawn(move || launch(1, 3, port).share_id(None, PATIENT));
        (zero.join().unwrap(), one.join().unwrap())
    });
    assert!(is_collective(&zero.unwrap_err(), "WORLD_SIZE=3"));
    assert!(is_collective(&one.unwrap_err(), "refused"));
}

/// Set in the environment of a rank this test binary spawns as a separate process: what the
/// rank does (`id`: fetch rank 0's id; `nccl`: an all-reduce over `Comm::from_env`;
/// `train`: the training check, [`TRAIN_STEPS`] of data-parallel SGD over `Comm::from_env`).
const SPAWNED: &str = "WARPDRIVE_DIST_SPAWNED";

/// The body of a spawned rank (see the two tests below); without `WARPDRIVE_DIST_SPAWNED`
/// it has nothing to do.
#[test]
fn spawned_rank_body() {
    let Ok(mode) = std::env::var(SPAWNED) else {
        return;
    };
    let env = LaunchEnv::from_env().unwrap();
    match mode.as_str() {
        "id" => {
            let mine = (env.rank == 0).then(|| NcclId::from_bytes([0x5a; 128]));
            let id = env.share_id(mine, PATIENT).unwrap();
            println!(
                "\nID {:?} {}",
                id,
                id.as_bytes().iter().map(|&b| b as u32).sum::<u32>()
            );
        }
        "nccl" => {
            let device = Device::cuda(env.local_rank).unwrap();
            let comm = Comm::from_env(&device, PATIENT).unwrap();
            let stream = device.new_stream().unwrap();
            let mut buf = Buffer::from_host(&stream, &vec![env.rank as f32 + 1.0; 1001]).unwrap();
            comm.all_reduce(&stream, &mut buf, ReduceOp::Sum).unwrap();
            comm.wait(&stream).unwrap();
            let out = buf.to_host(&stream).unwrap();
            assert!(out.iter().all(|&x| x == out[0]));
            println!("\nSUM {}", out[0]);
        }
        "train" => {
            let device = Device::cuda(env.local_rank).unwrap();
            let comm = Comm::from_env(&device, PATIENT).unwrap();
            let stream = device.new_stream().unwrap();
            let sd = common::seed("training");
            let (xs, ys) = mlp::data(sd, mlp::SAMPLES, 0.0);
            let mut p = mlp::init(sd ^ 1);
            for t in 0..TRAIN_STEPS {
                let (_, g) = mlp::grad(&p, &xs, &ys, &mlp::my_share(&comm, t, xs.len()));
                let mut buf = Buffer::from_host(&stream, &g).unwrap();
                comm.all_reduce(&stream, &mut buf, ReduceOp::Average)
                    .unwrap();
                comm.wait(&stream).unwrap();
                let g = buf.to_host(&stream).unwrap();
                p.iter_mut().zip(&g).for_each(|(p, g)| *p -= mlp::LR * g);
            }
            let bits: Vec<String> = p.iter().map(|v| format!("{:08x}", v.to_bits())).collect();
            println!("\nPARAMS {}", bits.join(" "));
        }
        other => panic!("{SPAWNED}={other}?"),
    }
}

/// Runs `world` copies of this test binary's `spawned_rank_body`, one a rank, as torchrun
/// would start them; the stdout of each, in rank order. Each is killed after two minutes.
fn spawn_ranks(world: usize, mode: &str) -> Vec<String> {
    spawn_ranks_with(world, mode, &[])
}

/// [`spawn_ranks`] with extra environment variables for every rank.
fn spawn_ranks_with(world: usize, mode: &str, vars: &[(&str, String)]) -> Vec<String> {
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
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
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

#[test]
fn ranks_in_separate_processes_get_rank_zeros_id() {
    let outs = spawn_ranks(3, "id");
    let ids: Vec<&str> = outs
        .iter()
        .map(|o| o.lines().find(|l| l.starts_with("ID ")).unwrap_or("none"))
        .collect();
    assert_eq!(
        ids[0],
        format!("ID {:?} {}", NcclId::from_bytes([0x5a; 128]), 0x5a * 128)
    );
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
}

#[test]
#[ignore = "needs two CUDA GPUs (and NCCL)"]
fn gpu_nccl_ranks_in_separate_processes_all_reduce() {
    if Device::cuda_count() < 2 {
        eprintln!(
            "SKIPPED: needs two CUDA GPUs, this host has {}",
            Device::cuda_count()
        );
        return;
    }
    let outs = spawn_ranks(2, "nccl");
    for out in outs {
        assert!(out.lines().any(|l| l == "SUM 3"), "{out}");
    }
}

/// The training check with one process per GPU, started as torchrun starts ranks: every
/// rank ends with the same parameters, within 1e-5 of their scale of one rank's SGD over the
/// whole batch (NCCL averages in f32, one rank sums the batch in another order). Runs on the
/// largest power of two of the host's GPUs (the batch splits evenly), one process on a
/// one-GPU host.
#[test]
#[ignore = "needs a CUDA GPU (and NCCL); several to average across processes"]
fn gpu_nccl_training_with_one_process_per_gpu_matches_one_rank() {
    let gpus = Device::cuda_count();
    assert!(gpus >= 1, "GPU test run without a CUDA device");
    let world = 1usize << gpus.min(mlp::BATCH).ilog2();
    let sd = common::seed("training");
    let outs = spawn_ranks_with(world, "train", &[("WARPDRIVE_TEST_SEED", sd.to_string())]);
    let params: Vec<Vec<f32>> = outs
        .iter()
        .map(|out| {
            let line = out.lines().find_map(|l| l.strip_prefix("PARAMS "));
            let line = line.unwrap_or_else(|| panic!("a rank printed no parameters: {out}"));
            line.split(' ')
                .map(|h| f32::from_bits(u32::from_str_radix(h, 16).unwrap()))
                .collect()
        })
        .collect();
    for (r, p) in params.iter().enumerate() {
        assert_eq!(p, &params[0], "world {world}: rank {r} differs from rank 0");
    }
    let (xs, ys) = mlp::data(sd, mlp::SAMPLES, 0.0);
    let reference = mlp::one_rank(&xs, &ys, sd ^ 1, TRAIN_STEPS, mlp::LR, 0.0);
    let want = &reference[TRAIN_STEPS - 1];
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in params[0].iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "world {world} param {i}: {a} vs {b} (scale {scale})"
        );
    }
    eprintln!(
        "world {world}: {} ranks, one process each, match one rank",
        params.len()
    );
}
