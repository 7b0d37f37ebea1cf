//! Compaction: mostly dead data segments rewritten into a new one that appears only by
//! rename, then the index log compacted when mostly dead.

use crate::error::{Error, Result};

use super::super::codec;
use super::super::disk::pad_to_align;
use super::super::log::{Location, Record};
use super::open::{segment_name, temp_segment_name};
use super::{folders, Inner, TierStore, LOG_COMPACT_RECORDS, SEGMENT_LIVE_MIN};

impl TierStore {
    /// Rewrites the closed data segments that are mostly dead (live blocks under half their
    /// bytes) into one new segment and removes them, then compacts the index log when most
    /// of its records are dead; returns the disk bytes freed.
    ///
    /// Crash-safe: the new segment is written under a temporary name, synced, renamed and its
    /// folder synced before any index record points at it; those records are synced before
    /// an old segment is removed. A reopen removes a leftover temporary segment and segments
    /// nothing points at, so a crash anywhere leaves every block where the index says. New
    /// puts go to a fresh segment after it (the one they were appended to is closed).
    pub fn compact(&self) -> Result<u64> {
        let mut g = self.inner.lock();
        let mut freed = 0u64;
        for folder in 0..self.folders.len() as u32 {
            freed += self.compact_folder(&mut g, folder)?;
        }
        let live = g.index.len();
        if g.log.records() >= LOG_COMPACT_RECORDS && g.log.dead_ratio(live) > 0.5 {
            let index = g.index.clone();
            g.log.compact(&index)?;
        }
        Ok(freed)
    }

    /// [`compact`](Self::compact)'s segments in one disk folder, rewritten in that folder.
    fn compact_folder(&self, g: &mut Inner, folder: u32) -> Result<u64> {
        let (dir, page) = match self.folders.get(folder as usize) {
            Some(d) => (&d.path, d.page),
            None => return Ok(0),
        };
        let current = g.current[folder as usize];
        let mut sparse: Vec<u64> = g
            .segments
            .iter()
            .filter(|(&(f, n), s)| {
                f == folder && n != current && (s.live as f64) < SEGMENT_LIVE_MIN * s.total as f64
            })
            .map(|(&(_, n), _)| n)
            .collect();
        sparse.sort_unstable();
        let mut freed = 0u64;
        if !sparse.is_empty() {
            let out = g.next_segment;
            let after = out.checked_add(2).ok_or_else(|| {
                Error::InvalidArgument("tier store: segment numbers ran out".into())
            })?;
            let tmp = dir.join(temp_segment_name(out));
            let to = dir.join(segment_name(out));
            let moving: Vec<(String, Location)> = g
                .index
                .iter()
                .filter(|(_, at)| at.folder == folder && sparse.contains(&at.segment))
                .map(|(k, at)| (k.clone(), *at))
                .collect();
            let mut moved = Vec::with_capacity(moving.len());
            let written = (|| -> Result<()> {
                for (key, at) in &moving {
                    let len = usize::try_from(at.len).map_err(|_| Error::Corrupt {
                        key: key.clone(),
                        detail: format!("a block of {} bytes", at.len),
                    })?;
                    let from = dir.join(segment_name(at.segment));
                    let stored = self.disk.read_aligned(&from, at.offset, len)?;
                    // Verified before it moves: a corrupt block is not copied on as good. It
                    // moves as it is (an old block with its header, a bare one without).
                    match &at.head {
                        Some(head) => codec::decode_parts(head, &stored, key)?,
                        None => codec::decode_block(&stored, key)?,
                    };
                    let offset = self.disk.append_aligned(&tmp, &[&stored])?;
                    moved.push((
                        key.clone(),
                        Location {
                            folder,
                            segment: out,
                            offset,
                            len: at.len,
                            head: at.head,
                        },
                    ));
                }
                if !moved.is_empty() {
                    self.disk.sync(&tmp)?;
                    self.disk.rename(&tmp, &to)?;
                    self.disk.sync_dir(dir)?;
                }
                Ok(())
            })();
            if let Err(e) = written {
                // Nothing points at the temporary segment; a reopen would remove it too.
                let _ = self.disk.remove(&tmp);
                return Err(e);
            }
            // This folder's appends go to a fresh segment from now: `out` is closed.
            g.current[folder as usize] = out + 1;
            g.named[folder as usize] = false;
            g.next_segment = after;
            for (key, at) in moved {
                g.log.append(
                    &Record::Put {
                        key: key.clone(),
                        at,
                    },
                    false,
                )?;
                g.index.insert(key, at);
                let seg = g.segments.entry((folder, out)).or_default();
                seg.live += at.len;
                seg.total = at.offset + at.len + pad_to_align(at.len);
                seg.charged = seg.charged.saturating_add(folders::charge(&at, page));
            }
            g.log.sync()?;
            for n in sparse {
                let total = g.segments.remove(&(folder, n)).map_or(0, |s| s.total);
                self.disk.remove(&dir.join(segment_name(n)))?;
                freed += total;
            }
            self.disk.sync_dir(dir)?;
        }
        Ok(freed)
    }
}
