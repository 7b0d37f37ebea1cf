//! A small MLP (16 → 32 tanh → 1, squared error) trained by SGD, its parameters flattened as
//! [W1 (32×16), b1, W2, b2]; the host computes forward and backward, the group averages the
//! gradients: the training check of data parallelism.

pub const D: usize = 16;
pub const H: usize = 32;
pub const PARAMS: usize = H * D + H + H + 1;
pub const SAMPLES: usize = 256;
pub const BATCH: usize = 64;
pub const LR: f32 = 0.1;

/// A fixed regression task of `samples`: x uniform in [-1, 1)^16, y = sin(x · w*) + 0.1·x0
/// + noise uniform in [-noise, noise).
pub fn data(seed: u64, samples: usize, noise: f32) -> (Vec<[f32; D]>, Vec<f32>) {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let w: Vec<f32> = (0..D).map(|_| r.random_range(-1.0f32..1.0)).collect();
    let xs: Vec<[f32; D]> = (0..samples)
        .map(|_| std::array::from_fn(|_| r.random_range(-1.0f32..1.0)))
        .collect();
    let ys = xs
        .iter()
        .map(|x| {
            let clean = x.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>().sin() + 0.1 * x[0];
            clean + noise * r.random_range(-1.0f32..1.0)
        })
        .collect();
    (xs, ys)
}

pub fn init(seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..PARAMS).map(|_| r.random_range(-0.3f32..0.3)).collect()
}

fn forward(p: &[f32], x: &[f32; D]) -> ([f32; H], f32) {
    let (w1, rest) = p.split_at(H * D);
    let (b1, rest) = rest.split_at(H);
    let (w2, b2) = rest.split_at(H);
    let a: [f32; H] = std::array::from_fn(|j| {
        let z: f32 = w1[j * D..(j + 1) * D]
            .iter()
            .zip(x)
            .map(|(w, x)| w * x)
            .sum();
        (z + b1[j]).tanh()
    });
    let y = a.iter().zip(w2).map(|(a, w)| a * w).sum::<f32>() + b2[0];
    (a, y)
}

/// The mean squared error / 2 over `idx` and its gradient (mean over `idx`).
pub fn grad(p: &[f32], xs: &[[f32; D]], ys: &[f32], idx: &[usize]) -> (f32, Vec<f32>) {
    let mut g = vec![0.0f32; PARAMS];
    let mut loss = 0.0f32;
    let inv = 1.0 / idx.len() as f32;
    for &i in idx {
        let (a, yh) = forward(p, &xs[i]);
        let dy = (yh - ys[i]) * inv;
        loss += 0.5 * (yh - ys[i]) * (yh - ys[i]) * inv;
        let w2 = &p[H * D + H..H * D + 2 * H];
        for j in 0..H {
            let dz = dy * w2[j] * (1.0 - a[j] * a[j]);
            for k in 0..D {
                g[j * D + k] += dz * xs[i][k];
            }
            g[H * D + j] += dz;
            g[H * D + H + j] += dy * a[j];
        }
        g[PARAMS - 1] += dy;
    }
    (loss, g)
}

/// Sample indices of step `t`'s global batch out of `samples`.
pub fn batch(t: usize, samples: usize) -> Vec<usize> {
    (0..BATCH).map(|k| (t * BATCH + k) % samples).collect()
}

pub fn full_loss(p: &[f32], xs: &[[f32; D]], ys: &[f32]) -> f32 {
    grad(p, xs, ys, &(0..xs.len()).collect::<Vec<_>>()).0
}

/// One rank trains on the whole batch for `steps` of SGD with `momentum` (heavy ball,
/// `m = momentum·m + g`, `p -= lr·m`): the parameters after every step.
pub fn one_rank(
    xs: &[[f32; D]],
    ys: &[f32],
    sd: u64,
    steps: usize,
    lr: f32,
    momentum: f32,
) -> Vec<Vec<f32>> {
    let mut p = init(sd);
    let mut m = vec![0.0f32; PARAMS];
    (0..steps)
        .map(|t| {
            let (_, g) = grad(&p, xs, ys, &batch(t, xs.len()));
            m.iter_mut()
                .zip(&g)
                .for_each(|(m, g)| *m = momentum * *m + g);
            p.iter_mut().zip(&m).for_each(|(p, m)| *p -= lr * m);
            p.clone()
        })
        .collect()
}

/// The rows of this rank's share of step `t`'s global batch.
pub fn my_share(comm: &warpdrive::dist::Comm, t: usize, samples: usize) -> Vec<usize> {
    let share = BATCH / comm.world();
    batch(t, samples)[comm.rank() * share..(comm.rank() + 1) * share].to_vec()
}
