//! The block size of map kernels: 256 threads unless tuned. [`Expr::tune`] times each
//! candidate through the exec floor's autotuner, which keeps the winner on disk per kernel
//! structure, output type, size bucket, device and host; every later `eval` of that structure
//! and size bucket (in this process or a later one) launches with the winner. Each candidate
//! is its own generated kernel (its `__launch_bounds__` set to its block), compiled only
//! when a tuning or a tuned winner asks for it.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::Result;
use crate::exec::{autotune, Autotuner, TuneKey};
use crate::memory::Buffer;
use crate::ops::float_index;

use super::codegen::BLOCK;
use super::expr::Expr;
use super::program::{Mode, Program};

/// The block sizes a tuning tries.
pub const BLOCK_CANDIDATES: [u32; 3] = [128, 256, 512];

/// Chosen blocks by (signature, size bucket, device ordinal), so an eval looks the autotune
/// cache up once per process.
fn chosen() -> &'static Mutex<HashMap<String, u32>> {
    static C: OnceLock<Mutex<HashMap<String, u32>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// The autotune cache's kernel name of a structure.
fn kernel_name(signature: &str) -> String {
    format!("fuse-map-{:016x}", xxh3_64(signature.as_bytes()))
}

fn slot(signature: &str, n: usize, stream: &Stream) -> String {
    let ordinal = stream.device().ordinal().map_or(-1, |o| o as i64);
    format!(
        "{signature}|{}|{ordinal}",
        crate::exec::tune::size_bucket(n)
    )
}

/// The block to launch a map kernel of `signature` over `n` elements with: a tuned winner
/// (this process's, else the autotune cache's) or [`BLOCK`].
pub(crate) fn block_for(stream: &Stream, signature: &str, out: DTypeKind, n: usize) -> u32 {
    let key = slot(signature, n, stream);
    if let Some(&b) = chosen().lock().get(&key) {
        return b;
    }
    let tuned = TuneKey::new(stream.device(), &kernel_name(signature), out, n)
        .ok()
        .and_then(|k| Autotuner::global().get(&k))
        .and_then(|r| r.winner.parse::<u32>().ok())
        .filter(|b| BLOCK_CANDIDATES.contains(b))
        .unwrap_or(BLOCK);
    chosen().lock().insert(key, tuned);
    tuned
}

impl<'a> Expr<'a> {
    /// Tunes the block size of this expression's kernel (output type `O`) at its size on the
    /// stream's device: each of [`BLOCK_CANDIDATES`] is timed (into a scratch output) and the
    /// fastest is kept, here and in the autotune cache on disk, for every later `eval` of the
    /// same structure and size bucket. Returns the winner. Elementwise expressions only (the
    /// reduction and filter kernels keep 256 threads); on the CPU backend, 256 at once.
    pub fn tune<O: Float>(&self, stream: &Stream) -> Result<u32> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        if prog.mode != Mode::Map || prog.len() == 0 {
            return Ok(BLOCK);
        }
        let n = prog.len();
        let sig = prog.signature(O::KIND);
        stream.run(
            (),
            // The CPU backend has no block size.
            |()| Ok(BLOCK),
            |(), _| {
                let mut out = Buffer::<O>::uninit(stream, n)?;
                let best = autotune(
                    stream,
                    &kernel_name(&sig),
                    O::KIND,
                    n,
                    &BLOCK_CANDIDATES,
                    |s, &block| super::eval::run_with_block(&prog, s, &mut out, block),
                )?;
                chosen().lock().insert(slot(&sig, n, stream), best);
                Ok(best)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::kernels::{Arch, PtxCache};

    #[test]
    fn the_cpu_backend_does_not_tune() {
        let s = Device::cpu().new_stream().unwrap();
        let x = Buffer::from_host(&s, &[1.0f32; 100]).unwrap();
        assert_eq!((Expr::input(&x) * 2.0).tune::<f32>(&s).unwrap(), BLOCK);
    }

    #[test]
    #[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
    fn every_candidate_block_compiles() {
        let s = Device::cpu().new_stream().unwrap();
        let x = Buffer::from_host(&s, &[half::bf16::ONE; 100]).unwrap();
        let e = (Expr::input(&x) * 2.0).silu() + 1.0;
        let prog = Program::new(&e).unwrap();
        let sig = prog.signature(DTypeKind::BF16);
        let dir = std::env::temp_dir().join(format!("wd-fuse-tune-{}", std::process::id()));
        let cache = PtxCache::at(&dir);
        for block in BLOCK_CANDIDATES {
            let src = super::super::registry::kernel_source_for(
                &prog,
                DTypeKind::BF16,
                &sig,
                super::super::codegen::Flavor::MapBlock(block),
            );
            assert!(src.code.contains(&format!("__launch_bounds__({block})")));
            let ptx = cache.ptx(src, Arch::SM_90A).unwrap();
            assert!(ptx.contains(&format!(".maxntid {block}")), "{block}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
