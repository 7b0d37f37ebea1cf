//! Spatial messages: a uniform grid over a cube, rebuilt each step by a counting sort (each
//! agent's bin and a count per bin, an exclusive scan of the counts, a scatter of each
//! agent's message into its bin's slots), as FLAME GPU 2's `MessageSpatial3D`: bins as wide
//! as the interaction radius, positions outside the cube clamped into its edge bins, and a
//! reader visits the 3 × 3 × 3 bins around its own.

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::AGENTS;
use crate::memory::Buffer;
use crate::ops::{self, fill_grid, launch, Args};

/// Bins along each axis at most (`dim³` bins must index with u32).
pub const MAX_DIM: u32 = 1600;

/// The grid's geometry: the cube `[lo, lo + dim · width)³` in bins of `width`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GridShape {
    /// The cube's lower corner on each axis.
    pub lo: f32,
    /// A bin's width (the interaction radius).
    pub width: f32,
    /// Bins along each axis.
    pub dim: u32,
}

impl GridShape {
    /// Bins of `radius` over `[lo, hi)` on each axis: `ceil((hi - lo) / radius)` of them, as
    /// FLAME GPU 2 sizes its grid.
    pub fn new(lo: f32, hi: f32, radius: f32) -> Result<GridShape> {
        let bins = ((hi - lo) / radius).ceil();
        if !(radius > 0.0 && radius.is_finite() && lo.is_finite() && hi > lo && hi.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "agents: a grid over [{lo}, {hi}) with radius {radius}"
            )));
        }
        if !(1.0..=MAX_DIM as f32).contains(&bins) {
            return Err(Error::InvalidArgument(format!(
                "agents: a grid of {bins} bins per axis (1 to {MAX_DIM})"
            )));
        }
        Ok(GridShape {
            lo,
            width: radius,
            dim: bins as u32,
        })
    }

    /// How many bins (`dim³`).
    pub fn bins(&self) -> usize {
        let d = self.dim as usize;
        d * d * d
    }

    /// The bin of one coordinate, clamped into the grid: the same f32 arithmetic as the
    /// kernels (`floor((p - lo) / width)`, a saturating conversion, NaN to 0), so both
    /// backends put an agent in the same bin.
    pub fn axis(&self, p: f32) -> u32 {
        let b = ((p - self.lo) / self.width).floor() as i32;
        b.clamp(0, self.dim as i32 - 1) as u32
    }

    /// The bin of a position.
    pub fn bin(&self, x: f32, y: f32, z: f32) -> u32 {
        (self.axis(z) * self.dim + self.axis(y)) * self.dim + self.axis(x)
    }
}

/// The grid's buffers: each agent's bin and rank in it, the bins' counts and first slots, and the messages
/// sorted by bin, four f32 each (`x`, `y`, `z`, and the agent's index as the bits of the
/// fourth: one 16-byte load per message on a GPU).
#[derive(Debug)]
pub struct SpatialGrid {
    shape: GridShape,
    pub(crate) bin_of: Buffer<u32>,
    pub(crate) counts: Buffer<u32>,
    /// `bins + 1` entries: bin `b`'s messages are `starts[b]..starts[b + 1]`.
    pub(crate) starts: Buffer<u32>,
    /// Each agent's place among its bin's messages (the count's atomic order on a GPU).
    pub(crate) rank: Buffer<u32>,
    pub(crate) msg: Buffer<f32>,
    agents: usize,
}

impl SpatialGrid {
    /// A grid of `shape` for `agents` agents on the stream's device (fewer than `u32::MAX`).
    pub fn new(stream: &Stream, shape: GridShape, agents: usize) -> Result<SpatialGrid> {
        if agents >= u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "agents: {agents} agents; the grid indexes them with u32"
            )));
        }
        let bins = shape.bins();
        let slots = bins
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("agents: too many bins".into()))?;
        let words = agents
            .checked_mul(4)
            .ok_or_else(|| Error::InvalidArgument(format!("agents: {agents} messages")))?;
        Ok(SpatialGrid {
            shape,
            bin_of: Buffer::zeros(stream, agents)?,
            counts: Buffer::zeros(stream, bins)?,
            starts: Buffer::zeros(stream, slots)?,
            rank: Buffer::zeros(stream, agents)?,
            msg: Buffer::zeros(stream, words)?,
            agents,
        })
    }

    /// The grid's geometry.
    pub fn shape(&self) -> GridShape {
        self.shape
    }

    /// How many agents it holds messages for.
    pub fn agents(&self) -> usize {
        self.agents
    }

    /// Each bin's first message slot (`bins + 1` entries, the last the total), to the host.
    pub fn starts_to_host(&self, stream: &Stream) -> Result<Vec<u32>> {
        self.starts.to_host(stream)
    }

    /// The messages' agent indices in slot order, to the host.
    pub fn messages_to_host(&self, stream: &Stream) -> Result<Vec<u32>> {
        let msg = self.msg.to_host(stream)?;
        Ok(msg.chunks_exact(4).map(|m| m[3].to_bits()).collect())
    }

    /// Rebuilds the grid from positions `x`, `y`, `z` (one per agent). On the CPU backend
    /// the messages of a bin are in agent order; on a GPU in the order its atomics give.
    pub fn rebuild(
        &mut self,
        stream: &Stream,
        x: &Buffer<f32>,
        y: &Buffer<f32>,
        z: &Buffer<f32>,
    ) -> Result<()> {
        let n = self.agents();
        for b in [x, y, z] {
            b.check_stream(stream, "agents grid")?;
            if b.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "agents: positions of {} agents for a grid of {n}",
                    b.len()
                )));
            }
        }
        let shape = self.shape;
        stream.run(
            self,
            |g| {
                let (xs, ys, zs) = (x.host_view()?, y.host_view()?, z.host_view()?);
                let bin_of = g.bin_of.host_view_mut()?;
                let rank = g.rank.host_view_mut()?;
                let counts = g.counts.host_view_mut()?;
                counts.fill(0);
                for i in 0..n {
                    let b = shape.bin(xs[i], ys[i], zs[i]);
                    bin_of[i] = b;
                    rank[i] = counts[b as usize];
                    counts[b as usize] += 1;
                }
                let starts = g.starts.host_view_mut()?;
                let mut run = 0u32;
                for (s, &c) in starts.iter_mut().zip(counts.iter()) {
                    *s = run;
                    run += c;
                }
                starts[counts.len()] = run;
                let msg = g.msg.host_view_mut()?;
                for i in 0..n {
                    let s = (starts[bin_of[i] as usize] + rank[i]) as usize * 4;
                    msg[s..s + 4].copy_from_slice(&[xs[i], ys[i], zs[i], f32::from_bits(i as u32)]);
                }
                Ok(())
            },
            |g, q| {
                check_aligned(&g.msg)?;
                ops::fill(stream, &mut g.counts, 0)?;
                if n > 0 {
                    let grid = fill_grid(q.gpu, (&AGENTS, "agents_bin_count"), n as u64, 256)?;
                    let args = Args::new()
                        .buf(x)
                        .buf(y)
                        .buf(z)
                        .u64(n as u64)
                        .f32(shape.lo)
                        .f32(shape.width)
                        .u32(shape.dim)
                        .buf(&g.bin_of)
                        .buf(&g.counts)
                        .buf(&g.rank);
                    // SAFETY: agents_bin_count(const float* x, y, z, u64 n, float lo, float w,
                    // u32 dim, u32* bin_of, u32* counts, u32* rank): x, y, z, bin_of and rank
                    // hold n elements, counts dim³ (the kernel clamps every bin into the grid).
                    unsafe { launch(q, (&AGENTS, "agents_bin_count"), grid, 256, 0, args)? };
                }
                ops::exclusive_scan(stream, &g.counts, &mut g.starts)?;
                if n > 0 {
                    let grid = fill_grid(q.gpu, (&AGENTS, "agents_scatter"), n as u64, 256)?;
                    let args = Args::new()
                        .buf(x)
                        .buf(y)
                        .buf(z)
                        .u64(n as u64)
                        .buf(&g.bin_of)
                        .buf(&g.rank)
                        .buf(&g.starts)
                        .buf(&g.msg);
                    // SAFETY: agents_scatter(const float* x, y, z, u64 n, const u32* bin_of,
                    // const u32* rank, const u32* starts, float4* msg): the n agents' bins
                    // (< dim³), their ranks (distinct in a bin, below its count) and the bins'
                    // first slots (dim³ + 1) as just built, so each agent takes one distinct
                    // slot below n of msg (4n floats from the pool, 16-byte aligned).
                    unsafe { launch(q, (&AGENTS, "agents_scatter"), grid, 256, 0, args)? };
                }
                Ok(())
            },
        )
    }
}

/// The messages' float4 loads need 16-byte alignment (the pool's blocks start at multiples
/// of 512 bytes: a check, not a workaround).
pub(crate) fn check_aligned(msg: &Buffer<f32>) -> Result<()> {
    if msg.device_ptr() % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "agents: messages at {:#x}, not 16-byte aligned",
            msg.device_ptr()
        )));
    }
    Ok(())
}
