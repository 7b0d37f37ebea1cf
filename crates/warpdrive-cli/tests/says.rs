//! The `warpdrive` binary says what it did (issue 31): its help names every command, a run
//! ends with what ran and where the results are, progress shows in a pipe, errors are one
//! line each cause once, and doctor speaks in words. Runs on the CPU backend, needs no GPU.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wd-says-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `warpdrive ARGS` in `dir` with stdout and stderr piped (never a terminal), a
/// backtrace asked for (none must show) and debug logs on.
fn warpdrive(dir: &Path, args: &[&str]) -> Output {
    Command::new(common::warpdrive_bin())
        .current_dir(dir)
        .env_remove("WARPDRIVE_DEVICE")
        .env("RUST_BACKTRACE", "1")
        .env("WARPDRIVE_LOG", "warpdrive_bench=debug")
        .args(args)
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn succeeded(out: &Output) -> (String, String) {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

/// Asserts a failure with exactly one line on stderr, `error: ...`: no `Caused by` list, no
/// backtrace; returns that line.
fn one_error_line(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

#[test]
fn help_names_every_command() {
    let dir = tempdir("help");
    let (help, _) = succeeded(&warpdrive(&dir, &["--help"]));
    let about = help.lines().next().unwrap();
    let listed = help
        .split("Commands:")
        .nth(1)
        .and_then(|s| s.split("Options:").next())
        .unwrap();
    for command in listed
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
    {
        assert!(about.contains(command), "{command} not in {about:?}");
    }
    for command in ["doctor", "bench", "report", "moe"] {
        assert!(about.contains(command), "{command} not in {about:?}");
    }
}

/// The README's `warpdrive` commands use only flags their command has, and `bench --list`
/// is there.
#[test]
fn readme_commands_match_the_binary() {
    let dir = tempdir("readme");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    // The `warpdrive ...` lines of its ```sh blocks, comments cut.
    let mut in_sh = false;
    let mut commands: Vec<&str> = Vec::new();
    for line in readme.lines().map(str::trim) {
        if line.starts_with("```") {
            in_sh = line == "```sh";
        } else if let Some(c) = line.strip_prefix("warpdrive ").filter(|_| in_sh) {
            commands.push(c.split(" #").next().unwrap().trim());
        }
    }
    assert!(
        commands.iter().any(|c| c.starts_with("bench --list")),
        "{commands:?}"
    );
    for command in &commands {
        let sub = command.split_whitespace().next().unwrap();
        let help_args = if sub.starts_with('-') {
            vec!["--help"]
        } else {
            vec![sub, "--help"]
        };
        let (help, _) = succeeded(&warpdrive(&dir, &help_args));
        for flag in command
            .split_whitespace()
            .map(|w| w.trim_matches(|c| c == '[' || c == ']'))
            .filter(|w| w.starts_with("--"))
            .map(|w| w.split('=').next().unwrap())
        {
            assert!(
                help.contains(flag),
                "README: `warpdrive {command}`: {flag} not in `{sub} --help`"
            );
        }
    }
    let (list, _) = succeeded(&warpdrive(&dir, &["bench", "--list"]));
    for suite in ["ceilings", "transfer", "moe"] {
        assert!(list.lines().any(|l| l.starts_with(suite)), "{list}");
    }
}

#[test]
fn bench_ends_with_what_ran_and_where_the_results_are() {
    let dir = tempdir("bench");
    let out = warpdrive(
        &dir,
        &["bench", "telemetry", "--device", "cpu", "--scale", "tiny"],
    );
    let (stdout, stderr) = succeeded(&out);
    let last: Vec<&str> = stdout.lines().rev().take(2).collect();
    assert!(
        last[1].starts_with("ran ceilings, telemetry in ") && last[1].ends_with(" s"),
        "{stdout}"
    );
    let written = last[0].strip_prefix("results written to ").unwrap();
    assert!(Path::new(written).is_absolute(), "{written}");
    assert_eq!(
        Path::new(written),
        dir.canonicalize().unwrap().join("warpdrive-results.json")
    );
    // Progress in a pipe: a line per step, and no colour codes in the logs.
    for step in [
        "ceilings (suite 1 of 2)",
        "telemetry (suite 2 of 2)",
        "ceilings: host_memcpy_gbps",
        "ceilings: cpu_gemm_f32_gflops",
        "span-overhead disabled",
    ] {
        assert!(
            stderr.lines().any(|l| l.starts_with(step)),
            "{step}:\n{stderr}"
        );
    }
    assert!(stderr.contains("DEBUG"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a pipe:\n{stderr:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows say what they measured: no row over its ceiling by citing itself, CPU copies say
/// what bounds them, cases name the sizes they ran, and shrunk MoE layers say so.
#[test]
fn rows_say_what_they_measured() {
    let dir = tempdir("rows");
    let args = [
        "bench", "transfer", "kernels", "moe", "--device", "cpu", "--scale", "tiny",
    ];
    let (stdout, _) = succeeded(&warpdrive(&dir, &args));
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("warpdrive-results.json")).unwrap())
            .unwrap();
    let rows = results["rows"].as_array().unwrap();
    let field = |r: &serde_json::Value, k: &str| r[k].as_str().unwrap_or_default().to_string();
    for r in rows {
        let (suite, case, variant) = (field(r, "suite"), field(r, "case"), field(r, "variant"));
        let what = format!("{suite} {case} {variant}");
        if variant == "ceiling" {
            match suite.as_str() {
                "ceilings" => assert_eq!(r["pct_of_ceiling"].as_f64(), Some(100.0), "{what}"),
                _ => assert!(r["pct_of_ceiling"].is_null(), "{what} cites itself"),
            }
        }
        if suite == "transfer" && (case == "h2d" || case == "d2h") {
            let extra = &r["extra"];
            assert_eq!(
                extra["copy"], "host memcpy (CPU backend: no PCIe)",
                "{what}"
            );
            assert!(
                extra["ceiling"].is_string() || extra["unbounded"].is_string(),
                "{what}: {extra}"
            );
        }
        if case == "host-copy-rate" {
            assert_eq!(r["extra"]["ceiling"], "host_memcpy_gbps", "{what}");
        }
        if let Some(n) = case.strip_prefix("gemm-bf16-") {
            assert_eq!(n, r["size"].to_string(), "{what} ran at size {}", r["size"]);
        }
        if suite == "moe" && r["extra"]["hidden"].is_u64() {
            assert!(
                case.ends_with("/16"),
                "{what}: a shrunk layer under the preset's name"
            );
        }
    }
    for case in [
        "gemm-bf16-64",
        "40x16-gemm",
        "mixtral-8x7b/16",
        "host-copy-rate",
    ] {
        assert!(rows.iter().any(|r| r["case"] == case), "{case} missing");
    }
    // The table shows the same names.
    assert!(stdout.contains("mixtral-8x7b/16"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_device_names_the_flag() {
    let dir = tempdir("device");
    for args in [
        &["doctor", "--device", "garbage"][..],
        &["bench", "telemetry", "--device", "garbage"],
        &["moe", "--preset", "qwen3-30b-a3b", "--device", "garbage"],
    ] {
        let out = warpdrive(&dir, args);
        let line = one_error_line(&out);
        assert!(
            line.contains("--device") && line.contains("garbage"),
            "{line}"
        );
        assert!(!line.contains("WARPDRIVE_DEVICE"), "{line}");
        // Nothing was reported before the device failed.
        assert!(out.stdout.is_empty(), "{}", text(&out).0);
    }
}

#[test]
fn errors_say_each_cause_once() {
    let dir = tempdir("errors");
    let line = one_error_line(&warpdrive(&dir, &["report", "missing.json"]));
    assert!(line.contains("missing.json"), "{line}");
    assert_eq!(line.matches("os error 2").count(), 1, "{line}");
}

#[test]
fn doctor_speaks_in_words() {
    let dir = tempdir("doctor");
    let out = warpdrive(&dir, &["doctor", "--device", "cpu", "--scale", "tiny"]);
    let (stdout, _) = succeeded(&out);
    assert!(!stdout.contains("null"), "{stdout}");
    assert!(stdout.contains("not measured"), "{stdout}");
    let numa = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("numa "))
        .unwrap();
    assert!(!numa.contains('{'), "{numa}");
    let libraries = stdout.split("libraries:").nth(1).unwrap();
    for line in libraries.lines().take_while(|l| l.starts_with("    ")) {
        let state = line.split_whitespace().nth(1).unwrap();
        match state {
            "loaded" => {}
            "missing" => assert!(line.contains("could not be loaded"), "{line}"),
            other => panic!("{other}: {line}"),
        }
    }
}

/// `warpdrive moe` shows progress, then one line per stage (not one `forward` line on the
/// CPU), their total and the whole-pass time, each under its own label.
#[test]
fn moe_prints_each_stage_under_its_own_label() {
    let dir = tempdir("moe");
    let args = [
        "moe",
        "--preset",
        "mixtral-8x7b",
        "--device",
        "cpu",
        "--scale",
        "tiny",
        "--reps",
        "2",
    ];
    let (stdout, stderr) = succeeded(&warpdrive(&dir, &args));
    assert!(
        stderr.contains("loading the mixtral-8x7b/16 layer"),
        "{stderr}"
    );
    assert!(
        stdout.starts_with("mixtral-8x7b/16 (hidden 256, intermediate 896)"),
        "{stdout}"
    );
    let labels: Vec<&str> = stdout
        .lines()
        .skip(1)
        .map(|l| l.trim_start().split("  ").next().unwrap())
        .collect();
    for stage in ["router", "experts-gate-up", "experts-down", "combine"] {
        assert!(labels.contains(&stage), "{stage}: {labels:?}");
    }
    assert_eq!(&labels[labels.len() - 2..], ["stages total", "whole pass"]);
    let mut unique = labels.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), labels.len(), "a label twice: {labels:?}");
}

#[test]
fn actors_shows_live_counters_then_round_trips_and_terminate() {
    let dir = tempdir("actors");
    let out = warpdrive(
        &dir,
        &[
            "actors",
            "--device",
            "cpu",
            "--seconds",
            "1",
            "--actors",
            "2",
        ],
    );
    let (stdout, _) = succeeded(&out);
    assert!(stdout.contains("2 actors on cpu"), "{stdout}");
    assert!(
        stdout.contains("M msg/s") && stdout.contains("dropped 0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("round trip (64 B") && stdout.contains("p99.9"),
        "{stdout}"
    );
    assert!(stdout.contains("terminated in"), "{stdout}");
    let bad = warpdrive(&dir, &["actors", "--device", "cpu", "--seconds", "0"]);
    assert!(one_error_line(&bad).contains("--seconds 0"));
}
