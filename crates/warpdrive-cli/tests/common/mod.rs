//! Shared by the CLI's integration tests: the binary under test, and (by being included) a
//! private `XDG_CACHE_HOME`.

use std::path::PathBuf;

/// The `warpdrive` binary under test: `WARPDRIVE_CLI` where set (the GPU bundle's `run.sh`
/// points it at the bundle's copy: cargo's path does not exist on that host), else the one
/// cargo built for these tests.
pub fn warpdrive_bin() -> PathBuf {
    std::env::var_os("WARPDRIVE_CLI")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_warpdrive")))
}

/// The tests, and the CLI they start (which inherits it), use a private `XDG_CACHE_HOME`.
#[path = "../../../warpdrive/tests/common/cache_home.rs"]
#[allow(dead_code)] // private_cache_home: for a test that looks into the cache
pub mod cache_home;
