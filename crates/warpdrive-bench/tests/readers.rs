//! The file readers never panic or abort, whatever they are given: the allocation-trace
//! reader (`warpdrive bench memory --replay`) and the results reader (`warpdrive report`),
//! with what is done with a results file once read (the table, the derived figures, the
//! report's charts). Malformed input is an error value; well-formed input round-trips.
//!
//! The same readers are cargo-fuzz targets under `fuzz/` (`trace_reader`, `results_reader`).

mod common;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use warpdrive::Device;
use warpdrive_bench::memory::{generate_trace, Trace, TraceOp, TRACE_FORMAT};
use warpdrive_bench::{format_derived, format_table, render_report, Results, Row};

/// Numbers a reader must survive: edges, huge, small.
fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..8,
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(1 << 40),
        Just(usize::MAX as u64 - 1),
        any::<u64>(),
    ]
}

/// One entry of `ops`: mostly op-shaped, sometimes not.
fn op() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![Just("a"), Just("f"), Just("x"), Just("")];
    prop_oneof![
        4 => (tag.clone(), number()).prop_map(|(t, id)| json!([t, id])),
        4 => (tag, number(), number()).prop_map(|(t, id, b)| json!([t, id, b])),
        1 => any::<i64>().prop_map(|n| json!(["a", n, n])),
        1 => Just(json!(["a", 1.5, 2])),
        1 => Just(json!([])),
        1 => Just(json!(null)),
        1 => Just(json!({"a": 0})),
    ]
}

/// A well-formed trace's text, cut short or with one byte changed.
fn damaged(text: String) -> impl Strategy<Value = String> {
    let len = text.len().max(1);
    prop_oneof![
        (0..len).prop_map({
            let t = text.clone();
            move |n| String::from_utf8_lossy(&t.as_bytes()[..n.min(t.len())]).into_owned()
        }),
        (0..len, any::<u8>()).prop_map(move |(i, b)| {
            let mut bytes = text.clone().into_bytes();
            if let Some(x) = bytes.get_mut(i) {
                *x = b;
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }),
    ]
}

fn trace_text() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::collection::vec(op(), 0..24)
            .prop_map(|ops| json!({"format": TRACE_FORMAT, "seed": 1, "ops": ops}).to_string()),
        any::<String>(),
        (1usize..40, any::<u64>())
            .prop_flat_map(|(n, seed)| damaged(generate_trace(n, seed, 1).to_json())),
        Just(format!(
            "{{\"format\": \"{TRACE_FORMAT}\", \"ops\": {}}}",
            "[".repeat(100_000)
        )),
    ]
}

/// Finite floats a reader (and the charts) must survive (JSON carries no others).
fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => 1e-3f64..1e5,
        3 => proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO,
        1 => Just(0.0),
        1 => Just(-1.0),
        1 => Just(f64::MAX),
        1 => Just(f64::MIN_POSITIVE),
        1 => Just(1e-300),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("warpdrive".to_string()),
        Just("torch-x".to_string()),
        Just("ceiling".to_string()),
        Just(String::new()),
        "[a-z<>&\"-]{0,12}",
        any::<String>(),
    ]
}

fn row() -> impl Strategy<Value = Row> {
    let extra = proptest::collection::vec(
        (
            prop_oneof![
                Just("ceiling".to_string()),
                Just("threads".to_string()),
                text()
            ],
            prop_oneof![
                float().prop_map(Value::from),
                text().prop_map(Value::from),
                Just(Value::from("h2d_pinned_gbps")),
            ],
        ),
        0..3,
    );
    (
        (
            prop_oneof![Just("transfer".to_string()), text()],
            text(),
            number(),
            text(),
        ),
        (float(), float(), float()),
        (
            proptest::option::of(float()),
            proptest::option::of(float()),
            proptest::option::of(float()),
        ),
        extra,
    )
        .prop_map(
            |((suite, case, size, variant), (median, p10, p90), (gbps, tflops, pct), extra)| Row {
                suite,
                case,
                size,
                variant,
                median,
                p10,
                p90,
                unit: "us".into(),
                gbps,
                tflops,
                pct_of_ceiling: pct,
                extra: extra.into_iter().collect::<Map<String, Value>>(),
            },
        )
}

/// A results file's text from rows of arbitrary values.
fn built_results() -> impl Strategy<Value = String> {
    let info = Device::cpu().info().unwrap();
    (
        proptest::collection::vec(row(), 0..10),
        proptest::option::of(float()),
    )
        .prop_map(move |(rows, h2d)| {
            let ceilings = warpdrive_bench::Ceilings {
                h2d_pinned_gbps: h2d,
                ..Default::default()
            };
            serde_json::to_string(&Results::new(&info, ceilings, rows)).unwrap_or_default()
        })
}

fn results_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => built_results(),
        2 => built_results().prop_flat_map(damaged),
        1 => any::<String>(),
        1 => Just(format!("{{\"schema\": {}", "[".repeat(100_000))),
    ]
}

/// Bandwidths so far apart that `hi / lo` overflows, or so large the axis end does: plotters
/// looped forever placing the log axis' ticks (found by the proptest below).
#[test]
fn a_report_whose_values_no_axis_can_span_is_an_error() {
    let info = Device::cpu().info().unwrap();
    let row = |size: u64, gbps: f64| Row {
        gbps: Some(gbps),
        ..Row::new(
            "transfer",
            "h2d",
            size,
            "warpdrive",
            warpdrive_bench::Stats {
                median: 1.0,
                p10: 1.0,
                p90: 1.0,
            },
        )
    };
    for rows in [
        vec![row(6, 1e-300), row(7, 5.6e44)],
        vec![row(6, 1.0), row(7, f64::MAX)],
    ] {
        let results = Results::new(&info, Default::default(), rows);
        assert!(render_report(&results).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_trace_reader_never_panics_and_round_trips_what_it_accepts(text in trace_text()) {
        if let Ok(trace) = Trace::from_json(&text) {
            let n = trace.allocations();
            for op in &trace.ops {
                let id = match *op {
                    TraceOp::Alloc { id, .. } | TraceOp::Free { id } => id,
                };
                prop_assert!(id < n, "id {} of {} allocations", id, n);
            }
            let _ = trace.peak_live_bytes();
            prop_assert_eq!(Trace::from_json(&trace.to_json()).ok(), Some(trace));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_results_reader_and_the_report_never_panic(text in results_text()) {
        if let Ok(results) = Results::from_json(&text) {
            let _ = format_table(&results);
            let _ = format_derived(&results);
            let _ = render_report(&results);
        }
    }
}
