//! The `tier` suite: what the tiered store's disk codec and migrations cost.
//!
//! - `compress-DATA` / `decompress-DATA` (size = block bytes): one core encoding (decoding)
//!   one block, µs per block and GB/s of raw data; variants `lz4`, `zstd-1`, and both after
//!   the 2-byte shuffle (`lz4-shuffle`, `zstd-1-shuffle`); `extra.ratio` = raw / stored.
//!   DATA: `bf16-weights` (Gaussian), `bf16-activations` (ReLU'd Gaussian: half zeros) and
//!   `text` (words of English).
//! - `migrate-FROM-TO` (size = block bytes): µs per [`TierStore::migrate`] of one block
//!   between tiers (GPU, pinned host, disk through the page cache), the stream synchronised
//!   at the end, 30 times at full scale (200 between GPU and host, for a p99 that is not the
//!   slowest of a few); `extra.p99_us`; `extra.store_us` and `extra.store_blocks`: the store's own
//!   count and mean time of that hop (`TierStats::moves`, warm-up included), which the
//!   `warpdrive_tier_move_seconds` metric also gets. GPU pairs run on a GPU only; each
//!   has a `driver-pinned` row beside it: the driver's copy between a device buffer and a
//!   pinned one, timed the same way in the same iterations (the hop's ceiling, with its p99).
//! - `disk-write` / `disk-read` (size = block bytes): one block at a time in the system's
//!   temporary folder: `raw-odirect` (our own loop of aligned `pwrite` / `pread` on one
//!   `O_DIRECT` file) vs `warpdrive` (a disk-only store's `put` with `Durability::Disk` and
//!   `get_host`: frame, checksum, the write, the index record; and `warpdrive-into`, a
//!   read by `get_host_into` into a buffer the caller reuses, as the raw loop reuses its
//!   own; `warpdrive-aligned` and `warpdrive-into-aligned`, the same from and into memory
//!   aligned for direct I/O, which the store moves in place with no buffer between), all at
//!   the queue depth the store gives the size (`extra.queue_depth`: 1, or 4
//!   pieces of 1-4 MiB in flight from 4 MiB); `extra.direct` says whether the file system took
//!   `O_DIRECT`, `extra.pct_of_raw` the store's rate against the raw loop's on the same
//!   engine. Each on the thread pool (`raw-odirect`, `warpdrive`, `warpdrive-into`) and on
//!   io_uring where the kernel offers it (`raw-odirect-uring`, `warpdrive-uring`,
//!   `warpdrive-uring-into`), all interleaved round by round; `extra.engine` and
//!   `extra.engine_queue_depth` name the engine and its ring's depth.
//! - `prefetch-TRACE` (size = gets): gets of 4 KiB blocks that start on a simulated disk,
//!   a GPU tier with room for a quarter of them; `warpdrive` (the prefetcher on) vs `lru`
//!   (off: CLOCK alone); `extra.hit_rate` = gets served from the GPU tier / gets. TRACE:
//!   `sequential`, `strided` (stride 3), `random`, `mixed` (runs of 8 in order between
//!   random jumps); µs per get.

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use warpdrive::bf16;
use warpdrive::error::{Error, Result};
use warpdrive::memory::{Buffer, PinnedBuf};
use warpdrive::tier::codec::{decode_block, encode_block, Compression, Filter};
use warpdrive::tier::disk::{
    queue_depth, stamp, AlignedBuf, DirectFile, DiskIo, Engine, Io, IoEngine, SimDisk, QUEUE_DEPTH,
};
use warpdrive::tier::prefetch::Prefetch;
use warpdrive::tier::{Durability, Tier, TierConfig, TierStore};

use super::stats::percentile;
use super::timing::{time_host, time_host_rounds};
use super::{Ctx, Row, Scale};

pub(crate) const SUITE: &str = "tier";

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    if !ctx.options().tier_disk_sizes.is_empty() {
        return disk_cases(ctx);
    }
    codec_cases(ctx)?;
    disk_cases(ctx)?;
    prefetch_cases(ctx)?;
    migrate_cases(ctx)
}

fn reps(scale: Scale) -> usize {
    match scale {
        Scale::Full => 30,
        Scale::Quick => 10,
        Scale::Tiny => 3,
    }
}

/// Gaussian values as bf16 bytes; with `relu`, negatives are zero.
fn bf16_bytes(r: &mut SmallRng, bytes: usize, relu: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes);
    while out.len() + 2 <= bytes {
        // Box-Muller.
        let (u, v): (f64, f64) = (r.random_range(1e-12..1.0), r.random());
        let mut x = ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32 * 0.02;
        if relu && x < 0.0 {
            x = 0.0;
        }
        out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
    }
    out.resize(bytes, 0);
    out
}

fn text_bytes(r: &mut SmallRng, bytes: usize) -> Vec<u8> {
    const WORDS: [&str; 24] = [
        "the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
        "are", "as", "with", "his", "they", "at", "memory", "device", "transfer", "tier",
    ];
    let mut out = Vec::with_capacity(bytes + 16);
    while out.len() < bytes {
        out.extend_from_slice(WORDS[r.random_range(0..WORDS.len())].as_bytes());
        out.push(if r.random_range(0..12) == 0 {
            b'\n'
        } else {
            b' '
        });
    }
    out.truncate(bytes);
    out
}

fn codec_cases(ctx: &mut Ctx) -> Result<()> {
    let size = if ctx.quick() { MIB } else { 4 * MIB };
    let mut r = SmallRng::seed_from_u64(0x71e2);
    let data = [
        ("bf16-weights", bf16_bytes(&mut r, size, false)),
        ("bf16-activations", bf16_bytes(&mut r, size, true)),
        ("text", text_bytes(&mut r, size)),
    ];
    let variants = [
        ("lz4", Compression::Lz4, Filter::None),
        ("zstd-1", Compression::Zstd { level: 1 }, Filter::None),
        (
            "lz4-shuffle",
            Compression::Lz4,
            Filter::Shuffle { width: 2 },
        ),
        (
            "zstd-1-shuffle",
            Compression::Zstd { level: 1 },
            Filter::Shuffle { width: 2 },
        ),
    ];
    let reps = reps(ctx.scale());
    for (name, raw) in &data {
        for (variant, c, f) in variants {
            ctx.step(format!("{SUITE}: compress {name} {variant}"));
            let stored = encode_block(raw, c, f)?;
            let ratio = raw.len() as f64 / stored.len() as f64;
            let mut enc = time_host(1, reps, || encode_block(raw, c, f).map(drop))?;
            ctx.record_bytes(
                &format!("compress-{name}"),
                size as u64,
                variant,
                &mut enc,
                raw.len() as f64,
                None,
            )?
            .extra
            .insert("ratio".into(), ratio.into());
            let mut dec = time_host(1, reps, || {
                let back = decode_block(&stored, name)?;
                match back.len() == raw.len() {
                    true => Ok(()),
                    false => Err(Error::Corrupt {
                        key: name.to_string(),
                        detail: "decoded to another length".into(),
                    }),
                }
            })?;
            ctx.record_bytes(
                &format!("decompress-{name}"),
                size as u64,
                variant,
                &mut dec,
                raw.len() as f64,
                None,
            )?
            .extra
            .insert("ratio".into(), ratio.into());
        }
    }
    Ok(())
}

/// The block sizes of the disk and migration cases.
fn block_sizes(scale: Scale) -> &'static [usize] {
    match scale {
        Scale::Full => &[64 * KIB, 4 * MIB, 64 * MIB],
        Scale::Quick => &[64 * KIB, 4 * MIB],
        Scale::Tiny => &[64 * KIB],
    }
}

/// The engines the disk cases run on: the thread pool, and io_uring where this kernel sets a
/// ring up (at the store's default queue depth).
fn disk_engines() -> Vec<Io> {
    let mut ios = vec![Io::threads()];
    let ring = DiskIo {
        engine: IoEngine::Uring,
        queue_depth: QUEUE_DEPTH,
    };
    match ring.resolve() {
        Ok(io) => ios.push(io),
        Err(e) => tracing::warn!("{SUITE}: no io_uring disk rows: {e}"),
    }
    ios
}

/// A variant's name on `io`'s engine: the thread pool's keeps the name it had before there
/// were two engines (`raw-odirect`, `warpdrive`), io_uring's adds `-uring`.
fn on_engine(variant: &str, io: Io) -> String {
    match io.engine {
        Engine::Threads => variant.to_string(),
        Engine::Uring => match variant.split_once('-') {
            Some(("warpdrive", rest)) => format!("warpdrive-uring-{rest}"),
            _ => format!("{variant}-uring"),
        },
    }
}

fn disk_cases(ctx: &mut Ctx) -> Result<()> {
    let sizes = match ctx.options().tier_disk_sizes.as_slice() {
        [] => block_sizes(ctx.scale()).to_vec(),
        chosen => chosen.to_vec(),
    };
    let reps = reps(ctx.scale());
    let dir = std::env::temp_dir().join(format!("warpdrive-bench-disk-{}", std::process::id()));
    let stream = ctx.stream().clone();
    let engines = disk_engines();
    let result = (|| -> Result<()> {
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        for &size in &sizes {
            let mut r = SmallRng::seed_from_u64(size as u64 ^ 0xd15c);
            let block = bf16_bytes(&mut r, size, false);
            // Per engine, raw: one file, aligned buffers, offsets one block apart, at the
            // queue depth the store gives a block of this size; the store: disk only, no
            // compression. All alternate round by round (`time_host_rounds`): this disk's
            // speed depends on what ran just before, so timing one after the other compared
            // two states of the disk (bench/NOTES.md, tier store at 67f5c67).
            let depth = queue_depth(size);
            ctx.step(format!(
                "{SUITE}: disk raw O_DIRECT and the store at {size} B on {}",
                engines
                    .iter()
                    .map(|io| io.engine.name())
                    .collect::<Vec<_>>()
                    .join(" and ")
            ));
            let mut raws = Vec::new();
            let mut stores = Vec::new();
            for io in &engines {
                let raw_path = dir.join(format!("raw-{size}-{}", io.engine.name()));
                let file = DirectFile::open_with(&raw_path, *io)?;
                let mut buf = AlignedBuf::new(size)?;
                buf.as_mut_slice()[..size].copy_from_slice(&block);
                raws.push((raw_path, file, buf));
                let mut config = TierConfig::new(0, 0);
                config.disk_compression = Compression::None;
                config.prefetch = Prefetch::Off;
                config.disk_io = DiskIo {
                    engine: match io.engine {
                        Engine::Uring => IoEngine::Uring,
                        Engine::Threads => IoEngine::Threads,
                    },
                    queue_depth: io.queue_depth,
                };
                let name = format!("store-{size}-{}", io.engine.name());
                stores.push(TierStore::open(dir.join(name), config, &stream)?);
            }
            let stride = raws[0].2.as_slice().len() as u64;
            let n = engines.len();
            // The same bytes in a `Vec` at an address that is a multiple of 512 B but not of
            // 4 KiB: in place where the file's direct-I/O memory alignment (`statx`
            // `STATX_DIOALIGN`) is 512 B or less (a virtio disk; NVMe reports 4 B), else bounced.
            let mut held = vec![0u8; size + 8192];
            let skip = to_512_not_4096(held.as_ptr() as usize);
            held[skip..skip + size].copy_from_slice(&block);
            let mut held_out = vec![0x5au8; size + 8192];
            let skip_out = to_512_not_4096(held_out.as_ptr() as usize);
            // Variant 4e: engine e's raw loop, 4e + 1: its store from the Vec, 4e + 2: from
            // the raw loop's aligned buffer, 4e + 3: from the 512 B-aligned `Vec` slice.
            let (mut written_raw, mut written_ours) = (vec![0u64; n], vec![0u64; n]);
            let mut written_aligned = vec![0u64; n];
            let mut written_512 = vec![0u64; n];
            let mut write_stages = Stages::new(4 * n);
            let writes = time_host_rounds(1, reps, 4 * n, |v| {
                let e = v / 4;
                write_stages.time(v, || match v % 4 {
                    0 => {
                        written_raw[e] += 1;
                        let (_, file, buf) = &raws[e];
                        file.write_at_depth(buf, written_raw[e] * stride, depth)
                    }
                    1 => {
                        written_ours[e] += 1;
                        let key = format!("b{}", written_ours[e]);
                        stores[e].put(&key, &block, Durability::Disk)
                    }
                    2 => {
                        written_aligned[e] += 1;
                        let key = format!("a{}", written_aligned[e]);
                        let aligned = raws[e].2.as_slice().get(..size).unwrap_or_default();
                        stores[e].put(&key, aligned, Durability::Disk)
                    }
                    _ => {
                        written_512[e] += 1;
                        let key = format!("m{}", written_512[e]);
                        stores[e].put(&key, &held[skip..skip + size], Durability::Disk)
                    }
                })
            })?;
            // The caller's buffer of `get_host_into`, reused as the raw loop reuses its own.
            let mut into = vec![0x5au8; size];
            let mut into_aligned = AlignedBuf::new(size)?;
            // Variant 5e: engine e's raw loop, 5e + 1: `get_host`, 5e + 2: `get_host_into`,
            // 5e + 3: `get_host_into` aligned memory, 5e + 4: into the 512 B-aligned slice.
            let mut next = vec![[0u64; 5]; n];
            let mut read_stages = Stages::new(5 * n);
            let reads = time_host_rounds(1, reps, 5 * n, |v| {
                let (e, which) = (v / 5, v % 5);
                let count = match which {
                    0 => written_raw[e],
                    3 => written_aligned[e],
                    4 => written_512[e],
                    _ => written_ours[e],
                };
                let at = &mut next[e][which];
                *at = *at % count.max(1) + 1;
                read_stages.time(v, || match which {
                    0 => {
                        let (_, file, buf) = &mut raws[e];
                        file.read_at_depth(buf, *at * stride, depth).map(drop)
                    }
                    1 => stores[e].get_host(&format!("b{at}")).map(drop),
                    2 => stores[e].get_host_into(&format!("b{at}"), &mut into),
                    3 => {
                        let out = into_aligned.as_mut_slice().get_mut(..size);
                        stores[e].get_host_into(&format!("a{at}"), out.unwrap_or_default())
                    }
                    _ => {
                        let out = &mut held_out[skip_out..skip_out + size];
                        stores[e].get_host_into(&format!("m{at}"), out)
                    }
                })
            })?;
            let direct: Vec<bool> = raws.iter().map(|(_, f, _)| f.is_direct()).collect();
            drop(stores);
            for (path, file, _) in raws {
                drop(file);
                let _ = std::fs::remove_file(&path);
            }
            let mut writes = writes.into_iter();
            let mut reads = reads.into_iter();
            for (e, io) in engines.iter().enumerate() {
                let missing = || Error::InvalidArgument("disk cases: a variant missing".into());
                let take = |it: &mut std::vec::IntoIter<Vec<f64>>| it.next().ok_or_else(missing);
                let (mut raw_w, mut ours_w, mut aligned_w, mut at512_w) = (
                    take(&mut writes)?,
                    take(&mut writes)?,
                    take(&mut writes)?,
                    take(&mut writes)?,
                );
                let (mut raw_r, mut ours_r, mut into_r, mut aligned_r, mut at512_r) = (
                    take(&mut reads)?,
                    take(&mut reads)?,
                    take(&mut reads)?,
                    take(&mut reads)?,
                    take(&mut reads)?,
                );
                let (w, r) = (4 * e, 5 * e);
                for (case, raw, ours, stages) in [
                    (
                        "disk-write",
                        &mut raw_w,
                        vec![
                            ("warpdrive", &mut ours_w),
                            ("warpdrive-aligned", &mut aligned_w),
                            ("warpdrive-512", &mut at512_w),
                        ],
                        (w..w + 4)
                            .map(|v| write_stages.medians(v))
                            .collect::<Vec<_>>(),
                    ),
                    (
                        "disk-read",
                        &mut raw_r,
                        vec![
                            ("warpdrive", &mut ours_r),
                            ("warpdrive-into", &mut into_r),
                            ("warpdrive-into-aligned", &mut aligned_r),
                            ("warpdrive-into-512", &mut at512_r),
                        ],
                        (r..r + 5)
                            .map(|v| read_stages.medians(v))
                            .collect::<Vec<_>>(),
                    ),
                ] {
                    let mut stages = stages.into_iter();
                    let variant = on_engine("raw-odirect", *io);
                    let raw_row =
                        ctx.record_bytes(case, size as u64, &variant, raw, size as f64, None)?;
                    let raw_gbps = raw_row.gbps;
                    disk_extras(raw_row, *io, direct[e], depth);
                    if let Some(Some(st)) = stages.next() {
                        raw_row.extra.insert("stages_us".into(), st);
                    }
                    for (variant, times) in ours {
                        let variant = on_engine(variant, *io);
                        let row = ctx.record_bytes(
                            case,
                            size as u64,
                            &variant,
                            times,
                            size as f64,
                            None,
                        )?;
                        disk_extras(row, *io, direct[e], depth);
                        if let Some(Some(st)) = stages.next() {
                            row.extra.insert("stages_us".into(), st);
                        }
                        if let (Some(a), Some(b)) = (row.gbps, raw_gbps) {
                            row.extra
                                .insert("pct_of_raw".into(), (100.0 * a / b).into());
                        }
                    }
                }
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Per disk variant, each stage's times (µs) between the store's stage marks
/// ([`stamp`], on in a build with warpdrive's `tier-stamps` feature; nothing without it): a
/// row's `extra.stages_us` then holds each stage's median over every run of the variant
/// (warm-ups included), named by the mark that ends it (`rest` runs from the last mark to the
/// op's return; a raw row has only `rest`).
struct Stages(Vec<Vec<(&'static str, Vec<f64>)>>);

impl Stages {
    fn new(variants: usize) -> Stages {
        Stages(vec![Vec::new(); variants])
    }

    /// Runs `op`, variant `v`'s, keeping the times between its marks.
    fn time<R>(&mut self, v: usize, op: impl FnOnce() -> R) -> R {
        if !stamp::ON {
            return op();
        }
        let _ = stamp::take();
        stamp::mark("start");
        let r = op();
        stamp::mark("rest");
        if let Some(stages) = self.0.get_mut(v) {
            for w in stamp::take().windows(2) {
                let us = (w[1].1 - w[0].1).as_secs_f64() * 1e6;
                match stages.iter_mut().find(|(name, _)| *name == w[1].0) {
                    Some((_, times)) => times.push(us),
                    None => stages.push((w[1].0, vec![us])),
                }
            }
        }
        r
    }

    /// Variant `v`'s median per stage.
    fn medians(&self, v: usize) -> Option<serde_json::Value> {
        let stages = self.0.get(v).filter(|s| !s.is_empty())?;
        let map = stages
            .iter()
            .map(|(name, times)| {
                let mut t = times.clone();
                t.sort_by(f64::total_cmp);
                let median = t.get(t.len() / 2).copied().unwrap_or(0.0);
                (name.to_string(), ((median * 100.0).round() / 100.0).into())
            })
            .collect();
        Some(serde_json::Value::Object(map))
    }
}

/// Bytes from `addr` to the next address that is a multiple of 512 but not of 4096.
fn to_512_not_4096(addr: usize) -> usize {
    (0..8192)
        .find(|s| (addr + s).is_multiple_of(512) && !(addr + s).is_multiple_of(4096))
        .unwrap_or(0)
}

/// What every disk row carries: the engine, its depth, whether `O_DIRECT` was taken and the
/// depth the store gives the block (1, or pieces in flight).
fn disk_extras(row: &mut Row, io: Io, direct: bool, depth: usize) {
    row.extra.insert("engine".into(), io.engine.name().into());
    row.extra
        .insert("engine_queue_depth".into(), io.queue_depth.into());
    row.extra.insert("direct".into(), direct.into());
    row.extra.insert("queue_depth".into(), depth.into());
}

fn prefetch_cases(ctx: &mut Ctx) -> Result<()> {
    const BLOCKS: usize = 256;
    const BLOCK: usize = 4 * KIB;
    let gets = match ctx.scale() {
        Scale::Full => 4000,
        Scale::Quick => 1000,
        Scale::Tiny => 200,
    };
    let mut r = SmallRng::seed_from_u64(0xfe7c);
    let mut mixed = Vec::with_capacity(gets);
    while mixed.len() < gets {
        let start = r.random_range(0..BLOCKS);
        mixed.extend((start..start + 8).map(|i| i % BLOCKS));
    }
    mixed.truncate(gets);
    let traces: [(&str, Vec<usize>); 4] = [
        ("sequential", (0..gets).map(|i| i % BLOCKS).collect()),
        ("strided", (0..gets).map(|i| (3 * i) % BLOCKS).collect()),
        (
            "random",
            (0..gets).map(|_| r.random_range(0..BLOCKS)).collect(),
        ),
        ("mixed", mixed),
    ];
    let stream = ctx.stream().clone();
    let data = bf16_bytes(&mut r, BLOCK, false);
    for (name, trace) in &traces {
        for (variant, prefetch) in [
            ("warpdrive", Prefetch::Auto { distance: 4 }),
            ("lru", Prefetch::Off),
        ] {
            ctx.step(format!("{SUITE}: prefetch {name} {variant}"));
            let mut config = TierConfig::new((BLOCKS * BLOCK / 4) as u64, 0);
            config.prefetch = prefetch;
            let store = TierStore::open_on(Arc::new(SimDisk::new()), "/bench", config, &stream)?;
            for i in 0..BLOCKS {
                let key = format!("blk-{i:04}");
                store.put(&key, &data, Durability::Disk)?;
                store.migrate(&key, Tier::Disk)?;
            }
            let before = store.stats().gpu_hits;
            let mut t = Vec::with_capacity(trace.len());
            for &i in trace {
                let start = Instant::now();
                store.get_host(&format!("blk-{i:04}"))?;
                t.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let hit_rate = (store.stats().gpu_hits - before) as f64 / trace.len() as f64;
            ctx.record_time(
                &format!("prefetch-{name}"),
                trace.len() as u64,
                variant,
                &mut t,
                None,
            )?
            .extra
            .insert("hit_rate".into(), hit_rate.into());
        }
    }
    Ok(())
}

fn migrate_cases(ctx: &mut Ctx) -> Result<()> {
    let sizes = block_sizes(ctx.scale());
    let gpu = !ctx.device().is_host_memory();
    let pairs: Vec<(Tier, Tier)> = [
        (Tier::Gpu, Tier::Host),
        (Tier::Host, Tier::Gpu),
        (Tier::Host, Tier::Disk),
        (Tier::Disk, Tier::Host),
        (Tier::Disk, Tier::Gpu),
        (Tier::Gpu, Tier::Disk),
    ]
    .into_iter()
    .filter(|(a, b)| gpu || (*a != Tier::Gpu && *b != Tier::Gpu))
    .collect();
    let dir = std::env::temp_dir().join(format!("warpdrive-bench-tier-{}", std::process::id()));
    let stream = ctx.stream().clone();
    let reps = reps(ctx.scale());
    // Between GPU and host a hop takes microseconds: enough of them for a real p99.
    let memory_reps = reps * 20 / 3;
    let result = (|| -> Result<()> {
        for &size in sizes {
            let budget = (4 * size) as u64;
            let mut config = TierConfig::new(if gpu { budget } else { 0 }, budget);
            config.disk_compression = Compression::None;
            let store = TierStore::open(&dir, config, &stream)?;
            let mut r = SmallRng::seed_from_u64(size as u64);
            let block = bf16_bytes(&mut r, size, false);
            for &(from, to) in &pairs {
                let case = format!("migrate-{}-{}", from.name(), to.name());
                ctx.step(format!("{SUITE}: {case} at {size} B"));
                let key = format!("{case}-{size}");
                store.put(&key, &block, Durability::Disk)?;
                let before = store.stats().moves.pair(from, to);
                let reps = if from == Tier::Disk || to == Tier::Disk {
                    reps
                } else {
                    memory_reps
                };
                let mut t = Vec::with_capacity(reps);
                // GPU <-> host: the driver's own copy between a device buffer and a pinned one,
                // timed the same way in the same iterations, is the hop's ceiling for its p99.
                let mut raw = match (from, to) {
                    (Tier::Gpu, Tier::Host) | (Tier::Host, Tier::Gpu) => Some((
                        Buffer::<u8>::from_host(&stream, &block)?,
                        PinnedBuf::<u8>::from_slice(stream.device(), &block)?,
                        Vec::with_capacity(reps),
                    )),
                    _ => None,
                };
                for i in 0..=reps {
                    if to == Tier::Disk {
                        // A write each time: the block must not be on disk already.
                        store.remove(&key)?;
                        store.put(&key, &block, Durability::Memory)?;
                    }
                    store.migrate(&key, from)?;
                    stream.synchronize()?;
                    let start = Instant::now();
                    store.migrate(&key, to)?;
                    stream.synchronize()?;
                    if i > 0 {
                        t.push(start.elapsed().as_secs_f64() * 1e6);
                    }
                    if let Some((dev, pinned, raw_t)) = raw.as_mut() {
                        let start = Instant::now();
                        if to == Tier::Host {
                            dev.copy_to_pinned(&stream, pinned)?;
                        } else {
                            dev.copy_from_pinned(&stream, pinned)?;
                        }
                        stream.synchronize()?;
                        if i > 0 {
                            raw_t.push(start.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                }
                if let Some((_, _, mut raw_t)) = raw {
                    let p99 = percentile(&raw_t, 0.99);
                    let row = ctx.record_bytes(
                        &case,
                        size as u64,
                        "driver-pinned",
                        &mut raw_t,
                        size as f64,
                        None,
                    )?;
                    row.extra.insert("p99_us".into(), p99.into());
                }
                let p99 = percentile(&t, 0.99);
                let after = store.stats().moves.pair(from, to);
                let blocks = after.blocks.saturating_sub(before.blocks);
                let nanos = after.nanos.saturating_sub(before.nanos);
                let extra = &mut ctx
                    .record_bytes(&case, size as u64, "warpdrive", &mut t, size as f64, None)?
                    .extra;
                extra.insert("p99_us".into(), p99.into());
                extra.insert("store_blocks".into(), blocks.into());
                let store_us = nanos as f64 / 1e3 / blocks.max(1) as f64;
                extra.insert("store_us".into(), store_us.into());
                store.remove(&key)?;
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_run_on_the_cpu_records_codec_and_migration_rows() {
        let mut ctx = Ctx::new(&warpdrive::Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let cases: Vec<&str> = ctx.rows().iter().map(|r| r.case.as_str()).collect();
        for want in [
            "compress-bf16-weights",
            "decompress-text",
            "migrate-host-disk",
            "migrate-disk-host",
            "disk-write",
            "disk-read",
            "prefetch-mixed",
        ] {
            assert!(cases.contains(&want), "{want} missing: {cases:?}");
        }
        assert!(
            !cases.iter().any(|c| c.contains("gpu")),
            "no GPU pairs on the CPU"
        );
        // Each migration row carries the store's own count of that hop.
        for row in ctx.rows().iter().filter(|r| r.case.starts_with("migrate-")) {
            let blocks = row.extra["store_blocks"].as_u64().unwrap();
            assert_eq!(blocks as usize, reps(Scale::Tiny) + 1, "{}", row.case);
        }
        // Every disk row names its engine; io_uring's rows are there wherever it is offered.
        let ring_here = DiskIo {
            engine: IoEngine::Uring,
            queue_depth: QUEUE_DEPTH,
        }
        .resolve()
        .is_ok();
        for case in ["disk-write", "disk-read"] {
            let variants: Vec<(&str, &str)> = ctx
                .rows()
                .iter()
                .filter(|r| r.case == case)
                .map(|r| (r.variant.as_str(), r.extra["engine"].as_str().unwrap()))
                .collect();
            assert!(
                variants.contains(&("raw-odirect", "threads")),
                "{variants:?}"
            );
            assert!(variants.contains(&("warpdrive", "threads")), "{variants:?}");
            assert_eq!(
                variants.contains(&("raw-odirect-uring", "uring")),
                ring_here,
                "{variants:?}"
            );
            assert_eq!(
                variants.contains(&("warpdrive-uring", "uring")),
                ring_here,
                "{variants:?}"
            );
        }
        // The aligned caller's rows, moved in place.
        for (case, variant) in [
            ("disk-write", "warpdrive-aligned"),
            ("disk-read", "warpdrive-into-aligned"),
        ] {
            let here = ctx
                .rows()
                .iter()
                .any(|r| r.case == case && r.variant == variant);
            assert!(here, "{case} {variant}");
        }
        assert_eq!(
            ctx.rows()
                .iter()
                .any(|r| r.case == "disk-read" && r.variant == "warpdrive-uring-into"),
            ring_here
        );
        let shuffled = ctx
            .rows()
            .iter()
            .find(|r| r.case == "compress-bf16-weights" && r.variant == "zstd-1-shuffle")
            .unwrap();
        let ratio = shuffled.extra["ratio"].as_f64().unwrap();
        assert!(ratio > 1.0, "shuffled bf16 compresses: {ratio}");
    }
}
