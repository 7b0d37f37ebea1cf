//! Every test process gets its own `XDG_CACHE_HOME`, a folder under the temp dir named after
//! the process, so no test reads or writes the user's autotune file or PTX cache. Included by
//! the integration tests' `common`, the CLI's tests and the library's unit tests (`#[path]`).

use std::path::PathBuf;

/// The folder this process's tests use as `XDG_CACHE_HOME` (created by whatever writes there).
pub fn private_cache_home() -> PathBuf {
    std::env::temp_dir().join(format!("warpdrive-test-cache-{}", std::process::id()))
}

/// Runs before `main`, while the process has one thread: setting the environment then races
/// no reader (from a test it would race the harness's other threads, the CUDA driver's and
/// NVRTC's `getenv`). Nothing reads `XDG_CACHE_HOME` before main.
#[used]
#[link_section = ".init_array"]
static SET_PRIVATE_CACHE_HOME: extern "C" fn() = set_private_cache_home;

extern "C" fn set_private_cache_home() {
    let dir = private_cache_home();
    // A folder an earlier process with the same id left behind would not be fresh.
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("XDG_CACHE_HOME", dir);
}
