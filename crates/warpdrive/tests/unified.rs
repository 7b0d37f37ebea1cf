//! `UnifiedBuffer` (state machine against a model, on both backends) and `ManagedBuffer`
//! (refusal beyond free memory, hints and prefetch). GPU tests (`gpu_*`) are ignored without
//! a GPU.

mod common;

use common::{cuda, device_test, random_f32, rng, seed};
use proptest::prelude::*;
use rand::Rng;
use warpdrive::memory::{Advice, Coherence, Location, ManagedBuffer, UnifiedBuffer};
use warpdrive::{ops, Buffer, Device, Error};

/// One step on a `UnifiedBuffer` of f32.
#[derive(Debug, Clone)]
enum Op {
    /// `host_mut()[i] = v`.
    HostWrite(usize, f32),
    /// `fill(device_mut(s), v)` on stream `s`.
    DeviceFill(usize, f32),
    /// `device_mut(s) += alpha` (axpy with ones) on stream `s`.
    DeviceAdd(usize, f32),
    SyncToDevice(usize),
    SyncToHost(usize),
    ReadHost,
    /// Reads the device side through a copy on stream `s`.
    ReadDevice(usize),
}

const STREAMS: usize = 2;

fn op_strategy(len: usize) -> impl Strategy<Value = Op> {
    let v = (-64i32..64).prop_map(|v| v as f32);
    prop_oneof![
        (0..len, v.clone()).prop_map(|(i, v)| Op::HostWrite(i, v)),
        (0..STREAMS, v.clone()).prop_map(|(s, v)| Op::DeviceFill(s, v)),
        (0..STREAMS, v).prop_map(|(s, v)| Op::DeviceAdd(s, v)),
        (0..STREAMS).prop_map(Op::SyncToDevice),
        (0..STREAMS).prop_map(Op::SyncToHost),
        Just(Op::ReadHost),
        (0..STREAMS).prop_map(Op::ReadDevice),
    ]
}

fn random_ops(seed: u64, len: usize, n: usize) -> Vec<Op> {
    let mut r = rng(seed);
    (0..n)
        .map(|_| {
            let s = r.random_range(0..STREAMS);
            let v = r.random_range(-64i32..64) as f32;
            match r.random_range(0..7) {
                0 => Op::HostWrite(r.random_range(0..len), v),
                1 => Op::DeviceFill(s, v),
                2 => Op::DeviceAdd(s, v),
                3 => Op::SyncToDevice(s),
                4 => Op::SyncToHost(s),
                5 => Op::ReadHost,
                _ => Op::ReadDevice(s),
            }
        })
        .collect()
}

fn refused<T: std::fmt::Debug>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::InvalidArgument(_)))
}

/// Runs `ops` on a buffer of `initial` and on a model (two vectors and a state); every
/// result, refusal and read must agree with the model.
fn state_machine_body(dev: &Device, initial: &[f32], ops: &[Op]) {
    let streams: Vec<_> = (0..STREAMS).map(|_| dev.new_stream().unwrap()).collect();
    let len = initial.len();
    let ones = Buffer::from_host(&streams[0], &vec![1.0f32; len]).unwrap();
    streams[0].synchronize().unwrap();
    let mut buf = UnifiedBuffer::from_host(&streams[0], initial).unwrap();
    let (mut host, mut device, mut state) =
        (initial.to_vec(), vec![0.0f32; len], Coherence::HostNewer);
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step}: {op:?}");
        match *op {
            Op::HostWrite(i, v) => {
                let r = buf.host_mut();
                if state == Coherence::DeviceNewer {
                    assert!(refused(r), "{ctx}");
                } else {
                    r.unwrap()[i] = v;
                    host[i] = v;
                    state = Coherence::HostNewer;
                }
            }
            Op::DeviceFill(s, v) | Op::DeviceAdd(s, v) => {
                let st = &streams[s];
                let r = buf.device_mut(st);
                if state == Coherence::HostNewer {
                    assert!(refused(r), "{ctx}");
                    continue;
                }
                let d = r.unwrap();
                if matches!(op, Op::DeviceFill(..)) {
                    ops::fill(st, d, v).unwrap();
                    device.iter_mut().for_each(|x| *x = v);
                } else {
                    ops::axpy(st, v, &ones, d).unwrap();
                    device.iter_mut().for_each(|x| *x += v);
                }
                state = Coherence::DeviceNewer;
            }
            Op::SyncToDevice(s) => {
                let copied = buf.sync_to_device(&streams[s]).unwrap();
                assert_eq!(copied, state == Coherence::HostNewer, "{ctx}");
                if copied {
                    device.copy_from_slice(&host);
                    state = Coherence::InSync;
                }
            }
            Op::SyncToHost(s) => {
                let copied = buf.sync_to_host(&streams[s]).unwrap();
                assert_eq!(copied, state == Coherence::DeviceNewer, "{ctx}");
                if copied {
                    host.copy_from_slice(&device);
                    state = Coherence::InSync;
                }
            }
            Op::ReadHost => {
                let r = buf.host();
                if state == Coherence::DeviceNewer {
                    assert!(refused(r), "{ctx}");
                } else {
                    assert_eq!(r.unwrap(), &host[..], "{ctx}");
                }
            }
            Op::ReadDevice(s) => {
                let r = buf.device(&streams[s]);
                if state == Coherence::HostNewer {
                    assert!(refused(r), "{ctx}");
                } else {
                    assert_eq!(r.unwrap().to_host(&streams[s]).unwrap(), device, "{ctx}");
                }
            }
        }
        assert_eq!(buf.state(), state, "{ctx}");
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn unified_buffer_follows_the_model_on_cpu(
        (initial, ops) in (1usize..40).prop_flat_map(|len| (
            proptest::collection::vec((-64i32..64).prop_map(|v| v as f32), len),
            proptest::collection::vec(op_strategy(len), 0..40),
        ))
    ) {
        state_machine_body(&Device::cpu(), &initial, &ops);
    }
}

#[test]
fn empty_unified_buffer_syncs() {
    state_machine_body(
        &Device::cpu(),
        &[],
        &[Op::SyncToDevice(0), Op::ReadDevice(1), Op::ReadHost],
    );
}

fn managed_body(dev: &Device, seed: u64, len: usize) {
    let stream = dev.new_stream().unwrap();
    let data = random_f32(&mut rng(seed), len);
    let mut m = ManagedBuffer::<f32>::new(&stream, len).unwrap();
    m.host_mut().unwrap().copy_from_slice(&data);
    let ordinal = dev.ordinal().unwrap_or(0);
    m.advise(Advice::ReadMostly).unwrap();
    m.advise(Advice::PreferredLocation(Location::Device(ordinal)))
        .unwrap();
    m.advise(Advice::AccessedBy(Location::Device(ordinal)))
        .unwrap();
    m.prefetch(0..len, Location::Device(ordinal), &stream)
        .unwrap();
    // A kernel reads the managed memory: its sum matches the host's in f64.
    let sum = ops::sum_to_host(&stream, m.as_buffer()).unwrap() as f64;
    let want: f64 = data.iter().map(|&x| x as f64).sum();
    let mag: f64 = data.iter().map(|&x| (x as f64).abs()).sum();
    assert!(
        (sum - want).abs() <= 1e-5 * mag.max(1.0),
        "sum {sum} vs {want}"
    );
    // A kernel writes it; the host sees the result after a prefetch back.
    let ones = Buffer::from_host(&stream, &vec![1.0f32; len]).unwrap();
    ops::axpy(&stream, 2.0, &ones, m.as_buffer_mut()).unwrap();
    m.prefetch(0..len, Location::Host, &stream).unwrap();
    let got = m.host().unwrap();
    for (i, (&g, &x)) in got.iter().zip(&data).enumerate() {
        assert_eq!(g, x + 2.0, "element {i}");
    }
    assert!(matches!(
        m.prefetch(0..len + 1, Location::Host, &stream),
        Err(Error::InvalidArgument(_))
    ));
}

/// [`managed_body`] at one, an odd and a large odd length.
fn managed_lengths_body(dev: &Device) {
    let s = seed("managed");
    for len in [1, 1023, (1 << 20) + 3] {
        managed_body(dev, s, len);
    }
}

device_test!(
    managed_round_trip_on_cpu,
    gpu_managed_advised_and_prefetched_gives_the_same_data,
    managed_lengths_body
);

/// More than the device reports free is refused before any allocation.
fn over_allocation_body(dev: &Device) {
    let stream = dev.new_stream().unwrap();
    let (free, _) = dev.mem_info().unwrap();
    let len = free / 4 + (1 << 20);
    match ManagedBuffer::<f32>::new(&stream, len) {
        Err(Error::OutOfMemory { requested, detail }) => {
            assert_eq!(requested, len * 4);
            assert!(detail.contains("over-subscription"), "{detail}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

device_test!(
    managed_over_allocation_is_refused_on_cpu,
    gpu_managed_over_allocation_is_refused,
    over_allocation_body
);

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_unified_mirror_round_trips_with_kernels_writing_the_device() {
    let s = seed("unified_gpu");
    let mut r = rng(s);
    for (i, len) in [1usize, 1023, (1 << 16) + 3].into_iter().enumerate() {
        let initial: Vec<f32> = (0..len)
            .map(|_| r.random_range(-64i32..64) as f32)
            .collect();
        // Sequences with every op; the model checks each read.
        state_machine_body(&cuda(), &initial, &random_ops(s ^ i as u64, len, 150));
    }
}

/// A pinned pool bound to NUMA node 0 (present on every Linux machine) serves buffers that
/// round trip through the device; a node that does not exist is an error, not a crash.
fn numa_pool_body(dev: &Device, seed: u64) {
    use warpdrive::memory::{PinnedBuf, PinnedPool};
    let pool = PinnedPool::on_node(dev, Some(0));
    assert_eq!(pool.numa_node(), Some(0));
    let stream = dev.new_stream().unwrap();
    let data = random_f32(&mut rng(seed), 100_003);
    let mut src = PinnedBuf::<f32>::new_in(&pool, data.len()).unwrap();
    src.wait_slice_mut().unwrap().copy_from_slice(&data);
    let mut d = Buffer::<f32>::uninit(&stream, data.len()).unwrap();
    d.copy_from_pinned(&stream, &mut src).unwrap();
    let mut back = PinnedBuf::<f32>::new_in(&pool, data.len()).unwrap();
    back.wait_slice_mut().unwrap().fill(f32::NAN);
    d.copy_to_pinned(&stream, &mut back).unwrap();
    assert_eq!(back.wait_slice().unwrap(), &data[..]);
    drop((src, back));
    assert_eq!(pool.stats().driver_allocs, 2);
    let class = warpdrive::memory::pinned_class(data.len() * 4) as u64;
    assert_eq!(pool.trim().unwrap(), 2 * class);
    let missing = PinnedPool::on_node(dev, Some(1000));
    assert!(PinnedBuf::<f32>::new_in(&missing, 16).is_err());
}

device_test!(
    numa_bound_pinned_pool_on_cpu,
    gpu_numa_bound_pinned_pool_round_trips,
    |dev| numa_pool_body(dev, seed("numa"))
);

#[test]
fn cpu_backend_reports_numa_placement_as_a_no_op() {
    let info = Device::cpu().info().unwrap();
    assert!(!info.numa.applies());
    assert!(!Device::cpu().numa_placement().pin_current_thread().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_numa_placement_is_consistent_with_sysfs() {
    let dev = cuda();
    let info = dev.info().unwrap();
    eprintln!("numa: {:?} (gpu node {:?})", info.numa, info.numa_node);
    // Placement applies exactly when the machine has several nodes and sysfs names the GPU's.
    assert_eq!(
        info.numa.applies(),
        info.numa.nodes > 1 && info.numa_node.is_some()
    );
    let pool_node = warpdrive::memory::pinned_pool(&dev).unwrap().numa_node();
    assert_eq!(pool_node.map(|n| n as i32), info.numa.node);
}
