//! Devices, streams, events, buffers and device information.

mod common;

use common::{cuda, device_test};
use warpdrive::{Buffer, Device, Error};

#[test]
fn bad_device_specs_are_clear_errors() {
    for spec in ["garbage", "cuda:x", "cuda:-1", "tpu:0", "cuda:"] {
        let err = Device::best_with(Some(spec)).unwrap_err();
        assert!(matches!(err, Error::BadDeviceSpec { .. }), "{spec}: {err}");
        assert!(err.to_string().contains("WARPDRIVE_DEVICE"), "{err}");
    }
    assert_eq!(Device::best_with(Some("cpu")).unwrap(), Device::Cpu);
    assert_eq!(Device::best_with(Some(" CPU ")).unwrap(), Device::Cpu);
}

#[test]
fn an_out_of_range_ordinal_is_an_error() {
    let err = Device::cuda(4096).unwrap_err();
    // Without a driver the answer is NoDriver; with one, BadOrdinal naming the count.
    match &err {
        Error::BadOrdinal { ordinal, .. } => assert_eq!(*ordinal, 4096),
        Error::NoDriver(_) => {}
        other => panic!("unexpected error: {other}"),
    }
    assert!(matches!(
        Device::from_spec("cuda:4096"),
        Err(Error::BadOrdinal { .. } | Error::NoDriver(_))
    ));
}

#[test]
fn best_always_gives_a_device() {
    let d = Device::best_with(None).unwrap();
    assert_eq!(d.is_cuda(), Device::cuda_count() > 0);
}

device_test!(
    buffers_round_trip_every_dtype_on_cpu,
    gpu_buffers_round_trip_every_dtype,
    round_trip
);

fn round_trip(dev: &Device) {
    use half::{bf16, f16};
    let s = dev.new_stream().unwrap();
    macro_rules! check {
        ($t:ty, $v:expr) => {{
            let data: Vec<$t> = (0..1031usize).map($v).collect();
            let b = Buffer::from_host(&s, &data).unwrap();
            assert_eq!(b.len(), data.len());
            assert_eq!(b.size_bytes(), data.len() * std::mem::size_of::<$t>());
            assert_eq!(b.to_host(&s).unwrap(), data, stringify!($t));
        }};
    }
    check!(f32, |i| i as f32 * 0.5 - 3.0);
    check!(f64, |i| i as f64 * -0.25);
    check!(f16, |i| f16::from_f32(i as f32 / 7.0));
    check!(bf16, |i| bf16::from_f32(i as f32 / 3.0));
    check!(i32, |i| i as i32 - 500);
    check!(u32, |i| i as u32 * 7);
    check!(i64, |i| -(i as i64) << 33);
    check!(u64, |i| (i as u64) << 40);
    check!(u8, |i| i as u8);
}

#[test]
fn cpu_events_time_host_work() {
    let d = Device::cpu();
    let s = d.new_stream().unwrap();
    let (a, b) = (d.new_event().unwrap(), d.new_event().unwrap());
    assert!(
        a.elapsed_ms(&b).is_err(),
        "unrecorded events have no elapsed time"
    );
    s.record(&a).unwrap();
    s.record(&b).unwrap();
    assert!(a.elapsed_ms(&b).unwrap() >= 0.0);
    s.wait(&b).unwrap();
    s.synchronize().unwrap();
}

#[test]
fn cpu_info_is_plausible() {
    let info = Device::cpu().info().unwrap();
    assert_eq!(info.backend, "cpu");
    assert!(info.cpu_threads >= 1);
    assert!(!info.name.is_empty());
    assert!(info.libraries.iter().any(|l| l.name == "nvrtc"));
    assert!(info.sms.is_none());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_info_is_plausible() {
    let info = cuda().info().unwrap();
    eprintln!("{info:#?}");
    assert_eq!(info.backend, "cuda");
    assert!(info.sms.unwrap() > 0);
    assert!(info.memory_total > 0);
    assert!(info.memory_free > 0 && info.memory_free <= info.memory_total);
    assert!(info.l2_bytes.unwrap() > 0);
    assert!(!info.name.is_empty());
    assert!(info.compute_capability.is_some());
    let lib = |n: &str| info.libraries.iter().find(|l| l.name == n).unwrap();
    assert!(lib("driver").loaded && lib("driver").version.is_some());
    assert!(lib("nvrtc").loaded, "NVRTC must load on the GPU host");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_events_and_streams() {
    let d = cuda();
    let (s1, s2) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    let (a, b) = (d.new_event().unwrap(), d.new_event().unwrap());
    let mut x = Buffer::<f32>::zeros(&s1, 1 << 22).unwrap();
    s1.record(&a).unwrap();
    warpdrive::ops::fill(&s1, &mut x, 2.0).unwrap();
    s1.record(&b).unwrap();
    // s2 waits for s1's fill, then reads the result.
    s2.wait(&b).unwrap();
    assert!(a.elapsed_ms(&b).unwrap() > 0.0);
    assert_eq!(
        warpdrive::ops::sum_to_host(&s2, &x).unwrap(),
        2.0 * (1 << 22) as f32
    );
    // Mixing backends is an error, not a crash.
    let cpu_event = Device::cpu().new_event().unwrap();
    assert!(matches!(
        s1.record(&cpu_event),
        Err(Error::DeviceMismatch { .. })
    ));
}
