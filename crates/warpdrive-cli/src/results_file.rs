//! Results files: checked before a run, written atomically after it (a `.partial` file
//! beside a good one when a suite failed), and rendered by `warpdrive report`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use warpdrive_bench::{self as bench, Results};

/// The results file `bench` writes when `--json` is not given.
pub(crate) const DEFAULT_RESULTS: &str = "warpdrive-results.json";

pub(crate) fn report(results: &Path, out: Option<&Path>) -> Result<()> {
    let loaded =
        Results::read_json(results).with_context(|| format!("reading {}", results.display()))?;
    bench::print_table(&loaded);
    let dir = out.unwrap_or(Path::new("warpdrive-report"));
    let html = bench::write_report(&loaded, dir)?;
    println!("report written to {}", html.display());
    Ok(())
}

/// Fails, naming `path` and why, when the results or trace file could not be written there:
/// checked before a run, so a bad path never costs the run.
pub(crate) fn check_output(path: &Path) -> Result<()> {
    warpdrive::files::check_writable(path)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `results` to `path` when every suite succeeded. After a failure they go to a
/// `.partial` file beside it instead (see [`partial_path`]), so a failed run never replaces
/// a good results file, and the run fails naming the suites.
/// Returns the absolute path written.
pub(crate) fn save_results(
    results: &Results,
    failed: &[(&str, warpdrive::Error)],
    path: &Path,
) -> Result<PathBuf> {
    let path = absolute(path);
    if failed.is_empty() {
        return write_results(results, &path);
    }
    let partial = partial_path(&path);
    write_results(results, &partial)?;
    bail!(
        "{}; the results so far are in {} ({} was left as it was)",
        failures(failed),
        partial.display(),
        path.display()
    )
}

/// `path` from the filesystem root, so that the line naming it works from any folder.
pub(crate) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

pub(crate) fn fail_on(failed: &[(&str, warpdrive::Error)]) -> Result<()> {
    if failed.is_empty() {
        return Ok(());
    }
    bail!("{}", failures(failed))
}

/// `N suite(s) failed: suite: error; ...`.
pub(crate) fn failures(failed: &[(&str, warpdrive::Error)]) -> String {
    let list: Vec<String> = failed.iter().map(|(s, e)| format!("{s}: {e}")).collect();
    format!("{} suite(s) failed: {}", failed.len(), list.join("; "))
}

/// `dir/name.partial.json` for `dir/name.json` (`name.partial` without an extension).
pub(crate) fn partial_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.partial.{}", ext.to_string_lossy()),
        None => format!("{stem}.partial"),
    };
    path.with_file_name(name)
}

/// Writes `results` atomically (a failed write leaves the file that was there whole).
pub(crate) fn write_results(results: &Results, path: &Path) -> Result<PathBuf> {
    results
        .write_json(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::Device;

    #[test]
    fn a_failed_run_keeps_the_good_results_file() {
        let dir = std::env::temp_dir().join(format!("wd-cli-save-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.json");
        std::fs::write(&path, "good").unwrap();
        let info = Device::cpu().info().unwrap();
        let results = Results::new(&info, bench::Ceilings::default(), Vec::new());
        let failed = [("memory", warpdrive::Error::InvalidArgument("boom".into()))];
        let err = save_results(&results, &failed, &path)
            .unwrap_err()
            .to_string();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "good");
        let partial = dir.join("r.partial.json");
        assert!(
            err.contains("memory") && err.contains(&*absolute(&partial).to_string_lossy()),
            "{err}"
        );
        assert_eq!(Results::read_json(&partial).unwrap().rows, results.rows);
        // A run without failures replaces it.
        save_results(&results, &[], &path).unwrap();
        assert!(Results::read_json(&path).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn partial_paths_sit_beside_the_results_file() {
        assert_eq!(
            partial_path(Path::new("out/r.json")),
            Path::new("out/r.partial.json")
        );
        assert_eq!(partial_path(Path::new("r")), Path::new("r.partial"));
    }
}
