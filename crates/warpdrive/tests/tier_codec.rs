//! The tier store's on-disk block frame (issue 34, item 3): round trips for every codec and
//! filter, raw fallback, every flipped bit caught, truncation and extension refused, and no
//! panic on any input.

use half::bf16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warpdrive::tier::codec::{
    decode_block, decode_block_into, encode_block, encode_plain_into, shuffle, unshuffle,
    Compression, Filter, Frame, HEADER_BYTES, OVERLAP_FROM,
};
use warpdrive::Error;

const COMPRESSIONS: [Compression; 5] = [
    Compression::None,
    Compression::Lz4,
    Compression::Zstd { level: 1 },
    Compression::Zstd { level: 19 },
    Compression::Zstd { level: -5 },
];
const FILTERS: [Filter; 4] = [
    Filter::None,
    Filter::Shuffle { width: 1 },
    Filter::Shuffle { width: 2 },
    Filter::Shuffle { width: 4 },
];
const SIZES: [usize; 5] = [0, 1, 3, 4097, (1 << 20) + 1];

fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

/// A standard normal sample (Box-Muller), for weight-like data.
fn normal(rng: &mut StdRng) -> f32 {
    let u: f32 = 1.0 - rng.random::<f32>();
    let v: f32 = rng.random();
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// `n` bytes of bf16 values drawn from N(0, 0.02²), like a layer's weights.
fn bf16_weights(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut out: Vec<u8> = (0..n.div_ceil(2))
        .flat_map(|_| bf16::from_f32(0.02 * normal(rng)).to_bits().to_le_bytes())
        .collect();
    out.truncate(n);
    out
}

/// `n` bytes of bf16 activations after a ReLU: about half exact zeros.
fn relu_activations(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut out: Vec<u8> = (0..n.div_ceil(2))
        .flat_map(|_| bf16::from_f32(normal(rng).max(0.0)).to_bits().to_le_bytes())
        .collect();
    out.truncate(n);
    out
}

/// `n` bytes of English-like text: words drawn at random from a small vocabulary.
fn text(rng: &mut StdRng, n: usize) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "the",
        "tier",
        "store",
        "keeps",
        "blocks",
        "on",
        "disk",
        "and",
        "in",
        "memory",
        "compressed",
        "with",
        "a",
        "checksum",
        "read",
        "back.\n",
    ];
    let mut out = Vec::with_capacity(n + 16);
    while out.len() < n {
        out.extend_from_slice(WORDS[rng.random_range(0..WORDS.len())].as_bytes());
        out.push(b' ');
    }
    out.truncate(n);
    out
}

fn round_trip_all(name: &str, make: fn(&mut StdRng, usize) -> Vec<u8>) {
    let mut rng = StdRng::seed_from_u64(34);
    for size in SIZES {
        let data = make(&mut rng, size);
        assert_eq!(data.len(), size);
        for compression in COMPRESSIONS {
            for filter in FILTERS {
                let stored = encode_block(&data, compression, filter).unwrap();
                assert!(
                    stored.len() <= data.len() + HEADER_BYTES,
                    "{name} {size} {compression:?} {filter:?}: grew past the raw frame"
                );
                let back = decode_block(&stored, "k").unwrap();
                assert!(
                    back == data,
                    "{name} {size} {compression:?} {filter:?}: round trip differs"
                );
            }
        }
    }
}

#[test]
fn round_trips_random_bytes() {
    round_trip_all("random", random_bytes);
}

#[test]
fn round_trips_bf16_weights() {
    round_trip_all("bf16", bf16_weights);
}

#[test]
fn round_trips_relu_activations() {
    round_trip_all("relu", relu_activations);
}

#[test]
fn round_trips_text() {
    round_trip_all("text", text);
}

#[test]
fn compressible_data_shrinks_and_random_bytes_are_stored_raw() {
    let mut rng = StdRng::seed_from_u64(1);
    let random = random_bytes(&mut rng, 64 << 10);
    let zeros = vec![0u8; 64 << 10];
    for compression in COMPRESSIONS {
        for filter in FILTERS {
            let stored = encode_block(&random, compression, filter).unwrap();
            assert_eq!(stored.len(), random.len() + HEADER_BYTES);
            assert_eq!(&stored[HEADER_BYTES..], &random[..], "raw payload");
            assert_eq!(stored[5], 0, "codec none recorded");
            assert_eq!(stored[7], 0, "no filter recorded");
            if compression != Compression::None {
                let stored = encode_block(&zeros, compression, filter).unwrap();
                assert!(
                    stored.len() < zeros.len() / 10,
                    "{compression:?} {filter:?}"
                );
            }
        }
    }
}

/// From 256 KiB a probe of spread windows decides before the whole block is compressed:
/// large random blocks are stored raw, large compressible ones (bf16 weights shuffled for
/// zstd, activations, text) still shrink as the whole-block codec makes them.
#[test]
fn large_blocks_are_probed_before_compression() {
    let mut rng = StdRng::seed_from_u64(2);
    let n = (1 << 20) + 3;
    let random = random_bytes(&mut rng, n);
    for compression in COMPRESSIONS {
        let stored = encode_block(&random, compression, Filter::None).unwrap();
        assert_eq!(stored.len(), n + HEADER_BYTES, "{compression:?}");
        assert_eq!(stored[5], 0, "codec none recorded");
    }
    let zstd = Compression::Zstd { level: 1 };
    let shuffle = Filter::Shuffle { width: 2 };
    for (name, data, filter) in [
        ("bf16 weights", bf16_weights(&mut rng, n), shuffle),
        ("activations", relu_activations(&mut rng, n), Filter::None),
        ("text", text(&mut rng, n), Filter::None),
    ] {
        let stored = encode_block(&data, zstd, filter).unwrap();
        assert!(
            stored.len() * 10 < data.len() * 9,
            "{name}: {} of {n}",
            stored.len()
        );
        assert_eq!(decode_block(&stored, "k").unwrap(), data, "{name}");
    }
}

#[test]
fn shuffle_groups_bytes_by_position_and_keeps_the_tail() {
    let data = [1, 2, 3, 11, 12, 13, 21, 22, 23, 31, 32];
    let mut out = Vec::new();
    shuffle(&data, 3, &mut out);
    assert_eq!(out, [1, 11, 21, 2, 12, 22, 3, 13, 23, 31, 32]);
    let mut back = vec![9; 3];
    unshuffle(&out, 3, &mut back);
    assert_eq!(back, data);
    for width in [0, 1] {
        shuffle(&data, width, &mut out);
        assert_eq!(out, data);
        unshuffle(&data, width, &mut out);
        assert_eq!(out, data);
    }
    shuffle(&data[..2], 4, &mut out);
    assert_eq!(out, [1, 2]);
    // Width 2 (bf16 / f16) has its own loop: the same layout, the odd byte kept last.
    shuffle(&data, 2, &mut out);
    assert_eq!(out, [1, 3, 12, 21, 23, 2, 11, 13, 22, 31, 32]);
    let mut back = vec![9; 5];
    unshuffle(&out, 2, &mut back);
    assert_eq!(back, data);
}

fn assert_corrupt(result: warpdrive::Result<Vec<u8>>, what: &str) {
    match result {
        Err(Error::Corrupt { key, detail }) => {
            assert_eq!(key, "blk/7", "{what}");
            assert!(!detail.is_empty(), "{what}");
        }
        Err(other) => panic!("{what}: wrong error {other:?}"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

#[test]
fn every_single_bit_flip_is_detected() {
    let mut rng = StdRng::seed_from_u64(7);
    let compressible: Vec<u8> = b"the tier store keeps blocks; ".repeat(7);
    let incompressible = random_bytes(&mut rng, 64);
    let cases = [
        (&incompressible, Compression::Lz4, Filter::None),
        (
            &compressible,
            Compression::Lz4,
            Filter::Shuffle { width: 2 },
        ),
        (&compressible, Compression::Zstd { level: 3 }, Filter::None),
    ];
    for (data, compression, filter) in cases {
        let stored = encode_block(data, compression, filter).unwrap();
        assert!(stored.len() <= 96, "a small block: {}", stored.len());
        if data.len() > 64 {
            assert_ne!(stored[5], 0, "compressed, so the payload is the codec's");
        }
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_corrupt(
                decode_block(&flipped, "blk/7"),
                &format!("{compression:?} bit {bit}"),
            );
        }
    }
}

#[test]
fn truncated_and_extended_blocks_are_rejected() {
    let mut rng = StdRng::seed_from_u64(8);
    let data = text(&mut rng, 1000);
    let stored = encode_block(&data, Compression::Lz4, Filter::None).unwrap();
    for len in 0..stored.len() {
        assert_corrupt(
            decode_block(&stored[..len], "blk/7"),
            &format!("cut to {len}"),
        );
    }
    for extra in [&[0u8][..], &[0; 7], &stored[..]] {
        let mut longer = stored.clone();
        longer.extend_from_slice(extra);
        assert_corrupt(decode_block(&longer, "blk/7"), "extended");
    }
}

/// `stored` with its checksum recomputed after a field was forged, so only the checks behind
/// the checksum can refuse it.
fn reseal(mut stored: Vec<u8>) -> Vec<u8> {
    let mut covered = stored[..24].to_vec();
    covered.extend_from_slice(&stored[HEADER_BYTES..]);
    let sum = twox_hash::XxHash3_64::oneshot(&covered);
    stored[24..32].copy_from_slice(&sum.to_le_bytes());
    stored
}

#[test]
fn resealing_an_unchanged_block_keeps_it_valid() {
    let stored = encode_block(&[5; 100], Compression::Lz4, Filter::None).unwrap();
    assert_eq!(reseal(stored.clone()), stored);
}

#[test]
fn forged_fields_behind_a_valid_checksum_are_refused() {
    let mut rng = StdRng::seed_from_u64(9);
    let data = text(&mut rng, 1000);
    let raw = encode_block(&data, Compression::None, Filter::None).unwrap();
    let lz4 = encode_block(&data, Compression::Lz4, Filter::None).unwrap();
    let zstd = encode_block(&data, Compression::Zstd { level: 1 }, Filter::None).unwrap();
    let forge = |stored: &Vec<u8>, at: usize, bytes: &[u8]| {
        let mut forged = stored.clone();
        forged[at..at + bytes.len()].copy_from_slice(bytes);
        reseal(forged)
    };
    let len = |n: u64| n.to_le_bytes();
    let cases = [
        ("raw length u64::MAX", forge(&raw, 8, &len(u64::MAX))),
        ("raw length 1 GiB + 1", forge(&raw, 8, &len((1 << 30) + 1))),
        ("magic", forge(&raw, 0, b"WDBX")),
        ("version", forge(&raw, 4, &[2])),
        ("unknown codec", forge(&lz4, 5, &[3])),
        ("level on lz4", forge(&lz4, 6, &[1])),
        ("raw with a filter", forge(&raw, 7, &[2])),
        ("raw with a short length", forge(&raw, 8, &len(999))),
        ("lz4 claims fewer bytes", forge(&lz4, 8, &len(999))),
        ("lz4 claims more bytes", forge(&lz4, 8, &len(1001))),
        ("zstd claims fewer bytes", forge(&zstd, 8, &len(999))),
        ("zstd claims more bytes", forge(&zstd, 8, &len(1001))),
        ("lz4 payload read as zstd", forge(&lz4, 5, &[2])),
        ("zstd payload read as lz4", forge(&zstd, 5, &[1, 0])),
        ("payload length", forge(&lz4, 16, &len(1))),
    ];
    for (what, forged) in cases {
        assert_corrupt(decode_block(&forged, "blk/7"), what);
    }
}

#[test]
fn bad_arguments_are_refused() {
    assert!(matches!(
        encode_block(b"abc", Compression::Lz4, Filter::Shuffle { width: 0 }),
        Err(Error::InvalidArgument(_))
    ));
    for level in [23, -129, i32::MIN, i32::MAX] {
        assert!(matches!(
            encode_block(b"abc", Compression::Zstd { level }, Filter::None),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
#[ignore = "prints ratios; run by hand"]
fn prints_ratios() {
    let mut rng = StdRng::seed_from_u64(34);
    let shuffled = Filter::Shuffle { width: 2 };
    let (lz4, zstd1, zstd_fast) = (
        Compression::Lz4,
        Compression::Zstd { level: 1 },
        Compression::Zstd { level: -1 },
    );
    for (name, data) in [
        ("bf16 N(0,0.02) weights", bf16_weights(&mut rng, 8 << 20)),
        (
            "bf16 ReLU activations",
            relu_activations(&mut rng, 64 << 20),
        ),
        ("text", text(&mut rng, 8 << 20)),
    ] {
        for block in [64 << 10, 4 << 20] {
            // Ratio (raw / stored, frames included) over the data cut into blocks.
            let ratio = |compression, filter| {
                let stored: usize = data
                    .chunks(block)
                    .map(|chunk| encode_block(chunk, compression, filter).unwrap().len())
                    .sum();
                data.len() as f64 / stored as f64
            };
            println!(
                "{name}, {} KiB blocks: lz4 {:.2}, zstd 1 {:.2}, zstd --fast=1 {:.2}; \
                 shuffled: lz4 {:.2}, zstd 1 {:.2}, zstd --fast=1 {:.2}",
                block >> 10,
                ratio(lz4, Filter::None),
                ratio(zstd1, Filter::None),
                ratio(zstd_fast, Filter::None),
                ratio(lz4, shuffled),
                ratio(zstd1, shuffled),
                ratio(zstd_fast, shuffled),
            );
        }
    }
}

fn compression_strategy() -> impl Strategy<Value = Compression> {
    prop_oneof![
        Just(Compression::None),
        Just(Compression::Lz4),
        (-7i32..=9).prop_map(|level| Compression::Zstd { level }),
    ]
}

fn filter_strategy() -> impl Strategy<Value = Filter> {
    prop_oneof![
        Just(Filter::None),
        (1u8..=8).prop_map(|width| Filter::Shuffle { width }),
    ]
}

/// Data that is sometimes compressible: a few distinct bytes in runs, or arbitrary bytes.
fn data_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..2048),
        proptest::collection::vec((0u8..4, 1usize..40), 0..100).prop_map(|runs| {
            runs.into_iter()
                .flat_map(|(byte, n)| std::iter::repeat_n(byte, n))
                .collect()
        }),
    ]
}

proptest! {
    #[test]
    fn any_data_round_trips(
        data in data_strategy(),
        compression in compression_strategy(),
        filter in filter_strategy(),
    ) {
        let stored = encode_block(&data, compression, filter).unwrap();
        prop_assert!(stored.len() <= data.len() + HEADER_BYTES);
        prop_assert_eq!(decode_block(&stored, "k").unwrap(), data);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_block(&bytes, "k");
    }

    #[test]
    fn arbitrary_bytes_behind_a_valid_magic_never_panic(
        mut bytes in proptest::collection::vec(any::<u8>(), HEADER_BYTES..256),
    ) {
        bytes[..5].copy_from_slice(b"WDBK\x01");
        let _ = decode_block(&bytes, "k");
    }

    #[test]
    fn flipped_bits_are_rejected(
        data in data_strategy(),
        compression in compression_strategy(),
        filter in filter_strategy(),
        flips in proptest::collection::vec(any::<prop::sample::Index>(), 1..8),
    ) {
        let stored = encode_block(&data, compression, filter).unwrap();
        let mut flipped = stored.clone();
        for flip in &flips {
            let bit = flip.index(stored.len() * 8);
            flipped[bit / 8] ^= 1 << (bit % 8);
        }
        match decode_block(&flipped, "k") {
            Err(Error::Corrupt { .. }) => {}
            // Flips that cancel out leave the block as it was.
            Ok(back) => {
                prop_assert_eq!(&flipped, &stored);
                prop_assert_eq!(back, data);
            }
            Err(other) => prop_assert!(false, "wrong error {:?}", other),
        }
    }
}

#[test]
fn large_blocks_checked_beside_their_landing_still_catch_every_flip() {
    // From OVERLAP_FROM stored bytes the checksum runs beside `land`: a flipped bit must
    // still make the read fail, whatever `land` did with the bytes.
    let mut rng = StdRng::seed_from_u64(0x0e21);
    let data = random_bytes(&mut rng, OVERLAP_FROM + 4099);
    let stored = encode_block(&data, Compression::None, Filter::None).unwrap();
    let landed =
        Frame::verify_then(&stored, "k", |f| Ok(f.plain_payload().map(<[u8]>::to_vec))).unwrap();
    assert_eq!(landed.as_deref(), Some(&data[..]));
    for at in [
        0,
        5,
        HEADER_BYTES - 1,
        HEADER_BYTES,
        stored.len() / 2,
        stored.len() - 1,
    ] {
        let mut bad = stored.clone();
        bad[at] ^= 0x10;
        let got = Frame::verify_then(&bad, "k", |f| Ok(f.raw_len()));
        assert!(
            matches!(got, Err(Error::Corrupt { .. })),
            "flip at {at}: {got:?}"
        );
    }
}

#[test]
fn one_pass_framing_and_landing_match_the_two_pass_ones_and_catch_every_flip() {
    // `encode_plain_into` copies and hashes in one pass: the same frame as `encode_block`;
    // `decode_block_into` / `decode_block` land a plain block the same way: every flip
    // is still an error, on both sides of a copy chunk and in the header.
    let mut rng = StdRng::seed_from_u64(0x1a55);
    for len in [1, 4064, 65_536, (1 << 20) + 7] {
        let data = random_bytes(&mut rng, len);
        let stored = encode_block(&data, Compression::None, Filter::None).unwrap();
        let mut framed = vec![0xa5; HEADER_BYTES + len];
        encode_plain_into(&data, &mut framed).unwrap();
        assert!(framed == stored, "{len}: another frame");
        let short = encode_plain_into(&data, &mut framed[1..]);
        assert!(
            matches!(short, Err(Error::LengthMismatch { .. })),
            "{short:?}"
        );
        let into = |s: &[u8]| decode_block_into(s, "k", |n| Ok(vec![7u8; n]), |v| Ok(&mut v[..]));
        assert!(into(&stored).unwrap() == data);
        assert!(decode_block(&stored, "k").unwrap() == data);
        for at in [
            0,
            6,
            HEADER_BYTES - 1,
            HEADER_BYTES,
            HEADER_BYTES + len / 2,
            stored.len() - 1,
        ] {
            let mut bad = stored.clone();
            bad[at] ^= 0x04;
            let (a, b) = (into(&bad), decode_block(&bad, "k"));
            assert!(
                matches!(a, Err(Error::Corrupt { .. })),
                "{len} flip at {at}: {a:?}"
            );
            assert!(
                matches!(b, Err(Error::Corrupt { .. })),
                "{len} flip at {at}: {b:?}"
            );
        }
    }
    // A compressed block lands through the same call.
    let text = b"the tier the tier the tier the tier ".repeat(4000);
    let stored = encode_block(&text, Compression::Lz4, Filter::None).unwrap();
    assert!(stored.len() < text.len());
    let back = decode_block_into(&stored, "k", |n| Ok(vec![0u8; n]), |v| Ok(&mut v[..])).unwrap();
    assert!(back == text);
}
