//! `dist::PeerMapped` buffers and device-initiated puts and signals: data put by a kernel
//! into another device's mapped memory is what a waiter sees once the signal arrives; a
//! signal that never comes is a timeout, not a hang; bad spans, devices and slots are errors.
//! One body on each backend (on one GPU the "peer" is the same GPU, reached through the same
//! mapping, from a second stream); the two-GPU test needs a second GPU with peer access.

mod common;

use std::time::Duration;

use common::{device_test, random_f32, rng, seed};
use warpdrive::dist::{put_signal, wait_signal, PeerMapped, SignalPingPong};
use warpdrive::{Buffer, Device, Error};

/// Lengths that miss the 16-byte vectors both ways, and one of several blocks.
const SIZES: [usize; 4] = [1, 3, 1_001, 300_007];

fn put_and_wait_body(dev: &Device) {
    let mut r = rng(seed("peer_put_signal"));
    let (writer, reader) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    for (round, n) in SIZES.into_iter().enumerate() {
        let offset = round * 7 % 5;
        let inbox = PeerMapped::<f32>::new(dev, n + offset + 2, &[]).unwrap();
        let poison = vec![f32::NAN; inbox.len()];
        inbox.write(&reader, 0, &poison).unwrap();
        let ready = PeerMapped::<u64>::new(dev, 4, &[]).unwrap();
        let data = random_f32(&mut r, n);
        let src = Buffer::from_host(&writer, &data).unwrap();
        let value = 10 + round as u64;
        put_signal(&writer, &src, &inbox, offset, &ready, 3, value).unwrap();
        wait_signal(&reader, &ready, 3, value, Duration::from_secs(10))
            .unwrap()
            .finish(&reader)
            .unwrap();
        let got = inbox.read(&reader, 0, inbox.len()).unwrap();
        assert_eq!(&got[offset..offset + n], &data[..], "n={n} offset={offset}");
        assert!(
            got[..offset].iter().all(|v| v.is_nan()),
            "bytes before the put"
        );
        assert!(
            got[offset + n..].iter().all(|v| v.is_nan()),
            "bytes after the put"
        );
        assert_eq!(ready.read(&reader, 0, 4).unwrap(), [0, 0, 0, value]);
    }
}

device_test!(
    put_signal_lands_the_data_before_the_signal,
    gpu_smem_put_signal_lands_the_data_before_the_signal,
    put_and_wait_body
);

fn errors_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let ready = PeerMapped::<u64>::new(dev, 2, &[]).unwrap();
    // A signal that never comes: a timeout, reported by finish.
    let w = wait_signal(&s, &ready, 1, 1, Duration::from_millis(20)).unwrap();
    assert!(matches!(w.finish(&s), Err(Error::Timeout { .. })));
    // The stream is still usable after a timed-out wait.
    ready.write(&s, 1, &[5]).unwrap();
    wait_signal(&s, &ready, 1, 5, Duration::from_secs(5))
        .unwrap()
        .finish(&s)
        .unwrap();
    let inbox = PeerMapped::<f32>::new(dev, 4, &[]).unwrap();
    let src = Buffer::from_host(&s, &[1.0f32, 2.0, 3.0]).unwrap();
    let bad =
        |e: warpdrive::Result<()>| assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    bad(put_signal(&s, &src, &inbox, 2, &ready, 0, 1));
    bad(put_signal(&s, &src, &inbox, usize::MAX, &ready, 0, 1));
    bad(put_signal(&s, &src, &inbox, 0, &ready, 2, 1));
    bad(wait_signal(&s, &ready, 2, 1, Duration::from_millis(1)).map(|_| ()));
    bad(inbox.write(&s, 3, &[1.0, 2.0]));
    bad(inbox.read(&s, 5, 0).map(|_| ()));
    assert!(PeerMapped::<f32>::new(dev, 0, &[]).is_err());
    assert!(PeerMapped::<f32>::new(dev, usize::MAX, &[]).is_err());
    if dev.is_cuda() {
        // Memory of a GPU is not reached from the CPU backend, nor the other way round.
        let cpu = Device::cpu();
        let e = PeerMapped::<f32>::new(dev, 4, std::slice::from_ref(&cpu));
        assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
        let e = PeerMapped::<f32>::new(&cpu, 4, std::slice::from_ref(dev));
        assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
        let c = cpu.new_stream().unwrap();
        bad(inbox.write(&c, 0, &[1.0]));
    }
}

device_test!(
    signal_waits_time_out_and_bad_arguments_are_errors,
    gpu_signal_waits_time_out_and_bad_arguments_are_errors,
    errors_body
);

fn pingpong_body(dev: &Device) {
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mut pp = SignalPingPong::new(dev, dev).unwrap();
    for rounds in [1, 100] {
        let one_way = pp.run(&a, &b, rounds, Duration::from_secs(10)).unwrap();
        assert!(
            one_way > Duration::ZERO && one_way < Duration::from_secs(1),
            "{one_way:?}"
        );
    }
    assert!(pp.run(&a, &a, 1, Duration::from_secs(1)).is_err());
    assert!(pp.run(&a, &b, 0, Duration::from_secs(1)).is_err());
}

device_test!(
    signal_pingpong_between_two_streams,
    gpu_signal_pingpong_between_two_streams,
    pingpong_body
);

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_put_signal_between_two_gpus() {
    if Device::cuda_count() < 2 {
        eprintln!(
            "SKIPPED: needs two CUDA GPUs, this host has {}",
            Device::cuda_count()
        );
        return;
    }
    let (g0, g1) = (Device::cuda(0).unwrap(), Device::cuda(1).unwrap());
    if !g1.can_access_peer(&g0).unwrap() {
        // Without peer access the mapping is refused with the reason, never made half-way.
        let e = PeerMapped::<f32>::new(&g0, 4, std::slice::from_ref(&g1));
        assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
        return;
    }
    let (s0, s1) = (g0.new_stream().unwrap(), g1.new_stream().unwrap());
    let mut r = rng(seed("peer_put_signal_two_gpus"));
    // cuda:1 puts into cuda:0's memory; cuda:0 waits on its own signal word.
    let inbox = PeerMapped::<f32>::new(&g0, 300_007, std::slice::from_ref(&g1)).unwrap();
    let ready = PeerMapped::<u64>::new(&g0, 1, std::slice::from_ref(&g1)).unwrap();
    let data = random_f32(&mut r, inbox.len());
    let src = Buffer::from_host(&s1, &data).unwrap();
    let wait = wait_signal(&s0, &ready, 0, 1, Duration::from_secs(10)).unwrap();
    put_signal(&s1, &src, &inbox, 0, &ready, 0, 1).unwrap();
    wait.finish(&s0).unwrap();
    assert_eq!(inbox.read(&s0, 0, inbox.len()).unwrap(), data);
    // Memory of cuda:0 not mapped for cuda:1 is refused on cuda:1's streams.
    let private = PeerMapped::<f32>::new(&g0, 4, &[]).unwrap();
    let e = put_signal(&s1, &src, &private, 0, &ready, 0, 2);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let mut pp = SignalPingPong::new(&g0, &g1).unwrap();
    let one_way = pp.run(&s0, &s1, 1000, Duration::from_secs(10)).unwrap();
    eprintln!("one-way device signal cuda:0 <-> cuda:1: {one_way:?}");
}
