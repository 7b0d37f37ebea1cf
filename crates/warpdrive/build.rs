// Bakes the git revision into the library: the GPU host that runs the bundle has no `.git`.
fn main() {
    println!("cargo:rerun-if-env-changed=WARPDRIVE_GIT_REV");
    // Rebuild when HEAD moves (a new commit or checkout), so local builds report the right rev.
    for path in [
        "../../.git/HEAD",
        "../../.git/refs/heads",
        "../../.git/packed-refs",
    ] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let rev = std::env::var("WARPDRIVE_GIT_REV")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(|| {
            let out = std::process::Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=WARPDRIVE_GIT_REV={rev}");
}
