//! Summary statistics of timing samples.

use serde::{Deserialize, Serialize};

use warpdrive::error::{Error, Result};

/// Median and spread of a set of timing samples (µs, like the samples).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
}

impl Stats {
    /// Median, 10th and 90th percentiles of `samples`, which this sorts in place.
    ///
    /// Percentiles use **linear interpolation between closest ranks** (numpy's default
    /// `linear` method): with the `n` samples sorted, percentile `q` sits at position
    /// `h = (n - 1) · q` and is `x[⌊h⌋] + (h - ⌊h⌋) · (x[⌊h⌋ + 1] - x[⌊h⌋])`. So the median of
    /// an even count is the mean of the two middle samples, and one sample is its own
    /// median, p10 and p90.
    ///
    /// Fails on an empty slice or on a sample that is not finite.
    pub fn from_samples(samples: &mut [f64]) -> Result<Stats> {
        if samples.is_empty() {
            return Err(Error::InvalidArgument(
                "statistics of an empty set of samples".into(),
            ));
        }
        if let Some(bad) = samples.iter().find(|v| !v.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "timing sample {bad} is not a finite number"
            )));
        }
        samples.sort_by(f64::total_cmp);
        Ok(Stats {
            median: percentile_sorted(samples, 0.5),
            p10: percentile_sorted(samples, 0.1),
            p90: percentile_sorted(samples, 0.9),
        })
    }
}

/// Percentile `q` (0..=1) of `samples` by linear interpolation, as [`Stats`] computes its
/// own (NaN for no samples): the tails rows report beside the median (p99, p99.9).
pub fn percentile(samples: &[f64], q: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile_sorted(&sorted, q)
}

/// Percentile `q` (0..=1) of non-empty, ascending `sorted`, by linear interpolation.
fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    let Some(&last) = sorted.last() else {
        return f64::NAN;
    };
    let h = (sorted.len() - 1) as f64 * q.clamp(0.0, 1.0);
    let lo = h.floor() as usize;
    match (sorted.get(lo), sorted.get(lo + 1)) {
        (Some(&a), Some(&b)) => a + (h - lo as f64) * (b - a),
        (Some(&a), None) => a,
        _ => last,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn one_sample_is_every_statistic() {
        let s = Stats::from_samples(&mut [7.5]).unwrap();
        assert_eq!((s.median, s.p10, s.p90), (7.5, 7.5, 7.5));
    }

    #[test]
    fn odd_count_median_is_the_middle_sample() {
        let s = Stats::from_samples(&mut [5.0, 1.0, 3.0, 4.0, 2.0]).unwrap();
        assert!(close(s.median, 3.0));
        // h = 4 · 0.1 = 0.4 → 1 + 0.4 · (2 - 1)
        assert!(close(s.p10, 1.4));
        // h = 4 · 0.9 = 3.6 → 4 + 0.6 · (5 - 4)
        assert!(close(s.p90, 4.6));
    }

    #[test]
    fn even_count_median_is_the_mean_of_the_middle_two() {
        let s = Stats::from_samples(&mut [4.0, 1.0, 3.0, 2.0]).unwrap();
        assert!(close(s.median, 2.5));
    }

    #[test]
    fn matches_numpy_linear_on_1_to_10() {
        // numpy.percentile(range(1, 11), [10, 50, 90]) == [1.9, 5.5, 9.1]
        let mut v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let s = Stats::from_samples(&mut v).unwrap();
        assert!(close(s.p10, 1.9));
        assert!(close(s.median, 5.5));
        assert!(close(s.p90, 9.1));
        assert!(v.windows(2).all(|w| w[0] <= w[1]), "sorted in place");
    }

    #[test]
    fn ordering_holds_on_spread_samples() {
        let mut v: Vec<f64> = (0..101).map(|i| ((i * 37) % 101) as f64).collect();
        let s = Stats::from_samples(&mut v).unwrap();
        assert!(s.p10 <= s.median && s.median <= s.p90);
        assert!(close(s.median, 50.0) && close(s.p10, 10.0) && close(s.p90, 90.0));
    }

    #[test]
    fn empty_and_non_finite_are_errors() {
        assert!(Stats::from_samples(&mut []).is_err());
        assert!(Stats::from_samples(&mut [1.0, f64::NAN]).is_err());
        assert!(Stats::from_samples(&mut [f64::INFINITY]).is_err());
    }
}
