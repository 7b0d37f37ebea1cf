//! Access-pattern detection for the store's prefetcher: the positions (ranks in key order)
//! of recent gets tell sequential, strided and random access apart (the seed's
//! `AccessPattern`), and a detected pattern predicts the next positions to bring up.

use std::collections::VecDeque;

/// What recent gets look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessPattern {
    /// Each get is the next key in order (stride 1, either direction).
    Sequential { step: i64 },
    /// A constant stride other than ±1.
    Strided { stride: i64 },
    /// No constant stride.
    Random,
}

/// Whether the store prefetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    Off,
    /// Detect the pattern of gets and bring up `distance` blocks ahead of it.
    Auto {
        distance: usize,
    },
}

/// The last few positions gets asked for.
#[derive(Debug, Clone)]
pub struct Detector {
    recent: VecDeque<i64>,
    window: usize,
}

impl Detector {
    /// A detector that decides from the last `window` gets (at least 3).
    pub fn new(window: usize) -> Detector {
        let window = window.max(3);
        Detector {
            recent: VecDeque::with_capacity(window),
            window,
        }
    }

    /// Notes a get of the key at `position`.
    pub fn record(&mut self, position: i64) {
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(position);
    }

    /// The pattern of the recorded gets: a stride held by every step of the window (a
    /// partly filled window needs three gets).
    pub fn pattern(&self) -> AccessPattern {
        if self.recent.len() < 3 {
            return AccessPattern::Random;
        }
        let stride = self.recent[1] - self.recent[0];
        let steady = self
            .recent
            .iter()
            .zip(self.recent.iter().skip(1))
            .all(|(a, b)| b - a == stride);
        match (steady, stride) {
            (false, _) | (true, 0) => AccessPattern::Random,
            (true, 1 | -1) => AccessPattern::Sequential { step: stride },
            (true, s) => AccessPattern::Strided { stride: s },
        }
    }

    /// The next `distance` positions the pattern predicts (none for random access).
    pub fn predict(&self, distance: usize) -> Vec<i64> {
        let step = match self.pattern() {
            AccessPattern::Sequential { step } => step,
            AccessPattern::Strided { stride } => stride,
            AccessPattern::Random => return Vec::new(),
        };
        let Some(&last) = self.recent.back() else {
            return Vec::new();
        };
        (1..=distance as i64)
            .map_while(|i| step.checked_mul(i).and_then(|d| last.checked_add(d)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(positions: &[i64]) -> Detector {
        let mut d = Detector::new(4);
        for &p in positions {
            d.record(p);
        }
        d
    }

    #[test]
    fn patterns_are_told_apart() {
        assert_eq!(
            fed(&[1, 2]).pattern(),
            AccessPattern::Random,
            "two gets decide nothing"
        );
        assert_eq!(
            fed(&[1, 2, 3, 4]).pattern(),
            AccessPattern::Sequential { step: 1 }
        );
        assert_eq!(
            fed(&[9, 8, 7]).pattern(),
            AccessPattern::Sequential { step: -1 }
        );
        assert_eq!(
            fed(&[0, 5, 10, 15]).pattern(),
            AccessPattern::Strided { stride: 5 }
        );
        assert_eq!(fed(&[3, 9, 4, 1]).pattern(), AccessPattern::Random);
        assert_eq!(fed(&[4, 4, 4]).pattern(), AccessPattern::Random);
        // The window forgets: a new stride takes over once it fills the window.
        assert_eq!(
            fed(&[3, 9, 4, 1, 3, 5, 7]).pattern(),
            AccessPattern::Strided { stride: 2 }
        );
    }

    #[test]
    fn predictions_follow_the_stride_and_stop_at_overflow() {
        assert_eq!(fed(&[0, 3, 6]).predict(3), vec![9, 12, 15]);
        assert_eq!(fed(&[5, 4, 3]).predict(2), vec![2, 1]);
        assert!(fed(&[1, 7, 2]).predict(4).is_empty());
        let near_max = [i64::MAX - 4, i64::MAX - 2, i64::MAX];
        assert!(fed(&near_max).predict(3).is_empty());
    }
}
