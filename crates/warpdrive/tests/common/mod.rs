//! Shared by the integration tests: devices, fresh random inputs, tolerances.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warpdrive::Device;

/// The sizes every op is checked at: empty, one, odd, and a large odd size.
pub const SIZES: [usize; 4] = [0, 1, 1023, (1 << 20) + 3];

/// CUDA device 0; GPU tests are `#[ignore]`d, so reaching here without one is a failure.
pub fn cuda() -> Device {
    match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => panic!("GPU test run without a usable CUDA device: {e}"),
    }
}

/// A fresh seed (or `WARPDRIVE_TEST_SEED`), printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed: u64 = std::env::var("WARPDRIVE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {seed} (set WARPDRIVE_TEST_SEED to replay)");
    seed
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1), never all zero.
pub fn random_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub fn random_f64(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-1.0f64..1.0)).collect()
}
