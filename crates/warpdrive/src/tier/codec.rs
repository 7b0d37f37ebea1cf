//! How a block is stored on disk: an optional byte-shuffle filter, lz4 or zstd (or the raw
//! bytes when that does not shrink them), framed by a fixed header whose xxh3 checksum covers
//! the header and the payload, verified on every read.
//!
//! # Frame layout
//!
//! A stored block is a [`HEADER_BYTES`] (32) byte header and the payload. Integers are
//! little-endian. The store keeps the header in the block's index record
//! ([`Location::head`](super::log::Location::head)) and only the payload in the data segment,
//! so a block's extent on disk is exactly its payload's pages ([`decode_parts`] and
//! [`decode_parts_into`] read it so); [`encode_block`] and [`decode_block`] keep the two
//! together (header then payload), as stores before that format wrote their segments.
//!
//! | offset | bytes | field                                                             |
//! |-------:|------:|-------------------------------------------------------------------|
//! | 0      | 4     | magic `b"WDBK"`                                                   |
//! | 4      | 1     | format version (1)                                                |
//! | 5      | 1     | codec actually used: 0 none (raw), 1 lz4 block, 2 zstd            |
//! | 6      | 1     | zstd level as `i8` (0 for the other codecs)                       |
//! | 7      | 1     | filter: 0 none, `w` ≥ 1 byte-shuffle by element width `w`        |
//! | 8      | 8     | raw length: bytes of the block as the caller gave them (`u64`)    |
//! | 16     | 8     | payload length: bytes after the header (`u64`)                    |
//! | 24     | 8     | xxh3-64 of header bytes 0..24 followed by the payload            |
//!
//! The payload is the raw bytes (codec 0, filter 0), or the lz4 block-format (no size prefix)
//! or zstd-frame compression of the data after the filter. A block whose compressed payload
//! would not be smaller than the data is stored raw. Raw lengths above [`MAX_RAW_BYTES`] are
//! refused on both sides.

use serde::{Deserialize, Serialize};
use std::hash::Hasher;

use crate::error::{Error, Result};

/// xxh3-64 (seed 0) taken in pieces (twox-hash picks AVX2 at run time: 64 KiB in 1.9 µs
/// against 3.1 for an SSE2 build on the build VM; the same hash as any xxh3-64).
#[derive(Clone)]
struct Xxh3(twox_hash::XxHash3_64);

impl Xxh3 {
    fn new() -> Xxh3 {
        Xxh3(twox_hash::XxHash3_64::with_seed(0))
    }

    fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    fn digest(&self) -> u64 {
        self.0.finish()
    }
}

/// How a tier compresses a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    None,
    Lz4,
    /// zstd at `level` (1..=22; negative levels are zstd's fast modes, down to -128 here since
    /// the frame records the level in one byte).
    Zstd {
        level: i32,
    },
}

/// A filter applied before compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Filter {
    None,
    /// Byte-shuffle by element width (2 for bf16 / f16): the i-th bytes of every element
    /// together, so exponents sit next to exponents. Width 0 is refused; width 1 changes
    /// nothing.
    Shuffle {
        width: u8,
    },
}

/// Stored blocks from this size have their checksum computed beside the landing of their
/// data by [`Frame::verify_then`] ([`decode_block`] and [`decode_block_into`] use it for
/// compressed or filtered blocks; plain ones are copied and hashed in one pass).
pub const OVERLAP_FROM: usize = 4 << 20;

/// Bytes of the frame around a stored block's payload.
pub const HEADER_BYTES: usize = 32;

/// The largest block (raw length) a frame may hold: 1 GiB, above the store's 256 MiB blocks,
/// so a corrupt length can never make a read allocate without bound.
pub const MAX_RAW_BYTES: u64 = 1 << 30;

const MAGIC: [u8; 4] = *b"WDBK";
const VERSION: u8 = 1;
const CODEC_NONE: u8 = 0;
const CODEC_LZ4: u8 = 1;
const CODEC_ZSTD: u8 = 2;
/// Header bytes before the checksum field: what the checksum covers, with the payload.
const CHECKED_HEADER: usize = 24;

/// `data` framed as a stored block (header with the codec actually used, lengths and an
/// xxh3 checksum, then the payload); stored raw when compression does not shrink it, or,
/// from 256 KiB, when a probe of four 16 KiB windows shrinks by under 3%.
pub fn encode_block(data: &[u8], compression: Compression, filter: Filter) -> Result<Vec<u8>> {
    Ok(encode(data, compression, filter)?.to_vec())
}

/// A stored block as its two parts: the header and the payload (`data` itself when stored
/// raw), for writers that copy them straight into their I/O buffer.
pub struct Encoded<'a> {
    pub header: [u8; HEADER_BYTES],
    pub payload: std::borrow::Cow<'a, [u8]>,
}

impl Encoded<'_> {
    /// The stored block in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.header[..], &self.payload].concat()
    }
}

/// [`encode_block`] without joining header and payload.
pub fn encode(data: &[u8], compression: Compression, filter: Filter) -> Result<Encoded<'_>> {
    let (filter_byte, level_byte) = check_args(data, compression, filter)?;
    if !worth_compressing(data, compression, usize::from(filter_byte))? {
        return Ok(frame(CODEC_NONE, 0, 0, data.len(), data.into()));
    }
    let filtered;
    let input = if filter_byte > 1 && compression != Compression::None {
        let mut out = Vec::new();
        shuffle(data, usize::from(filter_byte), &mut out);
        filtered = out;
        &filtered[..]
    } else {
        data
    };
    let compressed = compress(input, compression)?;

    match compressed {
        Some((codec, payload)) if payload.len() < data.len() => Ok(frame(
            codec,
            level_byte,
            filter_byte,
            data.len(),
            payload.into(),
        )),
        _ => Ok(frame(CODEC_NONE, 0, 0, data.len(), data.into())),
    }
}

/// [`encode`]'s checks of its arguments; the filter and level bytes of the header.
fn check_args(data: &[u8], compression: Compression, filter: Filter) -> Result<(u8, u8)> {
    if data.len() as u64 > MAX_RAW_BYTES {
        return Err(Error::InvalidArgument(format!(
            "tier block of {} bytes is over the {MAX_RAW_BYTES}-byte limit",
            data.len()
        )));
    }
    let filter_byte = match filter {
        Filter::None => 0,
        Filter::Shuffle { width: 0 } => {
            return Err(Error::InvalidArgument(
                "tier block: shuffle filter of width 0".into(),
            ))
        }
        Filter::Shuffle { width } => width,
    };
    let level_byte = match compression {
        Compression::Zstd { level } => zstd_level_byte(level)?,
        _ => 0,
    };
    Ok((filter_byte, level_byte))
}

/// Whether [`encode`] stores `data` as it is without trying a compression (no compression
/// asked for, or the probe says it would not shrink), its arguments checked as `encode`
/// checks them; then [`PlainFramer`] or [`encode_plain_into`] frames it.
pub fn stores_plain(data: &[u8], compression: Compression, filter: Filter) -> Result<bool> {
    let (filter_byte, _) = check_args(data, compression, filter)?;
    Ok(compression == Compression::None
        || !worth_compressing(data, compression, usize::from(filter_byte))?)
}

/// Writes `data` framed as [`encode`] stores it plain into `out` (exactly
/// [`HEADER_BYTES`] `+ data.len()` bytes, a direct-I/O buffer say): the copy and the checksum
/// in one pass, each chunk hashed from the cache right after it lands, where
/// a separate checksum and copy are two passes over the data.
pub fn encode_plain_into(data: &[u8], out: &mut [u8]) -> Result<()> {
    let len = out.len();
    let want = HEADER_BYTES.saturating_add(data.len());
    let split = out.split_first_chunk_mut::<HEADER_BYTES>();
    let Some((header, body)) = split.filter(|_| len == want) else {
        return Err(Error::LengthMismatch {
            op: "tier block frame",
            left: len,
            right: want,
        });
    };
    let mut framer = PlainFramer::start(data.len())?;
    framer.copy(data, body);
    *header = framer.header();
    Ok(())
}

/// A block stored plain framed piece by piece, for a write that sends its pieces out as they
/// are copied: [`copy`](Self::copy) takes the data's pieces in order (copied and hashed in one
/// pass, as [`encode_plain_into`]), [`header`](Self::header) then gives the frame's header.
pub struct PlainFramer {
    header: [u8; HEADER_BYTES],
    hasher: Xxh3,
}

impl PlainFramer {
    /// The framer of a plain block of `raw_len` bytes (at most [`MAX_RAW_BYTES`]).
    pub fn start(raw_len: usize) -> Result<PlainFramer> {
        if raw_len as u64 > MAX_RAW_BYTES {
            return Err(Error::InvalidArgument(format!(
                "tier block of {raw_len} bytes is over the {MAX_RAW_BYTES}-byte limit"
            )));
        }
        let header = frame_fields(CODEC_NONE, 0, 0, raw_len, raw_len);
        let mut hasher = Xxh3::new();
        hasher.update(&header[..CHECKED_HEADER]);
        Ok(PlainFramer { header, hasher })
    }

    /// Copies `src`, the data's next bytes, into `dst` (the shorter's length), each chunk
    /// hashed from the cache right after it lands.
    pub fn copy(&mut self, src: &[u8], dst: &mut [u8]) {
        for (s, d) in src.chunks(COPY_CHUNK).zip(dst.chunks_mut(COPY_CHUNK)) {
            let n = s.len().min(d.len());
            d[..n].copy_from_slice(&s[..n]);
            self.hasher.update(&d[..n]);
        }
    }

    /// Takes `src`, the data's next bytes, into the checksum without copying them (a writer
    /// that copies them itself, in pieces out of order).
    pub fn absorb(&mut self, src: &[u8]) {
        self.hasher.update(src);
    }

    /// The header, with the checksum of the data copied so far.
    pub fn header(&self) -> [u8; HEADER_BYTES] {
        let mut header = self.header;
        header[CHECKED_HEADER..].copy_from_slice(&self.hasher.digest().to_le_bytes());
        header
    }
}

/// Bytes the one-pass copies ([`encode_plain_into`], [`decode_block`] of a plain block) copy
/// and hash at a time: a chunk stays in the L1 cache from its copy to its hashing (8 KiB
/// chunks ran the pass a tenth faster than 64 KiB ones on the build VM).
pub(crate) const COPY_CHUNK: usize = 8 << 10;

/// `input` compressed by `compression` with its codec byte (`None` for no compression).
fn compress(input: &[u8], compression: Compression) -> Result<Option<(u8, Vec<u8>)>> {
    Ok(match compression {
        Compression::None => None,
        Compression::Lz4 => Some((CODEC_LZ4, lz4_flex::block::compress(input))),
        Compression::Zstd { level } => {
            let payload = zstd::bulk::compress(input, level)
                .map_err(|e| Error::InvalidArgument(format!("tier block: zstd failed: {e}")))?;
            Some((CODEC_ZSTD, payload))
        }
    })
}

/// Blocks from this size are probed before the whole is compressed.
const PROBE_FROM: usize = 256 << 10;
/// The probe: this many windows of this many bytes, spread over the block.
const PROBE_WINDOWS: usize = 4;
const PROBE_WINDOW: usize = 16 << 10;

/// Whether compressing `data` may pay: false when windows spread over a large block
/// (filtered as the block would be) shrink by under 3%. Incompressible blocks (bf16 weights
/// under plain lz4) then cost a probe instead of a full pass of the codec before they are
/// stored raw anyway.
fn worth_compressing(data: &[u8], compression: Compression, width: usize) -> Result<bool> {
    if compression == Compression::None || data.len() < PROBE_FROM {
        return Ok(true);
    }
    let step = data.len() / PROBE_WINDOWS;
    let mut sample = Vec::with_capacity(PROBE_WINDOWS * PROBE_WINDOW);
    let mut shuffled = Vec::new();
    for k in 0..PROBE_WINDOWS {
        let start = k * step - (k * step) % width.max(1);
        let window = &data[start..start + PROBE_WINDOW];
        if width > 1 {
            shuffle(window, width, &mut shuffled);
            sample.extend_from_slice(&shuffled);
        } else {
            sample.extend_from_slice(window);
        }
    }
    Ok(match compress(&sample, compression)? {
        Some((_, packed)) => packed.len() * 100 < sample.len() * 97,
        None => false,
    })
}

/// The data of a stored block, its checksum and framing verified; `key` names the block in
/// `Error::Corrupt`.
///
/// A plain block is copied out and hashed in one pass (each chunk hashed from the cache
/// right after it lands in the new `Vec`); the others are verified, then decoded, as
/// [`Frame::verify_then`] does.
pub fn decode_block(stored: &[u8], key: &str) -> Result<Vec<u8>> {
    let (header, payload) = split_frame(stored, key)?;
    decode_parts(header, payload, key)
}

/// [`decode_block`] of a block whose header is kept apart from its payload (a store's index
/// record holds it, the segment only the payload).
pub fn decode_parts(header: &[u8; HEADER_BYTES], payload: &[u8], key: &str) -> Result<Vec<u8>> {
    if let Some(mut stream) = PlainStream::start(header, payload.len(), key)? {
        // Reserved, not zeroed: the copy is the only pass over the new pages.
        let mut out = crate::memory::host_vec("a decoded tier block", payload.len())?;
        for chunk in payload.chunks(COPY_CHUNK) {
            let at = out.len();
            out.extend_from_slice(chunk);
            stream.update(&out[at..]);
        }
        stream.finish()?;
        return Ok(out);
    }
    let zeroed = |len| crate::memory::host_zeroed("a decoded tier block", len);
    decode_parts_into(header, payload, key, zeroed, |v| Ok(v.as_mut_slice()))
}

/// The data of a stored block, verified, in the destination `make` gives for its length
/// (`view` is its bytes: a pinned block, say): a plain block copied and hashed in one pass
/// as [`decode_block`] does, the others verified then decoded as [`Frame::verify_then`].
/// On `Error::Corrupt` the destination is dropped, never returned.
pub fn decode_block_into<D>(
    stored: &[u8],
    key: &str,
    make: impl FnOnce(usize) -> Result<D>,
    view: impl FnOnce(&mut D) -> Result<&mut [u8]>,
) -> Result<D> {
    let (header, payload) = split_frame(stored, key)?;
    decode_parts_into(header, payload, key, make, view)
}

/// [`decode_block_into`] of a block whose header is kept apart from its payload.
pub fn decode_parts_into<D>(
    header: &[u8; HEADER_BYTES],
    payload: &[u8],
    key: &str,
    make: impl FnOnce(usize) -> Result<D>,
    view: impl FnOnce(&mut D) -> Result<&mut [u8]>,
) -> Result<D> {
    if let Some(mut stream) = PlainStream::start(header, payload.len(), key)? {
        let mut dest = make(payload.len())?;
        let out = view(&mut dest)?;
        if out.len() != payload.len() {
            return Err(Error::LengthMismatch {
                op: "tier block decode",
                left: out.len(),
                right: payload.len(),
            });
        }
        for (src, dst) in payload.chunks(COPY_CHUNK).zip(out.chunks_mut(COPY_CHUNK)) {
            dst.copy_from_slice(src);
            stream.update(dst);
        }
        stream.finish()?;
        return Ok(dest);
    }
    Frame::verify_parts_then(header, payload, key, |frame| {
        let mut dest = make(frame.raw_len)?;
        frame.decode_into(view(&mut dest)?)?;
        Ok(dest)
    })
}

/// `stored` as its header and payload; `Error::Corrupt` naming `key` when it is shorter than a
/// header.
pub fn split_frame<'a>(stored: &'a [u8], key: &str) -> Result<(&'a [u8; HEADER_BYTES], &'a [u8])> {
    stored
        .split_first_chunk::<HEADER_BYTES>()
        .ok_or_else(|| Error::Corrupt {
            key: key.to_string(),
            detail: format!(
                "{} bytes, shorter than the {HEADER_BYTES}-byte block header",
                stored.len()
            ),
        })
}

/// A stored block whose header and checksum are verified: its data is `raw_len` bytes that
/// [`decode_into`](Self::decode_into) writes where the caller wants them (a pinned block on
/// its way to the GPU, say).
pub struct Frame<'a> {
    key: &'a str,
    codec: u8,
    filter: u8,
    raw_len: usize,
    payload: &'a [u8],
}

impl<'a> Frame<'a> {
    /// Checks `stored`'s framing and checksum; `key` names the block in `Error::Corrupt`.
    pub fn verify(stored: &'a [u8], key: &'a str) -> Result<Frame<'a>> {
        let (header, payload) = split_frame(stored, key)?;
        let framed = Framed::parse(header, payload, key)?;
        framed.check_sum()?;
        framed.fields
    }

    /// As [`verify`](Self::verify), then `land(&frame)`. From [`OVERLAP_FROM`] stored bytes
    /// the checksum runs on a thread of its own while `land` works (hashing a 64 MiB block
    /// took 3-5 ms on the build VM), and a mismatch wins over whatever `land` produced.
    pub fn verify_then<R>(
        stored: &'a [u8],
        key: &'a str,
        land: impl FnOnce(&Frame<'a>) -> Result<R>,
    ) -> Result<R> {
        let (header, payload) = split_frame(stored, key)?;
        Frame::verify_parts_then(header, payload, key, land)
    }

    /// [`verify_then`](Self::verify_then) of a block whose header is kept apart from its
    /// payload.
    pub fn verify_parts_then<R>(
        header: &'a [u8; HEADER_BYTES],
        payload: &'a [u8],
        key: &'a str,
        land: impl FnOnce(&Frame<'a>) -> Result<R>,
    ) -> Result<R> {
        let framed = Framed::parse(header, payload, key)?;
        if HEADER_BYTES + payload.len() < OVERLAP_FROM {
            framed.check_sum()?;
            return land(&framed.fields?);
        }
        std::thread::scope(|s| {
            let sum = s.spawn(|| framed.check_sum());
            let landed = framed.fields.as_ref().ok().map(land);
            let sum = sum.join().unwrap_or_else(|_| {
                Err(Error::Corrupt {
                    key: key.to_string(),
                    detail: "the checksum thread panicked".into(),
                })
            });
            sum?;
            match (landed, &framed.fields) {
                (Some(landed), _) => landed,
                (None, Err(e)) => Err(Error::Corrupt {
                    key: key.to_string(),
                    detail: e.to_string(),
                }),
                (None, Ok(_)) => Err(Error::Corrupt {
                    key: key.to_string(),
                    detail: "a frame that was not landed".into(),
                }),
            }
        })
    }
}

/// A block header's fields, checked against the payload length that follows it.
struct Head {
    codec: u8,
    level: i8,
    filter: u8,
    raw_len: u64,
}

impl Head {
    fn parse(header: &[u8; HEADER_BYTES], payload_len: usize, key: &str) -> Result<Head> {
        let corrupt = |detail: String| Error::Corrupt {
            key: key.to_string(),
            detail,
        };
        let magic = [header[0], header[1], header[2], header[3]];
        if magic != MAGIC {
            return Err(corrupt(format!("bad magic {magic:02x?}")));
        }
        let (version, codec, level, filter) = (header[4], header[5], header[6] as i8, header[7]);
        if version != VERSION {
            return Err(corrupt(format!("unknown format version {version}")));
        }
        let raw_len = u64_at(header, 8);
        let said = u64_at(header, 16);
        if said != payload_len as u64 {
            return Err(corrupt(format!(
                "header says a {said}-byte payload, {payload_len} bytes follow it"
            )));
        }
        if raw_len > MAX_RAW_BYTES {
            return Err(corrupt(format!(
                "raw length {raw_len} over the {MAX_RAW_BYTES}-byte limit"
            )));
        }
        Ok(Head {
            codec,
            level,
            filter,
            raw_len,
        })
    }
}

/// The checksum of a plain block (neither compressed nor filtered: its payload is its data)
/// taken as its payload arrives in order, so a large block is verified while it is read:
/// [`start`](Self::start) checks the header, [`update`](Self::update) takes the payload's
/// pieces in order, [`finish`](Self::finish) compares. A flipped bit anywhere is
/// `Error::Corrupt`, as [`Frame::verify`]'s.
pub struct PlainStream {
    key: String,
    expected: u64,
    hasher: Xxh3,
    raw_len: usize,
}

impl PlainStream {
    /// The stream of a block stored as `header` and `payload_len` bytes after it; `None`
    /// when the block is not plain (the caller reads it whole and decodes it).
    pub fn start(
        header: &[u8; HEADER_BYTES],
        payload_len: usize,
        key: &str,
    ) -> Result<Option<PlainStream>> {
        let head = Head::parse(header, payload_len, key)?;
        let plain = head.codec == CODEC_NONE && head.level == 0 && head.filter == 0;
        if !plain || head.raw_len != payload_len as u64 {
            return Ok(None);
        }
        let mut hasher = Xxh3::new();
        hasher.update(&header[..CHECKED_HEADER]);
        Ok(Some(PlainStream {
            key: key.to_string(),
            expected: u64_at(header, CHECKED_HEADER),
            hasher,
            raw_len: payload_len,
        }))
    }

    /// Bytes of the block's data (its payload).
    pub fn raw_len(&self) -> usize {
        self.raw_len
    }

    /// The next bytes of the payload.
    pub fn update(&mut self, payload: &[u8]) {
        self.hasher.update(payload);
    }

    /// Compares the checksum of everything given to [`update`](Self::update).
    pub fn finish(self) -> Result<()> {
        let actual = self.hasher.digest();
        if actual != self.expected {
            return Err(Error::Corrupt {
                key: self.key,
                detail: format!(
                    "checksum mismatch: stored {:#018x}, computed {actual:#018x}",
                    self.expected
                ),
            });
        }
        Ok(())
    }
}

/// A stored block whose framing was read but whose checksum is not yet checked.
struct Framed<'a> {
    key: &'a str,
    header: &'a [u8; HEADER_BYTES],
    payload: &'a [u8],
    /// The fields checked below the checksum (a bad one is a writer bug, reported only once
    /// the checksum holds).
    fields: Result<Frame<'a>>,
}

impl<'a> Framed<'a> {
    fn parse(
        header: &'a [u8; HEADER_BYTES],
        payload: &'a [u8],
        key: &'a str,
    ) -> Result<Framed<'a>> {
        let corrupt = |detail: String| Error::Corrupt {
            key: key.to_string(),
            detail,
        };
        let Head {
            codec,
            level,
            filter,
            raw_len,
        } = Head::parse(header, payload.len(), key)?;

        // Below the checksum, a bad field means a writer bug rather than a flipped bit;
        // still an error, never a panic.
        let fields = (|| {
            let raw_len = usize::try_from(raw_len)
                .map_err(|_| corrupt(format!("raw length {raw_len} does not fit in memory")))?;
            if codec != CODEC_ZSTD && level != 0 {
                return Err(corrupt(format!("level {level} recorded for codec {codec}")));
            }
            match codec {
                CODEC_NONE if filter != 0 || payload.len() != raw_len => Err(corrupt(format!(
                    "raw block with filter {filter}, {} payload bytes for raw length {raw_len}",
                    payload.len()
                ))),
                CODEC_NONE | CODEC_LZ4 | CODEC_ZSTD => Ok(Frame {
                    key,
                    codec,
                    filter,
                    raw_len,
                    payload,
                }),
                other => Err(corrupt(format!("unknown codec id {other}"))),
            }
        })();
        Ok(Framed {
            key,
            header,
            payload,
            fields,
        })
    }

    fn check_sum(&self) -> Result<()> {
        let expected = u64_at(self.header, CHECKED_HEADER);
        let actual = checksum(self.header, self.payload);
        if actual != expected {
            return Err(Error::Corrupt {
                key: self.key.to_string(),
                detail: format!(
                    "checksum mismatch: stored {expected:#018x}, computed {actual:#018x}"
                ),
            });
        }
        Ok(())
    }
}

impl Frame<'_> {
    /// Bytes of the block's data.
    pub fn raw_len(&self) -> usize {
        self.raw_len
    }

    /// The stored bytes when they are the block itself (neither compressed nor filtered).
    pub fn plain_payload(&self) -> Option<&[u8]> {
        (self.codec == CODEC_NONE && self.filter <= 1).then_some(self.payload)
    }

    /// Writes the block's data into `out` (exactly [`raw_len`](Self::raw_len) bytes).
    pub fn decode_into(&self, out: &mut [u8]) -> Result<()> {
        let corrupt = |detail: String| Error::Corrupt {
            key: self.key.to_string(),
            detail,
        };
        if out.len() != self.raw_len {
            return Err(Error::LengthMismatch {
                op: "tier block decode",
                left: out.len(),
                right: self.raw_len,
            });
        }
        let raw_len = self.raw_len;
        // A filtered block decompresses into a buffer of its own, then unshuffles into `out`.
        let mut filtered = Vec::new();
        let target: &mut [u8] = if self.filter > 1 {
            filtered.resize(raw_len, 0);
            &mut filtered
        } else {
            &mut *out
        };
        match self.codec {
            CODEC_NONE => target.copy_from_slice(self.payload),
            CODEC_LZ4 => {
                let n = lz4_flex::block::decompress_into(self.payload, target)
                    .map_err(|e| corrupt(format!("lz4: {e}")))?;
                if n != raw_len {
                    return Err(corrupt(format!(
                        "lz4 gave {n} bytes, raw length is {raw_len}"
                    )));
                }
            }
            _ => {
                let n = zstd::bulk::decompress_to_buffer(self.payload, target)
                    .map_err(|e| corrupt(format!("zstd: {e}")))?;
                if n != raw_len {
                    return Err(corrupt(format!(
                        "zstd gave {n} bytes, raw length is {raw_len}"
                    )));
                }
            }
        }
        if self.filter > 1 {
            let mut plain = Vec::new();
            unshuffle(&filtered, usize::from(self.filter), &mut plain);
            out.copy_from_slice(&plain);
        }
        Ok(())
    }
}

/// Byte-shuffle `data` by element `width` into `out` (cleared first): every element's first
/// byte, then every second byte, and so on; a tail shorter than one element is copied last as
/// it is. Widths 0 and 1 copy.
pub fn shuffle(data: &[u8], width: usize, out: &mut Vec<u8>) {
    out.clear();
    if width == 2 {
        // bf16 / f16: one pass that the compiler vectorizes (the general loop below gathers
        // a byte at a time: 0.43 GB/s on the build VM).
        let n = data.len() / 2;
        out.resize(data.len(), 0);
        let (low, rest) = out.split_at_mut(n);
        let (high, tail) = rest.split_at_mut(n);
        for ((pair, l), h) in data.chunks_exact(2).zip(low).zip(high.iter_mut()) {
            *l = pair[0];
            *h = pair[1];
        }
        tail.copy_from_slice(&data[2 * n..]);
        return;
    }
    out.reserve(data.len());
    let width = width.max(1);
    let body = data.len() - data.len() % width;
    for byte in 0..width {
        out.extend(
            data[..body]
                .chunks_exact(width)
                .map(|element| element[byte]),
        );
    }
    out.extend_from_slice(&data[body..]);
}

/// The inverse of [`shuffle`] with the same `width`, into `out` (cleared first).
pub fn unshuffle(data: &[u8], width: usize, out: &mut Vec<u8>) {
    out.clear();
    out.resize(data.len(), 0);
    if width == 2 {
        let n = data.len() / 2;
        let (low, rest) = data.split_at(n);
        let (high, tail) = rest.split_at(n);
        for ((pair, &l), &h) in out.chunks_exact_mut(2).zip(low).zip(high) {
            pair[0] = l;
            pair[1] = h;
        }
        out[2 * n..].copy_from_slice(tail);
        return;
    }
    let width = width.max(1);
    let elements = data.len() / width;
    let body = elements * width;
    for (byte, plane) in data[..body].chunks_exact(elements.max(1)).enumerate() {
        for (element, &value) in out[..body].chunks_exact_mut(width).zip(plane) {
            element[byte] = value;
        }
    }
    out[body..].copy_from_slice(&data[body..]);
}

/// The frame's one-byte record of a zstd level, refusing levels zstd lacks or one byte cannot
/// hold.
fn zstd_level_byte(level: i32) -> Result<u8> {
    match i8::try_from(level) {
        Ok(byte) if zstd::compression_level_range().contains(&level) => Ok(byte as u8),
        _ => Err(Error::InvalidArgument(format!(
            "tier block: zstd level {level} outside -128..={}",
            zstd::compression_level_range().end()
        ))),
    }
}

/// A header with every field but the checksum (zeros there).
fn frame_fields(
    codec: u8,
    level: u8,
    filter: u8,
    raw_len: usize,
    payload_len: usize,
) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[..4].copy_from_slice(&MAGIC);
    header[4] = VERSION;
    header[5] = codec;
    header[6] = level;
    header[7] = filter;
    header[8..16].copy_from_slice(&(raw_len as u64).to_le_bytes());
    header[16..24].copy_from_slice(&(payload_len as u64).to_le_bytes());
    header
}

fn frame<'a>(
    codec: u8,
    level: u8,
    filter: u8,
    raw_len: usize,
    payload: std::borrow::Cow<'a, [u8]>,
) -> Encoded<'a> {
    let mut header = frame_fields(codec, level, filter, raw_len, payload.len());
    let sum = checksum(&header, &payload);
    header[24..32].copy_from_slice(&sum.to_le_bytes());
    Encoded { header, payload }
}

fn checksum(header: &[u8; HEADER_BYTES], payload: &[u8]) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(&header[..CHECKED_HEADER]);
    hasher.update(payload);
    hasher.digest()
}

fn u64_at(header: &[u8; HEADER_BYTES], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&header[at..at + 8]);
    u64::from_le_bytes(bytes)
}
