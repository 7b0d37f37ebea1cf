//! What crossed each link between tiers: blocks, bytes and time per (from, to) pair, kept in
//! the store's stats and published through the `metrics` facade as it happens.
//!
//! One hop is one record: a block read from the disk for the GPU counts under `disk → gpu`
//! (the read, checksum, decode and upload together) and not also under `disk → host`; a disk
//! read that stops in host memory (the host tier, or the caller's memory for `get_host`)
//! counts under `disk → host`. Bytes are the blocks' own (not the stored, maybe compressed,
//! bytes: `TierStats::disk_bytes_{read,written}` count those). A batched write's time is
//! shared out among its blocks by size.

use std::time::Duration;

use super::Tier;

/// Moves across one tier pair since the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PairStats {
    pub blocks: u64,
    pub bytes: u64,
    /// Summed over the moves (a mean is `nanos / blocks`).
    pub nanos: u64,
}

/// [`PairStats`] for every (from, to) pair of tiers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moves([[PairStats; 3]; 3]);

fn index(t: Tier) -> usize {
    match t {
        Tier::Gpu => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

impl Moves {
    /// The moves from `from` to `to`.
    pub fn pair(&self, from: Tier, to: Tier) -> PairStats {
        self.0[index(from)][index(to)]
    }

    /// Every pair that saw a move, in a fixed order (GPU, host, disk as source, then target).
    pub fn pairs(&self) -> Vec<(Tier, Tier, PairStats)> {
        let mut out = Vec::new();
        for from in TIERS {
            for to in TIERS {
                let s = self.pair(from, to);
                if s.blocks > 0 {
                    out.push((from, to, s));
                }
            }
        }
        out
    }

    /// Counts one block of `bytes` moved from `from` to `to` in `took`, here and in the
    /// `warpdrive_tier_moved_{blocks,bytes}_total` counters and the
    /// `warpdrive_tier_move_seconds` histogram, labelled `from` and `to`.
    pub(crate) fn record(&mut self, from: Tier, to: Tier, bytes: u64, took: Duration) {
        let s = &mut self.0[index(from)][index(to)];
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        s.blocks = s.blocks.saturating_add(1);
        s.bytes = s.bytes.saturating_add(bytes);
        s.nanos = s.nanos.saturating_add(nanos);
        let (f, t) = (from.name(), to.name());
        metrics::counter!("warpdrive_tier_moved_blocks_total", "from" => f, "to" => t).increment(1);
        metrics::counter!("warpdrive_tier_moved_bytes_total", "from" => f, "to" => t)
            .increment(bytes);
        metrics::histogram!("warpdrive_tier_move_seconds", "from" => f, "to" => t)
            .record(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_counted_apart_and_listed_in_order() {
        let mut m = Moves::default();
        m.record(Tier::Disk, Tier::Gpu, 10, Duration::from_nanos(5));
        m.record(Tier::Gpu, Tier::Host, 7, Duration::from_nanos(3));
        m.record(Tier::Gpu, Tier::Host, 1, Duration::from_nanos(4));
        let want = PairStats {
            blocks: 2,
            bytes: 8,
            nanos: 7,
        };
        assert_eq!(m.pair(Tier::Gpu, Tier::Host), want);
        assert_eq!(m.pair(Tier::Host, Tier::Gpu), PairStats::default());
        let listed: Vec<_> = m.pairs().into_iter().map(|(f, t, _)| (f, t)).collect();
        assert_eq!(
            listed,
            vec![(Tier::Gpu, Tier::Host), (Tier::Disk, Tier::Gpu)]
        );
    }
}
