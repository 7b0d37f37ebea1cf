//! Output files that must not lose work: [`check_writable`] before a long run, so a bad
//! path fails at once rather than after the run, and [`write_atomic`] at its end, so a
//! reader (or a crash) never sees half a file and a failed write leaves the old one whole.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The folder `path` goes in (`.` for a bare file name).
pub(crate) fn folder(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A fresh hidden name beside `path` (same folder, so a rename onto `path` is atomic).
fn temp_beside(path: &Path) -> Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{} names no file", path.display())))?;
    Ok(folder(path).join(format!(
        ".{}.{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )))
}

/// Fails, naming `path` and why, unless a file can be written there: `path` is not a folder,
/// its folder exists or can be created (it is created), and a file can be created in it.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::io(
            path,
            std::io::Error::new(ErrorKind::IsADirectory, "a folder, not a file"),
        ));
    }
    let dir = folder(path);
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let probe = temp_beside(path)?;
    File::options()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| Error::io(path, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes `bytes` to a temporary file beside `path`, flushes it to disk and renames it onto
/// `path` (creating missing parent folders). On failure `path` is left as it was.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = folder(path);
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = temp_beside(path)?;
    let written = File::options()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wd-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn write_atomic_replaces_the_file_and_never_writes_into_the_old_one() {
        let dir = tempdir("atomic");
        let path = dir.join("r.json");
        std::fs::write(&path, "good").unwrap();
        // A second name for the old file: an in-place write would change it too.
        let old = dir.join("old.json");
        std::fs::hard_link(&path, &old).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "good");
        assert_eq!(leftovers(&dir), Vec::<String>::new());
        // Parent folders are created.
        write_atomic(&dir.join("a/b/c.json"), b"x").unwrap();
        assert_eq!(std::fs::read(dir.join("a/b/c.json")).unwrap(), b"x");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temp_file() {
        let dir = tempdir("failed");
        // The target is a non-empty folder: the rename fails.
        let target = dir.join("r.json");
        std::fs::create_dir_all(target.join("inside")).unwrap();
        assert!(write_atomic(&target, b"new").is_err());
        assert!(target.join("inside").is_dir());
        assert_eq!(leftovers(&dir), Vec::<String>::new());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn check_writable_names_the_path_and_why() {
        let dir = tempdir("check");
        let ok = dir.join("new/r.json");
        check_writable(&ok).unwrap();
        assert!(!ok.exists(), "the check leaves no file");
        assert_eq!(leftovers(&dir.join("new")), Vec::<String>::new());
        check_writable(Path::new("bare-name-in-cwd.json")).unwrap();

        // A file where a folder should be.
        let blocker = dir.join("blocker");
        std::fs::write(&blocker, "").unwrap();
        let err = check_writable(&blocker.join("r.json")).unwrap_err();
        assert!(
            matches!(err, Error::Io { ref path, .. } if path == &blocker),
            "{err}"
        );
        // A folder where the file should be.
        let err = check_writable(&dir).unwrap_err().to_string();
        assert!(
            err.contains("a folder") && err.contains(&*dir.to_string_lossy()),
            "{err}"
        );
        // No file name at all.
        assert!(check_writable(Path::new("/")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
