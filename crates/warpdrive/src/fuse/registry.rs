//! Generated kernel sources, interned for the life of the process, one per signature (and
//! map block size): a `KernelSource` must be `'static` to live in the device's kernel table
//! and the occupancy cache like the embedded sources, and its module stays loaded on the
//! device anyway. Module names are `fuse-<hash of the signature>`, made unique when two
//! signatures' hashes collide.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use twox_hash::XxHash3_64;

use crate::dtype::{DTypeKind, Float};
use crate::kernels::{KernelSource, FUSE_OPS};

use super::codegen::{self, Flavor};
use super::program::Program;

/// Interned sources by signature, and the signature behind each module name (so two
/// signatures whose hashes collide get different names).
#[derive(Default)]
struct Registry {
    by_signature: HashMap<String, &'static KernelSource>,
    by_name: HashMap<&'static str, String>,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The interned source of every kernel of `prog` with output `O` (the map kernel for blocks
/// of 256).
pub(crate) fn kernel_source<O: Float>(prog: &Program<'_>) -> &'static KernelSource {
    kernel_source_for(prog, O::KIND, &prog.signature(O::KIND), Flavor::Both)
}

/// The interned source of the kernels `flavor` names of `prog` with output `out`, whose
/// signature is `sig`.
pub(crate) fn kernel_source_for(
    prog: &Program<'_>,
    out: DTypeKind,
    sig: &str,
    flavor: Flavor,
) -> &'static KernelSource {
    let key = format!("{sig}{}", flavor.key());
    let mut reg = registry().lock();
    if let Some(s) = reg.by_signature.get(&key) {
        return s;
    }
    let hash = XxHash3_64::oneshot(key.as_bytes());
    let mut name = format!("fuse-{hash:016x}");
    let mut n = 1;
    while reg.by_name.contains_key(name.as_str()) {
        n += 1;
        name = format!("fuse-{hash:016x}-{n}");
    }
    let code = codegen::source(prog, out, &key, flavor);
    // Interned for the process's life (see the module docs): one per distinct structure.
    let name: &'static str = Box::leak(name.into_boxed_str());
    let src: &'static KernelSource = Box::leak(Box::new(KernelSource {
        name,
        code: Box::leak(code.into_boxed_str()),
        shared: Some(&FUSE_OPS),
    }));
    reg.by_name.insert(name, key.clone());
    reg.by_signature.insert(key, src);
    src
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::fuse::Expr;
    use crate::kernels::{Arch, PtxCache};
    use crate::memory::Buffer;

    #[test]
    #[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
    fn each_row_kernel_compiles_alone() {
        let s = Device::cpu().new_stream().unwrap();
        let x = Buffer::from_host(&s, &[half::bf16::ONE; 64]).unwrap();
        let m = Expr::matrix(&x, 8, 8);
        let z = (&m - m.max_rows()).exp();
        let prog = Program::new(&(&z / z.sum_rows())).unwrap();
        let sig = prog.signature(DTypeKind::F32);
        let dir = std::env::temp_dir().join(format!("wd-fuse-rows-{}", std::process::id()));
        let cache = PtxCache::at(&dir);
        for (flavor, mine, other) in [
            (Flavor::RowsWarp, "fuse_rows_warp", "fuse_rows_block"),
            (Flavor::RowsBlock, "fuse_rows_block", "fuse_rows_warp"),
        ] {
            let src = kernel_source_for(&prog, DTypeKind::F32, &sig, flavor);
            let ptx = cache.ptx(src, Arch::SM_90A).unwrap();
            assert!(ptx.contains(&format!(".entry {mine}")), "{flavor:?}");
            assert!(!ptx.contains(&format!(".entry {other}")), "{flavor:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    // The map kernel in every schedule (matmul_epilogue's GELU + residual over a bias GEMM's
    // product) compiles for sm_90a, where the wait and the prefetches are in the PTX, and for
    // sm_80, where the wait compiles away; the default schedule's source is the plain one.
    #[test]
    #[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
    fn scheduled_map_kernels_compile() {
        use super::super::codegen::{MapShape, Schedule};
        let s = Device::cpu().new_stream().unwrap();
        let h = Buffer::from_host(&s, &[half::bf16::ONE; 64]).unwrap();
        let r = Buffer::from_host(&s, &[half::bf16::ONE; 64]).unwrap();
        let e = Expr::matrix(&h, 8, 8).gelu_tanh() + Expr::matrix(&r, 8, 8);
        let prog = Program::new(&e).unwrap();
        let sig = prog.signature(DTypeKind::BF16);
        let dir = std::env::temp_dir().join(format!("wd-fuse-sched-{}", std::process::id()));
        let cache = PtxCache::at(&dir);
        let plain = kernel_source_for(&prog, DTypeKind::BF16, &sig, Flavor::Both);
        let default = Flavor::Map(MapShape::DEFAULT, Schedule::default());
        let same = kernel_source_for(&prog, DTypeKind::BF16, &sig, default);
        assert_eq!(plain.name, same.name);
        let narrow = MapShape {
            block: 512,
            vector_bytes: 8,
            plain: false,
        };
        for shape in [MapShape::DEFAULT, narrow] {
            for (reverse, programmatic, prefetch) in [
                (true, false, false),
                (false, true, false),
                (true, true, true),
            ] {
                let sched = Schedule {
                    reverse,
                    programmatic,
                    prefetch,
                };
                let src =
                    kernel_source_for(&prog, DTypeKind::BF16, &sig, Flavor::Map(shape, sched));
                assert_ne!(src.name, plain.name, "{sched:?}");
                assert_eq!(src.code.contains("gridDim.x - 1 - blockIdx.x"), reverse);
                let ptx = cache.ptx(src, Arch::SM_90A).unwrap();
                assert_eq!(
                    ptx.contains("griddepcontrol.wait"),
                    programmatic,
                    "{sched:?}"
                );
                assert_eq!(ptx.contains("prefetch.global.L2"), prefetch, "{sched:?}");
                let old = Arch::parse("sm_80").unwrap();
                let ptx = cache.ptx(src, old).unwrap();
                assert!(!ptx.contains("griddepcontrol"), "{sched:?}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
