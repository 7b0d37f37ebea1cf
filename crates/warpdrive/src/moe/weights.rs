//! Where a layer's weights come from: a seeded random init (computed on the device, the same
//! bits on both backends) or tensors (from a safetensors checkpoint, [`WeightsFile`], or the
//! caller), and the host copy of them ([`HostWeights`]) that tests and tools compare against.

mod checkpoint;
mod upload;

pub use checkpoint::{WeightsFile, INDEX_FILE};

use crate::error::{Error, Result};

use super::MoeConfig;

/// A layer's weights.
#[derive(Debug, Clone)]
pub enum MoeWeights {
    /// Uniform random values with the variance of PyTorch's default `nn.Linear` scale
    /// (1/fan_in), from a counter-based generator keyed by `seed`: the same values on both
    /// backends and on every run. No router bias.
    Random { seed: u64 },
    /// Tensors of one layer read from a safetensors file or sharded checkpoint (memory-mapped
    /// and uploaded in their dtype where it is the layer's: see [`WeightsFile`]).
    File(WeightsFile),
    /// Tensors given by the caller.
    Host(HostWeights),
}

/// A layer's tensors as f32 on the host, row-major in `nn.Linear`'s [out, in] convention.
#[derive(Debug, Clone, PartialEq)]
pub struct HostWeights {
    /// `gate.weight` [E, H].
    pub gate: Vec<f32>,
    /// `gate.bias` \[E\] (the Softmax router adds it to the logits; the SigmoidGrouped router
    /// uses it for selection only, as DeepSeek-V3's `e_score_correction_bias`).
    pub gate_bias: Option<Vec<f32>>,
    /// gate_proj [E, I, H].
    pub w1: Vec<f32>,
    /// up_proj [E, I, H].
    pub w3: Vec<f32>,
    /// down_proj [E, H, I].
    pub w2: Vec<f32>,
}

impl HostWeights {
    /// Fails unless every tensor has the shape `config` needs (the error names the tensor).
    pub fn check(&self, config: &MoeConfig) -> Result<()> {
        let (h, i, e) = (config.hidden, config.intermediate, config.experts);
        let want = |name: &str, len: usize, dims: &[usize]| -> Result<()> {
            let need = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            if need != Some(len) {
                let need = need.map_or("more than fit in memory".into(), |n| n.to_string());
                return Err(Error::InvalidArgument(format!(
                    "MoE weights: `{name}` has {len} elements, shape {dims:?} needs {need}"
                )));
            }
            Ok(())
        };
        want("gate.weight", self.gate.len(), &[e, h])?;
        if let Some(b) = &self.gate_bias {
            want("gate.bias", b.len(), &[e])?;
        }
        want("experts.w1", self.w1.len(), &[e, i, h])?;
        want("experts.w3", self.w3.len(), &[e, i, h])?;
        want("experts.w2", self.w2.len(), &[e, h, i])
    }
}

/// Seed offsets of the tensors of a random init (so they differ from each other). The router
/// weight `gate.weight` [E, H] of `MoeWeights::Random { seed }` has element `i` =
/// `random_value(seed ^ SEED_GATE, i, s)` with `s` = √(3 / H), rounded to the layer's dtype
/// (public: `bench/peers/moe.py` recomputes it).
pub const SEED_GATE: u64 = 0x6761_7465;
pub(crate) const SEED_W13: u64 = 0x7731_3300;
pub(crate) const SEED_W2: u64 = 0x7732_0000;

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `i` of the counter-based generator keyed by `seed` that [`MoeWeights::Random`] draws
/// from (a pure function: `bench/peers/moe.py` recomputes the bench's router weights and
/// inputs with it, so both sides route the same tokens to the same experts).
pub fn random_bits(seed: u64, i: u64) -> u64 {
    mix64(seed ^ mix64(i.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// Element `i` of a random tensor: uniform in [-scale, scale) from 24 random bits (exact in
/// f32). `moe_random` in `kernels/moe.cu` computes the same bits.
pub(crate) fn random_value(seed: u64, i: u64, scale: f32) -> f32 {
    let bits = (random_bits(seed, i) >> 40) as u32;
    let u = bits as f32 * 5.960_464_5e-8;
    (u * 2.0 - 1.0) * scale
}

/// The uniform bound whose variance is 1/fan_in.
pub(crate) fn random_scale(fan_in: usize) -> f32 {
    (3.0 / fan_in.max(1) as f64).sqrt() as f32
}

/// Row `r` of `w13` [E, 2I, H] (interleaved in blocks of 8 rows: w1 rows 8q.. at 16q.., w3
/// rows 8q.. at 16q + 8..) as (is_w3, expert, row of w1/w3).
pub(crate) fn w13_source(row: usize, inter: usize) -> (bool, usize, usize) {
    let (e, r) = (row / (2 * inter), row % (2 * inter));
    (r % 16 >= 8, e, (r / 16) * 8 + r % 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_peers_router_weight_is_this() {
        // bench/peers/moe.py recomputes the bench's router weight (seed 0x6d6f_6521) and pins
        // the same values (WD_PINNED_GATE).
        let want: [f32; 6] = [
            -0.017404694,
            -0.032054175,
            0.014484505,
            -0.022848701,
            -0.0046963175,
            -0.027917335,
        ];
        let scale = random_scale(2048);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(random_value(0x6d6f_6521 ^ SEED_GATE, i as u64, scale), *w);
        }
    }

    #[test]
    fn w13_interleaves_blocks_of_eight_rows() {
        let inter = 16;
        assert_eq!(w13_source(0, inter), (false, 0, 0));
        assert_eq!(w13_source(7, inter), (false, 0, 7));
        assert_eq!(w13_source(8, inter), (true, 0, 0));
        assert_eq!(w13_source(16, inter), (false, 0, 8));
        assert_eq!(w13_source(31, inter), (true, 0, 15));
        assert_eq!(w13_source(32, inter), (false, 1, 0));
    }

    #[test]
    fn random_values_are_bounded_and_spread() {
        let s = 0.5;
        let v: Vec<f32> = (0..10_000).map(|i| random_value(7, i, s)).collect();
        assert!(v.iter().all(|x| (-s..s).contains(x)));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert_ne!(random_value(7, 1, s), random_value(8, 1, s));
    }
}
