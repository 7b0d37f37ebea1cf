//! The allocation-trace reader (`warpdrive bench memory --replay`): any bytes are a trace or
//! an error, never a panic or an abort, and a trace it accepts round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warpdrive_bench::memory::Trace;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(trace) = Trace::from_json(text) {
        let _ = trace.peak_live_bytes();
        assert_eq!(Trace::from_json(&trace.to_json()).ok(), Some(trace));
    }
});
