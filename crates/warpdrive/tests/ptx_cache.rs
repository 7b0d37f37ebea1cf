//! The PTX cache's failure paths through the real NVRTC, without a GPU: a cached module the
//! driver rejects is compiled anew once (a loader closure stands in for the driver), and a
//! folder that cannot be written is reported once and compiled around. The same fallback on
//! a real driver is `ptx_cache_gpu.rs`.

mod common;

use std::path::{Path, PathBuf};

use common::warnings_during;
use warpdrive::kernels::{Arch, PtxCache, BASIC, EXEC};
use warpdrive::Error;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wd-ptxcache-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// What the driver says of PTX for another architecture than the device's.
fn invalid_ptx() -> Error {
    Error::Driver {
        call: "cuModuleLoadData",
        message: "CUDA_ERROR_INVALID_PTX".into(),
    }
}

/// A stand-in for the driver on a device of architecture `arch`: loads PTX that targets it
/// (the "module" is the PTX's length) and counts its calls.
fn driver(arch: Arch, calls: &mut usize) -> impl FnMut(&str) -> warpdrive::Result<usize> + '_ {
    move |ptx: &str| {
        *calls += 1;
        if ptx.contains(&format!(".target {arch}\n")) {
            Ok(ptx.len())
        } else {
            Err(invalid_ptx())
        }
    }
}

/// Puts into `dir`, under `arch`'s name, BASIC's PTX for a newer architecture: a file
/// whose checksum is right and whose PTX a device of `arch` does not load.
fn plant_foreign_ptx(dir: &Path, arch: Arch) {
    let newer = Arch::parse("sm_100").unwrap();
    let other = PtxCache::at(dir);
    other.ptx(&BASIC, newer).unwrap();
    std::fs::copy(
        other.path_for(&BASIC, newer).unwrap().unwrap(),
        other.path_for(&BASIC, arch).unwrap().unwrap(),
    )
    .unwrap();
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn the_global_ptx_cache_of_a_test_run_is_in_its_private_cache() {
    let home = common::cache_home::private_cache_home();
    let slot = PtxCache::global().path_for(&BASIC, Arch::SM_90A).unwrap();
    let slot = slot.expect("the global cache has a folder");
    assert!(slot.starts_with(&home), "{}", slot.display());
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn a_cached_module_the_driver_rejects_is_compiled_anew_once() {
    let dir = temp_dir("reject");
    let arch = Arch::SM_90A;
    plant_foreign_ptx(&dir, arch);

    // A new process reads the planted file, the driver rejects it, the cache compiles the
    // source anew and the second load succeeds.
    let cache = PtxCache::at(&dir);
    let mut calls = 0;
    let module = cache.load(&BASIC, arch, driver(arch, &mut calls)).unwrap();
    assert_eq!((calls, cache.compiles()), (2, 1));
    assert_eq!(module, cache.ptx(&BASIC, arch).unwrap().len());
    // The file was replaced: the next process loads it at once, compiling nothing.
    let next = PtxCache::at(&dir);
    let mut calls = 0;
    next.load(&BASIC, arch, driver(arch, &mut calls)).unwrap();
    assert_eq!((calls, next.compiles()), (1, 0));

    // A driver that rejects every PTX: one retry, then an error with both attempts.
    let cache = PtxCache::at(&dir);
    let mut calls = 0;
    let err = cache
        .load(&BASIC, arch, |_| -> warpdrive::Result<()> {
            calls += 1;
            Err(invalid_ptx())
        })
        .unwrap_err();
    assert_eq!((calls, cache.compiles()), (2, 1));
    assert!(matches!(err, Error::ModuleLoad { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("from the PTX cache") && text.contains("compiled anew"),
        "{text}"
    );
    assert_eq!(text.matches("CUDA_ERROR_INVALID_PTX").count(), 2, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn freshly_compiled_ptx_and_a_lost_device_are_not_retried() {
    let dir = temp_dir("noretry");
    let arch = Arch::SM_90A;
    // Compiled just now: a rejection is the driver's own error, with no second compile.
    let cache = PtxCache::at(&dir);
    let mut calls = 0;
    let err = cache
        .load(&BASIC, arch, |_| -> warpdrive::Result<()> {
            calls += 1;
            Err(invalid_ptx())
        })
        .unwrap_err();
    assert_eq!((calls, cache.compiles()), (1, 1));
    assert!(matches!(err, Error::Driver { .. }), "{err}");

    // From disk, on a lost device: no retry, and the loss stays visible.
    let cache = PtxCache::at(&dir);
    let mut calls = 0;
    let err = cache
        .load(&BASIC, arch, |_| -> warpdrive::Result<()> {
            calls += 1;
            Err(Error::DeviceLost {
                call: "cuModuleLoadData",
                message: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            })
        })
        .unwrap_err();
    assert_eq!((calls, cache.compiles()), (1, 0));
    assert!(err.is_device_lost(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn an_unwritable_cache_folder_is_reported_once_and_compiled_around() {
    // A file where the folder should be.
    let dir = temp_dir("file");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ptx");
    std::fs::write(&file, "not a folder").unwrap();
    // A folder in which nobody, root included, may create files (sysfs's root): what a
    // read-only folder is for a user (permission bits do not stop root, who runs CI).
    for folder in [file.as_path(), Path::new("/sys")] {
        let cache = PtxCache::at(folder);
        let arch = Arch::SM_90A;
        let log = warnings_during(|| {
            for source in [&BASIC, &EXEC] {
                let ptx = cache.ptx(source, arch).unwrap();
                assert!(ptx.contains(".entry"), "{}", source.name);
            }
            cache.ptx(&BASIC, arch).unwrap();
        });
        assert_eq!(cache.compiles(), 2, "{}", folder.display());
        assert_eq!(
            log.matches("cannot be written").count(),
            1,
            "{}: {log}",
            folder.display()
        );
        assert!(!cache.path_for(&BASIC, arch).unwrap().unwrap().exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
