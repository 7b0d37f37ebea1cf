//! The job bodies on the wire, shared by the service and the client: JSON, and a binary
//! little-endian tensor.
//!
//! - JSON (`application/json`, the default): a job is `{"rows": R, "data": [R × width
//!   numbers]}`; a reply adds `batch_rows`, `submit_us`, `queue_us` and `run_us`.
//! - Binary (`application/x-warpdrive-tensor`): a 16-byte header, then the values.
//!
//!   | bytes | field |
//!   |---|---|
//!   | 0..4 | magic `WDT1` |
//!   | 4 | dtype: 1 = f32, 2 = bf16 |
//!   | 5..8 | zero |
//!   | 8..12 | rows, u32 little-endian |
//!   | 12..16 | width (values per row), u32 little-endian |
//!   | 16.. | rows × width values, little-endian, row after row |
//!
//!   A reply is a tensor of the same dtype and shape; its batch facts travel in the
//!   `x-warpdrive-batch-rows`, `-submit-us`, `-queue-us` and `-run-us` headers.
//!
//! Every 200 job reply also carries the service's wall clock in the
//! `x-warpdrive-accepted-unix-us` and `-replied-unix-us` headers (a JSON reply has them as
//! `accepted_unix_us` and `replied_unix_us` fields too, the latter taken before encoding).
//!
//! Decoding checks every size with checked arithmetic before touching the data, and every
//! value for being finite; a bad body is a [`BadBody`] with a one-line reason. An f32 tensor
//! decodes and encodes as one copy of its bytes (`bytemuck`, on little-endian hosts): a
//! 256-row job of the qwen3 layer is 2 MiB, where a per-value loop costs milliseconds.

use half::bf16;
use serde::{Deserialize, Serialize};

/// The binary body's content type.
pub const TENSOR_TYPE: &str = "application/x-warpdrive-tensor";
/// The JSON body's content type.
pub const JSON_TYPE: &str = "application/json";
/// The binary header's first four bytes.
pub const MAGIC: [u8; 4] = *b"WDT1";
/// The binary header's length.
pub const HEADER_BYTES: usize = 16;

/// The reply headers that carry a binary reply's batch facts.
pub const BATCH_ROWS_HEADER: &str = "x-warpdrive-batch-rows";
pub const SUBMIT_US_HEADER: &str = "x-warpdrive-submit-us";
pub const QUEUE_US_HEADER: &str = "x-warpdrive-queue-us";
pub const RUN_US_HEADER: &str = "x-warpdrive-run-us";
/// The reply headers (on every 200 job reply, JSON or binary) that carry the service's wall
/// clock, µs since the Unix epoch: when the request's headers were accepted, and when the
/// reply was handed to hyper. Against the client's own clock on the same host they split a
/// job's time into to-the-service, inside, and back.
pub const ACCEPTED_UNIX_US_HEADER: &str = "x-warpdrive-accepted-unix-us";
pub const REPLIED_UNIX_US_HEADER: &str = "x-warpdrive-replied-unix-us";

/// This host's wall clock, µs since the Unix epoch (0 before it; exact in an f64 for the
/// next quarter of a million years).
pub fn unix_us_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A value type of the binary body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    fn code(self) -> u8 {
        match self {
            Dtype::F32 => 1,
            Dtype::Bf16 => 2,
        }
    }

    fn from_code(code: u8) -> Option<Dtype> {
        match code {
            1 => Some(Dtype::F32),
            2 => Some(Dtype::Bf16),
            _ => None,
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

/// How a body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Binary(Dtype),
}

impl Format {
    /// The content type of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Json => JSON_TYPE,
            Format::Binary(_) => TENSOR_TYPE,
        }
    }
}

/// Why a body was refused: the reason, one line. `unsupported` marks a content type the
/// service does not take (415), anything else is a malformed body (400).
#[derive(Debug, Clone, PartialEq)]
pub struct BadBody {
    pub why: String,
    pub unsupported: bool,
}

fn bad(why: impl Into<String>) -> BadBody {
    BadBody {
        why: why.into(),
        unsupported: false,
    }
}

/// A job's rows, decoded: `data` holds `rows × width` finite values, and `format` says how
/// its reply is encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub rows: usize,
    pub data: Vec<f32>,
    pub format: Format,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonJob {
    rows: usize,
    data: Vec<f32>,
}

/// The JSON reply.
#[derive(Debug, Serialize, Deserialize)]
pub struct JsonReply {
    pub rows: usize,
    pub data: Vec<f32>,
    pub batch_rows: usize,
    /// µs from the request's headers being read to the job being queued.
    pub submit_us: f64,
    pub queue_us: f64,
    pub run_us: f64,
    /// The service's wall clock (µs since the Unix epoch) when the request's headers were
    /// accepted and when the reply was encoded (the [`REPLIED_UNIX_US_HEADER`] header has
    /// the moment it was handed to hyper, after the encoding); absent from older services.
    #[serde(default)]
    pub accepted_unix_us: Option<u64>,
    #[serde(default)]
    pub replied_unix_us: Option<u64>,
}

/// The format a `Content-Type` names (none: JSON).
pub fn format_of(content_type: Option<&str>) -> Result<Format, BadBody> {
    let Some(t) = content_type else {
        return Ok(Format::Json);
    };
    let essence = t.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case(JSON_TYPE) {
        Ok(Format::Json)
    } else if essence.eq_ignore_ascii_case(TENSOR_TYPE) {
        // The dtype comes from the header.
        Ok(Format::Binary(Dtype::F32))
    } else {
        Err(BadBody {
            why: format!("content type {essence:?}: expected {JSON_TYPE} or {TENSOR_TYPE}"),
            unsupported: true,
        })
    }
}

/// Decodes a job body of `format` for a model of `width` values per row.
pub fn decode(format: Format, body: &[u8], width: usize) -> Result<Tensor, BadBody> {
    let t = match format {
        Format::Json => {
            let j: JsonJob =
                serde_json::from_slice(body).map_err(|e| bad(format!("not a job: {e}")))?;
            Tensor {
                rows: j.rows,
                data: j.data,
                format,
            }
        }
        Format::Binary(_) => decode_binary(body, width)?,
    };
    if t.rows == 0 || t.rows.checked_mul(width) != Some(t.data.len()) {
        return Err(bad(format!(
            "{} values are not {} rows of {width}",
            t.data.len(),
            t.rows
        )));
    }
    // The branch-free pass first (it vectorizes); the position only for the message.
    if !t.data.iter().fold(true, |ok, v| ok & v.is_finite()) {
        let i = t.data.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(bad(format!("value {i} is not finite")));
    }
    Ok(t)
}

fn decode_binary(body: &[u8], width: usize) -> Result<Tensor, BadBody> {
    let Some(header) = body.get(..HEADER_BYTES) else {
        return Err(bad(format!(
            "a tensor body of {} bytes: shorter than its {HEADER_BYTES}-byte header",
            body.len()
        )));
    };
    if header[..4] != MAGIC {
        return Err(bad("a tensor body without the WDT1 magic"));
    }
    let dtype = Dtype::from_code(header[4]).ok_or_else(|| {
        bad(format!(
            "tensor dtype {}: expected 1 (f32) or 2 (bf16)",
            header[4]
        ))
    })?;
    let word = |at: usize| {
        u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let (rows, w) = (word(8) as usize, word(12) as usize);
    if w != width {
        return Err(bad(format!(
            "tensor rows of {w} values: the model takes {width}"
        )));
    }
    let bytes = rows
        .checked_mul(w)
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| bad(format!("a {rows} × {w} tensor overflows")))?;
    let values = &body[HEADER_BYTES..];
    if values.len() != bytes {
        return Err(bad(format!(
            "a {rows} × {w} {dtype:?} tensor is {bytes} bytes; the body holds {}",
            values.len()
        )));
    }
    let data = match dtype {
        Dtype::F32 => f32_from_le(values),
        Dtype::Bf16 => values
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    };
    Ok(Tensor {
        rows,
        data,
        format: Format::Binary(dtype),
    })
}

/// Little-endian f32 bytes (a multiple of 4) as values: one copy on a little-endian host.
fn f32_from_le(bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / 4;
    let mut v = vec![0f32; n];
    bytemuck::cast_slice_mut::<f32, u8>(&mut v).copy_from_slice(&bytes[..n * 4]);
    if cfg!(target_endian = "big") {
        v.iter_mut()
            .for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
    }
    v
}

/// The width a binary body's header names (`None` when the body is shorter than a header
/// or lacks the magic).
pub fn tensor_width(body: &[u8]) -> Option<usize> {
    let h = body.get(..HEADER_BYTES)?;
    (h[..4] == MAGIC).then(|| u32::from_le_bytes([h[12], h[13], h[14], h[15]]) as usize)
}

/// The binary body of `rows` rows of `data` as `dtype` (`None` when a size does not fit
/// the header's u32 fields or `data` is not whole rows).
pub fn encode_binary(dtype: Dtype, rows: usize, data: &[f32]) -> Option<Vec<u8>> {
    let header = tensor_header(dtype, rows, data.len())?;
    let mut out =
        Vec::with_capacity(HEADER_BYTES.checked_add(data.len().checked_mul(dtype.size())?)?);
    out.extend_from_slice(&header);
    match dtype {
        Dtype::F32 if cfg!(target_endian = "little") => {
            out.extend_from_slice(bytemuck::cast_slice(data))
        }
        Dtype::F32 => data
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        Dtype::Bf16 => data
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes())),
    }
    Some(out)
}

/// The header of a tensor of `rows` rows of `values` values in all (`None` when a size does
/// not fit its u32 fields or the values are not whole rows).
pub fn tensor_header(dtype: Dtype, rows: usize, values: usize) -> Option<[u8; HEADER_BYTES]> {
    let width = values.checked_div(rows).unwrap_or(0);
    if rows.checked_mul(width) != Some(values) {
        return None;
    }
    let (r, w) = (u32::try_from(rows).ok()?, u32::try_from(width).ok()?);
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = dtype.code();
    h[8..12].copy_from_slice(&r.to_le_bytes());
    h[12..16].copy_from_slice(&w.to_le_bytes());
    Some(h)
}

/// The JSON body of a job.
pub fn encode_json(rows: usize, data: &[f32]) -> Vec<u8> {
    // Straight from the slice: a `json!` value tree costs ~7× more on a 256-row job.
    #[derive(Serialize)]
    struct JobRef<'a> {
        rows: usize,
        data: &'a [f32],
    }
    serde_json::to_vec(&JobRef { rows, data }).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_round_trips_in_both_dtypes() {
        let data: Vec<f32> = (0..12).map(|i| i as f32 / 4.0 - 1.0).collect();
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let body = encode_binary(dtype, 3, &data).unwrap();
            assert_eq!(body.len(), HEADER_BYTES + 12 * dtype.size());
            let t = decode(Format::Binary(Dtype::F32), &body, 4).unwrap();
            assert_eq!((t.rows, t.format), (3, Format::Binary(dtype)));
            assert_eq!(t.data, data, "{dtype:?} (these values are exact in bf16)");
        }
    }

    #[test]
    fn bad_binary_bodies_say_why() {
        let good = encode_binary(Dtype::F32, 2, &[1.0; 8]).unwrap();
        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut dtype = good.clone();
        dtype[4] = 9;
        let mut magic = good.clone();
        magic[0] = b'X';
        let mut nan = good.clone();
        nan[16..20].copy_from_slice(&f32::NAN.to_le_bytes());
        for (body, width, why) in [
            (&good[..5], 4, "shorter than"),
            (&good[..20], 4, "the body holds 4"),
            (&good[..], 3, "the model takes 3"),
            (&huge[..], 4, "the body holds 32"),
            (&dtype[..], 4, "dtype 9"),
            (&magic[..], 4, "magic"),
            (&nan[..], 4, "not finite"),
        ] {
            let e = decode(Format::Binary(Dtype::F32), body, width).unwrap_err();
            assert!(e.why.contains(why), "{}", e.why);
        }
    }

    proptest::proptest! {
        /// Any bytes decode to a job or a reason, never a panic; a decoded job is whole rows
        /// of finite values.
        #[test]
        fn any_bytes_decode_or_say_why(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96),
            header in proptest::prelude::any::<bool>(),
            width in 1usize..5,
        ) {
            let mut body = body;
            if header && body.len() >= 4 {
                body[..4].copy_from_slice(&MAGIC);
            }
            for format in [Format::Json, Format::Binary(Dtype::F32)] {
                if let Ok(t) = decode(format, &body, width) {
                    proptest::prop_assert_eq!(t.data.len(), t.rows * width);
                    proptest::prop_assert!(t.data.iter().all(|v| v.is_finite()));
                }
            }
        }
    }

    #[test]
    fn content_types_pick_the_format() {
        assert_eq!(format_of(None).unwrap(), Format::Json);
        assert_eq!(
            format_of(Some("application/json; charset=utf-8")).unwrap(),
            Format::Json
        );
        assert!(matches!(
            format_of(Some(TENSOR_TYPE)).unwrap(),
            Format::Binary(_)
        ));
        assert!(format_of(Some("text/plain")).unwrap_err().unsupported);
    }
}
