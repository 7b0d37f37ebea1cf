//! When the batcher closes a batch. Always once the jobs waiting fill the rows knob; before
//! that, [`Dispatch::WhenIdle`] closes it as soon as no batcher thread is running a batch
//! (jobs wait for company only while the device is busy), and [`Dispatch::Window`] only
//! once its oldest job has waited the delay knob (Triton's `max_queue_delay`).
//!
//! Waiting out a window on an idle device buys nothing but latency: below saturation the
//! jobs that arrive while one batch runs make the next batch, so batches grow with the load
//! by themselves, and a job waits at most for the batch ahead of it and its own.

use std::time::Instant;

use super::controller::Knobs;

/// The rule that closes a batch before it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dispatch {
    /// As soon as the device is idle (no batcher thread is running a batch), or once the
    /// oldest job has waited the delay knob while it is busy (a second batcher thread then
    /// runs a batch beside the first).
    #[default]
    WhenIdle,
    /// Once the oldest job has waited the delay knob, idle device or not.
    Window,
}

/// The queue as the batcher sees it when it looks for a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waiting {
    /// Rows queued.
    pub(crate) rows: usize,
    /// When the job that has waited longest arrived.
    pub(crate) oldest: Instant,
    /// Batches running now (on other batcher threads).
    pub(crate) running: usize,
    /// The queue takes no more jobs: what is in it runs at once.
    pub(crate) closed: bool,
}

impl Dispatch {
    /// `None` when a batch closes now, else when it will at the latest (a job arriving or
    /// a batch ending may close it sooner).
    pub(crate) fn closes(self, knobs: Knobs, w: Waiting, now: Instant) -> Option<Instant> {
        let due = crate::later(w.oldest, knobs.delay);
        let idle = self == Dispatch::WhenIdle && w.running == 0;
        if idle || w.closed || w.rows >= knobs.batch_rows || now >= due {
            None
        } else {
            Some(due)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn knobs(rows: usize, delay_ms: u64) -> Knobs {
        Knobs {
            batch_rows: rows,
            delay: Duration::from_millis(delay_ms),
        }
    }

    #[test]
    fn an_idle_device_takes_a_lone_job_at_once_and_a_window_waits_for_company() {
        let now = Instant::now();
        let lone = Waiting {
            rows: 1,
            oldest: now,
            running: 0,
            closed: false,
        };
        assert_eq!(Dispatch::WhenIdle.closes(knobs(256, 2), lone, now), None);
        let due = Dispatch::Window.closes(knobs(256, 2), lone, now);
        assert_eq!(due, Some(now + Duration::from_millis(2)));
    }

    #[test]
    fn a_busy_device_lets_jobs_wait_for_company_up_to_the_delay() {
        let now = Instant::now();
        let busy = Waiting {
            rows: 3,
            oldest: now,
            running: 1,
            closed: false,
        };
        let later = now + Duration::from_millis(2);
        assert_eq!(
            Dispatch::WhenIdle.closes(knobs(256, 2), busy, now),
            Some(later)
        );
        assert_eq!(Dispatch::WhenIdle.closes(knobs(256, 2), busy, later), None);
    }

    proptest! {
        /// Either rule closes a full batch, a closed queue's batch and a batch whose oldest
        /// job has waited the delay at once, and never waits past that delay.
        #[test]
        fn full_closed_or_overdue_batches_close_at_once(
            rows in 1usize..600,
            knob in 1usize..300,
            delay_us in 0u64..5000,
            waited_us in 0u64..5000,
            running in 0usize..3,
            closed: bool,
            window: bool,
        ) {
            let rule = if window { Dispatch::Window } else { Dispatch::WhenIdle };
            let now = Instant::now();
            let oldest = now.checked_sub(Duration::from_micros(waited_us)).unwrap_or(now);
            let k = Knobs { batch_rows: knob, delay: Duration::from_micros(delay_us) };
            let w = Waiting { rows, oldest, running, closed };
            match rule.closes(k, w, now) {
                None => {}
                Some(due) => {
                    prop_assert!(!closed && rows < knob && now < due);
                    prop_assert!(due <= oldest + k.delay);
                    prop_assert!(window || running > 0, "an idle device waited");
                }
            }
        }
    }
}
