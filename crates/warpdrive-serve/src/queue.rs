//! The job queue: one FIFO per priority class, a cap on the jobs waiting, and the rule that
//! picks a batch — higher classes first, FIFO within a class, and a starvation bound: a class
//! that had jobs waiting through `starvation_limit` batches in a row without one taken goes
//! first in the next batch.

use std::collections::VecDeque;
use std::time::Instant;

/// Priority classes: 0 (lowest) to `CLASSES - 1` (highest).
pub const CLASSES: usize = 4;
/// The class of a job that names none.
pub const DEFAULT_PRIORITY: u8 = 1;

/// What the queue needs to know of a job.
pub(crate) trait Queued {
    fn rows(&self) -> usize;
    /// 0..CLASSES.
    fn class(&self) -> usize;
    fn arrived(&self) -> Instant;
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Full,
    Closed,
}

pub(crate) struct Queue<J> {
    classes: [VecDeque<J>; CLASSES],
    jobs: usize,
    rows: usize,
    cap: usize,
    closed: bool,
    /// Batches in a row each class had jobs waiting and none taken.
    skipped: [u32; CLASSES],
    starvation_limit: u32,
}

impl<J: Queued> Queue<J> {
    pub(crate) fn new(cap: usize, starvation_limit: u32) -> Queue<J> {
        Queue {
            classes: Default::default(),
            jobs: 0,
            rows: 0,
            cap,
            closed: false,
            skipped: [0; CLASSES],
            starvation_limit: starvation_limit.max(1),
        }
    }

    /// Queues `job`, unless the queue is full or closed (the job comes back then).
    pub(crate) fn push(&mut self, job: J) -> Result<(), (Refused, J)> {
        if self.closed {
            return Err((Refused::Closed, job));
        }
        if self.jobs >= self.cap {
            return Err((Refused::Full, job));
        }
        self.jobs += 1;
        self.rows = self.rows.saturating_add(job.rows());
        let c = job.class().min(CLASSES - 1);
        self.classes[c].push_back(job);
        Ok(())
    }

    /// No more jobs are queued; those waiting stay to be taken.
    pub(crate) fn close(&mut self) {
        self.closed = true;
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    pub(crate) fn len(&self) -> usize {
        self.jobs
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// When the job that has waited longest arrived.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        self.classes
            .iter()
            .filter_map(|c| c.front().map(Queued::arrived))
            .min()
    }

    /// The next batch: at most `max_rows` rows (one job of more runs alone), classes in
    /// order (a starved class first, then highest first), FIFO within each, stopping at the
    /// first job that does not fit.
    pub(crate) fn take_batch(&mut self, max_rows: usize) -> Vec<J> {
        let mut order: Vec<usize> = (0..CLASSES).rev().collect();
        let starved = (0..CLASSES)
            .filter(|&c| !self.classes[c].is_empty() && self.skipped[c] >= self.starvation_limit)
            .max_by_key(|&c| (self.skipped[c], c));
        if let Some(s) = starved {
            order.retain(|&c| c != s);
            order.insert(0, s);
        }
        let mut batch = Vec::new();
        let mut rows = 0usize;
        let mut took = [false; CLASSES];
        'fill: for c in order {
            while let Some(job) = self.classes[c].front() {
                let r = job.rows();
                if !batch.is_empty() && rows.saturating_add(r) > max_rows {
                    break 'fill;
                }
                rows = rows.saturating_add(r);
                took[c] = true;
                batch.extend(self.classes[c].pop_front());
                if rows >= max_rows {
                    break 'fill;
                }
            }
        }
        for ((skipped, class), took) in self.skipped.iter_mut().zip(&self.classes).zip(took) {
            *skipped = if took || class.is_empty() {
                0
            } else {
                skipped.saturating_add(1)
            };
        }
        self.jobs -= batch.len();
        self.rows = self.rows.saturating_sub(rows);
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    struct J {
        id: usize,
        rows: usize,
        class: usize,
        at: Instant,
    }

    impl Queued for J {
        fn rows(&self) -> usize {
            self.rows
        }
        fn class(&self) -> usize {
            self.class
        }
        fn arrived(&self) -> Instant {
            self.at
        }
    }

    fn job(id: usize, rows: usize, class: usize) -> J {
        J {
            id,
            rows,
            class,
            at: Instant::now(),
        }
    }

    #[test]
    fn higher_classes_go_first_and_fifo_within_one() {
        let mut q = Queue::new(10, 100);
        for (id, class) in [(0, 0), (1, 2), (2, 1), (3, 2), (4, 0)] {
            q.push(job(id, 1, class)).unwrap();
        }
        let ids: Vec<usize> = q.take_batch(4).iter().map(|j| j.id).collect();
        assert_eq!(ids, [1, 3, 2, 0]);
        assert_eq!((q.len(), q.rows()), (1, 1));
    }

    #[test]
    fn a_starved_class_goes_first_after_the_limit() {
        let mut q = Queue::new(100, 3);
        q.push(job(0, 1, 0)).unwrap();
        let mut batches = 0;
        loop {
            q.push(job(1, 1, 3)).unwrap();
            let b = q.take_batch(1);
            batches += 1;
            if b[0].id == 0 {
                break;
            }
            assert!(batches <= 3, "the low job waited past the bound");
        }
        assert_eq!(
            batches, 4,
            "three batches skipped it, the fourth took it first"
        );
    }

    #[test]
    fn full_and_closed_queues_give_the_job_back() {
        let mut q = Queue::new(1, 4);
        q.push(job(0, 1, 1)).unwrap();
        assert_eq!(q.push(job(1, 1, 1)).unwrap_err().0, Refused::Full);
        q.close();
        assert_eq!(q.push(job(2, 1, 1)).unwrap_err().0, Refused::Closed);
        assert_eq!(
            q.take_batch(8).len(),
            1,
            "a closed queue still hands out its jobs"
        );
    }

    #[test]
    fn a_job_larger_than_a_batch_runs_alone() {
        let mut q = Queue::new(10, 4);
        q.push(job(0, 9, 1)).unwrap();
        q.push(job(1, 1, 1)).unwrap();
        assert_eq!(q.take_batch(4).len(), 1);
        assert_eq!(q.take_batch(4).len(), 1);
    }

    proptest! {
        /// Every job comes out exactly once, batches hold at most `max` rows unless one job
        /// alone is larger, and a class never waits through more than limit + CLASSES
        /// batches while jobs of it are queued.
        #[test]
        fn every_job_comes_out_once_within_the_bounds(
            jobs in prop::collection::vec((1usize..6, 0usize..CLASSES), 1..60),
            max in 1usize..12,
            limit in 1u32..5,
        ) {
            let mut q = Queue::new(jobs.len(), limit);
            for (id, &(rows, class)) in jobs.iter().enumerate() {
                q.push(job(id, rows, class)).unwrap();
            }
            let mut seen = vec![false; jobs.len()];
            let mut waited = [0usize; CLASSES];
            while q.len() > 0 {
                let b = q.take_batch(max);
                prop_assert!(!b.is_empty());
                let rows: usize = b.iter().map(|j| j.rows).sum();
                prop_assert!(rows <= max || b.len() == 1);
                for (c, waited) in waited.iter_mut().enumerate() {
                    let queued = q.classes[c].len() + b.iter().filter(|j| j.class == c).count();
                    if b.iter().any(|j| j.class == c) || queued == 0 {
                        *waited = 0;
                    } else {
                        *waited += 1;
                        prop_assert!(*waited <= limit as usize + CLASSES, "class {c}");
                    }
                }
                for j in b {
                    prop_assert!(!seen[j.id]);
                    seen[j.id] = true;
                }
            }
            prop_assert!(seen.iter().all(|&s| s));
            prop_assert_eq!(q.rows(), 0);
        }
    }
}
