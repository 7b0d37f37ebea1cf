//! What runs at process exit.

use std::sync::OnceLock;

use parking_lot::Mutex;

/// With this variable set to `1`, what warpdrive caches for the process's life (the default
/// pools' memory, the cuBLAS handles) is handed back when the process exits, so
/// `compute-sanitizer --leak-check full` reports only memory something still holds (the GPU
/// bundle's `run.sh` sets it).
pub const RELEASE_AT_EXIT: &str = "WARPDRIVE_RELEASE_AT_EXIT";

/// Whether [`RELEASE_AT_EXIT`] is set to `1` (read once).
pub(crate) fn release_at_exit() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| std::env::var_os(RELEASE_AT_EXIT).is_some_and(|v| v == "1"))
}

/// Functions run when the process exits normally ([`at_exit`]), in registration order.
static EXIT_HOOKS: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Runs the latest hook not yet run: C calls one of these per [`at_exit`], newest first.
extern "C" fn run_latest_exit_hook() {
    let hook = EXIT_HOOKS.lock().pop();
    if let Some(hook) = hook {
        // A panic must not unwind into C's exit.
        let _ = std::panic::catch_unwind(hook);
    }
}

/// Runs `hook` when the process exits normally. Each registration is its own C `atexit`
/// entry, so a hook runs before the teardown of whatever was loaded before it registered
/// (the CUDA driver registers at `cuInit`; cuBLAS when it loads). A hook registered more
/// than once runs once.
pub(crate) fn at_exit(hook: fn()) {
    let mut hooks = EXIT_HOOKS.lock();
    if hooks.iter().any(|h| std::ptr::fn_addr_eq(*h, hook)) {
        return;
    }
    hooks.push(hook);
    // SAFETY: `run_latest_exit_hook` is a plain `extern "C" fn()` that never unwinds;
    // atexit only stores the pointer.
    if unsafe { libc::atexit(run_latest_exit_hook) } != 0 {
        hooks.pop();
        tracing::warn!("atexit refused a hook: it will not run at exit");
    }
}
