//! `ops::segments`: many buffers packed into one and unpacked back, one body on each backend:
//! parts of odd and zero lengths, every element width, the device table reused while the
//! parts are the same buffers (their contents changed) and uploaded again for new ones.

mod common;

use common::{device_test, poisoned, rng, seed};
use rand::Rng;
use warpdrive::ops::segments::{pack_segments, unpack_segments, SegmentTable};
use warpdrive::{bf16, Buffer, DType, Device, Error};

const LENS: [usize; 7] = [1, 0, 257, 4099, 3, 100_003, 31];

fn round_trips<T: DType + PartialEq + std::fmt::Debug>(
    dev: &Device,
    poison: T,
    mut value: impl FnMut() -> T,
) {
    let s = dev.new_stream().unwrap();
    let total: usize = LENS.iter().sum();
    let (mut pack_table, mut unpack_table) = (SegmentTable::new(), SegmentTable::new());
    let mut parts: Vec<Buffer<T>> = LENS.iter().map(|&n| poisoned(&s, n, poison)).collect();
    for round in 0..3 {
        // Rounds 0 and 1: the same buffers, new contents; round 2: new buffers.
        if round == 2 {
            parts = LENS.iter().map(|&n| poisoned(&s, n, poison)).collect();
        }
        let host: Vec<Vec<T>> = LENS
            .iter()
            .map(|&n| (0..n).map(|_| value()).collect())
            .collect();
        for (p, h) in parts.iter_mut().zip(&host) {
            p.driver_copy_from_host(&s, h).unwrap();
        }
        let mut packed = poisoned(&s, total, poison);
        let refs: Vec<&Buffer<T>> = parts.iter().collect();
        pack_segments(&s, &refs, &mut packed, &mut pack_table).unwrap();
        assert_eq!(
            packed.to_host(&s).unwrap(),
            host.concat(),
            "pack, round {round}"
        );
        // Back: a new packed buffer into poisoned parts.
        let back: Vec<T> = (0..total).map(|_| value()).collect();
        let packed = Buffer::from_host(&s, &back).unwrap();
        for p in parts.iter_mut() {
            let n = p.len();
            p.driver_copy_from_host(&s, &vec![poison; n]).unwrap();
        }
        let mut refs: Vec<&mut Buffer<T>> = parts.iter_mut().collect();
        unpack_segments(&s, &packed, &mut refs, &mut unpack_table).unwrap();
        let mut at = 0;
        for (k, p) in parts.iter().enumerate() {
            let n = p.len();
            assert_eq!(
                p.to_host(&s).unwrap(),
                back[at..at + n],
                "unpack part {k}, round {round}"
            );
            at += n;
        }
    }
}

fn body(dev: &Device) {
    let mut r = rng(seed("segments"));
    round_trips(dev, f32::NAN.to_bits(), || r.random::<u32>());
    round_trips(dev, u8::MAX, || r.random::<u8>());
    round_trips(dev, bf16::from_f32(-0.0), || {
        bf16::from_f32(r.random_range(-1.0..1.0))
    });
    round_trips(dev, u64::MAX, || r.random::<u64>());
    // A packed buffer of the wrong length.
    let s = dev.new_stream().unwrap();
    let a = Buffer::from_host(&s, &[1.0f32; 5]).unwrap();
    let mut short = Buffer::from_host(&s, &[0.0f32; 4]).unwrap();
    let mut table = SegmentTable::new();
    let r = pack_segments(&s, &[&a], &mut short, &mut table);
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    let mut a = a;
    let r = unpack_segments(&s, &short, &mut [&mut a], &mut table);
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    // No parts, nothing packed: a no-op.
    let mut empty = Buffer::<f32>::from_host(&s, &[]).unwrap();
    pack_segments(&s, &[], &mut empty, &mut table).unwrap();
}

device_test!(cpu_segments_round_trip, gpu_segments_round_trip, body);
