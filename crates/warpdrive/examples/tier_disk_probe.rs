//! Where a tier-store disk op (64 KiB by default) spends its time over a raw `O_DIRECT` op
//! of the same size: raw reads of the raw loop's own file (in order, and every other block),
//! of the store's own segment at a stored block's offset (the store's layout, none of its
//! code), the same plus an xxh3 of the block, the store's `get_host_into` (aligned memory:
//! in place; a `Vec`: bounced); raw writes, raw + xxh3 + an 80-byte log append (a put's
//! floor), the store's `put` from aligned memory and from a `Vec`. Every variant runs once a
//! round, the order rotated round by round (this disk's time depends on the op before);
//! medians in µs. Built with `--features tier-stamps`, it also prints the median time of
//! each stage of the store's aligned get and put (`tier::disk::stamp`).
//!
//! `cargo run --release -p warpdrive --features tier-stamps --example tier_disk_probe --
//! [threads|uring] [OPS] [SIZE]`, in `TMPDIR` (the disk to measure); `PROBE_ONLY=V` runs
//! variant V alone (for `strace -c`).

use std::hash::Hasher;
use std::time::Instant;

use warpdrive::tier::codec::Compression;
use warpdrive::tier::disk::{AlignedBuf, DirectFile, DiskIo, IoEngine};
use warpdrive::tier::prefetch::Prefetch;
use warpdrive::tier::{Durability, TierConfig, TierStore};
use warpdrive::{Device, Result};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let engine = match args.get(1).map(String::as_str) {
        Some("uring") => IoEngine::Uring,
        _ => IoEngine::Threads,
    };
    let ops: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(400);
    let size: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(64 << 10);
    let io = DiskIo {
        engine,
        queue_depth: 4,
    }
    .resolve()?;
    let dir = std::env::temp_dir().join(format!("tier-disk-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| warpdrive::Error::io(&dir, e))?;
    let stream = Device::cpu().new_stream()?;
    let mut config = TierConfig::new(0, 0);
    config.disk_compression = Compression::None;
    config.prefetch = Prefetch::Off;
    config.disk_io = DiskIo {
        engine,
        queue_depth: 4,
    };
    let store_dir = dir.join("store");
    let store = TierStore::open(&store_dir, config, &stream)?;
    let raw = DirectFile::open_with(&dir.join("raw"), io)?;
    let raw_w = DirectFile::open_with(&dir.join("raw-w"), io)?;
    let log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(dir.join("log"))
        .map_err(|e| warpdrive::Error::io(&dir, e))?;
    let mut block = AlignedBuf::new(size)?;
    let vec_block: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
    block.as_mut_slice().copy_from_slice(&vec_block);

    // Setup: raw file of `ops` blocks; the store with keys x{k} (aligned) and y{k} (Vec)
    // interleaved, as the bench interleaves its variants' puts: x{k} at segment offset 2k.
    for k in 0..ops {
        raw.write_at(&block, (k * size) as u64)?;
        store.put(&format!("x{k}"), block.as_slice(), Durability::Disk)?;
        store.put(&format!("y{k}"), &vec_block, Durability::Disk)?;
    }
    let seg_path = std::fs::read_dir(&store_dir)
        .map_err(|e| warpdrive::Error::io(&store_dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "seg"))
        .ok_or_else(|| warpdrive::Error::InvalidArgument("no segment".into()))?;
    let seg = DirectFile::open_with(&seg_path, io)?;
    println!(
        "engine {:?}, {ops} ops of {size} B, segment {seg_path:?}, align {:?}",
        io.engine,
        seg.align()
    );

    let names = [
        "R raw read, own file, sequential",
        "R raw read, own file, stride 2",
        "R raw read, store segment at x{k}",
        "R raw read, segment at y{k}, + xxh3",
        "R store get_host_into aligned",
        "R store get_host_into Vec",
        "W raw write (append, own file)",
        "W raw write + xxh3 + 80 B log write",
        "W store put aligned",
        "W store put Vec",
    ];
    let n = names.len();
    let mut times = vec![Vec::with_capacity(ops); n];
    let mut buf = AlignedBuf::new(size)?;
    let mut into = vec![0u8; size];
    let mut next_w = 0usize;
    let mut hashes = 0u64;
    let mut raw_hash = (Vec::new(), Vec::new());
    let mut stages: Vec<(&str, Vec<f64>)> = Vec::new();
    // `PROBE_ONLY=V`: only variant V (to count its syscalls alone).
    let only: Option<usize> = std::env::var("PROBE_ONLY")
        .ok()
        .and_then(|s| s.parse().ok());
    for round in 0..ops {
        for j in 0..n {
            let v = (j + round) % n;
            if only.is_some_and(|o| o != v) {
                continue;
            }
            let k = round;
            let _ = warpdrive::tier::disk::stamp::take();
            let t = Instant::now();
            warpdrive::tier::disk::stamp::mark("start");
            match v {
                0 => drop(raw.read_at(&mut buf, (k * size) as u64)?),
                1 => drop(raw.read_at(&mut buf, ((2 * k) % ops * size) as u64)?),
                2 => drop(seg.read_at(&mut buf, (2 * k * size) as u64)?),
                3 => {
                    // y{k}'s place: not the block variant 2 read this round.
                    seg.read_at(&mut buf, ((2 * k + 1) * size) as u64)?;
                    let h = Instant::now();
                    if round % 2 == 0 {
                        hashes ^= twox_hash::XxHash3_64::oneshot(buf.as_slice());
                        raw_hash.0.push(h.elapsed().as_secs_f64() * 1e6);
                    } else {
                        let mut x = twox_hash::XxHash3_64::new();
                        x.write(buf.as_slice());
                        hashes ^= x.finish();
                        raw_hash.1.push(h.elapsed().as_secs_f64() * 1e6);
                    }
                }
                4 => store.get_host_into(&format!("x{k}"), buf.as_mut_slice())?,
                5 => store.get_host_into(&format!("y{k}"), &mut into)?,
                6 => {
                    raw_w.write_at(&block, (next_w * size) as u64)?;
                    next_w += 1;
                }
                7 => {
                    hashes ^= twox_hash::XxHash3_64::oneshot(block.as_slice());
                    raw_w.write_at(&block, (next_w * size) as u64)?;
                    next_w += 1;
                    use std::io::Write;
                    (&log)
                        .write_all(&[0u8; 80])
                        .map_err(|e| warpdrive::Error::io(&dir, e))?;
                }
                8 => store.put(&format!("w{round}"), block.as_slice(), Durability::Disk)?,
                _ => store.put(&format!("v{round}"), &vec_block, Durability::Disk)?,
            }
            times[v].push(t.elapsed().as_secs_f64() * 1e6);
            warpdrive::tier::disk::stamp::mark(if v == 8 {
                "put: gpu/host checks, unlock"
            } else {
                "get: prefetch check, unlock"
            });
            if v == 4 || v == 8 {
                let m = warpdrive::tier::disk::stamp::take();
                for w in m.windows(2) {
                    let i = match stages.iter().position(|(s, _)| *s == w[1].0) {
                        Some(i) => i,
                        None => {
                            stages.push((w[1].0, Vec::new()));
                            stages.len() - 1
                        }
                    };
                    stages[i].1.push((w[1].1 - w[0].1).as_secs_f64() * 1e6);
                }
            }
        }
    }
    // The checksum alone, hot.
    let t = Instant::now();
    for _ in 0..1000 {
        hashes ^= twox_hash::XxHash3_64::oneshot(block.as_slice());
    }
    let hash_us = t.elapsed().as_secs_f64() * 1e6 / 1000.0;
    println!("xxh3 of {size} B, hot: {hash_us:.2} µs (checksums {hashes:x})");
    for (name, t) in names.iter().zip(times.iter_mut()) {
        if t.is_empty() {
            continue;
        }
        println!("{name:40} {:8.2}", median(t));
    }
    println!(
        "xxh3 right after the raw read: one-shot {:.2} µs, streaming {:.2} µs",
        median(&mut raw_hash.0),
        median(&mut raw_hash.1)
    );
    for (name, t) in stages.iter_mut() {
        let m = median(t);
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        println!("  stage ending {name:32} median {m:7.2} mean {mean:7.2}");
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
