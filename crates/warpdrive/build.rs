// Bakes the git revision into the library: the GPU host that runs the bundle has no `.git`.
fn main() {
    println!("cargo:rerun-if-env-changed=WARPDRIVE_GIT_REV");
    // Rebuild when HEAD moves (a new commit or checkout), so local builds report the right rev.
    // Git names the files: in a worktree `.git` is a file, HEAD lives under the main
    // repository's `worktrees/`, and the refs in its common folder.
    let git = |args: &[&str]| -> Option<String> {
        let out = std::process::Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    if let Some(paths) = git(&["rev-parse", "--git-path", "HEAD", "--git-common-dir"]) {
        let mut lines = paths.lines();
        let head = lines.next().map(str::to_string);
        let common = lines.next().map(std::path::PathBuf::from);
        let watched = head.into_iter().map(std::path::PathBuf::from).chain(
            common
                .into_iter()
                .flat_map(|c| [c.join("refs/heads"), c.join("packed-refs")]),
        );
        for path in watched {
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    let rev = std::env::var("WARPDRIVE_GIT_REV")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=WARPDRIVE_GIT_REV={rev}");
}
