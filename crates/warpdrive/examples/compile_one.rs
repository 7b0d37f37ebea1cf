// Temporary: compile kernel sources for sm_90a and write PTX to /tmp/ptx/<name>.ptx.
use warpdrive::kernels::{Arch, PtxCache, SOURCES};
fn main() {
    let only = std::env::args().nth(1);
    let cache = PtxCache::at("/tmp/ptxcache");
    std::fs::create_dir_all("/tmp/ptx").unwrap();
    for s in SOURCES {
        if only.as_deref().is_some_and(|o| o != s.name) {
            continue;
        }
        let arch = Arch::parse("sm_90a").unwrap();
        match cache.compile(s, arch) {
            Ok(ptx) => {
                std::fs::write(format!("/tmp/ptx/{}.ptx", s.name), ptx).unwrap();
                println!("{} ok", s.name)
            }
            Err(e) => println!("{} FAILED: {e}", s.name),
        }
    }
}
