//! The tiered store's index: an append-only log of checksummed records, replayed on open
//! and compacted (rewritten with only the live entries) when mostly dead.
//!
//! `index.log` in the store's folder is a run of frames
//! `[payload length u32 LE][xxh3-64 of the payload u64 LE][payload]`; the payload is
//! `4u8, key length u16 LE, key (UTF-8), segment u64 LE, offset u64 LE, len u64 LE,
//! folder u32 LE, block header (32 bytes)` for a [`Record::Put`] whose block is stored bare
//! (the segment holds only its payload; the header — codec, lengths, the xxh3 that every
//! read verifies the payload against — is the record's, see [`Location::head`]), and
//! `2u8, key length u16 LE, key` for a [`Record::Remove`].
//!
//! Logs written before blocks were stored bare (the block's header in front of its payload
//! in the segment) hold `1u8` and `3u8` puts: `1u8, key length, key, segment, offset, len`
//! in the first disk folder, `3u8`, the same and `folder u32 LE` in another. They still
//! replay (as a location with no `head`) and such blocks are read as before.
//!
//! Replay stops at the first frame whose length runs past the end of the file, is out of
//! range, or whose checksum fails, and cuts the file there: that is the torn tail of a
//! write a crash interrupted. A damaged frame followed by good ones is treated the same
//! way, as the end of the log, and the frames after it are dropped too: past a damaged
//! length nothing says where the next frame starts, and replaying later records over a
//! lost one would not give any state the index ever had.
//!
//! Compaction writes the live entries to `index.log.tmp`, syncs it and renames it over
//! `index.log`; the rename is the commit point, so a crash anywhere in it leaves the old
//! log or the new one, each complete, and `open` discards a leftover `index.log.tmp`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use twox_hash::XxHash3_64;

use super::disk::Disk;
use crate::error::{Error, Result};

/// Where a block's stored bytes are on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    /// The disk folder holding the segment: its position in the store's list of folders
    /// (0, the only one, when the list is empty).
    #[serde(default)]
    pub folder: u32,
    /// The data segment file (`data-<segment>.seg` in that folder).
    pub segment: u64,
    /// Where the stored bytes start in the segment.
    pub offset: u64,
    /// Stored bytes in the segment (the payload alone where `head` is set).
    pub len: u64,
    /// The block's header ([`codec::HEADER_BYTES`](super::codec::HEADER_BYTES) bytes: codec,
    /// lengths and the checksum its payload is verified against), kept here rather than in
    /// front of the payload so that a block's extent is exactly its payload's pages (a
    /// 64 KiB block is 16 pages, not 17). `None`: a block an older store wrote with its
    /// header in the segment.
    #[serde(default)]
    pub head: Option<[u8; BLOCK_HEAD]>,
}

/// Bytes of a block header a [`Location`] carries.
pub const BLOCK_HEAD: usize = super::codec::HEADER_BYTES;

/// One change of the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    Put { key: String, at: Location },
    Remove { key: String },
}

/// The log's file in the store's folder.
pub const LOG_FILE: &str = "index.log";
/// The compacted log while it is written, before it is renamed onto [`LOG_FILE`].
pub const COMPACT_FILE: &str = "index.log.tmp";
/// The longest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 4096;

/// Payload length, then its checksum.
const FRAME_HEADER: usize = 4 + 8;
const TAG_PUT: u8 = 1;
const TAG_REMOVE: u8 = 2;
const TAG_PUT_IN: u8 = 3;
/// A put of a block stored bare: its header is in the record.
const TAG_PUT_BARE: u8 = 4;
/// Tag and key length; then the key, and for a put its location.
const MIN_PAYLOAD: usize = 1 + 2;
const MAX_PAYLOAD: usize = MIN_PAYLOAD + MAX_KEY_BYTES + 3 * 8 + 4 + BLOCK_HEAD;
/// Appends without `sync` accumulate at most this much before the log syncs on its own,
/// which bounds the bytes kept to write again after a failed sync.
const SYNC_EVERY_BYTES: usize = 1 << 20;

/// The index log of one store folder. Not shared between threads: the store serialises
/// its calls (every method takes `&mut self`).
pub struct IndexLog {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    path: PathBuf,
    /// Bytes of whole frames written.
    end: u64,
    /// Records in the file.
    records: u64,
    /// Bytes known durable (the file's length at its last successful sync).
    synced_end: u64,
    /// The frames past `synced_end`, written again after a failed sync (whose pages the
    /// kernel may have dropped while reporting the error).
    pending: Vec<u8>,
    /// A failed append may have left part of a frame past `end`.
    tail_dirty: bool,
    /// A sync failed: `pending` must be written again before a sync can count.
    rewrite_pending: bool,
    /// The log's current name is durable in its folder.
    name_durable: bool,
}

impl std::fmt::Debug for IndexLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexLog")
            .field("path", &self.path)
            .field("bytes", &self.end)
            .field("records", &self.records)
            .finish_non_exhaustive()
    }
}

impl IndexLog {
    /// Opens the log in `dir` (creating the folder and an empty log when absent) and
    /// replays it: the index as of the last whole record. Cuts a torn or damaged tail off
    /// (with a warning), discards an interrupted compaction's `index.log.tmp`, and makes
    /// the folder's names durable.
    pub fn open(disk: Arc<dyn Disk>, dir: &Path) -> Result<(IndexLog, BTreeMap<String, Location>)> {
        disk.create_dir_all(dir)?;
        let path = dir.join(LOG_FILE);
        let tmp = dir.join(COMPACT_FILE);
        if disk.len(&tmp)?.is_some() {
            // Not renamed yet: the old log is whole and still the index.
            tracing::warn!(path = %tmp.display(), "discarding an interrupted index compaction");
            disk.remove(&tmp)?;
        }
        let (index, end, records) = match disk.len(&path)? {
            None => {
                disk.write_new(&path, &[])?;
                disk.sync(&path)?;
                (BTreeMap::new(), 0, 0)
            }
            Some(_) => {
                let bytes = disk.read_all(&path)?;
                let replay = replay(&bytes, &path)?;
                if let Some(why) = replay.stopped {
                    tracing::warn!(
                        path = %path.display(),
                        kept = replay.end,
                        dropped = bytes.len() as u64 - replay.end,
                        "index log ends in {why} (a write a crash cut short, or damage): \
                         dropping it and everything after it"
                    );
                    disk.truncate(&path, replay.end)?;
                    disk.sync(&path)?;
                }
                (replay.index, replay.end, replay.records)
            }
        };
        disk.sync_dir(dir)?;
        let log = IndexLog {
            disk,
            dir: dir.to_path_buf(),
            path,
            end,
            records,
            synced_end: end,
            pending: Vec::new(),
            tail_dirty: false,
            rewrite_pending: false,
            name_durable: true,
        };
        Ok((log, index))
    }

    /// Appends `record`; with `sync` it is durable when this returns `Ok`. Without, it is
    /// durable after a later [`sync`](Self::sync), or once 1 MiB of unsynced records has
    /// gathered (the log then syncs on its own). Keys longer than [`MAX_KEY_BYTES`] are
    /// refused. After an error (a full disk) the log stays usable:
    /// the next call first cuts off whatever part of the record reached the file.
    pub fn append(&mut self, record: &Record, sync: bool) -> Result<()> {
        let mut frame = Vec::new();
        match record {
            Record::Put { key, at } => encode_frame(&mut frame, key, Some(at))?,
            Record::Remove { key } => encode_frame(&mut frame, key, None)?,
        }
        self.repair()?;
        let offset = self.disk.append(&self.path, &frame).inspect_err(|_| {
            self.tail_dirty = true;
        })?;
        if offset != self.end {
            self.tail_dirty = true;
            return Err(Error::Corrupt {
                key: self.path.display().to_string(),
                detail: format!(
                    "the log was {offset} bytes long where it had written {}: changed by \
                     someone else",
                    self.end
                ),
            });
        }
        self.end += frame.len() as u64;
        self.records += 1;
        self.pending.extend_from_slice(&frame);
        if sync {
            self.sync()
        } else {
            if self.pending.len() >= SYNC_EVERY_BYTES {
                // The record is written; a failure here is retried by the next sync.
                if let Err(e) = self.sync() {
                    tracing::warn!(path = %self.path.display(), "index log sync failed: {e}");
                }
            }
            Ok(())
        }
    }

    /// Makes every record appended so far durable (a group commit after appends without
    /// `sync`).
    pub fn sync(&mut self) -> Result<()> {
        self.repair()?;
        if let Err(e) = self.disk.sync(&self.path) {
            self.rewrite_pending = true;
            return Err(e);
        }
        self.synced_end = self.end;
        self.pending.clear();
        if !self.name_durable {
            self.disk.sync_dir(&self.dir)?;
            self.name_durable = true;
        }
        Ok(())
    }

    /// Rewrites the log with one put per entry of `live` (the index as the store holds it)
    /// and puts it in place of the old one; durable when this returns `Ok`. On an error
    /// before the rename the old log stays in use, whole.
    pub fn compact(&mut self, live: &BTreeMap<String, Location>) -> Result<()> {
        let mut bytes = Vec::new();
        for (key, at) in live {
            encode_frame(&mut bytes, key, Some(at))?;
        }
        let tmp = self.dir.join(COMPACT_FILE);
        let written = self
            .disk
            .write_new(&tmp, &bytes)
            .and_then(|()| self.disk.sync(&tmp))
            .and_then(|()| self.disk.rename(&tmp, &self.path));
        if let Err(e) = written {
            let _ = self.disk.remove(&tmp);
            return Err(e);
        }
        self.end = bytes.len() as u64;
        self.records = live.len() as u64;
        self.synced_end = self.end;
        self.pending.clear();
        self.tail_dirty = false;
        self.rewrite_pending = false;
        // Until the folder is synced a power loss may bring the old file back; a failure
        // here is retried by the next sync.
        self.name_durable = false;
        self.disk.sync_dir(&self.dir)?;
        self.name_durable = true;
        Ok(())
    }

    /// Records in the log file, puts and removes, live or dead.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Bytes of the log file.
    pub fn bytes(&self) -> u64 {
        self.end
    }

    /// The share of the log's records that compaction would drop, given the `live` entries
    /// of the index: 0 for an empty log.
    pub fn dead_ratio(&self, live: usize) -> f64 {
        if self.records == 0 {
            return 0.0;
        }
        self.records.saturating_sub(live as u64) as f64 / self.records as f64
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Brings the file back to exactly the frames written: writes again the frames a
    /// failed sync left in doubt, or cuts off part of a frame a failed append left.
    fn repair(&mut self) -> Result<()> {
        if self.rewrite_pending {
            self.disk.truncate(&self.path, self.synced_end)?;
            let offset = self.disk.append(&self.path, &self.pending)?;
            if offset != self.synced_end {
                return Err(Error::Corrupt {
                    key: self.path.display().to_string(),
                    detail: format!("rewriting from byte {} landed at {offset}", self.synced_end),
                });
            }
            self.rewrite_pending = false;
            self.tail_dirty = false;
        } else if self.tail_dirty {
            self.disk.truncate(&self.path, self.end)?;
            self.tail_dirty = false;
        }
        Ok(())
    }
}

/// Appends the frame of one record to `out`.
fn encode_frame(out: &mut Vec<u8>, key: &str, at: Option<&Location>) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidArgument(format!(
            "a key of {} bytes: keys are at most {MAX_KEY_BYTES} bytes",
            key.len()
        )));
    }
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER]);
    out.push(match at {
        Some(at) if at.head.is_some() => TAG_PUT_BARE,
        Some(at) if at.folder > 0 => TAG_PUT_IN,
        Some(_) => TAG_PUT,
        None => TAG_REMOVE,
    });
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    if let Some(at) = at {
        for v in [at.segment, at.offset, at.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        if at.folder > 0 || at.head.is_some() {
            out.extend_from_slice(&at.folder.to_le_bytes());
        }
        if let Some(head) = &at.head {
            out.extend_from_slice(head);
        }
    }
    let payload = start + FRAME_HEADER;
    let len = (out.len() - payload) as u32; // at most MAX_PAYLOAD
    let sum = XxHash3_64::oneshot(&out[payload..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..payload].copy_from_slice(&sum.to_le_bytes());
    Ok(())
}

/// What replaying a log gives.
struct Replay {
    index: BTreeMap<String, Location>,
    /// Bytes of whole, good frames.
    end: u64,
    records: u64,
    /// Why replay stopped before the end of the file.
    stopped: Option<&'static str>,
}

fn replay(bytes: &[u8], path: &Path) -> Result<Replay> {
    let mut index = BTreeMap::new();
    let (mut pos, mut records) = (0usize, 0u64);
    let stopped = loop {
        let rest = &bytes[pos..];
        if rest.is_empty() {
            break None;
        }
        let Some((len, sum)) = rest.get(..FRAME_HEADER).map(|h| {
            let (len, sum) = h.split_at(4);
            (
                u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize,
                u64::from_le_bytes(sum.try_into().unwrap_or_default()),
            )
        }) else {
            break Some("a partial frame header");
        };
        if !(MIN_PAYLOAD..=MAX_PAYLOAD).contains(&len) {
            break Some("a frame length out of range");
        }
        let Some(payload) = rest.get(FRAME_HEADER..FRAME_HEADER + len) else {
            break Some("a frame that runs past the end of the file");
        };
        if XxHash3_64::oneshot(payload) != sum {
            break Some("a frame whose checksum fails");
        }
        // The checksum holds, so a payload that does not decode was written wrong: refuse
        // the log rather than cut good records off it.
        let record = decode(payload).map_err(|detail| Error::Corrupt {
            key: path.display().to_string(),
            detail: format!("record at byte {pos}: {detail}"),
        })?;
        match record {
            Record::Put { key, at } => index.insert(key, at),
            Record::Remove { key } => index.remove(&key),
        };
        records += 1;
        pos += FRAME_HEADER + len;
    };
    Ok(Replay {
        index,
        end: pos as u64,
        records,
        stopped,
    })
}

fn decode(payload: &[u8]) -> Result<Record, String> {
    let (&tag, rest) = payload.split_first().ok_or("empty payload")?;
    let (key_len, rest) = rest.split_at_checked(2).ok_or("no key length")?;
    let key_len = u16::from_le_bytes([key_len[0], key_len[1]]) as usize;
    let (key, rest) = rest
        .split_at_checked(key_len)
        .ok_or("a key past the payload")?;
    let key = String::from_utf8(key.to_vec()).map_err(|_| "a key that is not UTF-8")?;
    let word = |i: usize| -> Result<u64, String> {
        rest.get(i * 8..i * 8 + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| "a location past the payload".to_string())
    };
    let (record, used) = match tag {
        TAG_PUT => {
            let at = Location {
                folder: 0,
                segment: word(0)?,
                offset: word(1)?,
                len: word(2)?,
                head: None,
            };
            (Record::Put { key, at }, 24)
        }
        TAG_PUT_IN | TAG_PUT_BARE => {
            let folder = rest
                .get(24..28)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .ok_or("a folder past the payload")?;
            let at = Location {
                folder,
                segment: word(0)?,
                offset: word(1)?,
                len: word(2)?,
                head: None,
            };
            if tag == TAG_PUT_IN {
                (Record::Put { key, at }, 28)
            } else {
                let head = rest
                    .get(28..28 + BLOCK_HEAD)
                    .and_then(|b| b.try_into().ok())
                    .ok_or("a block header past the payload")?;
                let at = Location {
                    head: Some(head),
                    ..at
                };
                (Record::Put { key, at }, 28 + BLOCK_HEAD)
            }
        }
        TAG_REMOVE => (Record::Remove { key }, 0),
        other => return Err(format!("unknown record tag {other}")),
    };
    if rest.len() != used {
        return Err(format!("{} bytes past the record", rest.len() - used));
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_decode_to_the_records_encoded() {
        let at = Location {
            folder: 0,
            segment: 3,
            offset: u64::MAX,
            len: 4096,
            head: None,
        };
        let mut bytes = Vec::new();
        encode_frame(&mut bytes, "ключ/1", Some(&at)).unwrap();
        encode_frame(&mut bytes, "", None).unwrap();
        let key = "k".repeat(MAX_KEY_BYTES);
        // In another folder, stored bare: the longest payload.
        let elsewhere = Location {
            folder: u32::MAX,
            head: Some([7; BLOCK_HEAD]),
            ..at
        };
        encode_frame(&mut bytes, &key, Some(&elsewhere)).unwrap();
        // Bare in the first folder; and an old-format put in another one.
        let bare = Location {
            head: Some(std::array::from_fn(|i| i as u8)),
            ..at
        };
        encode_frame(&mut bytes, "bare", Some(&bare)).unwrap();
        let old_in = Location { folder: 2, ..at };
        encode_frame(&mut bytes, "old", Some(&old_in)).unwrap();
        assert!(matches!(
            encode_frame(&mut bytes, &format!("{key}x"), None),
            Err(Error::InvalidArgument(_))
        ));
        let r = replay(&bytes, Path::new("log")).unwrap();
        assert_eq!((r.records, r.end, r.stopped), (5, bytes.len() as u64, None));
        assert_eq!(
            r.index.into_iter().collect::<Vec<_>>(),
            vec![
                ("bare".to_string(), bare),
                (key, elsewhere),
                ("old".to_string(), old_in),
                ("ключ/1".to_string(), at)
            ]
        );
    }

    #[test]
    fn a_checksummed_payload_that_does_not_decode_is_corrupt_not_a_tail() {
        let payload = [9u8, 0, 0];
        let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&XxHash3_64::oneshot(&payload).to_le_bytes());
        bytes.extend_from_slice(&payload);
        let e = replay(&bytes, Path::new("log")).err().unwrap();
        assert!(
            matches!(&e, Error::Corrupt { detail, .. } if detail.contains("tag 9")),
            "{e}"
        );
    }
}
