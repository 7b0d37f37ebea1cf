//! Every kernel source compiles through the real NVRTC for each architecture it declares,
//! and the disk cache serves a second start. Needs NVRTC (no GPU): ignored without it, run by
//! `.ci/run` with `--include-ignored` after `scripts/setup-nvrtc`.

mod common;

use warpdrive::kernels::{KernelSource, PtxCache, SOURCES};

fn temp_cache(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("wd-ptx-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn every_kernel_compiles_for_every_declared_arch() {
    let cache = PtxCache::at(temp_cache("all"));
    let mut failures = Vec::new();
    for source in SOURCES {
        for arch in source.archs().expect("archs line") {
            match cache.compile(source, arch) {
                Ok(ptx) => assert!(ptx.contains(".entry"), "{} {arch}: no entry", source.name),
                Err(e) => failures.push(format!("{} for {arch}: {e}", source.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn a_broken_kernel_returns_the_nvrtc_log() {
    static BROKEN: KernelSource = KernelSource {
        name: "broken",
        code:
            "// archs: sm_90\nextern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n",
        shared: None,
    };
    let cache = PtxCache::at(temp_cache("broken"));
    let arch = BROKEN.archs().unwrap()[0];
    let err = cache.compile(&BROKEN, arch).unwrap_err().to_string();
    assert!(
        err.contains("undefined_name"),
        "log missing from error: {err}"
    );
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn the_disk_cache_serves_a_second_start_and_repairs_corruption() {
    let dir = temp_cache("disk");
    let source = SOURCES[0];
    let arch = *source.archs().unwrap().last().unwrap();

    let first = PtxCache::at(&dir);
    let ptx = first.ptx(source, arch).unwrap();
    assert_eq!(first.compiles(), 1);
    first.ptx(source, arch).unwrap();
    assert_eq!(first.compiles(), 1, "the in-memory cache should answer");

    // A new cache on the same folder is a new process: it must read the file, not compile.
    let second = PtxCache::at(&dir);
    assert_eq!(*second.ptx(source, arch).unwrap(), *ptx);
    assert_eq!(second.compiles(), 0, "second start compiled again");

    // Corrupt the file: the next start detects it and recompiles, then rewrites it.
    let file = second.path_for(source, arch).unwrap().unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&file, &bytes).unwrap();
    let third = PtxCache::at(&dir);
    assert_eq!(*third.ptx(source, arch).unwrap(), *ptx);
    assert_eq!(third.compiles(), 1, "corrupt file was not recompiled");
    let fourth = PtxCache::at(&dir);
    fourth.ptx(source, arch).unwrap();
    assert_eq!(fourth.compiles(), 0, "repaired file was not rewritten");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn cubins_are_cached_on_disk_beside_the_ptx() {
    let dir = temp_cache("cubin");
    let source = SOURCES[0];
    let arch = *source.archs().unwrap().last().unwrap();

    let first = PtxCache::at(&dir);
    let cubin = first.cubin(source, arch).unwrap();
    assert_eq!(&cubin[..4], b"\x7fELF", "not machine code");
    assert_eq!(first.compiles(), 1);
    // The same compile gave the PTX.
    first.ptx(source, arch).unwrap();
    assert_eq!(first.compiles(), 1, "the PTX was compiled again");

    // A new cache on the folder (a new process) reads the cubin, not NVRTC.
    let second = PtxCache::at(&dir);
    assert_eq!(*second.cubin(source, arch).unwrap(), *cubin);
    assert_eq!(second.compiles(), 0, "second start compiled again");

    // A corrupt file is detected and compiled anew.
    let ptx_file = second.path_for(source, arch).unwrap().unwrap();
    let file = ptx_file.with_extension("cubin");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&file, &bytes).unwrap();
    let third = PtxCache::at(&dir);
    assert_eq!(*third.cubin(source, arch).unwrap(), *cubin);
    assert_eq!(third.compiles(), 1, "corrupt cubin was not recompiled");
    let _ = std::fs::remove_dir_all(&dir);
}
