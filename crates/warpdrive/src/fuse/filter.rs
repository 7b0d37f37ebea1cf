//! Stream compaction fused with its map (TransformFilter): the expression's elements where a
//! predicate holds, in order, and their count, in one pass (codegen's `fuse_filter`: a
//! single-pass scan with decoupled look-back).

use std::sync::Arc;

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::kernels::{self, Arch, PtxCache};
use crate::memory::{check_len, Buffer};
use crate::ops::{float_index, launch};

use super::codegen::{self, BLOCK, KERNEL_FILTER};
use super::eval::{check_inputs, input_args};
use super::expr::Expr;
use super::program::Program;
use super::registry::kernel_source;

impl<'a> Expr<'a> {
    /// Stream compaction (TransformFilter): the elements of this expression (row-major over
    /// the shape it and `keep` broadcast to) where `keep` is not 0 (NaN counts as not 0), in
    /// order, into the front of `out`, and their number into `count[0]`, in one pass on a GPU
    /// (a single-pass scan with decoupled look-back). `out` holds at least as many elements as
    /// that shape; its elements past the count are left as they were.
    pub fn filter_into<O: Float>(
        &self,
        keep: impl Into<Expr<'a>>,
        stream: &Stream,
        out: &mut Buffer<O>,
        count: &mut Buffer<u32>,
    ) -> Result<()> {
        let keep = keep.into();
        let prog = Program::with_roots(&[self, &keep])?;
        run_filter(&prog, stream, out, count)
    }

    /// [`filter_into`](Self::filter_into) into a new buffer, waiting for the count: the kept
    /// elements are the buffer's first `count`.
    pub fn filter<O: Float>(
        &self,
        keep: impl Into<Expr<'a>>,
        stream: &Stream,
    ) -> Result<(Buffer<O>, usize)> {
        let keep = keep.into();
        let prog = Program::with_roots(&[self, &keep])?;
        let mut out = Buffer::uninit(stream, prog.len())?;
        let mut count = Buffer::<u32>::zeros(stream, 1)?;
        run_filter(&prog, stream, &mut out, &mut count)?;
        let n = count.to_host(stream)?.first().copied().unwrap_or(0);
        Ok((out, n as usize))
    }

    /// The CUDA C of the kernel of [`filter_into`](Self::filter_into) with predicate `keep`.
    pub fn filter_source<O: Float>(&self, keep: &Expr<'a>) -> Result<String> {
        let prog = Program::with_roots(&[self, keep])?;
        float_index::<O>("fuse output")?;
        Ok(kernel_source::<O>(&prog).code.to_string())
    }

    /// The PTX of the kernel of [`filter_into`](Self::filter_into) with predicate `keep`,
    /// compiled for `arch` through the kernel cache (needs NVRTC, not a GPU).
    pub fn filter_ptx<O: Float>(&self, keep: &Expr<'a>, arch: Arch) -> Result<Arc<str>> {
        let prog = Program::with_roots(&[self, keep])?;
        float_index::<O>("fuse output")?;
        PtxCache::global().ptx(kernel_source::<O>(&prog), arch)
    }
}

fn run_filter<O: Float>(
    prog: &Program<'_>,
    stream: &Stream,
    out: &mut Buffer<O>,
    count: &mut Buffer<u32>,
) -> Result<()> {
    float_index::<O>("fuse output")?;
    check_inputs(prog, stream)?;
    out.check_stream(stream, "fuse filter")?;
    count.check_stream(stream, "fuse filter")?;
    check_len("fuse filter (count)", count.len(), 1)?;
    let n = prog.len();
    if out.len() < n {
        return Err(Error::InvalidArgument(format!(
            "fuse filter: an output of {} elements for up to {n} kept",
            out.len()
        )));
    }
    if u32::try_from(n).is_err() {
        return Err(Error::InvalidArgument(format!(
            "fuse filter: {n} elements; the count is a u32"
        )));
    }
    stream.run(
        (out, count),
        |(out, count)| {
            let kept = super::cpu::filter(prog, out.host_view_mut()?)?;
            count.host_view_mut()?[0] = kept as u32;
            Ok(())
        },
        |(out, count), q| {
            if n == 0 {
                return crate::ops::fill(stream, count, 0u32);
            }
            let src = kernel_source::<O>(prog);
            kernels::function_from_cubin(q.gpu, src, KERNEL_FILTER)?;
            let w = codegen::width(prog, O::KIND);
            let tile = BLOCK as u64 * codegen::FILTER_VECS * w;
            let tiles = (n as u64).div_ceil(tile);
            let grid = u32::try_from(tiles)
                .ok()
                .filter(|&g| g <= i32::MAX as u32)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("fuse filter: {n} elements need too many tiles"))
                })?;
            // Tile states, then the next tile's number: zeroed.
            let states = Buffer::<u64>::zeros(stream, tiles as usize + 1)?;
            let mut args = input_args(prog);
            args = args
                .buf(out)
                .buf(&states)
                .buf(count)
                .u64(n as u64)
                .u64(prog.space.cols as u64);
            for &c in &prog.consts {
                args = args.f32(c);
            }
            // SAFETY: fuse_filter(inputs..., tables..., O* out, u64* tiles, u32* count, u64 n,
            // u64 cols, consts...) as generated from this program: the inputs hold what their
            // classes read over the space of n elements (checked above), each gather table comes
            // with its length (the kernel checks indices), `out` at least n elements of O,
            // `tiles` one zeroed word per tile of this grid and one for the tile counter, `count`
            // one u32; one float per constant. The states stay alive until the kernel has run
            // (the pool hands freed blocks out again in stream order).
            let launched = unsafe { launch(q, (src, KERNEL_FILTER), grid, BLOCK, 0, args) };
            drop(states);
            launched
        },
    )
}
