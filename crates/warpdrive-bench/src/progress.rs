//! Where a run's progress goes: a bar on a terminal, one line per step on stderr otherwise
//! (a log or a pipe still shows what a long run is doing), or nowhere (tests, library calls).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A run's progress: steps and warnings, shown as a bar, as lines or not at all.
#[derive(Debug, Clone)]
pub struct Progress {
    bar: ProgressBar,
    /// Print each step as a line (stderr is not a terminal).
    lines: bool,
}

impl Progress {
    /// Shows nothing but warnings.
    pub fn hidden() -> Progress {
        Progress {
            bar: ProgressBar::hidden(),
            lines: false,
        }
    }

    /// `len` steps on stderr: a bar on a terminal, else a line per step.
    pub fn on_stderr(len: u64) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::lines();
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:24} {pos}/{len} {wide_msg}",
        ) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress { bar, lines: false }
    }

    /// A line per step on stderr, whatever stderr is.
    pub fn lines() -> Progress {
        Progress {
            bar: ProgressBar::hidden(),
            lines: true,
        }
    }

    /// Shows `message` as the current step (and logs it at debug level).
    pub fn step(&self, message: String) {
        tracing::debug!("bench: {message}");
        if self.lines {
            eprintln!("{message}");
        }
        self.bar.set_message(message);
    }

    /// `warning: <message>` on stderr, above the bar.
    pub fn warn(&self, message: &str) {
        self.bar.suspend(|| eprintln!("warning: {message}"));
    }

    /// One more step done.
    pub fn inc(&self) {
        self.bar.inc(1);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
