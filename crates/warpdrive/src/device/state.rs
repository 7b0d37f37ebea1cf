//! Per-device state the floors above keep — their pools, tuned configurations and clocks —
//! held by the device handle itself: one slot per kind, made on first use and kept for the
//! process (every handle of one device shares them). The device floor names the slots, not
//! the types in them, so nothing here imports upward.

use std::any::Any;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// The kinds of per-device state, one slot each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// `memory`: the default caching pool.
    DevicePool,
    /// `memory`: the default pinned host pool.
    PinnedPool,
    /// `transfer`: the tuned copy configurations, `Auto` compression's choices and the
    /// link's rate.
    Transfer,
    /// `transfer`: the copy threads (shared by the devices of one NUMA node).
    CopyWorkers,
    /// `telemetry`: the clock that maps GPU events to the host timeline.
    SpanClock,
}

const SLOTS: usize = 5;

type Value = &'static (dyn Any + Send + Sync);

/// The slots of one device.
pub(crate) struct DeviceState {
    values: [OnceLock<Value>; SLOTS],
    /// One lock per slot, held while its value is made: making one slot's value may use
    /// another slot (a tune allocates buffers from the pool), never its own.
    making: [Mutex<()>; SLOTS],
}

impl DeviceState {
    pub(crate) const fn new() -> DeviceState {
        DeviceState {
            values: [const { OnceLock::new() }; SLOTS],
            making: [const { Mutex::new(()) }; SLOTS],
        }
    }

    /// The value in `slot`, made by `make` on first use (a failed `make` leaves the slot
    /// empty, so a later call tries again).
    pub(crate) fn get_or_make<T: Any + Send + Sync>(
        &self,
        slot: Slot,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<&'static T> {
        let i = slot as usize;
        let value = match self.values[i].get() {
            Some(v) => *v,
            None => {
                let _making = self.making[i].lock();
                match self.values[i].get() {
                    Some(v) => *v,
                    None => {
                        let v: Value = Box::leak(Box::new(make()?));
                        *self.values[i].get_or_init(|| v)
                    }
                }
            }
        };
        downcast(slot, value)
    }

    /// The value in `slot` when one was made.
    pub(crate) fn get<T: Any + Send + Sync>(&self, slot: Slot) -> Result<Option<&'static T>> {
        self.values[slot as usize]
            .get()
            .map(|v| downcast(slot, *v))
            .transpose()
    }
}

fn downcast<T: Any + Send + Sync>(slot: Slot, value: Value) -> Result<&'static T> {
    value.downcast_ref::<T>().ok_or_else(|| {
        Error::Unsupported(format!(
            "per-device state {slot:?} holds another type than {}",
            std::any::type_name::<T>()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_made_once_and_a_failed_make_leaves_it_empty() {
        let state = DeviceState::new();
        let r =
            state.get_or_make::<u32>(Slot::Transfer, || Err(Error::InvalidArgument("no".into())));
        assert!(r.is_err());
        assert!(state.get::<u32>(Slot::Transfer).unwrap().is_none());
        let a = state.get_or_make(Slot::Transfer, || Ok(7u32)).unwrap();
        let b = state.get_or_make(Slot::Transfer, || Ok(8u32)).unwrap();
        assert_eq!((*a, *b), (7, 7));
        assert!(std::ptr::eq(a, b));
        // Another type asked of the same slot is an error, not a panic.
        assert!(state.get_or_make(Slot::Transfer, || Ok(1u64)).is_err());
        // Making one slot may use another.
        let outer = state
            .get_or_make(Slot::DevicePool, || {
                Ok(*state.get_or_make(Slot::PinnedPool, || Ok(3u8))? + 1)
            })
            .unwrap();
        assert_eq!(*outer, 4);
    }
}
