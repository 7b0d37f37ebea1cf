//! Peer benchmarks: Python scripts (`bench/peers/<suite>.py`) that run the same cases in
//! PyTorch or CuPy in the same invocation, so ratios come from one run on one GPU. The
//! script contract is in `bench/peers/README.md`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use warpdrive::device::Device;
use warpdrive::error::{Error, Result};

use super::results::Row;
use super::{Progress, Scale};

/// Overrides the folder of the peer scripts (default `bench/peers`, relative to the cwd).
pub const PEERS_DIR_ENV: &str = "WARPDRIVE_PEERS_DIR";
/// Overrides the seconds one peer script may run (default 900).
pub const PEER_TIMEOUT_ENV: &str = "WARPDRIVE_PEER_TIMEOUT_S";

const DEFAULT_TIMEOUT_S: u64 = 900;

/// `$WARPDRIVE_PEERS_DIR`, else `bench/peers`.
pub fn peers_dir() -> PathBuf {
    std::env::var_os(PEERS_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("bench/peers"))
}

fn peer_timeout() -> Duration {
    let secs = std::env::var(PEER_TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(DEFAULT_TIMEOUT_S);
    Duration::from_secs(secs)
}

/// Runs the peer script of each suite that has one, when `python3` can `import torch`, and
/// returns their rows. Each script runs as
/// `python3 <peers_dir>/<suite>.py --json --device <cpu|cuda:N> [--quick]`
/// (`--quick` where warpdrive itself uses smaller sizes: the CPU backend), each shown as a
/// step of the progress (a bar on a terminal, else a line on stderr).
///
/// Never fails: a missing interpreter or torch, a script that exits non-zero, times out or
/// prints something other than rows, and rows that break the contract, each become a
/// warning on stderr, and the run goes on without those rows.
pub fn run_peers<S: AsRef<str>>(
    suite_names: &[S],
    device: &Device,
    env: &[(String, String)],
) -> Vec<Row> {
    let peers = Peers {
        dir: peers_dir(),
        python: "python3".into(),
        import_check: Some("torch".into()),
        timeout: peer_timeout(),
        env: env.to_vec(),
    };
    let quick = Scale::for_device(device).quick();
    let progress = Progress::on_stderr(suite_names.len() as u64);
    let rows = peers.run(suite_names, &device.label(), quick, &progress);
    progress.finish();
    rows
}

/// How peer scripts are found and run.
struct Peers {
    dir: PathBuf,
    python: String,
    /// A module the interpreter must import before any script runs.
    import_check: Option<String>,
    timeout: Duration,
    /// Extra environment for the scripts (set by the suites, e.g. a trace file's path).
    env: Vec<(String, String)>,
}

impl Peers {
    fn run<S: AsRef<str>>(
        &self,
        suites: &[S],
        device_label: &str,
        quick: bool,
        progress: &Progress,
    ) -> Vec<Row> {
        let mut rows = Vec::new();
        let mut ready: Option<bool> = None;
        for suite in suites.iter().map(AsRef::as_ref) {
            let script = self.dir.join(format!("{suite}.py"));
            if !script.is_file() {
                continue;
            }
            let ok = *ready.get_or_insert_with(|| match self.check_interpreter() {
                Ok(()) => true,
                Err(e) => {
                    progress.warn(&format!("peer scripts skipped: {e}"));
                    false
                }
            });
            if !ok {
                break;
            }
            progress.step(format!("peer {}", script.display()));
            let mut args = vec!["--json", "--device", device_label];
            if quick {
                args.push("--quick");
            }
            let out = self
                .run_script(&script, &args)
                .and_then(|stdout| parse_peer_rows(&stdout));
            match out {
                Ok(found) => rows.extend(accept_rows(suite, &script, found, progress)),
                Err(e) => progress.warn(&format!("peer {}: {e}", script.display())),
            }
        }
        rows
    }

    fn check_interpreter(&self) -> Result<()> {
        let Some(module) = &self.import_check else {
            return Ok(());
        };
        let status = Command::new(&self.python)
            .args(["-c", &format!("import {module}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| Error::Unsupported(format!("cannot run {}: {e}", self.python)))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Unsupported(format!(
                "`{} -c 'import {module}'` failed ({status})",
                self.python
            )))
        }
    }

    /// The script's stdout; its stderr passes through. Killed after the timeout.
    fn run_script(&self, script: &Path, args: &[&str]) -> Result<String> {
        let io_err = |e| Error::io(script, e);
        let mut child = Command::new(&self.python)
            .arg(script)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(io_err)?;
        let mut pipe = child
            .stdout
            .take()
            .ok_or_else(|| Error::InvalidArgument("peer stdout was not captured".into()))?;
        // Read on a thread so a script that prints a lot cannot block on a full pipe.
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            pipe.read_to_string(&mut text).map(|_| text)
        });
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            if let Some(status) = child.try_wait().map_err(io_err)? {
                break status;
            }
            if Instant::now() >= deadline {
                // Our own child, by its handle.
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                return Err(Error::Unsupported(format!(
                    "timed out after {} s (set {PEER_TIMEOUT_ENV} to allow longer)",
                    self.timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = reader
            .join()
            .map_err(|_| Error::InvalidArgument("peer stdout reader panicked".into()))?
            .map_err(io_err)?;
        if !status.success() {
            return Err(Error::Unsupported(format!("exited with {status}")));
        }
        Ok(stdout)
    }
}

/// Parses a peer's stdout: a JSON array of rows, or an object `{"rows": [...]}`, each row in
/// the results-file shape (`unit`, `gbps`, `tflops`, `pct_of_ceiling` and `extra` may be
/// left out).
pub fn parse_peer_rows(stdout: &str) -> Result<Vec<Row>> {
    let bad = |what: String| Error::InvalidArgument(format!("peer output: {what}"));
    let value: Value = serde_json::from_str(stdout.trim()).map_err(|e| {
        let head: String = stdout.trim().chars().take(120).collect();
        bad(format!("not JSON ({e}); it starts {head:?}"))
    })?;
    let rows = match value {
        Value::Array(rows) => rows,
        Value::Object(mut obj) => match obj.remove("rows") {
            Some(Value::Array(rows)) => rows,
            _ => return Err(bad("an object without a `rows` array".into())),
        },
        other => return Err(bad(format!("expected an array of rows, got {other}"))),
    };
    rows.into_iter()
        .enumerate()
        .map(|(i, v)| serde_json::from_value(v).map_err(|e| bad(format!("row {i}: {e}"))))
        .collect()
}

/// Keeps the rows that keep the contract (this suite, unit `us`, a tool's variant name);
/// warns about the others.
fn accept_rows(suite: &str, script: &Path, rows: Vec<Row>, progress: &Progress) -> Vec<Row> {
    rows.into_iter()
        .filter(|r| {
            let problem = if r.suite != suite {
                Some(format!("suite {:?}, expected {suite:?}", r.suite))
            } else if r.unit != "us" {
                Some(format!("unit {:?}, expected \"us\"", r.unit))
            } else if r.variant.starts_with("warpdrive")
                || r.variant == "ceiling"
                || r.variant == "baseline"
            {
                Some(format!("variant {:?} is not a peer's name", r.variant))
            } else {
                None
            };
            if let Some(p) = &problem {
                progress.warn(&format!(
                    "peer {}: row {}/{} dropped: {p}",
                    script.display(),
                    r.case,
                    r.variant
                ));
            }
            problem.is_none()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: &str = r#"{ "suite": "transfer", "case": "h2d", "size": 67108864,
        "variant": "torch-pinned", "median": 1520.0, "p10": 1500.0, "p90": 1560.0,
        "unit": "us", "gbps": 44.1, "tflops": null, "pct_of_ceiling": null,
        "extra": { "ceiling": "h2d_pinned_gbps" } }"#;

    #[test]
    fn parses_an_array_of_rows() {
        let rows = parse_peer_rows(&format!("[{ROW}]\n")).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.suite.as_str(), r.case.as_str()), ("transfer", "h2d"));
        assert_eq!((r.size, r.variant.as_str()), (67108864, "torch-pinned"));
        assert_eq!((r.median, r.p10, r.p90), (1520.0, 1500.0, 1560.0));
        assert_eq!(r.gbps, Some(44.1));
        assert_eq!(r.tflops, None);
        assert_eq!(r.extra["ceiling"], "h2d_pinned_gbps");
    }

    #[test]
    fn parses_an_object_with_rows_and_fills_defaults() {
        let minimal = r#"{"rows": [{"suite": "s", "case": "c", "size": 1,
            "variant": "cupy-x", "median": 2.0, "p10": 1.0, "p90": 3.0}]}"#;
        let rows = parse_peer_rows(minimal).unwrap();
        assert_eq!(rows[0].unit, "us");
        assert_eq!((rows[0].gbps, rows[0].pct_of_ceiling), (None, None));
        assert!(rows[0].extra.is_empty());
        assert!(parse_peer_rows(r#"{"rows": []}"#).unwrap().is_empty());
    }

    #[test]
    fn rejects_what_is_not_rows() {
        assert!(parse_peer_rows("").is_err());
        assert!(parse_peer_rows("hello").is_err());
        assert!(parse_peer_rows("42").is_err());
        assert!(parse_peer_rows(r#"{"data": []}"#).is_err());
        assert!(parse_peer_rows(r#"[{"suite": "s"}]"#).is_err());
        assert!(parse_peer_rows(
            r#"[{"suite": "s", "case": "c", "size": -1, "variant": "v",
            "median": 1, "p10": 1, "p90": 1}]"#
        )
        .is_err());
    }

    #[test]
    fn drops_rows_that_break_the_contract() {
        let rows = parse_peer_rows(&format!("[{ROW}]")).unwrap();
        let good = rows[0].clone();
        let mut other_suite = good.clone();
        other_suite.suite = "moe".into();
        let mut ours = good.clone();
        ours.variant = "warpdrive".into();
        let mut ms = good.clone();
        ms.unit = "ms".into();
        let kept = accept_rows(
            "transfer",
            Path::new("transfer.py"),
            vec![good.clone(), other_suite, ours, ms],
            &Progress::hidden(),
        );
        assert_eq!(kept, vec![good]);
    }

    #[test]
    #[ignore = "needs python3 (its scripts import only json, os and sys)"]
    fn runs_scripts_and_turns_failures_into_warnings() {
        let py = "python3";
        let dir = std::env::temp_dir().join(format!("wd-peers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Echoes its arguments into `extra` so the test sees what it was given.
        let good = format!(
            "import json, os, sys\nrow = json.loads('''{ROW}''')\nrow['extra']['argv'] = sys.argv[1:]\nrow['extra']['env'] = os.environ.get('WD_TEST_ENV')\nprint(json.dumps([row]))\n"
        );
        std::fs::write(dir.join("transfer.py"), good).unwrap();
        std::fs::write(dir.join("broken.py"), "import sys\nsys.exit(3)\n").unwrap();
        std::fs::write(dir.join("noisy.py"), "print('not json')\n").unwrap();
        let peers = Peers {
            dir: dir.clone(),
            python: py.into(),
            import_check: Some("json".into()),
            timeout: Duration::from_secs(60),
            env: vec![("WD_TEST_ENV".into(), "x".into())],
        };
        let rows = peers.run(
            &["ceilings", "broken", "transfer", "noisy"],
            "cuda:0",
            false,
            &Progress::hidden(),
        );
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].variant, "torch-pinned");
        assert_eq!(
            rows[0].extra["env"], "x",
            "the suites' environment reaches the script"
        );
        assert_eq!(
            rows[0].extra["argv"],
            serde_json::json!(["--json", "--device", "cuda:0"])
        );
        let quick = peers.run(&["transfer"], "cpu", true, &Progress::hidden());
        assert_eq!(
            quick[0].extra["argv"],
            serde_json::json!(["--json", "--device", "cpu", "--quick"])
        );

        // An interpreter without the required module runs nothing.
        let missing = Peers {
            import_check: Some("warpdrive_no_such_module".into()),
            ..peers
        };
        assert!(missing
            .run(&["transfer"], "cpu", true, &Progress::hidden())
            .is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn no_scripts_means_no_rows() {
        let peers = Peers {
            dir: PathBuf::from("/nonexistent/warpdrive-peers"),
            python: "python3".into(),
            import_check: Some("torch".into()),
            timeout: Duration::from_secs(1),
            env: Vec::new(),
        };
        assert!(peers
            .run(&["ceilings"], "cpu", true, &Progress::hidden())
            .is_empty());
    }
}
