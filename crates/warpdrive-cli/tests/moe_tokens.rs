//! `warpdrive moe --tokens N` for token counts no pass can run: a clear error and exit status
//! 1 or 2, never an abort (134) or a panic (101). Runs on the CPU backend, needs no GPU.

use std::process::Command;

mod common;

/// Runs `warpdrive moe --preset qwen3-30b-a3b --device cpu --tokens TOKENS`: (status, stderr).
fn moe_tokens(tokens: &str) -> (Option<i32>, String) {
    let out = Command::new(common::warpdrive_bin())
        .args(["moe", "--preset", "qwen3-30b-a3b", "--device", "cpu"])
        .args(["--tokens", tokens])
        .output()
        .expect("the warpdrive binary runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn token_counts_beyond_the_host_are_a_clear_error() {
    for tokens in ["4294967295", "18446744073709551615"] {
        let (code, stderr) = moe_tokens(tokens);
        assert!(
            matches!(code, Some(1 | 2)),
            "--tokens {tokens}: {code:?}\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "--tokens {tokens}: {stderr}");
        assert!(stderr.contains(tokens), "--tokens {tokens}: {stderr}");
        assert!(
            stderr.contains("invalid argument"),
            "--tokens {tokens}: {stderr}"
        );
    }
}

/// No tokens is no pass to time: refused up front rather than printing an empty profile.
#[test]
fn zero_tokens_is_refused() {
    let (code, stderr) = moe_tokens("0");
    assert!(matches!(code, Some(1 | 2)), "{code:?}\n{stderr}");
    assert!(stderr.contains("--tokens"), "{stderr}");
}
