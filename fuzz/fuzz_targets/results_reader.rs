//! The results reader (`warpdrive report`) and what is done with a file once read: any bytes
//! are results or an error, and the table, derived figures and report never panic or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warpdrive_bench::{format_derived, format_table, render_report, Results};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(results) = Results::from_json(text) {
        let _ = format_table(&results);
        let _ = format_derived(&results);
        let _ = render_report(&results);
    }
});
