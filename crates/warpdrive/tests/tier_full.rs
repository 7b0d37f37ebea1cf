//! A real full disk: a store in a size-capped folder (a 16 MiB tmpfs this test mounts, so it
//! needs root and is ignored by default: `cargo test --test tier_full -- --ignored`) fails a put that does not
//! fit with `ENOSPC`, through the split, framed write of large blocks; it keeps every block it
//! had, gives the failed write's space back, takes the put once space is freed, and reopens
//! whole. The simulated disk's capacity test (tests/tier.rs) covers the same on every host.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use warpdrive::error::Error;
use warpdrive::tier::codec::Compression;
use warpdrive::tier::{Durability, TierConfig, TierStore};
use warpdrive::Device;

const MIB: usize = 1 << 20;

/// Runs `program` with `args`; whether it exited 0 within 30 s (killed after that).
fn run(program: &str, args: &[&str]) -> bool {
    let Ok(mut child) = Command::new(program).args(args).spawn() else {
        return false;
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

/// A tmpfs of `size` mounted at a fresh folder, unmounted and removed on drop.
struct Capped(PathBuf);

impl Capped {
    fn mount(size: &str) -> Option<Capped> {
        let dir = std::env::temp_dir().join(format!("warpdrive-tier-full-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let path = dir.to_str()?.to_string();
        if run(
            "mount",
            &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", &path],
        ) {
            Some(Capped(dir))
        } else {
            let _ = std::fs::remove_dir(&dir);
            None
        }
    }
}

impl Drop for Capped {
    fn drop(&mut self) {
        if let Some(path) = self.0.to_str() {
            run("umount", &[path]);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn no_space(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
}

fn filler(path: &Path, bytes: usize) {
    std::fs::write(path, vec![0x5a; bytes]).unwrap();
}

#[test]
#[ignore = "mounts a 16 MiB tmpfs: needs root (CAP_SYS_ADMIN); run with --ignored"]
fn a_full_size_capped_folder_is_enospc_and_the_store_stays_whole() {
    let Some(capped) = Capped::mount("16m") else {
        panic!("mounting a 16 MiB tmpfs failed: this test needs root (CAP_SYS_ADMIN)");
    };
    let s = Device::cpu().new_stream().unwrap();
    let mut r = rand::rngs::SmallRng::seed_from_u64(0xf011);
    let mut block = |len: usize| {
        let mut v = vec![0u8; len];
        r.fill_bytes(&mut v);
        v
    };
    let mut config = TierConfig::new(0, 0);
    config.disk_compression = Compression::None;
    let dir = capped.0.join("store");
    let taken = capped.0.join("taken");
    filler(&taken, 5 * MIB);
    let (a, b) = (block(4 * MIB + 123), block(8 * MIB));
    {
        let store = TierStore::open(&dir, config.clone(), &s).unwrap();
        store.put("a", &a, Durability::Sync).unwrap();
        // ~6 MiB left: the 8 MiB block's pieces run out of space part way.
        let e = store.put("b", &b, Durability::Sync).unwrap_err();
        assert!(no_space(&e), "{e}");
        assert_eq!(store.get_host("a").unwrap(), a);
        assert!(matches!(store.get_host("b"), Err(Error::NotFound { .. })));
        // The failed write's pieces were cut off: freeing the filler makes room for it.
        std::fs::remove_file(&taken).unwrap();
        store.put("b", &b, Durability::Sync).unwrap();
        assert_eq!(store.get_host("b").unwrap(), b);
        // Full again: a small block fails the same way and the store goes on.
        filler(&taken, 3 * MIB);
        let c = block(4 * MIB);
        let e = store.put("c", &c, Durability::Disk).unwrap_err();
        assert!(no_space(&e), "{e}");
        store.remove("a").unwrap();
    }
    let store = TierStore::open(&dir, config, &s).unwrap();
    assert!(matches!(store.get_host("a"), Err(Error::NotFound { .. })));
    assert!(matches!(store.get_host("c"), Err(Error::NotFound { .. })));
    assert_eq!(store.get_host("b").unwrap(), b);
}
