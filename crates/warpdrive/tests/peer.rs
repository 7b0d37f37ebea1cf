//! `transfer::copy_peer`: copies between devices, direct where the destination reaches the
//! source's memory and staged through pinned host memory where it does not. One body on each
//! backend (on one GPU both paths run between two buffers of that GPU, the staged one through
//! pinned blocks reused chunk after chunk); the two-GPU test needs a second GPU.

mod common;

use common::{device_test, poisoned, random_f32, rng, seed};
use warpdrive::transfer::{copy_peer, copy_peer_staged, PeerPath};
use warpdrive::{Buffer, Device, Error};

/// Sizes up to three staging chunks and a part (8 MiB each).
const SIZES: [usize; 4] = [1, 1_001, 2_097_153, 7_340_033];

fn same_device_body(dev: &Device) {
    let mut r = rng(seed("copy_peer_same_device"));
    let s = dev.new_stream().unwrap();
    assert!(dev.can_access_peer(dev).unwrap());
    for n in SIZES {
        let data = random_f32(&mut r, n);
        let src = Buffer::from_host(&s, &data).unwrap();
        let mut direct = poisoned(&s, n, f32::NAN);
        assert_eq!(copy_peer(&s, &src, &mut direct).unwrap(), PeerPath::Direct);
        assert_eq!(direct.to_host(&s).unwrap(), data, "direct n={n}");
        let mut staged = poisoned(&s, n, f32::NAN);
        copy_peer_staged(&s, &src, &mut staged).unwrap();
        assert_eq!(staged.to_host(&s).unwrap(), data, "staged n={n}");
    }
    // Nothing to copy, mismatched lengths, and a stream of another device than the
    // destination's.
    let empty = Buffer::<f32>::from_host(&s, &[]).unwrap();
    let mut also_empty = Buffer::<f32>::from_host(&s, &[]).unwrap();
    copy_peer_staged(&s, &empty, &mut also_empty).unwrap();
    let src = Buffer::from_host(&s, &[1.0f32, 2.0]).unwrap();
    let mut short = poisoned(&s, 1, 0.0f32);
    let e = copy_peer(&s, &src, &mut short);
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    let e = copy_peer_staged(&s, &src, &mut short);
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    if dev.is_cuda() {
        let cpu = Device::cpu().new_stream().unwrap();
        let mut dst = poisoned(&s, 2, 0.0f32);
        let e = copy_peer(&cpu, &src, &mut dst);
        assert!(matches!(e, Err(Error::DeviceMismatch { .. })), "{e:?}");
    }
}

device_test!(
    copy_peer_copies_within_a_device_both_ways,
    gpu_copy_peer_copies_within_a_device_both_ways,
    same_device_body
);

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_copy_peer_between_the_cpu_backend_and_a_gpu() {
    let gpu = common::cuda();
    let (g, c) = (
        gpu.new_stream().unwrap(),
        Device::cpu().new_stream().unwrap(),
    );
    assert!(!gpu.can_access_peer(&Device::cpu()).unwrap());
    let mut r = rng(seed("copy_peer_host"));
    for n in SIZES {
        let data = random_f32(&mut r, n);
        let on_cpu = Buffer::from_host(&c, &data).unwrap();
        let mut on_gpu = poisoned(&g, n, f32::NAN);
        assert_eq!(copy_peer(&g, &on_cpu, &mut on_gpu).unwrap(), PeerPath::Host);
        assert_eq!(on_gpu.to_host(&g).unwrap(), data, "up n={n}");
        let mut back = poisoned(&c, n, f32::NAN);
        assert_eq!(copy_peer(&c, &on_gpu, &mut back).unwrap(), PeerPath::Host);
        assert_eq!(back.to_host(&c).unwrap(), data, "down n={n}");
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn gpu_copy_peer_between_two_gpus_direct_and_staged() {
    if Device::cuda_count() < 2 {
        eprintln!(
            "SKIPPED: needs two CUDA GPUs, this host has {}",
            Device::cuda_count()
        );
        return;
    }
    let (a, b) = (Device::cuda(0).unwrap(), Device::cuda(1).unwrap());
    let (sa, sb) = (a.new_stream().unwrap(), b.new_stream().unwrap());
    let peer = b.can_access_peer(&a).unwrap();
    eprintln!("cuda:1 reaches cuda:0's memory: {peer}");
    let mut r = rng(seed("copy_peer_two_gpus"));
    for n in SIZES {
        let data = random_f32(&mut r, n);
        let src = Buffer::from_host(&sa, &data).unwrap();
        // The source's upload is ordered before the copy on the other device's stream.
        let ready = a.new_event().unwrap();
        sa.record(&ready).unwrap();
        sb.wait(&ready).unwrap();
        let mut dst = poisoned(&sb, n, f32::NAN);
        let want = if peer {
            PeerPath::Direct
        } else {
            PeerPath::Staged
        };
        assert_eq!(copy_peer(&sb, &src, &mut dst).unwrap(), want);
        assert_eq!(dst.to_host(&sb).unwrap(), data, "copy_peer n={n}");
        let mut staged = poisoned(&sb, n, f32::NAN);
        copy_peer_staged(&sb, &src, &mut staged).unwrap();
        assert_eq!(staged.to_host(&sb).unwrap(), data, "staged n={n}");
        // And back, on the first device's stream.
        let mut back = poisoned(&sa, n, f32::NAN);
        let done = b.new_event().unwrap();
        sb.record(&done).unwrap();
        sa.wait(&done).unwrap();
        copy_peer(&sa, &dst, &mut back).unwrap();
        assert_eq!(back.to_host(&sa).unwrap(), data, "back n={n}");
    }
}
