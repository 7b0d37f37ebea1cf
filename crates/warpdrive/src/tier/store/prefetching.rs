//! Prefetching: explicit (`prefetch`) and by pattern, gets of numbered keys watched per
//! prefix and the blocks a sequential or strided run predicts brought up to the GPU.

use std::time::Instant;

use crate::error::Result;

use super::super::prefetch::{Detector, Prefetch};
use super::{check_key, Inner, TierStore};

/// Detectors kept at once (key prefixes watched).
const DETECTORS: usize = 16;

/// `key` as (prefix, number, digits) when it ends in a decimal number.
fn numbered(key: &str) -> Option<(&str, i64, usize)> {
    let digits = key.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits == 0 || digits > 18 {
        return None;
    }
    let (prefix, number) = key.split_at(key.len() - digits);
    Some((prefix, number.parse().ok()?, digits))
}

impl TierStore {
    /// Brings `keys` up to the GPU tier ahead of their gets (absent keys are skipped).
    pub fn prefetch(&self, keys: &[&str]) -> Result<()> {
        for key in keys {
            check_key(key)?;
            let key = key.to_string();
            let mut g = self.inner.lock();
            // Absent keys and blocks the GPU tier cannot take are skipped.
            if g.gpu.contains(&key) || !self.may_fit_gpu(&g, &key) {
                continue;
            }
            let since = Instant::now();
            let below = self.find_below_gpu(&mut g, &key)?;
            self.promote(&mut g, &key, below, since)?;
        }
        Ok(())
    }

    /// Notes a get of `key` and brings up what its prefix's pattern predicts.
    pub(super) fn prefetch_after(&self, g: &mut Inner, key: &str) -> Result<()> {
        let Prefetch::Auto { distance } = self.config.prefetch else {
            return Ok(());
        };
        let Some((prefix, n, digits)) = numbered(key) else {
            return Ok(());
        };
        let i = match g.detectors.iter().position(|(p, _)| p == prefix) {
            Some(i) => i,
            None => {
                if g.detectors.len() == DETECTORS {
                    g.detectors.remove(0);
                }
                g.detectors.push((prefix.to_string(), Detector::new(4)));
                g.detectors.len() - 1
            }
        };
        g.detectors[i].1.record(n);
        for next in g.detectors[i].1.predict(distance) {
            if next < 0 {
                continue;
            }
            let key = format!("{prefix}{next:0digits$}");
            if g.gpu.contains(&key) || !self.may_fit_gpu(g, &key) {
                continue;
            }
            let since = Instant::now();
            let below = self.find_below_gpu(g, &key)?;
            if self.promote(g, &key, below, since)?.is_none() {
                g.stats.prefetched += 1;
                g.prefetched.insert(key);
            }
        }
        Ok(())
    }
}
