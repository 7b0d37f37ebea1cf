//! Persistent actors (issue 32): the API's checks (shapes, spawning after start, handlers
//! that do not compile), async replies and telemetry (Prometheus counters, trace slices).

mod common;

use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use common::actor::{msg, settled, spec, stateless, Out, State, WAIT};
use common::device_test;
use warpdrive::actor::{ActorSpec, ActorSystem, SystemConfig};
use warpdrive::{Device, Error};

#[test]
fn bad_shapes_are_refused() {
    let system = ActorSystem::new(&Device::cpu()).unwrap();
    #[repr(C)]
    #[derive(Clone, Copy, Pod, Zeroable)]
    struct Big([u32; 64], u32);
    let e = system
        .spawn(ActorSpec::<Big, Out, ()>::new("big", ()))
        .unwrap_err();
    assert!(e.to_string().contains("260 bytes"), "{e}");
    for bad in [
        spec("c").capacity(100),
        spec("c").capacity(8),
        spec("l").lanes(5),
        spec("b").batch(0),
    ] {
        assert!(matches!(system.spawn(bad), Err(Error::InvalidArgument(_))));
    }
    let mut empty = ActorSystem::new(&Device::cpu()).unwrap();
    assert!(empty.start().is_err());
}

#[test]
fn spawning_after_start_is_refused() {
    let mut system = ActorSystem::new(&Device::cpu()).unwrap();
    let _a = system.spawn(spec("a")).unwrap();
    system.start().unwrap();
    assert!(matches!(system.spawn(spec("b")), Err(Error::Actor { .. })));
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn handlers_compile_and_a_broken_one_returns_the_log() {
    use warpdrive::kernels::Arch;
    let system = ActorSystem::new(&Device::cpu()).unwrap();
    let second = system
        .spawn(ActorSpec::<Out, Out, State>::new("second", State::default()).cuda(
            "struct In { u32 id; u32 value; u64 seen; u32 lane; u32 pad[11]; };\ntypedef In Out;\n\
             struct State { u64 count; u64 sum; };\n\
             __device__ void handle(const In* in, Out* out, State* s, ActorCtx*) { *out = *in; }",
        ))
        .unwrap();
    let _first = system
        .spawn(spec("first").lanes(3).forward_to(&second))
        .unwrap();
    for arch in ["sm_80", "sm_90a"] {
        system.check_compiles(Arch::parse(arch).unwrap()).unwrap();
    }
    // Without the stream options (`quick_stream`, `wide_window`, `reply_gap`, `tail_hint`,
    // on by default), the loop compiles without their paths too.
    let config = SystemConfig {
        reply_gap: false,
        ..SystemConfig::default()
    };
    let narrow = ActorSystem::with_config(&Device::cpu(), config).unwrap();
    for name in ["narrow", "plain"] {
        let s = stateless(name)
            .quick_stream(false)
            .wide_window(false)
            .tail_hint(false);
        narrow.spawn(s).unwrap();
    }
    for arch in ["sm_80", "sm_90a"] {
        narrow.check_compiles(Arch::parse(arch).unwrap()).unwrap();
    }
    // And with `quick_stream` and `tail_hint` asked by one actor of two.
    let mixed = ActorSystem::new(&Device::cpu()).unwrap();
    mixed.spawn(stateless("quick")).unwrap();
    mixed
        .spawn(spec("plain").quick_stream(false).tail_hint(false))
        .unwrap();
    for arch in ["sm_80", "sm_90a"] {
        mixed.check_compiles(Arch::parse(arch).unwrap()).unwrap();
    }
    let broken = ActorSystem::new(&Device::cpu()).unwrap();
    broken
        .spawn(spec("broken").cuda(
            "struct In { u32 x[16]; }; struct Out { u32 y[16]; }; struct State { u64 a, b; };\n\
             __device__ void handle(const In* in, Out* out, State*, ActorCtx*) { out->y[0] = no_such_name; }",
        ))
        .unwrap();
    let e = broken.check_compiles(Arch::SM_90A).unwrap_err();
    assert!(matches!(e, Error::Compile { .. }), "{e}");
    assert!(e.to_string().contains("no_such_name"), "{e}");
    let sizes = ActorSystem::new(&Device::cpu()).unwrap();
    sizes
        .spawn(spec("sizes").cuda(
            "struct In { u32 x; }; struct Out { u32 y[16]; }; struct State { u64 a, b; };\n\
             __device__ void handle(const In*, Out*, State*, ActorCtx*) {}",
        ))
        .unwrap();
    let e = sizes.check_compiles(Arch::SM_90A).unwrap_err();
    assert!(e.to_string().contains("In is 64 bytes in Rust"), "{e}");
}

/// Polls every future on this thread until all are done (no async runtime: the actor
/// system's watcher does the waking).
fn block_on_all<F: std::future::Future + Unpin>(mut futs: Vec<F>) -> Vec<F::Output> {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    while out.iter().any(Option::is_none) {
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                if let Poll::Ready(v) = std::pin::Pin::new(f).poll(&mut cx) {
                    *o = Some(v);
                }
            }
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
    out.into_iter().flatten().collect()
}

device_test!(
    async_requests_are_woken_without_a_runtime,
    gpu_async_requests,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(spec("async")).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        let futs: Vec<_> = (0..50u32)
            .map(|k| a.request_async(&msg(k, k), 0, WAIT))
            .collect();
        for (k, r) in block_on_all(futs).into_iter().enumerate() {
            let out = r.unwrap();
            assert_eq!((out.id, out.value), (k as u32, 3 * k as u32 + 1));
        }
        a.deactivate().unwrap();
        let late = a.request_async(&msg(7, 7), 0, Duration::from_millis(30));
        let e = block_on_all(vec![late]).pop().unwrap().unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        a.activate().unwrap();
        // The timed-out request's reply arrives and is discarded; nothing is left for recv.
        settled(&a, 51, 0);
        std::thread::sleep(Duration::from_millis(5));
        assert!(a.try_recv().unwrap().is_none());
    }
);

#[test]
fn counters_reach_the_prometheus_endpoint() {
    use std::io::{Read, Write};
    let server =
        warpdrive::telemetry::serve_prometheus(Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let mut system = ActorSystem::new(&Device::cpu()).unwrap();
    let a = system.spawn(spec("metered")).unwrap();
    system.start().unwrap();
    a.activate().unwrap();
    for k in 0..10 {
        a.request(&msg(k, k), 0, WAIT).unwrap();
    }
    let t0 = Instant::now();
    loop {
        let mut c = std::net::TcpStream::connect(server.addr).unwrap();
        c.set_read_timeout(Some(WAIT)).unwrap();
        write!(c, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        if text.contains("warpdrive_actor_processed_total{actor=\"metered\"} 10") {
            assert!(
                text.contains("warpdrive_actor_busy_ratio{actor=\"metered\"}"),
                "{text}"
            );
            break;
        }
        assert!(t0.elapsed() < WAIT, "no actor counters in:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sampled_messages_show_on_the_actors_trace_track() {
    let config = SystemConfig {
        trace_every: 2,
        ..SystemConfig::default()
    };
    let mut system = ActorSystem::with_config(&Device::cpu(), config).unwrap();
    let a = system.spawn(spec("traced")).unwrap();
    system.start().unwrap();
    a.activate().unwrap();
    warpdrive::telemetry::start_trace();
    let t0 = Instant::now();
    for k in 0..40 {
        a.request(&msg(k, k), 0, WAIT).unwrap();
    }
    // The watcher's last pass, which `terminate` waits for, drains every record left.
    system.terminate().unwrap();
    let trace = warpdrive::telemetry::finish_trace().to_json();
    let events = trace["traceEvents"].as_array().unwrap();
    let track = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "traced")
        .expect("a track named after the actor");
    let slices: Vec<_> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == track["pid"] && e["tid"] == track["tid"])
        .collect();
    assert!(slices.len() >= 10, "{} slices", slices.len());
    for s in &slices {
        assert_eq!(s["name"], "handle");
        assert!(s["dur"].as_f64().unwrap() >= 0.0);
        assert!(
            s["args"]["correlation"].as_u64().unwrap() % 2 == 1,
            "every second message"
        );
    }
    // On the trace's clock: within this test's span, to a millisecond.
    let span_us = t0.elapsed().as_secs_f64() * 1e6;
    let ts: Vec<f64> = slices.iter().map(|s| s["ts"].as_f64().unwrap()).collect();
    let (lo, hi) = ts
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &t| (l.min(t), h.max(t)));
    assert!(hi - lo <= span_us + 1000.0, "{lo}..{hi} over {span_us} µs");
}
