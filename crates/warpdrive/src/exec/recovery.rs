//! Recovery policy: what to do when work fails.
//!
//! - Out of memory: [`run_with_backoff`] halves the batch and tries again, down to a floor;
//!   at the floor the error is returned, naming every batch tried.
//! - Errors that leave the context usable (OOM at the floor, an unsupported architecture
//!   or dtype, no driver or library): with the opt-in [`Fallback::Cpu`] policy,
//!   [`run_with_fallback`] reruns the work on the CPU backend, with a warning.
//! - A sticky device fault (illegal address, trap) is `Error::DeviceLost`: the device layer
//!   marks the device lost, and every later call on it returns `DeviceLost` at once, without
//!   touching the driver. Nothing is retried and nothing falls back: the context is gone and
//!   there is nothing to read back; the process must restart to use the GPU.

use crate::device::{Device, Stream};
use crate::error::{Error, Result};

/// What [`run_with_backoff`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff<T> {
    pub value: T,
    /// The batch that succeeded.
    pub batch: usize,
    /// Every batch tried, in order (the last one succeeded).
    pub tried: Vec<usize>,
}

/// Runs `f(batch)`; on `Error::OutOfMemory` halves the batch (never below `floor`) and runs
/// it again. Returns the value with the batch that worked, or the error of the attempt at
/// the floor with the batches tried added to its detail. Other errors return at once.
pub fn run_with_backoff<T>(
    batch: usize,
    floor: usize,
    mut f: impl FnMut(usize) -> Result<T>,
) -> Result<Backoff<T>> {
    if floor == 0 || batch < floor {
        return Err(Error::InvalidArgument(format!(
            "run_with_backoff: batch {batch} with floor {floor} (need 1 <= floor <= batch)"
        )));
    }
    let mut tried = Vec::new();
    let mut b = batch;
    loop {
        tried.push(b);
        match f(b) {
            Ok(value) => {
                return Ok(Backoff {
                    value,
                    batch: b,
                    tried,
                })
            }
            Err(Error::OutOfMemory { requested, detail }) if b <= floor => {
                let list: Vec<String> = tried.iter().map(|t| t.to_string()).collect();
                return Err(Error::OutOfMemory {
                    requested,
                    detail: format!(
                        "{detail}; batch backed off {} and reached the floor {floor}",
                        list.join(" -> ")
                    ),
                });
            }
            Err(Error::OutOfMemory { .. }) => {
                let next = (b / 2).max(floor);
                tracing::warn!("out of memory at batch {b}; retrying with batch {next}");
                metrics::counter!("warpdrive_oom_retries_total").increment(1);
                b = next;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether failed GPU work may run again on the CPU backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fallback {
    /// Return the error (the default).
    #[default]
    Never,
    /// Rerun on the CPU backend after errors that leave the context usable, with a warning.
    Cpu,
}

/// True for errors after which the same work can run on the CPU backend: the GPU context is
/// still usable (or there never was one). Device loss, bad arguments and driver failures
/// are not among them.
pub fn recoverable_on_cpu(e: &Error) -> bool {
    matches!(
        e,
        Error::OutOfMemory { .. }
            | Error::Unsupported(_)
            | Error::NoDriver(_)
            | Error::LibraryMissing { .. }
            | Error::BadOrdinal { .. }
            | Error::Compile { .. }
    )
}

/// What [`run_with_fallback`] returned, and where it ran.
#[derive(Debug)]
pub struct Recovered<T> {
    pub value: T,
    /// The GPU error that sent the work to the CPU backend; `None` when it ran where asked.
    pub fell_back: Option<Error>,
}

impl Fallback {
    /// `device` as opened, or, under [`Fallback::Cpu`], the CPU backend (with a warning)
    /// when opening it failed recoverably (no driver, no such device).
    pub fn device(self, device: Result<Device>) -> Result<Device> {
        match device {
            Err(e) if self == Fallback::Cpu && recoverable_on_cpu(&e) => {
                tracing::warn!("{e}; falling back to the CPU backend");
                Ok(Device::cpu())
            }
            other => other,
        }
    }
}

/// Runs `op` on a new stream of `device`; when it fails recoverably (see
/// [`recoverable_on_cpu`]) and `policy` is [`Fallback::Cpu`], warns and runs it again on a
/// CPU stream. `op` must make its own inputs on the stream it is given (it may run twice).
pub fn run_with_fallback<T>(
    device: &Device,
    policy: Fallback,
    mut op: impl FnMut(&Stream) -> Result<T>,
) -> Result<Recovered<T>> {
    let first = device.new_stream().and_then(|s| op(&s));
    match first {
        Ok(value) => Ok(Recovered {
            value,
            fell_back: None,
        }),
        Err(e) if policy == Fallback::Cpu && !device.is_host_memory() && recoverable_on_cpu(&e) => {
            tracing::warn!(
                "{} failed ({e}); running it on the CPU backend",
                device.label()
            );
            let cpu = Device::cpu().new_stream()?;
            Ok(Recovered {
                value: op(&cpu)?,
                fell_back: Some(e),
            })
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(bytes: usize) -> Error {
        Error::OutOfMemory {
            requested: bytes,
            detail: "test".into(),
        }
    }

    #[test]
    fn backoff_halves_until_it_fits() {
        let r = run_with_backoff(64, 1, |b| if b > 10 { Err(oom(b)) } else { Ok(b * 2) }).unwrap();
        assert_eq!((r.value, r.batch), (16, 8));
        assert_eq!(r.tried, [64, 32, 16, 8]);
    }

    #[test]
    fn backoff_reaches_the_floor_and_reports() {
        let mut calls = Vec::new();
        let err = run_with_backoff(100, 12, |b| -> Result<()> {
            calls.push(b);
            Err(oom(b))
        })
        .unwrap_err();
        assert_eq!(calls, [100, 50, 25, 12]);
        match err {
            Error::OutOfMemory { requested, detail } => {
                assert_eq!(requested, 12);
                assert!(detail.contains("100 -> 50 -> 25 -> 12"), "{detail}");
                assert!(detail.contains("floor 12"), "{detail}");
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn other_errors_and_bad_arguments_return_at_once() {
        let mut n = 0;
        let err = run_with_backoff(8, 1, |_| -> Result<()> {
            n += 1;
            Err(Error::InvalidArgument("x".into()))
        })
        .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert_eq!(n, 1);
        assert!(run_with_backoff(4, 8, |_| Ok(())).is_err());
        assert!(run_with_backoff(4, 0, |_| Ok(())).is_err());
    }

    #[test]
    fn which_errors_may_fall_back() {
        assert!(recoverable_on_cpu(&oom(1)));
        assert!(recoverable_on_cpu(&Error::Unsupported("bf16".into())));
        assert!(recoverable_on_cpu(&Error::NoDriver("none".into())));
        assert!(!recoverable_on_cpu(&Error::DeviceLost {
            call: "x",
            message: "y".into()
        }));
        assert!(!recoverable_on_cpu(&Error::InvalidArgument("x".into())));
        assert_eq!(
            Fallback::Cpu
                .device(Err(Error::NoDriver("none".into())))
                .unwrap(),
            Device::cpu()
        );
        assert!(Fallback::Never
            .device(Err(Error::NoDriver("none".into())))
            .is_err());
    }

    #[test]
    fn work_on_the_cpu_runs_once_where_asked() {
        let r =
            run_with_fallback(&Device::cpu(), Fallback::Cpu, |s| Ok(s.device().label())).unwrap();
        assert_eq!(r.value, "cpu");
        assert!(r.fell_back.is_none());
    }
}
