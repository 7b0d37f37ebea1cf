//! `warpdrive`: the command line of the warpdrive runtime.
//!
//! - `warpdrive doctor`: lists the devices and measures the machine's ceilings.
//! - `warpdrive bench [SUITES...]`: runs benchmark suites (and their peers) and writes a
//!   results file (`docs/BENCH.md`); `--trace out.json` records a Chrome trace of the run.
//! - `warpdrive report RESULTS.json [-o DIR]`: the table, SVG charts and one HTML page.
//! - `warpdrive moe --preset NAME --tokens N [--weights PATH --layer N]`: one MoE layer
//!   forward pass with per-stage timing, on seeded weights or one layer of a checkpoint.
//!
//! - `warpdrive actors [--actors N --producers N --batch N --seconds S]`: persistent actors
//!   with live counters, then round trips and the time to terminate.
//! - `warpdrive serve [--model moe:PRESET --addr ADDR ...]`: the job service
//!   (`warpdrive-serve`).
//! - `warpdrive load [--addr ADDR] [--rate R | --clients N] ...`: load on a running service,
//!   latency percentiles and throughput.
//!
//! `flags` defines the commands and their flags; each command runs in its own module
//! (`doctor`, `benchmark`, `moe`, `results_file` for `report` and the results files); this
//! file dispatches and prints an error as one line.

mod actors;
mod benchmark;
mod doctor;
mod flags;
mod load;
mod moe;
mod results_file;
mod serve;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use warpdrive::moe::{W256Rows, WgmmaW256, WgmmaWide};
use warpdrive_bench as bench;

use benchmark::{bench_traced, list_suites};
use doctor::doctor;
use flags::{scale_named, Cli, Command};
use moe::moe;
use results_file::{report, DEFAULT_RESULTS};

fn main() -> ExitCode {
    init_logging();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, `what: why: ...`, leaving out a cause whose text
/// the line already holds (library errors repeat their source's message), and no backtrace.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Doctor {
            device,
            scale,
            output,
        } => doctor(&device, &scale, output.json.as_deref()),
        Command::Bench {
            suites,
            list,
            replay,
            tier_disk_sizes,
            trace,
            device,
            scale,
            output,
        } => {
            if list {
                list_suites();
                return Ok(());
            }
            let path = output
                .json
                .unwrap_or_else(|| PathBuf::from(DEFAULT_RESULTS));
            let options = bench::Options {
                memory_trace: replay,
                tier_disk_sizes,
            };
            bench_traced(
                &suites,
                (&device, &scale),
                &path,
                &options,
                trace.as_deref(),
            )
        }
        Command::Report { results, out } => report(&results, out.as_deref()),
        Command::Actors(args) => actors::actors(&args),
        Command::Serve(args) => serve::serve(&args),
        Command::Load(args) => load::load(&args),
        Command::Moe {
            preset,
            tokens,
            path,
            reps,
            no_wgmma,
            wgmma_overlap,
            no_wgmma_overlap,
            wgmma_wide,
            no_wgmma_wide,
            wgmma_wide_on,
            wgmma_tma,
            no_wgmma_tma,
            wgmma_weight_rows,
            wgmma_weight_rows_on,
            wgmma_token_rows,
            gemm_items_fastest,
            no_gemm_items_fastest,
            prefill_router,
            no_prefill_router,
            no_decode_kernel,
            scale,
            weights,
            device,
        } => moe(
            (&preset, scale_named(&scale)),
            tokens,
            &path,
            reps,
            moe::Kernels {
                wgmma: !no_wgmma,
                decode: !no_decode_kernel,
                // Both flags together are refused by the parser.
                overlap: match (wgmma_overlap, no_wgmma_overlap) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
                // The parser refuses --wgmma-wide-on beside either and keeps to its values.
                wide: match (wgmma_wide, no_wgmma_wide, wgmma_wide_on.as_deref()) {
                    (true, _, _) | (_, _, Some("both")) => Some(WgmmaWide::Both),
                    (_, true, _) | (_, _, Some("none")) => Some(WgmmaWide::Neither),
                    (_, _, Some("gate-up")) => Some(WgmmaWide::GateUp),
                    (_, _, Some("down")) => Some(WgmmaWide::Down),
                    _ => None,
                },
                tma: match (wgmma_tma, no_wgmma_tma) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
                // The parser keeps each to its values and the others to 256's company.
                // 128: the 256-weight-row tile forced off; 256: on; neither: the plan's choice.
                w256: wgmma_weight_rows.as_deref().map(|rows| {
                    WgmmaW256::new(
                        match (rows, wgmma_weight_rows_on.as_deref()) {
                            ("128", _) => WgmmaWide::Neither,
                            (_, Some("gate-up")) => WgmmaWide::GateUp,
                            (_, Some("down")) => WgmmaWide::Down,
                            _ => WgmmaWide::Both,
                        },
                        match wgmma_token_rows.as_deref() {
                            Some("96") => W256Rows::Rows96,
                            _ => W256Rows::Rows128,
                        },
                    )
                }),
                items_fastest: match (gemm_items_fastest, no_gemm_items_fastest) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
                prefill_router: match (prefill_router, no_prefill_router) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
            },
            weights.file(),
            &device,
        ),
    }
}

/// Logs on stderr, filtered by `WARPDRIVE_LOG` (e.g. `warpdrive=debug`); warnings by default.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("WARPDRIVE_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: in a log file or a pipe they are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let lib = warpdrive::Error::io(Path::new("r.json"), io);
        let e = anyhow::Error::new(lib).context("reading r.json");
        let line = error_line(&e);
        assert_eq!(line.matches("gone").count(), 1, "{line}");
        assert!(line.starts_with("reading r.json: "), "{line}");
    }

    #[test]
    fn unknown_suite_lists_the_known_ones() {
        let err = bench::select_suites(&["nope"]).unwrap_err().to_string();
        assert!(err.contains("ceilings"), "{err}");
    }
}
