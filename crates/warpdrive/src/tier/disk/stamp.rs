//! Time marks along a store op's stages, for a probe to read back per op (the
//! `tier_disk_probe` example): on with the `tier-stamps` feature, else every call is empty
//! and compiles to nothing. A fixed cost per op on one host and not another is placed by
//! running the probe there (bench/NOTES.md, h-tier-10).

#[cfg(feature = "tier-stamps")]
mod on {
    use std::cell::RefCell;
    use std::time::Instant;

    thread_local! {
        static MARKS: RefCell<Vec<(&'static str, Instant)>> = const { RefCell::new(Vec::new()) };
    }

    /// Notes that this thread's op reached `stage` now.
    pub fn mark(stage: &'static str) {
        let now = Instant::now();
        let _ = MARKS.try_with(|m| m.borrow_mut().push((stage, now)));
    }

    /// This thread's marks since the last call, oldest first.
    pub fn take() -> Vec<(&'static str, Instant)> {
        MARKS
            .try_with(|m| std::mem::take(&mut *m.borrow_mut()))
            .unwrap_or_default()
    }
}

#[cfg(feature = "tier-stamps")]
pub use on::{mark, take};

/// Notes that this thread's op reached `stage` now (nothing without `tier-stamps`).
#[cfg(not(feature = "tier-stamps"))]
#[inline(always)]
pub fn mark(_stage: &'static str) {}

/// This thread's marks since the last call (none without `tier-stamps`).
#[cfg(not(feature = "tier-stamps"))]
pub fn take() -> Vec<(&'static str, std::time::Instant)> {
    Vec::new()
}

/// Whether marks are taken (the `tier-stamps` feature).
pub const ON: bool = cfg!(feature = "tier-stamps");
