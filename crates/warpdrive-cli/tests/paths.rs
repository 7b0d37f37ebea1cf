//! The `warpdrive` binary checks its input and output paths before it runs anything: an
//! unwritable `--json` / `--trace` path or a missing or malformed `--replay` trace fails at
//! once, naming the path and why, and leaves an earlier results file as it was.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wd-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `warpdrive ARGS` in `dir` on the CPU backend.
fn warpdrive(dir: &Path, args: &[&str]) -> Output {
    Command::new(common::warpdrive_bin())
        .current_dir(dir)
        .env("WARPDRIVE_DEVICE", "cpu")
        .args(args)
        .output()
        .unwrap()
}

/// Asserts that the command failed before running anything (`started` is what it prints
/// when work starts) with an error that contains each of `mentions`.
fn fails_at_once(out: &Output, started: &str, mentions: &[&str]) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded:\n{stdout}\n{stderr}");
    assert!(
        !stdout.contains(started),
        "the run started:\n{stdout}\n{stderr}"
    );
    for m in mentions {
        assert!(stderr.contains(m), "{m:?} missing from:\n{stderr}");
    }
}

/// A regular file where a folder is needed: nothing can be written under it.
fn blocker(dir: &Path) -> String {
    std::fs::write(dir.join("blocker"), "").unwrap();
    "blocker/out.json".into()
}

#[test]
fn an_unwritable_json_path_fails_before_the_run() {
    let dir = tempdir("json");
    let bad = blocker(&dir);
    let out = warpdrive(&dir, &["bench", "telemetry", "--json", &bad]);
    fails_at_once(&out, "benchmarking on", &[&bad, "blocker"]);
    let out = warpdrive(&dir, &["doctor", "--json", &bad]);
    fails_at_once(&out, "measuring ceilings", &[&bad]);
    let out = warpdrive(&dir, &["bench", "telemetry", "--json", "."]);
    fails_at_once(&out, "benchmarking on", &["a folder"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unwritable_trace_path_fails_before_the_run() {
    let dir = tempdir("trace");
    let bad = blocker(&dir);
    let out = warpdrive(&dir, &["bench", "telemetry", "--trace", &bad]);
    fails_at_once(&out, "benchmarking on", &[&bad]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_replay_trace_fails_before_the_run_and_keeps_the_results_file() {
    let dir = tempdir("replay");
    let results = dir.join("warpdrive-results.json");
    std::fs::write(&results, "good").unwrap();
    let out = warpdrive(&dir, &["bench", "memory", "--replay", "missing.json"]);
    fails_at_once(&out, "benchmarking on", &["missing.json", "No such file"]);
    assert_eq!(std::fs::read_to_string(&results).unwrap(), "good");

    std::fs::write(dir.join("bad.json"), r#"{"format": "other", "ops": []}"#).unwrap();
    let out = warpdrive(&dir, &["bench", "memory", "--replay", "bad.json"]);
    fails_at_once(&out, "benchmarking on", &["bad.json", "format"]);
    assert_eq!(std::fs::read_to_string(&results).unwrap(), "good");
    let _ = std::fs::remove_dir_all(&dir);
}
