//! The exec floor on both backends: graph replay equals eager execution bit for bit (with
//! new contents in the same buffers), capture-breaking actions fail with their errors, the
//! lean launch path and occupancy configuration, autotune's file (round trip, old files,
//! corruption), and the CPU fallback policy. The device-loss test is in `trap.rs` (it breaks
//! the context for its whole process).

mod common;

use std::path::PathBuf;

use common::{cuda, device_test, random_f32, rng, seed};
use warpdrive::exec::{
    self, run_with_fallback, Autotuner, Fallback, Graph, Kernel, LaunchConfig, TuneKey,
};
use warpdrive::memory::{DevicePool, PoolStrategy};
use warpdrive::{kernels, ops, Buffer, DTypeKind, Device, Error, Result, Stream};

const N: usize = 4099;
const M: usize = 33;
const K: usize = 65;
const NN: usize = 17;

/// x, y, a, b, c, total.
type State = (
    Buffer<f32>,
    Buffer<f32>,
    Buffer<f32>,
    Buffer<f32>,
    Buffer<f32>,
    Buffer<f32>,
);

/// The captured work: axpy in place, a GEMM, and a sum (whose temporary comes from the
/// pool, in capture mode while capturing).
fn pipeline(s: &Stream, st: &mut State) -> Result<()> {
    ops::axpy(s, 1.5, &st.0, &mut st.1)?;
    ops::gemm::matmul(s, &st.2, &st.3, &mut st.4, (M, NN, K))?;
    ops::sum_into(s, &st.1, &mut st.5)
}

fn new_state(s: &Stream) -> State {
    let p = |n: usize| Buffer::from_host(s, &vec![f32::NAN; n]).unwrap();
    (p(N), p(N), p(M * K), p(K * NN), p(M * NN), p(1))
}

type Inputs = [Vec<f32>; 4];

fn write(s: &Stream, st: &mut State, inputs: &Inputs) {
    st.0.copy_from_host(s, &inputs[0]).unwrap();
    st.1.copy_from_host(s, &inputs[1]).unwrap();
    st.2.copy_from_host(s, &inputs[2]).unwrap();
    st.3.copy_from_host(s, &inputs[3]).unwrap();
}

fn outputs(s: &Stream, st: &State) -> Vec<u32> {
    [&st.1, &st.4, &st.5]
        .iter()
        .flat_map(|b| b.to_host(s).unwrap())
        .map(f32::to_bits)
        .collect()
}

fn graph_replay_body(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut inputs = || -> Inputs {
        [
            random_f32(&mut r, N),
            random_f32(&mut r, N),
            random_f32(&mut r, M * K),
            random_f32(&mut r, K * NN),
        ]
    };
    let mut st = new_state(&s);
    let mut eager = new_state(&s);
    // Warm-up on the capture stream: modules load, cuBLAS picks its kernels, and the pool
    // holds a block for the sum's temporary.
    write(&s, &mut st, &inputs());
    pipeline(&s, &mut st).unwrap();
    s.synchronize().unwrap();

    let mut graph = Graph::capture_with(&s, &mut st, pipeline).unwrap();
    graph.prepare().unwrap();
    for round in 0..3 {
        let fresh = inputs();
        write(&s, &mut st, &fresh);
        graph.launch_with(&mut st).unwrap();
        let replayed = outputs(&s, &st);
        write(&s, &mut eager, &fresh);
        pipeline(&s, &mut eager).unwrap();
        let want = outputs(&s, &eager);
        assert!(
            replayed == want,
            "round {round}: replay differs from eager execution"
        );
        assert!(replayed.iter().all(|&b| !f32::from_bits(b).is_nan()));
    }
    // A replay with other buffers is refused on CUDA (the graph holds their addresses);
    // the CPU backend runs the recorded closure on whatever it is given.
    let other = graph.launch_with(&mut eager);
    assert_eq!(other.is_err(), dev.is_cuda(), "{other:?}");
}

device_test!(
    cpu_graph_replay_equals_eager_bit_for_bit,
    gpu_graph_replay_equals_eager_bit_for_bit,
    |dev| graph_replay_body(dev, seed("graph_replay"))
);

/// A closure-only graph: capture records, each launch replays.
fn graph_counts_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let mut acc = Buffer::from_host(&s, &[0.0f32; 3]).unwrap();
    let one = Buffer::from_host(&s, &[1.0f32; 3]).unwrap();
    // Run once before capturing (kernels load lazily, and loading is no capture work).
    ops::axpy(&s, 1.0, &one, &mut acc).unwrap();
    {
        let mut g = Graph::capture(&s, |s| ops::axpy(s, 1.0, &one, &mut acc)).unwrap();
        for _ in 0..5 {
            g.launch().unwrap();
        }
        s.synchronize().unwrap();
    }
    // The warm-up, then the capture (not run on CUDA, recorded on the CPU) replayed five
    // times.
    assert_eq!(acc.to_host(&s).unwrap(), [6.0; 3]);
    // An empty capture is a graph too.
    let mut empty = Graph::capture(&s, |_| Ok(())).unwrap();
    empty.prepare().unwrap();
    empty.launch().unwrap();
}

device_test!(
    cpu_graph_records_the_closure_and_replays_it,
    gpu_graph_captures_once_and_replays,
    graph_counts_body
);

#[test]
fn cpu_graph_errors_come_at_launch() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32; 3]).unwrap();
    let mut y = Buffer::from_host(&s, &[1.0f32; 4]).unwrap();
    let mut g = Graph::capture(&s, |s| ops::axpy(s, 1.0, &x, &mut y)).unwrap();
    assert!(matches!(g.launch(), Err(Error::LengthMismatch { .. })));
}

fn is_capture_error(r: &Result<()>, call_part: &str) -> bool {
    matches!(r, Err(Error::Capture { call, .. }) if call.contains(call_part))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_capture_breaking_actions_fail_with_their_errors() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let mut buf = Buffer::from_host(&s, &[1.0f32; 1024]).unwrap();
    let host = vec![2.0f32; 1024];
    let event = dev.new_sync_event().unwrap();
    s.record(&event).unwrap();
    s.synchronize().unwrap();

    // A buffer the pool does not hold would need the driver: the pool refuses.
    let r = Graph::capture(&s, |s| Buffer::<u8>::uninit(s, 64 << 20).map(drop)).map(drop);
    assert!(
        matches!(&r, Err(Error::OutOfMemory { detail, .. }) if detail.contains("captured")),
        "{r:?}"
    );
    // A pool that is not in capture mode would call cuMemAlloc: refused.
    let other = DevicePool::new(&dev, PoolStrategy::default()).unwrap();
    let r = Graph::capture(&s, |s| Buffer::<u8>::uninit_in(&other, s, 4096).map(drop)).map(drop);
    assert!(is_capture_error(&r, "cuMemAlloc"), "{r:?}");
    // Event queries and synchronisation.
    let r = Graph::capture(&s, |_| event.query().map(drop)).map(drop);
    assert!(is_capture_error(&r, "cuEventQuery"), "{r:?}");
    let r = Graph::capture(&s, |s| s.synchronize()).map(drop);
    assert!(is_capture_error(&r, "cuStreamSynchronize"), "{r:?}");
    let r = Graph::capture(&s, |_| dev.synchronize()).map(drop);
    assert!(is_capture_error(&r, "cuCtxSynchronize"), "{r:?}");
    // Copies from and to pageable memory.
    let r = Graph::capture(&s, |s| buf.copy_from_host(s, &host)).map(drop);
    assert!(is_capture_error(&r, "pageable"), "{r:?}");
    let r = Graph::capture(&s, |s| buf.to_host(s).map(drop)).map(drop);
    assert!(is_capture_error(&r, "pageable"), "{r:?}");

    // The stream and the device work afterwards, and so does a good capture.
    ops::fill(&s, &mut buf, 3.0).unwrap();
    assert_eq!(buf.to_host(&s).unwrap(), vec![3.0; 1024]);
    assert!(event.query().unwrap());
    {
        let mut g = Graph::capture(&s, |s| ops::fill(s, &mut buf, 4.0)).unwrap();
        g.launch().unwrap();
    }
    assert_eq!(buf.to_host(&s).unwrap(), vec![4.0; 1024]);
}

// ---- the lean launch path ----

#[test]
fn cpu_kernels_are_unsupported_on_the_cpu_backend() {
    let r = Kernel::new(&Device::cpu(), &kernels::BASIC, "fill_u32");
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
}

/// fill_u32 through `exec::launch` at the occupancy configuration.
fn launch_fill(s: &Stream, kernel: &Kernel, buf: &mut Buffer<u32>, value: u32) -> Result<()> {
    let config = kernel.config_for(buf.len());
    let (mut out, mut v, mut n) = (buf.device_ptr(), value, buf.len() as u64);
    let mut params = [
        &mut out as *mut u64 as *mut std::ffi::c_void,
        &mut v as *mut u32 as *mut std::ffi::c_void,
        &mut n as *mut u64 as *mut std::ffi::c_void,
    ];
    // SAFETY: fill_u32(u32* out, u32 value, u64 n); `out` holds n elements.
    unsafe { exec::launch(s, kernel, config, &mut params) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_lean_launches_fill_at_the_occupancy_config_on_any_thread() {
    let dev = cuda();
    let kernel = Kernel::new(&dev, &kernels::BASIC, "fill_u32").unwrap();
    let block = kernel.occupancy_block();
    assert!((32..=1024).contains(&block) && block % 32 == 0, "{block}");
    assert!(kernel.occupancy_grid() >= 1);
    for n in [1usize, 1023, (1 << 20) + 3] {
        let s = dev.new_stream().unwrap();
        let mut buf = Buffer::from_host(&s, &vec![0u32; n]).unwrap();
        launch_fill(&s, &kernel, &mut buf, 0xabcd).unwrap();
        assert!(
            buf.to_host(&s).unwrap().iter().all(|&v| v == 0xabcd),
            "n={n}"
        );
    }
    // A fresh thread has bound nothing yet: its first launch binds.
    let k2 = kernel.clone();
    let d2 = dev.clone();
    std::thread::spawn(move || {
        let s = d2.new_stream().unwrap();
        let mut buf = Buffer::from_host(&s, &vec![0u32; 77]).unwrap();
        launch_fill(&s, &k2, &mut buf, 7).unwrap();
        assert_eq!(buf.to_host(&s).unwrap(), vec![7u32; 77]);
    })
    .join()
    .unwrap();
    // A CPU stream is the wrong device.
    let cpu = Device::cpu().new_stream().unwrap();
    let mut params: [*mut std::ffi::c_void; 0] = [];
    // SAFETY: refused before any launch (wrong device).
    let r = unsafe { exec::launch(&cpu, &kernel, LaunchConfig::linear(1, 32), &mut params) };
    assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_programmatic_launches_keep_stream_order() {
    // Fills of 1..=N into the same elements, chained by programmatic dependent launch: each
    // waits for the previous before writing, so the last value wins, eagerly and in a graph.
    let dev = cuda();
    let kernel = Kernel::new(&dev, &kernels::BASIC, "fill_u32").unwrap();
    let s = dev.new_stream().unwrap();
    let n = 4099usize;
    let mut buf = Buffer::from_host(&s, &vec![0u32; n]).unwrap();
    let ptr = buf.device_ptr();
    let config = LaunchConfig {
        programmatic: true,
        ..kernel.config_for(n)
    };
    let enqueue = |s: &Stream, count: u32| -> Result<()> {
        for v in 1..=count {
            let (mut out, mut value, mut len) = (ptr, v, n as u64);
            let mut params = [
                &mut out as *mut u64 as *mut std::ffi::c_void,
                &mut value as *mut u32 as *mut std::ffi::c_void,
                &mut len as *mut u64 as *mut std::ffi::c_void,
            ];
            // SAFETY: fill_u32(u32* out, u32 value, u64 n) over `buf`'s n elements, which
            // outlive the launches; the fill waits for the previous kernel before writing.
            unsafe { exec::launch(s, &kernel, config, &mut params)? };
        }
        Ok(())
    };
    enqueue(&s, 300).unwrap();
    assert!(buf.to_host(&s).unwrap().iter().all(|&v| v == 300));
    let mut graph = Graph::capture(&s, |s| enqueue(s, 500)).unwrap();
    graph.prepare().unwrap();
    for _ in 0..3 {
        buf.copy_from_host(&s, &vec![0u32; n]).unwrap();
        graph.launch().unwrap();
        assert!(buf.to_host(&s).unwrap().iter().all(|&v| v == 500));
    }
}

// ---- autotune ----

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wd-tune-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir.join("autotune.toml")
}

/// Candidate work on the CPU backend: each candidate fills the buffer with itself.
fn cpu_work(s: &Stream, buf: &mut Buffer<f32>, c: u32) -> Result<()> {
    ops::fill(s, buf, c as f32)
}

#[test]
fn autotune_keeps_every_time_and_the_winner_and_reads_them_back() {
    let path = temp_file("roundtrip");
    let s = Device::cpu().new_stream().unwrap();
    let mut buf = Buffer::<f32>::zeros(&s, 1 << 16).unwrap();
    let key = TuneKey::new(&Device::cpu(), "demo", DTypeKind::F32, 1000).unwrap();
    assert_eq!(key.bucket, 10);
    let candidates = [64u32, 128, 256];

    let tuner = Autotuner::at(&path);
    let best = tuner
        .tune(&s, &key, 1000, &candidates, |s, &c| {
            cpu_work(s, &mut buf, c)
        })
        .unwrap();
    // Which candidate is fastest is a measurement (the choice among given times is tested in
    // exec::tune's unit tests); what matters here is what is kept.
    assert!(candidates.contains(&best));
    assert_eq!(tuner.tunings(), 1);
    let record = tuner.get(&key).unwrap();
    assert_eq!(record.winner, best.to_string());
    assert_eq!(record.size, 1000);
    let configs: Vec<&str> = record
        .candidates
        .iter()
        .map(|c| c.config.as_str())
        .collect();
    assert_eq!(configs, ["64", "128", "256"]);
    assert!(record
        .candidates
        .iter()
        .all(|c| c.us > 0.0 && c.us.is_finite()));

    // A new tuner (a new process) reads the file and times nothing for the same bucket.
    let again = Autotuner::at(&path);
    assert_eq!(again.get(&key), Some(record.clone()));
    let mut runs = 0;
    let same_bucket = TuneKey::new(&Device::cpu(), "demo", DTypeKind::F32, 900).unwrap();
    let again_best = again
        .tune(&s, &same_bucket, 900, &candidates, |_, _| {
            runs += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!((again_best, runs, again.tunings()), (best, 0, 0));
    // Another bucket, dtype or kernel is tuned anew; so is a winner no longer offered.
    let other = TuneKey::new(&Device::cpu(), "demo", DTypeKind::F32, 5000).unwrap();
    again
        .tune(&s, &other, 5000, &candidates, |s, &c| {
            cpu_work(s, &mut buf, c)
        })
        .unwrap();
    let others: Vec<u32> = candidates.into_iter().filter(|&c| c != best).collect();
    again
        .tune(&s, &key, 1000, &others, |s, &c| cpu_work(s, &mut buf, c))
        .unwrap();
    assert_eq!(again.tunings(), 2);
    assert_eq!(Autotuner::at(&path).records().len(), 2);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn autotune_files_of_older_versions_load_and_corrupt_files_are_ignored() {
    let path = temp_file("compat");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let key = TuneKey::new(&Device::cpu(), "old", DTypeKind::BF16, 4096).unwrap();
    // An older file: fewer fields, plus one this version does not know.
    std::fs::write(
        &path,
        "version = 0\n[[records]]\nkernel = \"old\"\ndtype = \"bf16\"\nbucket = 12\n\
         device = \"cpu\"\nwinner = \"256\"\nfuture_field = 3\n",
    )
    .unwrap();
    let tuner = Autotuner::at(&path);
    let record = tuner.get(&key).unwrap();
    assert_eq!(
        (record.winner.as_str(), record.candidates.len()),
        ("256", 0)
    );
    let s = Device::cpu().new_stream().unwrap();
    let best = tuner
        .tune(&s, &key, 4096, &[128u32, 256], |_, _| Ok(()))
        .unwrap();
    assert_eq!((best, tuner.tunings()), (256, 0));

    for garbage in ["not toml at all [[[", "records = 5", "\u{0}\u{1}binary"] {
        std::fs::write(&path, garbage).unwrap();
        let tuner = Autotuner::at(&path);
        assert!(tuner.records().is_empty(), "{garbage:?}");
        let best = tuner
            .tune(&s, &key, 4096, &[128u32], |_, _| Ok(()))
            .unwrap();
        assert_eq!(best, 128);
        // The file is valid again.
        assert_eq!(Autotuner::at(&path).get(&key).unwrap().winner, "128");
    }
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn autotune_records_from_another_host_are_not_reused_and_are_kept() {
    let path = temp_file("hosts");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let key = TuneKey::new(&Device::cpu(), "copy", DTypeKind::U8, 1 << 20).unwrap();
    assert_eq!(key.host, exec::tune::host_fingerprint());
    assert!(!key.host.is_empty());
    // The same kernel, dtype, bucket and device, tuned on a machine with other CPUs (a cache
    // that travelled with a home directory).
    std::fs::write(
        &path,
        "version = 1\n[[records]]\nkernel = \"copy\"\ndtype = \"u8\"\nbucket = 20\n\
         device = \"cpu\"\nhost = \"Some Other CPU x3\"\nwinner = \"4\"\n",
    )
    .unwrap();
    let tuner = Autotuner::at(&path);
    assert_eq!(tuner.records().len(), 1);
    assert!(tuner.get(&key).is_none());
    let s = Device::cpu().new_stream().unwrap();
    let mut runs = 0;
    let best = tuner
        .tune(&s, &key, 1 << 20, &[4u32, 16], |_, &c| {
            runs += 1;
            // 4 fails here, so a tune can only pick 16; the other host's 4, taken as it is,
            // would come back without a run.
            match c {
                4 => Err(Error::Unsupported("candidate 4 on this host".into())),
                _ => Ok(()),
            }
        })
        .unwrap();
    assert_eq!((best, tuner.tunings()), (16, 1));
    assert!(runs > 2);
    // Both hosts' records stay in the file, each found by its own host.
    let again = Autotuner::at(&path);
    assert_eq!(again.records().len(), 2);
    let mine = again.get(&key).unwrap();
    assert_eq!(
        (mine.winner.as_str(), mine.host.as_str()),
        ("16", key.host.as_str())
    );
    let other = TuneKey {
        host: "Some Other CPU x3".into(),
        ..key.clone()
    };
    assert_eq!(again.get(&other).unwrap().winner, "4");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn the_autotune_file_of_a_test_run_is_in_its_private_cache() {
    let home = common::cache_home::private_cache_home();
    assert_eq!(
        std::env::var_os("XDG_CACHE_HOME"),
        Some(home.clone().into())
    );
    let file = exec::tune::default_path().unwrap();
    assert!(file.starts_with(&home), "{}", file.display());
}

/// Set in the children of the test below: `<file>|<child index>`.
const TUNE_CHILD_ENV: &str = "WARPDRIVE_TEST_TUNE_CHILD";
const TUNE_PROCESSES: usize = 4;
const TUNE_KEYS_EACH: usize = 40;

/// The keys child `child` tunes.
fn child_keys(child: usize) -> Vec<TuneKey> {
    (0..TUNE_KEYS_EACH)
        .map(|k| {
            TuneKey::new(
                &Device::cpu(),
                &format!("p{child}-k{k}"),
                DTypeKind::F32,
                64,
            )
        })
        .collect::<Result<_>>()
        .unwrap()
}

#[test]
fn autotune_records_of_concurrent_processes_all_reach_the_file() {
    const NAME: &str = "autotune_records_of_concurrent_processes_all_reach_the_file";
    if let Ok(spec) = std::env::var(TUNE_CHILD_ENV) {
        // A child: tune (and so save) each of its keys, one after another.
        let (path, child) = spec.rsplit_once('|').unwrap();
        let tuner = Autotuner::at(path);
        let s = Device::cpu().new_stream().unwrap();
        for key in child_keys(child.parse().unwrap()) {
            tuner.tune(&s, &key, 64, &[1u32, 2], |_, _| Ok(())).unwrap();
        }
        return;
    }
    let path = temp_file("processes");
    let exe = std::env::current_exe().unwrap();
    let (done, results) = std::sync::mpsc::channel();
    for child in 0..TUNE_PROCESSES {
        let process = std::process::Command::new(&exe)
            .args(["--exact", NAME, "--test-threads=1"])
            .env(TUNE_CHILD_ENV, format!("{}|{child}", path.display()))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let done = done.clone();
        std::thread::spawn(move || done.send((child, process.wait_with_output())));
    }
    for _ in 0..TUNE_PROCESSES {
        // A bound on a hang, not a timing assertion.
        let (child, output) = results
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("a child process did not finish");
        let output = output.unwrap();
        assert!(
            output.status.success(),
            "child {child}: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let file = Autotuner::at(&path);
    let missing: Vec<String> = (0..TUNE_PROCESSES)
        .flat_map(child_keys)
        .filter(|k| file.get(k).is_none())
        .map(|k| k.kernel)
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} records lost: {missing:?}",
        missing.len(),
        TUNE_PROCESSES * TUNE_KEYS_EACH
    );
    assert_eq!(file.records().len(), TUNE_PROCESSES * TUNE_KEYS_EACH);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_autotune_times_launch_configs_with_events() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let kernel = Kernel::new(&dev, &kernels::BASIC, "fill_u32").unwrap();
    let n = (1 << 22) + 5;
    let buf = Buffer::<u32>::uninit(&s, n).unwrap();
    let path = temp_file("gpu");
    let tuner = Autotuner::at(&path);
    let key = TuneKey::new(&dev, "fill_u32", DTypeKind::U32, n).unwrap();
    // fill_u32 has __launch_bounds__(256): the larger blocks are refused by the launch (before
    // the driver), and the tuner skips them.
    assert_eq!(kernel.max_block(), 256);
    let blocks = [64u32, 128, 256, 512, 1024];
    let last = std::cell::Cell::new(0u32);
    let best = tuner
        .tune(&s, &key, n, &blocks, |s, &block| {
            last.set(block);
            let grid = n.div_ceil(block as usize).min(65535) as u32;
            let (mut out, mut v, mut len) = (buf.device_ptr(), block, n as u64);
            let mut params = [
                &mut out as *mut u64 as *mut std::ffi::c_void,
                &mut v as *mut u32 as *mut std::ffi::c_void,
                &mut len as *mut u64 as *mut std::ffi::c_void,
            ];
            // SAFETY: fill_u32(u32* out, u32 value, u64 n); `out` holds n elements.
            unsafe { exec::launch(s, &kernel, LaunchConfig::linear(grid, block), &mut params) }
        })
        .unwrap();
    assert!(blocks[..3].contains(&best), "{best}");
    let record = Autotuner::at(&path).get(&key).unwrap();
    let timed: Vec<&str> = record
        .candidates
        .iter()
        .map(|c| c.config.as_str())
        .collect();
    assert_eq!(timed, ["64", "128", "256"]);
    assert!(record.candidates.iter().all(|c| c.us > 0.0));
    assert!(record.device.contains("cc"), "{}", record.device);
    // The last candidate run (which one depends on the number of rounds) wrote the whole
    // buffer.
    assert!(blocks[..3].contains(&last.get()));
    assert!(buf.to_host(&s).unwrap().iter().all(|&v| v == last.get()));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

// ---- fallback ----

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_recoverable_failures_fall_back_to_the_cpu_only_when_asked() {
    let dev = cuda();
    let op = |s: &Stream| -> Result<Vec<f32>> {
        if s.device().is_cuda() {
            // What an unsupported architecture or dtype reports.
            return Err(Error::Unsupported("this op on this GPU".into()));
        }
        let x = Buffer::from_host(s, &[1.0f32, 2.0])?;
        let mut y = Buffer::from_host(s, &[1.0f32, 1.0])?;
        ops::axpy(s, 2.0, &x, &mut y)?;
        y.to_host(s)
    };
    let r = run_with_fallback(&dev, Fallback::Cpu, op).unwrap();
    assert_eq!(r.value, [3.0, 5.0]);
    assert!(matches!(r.fell_back, Some(Error::Unsupported(_))));
    assert!(matches!(
        run_with_fallback(&dev, Fallback::Never, op),
        Err(Error::Unsupported(_))
    ));
    // Out of memory (more than the card has) falls back too.
    let (_, total) = dev.mem_info().unwrap();
    let r = run_with_fallback(&dev, Fallback::Cpu, |s| {
        let n = if s.device().is_cuda() { total } else { 16 };
        Buffer::<f32>::uninit(s, n).map(|b| b.len())
    })
    .unwrap();
    assert_eq!(r.value, 16);
    assert!(matches!(r.fell_back, Some(Error::OutOfMemory { .. })));
}
