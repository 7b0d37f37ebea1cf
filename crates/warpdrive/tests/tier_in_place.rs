//! The tier store's disk I/O in place: memory at the file's direct-I/O alignment is written
//! and read with no buffer between, still verified on every read.

mod common;

use common::tier::{block, block_on_disk, engines_here, flip_byte};
use common::{rng, seed};
use warpdrive::tier::codec::Compression;
use warpdrive::tier::{Durability, Tier, TierConfig, TierStore};
use warpdrive::{Device, Error};

/// Memory aligned for direct I/O is moved in place on either engine (a put written from it,
/// a `get_host_into` or a GPU get's pinned block read into it, no buffer between; large
/// blocks in pieces checksummed in order as they land), and such a read is still verified: a flipped byte is `Error::Corrupt` naming the key, with
/// nothing of the block left in the caller's memory. Blocks put from a `Vec` and from
/// aligned memory read back either way.
#[test]
fn aligned_memory_moves_in_place_and_is_still_verified() {
    use warpdrive::tier::disk::AlignedBuf;
    let s = Device::cpu().new_stream().unwrap();
    let mut r = rng(seed("tier in place"));
    // No GPU tier: `get_host_into` reads the disk into the caller's memory; a GPU tier
    // (the CPU device's here): through a pinned block.
    for (io, gpu) in engines_here()
        .into_iter()
        .flat_map(|io| [(io, 0), (io, 1 << 20)])
    {
        let root = std::env::temp_dir().join(format!(
            "warpdrive-tier-in-place-{}-{:?}-{}-{gpu}",
            std::process::id(),
            io.engine,
            io.queue_depth
        ));
        let _ = std::fs::remove_dir_all(&root);
        let mut config = TierConfig::new(gpu, 0);
        config.disk_compression = Compression::None;
        config.prefetch = warpdrive::tier::prefetch::Prefetch::Off;
        config.disk_io = io;
        let store = TierStore::open(&root, config, &s).unwrap();
        // One I/O; pieces in flight from 4 MiB (and the streamed path's size, 16 MiB up).
        for len in [
            4096,
            12 << 10,
            64 << 10,
            5000,
            4 << 20,
            (16 << 20) + (12 << 10),
        ] {
            let data = block(&mut r, len);
            let mut aligned = AlignedBuf::new(len).unwrap();
            aligned.as_mut_slice()[..len].copy_from_slice(&data);
            store
                .put("from-aligned", &aligned.as_slice()[..len], Durability::Disk)
                .unwrap();
            store.put("from-vec", &data, Durability::Sync).unwrap();
            for key in ["from-aligned", "from-vec"] {
                let mut out = AlignedBuf::new(len).unwrap();
                out.as_mut_slice().fill(0xaa);
                store
                    .get_host_into(key, &mut out.as_mut_slice()[..len])
                    .unwrap();
                assert!(
                    out.as_slice()[..len] == data[..],
                    "{len} {key} into aligned"
                );
                assert_eq!(store.get_host(key).unwrap(), data, "{len} {key} get_host");
                // Through the GPU tier (the CPU device here): a pinned block in between.
                assert_eq!(
                    store.get(key).unwrap().to_host(&s).unwrap(),
                    data,
                    "{len} {key}"
                );
                store.migrate(key, Tier::Disk).unwrap();
            }
            // A byte flipped in the last block written: caught on the in-place read.
            let (segment, start) = block_on_disk(&root, &data[..64]);
            let at = start + len as u64 / 2;
            flip_byte(&segment, at, 0x01);
            let mut out = AlignedBuf::new(len).unwrap();
            match store.get_host_into("from-vec", &mut out.as_mut_slice()[..len]) {
                Err(Error::Corrupt { key, .. }) => assert_eq!(key, "from-vec"),
                other => panic!("{len}: {other:?}"),
            }
            assert!(
                out.as_slice()[..len].iter().all(|&b| b == 0),
                "{len}: bytes left"
            );
            let got = store.get("from-vec").map(drop);
            assert!(matches!(got, Err(Error::Corrupt { .. })), "{len}: {got:?}");
            flip_byte(&segment, at, 0x01);
            store.migrate("from-vec", Tier::Disk).unwrap();
            assert_eq!(store.get_host("from-vec").unwrap(), data, "{len} restored");
        }
        drop(store);
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// `len` bytes of `v` starting at an address that is a multiple of 512 but not of 4096 (a
/// `Vec` slice where the file's direct-I/O memory alignment is 512 B, not a page).
fn at_512_not_4096(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    v.resize(len + 8192, 0);
    let addr = v.as_ptr() as usize;
    let skip = (0..8192)
        .find(|s| (addr + s) % 512 == 0 && (addr + s) % 4096 != 0)
        .expect("a 512-aligned address in 8 KiB");
    &mut v[skip..skip + len]
}

#[test]
fn memory_at_the_files_dio_alignment_moves_in_place_and_is_verified() {
    use warpdrive::tier::disk::{in_place_ios, DirectFile};
    let s = Device::cpu().new_stream().unwrap();
    let mut r = rng(seed("tier dio align"));
    for io in engines_here() {
        let root = std::env::temp_dir().join(format!(
            "warpdrive-tier-dio-{}-{:?}-{}",
            std::process::id(),
            io.engine,
            io.queue_depth
        ));
        let _ = std::fs::remove_dir_all(&root);
        let mut config = TierConfig::new(0, 0);
        config.disk_compression = Compression::None;
        config.prefetch = warpdrive::tier::prefetch::Prefetch::Off;
        config.disk_io = io;
        let store = TierStore::open(&root, config, &s).unwrap();
        // What this folder's file system asks (this build VM's virtio disk: 512 / 512).
        let probe = root.join("probe");
        let file = DirectFile::open(&probe).unwrap();
        let align = file.align();
        drop(file);
        std::fs::remove_file(&probe).unwrap();
        eprintln!("{io:?}: direct {align:?}");
        // On the sector, off it (its last partial sector bounced), under one sector.
        for len in [64 << 10, (64 << 10) + 100, 5000, 300] {
            let data = block(&mut r, len);
            let mut src = Vec::new();
            let src = at_512_not_4096(&mut src, len);
            src.copy_from_slice(&data);
            // In place where the memory meets the file's alignment and a sector fits.
            let moves = align.mem <= 512 && len >= align.offset;
            let before = in_place_ios();
            store.put("k", src, Durability::Sync).unwrap();
            assert_eq!(in_place_ios() - before, moves as u64, "{len}: put in place");
            let mut back = Vec::new();
            let back = at_512_not_4096(&mut back, len);
            back.fill(0xaa);
            let before = in_place_ios();
            store.get_host_into("k", back).unwrap();
            assert_eq!(in_place_ios() - before, moves as u64, "{len}: get in place");
            assert!(back[..] == data[..], "{len}: round trip");
            assert_eq!(store.get_host("k").unwrap(), data, "{len}: get_host");
            assert_eq!(store.get("k").unwrap().to_host(&s).unwrap(), data, "{len}");
            store.migrate("k", Tier::Disk).unwrap();
            // A byte flipped in the block's first sector, then in its last (the bounced
            // partial sector where there is one): caught, the caller's memory zeroed.
            let (segment, start) = block_on_disk(&root, &data[..64]);
            for at in [start + 7, start + len as u64 - 1] {
                flip_byte(&segment, at, 0x10);
                back.fill(0xaa);
                match store.get_host_into("k", back) {
                    Err(Error::Corrupt { key, .. }) => assert_eq!(key, "k"),
                    other => panic!("{len} at {at}: {other:?}"),
                }
                assert!(back.iter().all(|&b| b == 0), "{len} at {at}: bytes left");
                flip_byte(&segment, at, 0x10);
                store.get_host_into("k", back).unwrap();
                assert!(back[..] == data[..], "{len}: restored");
            }
            store.remove("k").unwrap();
        }
        drop(store);
        let _ = std::fs::remove_dir_all(&root);
    }
}
