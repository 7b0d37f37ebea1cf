//! Budgets per tenant (the `x-warpdrive-tenant` header; `default` when absent): jobs in
//! flight, bytes of job data in flight, and a request rate (a token bucket). A job past its
//! tenant's budget is refused before it is queued — 429 with a reason (and `Retry-After`
//! for the rate), 413 for one job larger than the whole byte budget — and every other tenant
//! is served on. What a job holds is given back when its [`Grant`] drops, however the job
//! ends.
//!
//! Device (GPU) memory is budgeted where it is allocated: as a batch is about to run, each
//! of its jobs charges its tenant the device bytes the model says its rows take
//! ([`Model::device_bytes`](crate::Model::device_bytes)) on the [`DeviceLedger`]; a job past
//! its tenant's budget fails with a reason (429, or 413 when no budget could hold it) and
//! the rest of the batch runs. The charge is given back when the batch ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// One tenant's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Jobs queued or running at once.
    pub jobs_in_flight: usize,
    /// Bytes of job data (input and output, as f32) held at once.
    pub bytes_in_flight: usize,
    /// Jobs a second, sustained (`f64::INFINITY`: no limit)...
    pub rate_per_s: f64,
    /// ...with bursts of this many jobs.
    pub burst: f64,
    /// Bytes of device memory the tenant's jobs may hold at once while their batches run
    /// (`usize::MAX`: no limit).
    pub device_bytes: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            jobs_in_flight: 4096,
            bytes_in_flight: 4 << 30,
            rate_per_s: f64::INFINITY,
            burst: 1.0,
            device_bytes: usize::MAX,
        }
    }
}

/// Why a job was refused.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Over {
    Jobs {
        limit: usize,
    },
    Bytes {
        asked: usize,
        held: usize,
        limit: usize,
    },
    TooLarge {
        asked: usize,
        limit: usize,
    },
    Rate {
        per_s: f64,
        retry_after: Duration,
    },
    Tenants {
        limit: usize,
    },
}

impl Over {
    /// The HTTP status: 413 for a job no budget could take, else 429.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Over::TooLarge { .. } => 413,
            _ => 429,
        }
    }

    /// Seconds to wait before asking again, for the `Retry-After` header.
    pub(crate) fn retry_after_s(&self) -> Option<u64> {
        match self {
            Over::Rate { retry_after, .. } => {
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64)
            }
            _ => None,
        }
    }

    pub(crate) fn message(&self, tenant: &str) -> String {
        match self {
            Over::Jobs { limit } => {
                format!("tenant {tenant:?} has {limit} jobs in flight, its budget")
            }
            Over::Bytes { asked, held, limit } => format!(
                "tenant {tenant:?} holds {held} bytes of jobs; {asked} more is over its budget of {limit}"
            ),
            Over::TooLarge { asked, limit } => format!(
                "a job of {asked} bytes is over tenant {tenant:?}'s whole budget of {limit}"
            ),
            Over::Rate { per_s, .. } => {
                format!("tenant {tenant:?} is over its rate of {per_s} jobs/s")
            }
            Over::Tenants { limit } => {
                format!("{limit} tenants are active, the most the service tracks")
            }
        }
    }
}

#[derive(Debug)]
struct Use {
    jobs: usize,
    bytes: usize,
    tokens: f64,
    refilled: Instant,
}

/// Every tenant's budget and use.
#[derive(Debug)]
pub(crate) struct Budgets {
    default: Budget,
    named: HashMap<String, Budget>,
    max_tenants: usize,
    used: Mutex<HashMap<String, Use>>,
}

/// What an admitted job holds of its tenant's budget, until it drops.
#[derive(Debug)]
pub(crate) struct Grant {
    budgets: Arc<Budgets>,
    tenant: String,
    bytes: usize,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut used = self.budgets.used.lock();
        if let Some(u) = used.get_mut(&self.tenant) {
            u.jobs = u.jobs.saturating_sub(1);
            u.bytes = u.bytes.saturating_sub(self.bytes);
        }
    }
}

impl Budgets {
    /// `default` for every tenant but those `named`, tracking at most `max_tenants` at once.
    pub(crate) fn new(
        default: Budget,
        named: HashMap<String, Budget>,
        max_tenants: usize,
    ) -> Budgets {
        Budgets {
            default,
            named,
            max_tenants: max_tenants.max(1),
            used: Mutex::new(HashMap::new()),
        }
    }

    fn budget(&self, tenant: &str) -> Budget {
        self.named.get(tenant).copied().unwrap_or(self.default)
    }

    /// Admits a job of `bytes` for `tenant` at `now`, or says why not.
    pub(crate) fn admit(
        self: &Arc<Self>,
        tenant: &str,
        bytes: usize,
        now: Instant,
    ) -> Result<Grant, Over> {
        let b = self.budget(tenant);
        if bytes > b.bytes_in_flight {
            return Err(Over::TooLarge {
                asked: bytes,
                limit: b.bytes_in_flight,
            });
        }
        let mut used = self.used.lock();
        if !used.contains_key(tenant) && used.len() >= self.max_tenants {
            // Forget tenants with nothing in flight; their buckets refill to full anyway
            // after burst / rate seconds, so forgetting one gives it at most a burst back.
            used.retain(|_, u| u.jobs > 0);
            if used.len() >= self.max_tenants {
                return Err(Over::Tenants {
                    limit: self.max_tenants,
                });
            }
        }
        let u = used.entry(tenant.to_string()).or_insert(Use {
            jobs: 0,
            bytes: 0,
            tokens: b.burst,
            refilled: now,
        });
        if u.jobs >= b.jobs_in_flight {
            return Err(Over::Jobs {
                limit: b.jobs_in_flight,
            });
        }
        if u.bytes.saturating_add(bytes) > b.bytes_in_flight {
            return Err(Over::Bytes {
                asked: bytes,
                held: u.bytes,
                limit: b.bytes_in_flight,
            });
        }
        if b.rate_per_s.is_finite() {
            let dt = now.saturating_duration_since(u.refilled).as_secs_f64();
            u.tokens = (u.tokens + dt * b.rate_per_s).min(b.burst.max(1.0));
            u.refilled = now;
            if u.tokens < 1.0 {
                let wait = if b.rate_per_s > 0.0 {
                    (1.0 - u.tokens) / b.rate_per_s
                } else {
                    3600.0
                };
                return Err(Over::Rate {
                    per_s: b.rate_per_s,
                    retry_after: Duration::from_secs_f64(wait.min(3600.0)),
                });
            }
            u.tokens -= 1.0;
        }
        u.jobs += 1;
        u.bytes += bytes;
        Ok(Grant {
            budgets: self.clone(),
            tenant: tenant.to_string(),
            bytes,
        })
    }
}

/// Every tenant's device memory in use by running batches, against its budget. Shared by
/// the batcher threads, so batches running at once count together.
#[derive(Debug)]
pub(crate) struct DeviceLedger {
    default: usize,
    named: HashMap<String, usize>,
    used: Mutex<HashMap<String, usize>>,
}

/// Why a job's device memory was refused.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OverDevice {
    pub(crate) asked: usize,
    pub(crate) held: usize,
    pub(crate) limit: usize,
}

impl OverDevice {
    /// 413 when the tenant's whole budget could not hold the job, else 429.
    pub(crate) fn status(&self) -> u16 {
        if self.asked > self.limit {
            413
        } else {
            429
        }
    }

    pub(crate) fn message(&self, tenant: &str) -> String {
        format!(
            "tenant {tenant:?}'s device memory budget is {} bytes: this job needs {} more while \
             its running jobs hold {}",
            self.limit, self.asked, self.held
        )
    }
}

/// Device bytes a running job holds of its tenant's budget, until it drops.
#[derive(Debug)]
pub(crate) struct DeviceGrant<'a> {
    ledger: &'a DeviceLedger,
    tenant: String,
    bytes: usize,
}

impl Drop for DeviceGrant<'_> {
    fn drop(&mut self) {
        let mut used = self.ledger.used.lock();
        if let Some(u) = used.get_mut(&self.tenant) {
            *u = u.saturating_sub(self.bytes);
            if *u == 0 {
                used.remove(&self.tenant);
            }
        }
    }
}

impl DeviceLedger {
    /// Every tenant's device budget: `default`'s, but for those `named`.
    pub(crate) fn new(default: &Budget, named: &HashMap<String, Budget>) -> DeviceLedger {
        DeviceLedger {
            default: default.device_bytes,
            named: named
                .iter()
                .map(|(t, b)| (t.clone(), b.device_bytes))
                .collect(),
            used: Mutex::new(HashMap::new()),
        }
    }

    /// Charges `tenant` `bytes` of device memory, or says why not. Free charges (0 bytes)
    /// always pass.
    pub(crate) fn charge(&self, tenant: &str, bytes: usize) -> Result<DeviceGrant<'_>, OverDevice> {
        let limit = self.named.get(tenant).copied().unwrap_or(self.default);
        let mut used = self.used.lock();
        let held = used.get(tenant).copied().unwrap_or(0);
        if bytes > 0 && held.saturating_add(bytes) > limit {
            return Err(OverDevice {
                asked: bytes,
                held,
                limit,
            });
        }
        if bytes > 0 {
            *used.entry(tenant.to_string()).or_insert(0) += bytes;
        }
        Ok(DeviceGrant {
            ledger: self,
            tenant: tenant.to_string(),
            bytes,
        })
    }
}

/// A tenant name from a header: 1 to 64 visible ASCII characters.
pub(crate) fn tenant_name(header: Option<&[u8]>) -> Result<&str, String> {
    let Some(raw) = header else {
        return Ok("default");
    };
    match std::str::from_utf8(raw) {
        Ok(t) if !t.is_empty() && t.len() <= 64 && t.bytes().all(|c| c.is_ascii_graphic()) => Ok(t),
        _ => Err("a tenant is 1 to 64 visible ASCII characters".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(b: Budget, max_tenants: usize) -> Arc<Budgets> {
        Arc::new(Budgets::new(b, HashMap::new(), max_tenants))
    }

    #[test]
    fn jobs_and_bytes_in_flight_are_given_back_on_drop() {
        let b = budgets(
            Budget {
                jobs_in_flight: 2,
                bytes_in_flight: 100,
                ..Budget::default()
            },
            8,
        );
        let now = Instant::now();
        let g1 = b.admit("a", 60, now).unwrap();
        assert!(matches!(
            b.admit("a", 50, now),
            Err(Over::Bytes { held: 60, .. })
        ));
        let g2 = b.admit("a", 10, now).unwrap();
        assert!(matches!(b.admit("a", 1, now), Err(Over::Jobs { limit: 2 })));
        assert!(b.admit("b", 90, now).is_ok(), "another tenant runs on");
        assert_eq!(b.admit("a", 101, now).unwrap_err().status(), 413);
        drop((g1, g2));
        assert!(b.admit("a", 100, now).is_ok());
    }

    #[test]
    fn the_rate_refills_over_time_and_says_when() {
        let b = budgets(
            Budget {
                rate_per_s: 10.0,
                burst: 2.0,
                ..Budget::default()
            },
            8,
        );
        let t0 = Instant::now();
        let _g = (b.admit("a", 1, t0).unwrap(), b.admit("a", 1, t0).unwrap());
        let e = b.admit("a", 1, t0).unwrap_err();
        assert_eq!((e.status(), e.retry_after_s()), (429, Some(1)));
        assert!(b.admit("a", 1, t0 + Duration::from_millis(100)).is_ok());
    }

    #[test]
    fn idle_tenants_are_forgotten_to_make_room() {
        let b = budgets(Budget::default(), 2);
        let now = Instant::now();
        let busy = b.admit("a", 1, now).unwrap();
        drop(b.admit("b", 1, now).unwrap());
        assert!(b.admit("c", 1, now).is_ok(), "b was idle");
        let _c = b.admit("c", 1, now).unwrap();
        assert!(matches!(
            b.admit("d", 1, now),
            Err(Over::Tenants { limit: 2 })
        ));
        drop(busy);
    }

    #[test]
    fn device_memory_is_charged_per_tenant_while_held() {
        let mut named = HashMap::new();
        named.insert(
            "big".to_string(),
            Budget {
                device_bytes: 1000,
                ..Budget::default()
            },
        );
        let ledger = DeviceLedger::new(
            &Budget {
                device_bytes: 100,
                ..Budget::default()
            },
            &named,
        );
        let a = ledger.charge("a", 60).unwrap();
        let e = ledger.charge("a", 50).unwrap_err();
        assert_eq!((e.held, e.status()), (60, 429));
        assert_eq!(ledger.charge("a", 101).unwrap_err().status(), 413);
        assert!(ledger.charge("b", 100).is_ok(), "another tenant runs on");
        assert!(ledger.charge("big", 900).is_ok(), "a named budget");
        drop(a);
        assert!(ledger.charge("a", 100).is_ok(), "given back on drop");
        assert!(ledger.used.lock().is_empty(), "nothing held once all drop");
    }

    #[test]
    fn tenant_names_are_checked() {
        assert_eq!(tenant_name(None), Ok("default"));
        assert_eq!(tenant_name(Some(b"team-7")), Ok("team-7"));
        for bad in [&b""[..], b"a b", &[0xff], &[b'x'; 65]] {
            assert!(tenant_name(Some(bad)).is_err(), "{bad:?}");
        }
    }
}
