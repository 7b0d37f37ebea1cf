//! Opening a store: the index log replayed and checked against the data segments on disk
//! (entries past their segment's end dropped, leftover compaction output and segments
//! nothing points at removed), and the segments' names.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::device::Stream;
use crate::error::Result;

use super::super::disk::{Disk, OsDisk};
use super::super::log::IndexLog;
use super::super::policy::Clock;
use super::{Inner, TierConfig, TierStats, TierStore};

pub(super) fn segment_name(n: u64) -> String {
    format!("data-{n}.seg")
}

/// A data segment while a compaction writes it, before it is renamed to [`segment_name`].
pub(super) fn temp_segment_name(n: u64) -> String {
    format!("data-{n}.seg.tmp")
}

pub(super) fn is_temp_segment(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("data-") && n.ends_with(".seg.tmp"))
}

pub(super) fn segment_number(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("data-")?
        .strip_suffix(".seg")?
        .parse()
        .ok()
}

impl TierStore {
    /// Opens (or creates) the store in `dir` on the operating system's files; blocks in
    /// memory tiers live on `stream`'s device and its pinned pool.
    /// The disk's direct I/O runs on the engine `config.disk_io` resolves to here
    /// ([`io`](Self::io) says which).
    pub fn open(dir: impl AsRef<Path>, config: TierConfig, stream: &Stream) -> Result<TierStore> {
        let disk = OsDisk::with_io(config.disk_io)?;
        TierStore::open_on(Arc::new(disk), dir, config, stream)
    }

    /// [`open`](Self::open) on any [`Disk`] (a simulated one in crash tests).
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: impl AsRef<Path>,
        config: TierConfig,
        stream: &Stream,
    ) -> Result<TierStore> {
        config.gpu.check("gpu")?;
        config.host.check("host")?;
        if let Some(io) = disk.io() {
            tracing::debug!(
                engine = io.engine.name(),
                depth = io.queue_depth,
                "tier disk I/O"
            );
            metrics::gauge!("warpdrive_tier_io_queue_depth", "engine" => io.engine.name())
                .set(io.queue_depth as f64);
        }
        let dir = dir.as_ref().to_path_buf();
        disk.create_dir_all(&dir)?;
        let (log, mut index) = IndexLog::open(disk.clone(), &dir)?;
        let mut last = 0u64;
        let mut lens = HashMap::new();
        // A compaction's output not renamed yet: nothing points at it.
        for path in disk.list(&dir)? {
            if is_temp_segment(&path) {
                tracing::warn!(path = %path.display(), "discarding an interrupted compaction's segment");
                disk.remove(&path)?;
            }
        }
        for path in disk.list(&dir)? {
            if let Some(n) = segment_number(&path) {
                last = last.max(n);
                lens.insert(n, disk.len(&path)?.unwrap_or(0));
            }
        }
        // Entries whose bytes never reached their segment (a crash before the data sync).
        index.retain(|_, at| {
            lens.get(&at.segment)
                .is_some_and(|&len| at.offset.saturating_add(at.len) <= len)
        });
        let mut segments: HashMap<u64, (u64, u64)> =
            lens.iter().map(|(&n, &len)| (n, (0, len))).collect();
        for at in index.values() {
            if let Some(s) = segments.get_mut(&at.segment) {
                s.0 += at.len;
            }
        }
        // Segments nothing points at (emptied by a compaction that crashed before removing
        // them, or by removes) go now.
        for (&n, &(live, _)) in &segments {
            if live == 0 {
                disk.remove(&dir.join(segment_name(n)))?;
            }
        }
        segments.retain(|_, s| s.0 > 0);
        Ok(TierStore {
            stream: stream.clone(),
            disk,
            dir,
            config,
            inner: Mutex::new(Inner {
                gpu: Clock::new(config.gpu),
                gpu_blocks: HashMap::new(),
                host: Clock::new(config.host),
                host_blocks: HashMap::new(),
                index,
                log,
                segment: last + 1,
                segment_named: false,
                stats: TierStats::default(),
                detectors: Vec::new(),
                prefetched: Default::default(),
                segments,
            }),
        })
    }
}
