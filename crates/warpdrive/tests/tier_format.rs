//! The on-disk format: a block is stored bare (its data segment holds only the payload, on
//! whole pages; its header with the checksum is in the index record), and a store written
//! before that (each block's 32-byte header in front of its payload in the segment, puts
//! logged without a header) still opens, reads, verifies, compacts and takes new puts.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{rng, seed};
use rand::RngCore;
use warpdrive::tier::codec::{encode_block, Compression, Filter, HEADER_BYTES};
use warpdrive::tier::disk::{Disk, SimDisk, DIRECT_ALIGN};
use warpdrive::tier::log::{IndexLog, Location, Record};
use warpdrive::tier::{Durability, TierConfig, TierStore};
use warpdrive::{Device, Error};

fn dir() -> PathBuf {
    PathBuf::from("/store/format")
}

fn random(r: &mut impl RngCore, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.fill_bytes(&mut v);
    v
}

/// Writes `blocks` as the old format did: segment 1 holds each framed block (header, then
/// payload) at an aligned offset, the log one put per block with no header.
fn write_old_store(disk: &Arc<SimDisk>, blocks: &[(&str, Vec<u8>)]) -> Vec<Location> {
    let (mut log, index) = IndexLog::open(disk.clone(), &dir()).unwrap();
    assert!(index.is_empty());
    let segment = dir().join("data-1.seg");
    let mut placed = Vec::new();
    for (key, stored) in blocks {
        let offset = disk.append_aligned(&segment, &[stored]).unwrap();
        let at = Location {
            folder: 0,
            segment: 1,
            offset,
            len: stored.len() as u64,
            head: None,
        };
        log.append(
            &Record::Put {
                key: key.to_string(),
                at,
            },
            false,
        )
        .unwrap();
        placed.push(at);
    }
    disk.sync(&segment).unwrap();
    disk.sync_dir(&dir()).unwrap();
    log.sync().unwrap();
    placed
}

#[test]
fn a_store_of_the_old_format_opens_reads_verifies_and_compacts() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let mut r = rng(seed("tier old format"));
    let plain = random(&mut r, 10_000);
    let zeros = vec![0u8; 50_000];
    // From 16 MiB stored bytes a read lands piece by piece (the header inside the first).
    let large = random(&mut r, (17 << 20) + 3);
    let dead = random(&mut r, 300_000);
    let zstd = Compression::Zstd { level: 1 };
    let stored = [
        (
            "plain",
            encode_block(&plain, Compression::None, Filter::None).unwrap(),
        ),
        (
            "zeros",
            encode_block(&zeros, zstd, Filter::Shuffle { width: 2 }).unwrap(),
        ),
        (
            "large",
            encode_block(&large, Compression::None, Filter::None).unwrap(),
        ),
        (
            "dead",
            encode_block(&dead, Compression::None, Filter::None).unwrap(),
        ),
    ];
    assert!(stored[1].1.len() < 1000, "the zeros compressed");
    let placed = write_old_store(&disk, &stored);
    let config = TierConfig::new(0, 0);
    let want = [
        ("plain", &plain),
        ("zeros", &zeros),
        ("large", &large),
        ("dead", &dead),
    ];
    {
        let store = TierStore::open_on(disk.clone(), dir(), config.clone(), &s).unwrap();
        for (key, data) in want {
            assert_eq!(&store.get_host(key).unwrap(), data, "{key}");
            let mut into = vec![0u8; data.len()];
            store.get_host_into(key, &mut into).unwrap();
            assert_eq!(&into, data, "{key} into a buffer");
        }
        // A flipped byte in an old block's header or payload is caught.
        let segment = dir().join("data-1.seg");
        for (i, at) in placed.iter().enumerate().take(3) {
            let key = stored[i].0;
            for off in [5, 30, HEADER_BYTES as u64 + 1, at.len - 1] {
                disk.flip_byte(&segment, at.offset + off).unwrap();
                match store.get_host(key) {
                    Err(Error::Corrupt { key: k, .. }) => assert_eq!(k, key),
                    other => panic!("{key} at {off}: {:?}", other.map(|v| v.len())),
                }
                disk.flip_byte(&segment, at.offset + off).unwrap();
            }
        }
        // New blocks beside the old ones are stored bare.
        store.put("new", &plain, Durability::Sync).unwrap();
        assert_eq!(store.get_host("new").unwrap(), plain);
        // Most of the old segment dies: compaction moves the old blocks on as they are.
        store.remove("large").unwrap();
        store.remove("dead").unwrap();
        assert!(
            store.compact().unwrap() > 0,
            "the old segment was compacted"
        );
        assert!(
            disk.len(&segment).unwrap().is_none(),
            "the old segment went"
        );
        for (key, data) in [("plain", &plain), ("zeros", &zeros), ("new", &plain)] {
            assert_eq!(
                &store.get_host(key).unwrap(),
                data,
                "{key} after compaction"
            );
        }
    }
    let store = TierStore::open_on(disk.clone(), dir(), config, &s).unwrap();
    for (key, data) in [("plain", &plain), ("zeros", &zeros), ("new", &plain)] {
        assert_eq!(&store.get_host(key).unwrap(), data, "{key} after reopening");
    }
    assert!(store.get_host("large").is_err());
}

/// A new block's segment bytes are exactly its payload on whole pages: a 64 KiB block stored
/// raw takes 16 pages, and its data starts on a page.
#[test]
fn a_block_is_stored_bare_on_whole_pages() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let mut r = rng(seed("tier bare"));
    let store = TierStore::open_on(disk.clone(), dir(), TierConfig::new(0, 0), &s).unwrap();
    let a = random(&mut r, 64 << 10);
    let b = random(&mut r, 64 << 10);
    store.put("a", &a, Durability::Sync).unwrap();
    store.put("b", &b, Durability::Sync).unwrap();
    let segment = segment_of(&disk);
    let bytes = disk.read_all(&segment).unwrap();
    assert_eq!(bytes.len(), 2 * (64 << 10), "two blocks of 16 pages each");
    assert_eq!(&bytes[..64 << 10], &a[..]);
    assert_eq!(&bytes[64 << 10..], &b[..]);
    assert_eq!(bytes.len() as u64 % DIRECT_ALIGN, 0);
}

fn segment_of(disk: &SimDisk) -> PathBuf {
    disk.list(Path::new(&dir()))
        .unwrap()
        .into_iter()
        .find(|p| p.extension().is_some_and(|x| x == "seg"))
        .expect("a segment")
}
