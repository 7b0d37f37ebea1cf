//! Evaluating an expression: the program on the CPU backend, or its generated kernel on a
//! GPU, compiled once per structure (`registry.rs`), loaded from its cubin (the kernel
//! floor's cache, on disk too, so a later process skips NVRTC and the JIT) and launched on
//! the lean path.

use std::sync::Arc;

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::kernels::{self, Arch, PtxCache};
use crate::memory::{check_len, Buffer};
use crate::ops::{fill_grid, float_index, launch, launch_as, Args};

use super::codegen::{
    self, Flavor, MapShape, Schedule, BLOCK, KERNEL_ALL, KERNEL_MAP, KERNEL_ROWS_BLOCK,
    KERNEL_ROWS_WARP, WARP_ROW_MAX,
};
use super::expr::Axis;
use super::expr::Expr;
use super::program::{Mode, Op, Program};
use super::registry::{kernel_source, kernel_source_for};

impl<'a> Expr<'a> {
    /// Evaluates into a new buffer of `O` (f32, f16 or bf16) with the expression's shape
    /// (row-major), on `stream`.
    pub fn eval<O: Float>(&self, stream: &Stream) -> Result<Buffer<O>> {
        let prog = Program::new(self)?;
        let mut out = Buffer::uninit(stream, prog.len())?;
        run(&prog, stream, &mut out, Schedule::default())?;
        Ok(out)
    }

    /// Evaluates into `out`, which holds the expression's elements (row-major).
    pub fn eval_into<O: Float>(&self, stream: &Stream, out: &mut Buffer<O>) -> Result<()> {
        self.eval_into_scheduled(stream, out, Schedule::default())
    }

    /// Evaluates an elementwise expression into `out` with its map kernel in `shape` (what
    /// [`Expr::tune`] chooses among) instead of the tuned one: to pin a shape, or to check
    /// each. Not an elementwise expression, a block that is not a multiple of 32 from 32 to
    /// 1024, vectors other than 8 or 16 bytes, or 8-byte vectors over arrays of different
    /// element sizes: an error.
    pub fn eval_into_shape<O: Float>(
        &self,
        stream: &Stream,
        out: &mut Buffer<O>,
        shape: MapShape,
    ) -> Result<()> {
        let prog = Program::new(self)?;
        run_with_shape(&prog, stream, out, shape)
    }

    /// Evaluates an elementwise expression into `out` as [`eval_into`](Self::eval_into) does,
    /// its map kernel in `schedule` (how it meets the kernel before it: chunk order, a
    /// programmatic dependent launch). The default schedule is `eval_into`; another one for
    /// an expression that is not elementwise is an error. The CPU backend computes the same
    /// result in any schedule.
    pub fn eval_into_scheduled<O: Float>(
        &self,
        stream: &Stream,
        out: &mut Buffer<O>,
        schedule: Schedule,
    ) -> Result<()> {
        let prog = Program::new(self)?;
        if schedule != Schedule::default() && prog.mode != Mode::Map {
            return Err(Error::InvalidArgument(
                "fuse: a map schedule for an expression that is not elementwise".into(),
            ));
        }
        run(&prog, stream, out, schedule)
    }

    /// Loads this expression's kernel (output type `O`) through `cache` into a module of
    /// its own, not the device's table, and drops it: what a new process pays before its
    /// first `eval` — NVRTC when `cache` holds no cubin for the device, else a file read and
    /// the driver's load of machine code (no JIT). The benchmarks time first and cached
    /// starts with it. A no-op on the CPU backend.
    pub fn load_fresh<O: Float>(&self, stream: &Stream, cache: &PtxCache) -> Result<()> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        let (name, flavor) = launched(&prog);
        let src = kernel_source_for(&prog, O::KIND, &prog.signature(O::KIND), flavor);
        stream.run(
            (),
            |()| Ok(()),
            |(), q| kernels::load_cubin_fresh(q.gpu, cache, src, name),
        )
    }

    /// The PTX of this expression's kernel with output type `O`, compiled by NVRTC for `arch`
    /// through the kernel cache (memory, then disk, then NVRTC). Needs NVRTC, not a GPU.
    pub fn ptx<O: Float>(&self, arch: Arch) -> Result<Arc<str>> {
        self.ptx_with::<O>(PtxCache::global(), arch)
    }

    /// [`ptx`](Self::ptx) through `cache` (a fresh [`PtxCache::at`] a folder behaves like a
    /// new process: the benchmarks time a first compile and a start from disk with it).
    pub fn ptx_with<O: Float>(&self, cache: &PtxCache, arch: Arch) -> Result<Arc<str>> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        cache.ptx(kernel_source::<O>(&prog), arch)
    }

    /// Compiles and loads this expression's kernel with output type `O` on the stream's
    /// device now, so the first `eval` does not (a no-op on the CPU backend).
    pub fn prepare<O: Float>(&self, stream: &Stream) -> Result<()> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        stream.run(
            (),
            |()| Ok(()),
            |(), q| {
                let sig = prog.signature(O::KIND);
                let (name, flavor) = match launched(&prog) {
                    (name, Flavor::Both) if prog.mode == Mode::Map && prog.len() > 0 => {
                        let shape =
                            super::tune::shape_for(stream, &prog, &sig, O::KIND, prog.len());
                        (name, Flavor::Map(shape, Default::default()))
                    }
                    other => other,
                };
                kernels::function_from_cubin(
                    q.gpu,
                    kernel_source_for(&prog, O::KIND, &sig, flavor),
                    name,
                )?;
                Ok(())
            },
        )
    }

    /// The CUDA C of this expression's kernel with output type `O` (without the prelude and
    /// `kernels/fuse.cu`, which are prepended when it is compiled).
    pub fn source<O: Float>(&self) -> Result<String> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        Ok(kernel_source::<O>(&prog).code.to_string())
    }
}

/// The kernel arguments every generated kernel starts with: its inputs, then each gather
/// table and its length.
pub(super) fn input_args(prog: &Program<'_>) -> Args {
    let mut args = Args::new();
    for input in &prog.inputs {
        args = args.ptr(input.buf.device_ptr());
    }
    for t in &prog.tables {
        args = args.ptr(t.buf.device_ptr()).u64(t.buf.elements() as u64);
    }
    args
}

/// Checks the inputs against the program's space (streams, and the elements each class
/// reads: the shapes were checked as the graph was built; this keeps the launch's bounds a
/// fact checked here).
pub(super) fn check_inputs(prog: &Program<'_>, stream: &Stream) -> Result<()> {
    for t in &prog.tables {
        t.buf.check_stream(stream)?;
    }
    for input in &prog.inputs {
        input.buf.check_stream(stream)?;
        let reads = input.class.reads(prog.space);
        if prog.len() > 0 && input.buf.elements() != reads {
            return Err(Error::InvalidArgument(format!(
                "fuse: an input of {} elements where the graph reads {reads}",
                input.buf.elements()
            )));
        }
    }
    Ok(())
}

/// A map program's launch in `shape` (a tuning's candidate), after the checks `run` makes.
pub(crate) fn run_with_shape<O: Float>(
    prog: &Program<'_>,
    stream: &Stream,
    out: &mut Buffer<O>,
    shape: MapShape,
) -> Result<()> {
    float_index::<O>("fuse output")?;
    check_inputs(prog, stream)?;
    out.check_stream(stream, "fuse")?;
    check_len("fuse (output)", out.len(), prog.len())?;
    if prog.len() == 0 || prog.mode != Mode::Map {
        return Err(Error::InvalidArgument(
            "fuse: a map shape for a program that is not a non-empty map".into(),
        ));
    }
    if !(32..=1024).contains(&shape.block)
        || shape.block % 32 != 0
        || !matches!(shape.vector_bytes, 8 | 16)
    {
        return Err(Error::InvalidArgument(format!(
            "fuse: a map shape of {} threads and {}-byte vectors (expected a multiple of 32 \
             from 32 to 1024 threads, 8- or 16-byte vectors)",
            shape.block, shape.vector_bytes
        )));
    }
    if shape.vector_bytes != 16 && !codegen::one_element_size(prog, O::KIND) {
        return Err(Error::InvalidArgument(format!(
            "fuse: {shape}: 8-byte vectors need one element size in every streamed array"
        )));
    }
    map_launch(
        prog,
        stream,
        out,
        &prog.signature(O::KIND),
        Some(shape),
        Schedule::default(),
    )
}

/// Launches a checked, non-empty map program's kernel in `shape` (by default the tuned shape:
/// `tune.rs`) and `schedule`, one block per chunk of the elements (up to the grid's limit: the
/// kernel loops past it).
fn map_launch<O: Float>(
    prog: &Program<'_>,
    stream: &Stream,
    out: &mut Buffer<O>,
    sig: &str,
    shape: Option<MapShape>,
    schedule: Schedule,
) -> Result<()> {
    let n = prog.len() as u64;
    stream.run(
        out,
        |out| super::cpu::eval(prog, out.host_view_mut()?),
        |out, q| {
            let shape = shape
                .unwrap_or_else(|| super::tune::shape_for(stream, prog, sig, O::KIND, n as usize));
            let block = shape.block;
            let src = kernel_source_for(prog, O::KIND, sig, Flavor::Map(shape, schedule));
            // Loaded from its cubin (no JIT in a later process) before the launch looks it up.
            kernels::function_from_cubin(q.gpu, src, KERNEL_MAP)?;
            let per_block = block as u64
                * codegen::map_width(prog, O::KIND, shape)
                * codegen::map_unroll(prog, shape);
            let grid = n.div_ceil(per_block.max(1)).clamp(1, i32::MAX as u64) as u32;
            let mut args = input_args(prog);
            args = args.buf(out).u64(n).u64(prog.space.cols as u64);
            for &c in &prog.consts {
                args = args.f32(c);
            }
            // SAFETY: fuse_map(const I_k* in_k..., (const T_j* g_j, u64 len_j)..., O* out, u64 n,
            // u64 cols, float c_j...) as generated from this program with
            // __launch_bounds__(block): one pointer per input of its element type holding what
            // its class reads over the n-element space (checked by the caller), each gather table
            // with its length (the kernel checks every index against it), `out` holding n
            // elements of O, one float per constant. Programmatic only in a schedule whose kernel
            // runs wait_prior_grid() before its first load (and only prefetches before it).
            unsafe {
                launch_as(
                    q,
                    (src, KERNEL_MAP),
                    grid,
                    block,
                    0,
                    args,
                    schedule.programmatic,
                )
            }
        },
    )
}

/// The kernel a launch of `prog` runs and the source flavor that holds it (the map kernel's
/// block is chosen at the launch).
fn launched(prog: &Program<'_>) -> (&'static str, Flavor) {
    match prog.mode {
        Mode::Map => (KERNEL_MAP, Flavor::Both),
        Mode::Rows | Mode::RowsAll if prog.space.cols <= WARP_ROW_MAX => {
            (KERNEL_ROWS_WARP, Flavor::RowsWarp)
        }
        Mode::Rows | Mode::RowsAll => (KERNEL_ROWS_BLOCK, Flavor::RowsBlock),
        Mode::All => (KERNEL_ALL, Flavor::Both),
    }
}

/// Runs a checked program into `out`, a map program's kernel in `schedule` (the caller
/// checked that only a map program has another than the default).
fn run<O: Float>(
    prog: &Program<'_>,
    stream: &Stream,
    out: &mut Buffer<O>,
    schedule: Schedule,
) -> Result<()> {
    float_index::<O>("fuse output")?;
    check_inputs(prog, stream)?;
    out.check_stream(stream, "fuse")?;
    let n = prog.len();
    check_len("fuse (output)", out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    if prog.mode == Mode::Map {
        return map_launch(prog, stream, out, &prog.signature(O::KIND), None, schedule);
    }
    let space = prog.space;
    stream.run(
        out,
        |out| super::cpu::eval(prog, out.host_view_mut()?),
        |out, q| {
            let (_, flavor) = launched(prog);
            let src = kernel_source_for(prog, O::KIND, &prog.signature(O::KIND), flavor);
            let w = codegen::width(prog, O::KIND);
            let (rows, cols) = (space.rows as u64, space.cols as u64);
            let mut args = input_args(prog);
            args = args.buf(out);
            // Scratch of the whole-buffer reductions, alive until the kernel has run (the pool
            // hands freed blocks out again in stream order).
            let mut scratch = None;
            let (kernel, grid) = match prog.mode {
                // Launched by map_launch (above).
                Mode::Map => {
                    return Err(Error::InvalidArgument(
                        "fuse: a map program reached the reduction launch (a bug)".into(),
                    ))
                }
                Mode::Rows | Mode::RowsAll => {
                    let (kernel, per_block) = if space.cols <= WARP_ROW_MAX {
                        (KERNEL_ROWS_WARP, (BLOCK / 32) as u64)
                    } else {
                        (KERNEL_ROWS_BLOCK, 1)
                    };
                    kernels::function_from_cubin(q.gpu, src, kernel)?;
                    let grid = fill_grid(q.gpu, (src, kernel), rows, per_block)?;
                    if prog.mode == Mode::RowsAll {
                        // The whole reductions' block results and ticket (as Mode::All).
                        let wholes = prog
                            .ops
                            .iter()
                            .filter(|o| matches!(o, Op::Reduce(_, Axis::All, _)))
                            .count();
                        let partials = wholes.checked_mul(grid as usize).ok_or_else(|| {
                            Error::InvalidArgument("fuse: too many reductions".into())
                        })?;
                        let p = Buffer::<f32>::uninit(stream, partials)?;
                        let t = Buffer::<u32>::zeros(stream, 1)?;
                        args = args.buf(&p).buf(&t);
                        scratch = Some((p, t));
                    }
                    args = args.u64(rows).u64(cols);
                    (kernel, grid)
                }
                Mode::All => {
                    kernels::function_from_cubin(q.gpu, src, KERNEL_ALL)?;
                    let items = rows.saturating_mul(cols);
                    let grid = fill_grid(q.gpu, (src, KERNEL_ALL), items, BLOCK as u64 * w)?;
                    let reductions = prog
                        .ops
                        .iter()
                        .filter(|o| matches!(o, Op::Reduce(..)))
                        .count();
                    let partials = reductions.checked_mul(grid as usize).ok_or_else(|| {
                        Error::InvalidArgument("fuse: too many reductions".into())
                    })?;
                    let p = Buffer::<f32>::uninit(stream, partials)?;
                    let t = Buffer::<u32>::zeros(stream, 1)?;
                    args = args.buf(&p).buf(&t).u64(items).u64(cols);
                    scratch = Some((p, t));
                    (KERNEL_ALL, grid)
                }
            };
            for &c in &prog.consts {
                args = args.f32(c);
            }
            // SAFETY: the kernel's parameters as generated from this program (codegen.rs): one
            // pointer per input of its element type (then each gather table with its length, which
            // the kernel checks every index against), each holding what its class reads over the
            // program's space (checked above), `out` of type O holding the result's n elements;
            // then (rows, cols) for rows (after the partials, one f32 per whole reduction and
            // block of this grid, and the zeroed ticket, when whole reductions follow), or for a
            // whole reduction the partials, the ticket and (elements, cols); then one float per
            // constant.
            let launched = unsafe { launch(q, (src, kernel), grid, BLOCK, 0, args) };
            drop(scratch);
            launched
        },
    )
}
