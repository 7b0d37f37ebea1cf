//! Elementwise ops over f32 / f16 / bf16 (arithmetic in f32 on the GPU, f64 on the CPU
//! backend, one rounding to the output type):
//!
//! - [`map`]: `y = cast(act(scale · x + shift))` in one pass, so the intermediates never
//!   touch memory (the fused chain `a·x + b` → activation → cast). [`cast`] is the identity
//!   map: round to nearest even, NaN stays NaN, -0.0 stays -0.0, f16 overflow becomes ±inf.
//! - [`binary`]: `out = op(a, b)` for add, sub, mul, max, min and SwiGLU (`silu(a) · b`).
//! - [`widen_f16_checking_inf`]: the f16 → f32 cast that also tells whether the input holds
//!   a ±inf.
//!
//! Kernels give each lane 16 bytes of the wider type per access (4 f32 or 8 f16/bf16; the
//! narrower side of a cast moves 8 bytes), so every access instruction of a warp covers one
//! contiguous span, with 4 such vectors in flight per thread, grid-stride over SMs × resident
//! blocks; [`Loads::Scalar`] selects the one-element-per-access kernel instead, kept as the
//! measured baseline.

use half::f16;

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::Result;
use crate::kernels::ELEMENTWISE;
use crate::memory::{check_len, Buffer, PinnedBuf};

use super::{by_float, fill_grid, float_index, launch, Args, BLOCK};

/// An activation function applied inside a [`map`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// The identity.
    None,
    /// `x · sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    GeluTanh,
    /// `0.5 x (1 + erf(x / √2))`.
    GeluErf,
}

impl Activation {
    /// The code the kernels switch on (`ACT_*` in `elementwise.cu`).
    fn code(self) -> i32 {
        match self {
            Activation::None => 0,
            Activation::Silu => 1,
            Activation::GeluTanh => 2,
            Activation::GeluErf => 3,
        }
    }

    /// The activation in f64 (the CPU backend).
    pub(crate) fn apply(self, x: f64) -> f64 {
        match self {
            Activation::None => x,
            Activation::Silu => silu(x),
            Activation::GeluTanh => {
                // 0.5 x (1 + tanh(u)) == x · sigmoid(2u), without the cancellation for x < 0.
                let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                x / (1.0 + (-2.0 * u).exp())
            }
            Activation::GeluErf => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        }
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// erf in f64 (std's is unstable): `2/√π · e^(-z²) · Σ 2ⁿ z^(2n+1) / (1·3·…·(2n+1))`, a
/// series of positive terms, within 2e-15 absolute; ±1 beyond |z| = 6.
pub(crate) fn erf(x: f64) -> f64 {
    let z = x.abs();
    if z.is_nan() {
        return f64::NAN;
    }
    if z > 6.0 {
        return x.signum();
    }
    let z2 = z * z;
    let (mut term, mut sum, mut n) = (z, z, 0.0);
    while term > sum * 1e-17 {
        n += 1.0;
        term *= 2.0 * z2 / (2.0 * n + 1.0);
        sum += term;
    }
    let r = 2.0 / std::f64::consts::PI.sqrt() * (-z2).exp() * sum;
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// Which accesses an elementwise or reduction kernel uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Loads {
    /// 16-byte vectors, several in flight per thread (the default).
    #[default]
    Vector,
    /// One element per access: the naive baseline the benchmarks measure against.
    Scalar,
}

/// What [`map`] computes per element: `act(scale · x + shift)` in f32, cast to the output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Map {
    pub scale: f32,
    pub shift: f32,
    pub act: Activation,
    pub loads: Loads,
}

impl Map {
    /// `y = x` (with `map` between two types: a cast).
    pub const IDENTITY: Map = Map {
        scale: 1.0,
        shift: 0.0,
        act: Activation::None,
        loads: Loads::Vector,
    };

    /// `y = scale · x + shift`.
    pub fn affine(scale: f32, shift: f32) -> Map {
        Map {
            scale,
            shift,
            ..Map::IDENTITY
        }
    }

    /// `y = act(x)`.
    pub fn activation(act: Activation) -> Map {
        Map {
            act,
            ..Map::IDENTITY
        }
    }

    /// This map followed by `act`.
    pub fn then(self, act: Activation) -> Map {
        Map { act, ..self }
    }

    /// This map with the given kind of accesses.
    pub fn with_loads(self, loads: Loads) -> Map {
        Map { loads, ..self }
    }

    fn is_affine_identity(&self) -> bool {
        self.scale == 1.0 && self.shift == 0.0
    }

    /// The map in f64 (the CPU backend); the identity affine is skipped, as in the kernels,
    /// so casts are exact.
    pub(crate) fn apply(&self, x: f64) -> f64 {
        let v = if self.is_affine_identity() {
            x
        } else {
            self.scale as f64 * x + self.shift as f64
        };
        self.act.apply(v)
    }
}

const MAP: [[&str; 3]; 3] = [
    by_float!("map_f32"),
    by_float!("map_f16"),
    by_float!("map_bf16"),
];
const MAP_ACT: [[&str; 3]; 3] = [
    by_float!("map_act_f32"),
    by_float!("map_act_f16"),
    by_float!("map_act_bf16"),
];
const MAP_SCALAR: [[&str; 3]; 3] = [
    by_float!("map_scalar_f32"),
    by_float!("map_scalar_f16"),
    by_float!("map_scalar_bf16"),
];

/// `y[i] = cast(act(scale · x[i] + shift))` for `I`, `O` in f32 / f16 / bf16, in one pass.
pub fn map<I: Float, O: Float>(
    stream: &Stream,
    m: &Map,
    x: &Buffer<I>,
    y: &mut Buffer<O>,
) -> Result<()> {
    x.check_stream(stream, "map")?;
    y.check_stream(stream, "map")?;
    check_len("map", x.len(), y.len())?;
    let (i, o) = (float_index::<I>("map")?, float_index::<O>("map")?);
    if x.is_empty() {
        return Ok(());
    }
    stream.run(
        y,
        |y| {
            for (yo, &xi) in y.host_view_mut()?.iter_mut().zip(x.host_view()?) {
                *yo = O::from_f64(m.apply(xi.to_f64()));
            }
            Ok(())
        },
        |y, q| {
            let d = q.gpu;
            // Without an activation, a leaner kernel (fewer registers: more threads per SM).
            let (name, per_thread) = match (m.loads, m.act) {
                (Loads::Vector, Activation::None) => (MAP[i][o], 16),
                (Loads::Vector, _) => (MAP_ACT[i][o], 16),
                (Loads::Scalar, _) => (MAP_SCALAR[i][o], 1),
            };
            let n = x.len() as u64;
            let grid = fill_grid(d, (&ELEMENTWISE, name), n, BLOCK as u64 * per_thread)?;
            let args = Args::new()
                .buf(x)
                .buf(y)
                .u64(n)
                .f32(m.scale)
                .f32(m.shift)
                .i32(m.act.code());
            // SAFETY: map_<I>_<O>(const I* x, O* y, u64 n, float a, float b, int act) with I, O the
            // buffers' element types; both hold n elements.
            unsafe { launch(q, (&ELEMENTWISE, name), grid, BLOCK, 0, args) }
        },
    )
}

/// Converts `x` into `y`'s element type (f32 / f16 / bf16): the identity [`map`].
pub fn cast<I: Float, O: Float>(stream: &Stream, x: &Buffer<I>, y: &mut Buffer<O>) -> Result<()> {
    map(stream, &Map::IDENTITY, x, y)
}

/// [`cast`] from f16 to f32 that also tells whether `x` holds a ±inf; returns once the
/// stream's work is done. The kernel raises a flag in pinned host memory through unified
/// addressing, which the host reads after the wait with no copy back, so data narrowed to
/// f16 on the host is checked for overflow on the device instead of by another host pass
/// (`transfer::Compression::Auto`). Waiting here, not recording an event for the flag,
/// keeps the check within about a microsecond of the plain cast (an event on the flag
/// block cost more; bench/NOTES.md, compressed transfers).
pub fn widen_f16_checking_inf(
    stream: &Stream,
    x: &Buffer<f16>,
    y: &mut Buffer<f32>,
) -> Result<bool> {
    const OP: &str = "widen_f16_checking_inf";
    x.check_stream(stream, OP)?;
    y.check_stream(stream, OP)?;
    check_len(OP, x.len(), y.len())?;
    stream.run(
        y,
        |y| {
            let mut found = false;
            for (yo, &xi) in y.host_view_mut()?.iter_mut().zip(x.host_view()?) {
                found |= xi.is_infinite();
                *yo = xi.to_f32();
            }
            Ok(found)
        },
        |y, q| {
            let d = q.gpu;
            if x.is_empty() {
                return Ok(false);
            }
            const NAME: &str = "widen_f16_flag_inf";
            let n = x.len() as u64;
            // 4 vectors of 4 per thread per pass, as the f16 -> f32 map.
            let grid = fill_grid(d, (&ELEMENTWISE, NAME), n, BLOCK as u64 * 16)?;
            let mut flag = PinnedBuf::<u32>::new(stream.device(), 1)?;
            flag.wait_slice_mut()?[0] = 0;
            let args = Args::new().buf(x).buf(y).u64(n).u64(flag.host_ptr());
            // SAFETY: widen_f16_flag_inf(const f16* x, float* y, u64 n, volatile u32* any_inf): x
            // and y hold n elements; the flag is a live pinned block of one u32, addressable from
            // the device at its host address (unified addressing), which this call alone holds and
            // neither reads nor releases before the stream's work is done (or, when the wait
            // fails, releases only after an event recorded behind the kernel).
            unsafe { launch(q, (&ELEMENTWISE, NAME), grid, BLOCK, 0, args)? };
            if let Err(e) = stream.synchronize() {
                // Best effort: the wait's error is the one to report.
                let _ = flag.record_use(stream);
                return Err(e);
            }
            Ok(flag.wait_slice()?[0] != 0)
        },
    )
}

/// An elementwise operation of two buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// The larger; NaN if either is NaN.
    Max,
    /// The smaller; NaN if either is NaN.
    Min,
    /// `silu(a) · b` (a is the gate, b the up projection).
    SwiGlu,
}

impl BinaryOp {
    fn code(self) -> i32 {
        match self {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Max => 3,
            BinaryOp::Min => 4,
            BinaryOp::SwiGlu => 5,
        }
    }

    fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Max => {
                if a.is_nan() || a > b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Min => {
                if a.is_nan() || a < b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::SwiGlu => silu(a) * b,
        }
    }
}

const BINARY: [&str; 3] = by_float!("binary");

/// `out[i] = op(a[i], b[i])` for f32 / f16 / bf16 (all three buffers the same length).
pub fn binary<T: Float>(
    stream: &Stream,
    op: BinaryOp,
    a: &Buffer<T>,
    b: &Buffer<T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    for (buf, what) in [(a, "binary"), (b, "binary")] {
        buf.check_stream(stream, what)?;
    }
    out.check_stream(stream, "binary")?;
    check_len("binary", a.len(), b.len())?;
    check_len("binary (output)", a.len(), out.len())?;
    let t = float_index::<T>("binary")?;
    if a.is_empty() {
        return Ok(());
    }
    stream.run(
        out,
        |out| {
            let (av, bv) = (a.host_view()?, b.host_view()?);
            for ((o, &x), &y) in out.host_view_mut()?.iter_mut().zip(av).zip(bv) {
                *o = T::from_f64(op.apply(x.to_f64(), y.to_f64()));
            }
            Ok(())
        },
        |out, q| {
            let d = q.gpu;
            let n = a.len() as u64;
            let grid = fill_grid(d, (&ELEMENTWISE, BINARY[t]), n, BLOCK as u64 * 16)?;
            let args = Args::new().buf(a).buf(b).buf(out).u64(n).i32(op.code());
            // SAFETY: binary_<T>(const T* a, const T* b, T* out, u64 n, int op); all three buffers
            // hold n elements of T.
            unsafe { launch(q, (&ELEMENTWISE, BINARY[t]), grid, BLOCK, 0, args) }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // Abramowitz & Stegun / mpmath values.
        for (x, want) in [
            (0.0, 0.0),
            (0.1, 0.1124629160182849),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (2.0, 0.9953222650189527),
            (3.5, 0.9999992569016276),
            (-1.5, -0.9661051464753108),
            (7.0, 1.0),
        ] {
            let got = erf(x);
            assert!((got - want).abs() <= 2e-15, "erf({x}) = {got}, want {want}");
        }
        assert!(erf(f64::NAN).is_nan());
    }

    #[test]
    fn activations_in_f64() {
        assert_eq!(Activation::None.apply(-2.5), -2.5);
        assert!((Activation::Silu.apply(1.0) - 0.7310585786300049).abs() < 1e-15);
        // gelu(1) with erf: 0.8413447460685429; with tanh: 0.8411919906082768.
        assert!((Activation::GeluErf.apply(1.0) - 0.8413447460685429).abs() < 1e-15);
        assert!((Activation::GeluTanh.apply(1.0) - 0.8411919906082768).abs() < 1e-15);
        let m = Map::affine(2.0, -1.0).then(Activation::Silu);
        assert!((m.apply(1.0) - 0.7310585786300049).abs() < 1e-15);
        assert_eq!(Map::IDENTITY.apply(-0.0).to_bits(), (-0.0f64).to_bits());
    }
}
