//! MatrixOps: a GEMM with its epilogue fused, `out = act(a · b + bias) + residual`.
//!
//! Where cuBLASLt has the epilogue (a bias, with GELU in its tanh form or none, no residual,
//! bf16 or f16), the whole thing is one cuBLASLt matmul: the epilogue runs inside the GEMM
//! kernel on its f32 accumulators (a shape cuBLASLt finds no algorithm for takes the other
//! way). With a residual as well, cuBLASLt's GEMM adds the bias and one generated kernel
//! applies the activation and adds the residual; a product larger than a share of L2 is
//! computed in chunks of rows ([`Chunks`]), each chunk's epilogue kernel right after its
//! GEMM, so the kernel reads the chunk back from L2 rather than DRAM
//! ([`matmul_epilogue_overlapped`]: the epilogues on a second stream, beside the next
//! chunk's GEMM). Otherwise the GEMM
//! (cuBLAS) writes the product once and one generated kernel applies the whole epilogue
//! (bias, activation, residual, cast) in a single read and write. The CPU backend computes
//! the product (f32 accumulation) and the epilogue in f64 (in the same chunks where
//! [`Chunks::Rows`] asks for them).

use crate::device::{BiasGemm, Event, Queue, Stream};
use crate::dtype::{DTypeKind, Float};
use crate::error::{Error, Result};
use crate::memory::{check_len, Buffer};
use crate::ops::{gemm, Activation};

use super::expr::{Elements, Expr};

/// The workspace cuBLASLt may use for one GEMM: what torch gives it on Hopper (32 MiB), which
/// lets its heuristic choose the kernels it chooses there (no workspace rules out split-K and
/// some larger-tile kernels).
const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// [`Chunks::Auto`] keeps a chunk's product within this fraction of L2 (a fifth: the GEMM's
/// tiles of `a` and `b`, the residual read and the output written stream through the rest
/// meanwhile, and the chunk must still be there when the epilogue reads it).
const L2_SHARE: usize = 5;

/// [`Chunks::Auto`]'s chunks are whole multiples of this many rows: cuBLAS's Hopper tiles
/// span 128 or 256 rows of the product, so a chunk adds no partial tiles.
const CHUNK_ROW_ALIGN: usize = 256;

/// How [`matmul_epilogue_with`] splits the GEMM along the product's rows where a residual
/// follows it and cuBLASLt runs the GEMM with the bias inside (bf16 or f16, a bias, GELU
/// (tanh) or no activation): each chunk's GEMM, then the epilogue kernel over that chunk,
/// which then reads the chunk's product back from L2 instead of DRAM (the whole 4096² bf16
/// product is 32 MiB: its round trip is ~10 µs on an H100). Other epilogues ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunks {
    /// From the shape and the device's L2 (what [`matmul_epilogue`] uses): no chunks where
    /// the whole product fits a fifth of L2 (or on the CPU backend); else the fewest even
    /// chunks of a multiple of 256 rows that each fit it (4096×4096 bf16 on a 50 MiB L2:
    /// four chunks of 1024 rows).
    #[default]
    Auto,
    /// One GEMM over all rows, then one epilogue kernel (the product goes through DRAM).
    Whole,
    /// Chunks of this many rows (the last one shorter where they do not divide the rows);
    /// 0 is an error. The CPU backend runs these chunks too.
    Rows(usize),
}

impl Chunks {
    /// The rows of a chunk of an m×n product of `T` on `stream`'s device; `None`: one GEMM
    /// over all rows.
    pub fn rows<T: Float>(self, stream: &Stream, (m, n): (usize, usize)) -> Result<Option<usize>> {
        match self {
            Chunks::Whole => Ok(None),
            Chunks::Rows(0) => Err(Error::InvalidArgument(
                "matmul_epilogue: chunks of 0 rows".into(),
            )),
            Chunks::Rows(rows) => Ok((rows < m).then_some(rows)),
            Chunks::Auto => {
                let l2 = stream.run((), |()| Ok(0), |(), q| q.gpu.l2_cache_bytes())?;
                Ok(auto_rows(l2, (m, n), std::mem::size_of::<T>()))
            }
        }
    }
}

/// [`Chunks::Auto`]'s rule for an m×n product of `elem`-byte elements and `l2_bytes` of L2
/// (0: none known, no chunks).
fn auto_rows(l2_bytes: usize, (m, n): (usize, usize), elem: usize) -> Option<usize> {
    let budget = l2_bytes / L2_SHARE;
    let row_bytes = n.checked_mul(elem).filter(|&b| b > 0)?;
    if budget == 0 || m.checked_mul(row_bytes).is_some_and(|b| b <= budget) {
        return None;
    }
    let most = (budget / row_bytes / CHUNK_ROW_ALIGN * CHUNK_ROW_ALIGN).max(CHUNK_ROW_ALIGN);
    let rows = m
        .div_ceil(m.div_ceil(most))
        .div_ceil(CHUNK_ROW_ALIGN)
        .checked_mul(CHUNK_ROW_ALIGN)?;
    (rows < m).then_some(rows)
}

/// What follows the product in [`matmul_epilogue`].
#[derive(Debug, Clone, Copy)]
pub struct Epilogue<'a, T: Float> {
    /// One value per column of the product (n), added to every row.
    pub bias: Option<&'a Buffer<T>>,
    pub act: Activation,
    /// An m×n matrix added after the activation.
    pub residual: Option<&'a Buffer<T>>,
}

impl<'a, T: Float> Epilogue<'a, T> {
    /// `act(x + bias)`.
    pub fn bias(bias: &'a Buffer<T>, act: Activation) -> Epilogue<'a, T> {
        Epilogue {
            bias: Some(bias),
            act,
            residual: None,
        }
    }

    /// This epilogue with `residual` added last.
    pub fn with_residual(self, residual: &'a Buffer<T>) -> Epilogue<'a, T> {
        Epilogue {
            residual: Some(residual),
            ..self
        }
    }

    /// Whether cuBLASLt runs this epilogue inside the GEMM.
    pub fn in_cublaslt(&self) -> bool {
        self.bias.is_some()
            && self.residual.is_none()
            && matches!(self.act, Activation::None | Activation::GeluTanh)
            && matches!(T::KIND, DTypeKind::BF16 | DTypeKind::F16)
    }
}

/// `out = act(a · b + bias) + residual` for row-major `a` (m×k), `b` (k×n), `out` (m×n), with
/// `mnk = (m, n, k)`: one cuBLASLt matmul where [`Epilogue::in_cublaslt`], else the GEMM and
/// one fused epilogue kernel (the product in a buffer of the pool; with a residual after
/// cuBLASLt's GEMM, in chunks of rows as [`Chunks::Auto`] chooses). f32, f16, bf16 (cuBLASLt
/// for the 16-bit types).
pub fn matmul_epilogue<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    mnk: (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    matmul_epilogue_with(stream, a, b, mnk, epilogue, Chunks::Auto, out)
}

/// [`matmul_epilogue`] with the residual path's chunks as `chunks` says (to compare them, or
/// to pin one).
pub fn matmul_epilogue_with<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    mnk: (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    chunks: Chunks,
    out: &mut Buffer<T>,
) -> Result<()> {
    run_epilogue((stream, None), a, b, mnk, epilogue, chunks, out)
}

/// [`matmul_epilogue_with`] with each chunk's epilogue kernel enqueued on `side` (a stream of
/// the caller's on the same device), so it may run beside the next chunk's GEMM on `stream`
/// (the product in two buffers taking turns); events order the two: each epilogue after its
/// chunk's GEMM, a GEMM after the epilogue that last read its buffer, and `stream`'s later
/// work after the last epilogue, so to the caller it is all `stream`'s work. Where no chunks
/// run (one chunk, no residual, another epilogue), `side` is not used.
#[allow(clippy::too_many_arguments)]
pub fn matmul_epilogue_overlapped<T: Float>(
    stream: &Stream,
    side: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    mnk: (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    chunks: Chunks,
    out: &mut Buffer<T>,
) -> Result<()> {
    side.device()
        .same_as(stream.device(), "matmul_epilogue_overlapped")?;
    run_epilogue((stream, Some(side)), a, b, mnk, epilogue, chunks, out)
}

/// The body of [`matmul_epilogue_with`] and [`matmul_epilogue_overlapped`] (`side`: where the
/// chunks' epilogues go, if not on `stream`).
fn run_epilogue<T: Float>(
    (stream, side): (&Stream, Option<&Stream>),
    a: &Buffer<T>,
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    chunks: Chunks,
    out: &mut Buffer<T>,
) -> Result<()> {
    let size = |what: &str, x: usize, y: usize| {
        x.checked_mul(y).ok_or_else(|| {
            Error::InvalidArgument(format!("matmul_epilogue: {what} {x}×{y} overflows"))
        })
    };
    let (mk, kn, mn) = (size("a", m, k)?, size("b", k, n)?, size("out", m, n)?);
    a.check_stream(stream, "matmul_epilogue")?;
    b.check_stream(stream, "matmul_epilogue")?;
    out.check_stream(stream, "matmul_epilogue")?;
    check_len("matmul_epilogue (a)", a.len(), mk)?;
    check_len("matmul_epilogue (b)", b.len(), kn)?;
    check_len("matmul_epilogue (out)", out.len(), mn)?;
    if let Some(bias) = epilogue.bias {
        bias.check_stream(stream, "matmul_epilogue")?;
        check_len("matmul_epilogue (bias)", bias.len(), n)?;
    }
    if let Some(r) = epilogue.residual {
        r.check_stream(stream, "matmul_epilogue")?;
        check_len("matmul_epilogue (residual)", r.len(), mn)?;
    }
    // Checked even where the epilogue ignores it: one error for one mistake.
    let rows = chunks.rows::<T>(stream, (m, n))?;
    if mn == 0 {
        return Ok(());
    }
    // cuBLASLt is not asked for an empty product (k = 0): the epilogue of zeros.
    if !lt_head(epilogue) || k == 0 {
        return two_kernels(stream, a, b, (m, n, k), epilogue, out);
    }
    stream.run(
        out,
        |out| match rows {
            // The CPU backend runs the same chunks (the views and offsets the GPU path
            // uses), each chunk's product from a copy of its rows of `a`.
            Some(rows) if epilogue.residual.is_some() => chunked(
                (stream, side),
                (m, n),
                rows,
                epilogue,
                false,
                out,
                |first, mc, product| rows_product(stream, (a, first), b, (mc, n, k), product),
            ),
            _ => two_kernels(stream, a, b, (m, n, k), epilogue, out),
        },
        |out, q| {
            let workspace = workspace(stream);
            let ws = workspace.as_ref();
            let r = if epilogue.residual.is_none() {
                lt_gemm(q, (a, 0), b, (m, n, k), epilogue, out, ws)
            } else {
                // A residual: cuBLASLt's GEMM with only the bias inside it, then one kernel
                // applies the activation and adds the residual (same bytes as GELU inside the
                // GEMM and a kernel adding the residual, and measured faster: bench/NOTES.md),
                // chunk by chunk (one chunk of all rows unless `rows`).
                let bias_only = Epilogue {
                    act: Activation::None,
                    residual: None,
                    ..*epilogue
                };
                let rows = rows.unwrap_or(m);
                chunked(
                    (stream, side),
                    (m, n),
                    rows,
                    epilogue,
                    true,
                    out,
                    |first, mc, product| {
                        lt_gemm(q, (a, first), b, (mc, n, k), &bias_only, product, ws)
                    },
                )
            };
            match r {
                // Found at the first chunk, or at a shorter last one: every row of `out` is
                // written again, from inputs `out` does not overlap.
                Err(e) if no_lt_algo(&e) => two_kernels(stream, a, b, (m, n, k), epilogue, out),
                r => r,
            }
        },
    )
}

/// The epilogue `rows` rows at a time (the last chunk shorter where they do not divide `m`):
/// `head(first, mc, product)` writes rows `first .. first + mc` of `a · b` (with the bias
/// where `bias_in_head`) into the first `mc` rows of `product`, a buffer of `rows` rows
/// that the chunks reuse; then one generated kernel reads them and the residual's same rows
/// (views: `Elements`) and writes those rows of `out`. The heads run on `stream`; the
/// epilogues there too, or with a `side` stream on it, ordered by events (see
/// [`matmul_epilogue_overlapped`]).
fn chunked<T: Float>(
    (stream, side): (&Stream, Option<&Stream>),
    (m, n): (usize, usize),
    rows: usize,
    epilogue: &Epilogue<'_, T>,
    bias_in_head: bool,
    out: &mut Buffer<T>,
    mut head: impl FnMut(usize, usize, &mut Buffer<T>) -> Result<()>,
) -> Result<()> {
    let rows = rows.clamp(1, m.max(1));
    // Only where there are chunks to overlap.
    let side = side.filter(|_| rows < m);
    // rows ≤ m, so rows · n ≤ m · n, which the caller checked.
    let mut products = vec![Buffer::<T>::uninit(stream, rows * n)?];
    let mut order = None;
    if let Some(side) = side {
        let mut second = Buffer::<T>::uninit(stream, rows * n)?;
        // Read on `side`: freed only once its work is done.
        products[0].record_stream(side)?;
        second.record_stream(side)?;
        products.push(second);
        let dev = stream.device();
        order = Some(Order {
            side,
            gemm: dev.new_sync_event()?,
            read: [dev.new_sync_event()?, dev.new_sync_event()?],
            last: None,
        });
    }
    let r = chunks_into(
        stream,
        (m, n, rows),
        epilogue,
        bias_in_head,
        (&mut products, &mut order),
        out,
        &mut head,
    );
    // `stream`'s later work (and a fallback that writes `out` again) after every epilogue
    // enqueued, whether or not all were.
    let joined = match &order {
        Some(Order {
            read,
            last: Some(slot),
            ..
        }) => stream.wait(&read[*slot]),
        _ => Ok(()),
    };
    r.and(joined)
}

/// The events of [`chunked`] with a side stream: `gemm` recorded on the main stream after
/// each chunk's GEMM (the side waits for it), `read[j]` on the side after each epilogue that
/// read product buffer `j` (the GEMM that next writes it waits for it); `last`: the buffer
/// of the last epilogue enqueued.
struct Order<'s> {
    side: &'s Stream,
    gemm: Event,
    read: [Event; 2],
    last: Option<usize>,
}

/// [`chunked`]'s loop over the chunks.
fn chunks_into<T: Float>(
    stream: &Stream,
    (m, n, rows): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    bias_in_head: bool,
    (products, order): (&mut [Buffer<T>], &mut Option<Order<'_>>),
    out: &mut Buffer<T>,
    head: &mut impl FnMut(usize, usize, &mut Buffer<T>) -> Result<()>,
) -> Result<()> {
    let mut first = 0;
    let mut i = 0;
    while first < m {
        let mc = rows.min(m - first);
        let slot = i % products.len();
        let on = match order.as_mut() {
            Some(o) => {
                // The buffer's previous reader (two chunks back) first; the event's latest
                // record is that epilogue's (the last one used the other buffer).
                if i >= 2 {
                    stream.wait(&o.read[slot])?;
                }
                head(first, mc, &mut products[slot])?;
                stream.record(&o.gemm)?;
                o.side.wait(&o.gemm)?;
                o.side
            }
            None => {
                head(first, mc, &mut products[slot])?;
                stream
            }
        };
        let p = Elements::new(&products[slot], 0, mc * n)?;
        let mut e = Expr::operand_matrix(&p, mc, n);
        if let (Some(bias), false) = (epilogue.bias, bias_in_head) {
            e = e + Expr::input(bias);
        }
        e = e.activation(epilogue.act);
        let residual = epilogue
            .residual
            .map(|r| Elements::new(r, first * n, mc * n))
            .transpose()?;
        if let Some(r) = &residual {
            e = e + Expr::operand_matrix(r, mc, n);
        }
        let written = e.eval_into_at(on, out, first * n);
        if let Some(o) = order.as_mut() {
            // Recorded even after a failed launch: the join waits for what was enqueued.
            o.side.record(&o.read[slot])?;
            o.last = Some(slot);
        }
        written?;
        first += mc;
        i += 1;
    }
    Ok(())
}

/// Rows `first .. first + m` of `a · b` into the first `m` rows of `product`, through a copy
/// of those rows of `a` (the CPU backend's chunk head: `gemm::matmul` takes whole buffers).
fn rows_product<T: Float>(
    stream: &Stream,
    (a, first): (&Buffer<T>, usize),
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    product: &mut Buffer<T>,
) -> Result<()> {
    let size = |x: usize, y: usize| {
        x.checked_mul(y)
            .ok_or_else(|| Error::InvalidArgument("matmul_epilogue: chunk overflows".into()))
    };
    let mut rows = Buffer::<T>::uninit(stream, size(m, k)?)?;
    rows.copy_rows_from(stream, (0, k), (a, size(first, k)?, k), k, m)?;
    let mut p = Buffer::<T>::uninit(stream, size(m, n)?)?;
    gemm::matmul(stream, &rows, b, &mut p, (m, n, k))?;
    product.copy_rows_from(stream, (0, n), (&p, 0, n), n, m)
}

/// cuBLASLt's workspace, from the pool (a cached block, stream-ordered, so one stream's GEMMs
/// reuse it and no other stream's touch it until they are done); without the memory, none.
fn workspace(stream: &Stream) -> Option<Buffer<u8>> {
    Buffer::<u8>::uninit(stream, LT_WORKSPACE_BYTES).ok()
}

/// Whether cuBLASLt can run the epilogue's bias and activation inside the GEMM (what
/// [`Epilogue::in_cublaslt`] asks, less the residual, which a kernel after it adds).
fn lt_head<T: Float>(epilogue: &Epilogue<'_, T>) -> bool {
    Epilogue {
        residual: None,
        ..*epilogue
    }
    .in_cublaslt()
}

/// cuBLASLt found no algorithm for the shape (odd leading dimensions, say): the caller takes
/// the GEMM and the generated epilogue instead.
fn no_lt_algo(e: &Error) -> bool {
    matches!(
        e,
        Error::Blas {
            call: "cublasLtMatmulAlgoGetHeuristic",
            ..
        }
    )
}

/// Rows `first .. first + m` of `act(a · b + bias)` into the first `m` rows of `out`, as one
/// cuBLASLt matmul (bias present, [`lt_head`]), k > 0; `a`'s rows are read in place (row
/// major: they are contiguous from row `first`).
fn lt_gemm<T: Float>(
    q: Queue<'_>,
    (a, first): (&Buffer<T>, usize),
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
    workspace: Option<&Buffer<u8>>,
) -> Result<()> {
    let fits =
        |rows: usize, cols: usize, len: usize| rows.checked_mul(cols).is_some_and(|e| e <= len);
    let a_rows = first.saturating_add(m);
    if !fits(a_rows, k, a.len()) || !fits(k, n, b.len()) || !fits(m, n, out.len()) {
        return Err(Error::InvalidArgument(format!(
            "matmul_epilogue: rows {first} + {m} of a {m}×{n}×{k} product out of its buffers"
        )));
    }
    let size = std::mem::size_of::<T>() as u64;
    let call = BiasGemm {
        dtype: T::KIND,
        m,
        n,
        k,
        gelu: epilogue.act == Activation::GeluTanh,
        // In bounds (checked above).
        a: a.device_ptr() + (first * k) as u64 * size,
        b: b.device_ptr(),
        bias: epilogue.bias.map_or(0, |b| b.device_ptr()),
        d: out.device_ptr(),
        workspace: workspace.map_or(0, |w| w.device_ptr()),
        workspace_bytes: workspace.map_or(0, |w| w.len()),
    };
    // SAFETY: `a` holds rows first .. first + m of k elements, `b` k·n elements and `out`
    // m·n (checked above), the bias n (checked by the caller; present: lt_head), all live
    // buffers of T; `out` is borrowed mutably, so it overlaps none of them; the workspace
    // is the caller's, on this stream, and outlives the enqueued call (the pool reuses it
    // only after the stream's later work).
    unsafe { q.gpu.gemm_bias(q.stream, &call) }
}

/// The GEMM into a pooled buffer, then the epilogue as one generated kernel.
fn two_kernels<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    let mut product = Buffer::<T>::uninit(stream, out.len())?;
    gemm::matmul(stream, a, b, &mut product, (m, n, k))?;
    let mut e = Expr::matrix(&product, m, n);
    if let Some(bias) = epilogue.bias {
        e = e + Expr::input(bias);
    }
    e = e.activation(epilogue.act);
    if let Some(r) = epilogue.residual {
        e = e + Expr::matrix(r, m, n);
    }
    e.eval_into(stream, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_chunks_fit_a_fifth_of_l2_in_whole_tiles() {
        let l2 = 50 << 20;
        // 4096² bf16 (32 MiB): four chunks of 1024 rows (8 MiB each).
        assert_eq!(auto_rows(l2, (4096, 4096), 2), Some(1024));
        assert_eq!(auto_rows(l2, (2048, 4096), 2), Some(1024));
        // Uneven: two chunks of 768 rows (the last 532).
        assert_eq!(auto_rows(l2, (1300, 4096), 2), Some(768));
        // Fits the share whole, or too few rows for two chunks.
        assert_eq!(auto_rows(l2, (1024, 4096), 2), None);
        assert_eq!(auto_rows(l2, (256, 1 << 16), 2), None);
        // Rows too wide for the share: 256-row chunks still.
        assert_eq!(auto_rows(l2, (4096, 1 << 16), 2), Some(256));
        // f32 rows are twice as wide.
        assert_eq!(auto_rows(l2, (4096, 4096), 4), Some(512));
        // No L2 known (the CPU backend), nothing to chunk.
        assert_eq!(auto_rows(0, (4096, 4096), 2), None);
        assert_eq!(auto_rows(l2, (4096, 0), 2), None);
        // A product past usize's bytes: chunks of the share all the same.
        assert_eq!(auto_rows(l2, (usize::MAX, 4096), 2), Some(1280));
    }
}
