//! Opening a store: the index log replayed and checked against the data segments on disk
//! (entries past their segment's end dropped, leftover compaction output and segments
//! nothing points at removed), and the segments' names.
//!
//! A block has no header of its own on disk to tell a whole block from a half-written one:
//! its index record is that mark. The record is appended only once the block's write has
//! returned (and, for a `Sync` put, once the segment is synced), so a half-written block has
//! no record and its bytes are dead space; a record whose bytes lie past the segment's end
//! is dropped here; and any record whose bytes did not all survive is caught by the checksum
//! the record holds on the first read (`Error::Corrupt` naming the key, never the data).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::device::Stream;
use crate::error::{Error, Result};

use super::super::disk::{Disk, OsDisk};
use super::super::log::IndexLog;
use super::super::policy::Clock;
use super::{folders, Inner, SegmentUse, TierConfig, TierStats, TierStore};

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

/// The file naming a configured disk folder's position in its store's list: a folder swapped
/// with another, or an empty mount point where a disk should be, is refused rather than read
/// as a folder whose blocks were lost.
const FOLDER_MARK: &str = "tier-folder.mark";

fn mark_text(position: usize) -> String {
    format!("warpdrive tier store disk folder #{position}\n")
}

/// Checks `dir`'s mark says `position`; writes it (whole, by rename) where the folder has none
/// and holds none of the index's blocks.
fn check_mark(disk: &dyn Disk, dir: &Path, position: usize, holds_blocks: bool) -> Result<()> {
    let mark = dir.join(FOLDER_MARK);
    let want = mark_text(position);
    let refuse = |detail: String| Error::Io {
        path: dir.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, detail),
    };
    match disk.len(&mark)? {
        Some(_) => {
            let got = disk.read_all(&mark)?;
            if got != want.as_bytes() {
                return Err(refuse(format!(
                    "this disk folder's mark reads {:?}, the config lists it as #{position} \
                     (folders are named by their position: keep the order)",
                    String::from_utf8_lossy(&got).trim_end()
                )));
            }
            Ok(())
        }
        None if holds_blocks => Err(refuse(
            "the tier store's index has blocks in this disk folder but it has no mark: \
             missing, not mounted, or another folder"
                .into(),
        )),
        None => {
            let tmp = dir.join(format!("{FOLDER_MARK}.tmp"));
            disk.write_new(&tmp, want.as_bytes())?;
            disk.sync(&tmp)?;
            disk.rename(&tmp, &mark)?;
            disk.sync_dir(dir)
        }
    }
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
        let folders = folders::resolve(&dir, &config.disk_folders)?;
        disk.create_dir_all(&dir)?;
        let (log, mut index) = IndexLog::open(disk.clone(), &dir)?;
        if let Some(at) = index
            .values()
            .find(|at| at.folder as usize >= folders.len())
        {
            return Err(Error::InvalidArgument(format!(
                "tier store {}: the index has blocks in disk folder #{} but the config lists {} \
                 (folders are named by their position: keep the order, append new ones)",
                dir.display(),
                at.folder,
                folders.len()
            )));
        }
        let mut last = 0u64;
        let mut lens = HashMap::new();
        for (f, folder) in folders.iter().enumerate() {
            let path = &folder.path;
            let holds_blocks = index.values().any(|at| at.folder as usize == f);
            // A folder the index has blocks in must be there: creating it empty would drop
            // them without a word.
            if !holds_blocks {
                disk.create_dir_all(path)?;
            }
            let listed = disk.list(path).map_err(|e| Error::Io {
                path: path.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("a disk folder the tier store's index has blocks in: {e}"),
                ),
            })?;
            if !config.disk_folders.is_empty() {
                check_mark(disk.as_ref(), path, f, holds_blocks)?;
            }
            for file in listed {
                // A compaction's output not renamed yet: nothing points at it.
                if is_temp_segment(&file) {
                    tracing::warn!(path = %file.display(), "discarding an interrupted compaction's segment");
                    disk.remove(&file)?;
                } else if let Some(n) = segment_number(&file) {
                    last = last.max(n);
                    lens.insert((f as u32, n), disk.len(&file)?.unwrap_or(0));
                }
            }
        }
        // Entries whose bytes never reached their segment (a crash before the data sync).
        index.retain(|_, at| {
            lens.get(&(at.folder, at.segment))
                .is_some_and(|&len| at.offset.saturating_add(at.len) <= len)
        });
        let mut segments: HashMap<(u32, u64), SegmentUse> = lens
            .iter()
            .map(|(&at, &total)| {
                let use_ = SegmentUse {
                    total,
                    ..SegmentUse::default()
                };
                (at, use_)
            })
            .collect();
        for at in index.values() {
            if let Some(s) = segments.get_mut(&(at.folder, at.segment)) {
                s.live += at.len;
                s.charged = s
                    .charged
                    .saturating_add(folders::charge(at, folders[at.folder as usize].page));
            }
        }
        // Dead blocks still take their bytes: charged at least the file's length.
        for (&(f, _), s) in segments.iter_mut() {
            let page = folders[f as usize].page;
            let file = folders::in_pages(s.total, page).unwrap_or(u64::MAX);
            s.charged = s.charged.max(file);
        }
        // Segments nothing points at (emptied by a compaction that crashed before removing
        // them, or by removes) go now.
        for (&(f, n), s) in &segments {
            if s.live == 0 {
                disk.remove(&folders[f as usize].path.join(segment_name(n)))?;
            }
        }
        segments.retain(|_, s| s.live > 0);
        let first_new = last
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("tier store: segment numbers ran out".into()))?;
        // One fresh segment per folder, numbered on from the last one on disk.
        let current: Vec<u64> = (0..folders.len() as u64)
            .map(|i| first_new.saturating_add(i))
            .collect();
        let next_segment = first_new.saturating_add(folders.len() as u64);
        Ok(TierStore {
            stream: stream.clone(),
            disk,
            dir,
            folders,
            config: config.clone(),
            inner: Mutex::new(Inner {
                gpu: Clock::new(config.gpu),
                gpu_blocks: HashMap::new(),
                host: Clock::new(config.host),
                host_blocks: HashMap::new(),
                index,
                log,
                named: vec![false; current.len()],
                current,
                next_segment,
                stats: TierStats::default(),
                detectors: Vec::new(),
                prefetched: Default::default(),
                segments,
            }),
        })
    }
}
