//! The store's disk side: blocks encoded and appended bare (the payload alone, on whole
//! pages) to the current segment, then their index records holding their headers (a plain
//! block copied and hashed straight into the direct-I/O buffer), and read back verified
//! against those headers (large plain blocks landing piece by piece, smaller ones copied
//! out and hashed in one pass). Blocks an older store wrote with the header in front of the
//! payload (a record without a header) are read as they lie.

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::memory::PinnedBuf;

use super::super::codec;
use super::super::disk::{pad_to_align, piece_bytes, Framer, DIRECT_ALIGN, SPLIT_FROM};
use super::super::log::{Location, Record};
use super::open::segment_name;
use super::{folders, forget, Below, Inner, TierStore};

/// Blocks read piece by piece into their destination from this many stored bytes: below it
/// the header's own read and the hand-offs cost more than the one-pass copy and checksum after
/// the read (4 MiB reads ran 65-73% of raw streamed against 85-88% whole on the build VM).
const STREAM_FROM: usize = 16 << 20;

/// A plain block's framer for a bare write: the body copied and hashed, no header in the
/// write (the header, [`codec::PlainFramer::header`], goes into the index record).
struct Bare(codec::PlainFramer);

impl Framer for Bare {
    fn copy(&mut self, src: &[u8], dst: &mut [u8]) {
        self.0.copy(src, dst);
    }
    fn absorb(&mut self, src: &[u8]) {
        self.0.absorb(src);
    }
    fn header(&mut self) -> Vec<u8> {
        Vec::new()
    }
}

/// Blocks by key, written together.
type Blocks<'a> = Vec<(&'a str, &'a [u8])>;

impl TierStore {
    /// Appends `data` as an encoded block to the current segment and records it.
    pub(super) fn write_to_disk(
        &self,
        g: &mut Inner,
        key: &str,
        data: &[u8],
        sync: bool,
    ) -> Result<()> {
        self.write_many_to_disk(g, &[(key, data)], sync)
    }

    /// Places `blocks` among the disk folders ([`folders::choose`]) and appends those of each
    /// folder to its current segment in one write, then records them.
    pub(super) fn write_many_to_disk(
        &self,
        g: &mut Inner,
        blocks: &[(&str, &[u8])],
        sync: bool,
    ) -> Result<()> {
        // Budgets count the blocks placed before in the same call.
        let mut pending = vec![0u64; self.folders.len()];
        let mut groups: Vec<(u32, Blocks)> = Vec::new();
        for &(key, data) in blocks {
            let f = folders::choose(&self.folders, g, data.len(), &pending)?;
            let stored = data.len() as u64; // stored raw at worst, its header in the log
            let page = self.folders[f as usize].page;
            let need = folders::in_pages(stored, page).unwrap_or(u64::MAX);
            pending[f as usize] = pending[f as usize].saturating_add(need);
            match groups.iter_mut().find(|(to, _)| *to == f) {
                Some((_, group)) => group.push((key, data)),
                None => groups.push((f, vec![(key, data)])),
            }
        }
        for (f, group) in groups {
            self.write_to_folder(g, f, &group, sync)?;
        }
        Ok(())
    }

    /// Appends `blocks` as encoded blocks to `folder`'s current segment in one write (each at
    /// an aligned offset) and records them.
    fn write_to_folder(
        &self,
        g: &mut Inner,
        folder: u32,
        blocks: &[(&str, &[u8])],
        sync: bool,
    ) -> Result<()> {
        const ZEROS: [u8; DIRECT_ALIGN as usize] = [0; DIRECT_ALIGN as usize];
        type Head = [u8; codec::HEADER_BYTES];
        let f = folder as usize;
        let (dir, page) = match self.folders.get(f) {
            Some(d) => (&d.path, d.page),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "tier store: no disk folder #{folder}"
                )))
            }
        };
        let segment = g.current[f];
        let path = dir.join(segment_name(segment));
        let (compression, filter) = (self.config.disk_compression, self.config.disk_filter);
        // (offset in the write, stored length, header) of each block. Blocks are stored bare:
        // only the payload goes into the segment (a 64 KiB block is 16 pages), the header into
        // the index record written after it.
        let mut placed: Vec<(u64, u64, Head)> = Vec::with_capacity(blocks.len());
        let base = match blocks {
            // A large block stored as it is: copied and hashed piece by piece, in order, while
            // the pieces before go out.
            [(_, data)]
                if data.len() >= SPLIT_FROM && codec::stores_plain(data, compression, filter)? =>
            {
                let mut framer = Bare(codec::PlainFramer::start(data.len())?);
                let base = self
                    .disk
                    .append_aligned_framed(&path, 0, data, &mut framer)?;
                placed.push((0, data.len() as u64, framer.0.header()));
                base
            }
            // A smaller one in one I/O: written from where it lies when aligned, hashed while
            // the write is out (io_uring) or as it is copied into the I/O buffer.
            [(_, data)] if codec::stores_plain(data, compression, filter)? => {
                let mut framer = codec::PlainFramer::start(data.len())?;
                crate::tier::disk::stamp::mark("put: placing, path, framer");
                let mut take = |bytes: &[u8]| framer.absorb(bytes);
                let base = self.disk.append_aligned_taking(&path, data, &mut take)?;
                placed.push((0, data.len() as u64, framer.header()));
                base
            }
            _ => {
                let encoded = blocks
                    .iter()
                    .map(|(_, data)| codec::encode(data, compression, filter))
                    .collect::<Result<Vec<_>>>()?;
                let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * encoded.len());
                let mut at = 0u64;
                for (i, block) in encoded.iter().enumerate() {
                    let len = block.payload.len() as u64;
                    placed.push((at, len, block.header));
                    parts.push(&block.payload);
                    let pad = pad_to_align(len);
                    if i + 1 < encoded.len() && pad > 0 {
                        parts.push(&ZEROS[..pad as usize]);
                    }
                    at += len + pad;
                }
                self.disk.append_aligned(&path, &parts)?
            }
        };
        crate::tier::disk::stamp::mark("put: after the I/O");
        if sync {
            self.disk.sync(&path)?;
            if !g.named[f] {
                self.disk.sync_dir(dir)?;
                g.named[f] = true;
            }
        }
        for ((key, _), (start, len, head)) in blocks.iter().zip(placed) {
            let at = Location {
                folder,
                segment,
                offset: base + start,
                len,
                head: Some(head),
            };
            g.log.append(
                &Record::Put {
                    key: key.to_string(),
                    at,
                },
                sync,
            )?;
            crate::tier::disk::stamp::mark("put: index record write");
            let seg = g.segments.entry((folder, segment)).or_default();
            seg.live += at.len;
            seg.total = at.offset + at.len + pad_to_align(at.len);
            seg.charged = seg.charged.saturating_add(folders::charge(&at, page));
            if let Some(old) = g.index.insert(key.to_string(), at) {
                forget(g, old);
            }
            g.stats.disk_bytes_written += len;
        }
        Ok(())
    }

    /// Finds the block below the GPU tier: in the host tier (its pinned block stays there),
    /// else read from the disk, checksum verified, into a pinned block of its own.
    pub(super) fn find_below_gpu(&self, g: &mut Inner, key: &String) -> Result<Below> {
        if g.host_blocks.contains_key(key) {
            g.host.touch(key);
            g.stats.host_hits += 1;
            metrics::counter!("warpdrive_tier_hits_total", "tier" => "host").increment(1);
            return Ok(Below::Host);
        }
        // A pinned block made for an in-place read that did not apply serves the read below.
        let spare = std::cell::Cell::new(None::<PinnedBuf<u8>>);
        let pinned = |len| match spare.take() {
            Some(p) if p.len() == len => Ok(p),
            _ => PinnedBuf::<u8>::new(self.stream.device(), len),
        };
        if let Some(len) = self.in_place_len(g, key) {
            let mut p = pinned(len)?;
            if self.read_disk_in_place(g, key, &|_| Ok(()), p.wait_slice_mut()?)? {
                return Ok(Below::Disk(p));
            }
            spare.set(Some(p));
        }
        if let Some(p) = self.read_disk_streamed(g, key, pinned, |p| p.wait_slice_mut())? {
            return Ok(Below::Disk(p));
        }
        self.read_disk(g, key, |header, payload| {
            codec::decode_parts_into(header, payload, key, pinned, |p| p.wait_slice_mut())
                .map(Below::Disk)
        })
    }

    /// Reads `key`'s stored block from the disk and hands its header (from the index record,
    /// or in front of the payload for a block an older store wrote) and payload to `land`,
    /// which verifies and decodes it where the caller wants it ([`codec::decode_parts_into`]).
    pub(super) fn read_disk<R>(
        &self,
        g: &mut Inner,
        key: &String,
        land: impl FnOnce(&[u8; codec::HEADER_BYTES], &[u8]) -> Result<R>,
    ) -> Result<R> {
        let Some(at) = g.index.get(key).copied() else {
            g.stats.misses += 1;
            metrics::counter!("warpdrive_tier_misses_total").increment(1);
            return Err(Error::NotFound { key: key.clone() });
        };
        let path = self.segment_path(at.folder, at.segment);
        let corrupt = |detail: String| Error::Corrupt {
            key: key.clone(),
            detail,
        };
        let len =
            usize::try_from(at.len).map_err(|_| corrupt(format!("a block of {} bytes", at.len)))?;
        let mut land = Some(land);
        let mut landed = None;
        self.disk
            .with_aligned(&path, at.offset, len, &mut |stored| {
                if stored.len() != len {
                    return Err(corrupt(format!("{} of {len} bytes on disk", stored.len())));
                }
                if let Some(land) = land.take() {
                    let (header, payload) = match &at.head {
                        Some(head) => (head, stored),
                        None => codec::split_frame(stored, key)?,
                    };
                    landed = Some(land(header, payload)?);
                }
                Ok(())
            })?;
        let landed = landed.ok_or_else(|| corrupt("the disk handed back no bytes".into()))?;
        g.stats.disk_hits += 1;
        metrics::counter!("warpdrive_tier_hits_total", "tier" => "disk").increment(1);
        g.stats.disk_bytes_read += at.len;
        Ok(landed)
    }

    /// The length of `key`'s block where [`read_disk_in_place`](Self::read_disk_in_place)
    /// may land it: a plain bare block (whether the disk can land it where the caller wants
    /// it, the file's direct-I/O alignment decides there).
    pub(super) fn in_place_len(&self, g: &Inner, key: &String) -> Option<usize> {
        let at = g.index.get(key)?;
        let head = at.head?;
        let len = usize::try_from(at.len).ok()?;
        let plain = codec::PlainStream::start(&head, len, key).ok()??;
        (plain.raw_len() == len).then_some(len)
    }

    /// `key`'s block read from the disk straight into `out` (its length checked by `fits`
    /// first) and verified there, with no direct-I/O buffer between, where the disk can land
    /// it there ([`Disk::read_aligned_into`]: `out` at the file's direct-I/O memory alignment,
    /// a pinned block say), checksummed in order as its pieces land: a plain bare block.
    /// `false` where not (`out` then holds no bytes of it, or bytes the caller's next read
    /// overwrites). After an error `out` holds bytes never verified (the caller zeroes them).
    pub(super) fn read_disk_in_place(
        &self,
        g: &mut Inner,
        key: &String,
        fits: &dyn Fn(usize) -> Result<()>,
        out: &mut [u8],
    ) -> Result<bool> {
        // One index look-up and one checksum stream (`in_place_len` and a second start cost
        // ~1 µs of a 64 KiB read on the build VM: bench/NOTES.md, h-tier-10).
        let Some(at) = g.index.get(key).copied() else {
            return Ok(false);
        };
        let Some(head) = at.head else {
            return Ok(false);
        };
        let Ok(len) = usize::try_from(at.len) else {
            return Ok(false);
        };
        // A header that does not parse is not read here: the bounce path reports it.
        let Some(stream) = codec::PlainStream::start(&head, len, key).ok().flatten() else {
            return Ok(false);
        };
        if stream.raw_len() != len {
            return Ok(false);
        }
        fits(len)?;
        if out.len() != len {
            return Err(Error::LengthMismatch {
                op: "tier disk read",
                left: out.len(),
                right: len,
            });
        }
        let path = self.segment_path(at.folder, at.segment);
        crate::tier::disk::stamp::mark("get: index, checksum, path");
        let stream = Mutex::new(stream);
        let hash = |_: usize, bytes: &[u8]| {
            stream.lock().update(bytes);
            Ok(())
        };
        let Some(got) = self.disk.read_aligned_into(&path, at.offset, out, &hash)? else {
            return Ok(false);
        };
        if got != len {
            return Err(Error::Corrupt {
                key: key.clone(),
                detail: format!("{got} of {len} bytes on disk"),
            });
        }
        crate::tier::disk::stamp::mark("get: after the I/O");
        stream.into_inner().finish()?;
        crate::tier::disk::stamp::mark("get: checksum compare");
        g.stats.disk_hits += 1;
        metrics::counter!("warpdrive_tier_hits_total", "tier" => "disk").increment(1);
        g.stats.disk_bytes_read += at.len;
        crate::tier::disk::stamp::mark("get: counters");
        Ok(true)
    }

    /// A large plain block read from the disk straight into the destination `make` gives for
    /// its length (a new `Vec`, a pinned block; `view` is its bytes), each piece of the read
    /// copied in and checksummed in order as it lands, so the copying and hashing overlap
    /// the reads of the later pieces; `None` where that does not apply (a block under
    /// [`STREAM_FROM`], or compressed or filtered: [`read_disk`](Self::read_disk) reads those).
    pub(super) fn read_disk_streamed<D>(
        &self,
        g: &mut Inner,
        key: &String,
        make: impl FnOnce(usize) -> Result<D>,
        view: impl FnOnce(&mut D) -> Result<&mut [u8]>,
    ) -> Result<Option<D>> {
        let Some(at) = g.index.get(key).copied() else {
            return Ok(None);
        };
        let corrupt = |detail: String| Error::Corrupt {
            key: key.clone(),
            detail,
        };
        let len =
            usize::try_from(at.len).map_err(|_| corrupt(format!("a block of {} bytes", at.len)))?;
        if len < STREAM_FROM {
            return Ok(None);
        }
        let path = self.segment_path(at.folder, at.segment);
        // Header bytes in front of the payload in the segment: none for a bare block.
        let (header, hlen) = match at.head {
            Some(head) => (head, 0),
            None => {
                let first = self
                    .disk
                    .read_aligned(&path, at.offset, codec::HEADER_BYTES)?;
                let header: [u8; codec::HEADER_BYTES] = *first
                    .first_chunk()
                    .ok_or_else(|| corrupt(format!("{} of {len} bytes on disk", first.len())))?;
                (header, codec::HEADER_BYTES)
            }
        };
        let header = &header;
        let payload_len = len - hlen;
        let Some(stream) = codec::PlainStream::start(header, payload_len, key)? else {
            return Ok(None);
        };
        let mut dest = make(stream.raw_len())?;
        let data = view(&mut dest)?;
        if data.len() != stream.raw_len() {
            return Err(Error::LengthMismatch {
                op: "tier disk read",
                left: data.len(),
                right: stream.raw_len(),
            });
        }
        // One part of `data` per piece of the read (piece k: stored bytes from k × the disk's
        // piece for this span, an old block's header inside the first), each landed by the
        // thread that read it; the one that lands the next part in order hashes forward.
        let piece = piece_bytes(len + pad_to_align(at.len) as usize);
        let mut parts = Vec::new();
        let mut rest = data;
        let mut end = piece - hlen;
        while !rest.is_empty() {
            let n = end.min(rest.len());
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(n);
            parts.push(Mutex::new((part, 0usize)));
            rest = tail;
            end = piece;
        }
        let starts: Vec<usize> = (0..parts.len())
            .map(|k| (k * piece).saturating_sub(hlen))
            .collect();
        let order = Mutex::new((0usize, Some(stream)));
        // Hashes the parts that landed in order from the first not yet hashed.
        let hash_forward = |order: &mut (usize, Option<codec::PlainStream>)| {
            let (next, stream) = order;
            while let Some(part) = parts.get(*next) {
                let part = part.lock();
                if part.1 < part.0.len() {
                    break;
                }
                if let Some(s) = stream.as_mut() {
                    s.update(part.0);
                }
                *next += 1;
            }
        };
        let land = |at: usize, bytes: &[u8]| -> Result<()> {
            // Stored bytes at..at + len: the header's (an old block's), then payload bytes from
            // `at − hlen`.
            let skip = hlen.saturating_sub(at).min(bytes.len());
            if skip > 0 && bytes[..skip] != header[at..at + skip] {
                return Err(corrupt("the header changed between two reads".into()));
            }
            let mut from = (at + skip).saturating_sub(hlen);
            let mut bytes = &bytes[skip..];
            while !bytes.is_empty() {
                let k = starts.partition_point(|&s| s <= from) - 1;
                let mut part = parts[k].lock();
                let (dst, landed) = &mut *part;
                let off = from - starts[k];
                let n = bytes.len().min(dst.len() - off);
                dst[off..off + n].copy_from_slice(&bytes[..n]);
                *landed += n;
                drop(part);
                (from, bytes) = (from + n, &bytes[n..]);
            }
            // A thread that finds another hashing goes back to reading (waiting here held
            // the next read back); the parts it landed are hashed by that thread or, at the
            // latest, after the last read.
            if let Some(mut order) = order.try_lock() {
                hash_forward(&mut order);
            }
            Ok(())
        };
        let got = self.disk.read_aligned_each(&path, at.offset, len, &land)?;
        if got != len {
            return Err(corrupt(format!("{got} of {len} bytes on disk")));
        }
        let mut order = order.into_inner();
        hash_forward(&mut order);
        let (hashed, stream) = order;
        if hashed != parts.len() {
            return Err(corrupt("parts of the block never landed".into()));
        }
        drop(parts);
        stream
            .ok_or_else(|| corrupt("no checksum".into()))?
            .finish()?;
        g.stats.disk_hits += 1;
        metrics::counter!("warpdrive_tier_hits_total", "tier" => "disk").increment(1);
        g.stats.disk_bytes_read += at.len;
        Ok(Some(dest))
    }
}
