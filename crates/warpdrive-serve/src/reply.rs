//! A job's 200 reply in its request's format. An f32 tensor reply is its 16-byte header and
//! then the job's rows read in place from the batch's output (no copy, no per-value work);
//! a bf16 one converts each value; a JSON one formats each value (the client asked for it).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde::Serialize;

use super::batcher::{BatchStats, Rows};
use super::http::{reply, Body};
use super::wire::{self, Dtype, Format};

/// The JSON reply, serialized from the rows in place (the client reads it as
/// [`wire::JsonReply`]).
#[derive(Serialize)]
struct JsonReplyRef<'a> {
    rows: usize,
    data: &'a [f32],
    batch_rows: usize,
    submit_us: f64,
    queue_us: f64,
    run_us: f64,
    accepted_unix_us: u64,
    replied_unix_us: u64,
}

/// The 200 reply of a job of `rows` rows in `format`, whose request's headers were accepted
/// at `accepted_unix_us` (the service's wall clock, [`wire::unix_us_now`]).
pub(crate) fn answer(
    format: Format,
    rows: usize,
    data: Rows,
    stats: BatchStats,
    (submit_us, accepted_unix_us): (f64, u64),
) -> Response<Body> {
    let too_large = || format!("{rows} rows do not fit a tensor");
    let made = match format {
        Format::Json => serde_json::to_vec(&JsonReplyRef {
            rows,
            data: data.as_slice(),
            batch_rows: stats.batch_rows,
            submit_us,
            queue_us: stats.queue_us,
            run_us: stats.run_us,
            accepted_unix_us,
            replied_unix_us: wire::unix_us_now(),
        })
        .map(|b| reply(StatusCode::OK, b))
        .map_err(|e| e.to_string()),
        Format::Binary(Dtype::F32) if cfg!(target_endian = "little") => TensorBody::new(rows, data)
            .map(|b| {
                let mut r = Response::new(b.boxed());
                *r.status_mut() = StatusCode::OK;
                r
            })
            .ok_or_else(too_large),
        Format::Binary(dtype) => wire::encode_binary(dtype, rows, data.as_slice())
            .map(|b| reply(StatusCode::OK, b))
            .ok_or_else(too_large),
    };
    let mut r = match made {
        Ok(r) => r,
        Err(e) => {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding: {e}\n"),
            )
        }
    };
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(format.content_type()),
    );
    if let Format::Binary(_) = format {
        for (name, v) in [
            (wire::BATCH_ROWS_HEADER, stats.batch_rows as f64),
            (wire::SUBMIT_US_HEADER, submit_us),
            (wire::QUEUE_US_HEADER, stats.queue_us),
            (wire::RUN_US_HEADER, stats.run_us),
        ] {
            if let Ok(v) = HeaderValue::from_str(&format!("{v:.1}")) {
                h.insert(name, v);
            }
        }
    }
    // Last, so the stamp is as near as this code gets to hyper's write.
    h.insert(
        wire::ACCEPTED_UNIX_US_HEADER,
        HeaderValue::from(accepted_unix_us),
    );
    h.insert(
        wire::REPLIED_UNIX_US_HEADER,
        HeaderValue::from(wire::unix_us_now()),
    );
    r
}

/// An f32 tensor reply's body: its header, then the rows in place (little-endian hosts).
struct TensorBody {
    header: Option<Bytes>,
    rows: Option<Rows>,
}

impl TensorBody {
    /// `None` when a size does not fit the header.
    fn new(rows: usize, data: Rows) -> Option<TensorBody> {
        let header = wire::tensor_header(Dtype::F32, rows, data.as_slice().len())?;
        Some(TensorBody {
            header: Some(Bytes::copy_from_slice(&header)),
            rows: Some(data),
        })
    }
}

/// A job's rows as the bytes of a little-endian f32 tensor.
struct RowBytes(Rows);

impl AsRef<[u8]> for RowBytes {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_slice())
    }
}

impl hyper::body::Body for TensorBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let next = this
            .header
            .take()
            .or_else(|| this.rows.take().map(|r| Bytes::from_owner(RowBytes(r))));
        Poll::Ready(next.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.header.is_none() && self.rows.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let header = self.header.as_ref().map_or(0, Bytes::len);
        let rows = self
            .rows
            .as_ref()
            .map_or(0, |r| std::mem::size_of_val(r.as_slice()));
        SizeHint::with_exact(header.saturating_add(rows) as u64)
    }
}
