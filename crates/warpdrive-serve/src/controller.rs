//! The controller: once an interval it looks at what the service saw ([`Seen`]) and sets the
//! batcher's two knobs, the rows a batch closes at and the delay a lone job waits for
//! company, to keep the p99 latency of jobs under an objective while the batches grow as
//! large as the load allows.
//!
//! The seed's "90 % utilization" read the way it matters: below capacity the device's busy
//! fraction follows the load, and waiting for company only adds latency, so the delay
//! shrinks when the objective is missed, the device is mostly idle, or batches hold one job
//! each (no one came while it waited), and grows (up to its cap) only while there is
//! latency to spare and the device is busy enough for larger batches to save it work. The
//! rows grow while batches close full (jobs waited for a later batch), and shrink when a
//! batch of several jobs alone runs past the objective on a device with time to spare
//! (on a saturated one fewer rows a batch only lowers the throughput). At saturation the
//! batcher always has a full batch waiting, so the device stays busy; the knobs then only
//! decide how large the batches are.
//!
//! Busy is the fraction of the interval the batcher spent in the model's `run` (which ends
//! with the results on the host): busy time measured around the service's own work, the
//! fallback the issue allows where NVML's GPM metrics are missing (they are on the VMs we
//! measure on).

use std::time::Duration;

use super::stats::Seen;

/// The controller's objective and bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControllerConfig {
    /// The p99 latency (arrival to answer, as the service measures it) to stay under.
    pub p99_target: Duration,
    /// The most rows the controller lets a batch close at.
    pub max_batch_rows: usize,
    /// The longest delay it lets a lone job wait for company.
    pub max_delay: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            p99_target: Duration::from_millis(50),
            max_batch_rows: 1024,
            max_delay: Duration::from_millis(10),
        }
    }
}

/// The batcher's knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// A batch closes once it holds this many rows...
    pub batch_rows: usize,
    /// ...or once its oldest job has waited this long.
    pub delay: Duration,
}

/// The busy fraction below which waiting for company is not worth it.
const MOSTLY_IDLE: f64 = 0.5;
/// The busy fraction at which the device has no time to spare (the 90 %): fewer
/// rows a batch would then mean fewer rows a second, and the queue would only grow.
const SATURATED: f64 = 0.9;
/// A delay this short is no delay.
const DELAY_FLOOR: Duration = Duration::from_micros(20);
/// The first step up from no delay.
const DELAY_STEP: Duration = Duration::from_micros(100);

/// Steers [`Knobs`] toward the objective, one step an interval.
#[derive(Debug, Clone)]
pub struct Controller {
    config: ControllerConfig,
    knobs: Knobs,
}

impl Controller {
    /// A controller that starts from `start` (clamped to the bounds).
    pub fn new(config: ControllerConfig, start: Knobs) -> Controller {
        let config = ControllerConfig {
            max_batch_rows: config.max_batch_rows.max(1),
            ..config
        };
        Controller {
            knobs: Knobs {
                batch_rows: start.batch_rows.clamp(1, config.max_batch_rows),
                delay: start.delay.min(config.max_delay),
            },
            config,
        }
    }

    pub fn knobs(&self) -> Knobs {
        self.knobs
    }

    /// The knobs for the next interval after one that saw `seen`.
    pub fn step(&mut self, seen: &Seen) -> Knobs {
        if seen.jobs == 0 {
            return self.knobs;
        }
        let target = self.config.p99_target.as_secs_f64() * 1e6;
        // Jobs a batch held on average: the company waiting bought, and whether fewer rows
        // could shorten a batch at all (one large job runs alone whatever the knob says).
        let company = seen.jobs as f64 / seen.batches.max(1) as f64;
        let k = &mut self.knobs;
        // Rows: a batch of several jobs past the objective is too large, unless the device is
        // saturated (halving then cuts the throughput and the queue grows without end);
        // batches that close full leave jobs for a later batch, so let them hold more.
        let overlong = seen.run_p99_us > target && company >= 1.5 && seen.busy < SATURATED;
        if overlong && k.batch_rows > 1 {
            k.batch_rows = (k.batch_rows / 2).max(1);
        } else if seen.full_batches > 0.5 && k.batch_rows < self.config.max_batch_rows {
            k.batch_rows = k
                .batch_rows
                .saturating_mul(2)
                .min(self.config.max_batch_rows);
        }
        // Delay: waiting pays only while there is latency to spare, a busy device to save,
        // and company to be had (batches of one job mean no one came while it waited).
        if seen.p99_us > target || seen.busy < MOSTLY_IDLE || company < 1.5 {
            k.delay /= 2;
            if k.delay < DELAY_FLOOR {
                k.delay = Duration::ZERO;
            }
        } else if seen.p99_us < 0.5 * target {
            k.delay = (k.delay * 2).max(DELAY_STEP).min(self.config.max_delay);
        }
        self.knobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller() -> Controller {
        Controller::new(
            ControllerConfig {
                p99_target: Duration::from_millis(10),
                max_batch_rows: 256,
                max_delay: Duration::from_millis(4),
            },
            Knobs {
                batch_rows: 32,
                delay: Duration::from_millis(2),
            },
        )
    }

    fn seen(busy: f64, p99_ms: f64) -> Seen {
        Seen {
            jobs: 100,
            busy,
            p99_us: p99_ms * 1e3,
            run_p99_us: p99_ms * 1e2,
            ..Seen::default()
        }
    }

    #[test]
    fn a_mostly_idle_device_waits_for_no_one() {
        let mut c = controller();
        for _ in 0..10 {
            c.step(&seen(0.1, 3.0));
        }
        assert_eq!(c.knobs().delay, Duration::ZERO);
    }

    #[test]
    fn a_missed_objective_shortens_the_delay() {
        let mut c = controller();
        let k = c.step(&seen(0.8, 20.0));
        assert_eq!(k.delay, Duration::from_millis(1));
    }

    #[test]
    fn spare_latency_on_a_busy_device_lengthens_the_delay_up_to_its_cap() {
        let mut c = controller();
        for _ in 0..10 {
            c.step(&seen(0.8, 1.0));
        }
        assert_eq!(c.knobs().delay, Duration::from_millis(4));
        // ...and between half the objective and the objective, it holds.
        assert_eq!(c.step(&seen(0.8, 7.0)).delay, Duration::from_millis(4));
    }

    #[test]
    fn full_batches_grow_to_the_cap_and_an_overlong_batch_shrinks() {
        let mut c = controller();
        let full = Seen {
            full_batches: 1.0,
            ..seen(0.8, 8.0)
        };
        for _ in 0..10 {
            c.step(&full);
        }
        assert_eq!(c.knobs().batch_rows, 256);
        let long = Seen {
            run_p99_us: 12e3,
            ..full
        };
        assert_eq!(c.step(&long).batch_rows, 128);
    }

    #[test]
    fn a_saturated_device_keeps_its_batch_rows_though_batches_run_long() {
        let mut c = controller();
        let long = Seen {
            run_p99_us: 12e3,
            ..seen(0.95, 30.0)
        };
        for _ in 0..10 {
            c.step(&long);
        }
        assert_eq!(c.knobs().batch_rows, 32, "halving would cut the throughput");
    }

    #[test]
    fn batches_of_one_job_stop_the_wait_and_keep_their_rows() {
        let mut c = controller();
        let lone = Seen {
            batches: 100,
            run_p99_us: 20e3,
            ..seen(0.8, 1.0)
        };
        for _ in 0..10 {
            c.step(&lone);
        }
        assert_eq!(c.knobs().delay, Duration::ZERO, "no company came");
        assert_eq!(
            c.knobs().batch_rows,
            32,
            "fewer rows cannot shorten one job"
        );
    }

    #[test]
    fn an_interval_without_jobs_changes_nothing() {
        let mut c = controller();
        let before = c.knobs();
        assert_eq!(c.step(&Seen::default()), before);
    }

    #[test]
    fn the_start_is_clamped_to_the_bounds() {
        let c = Controller::new(
            ControllerConfig {
                max_batch_rows: 0,
                ..ControllerConfig::default()
            },
            Knobs {
                batch_rows: 99,
                delay: Duration::from_secs(9),
            },
        );
        assert_eq!(c.knobs().batch_rows, 1);
        assert_eq!(c.knobs().delay, ControllerConfig::default().max_delay);
    }
}
