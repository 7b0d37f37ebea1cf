//! The CPU backend's shared memory between threads: for one step, each of `world` threads
//! lends its host buffer to the others, and each works on its own share of every buffer in
//! place — no copy into a common area and back out (the in-process group's all-reduce
//! moves the minimal traffic this way: each element read once and written once a rank).
//!
//! Why this is sound: a lender stays inside [`Lending::lend`] (its `&mut` borrow held) until
//! every thread that started working on the lent buffers has finished; the shares are
//! disjoint ranges fixed by the buffers' common length, so no two threads ever hold an
//! overlapping range; and no thread starts working until all `world` have lent (a step that
//! times out before that touches no one's buffer).

use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Why a step did not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LendError {
    /// The deadline passed with these ranks not arrived; the step is abandoned by all.
    Missing(Vec<usize>),
    /// The ranks lent buffers of different lengths (elements × size, in rank order).
    Mismatch(Vec<(usize, usize)>),
    /// A rank outside `0..world`.
    BadRank(usize),
}

struct Step {
    /// Increments when a step completes; a thread waits for its own step's generation.
    generation: u64,
    /// Address, length and element size each rank lent this step.
    lent: Vec<Option<(usize, usize, usize)>>,
    arrived: usize,
    /// Set when a rank gave up waiting for arrivals: late arrivals find it and leave too.
    abandoned: bool,
    /// Ranks done with the step: their share finished, or they left it abandoned.
    done: Vec<bool>,
}

pub(crate) struct Lending {
    world: usize,
    step: Mutex<Step>,
    changed: Condvar,
}

impl Lending {
    pub(crate) fn new(world: usize) -> Lending {
        Lending {
            world,
            step: Mutex::new(Step {
                generation: 0,
                lent: vec![None; world],
                arrived: 0,
                abandoned: false,
                done: vec![false; world],
            }),
            changed: Condvar::new(),
        }
    }

    /// Lends `data` for one step: once every rank has lent its buffer, `work` runs on this
    /// rank's share — the same element range of every rank's buffer, in rank order — and
    /// this returns once every rank's share is done. A rank not arrived by `deadline` makes
    /// the step fail on every rank that came, and no buffer is touched. `rank < world`.
    pub(crate) fn lend<T: bytemuck::Pod + Send>(
        &self,
        rank: usize,
        data: &mut [T],
        deadline: Option<Instant>,
        work: impl FnOnce(&mut [&mut [T]]),
    ) -> Result<(), LendError> {
        let size = std::mem::size_of::<T>();
        if rank >= self.world {
            return Err(LendError::BadRank(rank));
        }
        let mut st = self.step.lock();
        let generation = st.generation;
        if st.abandoned || st.done[rank] {
            return Err(self.leave_abandoned(&mut st, rank));
        }
        st.lent[rank] = Some((data.as_mut_ptr() as usize, data.len(), size));
        st.arrived += 1;
        self.changed.notify_all();
        while st.arrived < self.world && !st.abandoned {
            let timed_out = match deadline {
                Some(d) => self.changed.wait_until(&mut st, d).timed_out(),
                None => {
                    self.changed.wait(&mut st);
                    false
                }
            };
            if timed_out && st.arrived < self.world {
                st.abandoned = true;
                self.changed.notify_all();
            }
        }
        if st.arrived < self.world {
            return Err(self.leave_abandoned(&mut st, rank));
        }
        let lent: Vec<(usize, usize, usize)> = st.lent.iter().flatten().copied().collect();
        drop(st);
        let mismatch = lent.iter().any(|&(_, n, s)| n != data.len() || s != size);
        if !mismatch {
            let (start, end) = share(data.len(), self.world, rank);
            let mut parts: Vec<&mut [T]> = lent
                .iter()
                .map(|&(ptr, _, _)| {
                    // SAFETY: every rank lent a live `&mut [T]` of `data.len()` elements
                    // (checked above: same length and element size) and stays in `lend`,
                    // not touching it, until every share is done (below); `start..end` is
                    // this rank's share, disjoint from every other rank's, so this is the
                    // only reference to these elements anywhere. `T: Pod`: any bits valid.
                    unsafe {
                        std::slice::from_raw_parts_mut((ptr as *mut T).add(start), end - start)
                    }
                })
                .collect();
            work(&mut parts);
        }
        let mut st = self.step.lock();
        st.done[rank] = true;
        if st.done.iter().all(|&d| d) {
            self.reset(&mut st);
        } else {
            while st.generation == generation {
                // Every rank past the arrival wait finishes its share without waiting on
                // anyone: this wait is bounded by their work.
                self.changed.wait(&mut st);
            }
        }
        if mismatch {
            return Err(LendError::Mismatch(
                lent.iter().map(|&(_, n, s)| (n, s)).collect(),
            ));
        }
        Ok(())
    }

    /// A rank leaving an abandoned step: done with it (once), and the last one out resets
    /// it for the next step.
    fn leave_abandoned(&self, st: &mut Step, rank: usize) -> LendError {
        let missing = (0..self.world).filter(|&r| st.lent[r].is_none()).collect();
        st.done[rank] = true;
        if st.done.iter().all(|&d| d) {
            self.reset(st);
        }
        LendError::Missing(missing)
    }

    fn reset(&self, st: &mut Step) {
        st.generation += 1;
        st.lent.iter_mut().for_each(|l| *l = None);
        st.arrived = 0;
        st.abandoned = false;
        st.done.iter_mut().for_each(|d| *d = false);
        self.changed.notify_all();
    }
}

/// Rank `r`'s share of `len` elements over `world` ranks: contiguous, in rank order, sizes
/// differing by at most one.
pub(crate) fn share(len: usize, world: usize, r: usize) -> (usize, usize) {
    let (base, extra) = (len / world, len % world);
    let start = r * base + r.min(extra);
    (start, start + base + usize::from(r < extra))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_rank_works_its_share_of_every_buffer_in_place() {
        for world in 1..=4 {
            let lending = Lending::new(world);
            for len in [0, 1, 7, 1001] {
                let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
                    let lending = &lending;
                    let handles: Vec<_> = (0..world)
                        .map(|rank| {
                            s.spawn(move || {
                                let mut data: Vec<u32> =
                                    (0..len as u32).map(|i| i + 1000 * rank as u32).collect();
                                lending
                                    .lend(rank, &mut data, None, |parts| {
                                        // Each element becomes the sum over the ranks.
                                        let n = parts[0].len();
                                        for i in 0..n {
                                            let sum: u32 = parts.iter().map(|p| p[i]).sum();
                                            parts.iter_mut().for_each(|p| p[i] = sum);
                                        }
                                    })
                                    .unwrap();
                                data
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                let w = world as u32;
                let want: Vec<u32> = (0..len as u32)
                    .map(|i| w * i + 1000 * w * (w - 1) / 2)
                    .collect();
                for out in outs {
                    assert_eq!(out, want, "world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn a_rank_that_never_comes_fails_the_step_and_the_next_one_runs() {
        let lending = Lending::new(2);
        let mut data = [1u8; 8];
        let deadline = Instant::now() + Duration::from_millis(50);
        let e = lending.lend(0, &mut data, Some(deadline), |_| panic!("no work"));
        assert_eq!(e, Err(LendError::Missing(vec![1])));
        // The late rank finds the step abandoned and leaves; then a full step runs.
        let e = lending.lend(1, &mut data, None, |_| panic!("no work"));
        assert_eq!(e, Err(LendError::Missing(vec![1])));
        std::thread::scope(|s| {
            let l = &lending;
            let a = s.spawn(move || l.lend(0, &mut [1u8; 4], None, |_| ()));
            let b = s.spawn(move || l.lend(1, &mut [2u8; 4], None, |_| ()));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
    }

    #[test]
    fn buffers_of_different_lengths_fail_on_every_rank_untouched() {
        let lending = Lending::new(2);
        let outs = std::thread::scope(|s| {
            let l = &lending;
            let a = s.spawn(move || {
                let mut d = [1u16; 3];
                (l.lend(0, &mut d, None, |_| panic!("no work")), d)
            });
            let b = s.spawn(move || {
                let mut d = [2u16; 5];
                (l.lend(1, &mut d, None, |_| panic!("no work")), d.len())
            });
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!(outs.0 .0, Err(LendError::Mismatch(vec![(3, 2), (5, 2)])));
        assert_eq!(outs.0 .1, [1u16; 3]);
        assert!(outs.1 .0.is_err());
    }
}
