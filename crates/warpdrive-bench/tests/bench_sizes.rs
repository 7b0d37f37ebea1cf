//! Sizes computed from caller input in the benchmark harness (issue 26, item 4): the MoE
//! case's input and replayed allocation traces fail with an error value, never a wrapped
//! size, an overflow panic or an allocation abort.

mod common;

use warpdrive::Error;

/// `warpdrive moe --tokens N`'s input: N · hidden bf16 values on the host.
#[test]
fn moe_case_refuses_inputs_that_overflow_or_exceed_the_host() {
    use warpdrive_bench::moe::case;
    for tokens in [usize::MAX, u32::MAX as usize] {
        let err = case("qwen3-30b-a3b", tokens).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(&tokens.to_string()), "{err}");
    }
    let (c, _, x) = case("qwen3-30b-a3b", 2).unwrap();
    assert_eq!(x.len(), 2 * c.hidden);
}

/// An allocation trace from a file (`warpdrive bench memory --replay`): ids and byte counts
/// from the file size nothing by themselves.
#[test]
fn replay_traces_with_huge_ids_or_bytes_are_refused_or_saturate() {
    use warpdrive_bench::memory::{Trace, TRACE_FORMAT};
    let trace = |ops: &str| format!("{{\"format\": \"{TRACE_FORMAT}\", \"ops\": [{ops}]}}");
    for id in [u64::MAX, 1 << 40] {
        let err = Trace::from_json(&trace(&format!("[\"a\", {id}, 8]"))).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    let big = Trace::from_json(&trace(&format!(
        "[\"a\", 0, {m}], [\"a\", 1, {m}], [\"f\", 0], [\"f\", 1]",
        m = u64::MAX
    )))
    .unwrap();
    assert_eq!(big.peak_live_bytes(), u64::MAX);
}
