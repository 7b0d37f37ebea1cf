//! Which blocks a tier keeps: a byte budget with the seed's watermarks, and CLOCK eviction
//! that never picks a pinned block. Backend-free: the store moves the bytes, this only
//! decides.

use std::collections::HashMap;
use std::hash::Hash;

use crate::error::{Error, Result};

/// A tier's budget and watermarks: eviction starts when a tier would fill past `high` of its
/// budget and frees down to `low` (the seed's 90% / 85%).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub bytes: u64,
    pub high: f64,
    pub low: f64,
}

impl Budget {
    /// `bytes` with the default watermarks (90% / 85%).
    pub fn new(bytes: u64) -> Budget {
        Budget {
            bytes,
            high: 0.90,
            low: 0.85,
        }
    }

    /// `InvalidArgument` unless 0 < low <= high <= 1.
    pub fn check(&self, tier: &str) -> Result<()> {
        let ok = self.low > 0.0 && self.low <= self.high && self.high <= 1.0;
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "{tier} tier: watermarks {} / {} (need 0 < low <= high <= 1)",
                self.low, self.high
            )));
        }
        Ok(())
    }

    fn mark(&self, fraction: f64) -> u64 {
        (self.bytes as f64 * fraction) as u64
    }
}

struct Entry<K> {
    key: K,
    bytes: u64,
    /// Set on access, cleared as the hand passes: a second chance.
    referenced: bool,
    pins: u32,
}

/// The blocks of one tier in CLOCK order.
pub struct Clock<K> {
    budget: Budget,
    ring: Vec<Entry<K>>,
    at: HashMap<K, usize>,
    hand: usize,
    used: u64,
}

impl<K: Clone + Eq + Hash> Clock<K> {
    pub fn new(budget: Budget) -> Clock<K> {
        Clock {
            budget,
            ring: Vec::new(),
            at: HashMap::new(),
            hand: 0,
            used: 0,
        }
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Bytes of the blocks held.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.at.contains_key(key)
    }

    /// Whether a block of `bytes` can ever live here (a budget smaller than one block is a
    /// configuration error the store reports, not something eviction can fix).
    pub fn fits(&self, bytes: u64) -> bool {
        bytes <= self.budget.mark(self.budget.high).max(1)
    }

    /// Blocks to move out before a block of `incoming` bytes comes in: none while the tier
    /// stays under its high watermark, else unpinned blocks in CLOCK order (recently used
    /// ones get a second chance) until it would be down to the low one. Fewer when pins
    /// hold the rest; the caller then sends the block elsewhere. Nothing is removed here.
    pub fn victims(&mut self, incoming: u64) -> Vec<(K, u64)> {
        let after = self.used.saturating_add(incoming);
        if after <= self.budget.mark(self.budget.high) {
            return Vec::new();
        }
        let target = self.budget.mark(self.budget.low);
        let mut free = after.saturating_sub(target);
        let mut out = Vec::new();
        let mut chosen = vec![false; self.ring.len()];
        // Two sweeps: the first clears the referenced bits it passes, the second may take
        // what the first spared.
        let mut steps = 2 * self.ring.len();
        while free > 0 && steps > 0 {
            steps -= 1;
            let i = self.hand;
            self.hand = (self.hand + 1) % self.ring.len();
            let e = &mut self.ring[i];
            if chosen[i] || e.pins > 0 {
                continue;
            }
            if e.referenced {
                e.referenced = false;
                continue;
            }
            chosen[i] = true;
            free = free.saturating_sub(e.bytes);
            out.push((e.key.clone(), e.bytes));
        }
        out
    }

    /// Adds a block (or replaces its size, keeping its pins).
    pub fn insert(&mut self, key: K, bytes: u64) {
        if let Some(&i) = self.at.get(&key) {
            let e = &mut self.ring[i];
            self.used = self.used - e.bytes + bytes;
            e.bytes = bytes;
            e.referenced = true;
            return;
        }
        self.at.insert(key.clone(), self.ring.len());
        self.ring.push(Entry {
            key,
            bytes,
            referenced: false,
            pins: 0,
        });
        self.used += bytes;
    }

    /// Marks an access (a second chance at the next sweep).
    pub fn touch(&mut self, key: &K) {
        if let Some(&i) = self.at.get(key) {
            self.ring[i].referenced = true;
        }
    }

    /// Pins a held block: never a victim until unpinned as often. False when not held.
    pub fn pin(&mut self, key: &K) -> bool {
        match self.at.get(key) {
            Some(&i) => {
                self.ring[i].pins += 1;
                true
            }
            None => false,
        }
    }

    /// Undoes one [`pin`](Self::pin); false when the block is not held or not pinned.
    pub fn unpin(&mut self, key: &K) -> bool {
        match self.at.get(key) {
            Some(&i) if self.ring[i].pins > 0 => {
                self.ring[i].pins -= 1;
                true
            }
            _ => false,
        }
    }

    pub fn is_pinned(&self, key: &K) -> bool {
        self.at.get(key).is_some_and(|&i| self.ring[i].pins > 0)
    }

    /// Drops a block; its size when it was held.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let i = self.at.remove(key)?;
        let e = self.ring.swap_remove(i);
        if let Some(moved) = self.ring.get(i) {
            self.at.insert(moved.key.clone(), i);
        }
        if self.hand >= self.ring.len() {
            self.hand = 0;
        }
        self.used -= e.bytes;
        Some(e.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn victims_skip_pins_and_give_a_second_chance() {
        let mut c = Clock::new(Budget {
            bytes: 100,
            high: 0.9,
            low: 0.5,
        });
        for k in 0..8u32 {
            c.insert(k, 10);
        }
        assert!(c.victims(10).is_empty(), "90 bytes: at the high mark");
        c.pin(&0);
        c.touch(&1);
        assert!(
            c.victims(10).is_empty(),
            "80 + 10 bytes: still at the high mark"
        );
        let v: Vec<u32> = c.victims(20).into_iter().map(|(k, _)| k).collect();
        // 100 bytes after, down to 50: 50 bytes, five blocks, not 0 (pinned) nor 1 (touched)
        // while others remain.
        assert_eq!(v, vec![2, 3, 4, 5, 6]);
        assert!(c.unpin(&0) && !c.unpin(&0));
    }

    #[test]
    fn watermarks_are_checked() {
        assert!(Budget::new(1).check("gpu").is_ok());
        for (h, l) in [(0.5, 0.6), (1.1, 0.5), (0.9, 0.0)] {
            let b = Budget {
                bytes: 1,
                high: h,
                low: l,
            };
            assert!(b.check("gpu").is_err());
        }
    }

    proptest! {
        /// Size accounting holds, victims are held, distinct and never pinned, and taking
        /// them brings the tier to its low mark whenever unpinned blocks allow.
        #[test]
        fn clock_invariants(ops in proptest::collection::vec((0u8..5, 0u32..16, 1u64..40), 1..200)) {
            let mut c = Clock::new(Budget { bytes: 200, high: 0.9, low: 0.6 });
            let mut model: HashMap<u32, (u64, u32)> = HashMap::new();
            for (op, k, bytes) in ops {
                match op {
                    0 => {
                        let victims = c.victims(bytes);
                        let mut seen = std::collections::HashSet::new();
                        for (v, b) in &victims {
                            prop_assert!(seen.insert(*v));
                            prop_assert_eq!(model.get(v).map(|m| m.0), Some(*b));
                            prop_assert_eq!(model[v].1, 0, "a pinned victim");
                        }
                        for (v, _) in &victims {
                            c.remove(v);
                            model.remove(v);
                        }
                        let unpinned: u64 = model.values().filter(|m| m.1 == 0).map(|m| m.0).sum();
                        let after = c.used() + bytes;
                        if after > 180 && unpinned > 0 && victims.is_empty() {
                            prop_assert!(false, "over the high mark with unpinned blocks, no victim");
                        }
                        c.insert(k, bytes);
                        let pins = model.get(&k).map_or(0, |m| m.1);
                        model.insert(k, (bytes, pins));
                    }
                    1 => { c.touch(&k); }
                    2 => {
                        let held = c.pin(&k);
                        prop_assert_eq!(held, model.contains_key(&k));
                        if let Some(m) = model.get_mut(&k) { m.1 += 1; }
                    }
                    3 => {
                        let ok = c.unpin(&k);
                        let expect = model.get(&k).is_some_and(|m| m.1 > 0);
                        prop_assert_eq!(ok, expect);
                        if ok { if let Some(m) = model.get_mut(&k) { m.1 -= 1; } }
                    }
                    _ => {
                        prop_assert_eq!(c.remove(&k), model.remove(&k).map(|m| m.0));
                    }
                }
                prop_assert_eq!(c.used(), model.values().map(|m| m.0).sum::<u64>());
                prop_assert_eq!(c.len(), model.len());
                for (key, m) in &model {
                    prop_assert_eq!(c.is_pinned(key), m.1 > 0);
                }
            }
        }
    }
}
