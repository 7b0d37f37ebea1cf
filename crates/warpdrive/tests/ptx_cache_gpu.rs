//! A cached module the driver rejects is discarded and compiled anew, on a real device (its
//! own test binary: the process-wide PTX cache in its private `XDG_CACHE_HOME` holds only
//! what this test puts there). The decision logic, with a stand-in driver, is tested in
//! `ptx_cache.rs`.

mod common;

use common::{cuda, random_f32, rng, seed};
use warpdrive::kernels::{Arch, PtxCache, BASIC};
use warpdrive::{ops, Buffer, Device};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_a_cached_module_the_driver_rejects_is_compiled_anew() {
    let home = common::cache_home::private_cache_home();
    let dev = cuda();
    let Device::Cuda(d) = &dev else {
        unreachable!("cuda() returns a CUDA device")
    };
    let (major, minor) = d.compute_capability();
    let arch = BASIC
        .arch_for(Arch::from_compute_capability(major as u32, minor as u32))
        .unwrap();
    let slot = PtxCache::global().path_for(&BASIC, arch).unwrap().unwrap();
    assert!(slot.starts_with(&home), "{}", slot.display());

    // BASIC's PTX for a newer architecture than the device's, in the file this device reads
    // (its checksum is right): the driver refuses to load it.
    let newer = Arch::parse("sm_100").unwrap();
    assert!(newer > arch, "the device is {arch}");
    let other = PtxCache::at(slot.parent().unwrap());
    other.ptx(&BASIC, newer).unwrap();
    std::fs::copy(other.path_for(&BASIC, newer).unwrap().unwrap(), &slot).unwrap();

    // `fill` runs BASIC's kernel: it loads after one recompile and writes every element.
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed(
        "gpu_a_cached_module_the_driver_rejects_is_compiled_anew",
    ));
    let mut buf = Buffer::from_host(&s, &random_f32(&mut r, 4099)).unwrap();
    ops::fill(&s, &mut buf, 2.5f32).unwrap();
    assert!(buf.to_host(&s).unwrap().iter().all(|&v| v == 2.5));

    // The file now holds PTX for the device: the next process reads it, compiling nothing.
    let next = PtxCache::at(slot.parent().unwrap());
    let ptx = next.ptx(&BASIC, arch).unwrap();
    assert_eq!(next.compiles(), 0);
    assert!(ptx.contains(&format!(".target {arch}")), "{ptx:.400}");
    let _ = std::fs::remove_dir_all(&home);
}
