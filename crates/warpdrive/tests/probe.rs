//! The benchmarks' safe probes (`device::probe`, `exec::probe`): driver allocation pairs on
//! both backends, CUDA-only probes refused on the CPU, and on a GPU the launch probe's fill,
//! its stream check, CUDA's own pool and the reference launches.

mod common;

use common::cuda;
use warpdrive::device::probe::{self, DriverPool, ReferenceLaunches};
use warpdrive::exec::probe::LaunchProbe;
use warpdrive::exec::{Graph, LaunchConfig};
use warpdrive::{Device, Error};

fn alloc_pairs_body(dev: &Device) {
    for bytes in [0, 1, 4096, 1 << 20] {
        probe::alloc_free_pair(dev, bytes).unwrap();
        probe::pinned_alloc_free_pair(dev, bytes).unwrap();
    }
}

#[test]
fn cpu_alloc_pairs_allocate_and_free() {
    alloc_pairs_body(&Device::cpu());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_alloc_pairs_allocate_and_free() {
    alloc_pairs_body(&cuda());
}

#[test]
fn cuda_only_probes_are_unsupported_on_the_cpu() {
    let dev = Device::cpu();
    let s = dev.new_stream().unwrap();
    assert!(matches!(
        LaunchProbe::new(&s).err(),
        Some(Error::Unsupported(_))
    ));
    assert!(matches!(
        DriverPool::new(&dev).err(),
        Some(Error::Unsupported(_))
    ));
    assert!(matches!(
        ReferenceLaunches::new(&s).err(),
        Some(Error::Unsupported(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_launch_probe_fills_its_element_eagerly_and_in_a_graph() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let probe = LaunchProbe::new(&s).unwrap();
    assert_eq!(probe.value(&s).unwrap(), 0);
    let plain = LaunchConfig::linear(1, 32);
    let chained = LaunchConfig {
        programmatic: true,
        ..plain
    };
    probe.fill(&s, 7, plain).unwrap();
    probe.empty(&s, plain).unwrap();
    assert_eq!(probe.value(&s).unwrap(), 7);
    let mut graph = Graph::capture(&s, |s| {
        probe.empty(s, chained)?;
        probe.fill(s, 9, chained)
    })
    .unwrap();
    graph.launch().unwrap();
    assert_eq!(probe.value(&s).unwrap(), 9);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_probes_refuse_another_stream() {
    let dev = cuda();
    let (s, other) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let probe = LaunchProbe::new(&s).unwrap();
    let plain = LaunchConfig::linear(1, 32);
    assert!(matches!(
        probe.fill(&other, 1, plain),
        Err(Error::InvalidArgument(_))
    ));
    assert!(probe.empty(&other, plain).is_err());
    let pool = DriverPool::new(&dev).unwrap();
    let cpu = Device::cpu().new_stream().unwrap();
    assert!(matches!(
        pool.alloc_free_pair(&cpu, 64),
        Err(Error::DeviceMismatch { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_driver_pool_and_reference_launches_run() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let pool = DriverPool::new(&dev).unwrap();
    for bytes in [0, 512, 1 << 20] {
        pool.alloc_free_pair(&s, bytes).unwrap();
    }
    s.synchronize().unwrap();
    let mut r = ReferenceLaunches::new(&s).unwrap();
    for _ in 0..3 {
        r.builder_launch().unwrap();
    }
    r.builder_synchronize().unwrap();
    r.bind().unwrap();
    for _ in 0..3 {
        r.raw_launch().unwrap();
    }
    s.synchronize().unwrap();
}
