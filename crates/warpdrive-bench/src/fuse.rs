//! The `fuse` suite (issue 39): chains of elementwise ops fused into one generated kernel
//! against the same chain as today's ops (one kernel per op) and the copy ceiling; PyTorch
//! eager and `torch.compile` run the same cases in `bench/peers/fuse.py`.
//!
//! Every case reads two inputs `x`, `y` of `size` bytes each (random, seeded) and writes one
//! output of the same type; GB/s counts those bytes read and written once (what a fused
//! kernel moves), for every variant, so the unfused row's GB/s is the effective rate.
//!
//! - `chain2-<t>`: `1.5·(x·y) + 0.25` (mul, fma).
//! - `chain5-<t>`: `leaky(1.5·max(x·y + x, y) + 0.25)`, `leaky(v) = v > 0 ? v : 0.1·v`
//!   (mul, add, max, fma, compare/select).
//! - `chain10-<t>`: chain5, then `min(·, y)`, `− x`, `0.5·(·) − 1`, `· y`, `+ x`.
//! - `gelu-silu-<t>`: `gelu_tanh(x) · silu(y)`: two transcendental activations
//!   (`extra.bound = "compute"`; the others are memory-bound).
//!
//! `t` is `f32` or `bf16` (arithmetic in f32 either way: a bf16 chain casts on every load and
//! store). Variants: `warpdrive-fused` (one kernel), `warpdrive-unfused` (`ops::binary`,
//! `ops::map` and, for compare/select, which no op has, a one-node fused kernel: one kernel
//! per op, intermediates in memory), `ceiling` (`ops::copy` of the same bytes read + written).
//! The fused kernel's shape is tuned first (`Expr::tune_shape`; `extra.block`,
//! `extra.vector_bytes`, `extra.shape`). For f32, where a streaming kernel's time moved by
//! where its output sat (bench/NOTES.md), `warpdrive-fused-<shape>` rows pin each 8-byte shape
//! (`256x8`, `512x8`, and `p`: without the streaming cache hints, torch.compile's loads and
//! stores) with the output at the start of its allocation (the suite's `out`), and
//! `…-offset` rows (the tuned shape: `warpdrive-fused-offset`) with it 12 MiB + 4 KiB into a
//! pool segment, after another block (`extra.output_offset_bytes`; rows left out where the pool
//! did not place it so).
//!
//! `softmax-xent-bf16`: the softmax cross-entropy of each row of bf16 logits `[rows, 32768]`
//! (`size` bytes of logits) against f32 class labels, `log Σ exp(x − max) + max − x[label]`,
//! into one f32 per row: `warpdrive-fused` (one kernel: a warp or block per row, max and the
//! label's logit in one pass over the row, the exponentials' sum in a second, from cache),
//! `warpdrive-unfused` (max, `exp(x − max)` into a bf16 matrix, its row sums, the label's
//! logit, the loss: five kernels), `ceiling`. GB/s counts the logits, labels and losses once.
//!
//! `filter-1pct-f32`, `filter-50pct-f32`: `1.5·x + 0.25` where `x < t` (uniform x, `t` for
//! 1 % or 50 % kept), compacted in order, over `size` bytes of f32, the count left on the
//! device: `warpdrive-fused` (one kernel, a single-pass scan with decoupled look-back),
//! `warpdrive-unfused` (`ops::map`, then the compaction of the mapped buffer: two kernels),
//! `ceiling`. GB/s counts the input read and the kept values written once.
//!
//! `gemm-bias-gelu-bf16` and `gemm-bias-gelu-residual-bf16`: see `fuse_gemm.rs`.
//!
//! On CUDA, `compile-first` and `compile-cached` time the chain5 bf16 kernel's start in a new
//! process (`Expr::load_fresh`: a module of its own each time): NVRTC into an empty kernel
//! cache (PTX and cubin), then from that cache's files (the cubin read and loaded, no JIT).
//!
//! Sizes: 256 MiB per input on CUDA, 4 MiB on the CPU backend (`--quick` for the peer).

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use warpdrive::device::Stream;
use warpdrive::error::Result;
use warpdrive::fuse::{Expr, MapShape};
use warpdrive::kernels::PtxCache;
use warpdrive::memory::Buffer;
use warpdrive::ops::{self, Activation, BinaryOp, Map};
use warpdrive::Float;

use super::kernels::size_label;
use super::results::Ceiling;
use super::timing::{time_gpu, time_host};
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "fuse";

struct Plan {
    bytes: usize,
    warmup: usize,
    reps: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                bytes: 256 << 20,
                warmup: 5,
                reps: 30,
            },
            Scale::Quick => Plan {
                bytes: 4 << 20,
                warmup: 1,
                reps: 5,
            },
            Scale::Tiny => Plan {
                bytes: 64 << 10,
                warmup: 1,
                reps: 2,
            },
        }
    }
}

/// A chain of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chain {
    Two,
    Five,
    Ten,
    GeluSilu,
}

impl Chain {
    pub(crate) const ALL: [Chain; 4] = [Chain::Two, Chain::Five, Chain::Ten, Chain::GeluSilu];

    fn name(self) -> &'static str {
        match self {
            Chain::Two => "chain2",
            Chain::Five => "chain5",
            Chain::Ten => "chain10",
            Chain::GeluSilu => "gelu-silu",
        }
    }

    /// Kernels of the unfused chain (= its ops).
    fn ops(self) -> usize {
        match self {
            Chain::Two => 2,
            Chain::Five => 5,
            Chain::Ten => 10,
            Chain::GeluSilu => 3,
        }
    }

    fn formula(self) -> &'static str {
        match self {
            Chain::Two => "1.5 (x y) + 0.25",
            Chain::Five => "leaky(1.5 max(x y + x, y) + 0.25)",
            Chain::Ten => "(0.5 (min(leaky(1.5 max(x y + x, y) + 0.25), y) - x) - 1) y + x",
            Chain::GeluSilu => "gelu_tanh(x) silu(y)",
        }
    }

    /// The chain as one expression.
    pub(crate) fn fused<'a>(self, x: &'a Expr<'a>, y: &'a Expr<'a>) -> Expr<'a> {
        let leaky = |v: Expr<'a>| v.gt(0.0).select(&v, &v * 0.1);
        let five = || leaky((x * y + x).max(y) * 1.5 + 0.25);
        match self {
            Chain::Two => x * y * 1.5 + 0.25,
            Chain::Five => five(),
            Chain::Ten => ((five().min(y) - x) * 0.5 - 1.0) * y + x,
            Chain::GeluSilu => x.gelu_tanh() * y.silu(),
        }
    }
}

/// The chain as today's ops, one kernel each, through the temporaries `a` and `b`.
pub(crate) fn unfused<T: Float>(
    s: &Stream,
    chain: Chain,
    x: &Buffer<T>,
    y: &Buffer<T>,
    a: &mut Buffer<T>,
    b: &mut Buffer<T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    let leaky = |s: &Stream, v: &Buffer<T>, out: &mut Buffer<T>| {
        let e = Expr::input(v);
        e.gt(0.0).select(&e, &e * 0.1).eval_into(s, out)
    };
    let affine = |s: &Stream, k: f32, c: f32, v: &Buffer<T>, out: &mut Buffer<T>| {
        ops::map(s, &Map::affine(k, c), v, out)
    };
    match chain {
        Chain::Two => {
            ops::binary(s, BinaryOp::Mul, x, y, a)?;
            affine(s, 1.5, 0.25, a, out)
        }
        Chain::Five | Chain::Ten => {
            ops::binary(s, BinaryOp::Mul, x, y, a)?;
            ops::binary(s, BinaryOp::Add, a, x, b)?;
            ops::binary(s, BinaryOp::Max, b, y, a)?;
            affine(s, 1.5, 0.25, a, b)?;
            if chain == Chain::Five {
                return leaky(s, b, out);
            }
            leaky(s, b, a)?;
            ops::binary(s, BinaryOp::Min, a, y, b)?;
            ops::binary(s, BinaryOp::Sub, b, x, a)?;
            affine(s, 0.5, -1.0, a, b)?;
            ops::binary(s, BinaryOp::Mul, b, y, a)?;
            ops::binary(s, BinaryOp::Add, a, x, out)
        }
        Chain::GeluSilu => {
            ops::map(s, &Map::activation(Activation::GeluTanh), x, a)?;
            ops::map(s, &Map::activation(Activation::Silu), y, b)?;
            ops::binary(s, BinaryOp::Mul, a, b, out)
        }
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    chains::<f32>(ctx, &plan, "f32")?;
    chains::<bf16>(ctx, &plan, "bf16")?;
    softmax_xent(ctx, &plan)?;
    filters(ctx, &plan)?;
    super::fuse_gemm::run_cases(ctx, plan.warmup, plan.reps)?;
    if ctx.device().is_cuda() {
        compile_times(ctx, &plan)?;
    }
    Ok(())
}

/// Seeded values in [-2, 2) as `T`.
fn random<T: Float>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64(rng.random_range(-2.0f64..2.0)))
        .collect()
}

fn chains<T: Float>(ctx: &mut Ctx, plan: &Plan, tname: &str) -> Result<()> {
    let bytes = plan.bytes;
    let n = bytes / std::mem::size_of::<T>();
    let stream = ctx.stream().clone();
    let x = Buffer::from_host(&stream, &random::<T>(n, 0xf05e))?;
    let y = Buffer::from_host(&stream, &random::<T>(n, 0xf05f))?;
    let mut a = Buffer::<T>::uninit(&stream, n)?;
    let mut b = Buffer::<T>::uninit(&stream, n)?;
    let mut out = Buffer::<T>::uninit(&stream, n)?;
    // Two inputs read and one output written, once.
    let moved = 3.0 * bytes as f64;
    // The ceiling: a copy of half those bytes (read + written = all of them).
    let half = (3 * bytes / 2) / 4;
    let src = Buffer::from_host(&stream, &random::<f32>(half, 0xc0b1))?;
    let mut dst = Buffer::<f32>::uninit(&stream, half)?;
    let (warm, reps) = (plan.warmup, plan.reps);
    let copy_us = time_gpu(&stream, warm, reps, |s| ops::copy(s, &src, &mut dst))?;
    let (ex, ey) = (Expr::input(&x), Expr::input(&y));
    for chain in Chain::ALL {
        let case = format!("{}-{tname}", chain.name());
        ctx.step(format!("{SUITE}: {case} ({})", size_label(bytes)));
        let fused = chain.fused(&ex, &ey);
        // The map shape tuned (and kept in the autotune cache) before timing.
        let shape = fused.tune_shape::<T>(&stream)?;
        fused.prepare::<T>(&stream)?;
        let mut us = time_gpu(&stream, warm, reps, |s| fused.eval_into(s, &mut out))?;
        let bound = if chain == Chain::GeluSilu {
            "compute"
        } else {
            "memory"
        };
        let annotate = |row: &mut super::Row, kernels: usize| {
            row.extra.insert("dtype".into(), tname.into());
            row.extra.insert("op".into(), chain.formula().into());
            row.extra.insert("ops".into(), chain.ops().into());
            row.extra.insert("kernels".into(), kernels.into());
            row.extra.insert("bound".into(), bound.into());
            row.extra.insert(
                "bytes_counted".into(),
                "2 inputs read + 1 output written".into(),
            );
        };
        let size = bytes as u64;
        let row = ctx.record_bytes(
            &case,
            size,
            "warpdrive-fused",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        annotate(row, 1);
        row.extra.insert("block".into(), shape.block.into());
        row.extra
            .insert("vector_bytes".into(), shape.vector_bytes.into());
        row.extra.insert("shape".into(), shape.to_string().into());
        if T::KIND == warpdrive::DTypeKind::F32 {
            let timing = (warm, reps, moved);
            placements(ctx, &stream, &case, &fused, &mut out, shape, timing)?;
        }
        let mut us = time_gpu(&stream, warm, reps, |s| {
            unfused(s, chain, &x, &y, &mut a, &mut b, &mut out)
        })?;
        let row = ctx.record_bytes(
            &case,
            size,
            "warpdrive-unfused",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        annotate(row, chain.ops());
        let mut us = copy_us.clone();
        let row = ctx.record_bytes(
            &case,
            size,
            "ceiling",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        row.extra.insert(
            "op".into(),
            "ops::copy of 1.5 x size (device to device)".into(),
        );
        row.extra
            .insert("bytes_counted".into(), "read+write".into());
    }
    Ok(())
}

/// How far into a pool segment the offset output starts: past the 10 MiB under which blocks
/// share segments, and not a multiple of a large power of two.
const OUTPUT_OFFSET: usize = (12 << 20) + 4096;

/// The blocks held before (and beside) an offset output, and the output.
type OffsetOutput<T> = (Vec<Buffer<u8>>, Buffer<T>);

/// An `n`-element output `OUTPUT_OFFSET` bytes into a pool segment, behind a pad block: a
/// freed block of pad + output splits from its low end (the caching pool's best fit), so the
/// pad takes its start and the output the rest, as the addresses must show. Blocks that take
/// the pad's place (a better fit elsewhere) are held, so the next try skips them; `None` after
/// four tries (or on the CPU backend, where placement is the host allocator's).
fn offset_output<T: Float>(stream: &Stream, n: usize) -> Result<Option<OffsetOutput<T>>> {
    if !stream.device().is_cuda() {
        return Ok(None);
    }
    let bytes = n * std::mem::size_of::<T>();
    let mut held = Vec::new();
    for _ in 0..4 {
        let base = Buffer::<u8>::uninit(stream, OUTPUT_OFFSET + bytes)?;
        let at = base.device_ptr();
        drop(base);
        let pad = Buffer::<u8>::uninit(stream, OUTPUT_OFFSET)?;
        if pad.device_ptr() != at {
            held.push(pad);
            continue;
        }
        let out = Buffer::<T>::uninit(stream, n)?;
        let placed = out.device_ptr() == at + OUTPUT_OFFSET as u64;
        held.push(pad);
        if placed {
            return Ok(Some((held, out)));
        }
    }
    Ok(None)
}

/// The f32 chain's kernel in each 8-byte shape with the output at the start of its allocation
/// (`out`), and in each shape and the tuned one with it at an offset (see the module doc), so
/// one run shows which shape is insensitive to where its output sits.
fn placements<T: Float>(
    ctx: &mut Ctx,
    stream: &Stream,
    case: &str,
    fused: &Expr<'_>,
    out: &mut Buffer<T>,
    tuned: MapShape,
    (warm, reps, moved): (usize, usize, f64),
) -> Result<()> {
    let size = out.size_bytes() as u64;
    let shapes: Vec<MapShape> = [(256, false), (512, false), (256, true), (512, true)]
        .into_iter()
        .map(|(block, plain)| MapShape {
            block,
            vector_bytes: 8,
            plain,
        })
        .collect();
    let record =
        |ctx: &mut Ctx, variant: String, us: &mut Vec<f64>, shape: MapShape, off: usize| {
            let row = ctx.record_bytes(case, size, &variant, us, moved, Some(Ceiling::D2dCopy))?;
            row.extra.insert("shape".into(), shape.to_string().into());
            row.extra.insert("output_offset_bytes".into(), off.into());
            row.extra.insert("kernels".into(), 1.into());
            Ok::<(), warpdrive::Error>(())
        };
    for &shape in &shapes {
        let mut us = time_gpu(stream, warm, reps, |s| fused.eval_into_shape(s, out, shape))?;
        record(ctx, format!("warpdrive-fused-{shape}"), &mut us, shape, 0)?;
    }
    let Some((_pad, mut off_out)) = offset_output::<T>(stream, out.len())? else {
        return Ok(());
    };
    for &shape in &shapes {
        let mut us = time_gpu(stream, warm, reps, |s| {
            fused.eval_into_shape(s, &mut off_out, shape)
        })?;
        let variant = format!("warpdrive-fused-{shape}-offset");
        record(ctx, variant, &mut us, shape, OUTPUT_OFFSET)?;
    }
    let mut us = time_gpu(stream, warm, reps, |s| fused.eval_into(s, &mut off_out))?;
    record(
        ctx,
        "warpdrive-fused-offset".into(),
        &mut us,
        tuned,
        OUTPUT_OFFSET,
    )?;
    Ok(())
}

/// Columns of the softmax cross-entropy's logits (a vocabulary).
fn vocab(scale: Scale) -> usize {
    match scale {
        Scale::Full => 32768,
        Scale::Quick => 4096,
        Scale::Tiny => 256,
    }
}

/// The per-row loss, fused.
pub(crate) fn xent<'a>(x: &'a Expr<'a>, labels: &'a Expr<'a>, cols: usize) -> Expr<'a> {
    let m = x.max_rows();
    let picked = Expr::col_index(cols)
        .equals(labels)
        .select(x, 0.0)
        .sum_rows();
    (x - &m).exp().sum_rows().log() + m - picked
}

/// The per-row loss as five kernels, intermediates in memory (`z`: the exponentials, bf16).
pub(crate) struct XentSteps {
    m: Buffer<f32>,
    s: Buffer<f32>,
    picked: Buffer<f32>,
    z: Buffer<bf16>,
}

impl XentSteps {
    pub(crate) fn new(stream: &Stream, rows: usize, cols: usize) -> Result<XentSteps> {
        Ok(XentSteps {
            m: Buffer::uninit(stream, rows)?,
            s: Buffer::uninit(stream, rows)?,
            picked: Buffer::uninit(stream, rows)?,
            z: Buffer::uninit(stream, rows * cols)?,
        })
    }

    pub(crate) fn run(
        &mut self,
        s: &Stream,
        x: &Buffer<bf16>,
        labels: &Buffer<f32>,
        out: &mut Buffer<f32>,
    ) -> Result<()> {
        let rows = labels.len();
        let cols = x.len() / rows.max(1);
        let ex = Expr::matrix(x, rows, cols);
        ex.max_rows().eval_into(s, &mut self.m)?;
        (&ex - Expr::col(&self.m)).exp().eval_into(s, &mut self.z)?;
        Expr::matrix(&self.z, rows, cols)
            .sum_rows()
            .eval_into(s, &mut self.s)?;
        Expr::col_index(cols)
            .equals(Expr::col(labels))
            .select(&ex, 0.0)
            .sum_rows()
            .eval_into(s, &mut self.picked)?;
        (Expr::input(&self.s).log() + Expr::input(&self.m) - Expr::input(&self.picked))
            .eval_into(s, out)
    }
}

/// `softmax-xent-bf16` (see the module docs).
fn softmax_xent(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    let case = "softmax-xent-bf16";
    let cols = vocab(ctx.scale());
    let rows = (plan.bytes / 2 / cols).max(1);
    let bytes = rows * cols * 2;
    ctx.step(format!("{SUITE}: {case} ({rows} x {cols})"));
    let stream = ctx.stream().clone();
    let x = Buffer::from_host(&stream, &random::<bf16>(rows * cols, 0x5e7))?;
    let mut rng = SmallRng::seed_from_u64(0x1abe1);
    let labels: Vec<f32> = (0..rows)
        .map(|_| rng.random_range(0..cols) as f32)
        .collect();
    let l = Buffer::from_host(&stream, &labels)?;
    let mut out = Buffer::<f32>::uninit(&stream, rows)?;
    let mut steps = XentSteps::new(&stream, rows, cols)?;
    let moved = (bytes + 8 * rows) as f64;
    let half = (bytes + 8 * rows) / 2 / 4;
    let src = Buffer::from_host(&stream, &random::<f32>(half, 0xc0b2))?;
    let mut dst = Buffer::<f32>::uninit(&stream, half)?;
    let (warm, reps) = (plan.warmup, plan.reps);
    let (ex, el) = (Expr::matrix(&x, rows, cols), Expr::col(&l));
    let fused = xent(&ex, &el, cols);
    fused.prepare::<f32>(&stream)?;
    let size = bytes as u64;
    let mut us = time_gpu(&stream, warm, reps, |s| fused.eval_into(s, &mut out))?;
    let annotate = |row: &mut super::Row, kernels: usize| {
        row.extra.insert("dtype".into(), "bf16".into());
        row.extra.insert("rows".into(), rows.into());
        row.extra.insert("cols".into(), cols.into());
        row.extra.insert("kernels".into(), kernels.into());
        row.extra.insert(
            "op".into(),
            "log sum exp(x - max) + max - x[label], per row".into(),
        );
        row.extra.insert(
            "bytes_counted".into(),
            "logits + labels + losses once".into(),
        );
    };
    let row = ctx.record_bytes(
        case,
        size,
        "warpdrive-fused",
        &mut us,
        moved,
        Some(Ceiling::D2dCopy),
    )?;
    annotate(row, 1);
    let mut us = time_gpu(&stream, warm, reps, |s| steps.run(s, &x, &l, &mut out))?;
    let row = ctx.record_bytes(
        case,
        size,
        "warpdrive-unfused",
        &mut us,
        moved,
        Some(Ceiling::D2dCopy),
    )?;
    annotate(row, 5);
    let mut us = time_gpu(&stream, warm, reps, |s| ops::copy(s, &src, &mut dst))?;
    let row = ctx.record_bytes(
        case,
        size,
        "ceiling",
        &mut us,
        moved,
        Some(Ceiling::D2dCopy),
    )?;
    row.extra.insert(
        "op".into(),
        "ops::copy of half the bytes counted (device to device)".into(),
    );
    Ok(())
}

/// `filter-*` (see the module docs).
fn filters(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    let bytes = plan.bytes;
    let n = bytes / 4;
    let stream = ctx.stream().clone();
    let xs = random::<f32>(n, 0xf11);
    let x = Buffer::from_host(&stream, &xs)?;
    let mut mapped = Buffer::<f32>::uninit(&stream, n)?;
    let mut out = Buffer::<f32>::uninit(&stream, n)?;
    let mut count = Buffer::<u32>::zeros(&stream, 1)?;
    let (warm, reps) = (plan.warmup, plan.reps);
    let ex = Expr::input(&x);
    // x is uniform in [-2, 2): x < t keeps (t + 2) / 4 of it.
    for (pct, t) in [(1u32, -1.96f32), (50, 0.0)] {
        let case = format!("filter-{pct}pct-f32");
        ctx.step(format!("{SUITE}: {case} ({})", size_label(bytes)));
        let kept = xs.iter().filter(|&&v| v < t).count();
        let moved = (bytes + kept * 4 + 4) as f64;
        let value = &ex * 1.5 + 0.25;
        let keep = ex.lt(t);
        let mut us = time_gpu(&stream, warm, reps, |s| {
            value.filter_into(&keep, s, &mut out, &mut count)
        })?;
        let annotate = |row: &mut super::Row, kernels: usize| {
            row.extra.insert("dtype".into(), "f32".into());
            row.extra.insert("kept".into(), kept.into());
            row.extra.insert("selectivity_pct".into(), pct.into());
            row.extra.insert("kernels".into(), kernels.into());
            row.extra
                .insert("op".into(), format!("1.5 x + 0.25 where x < {t}").into());
            row.extra.insert(
                "bytes_counted".into(),
                "input read + kept values written".into(),
            );
        };
        let size = bytes as u64;
        let row = ctx.record_bytes(
            &case,
            size,
            "warpdrive-fused",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        annotate(row, 1);
        let mut us = time_gpu(&stream, warm, reps, |s| {
            ops::map(s, &Map::affine(1.5, 0.25), &x, &mut mapped)?;
            // Kept where the input is below t: the mapped value is below 1.5 t + 0.25.
            let m = Expr::input(&mapped);
            m.filter_into(m.lt(1.5 * t + 0.25), s, &mut out, &mut count)
        })?;
        let row = ctx.record_bytes(
            &case,
            size,
            "warpdrive-unfused",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        annotate(row, 2);
        let half = ((moved as usize) / 2 / 4).max(1);
        let src = Buffer::from_host(&stream, &random::<f32>(half, 0xc0b3))?;
        let mut dst = Buffer::<f32>::uninit(&stream, half)?;
        let mut us = time_gpu(&stream, warm, reps, |s| ops::copy(s, &src, &mut dst))?;
        let row = ctx.record_bytes(
            &case,
            size,
            "ceiling",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        row.extra.insert(
            "op".into(),
            "ops::copy of half the bytes counted (device to device)".into(),
        );
    }
    Ok(())
}

/// `compile-first` and `compile-cached` (see the module docs).
fn compile_times(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    ctx.step(format!("{SUITE}: first compile and cached start"));
    let stream = ctx.stream().clone();
    let x = Buffer::<bf16>::uninit(&stream, 16)?;
    let y = Buffer::<bf16>::uninit(&stream, 16)?;
    let (ex, ey) = (Expr::input(&x), Expr::input(&y));
    let e = Chain::Five.fused(&ex, &ey);
    let base = std::env::temp_dir().join(format!("warpdrive-fuse-bench-{}", std::process::id()));
    let reps = plan.reps.clamp(3, 10);
    let mut next = 0usize;
    let mut first = time_host(0, reps, || {
        next += 1;
        let cache = PtxCache::at(base.join(format!("first-{next}")));
        e.load_fresh::<bf16>(&stream, &cache)
    })?;
    let dir = base.join("first-1");
    let mut cached = time_host(1, reps, || {
        e.load_fresh::<bf16>(&stream, &PtxCache::at(&dir))
    })?;
    let _ = std::fs::remove_dir_all(&base);
    let row = ctx.record_time("compile-first", 1, "warpdrive-fused", &mut first, None)?;
    row.extra.insert("kernel".into(), "chain5-bf16".into());
    row.extra.insert(
        "what".into(),
        "NVRTC compile (PTX + cubin) into an empty kernel cache, written to disk, and the \
         module's load"
            .into(),
    );
    let row = ctx.record_time("compile-cached", 1, "warpdrive-fused", &mut cached, None)?;
    row.extra.insert("kernel".into(), "chain5-bf16".into());
    row.extra.insert(
        "what".into(),
        "a new process's start: the cubin read from the disk cache (checksummed) and loaded \
         by the driver (no JIT), the kernel fetched"
            .into(),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::device::Device;

    #[test]
    fn tiny_run_on_the_cpu_has_every_case_and_variant() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        for t in ["f32", "bf16"] {
            for chain in Chain::ALL {
                let case = format!("{}-{t}", chain.name());
                for variant in ["warpdrive-fused", "warpdrive-unfused", "ceiling"] {
                    let row = rows
                        .iter()
                        .find(|r| r.case == case && r.variant == variant)
                        .unwrap_or_else(|| panic!("{case} {variant} missing"));
                    assert_eq!(row.size, 64 << 10);
                    assert!(row.gbps.is_some_and(|g| g > 0.0), "{case} {variant}");
                }
                // The pinned 8-byte shapes at the output's start: f32 only (no offset rows on
                // the CPU backend, whose placement is the host allocator's).
                for shape in ["256x8", "512x8", "256x8p", "512x8p"] {
                    let variant = format!("warpdrive-fused-{shape}");
                    let there = rows.iter().any(|r| r.case == case && r.variant == variant);
                    assert_eq!(there, t == "f32", "{case} {variant}");
                }
            }
        }
        for case in ["softmax-xent-bf16", "filter-1pct-f32", "filter-50pct-f32"] {
            for variant in ["warpdrive-fused", "warpdrive-unfused", "ceiling"] {
                assert!(
                    rows.iter().any(|r| r.case == case && r.variant == variant),
                    "{case} {variant} missing"
                );
            }
        }
    }

    #[test]
    fn fused_and_unfused_cross_entropy_agree() {
        let s = Device::cpu().new_stream().unwrap();
        let (rows, cols) = (7, 300);
        let x = Buffer::from_host(&s, &random::<bf16>(rows * cols, 3)).unwrap();
        let labels: Vec<f32> = (0..rows).map(|i| (i * 41 % cols) as f32).collect();
        let l = Buffer::from_host(&s, &labels).unwrap();
        let (ex, el) = (Expr::matrix(&x, rows, cols), Expr::col(&l));
        let fused = xent(&ex, &el, cols)
            .eval::<f32>(&s)
            .unwrap()
            .to_host(&s)
            .unwrap();
        let mut out = Buffer::<f32>::zeros(&s, rows).unwrap();
        XentSteps::new(&s, rows, cols)
            .unwrap()
            .run(&s, &x, &l, &mut out)
            .unwrap();
        let steps = out.to_host(&s).unwrap();
        for (f, u) in fused.iter().zip(&steps) {
            // The unfused chain keeps the exponentials in bf16.
            assert!(
                (f - u).abs() <= 1e-2 * (1.0 + f.abs()),
                "fused {f}, unfused {u}"
            );
        }
    }

    #[test]
    fn fused_and_unfused_chains_agree() {
        let s = Device::cpu().new_stream().unwrap();
        let n = 1001;
        let x = Buffer::from_host(&s, &random::<f32>(n, 1)).unwrap();
        let y = Buffer::from_host(&s, &random::<f32>(n, 2)).unwrap();
        let (ex, ey) = (Expr::input(&x), Expr::input(&y));
        let mut a = Buffer::<f32>::zeros(&s, n).unwrap();
        let mut b = Buffer::<f32>::zeros(&s, n).unwrap();
        let mut out = Buffer::<f32>::zeros(&s, n).unwrap();
        for chain in Chain::ALL {
            let fused = chain
                .fused(&ex, &ey)
                .eval::<f32>(&s)
                .unwrap()
                .to_host(&s)
                .unwrap();
            unfused(&s, chain, &x, &y, &mut a, &mut b, &mut out).unwrap();
            let step = out.to_host(&s).unwrap();
            for (i, (f, u)) in fused.iter().zip(&step).enumerate() {
                // The unfused chain rounds to f32 between ops: a few ulps of the terms.
                assert!(
                    (f - u).abs() <= 1e-5 * (1.0 + f.abs()),
                    "{chain:?} at {i}: fused {f}, unfused {u}"
                );
            }
        }
    }
}
