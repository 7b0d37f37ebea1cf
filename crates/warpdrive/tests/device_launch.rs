//! Work launched from the device (issue 33): the dispatcher routes queues of requests to
//! graphs on both backends with the same decisions; the latency probe on a GPU; graphs that
//! cannot be launched from the device are refused with the reason.

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use rand::Rng;
use warpdrive::exec::{DeviceLaunchProbe, Dispatcher, Graph, LaunchPath};
use warpdrive::memory::Buffer;
use warpdrive::{ops, Device, Error, Stream};

use common::{cuda, device_test, is_invalid, rng};

/// A dispatcher over `bounds` whose target `b` adds 1 to every element of its own counter
/// (odd length), so the counters say how many requests each target ran.
fn counting_dispatcher<'a>(
    stream: &Stream,
    bounds: &[u32],
    capacity: usize,
    per_round: usize,
    counters: &[Rc<RefCell<Buffer<f32>>>],
    ones: &Rc<Buffer<f32>>,
) -> Dispatcher<'a> {
    let mut d = Dispatcher::new(stream, capacity, per_round).expect("a dispatcher");
    for (&b, c) in bounds.iter().zip(counters) {
        let (c, ones) = (c.clone(), ones.clone());
        d.add_target(b, move |s| ops::axpy(s, 1.0f32, &ones, &mut c.borrow_mut()))
            .expect("a target");
    }
    d
}

fn dispatcher_routes_requests_as_the_reference(dev: &Device) {
    let mut rng = rng(0xd15);
    let stream = dev.new_stream().expect("a stream");
    let len = 37;
    let bounds = [1u32, 4, 16, 64, 200];
    let ones = Rc::new(Buffer::from_host(&stream, &vec![1.0f32; len]).expect("ones"));
    // Poisoned (non-zero, random) starting counts: the targets add to them.
    let starts: Vec<f32> = (0..bounds.len())
        .map(|_| rng.random_range(1..100) as f32)
        .collect();
    let counters: Vec<_> = starts
        .iter()
        .map(|&v| {
            Rc::new(RefCell::new(
                Buffer::from_host(&stream, &vec![v; len]).expect("c"),
            ))
        })
        .collect();
    stream.synchronize().expect("sync");
    for per_round in [1usize, 3, 64] {
        let n = rng.random_range(20..90);
        let requests: Vec<u32> = (0..n).map(|_| rng.random_range(0..=200)).collect();
        let mut d = counting_dispatcher(&stream, &bounds, 128, per_round, &counters, &ones);
        let before: Vec<Vec<f32>> = counters
            .iter()
            .map(|c| c.borrow().to_host(&stream).expect("read"))
            .collect();
        let report = d.run(&requests).expect("a run");
        let reference = d.decide(&requests).expect("the reference");
        assert_eq!(report.decisions, reference, "per_round {per_round}");
        assert_eq!(
            report.rounds,
            reference.last().map_or(0, |x| x.round + 1),
            "rounds, per_round {per_round}"
        );
        for (i, r) in requests.iter().enumerate() {
            let t = reference[i].target;
            assert!(
                *r <= bounds[t] && (t == 0 || *r > bounds[t - 1]),
                "request {i}: {r} → {t}"
            );
        }
        for (b, c) in counters.iter().enumerate() {
            let ran = reference.iter().filter(|x| x.target == b).count() as f32;
            let after = c.borrow().to_host(&stream).expect("read");
            for (x, y) in before[b].iter().zip(&after) {
                assert_eq!(*y, x + ran, "target {b}, per_round {per_round}");
            }
        }
        if dev.is_cuda() {
            assert_eq!(report.latency_ns.len(), requests.len());
            assert!(
                report.latency_ns.iter().all(|&ns| ns > 0),
                "every target started after its decision"
            );
        } else {
            assert!(report.latency_ns.is_empty());
        }
        // A second run over the same dispatcher decides the same.
        let again = d.run(&requests).expect("a second run");
        assert_eq!(again.decisions, reference);
    }
}

device_test!(
    dispatcher_routes_requests_as_the_reference_cpu,
    gpu_dispatcher_routes_requests_as_the_reference,
    dispatcher_routes_requests_as_the_reference
);

fn dispatcher_refuses_bad_input(dev: &Device) {
    let stream = dev.new_stream().expect("a stream");
    assert!(is_invalid(Dispatcher::new(&stream, 0, 1).map(drop), "1 to"));
    assert!(is_invalid(
        Dispatcher::new(&stream, 8, 0).map(drop),
        "1 to 64"
    ));
    assert!(is_invalid(
        Dispatcher::new(&stream, 8, 65).map(drop),
        "1 to 64"
    ));
    let mut d = Dispatcher::new(&stream, 8, 2).expect("a dispatcher");
    assert!(is_invalid(d.run(&[1]).map(drop), "no targets"));
    d.add_target(4, |_| Ok(())).expect("a target");
    assert!(is_invalid(
        d.add_target(4, |_| Ok(())).map(drop),
        "must increase"
    ));
    d.add_target(9, |_| Ok(())).expect("a target");
    assert!(is_invalid(
        d.run(&[3, 10]).map(drop),
        "above the largest target's bound 9"
    ));
    assert!(is_invalid(
        d.run(&[1; 9]).map(drop),
        "9 requests for a dispatcher of 8"
    ));
    assert_eq!(d.run(&[]).expect("an empty run").decisions, vec![]);
    assert_eq!(d.bounds(), &[4, 9]);
    let mut many = Dispatcher::new(&stream, 8, 1).expect("a dispatcher");
    for b in 0..64 {
        many.add_target(b, |_| Ok(())).expect("a target");
    }
    assert!(is_invalid(
        many.add_target(64, |_| Ok(())).map(drop),
        "at most 64"
    ));
}

device_test!(
    dispatcher_refuses_bad_input_cpu,
    gpu_dispatcher_refuses_bad_input,
    dispatcher_refuses_bad_input
);

#[test]
fn graphs_on_the_cpu_backend_are_not_launched_from_the_device() {
    let stream = Device::cpu().new_stream().expect("a stream");
    let mut g = Graph::capture(&stream, |_| Ok(())).expect("a graph");
    assert!(matches!(
        g.prepare_device_launch(),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        DeviceLaunchProbe::new(&stream, 8),
        Err(Error::Unsupported(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_an_empty_graph_is_refused_for_device_launch() {
    let stream = cuda().new_stream().expect("a stream");
    let mut g = Graph::capture(&stream, |_| Ok(())).expect("a graph");
    let e = g.prepare_device_launch().expect_err("nothing to launch");
    assert!(e.to_string().contains("captured no work"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_the_latency_probe_measures_every_path() {
    let stream = cuda().new_stream().expect("a stream");
    let mut probe = DeviceLaunchProbe::new(&stream, 33).expect("a probe");
    for path in [
        LaunchPath::Device,
        LaunchPath::DeviceTail,
        LaunchPath::DeviceKernel,
        LaunchPath::HostGraph,
        LaunchPath::HostRoundTrip,
    ] {
        let t = probe.measure(path, 32).expect("a measurement");
        let ns = &t.to_start;
        assert_eq!(ns.len(), 32);
        assert!(
            ns.iter().all(|&v| v > 0),
            "{path:?}: every start after its decision: {ns:?}"
        );
        let from_graph = matches!(path, LaunchPath::Device | LaunchPath::DeviceTail);
        assert_eq!(t.in_call.len(), if from_graph { 32 } else { 0 }, "{path:?}");
    }
    assert!(probe.measure(LaunchPath::Device, 33).is_err());
}

/// The MoE layer dispatched from the device: one target per token count (the layer's kernels
/// for that size captured, its own graphs off), a queue of batches in random order, each
/// target's output equal to the host-launched layer's on the same input (the layer's output
/// is deterministic), on both backends.
fn moe_dispatched_from_the_device_matches_the_layer(dev: &Device) {
    use warpdrive::bf16;
    use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights};
    let mut rng = rng(0x30e);
    let stream = dev.new_stream().expect("a stream");
    let config = MoeConfig::tiny();
    let hidden = config.hidden;
    let layer = Rc::new(RefCell::new(
        MoeLayer::<bf16>::new(&stream, config, MoeWeights::Random { seed: 5 }).expect("a layer"),
    ));
    let sizes = [1usize, 3, 17];
    let mut expected = Vec::new();
    let mut pairs = Vec::new();
    for &t in &sizes {
        let x: Vec<bf16> = (0..t * hidden)
            .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
            .collect();
        let x = Rc::new(Buffer::from_host(&stream, &x).expect("x"));
        let reference = layer.borrow_mut().forward(&x).expect("the layer");
        expected.push(reference.to_host(&stream).expect("read"));
        // Poisoned output: the dispatched pass must overwrite all of it.
        let poison = vec![bf16::from_f32(f32::NAN); t * hidden];
        let y = Rc::new(RefCell::new(
            Buffer::from_host(&stream, &poison).expect("y"),
        ));
        pairs.push((t, x, y));
    }
    layer.borrow_mut().set_graphs(false);
    let mut d = Dispatcher::new(&stream, 16, 1).expect("a dispatcher");
    for (t, x, y) in &pairs {
        let (l, x, y) = (layer.clone(), x.clone(), y.clone());
        // A pass first: the capture takes its workspace from blocks the pool already holds.
        l.borrow_mut()
            .forward_into(&x, &mut y.borrow_mut())
            .expect("a pass");
        y.borrow_mut()
            .copy_from_host(&stream, &vec![bf16::from_f32(f32::NAN); x.len()])
            .expect("poison again");
        d.add_target(*t as u32, move |_| {
            l.borrow_mut().forward_into(&x, &mut y.borrow_mut())
        })
        .expect("the layer's kernels launch from the device");
    }
    let requests: Vec<u32> = (0..9)
        .map(|_| sizes[rng.random_range(0..3)] as u32)
        .collect();
    let report = d.run(&requests).expect("a run");
    assert_eq!(
        report.decisions,
        d.decide(&requests).expect("the reference")
    );
    for (i, (t, _, y)) in pairs.iter().enumerate() {
        if !requests.contains(&(*t as u32)) {
            continue;
        }
        let got = y.borrow().to_host(&stream).expect("read");
        let same = got
            .iter()
            .zip(&expected[i])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{t} tokens: the dispatched pass differs from the layer's"
        );
    }
}

device_test!(
    moe_dispatched_from_the_device_matches_the_layer_cpu,
    gpu_moe_dispatched_from_the_device_matches_the_layer,
    moe_dispatched_from_the_device_matches_the_layer
);
