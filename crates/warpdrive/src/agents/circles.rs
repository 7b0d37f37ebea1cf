//! Circles, FLAME GPU 2's published benchmark model (`FLAMEGPU2-circles-benchmark`,
//! `circles_spatial3D_rtc`), matched as its source defines it:
//!
//! - **Bounds and density**: a cube of width `W` centred on 0 (`[-W/2, W/2)` on each axis)
//!   with one agent per unit volume: its fixed-density experiment takes `W = round(∛V)` for
//!   target volumes `V` and `ceil(W³)` agents (1 M agents at `W = 100`). Here `W = ∛N`
//!   for `N` agents ([`CirclesConfig::new`]); at 1 M the two agree.
//! - **Initialization**: `x`, `y`, `z` uniform on `[-W/2, W/2)`, seeded (FLAME GPU draws them
//!   with `std::default_random_engine`; here splitmix64, so the same seed does not give the
//!   same positions as FLAME GPU, only the same distribution).
//! - **Messages**: spatial, radius 2 (the bin width), read from the 3 × 3 × 3 bins around an
//!   agent's own, positions outside the cube clamped into the edge bins; an agent skips its
//!   own message. At density 1 that is ≈ 27 · 8 = 216 messages per agent inside the cube,
//!   fewer at its faces (the issue's ≈ 204.5 is FLAME GPU's measured mean).
//! - **Force law**: for each message at offset `d` with `s = ∛(|d|²)` (the benchmark takes the
//!   cube root of the squared distance, not the square root: kept as it is), when
//!   `0 < s < r`: `k = sin(-2 · 3.141 · s / r) · 0.05` (repulse 0.05, the argument in double
//!   as its `3.141` literal makes it) and `F += k · d / s`; the agent then moves by `F / count`
//!   (count of messages that passed the test, at least 1). No clamping to the bounds.
//! - **Timing** (the anchor: 0.428 s for 200 steps at 1 M on an H100 PCIe): the benchmark
//!   reports its run-time compile (`s_rtc`) apart from `s_simulation`; the population is
//!   uploaded by `setPopulationData` before `simulate()`. Read from the source, not measured.
//!
//! The CPU backend is the reference: the same bins (identical f32 arithmetic), messages of a
//! bin in agent order, the force summed in f64 and rounded once.

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::AGENTS;
use crate::ops::{fill_grid, launch, Args};

use super::grid::{GridShape, SpatialGrid};
use super::population::Population;

/// The benchmark's interaction radius.
pub const RADIUS: f32 = 2.0;
/// The benchmark's repulsion factor (`ENV_REPULSE`).
pub const REPULSE: f32 = 0.05;

/// The benchmark's value of π (its literal `3.141`), kept to match its force law.
#[allow(clippy::approx_constant)]
const BENCHMARK_PI: f64 = 3.141;

/// A Circles model's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CirclesConfig {
    /// How many agents.
    pub agents: usize,
    /// The cube's width.
    pub width: f32,
    /// Interaction radius (the grid's bin width).
    pub radius: f32,
    /// Repulsion factor.
    pub repulse: f32,
    /// Seed of the initial positions.
    pub seed: u64,
}

impl CirclesConfig {
    /// The benchmark's fixed-density setup for `agents` agents: density 1, radius 2,
    /// repulse 0.05.
    pub fn new(agents: usize, seed: u64) -> CirclesConfig {
        CirclesConfig {
            agents,
            width: (agents as f64).cbrt().max(1.0) as f32,
            radius: RADIUS,
            repulse: REPULSE,
            seed,
        }
    }

    /// The grid's geometry.
    pub fn shape(&self) -> Result<GridShape> {
        let lo = -0.5 * self.width;
        GridShape::new(lo, lo + self.width, self.radius)
    }

    /// The initial positions `(x, y, z)`, uniform on the cube, from the seed.
    pub fn positions(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut state = self.seed;
        let lo = -0.5 * self.width;
        let mut draw = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            // 24 random bits: a float uniform on [0, 1).
            let u = (z >> 40) as f32 / (1u32 << 24) as f32;
            lo + u * self.width
        };
        let mut xs = Vec::with_capacity(self.agents);
        let mut ys = Vec::with_capacity(self.agents);
        let mut zs = Vec::with_capacity(self.agents);
        for _ in 0..self.agents {
            xs.push(draw());
            ys.push(draw());
            zs.push(draw());
        }
        (xs, ys, zs)
    }
}

/// Which GPU kernel moves the agents (the CPU backend has one reference for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoveKernel {
    /// `circles_move_fast` (the default): the same walk and in/out decision as `Exact`, the
    /// force from approximate cube root, sine and reciprocal (each within ~1e-6 relative).
    #[default]
    Fast,
    /// `circles_move`: precise `cbrtf`, `sinf` of a double argument, IEEE divisions.
    Exact,
}

impl MoveKernel {
    fn kernel(self) -> &'static str {
        match self {
            MoveKernel::Fast => "circles_move_fast",
            MoveKernel::Exact => "circles_move",
        }
    }
}

/// A Circles simulation: the population (`x`, `y`, `z`) and its grid of messages.
///
/// ```
/// use warpdrive::agents::{Circles, CirclesConfig};
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let mut sim = Circles::new(&stream, CirclesConfig::new(1000, 7))?;
/// let before = sim.population().f32_to_host(&stream, "x")?;
/// sim.step(&stream)?;
/// let after = sim.population().f32_to_host(&stream, "x")?;
/// // Each agent moves by at most the repulsion factor per axis.
/// assert!(before.iter().zip(&after).all(|(a, b)| (a - b).abs() <= 0.05 + 1e-6));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Circles {
    config: CirclesConfig,
    agents: Population,
    grid: SpatialGrid,
    kernel: MoveKernel,
    /// Messages read by the last CPU step (the CPU backend counts them).
    messages: Option<u64>,
}

impl Circles {
    /// The model of `config` on the stream's device, its agents placed from the seed.
    pub fn new(stream: &Stream, config: CirclesConfig) -> Result<Circles> {
        let (x, y, z) = config.positions();
        Circles::from_positions(stream, config, &x, &y, &z)
    }

    /// The model of `config` from given positions (one per agent on each axis).
    pub fn from_positions(
        stream: &Stream,
        config: CirclesConfig,
        x: &[f32],
        y: &[f32],
        z: &[f32],
    ) -> Result<Circles> {
        if !(config.radius > 0.0 && config.repulse.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "agents: circles with radius {} and repulse {}",
                config.radius, config.repulse
            )));
        }
        let mut agents = Population::new(config.agents);
        agents.add_f32(stream, "x", x)?;
        agents.add_f32(stream, "y", y)?;
        agents.add_f32(stream, "z", z)?;
        let grid = SpatialGrid::new(stream, config.shape()?, config.agents)?;
        Ok(Circles {
            config,
            agents,
            grid,
            kernel: MoveKernel::default(),
            messages: None,
        })
    }

    /// The parameters.
    pub fn config(&self) -> CirclesConfig {
        self.config
    }

    /// The agents (fields `x`, `y`, `z`).
    pub fn population(&self) -> &Population {
        &self.agents
    }

    /// Chooses the GPU kernel that moves the agents (no effect on the CPU backend).
    pub fn set_move_kernel(&mut self, kernel: MoveKernel) {
        self.kernel = kernel;
    }

    /// The GPU kernel that moves the agents.
    pub fn move_kernel(&self) -> MoveKernel {
        self.kernel
    }

    /// The grid of the last step's messages.
    pub fn grid(&self) -> &SpatialGrid {
        &self.grid
    }

    /// Messages the last step read over all agents (own message included, as FLAME GPU
    /// counts), when it ran on the CPU backend; `None` on a GPU (not counted there).
    pub fn messages_read(&self) -> Option<u64> {
        self.messages
    }

    /// One step: the grid rebuilt from the positions, then every agent moved (four kernels
    /// and a scan on a GPU; nothing allocated, so the step can be captured in a graph).
    pub fn step(&mut self, stream: &Stream) -> Result<()> {
        let Circles {
            config,
            agents,
            grid,
            kernel,
            messages,
        } = self;
        let name = kernel.kernel();
        let (x, y, z) = (agents.f32("x")?, agents.f32("y")?, agents.f32("z")?);
        grid.rebuild(stream, x, y, z)?;
        let n = config.agents;
        let shape = grid.shape();
        let (radius, repulse) = (config.radius, config.repulse);
        let read = stream.run(
            (&mut *agents, &*grid),
            |(agents, grid)| {
                let starts = grid.starts.host_view()?;
                let msg = grid.msg.host_view()?;
                let mut pos: Vec<Vec<f32>> = Vec::with_capacity(3);
                for name in ["x", "y", "z"] {
                    pos.push(agents.f32(name)?.host_view()?.to_vec());
                }
                let mut moved = [Vec::new(), Vec::new(), Vec::new()];
                let mut read = 0u64;
                let last = shape.dim as i64 - 1;
                let (r, k0) = (radius as f64, repulse as f64);
                let agents_at = pos[0].iter().zip(&pos[1]).zip(&pos[2]).enumerate();
                for (i, ((&x1, &y1), &z1)) in agents_at.take(n) {
                    let (cx, cy, cz) = (
                        shape.axis(x1) as i64,
                        shape.axis(y1) as i64,
                        shape.axis(z1) as i64,
                    );
                    let (mut f, mut count) = ([0.0f64; 3], 0u32);
                    for bz in (cz - 1).max(0)..=(cz + 1).min(last) {
                        for by in (cy - 1).max(0)..=(cy + 1).min(last) {
                            let row = ((bz * shape.dim as i64 + by) * shape.dim as i64) as usize;
                            let first = starts[row + (cx - 1).max(0) as usize] as usize;
                            let end = starts[row + (cx + 1).min(last) as usize + 1] as usize;
                            read += (end - first) as u64;
                            for m in msg[first * 4..end * 4].chunks_exact(4) {
                                if m[3].to_bits() as usize == i {
                                    continue;
                                }
                                let d = [
                                    m[0] as f64 - x1 as f64,
                                    m[1] as f64 - y1 as f64,
                                    m[2] as f64 - z1 as f64,
                                ];
                                let s = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2]).cbrt();
                                if s < r && s > 0.0 {
                                    let k = ((s / r) * BENCHMARK_PI * -2.0).sin() * k0;
                                    for a in 0..3 {
                                        f[a] += k * d[a] / s;
                                    }
                                    count += 1;
                                }
                            }
                        }
                    }
                    let c = count.max(1) as f64;
                    for ((out, p), fa) in moved.iter_mut().zip([x1, y1, z1]).zip(f) {
                        out.push((p as f64 + fa / c) as f32);
                    }
                }
                for (name, v) in ["x", "y", "z"].into_iter().zip(moved) {
                    agents.f32_mut(name)?.host_view_mut()?.copy_from_slice(&v);
                }
                Ok(Some(read))
            },
            |(agents, grid), q| {
                if n == 0 {
                    return Ok(None);
                }
                super::grid::check_aligned(&grid.msg)?;
                let f = fill_grid(q.gpu, (&AGENTS, name), n as u64, 256)?;
                let args = Args::new()
                    .buf(agents.f32("x")?)
                    .buf(agents.f32("y")?)
                    .buf(agents.f32("z")?)
                    .u64(n as u64)
                    .buf(&grid.starts)
                    .buf(&grid.msg)
                    .f32(shape.lo)
                    .f32(shape.width)
                    .u32(shape.dim)
                    .f32(radius)
                    .f32(repulse);
                // SAFETY: circles_move and circles_move_fast(float* x, y, z, u64 n, const u32* starts, const float4*
                // msg, float lo, float w, u32 dim, float radius, float repulse): x, y, z hold n
                // agents (the population's length), starts dim³ + 1 slots built by the grid's
                // rebuild for these positions (each <= n), msg n float4s (16-byte aligned) whose
                // indices are the agents', each < n; the kernel clamps every bin into the grid.
                unsafe { launch(q, (&AGENTS, name), f, 256, 0, args)? };
                Ok(None)
            },
        )?;
        *messages = read;
        Ok(())
    }
}
