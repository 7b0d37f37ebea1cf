//! Batch sizes the device runs efficiently, measured at start (`ServeConfig::tune_batch`):
//! the model runs batches of 1, 2, 4, ... rows up to the largest the service may form, and
//! warpdrive's `batch_knee` finds the best throughput and the knee (the smallest batch within
//! 90 % of it). The service then prefers those sizes: a batch closes at the best size at
//! most (beyond it each row costs more), and the controller starts its rows knob at the knee
//! and never raises it past the best.

use std::time::Instant;

use warpdrive::exec::{batch_knee, BatchSweep};
use warpdrive::Result;

use super::batcher::ServeConfig;
use super::model::Model;

/// Times `model` on batches of 1, 2, 4, ... up to `max` rows (the median of three runs after
/// one warm-up run, on inputs that are not zeros).
pub(crate) fn sweep(model: &mut dyn Model, max: usize) -> Result<BatchSweep> {
    let sizes: Vec<usize> = std::iter::successors(Some(1usize), |&b| {
        (b < max).then(|| b.saturating_mul(2).min(max))
    })
    .collect();
    let width = model.width();
    let mut out = Vec::new();
    batch_knee(&sizes, |rows| {
        let input: Vec<f32> = (0..rows.saturating_mul(width))
            .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
            .collect();
        model.run(&input, &mut out)?;
        let mut us = [0.0f64; 3];
        for u in &mut us {
            let t = Instant::now();
            model.run(&input, &mut out)?;
            *u = t.elapsed().as_secs_f64() * 1e6;
        }
        us.sort_by(f64::total_cmp);
        Ok(us[1].max(1e-3))
    })
}

/// The largest batch the service may form under `config`.
pub(crate) fn largest(config: &ServeConfig) -> usize {
    config
        .controller
        .map_or(config.max_batch_rows, |c| {
            c.max_batch_rows.max(config.max_batch_rows)
        })
        .max(1)
}

/// `config` preferring the sizes `sweep` found.
pub(crate) fn prefer(mut config: ServeConfig, sweep: &BatchSweep) -> ServeConfig {
    match config.controller.as_mut() {
        Some(c) => {
            c.max_batch_rows = c.max_batch_rows.min(sweep.best).max(1);
            config.max_batch_rows = sweep.knee.min(c.max_batch_rows).max(1);
        }
        None => config.max_batch_rows = config.max_batch_rows.min(sweep.best).max(1),
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ControllerConfig;

    fn found(knee: usize, best: usize) -> BatchSweep {
        BatchSweep {
            points: Vec::new(),
            best,
            knee,
        }
    }

    #[test]
    fn batches_stop_at_the_best_size_and_the_controller_starts_at_the_knee() {
        let plain = ServeConfig {
            max_batch_rows: 256,
            ..ServeConfig::default()
        };
        assert_eq!(prefer(plain.clone(), &found(16, 64)).max_batch_rows, 64);
        assert_eq!(prefer(plain.clone(), &found(16, 512)).max_batch_rows, 256);
        let steered = ServeConfig {
            controller: Some(ControllerConfig {
                max_batch_rows: 1024,
                ..ControllerConfig::default()
            }),
            ..plain
        };
        assert_eq!(largest(&steered), 1024);
        let c = prefer(steered, &found(32, 512));
        assert_eq!(c.max_batch_rows, 32);
        assert_eq!(c.controller.unwrap().max_batch_rows, 512);
    }
}
