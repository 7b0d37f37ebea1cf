//! The map kernel's shape (threads a block, bytes a vector access): 256 threads on 16-byte
//! vectors unless tuned. [`Expr::tune`] times each candidate through the exec floor's
//! autotuner, which keeps the winner on disk per kernel structure, output type, size bucket,
//! device and host; every later `eval` of that structure and size bucket (in this process or
//! a later one) launches with the winner. Each candidate is its own generated kernel (its
//! `__launch_bounds__` set to its block), compiled only when a tuning or a tuned winner asks
//! for it.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use twox_hash::XxHash3_64;

use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::Result;
use crate::exec::{autotune, Autotuner, TuneKey};
use crate::memory::Buffer;
use crate::ops::float_index;

use super::codegen::{one_element_size, MapShape};
use super::expr::Expr;
use super::program::{Mode, Program};

/// The block sizes a tuning tries (on 16-byte vectors; 256 and 512 also on 8-byte ones where
/// every streamed array has one element size, with and without the streaming cache hints).
pub const BLOCK_CANDIDATES: [u32; 3] = [128, 256, 512];

/// The shapes a tuning of `prog` with output `out` tries.
fn candidates(prog: &Program<'_>, out: DTypeKind) -> Vec<MapShape> {
    let wide = BLOCK_CANDIDATES.iter().map(|&block| MapShape {
        block,
        vector_bytes: 16,
        plain: false,
    });
    // torch.compile's f32 map is 256 threads on 8-byte vectors, plain loads and stores, one
    // block per 512 elements (as ours): the plain ones are its shape.
    let narrow = [(256, false), (512, false), (256, true), (512, true)]
        .into_iter()
        .map(|(block, plain)| MapShape {
            block,
            vector_bytes: 8,
            plain,
        });
    if one_element_size(prog, out) {
        wide.chain(narrow).collect()
    } else {
        wide.collect()
    }
}

/// Chosen shapes by (signature, size bucket, device ordinal), so an eval looks the autotune
/// cache up once per process.
fn chosen() -> &'static Mutex<HashMap<String, MapShape>> {
    static C: OnceLock<Mutex<HashMap<String, MapShape>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// The autotune cache's kernel name of a structure.
fn kernel_name(signature: &str) -> String {
    format!(
        "fuse-map-{:016x}",
        XxHash3_64::oneshot(signature.as_bytes())
    )
}

fn slot(signature: &str, n: usize, stream: &Stream) -> String {
    let ordinal = stream.device().ordinal().map_or(-1, |o| o as i64);
    format!(
        "{signature}|{}|{ordinal}",
        crate::exec::tune::size_bucket(n)
    )
}

/// The shape to launch a map kernel of `signature` over `n` elements in: a tuned winner (this
/// process's, else the autotune cache's, if it is still a candidate) or
/// [`MapShape::DEFAULT`].
pub(crate) fn shape_for(
    stream: &Stream,
    prog: &Program<'_>,
    signature: &str,
    out: DTypeKind,
    n: usize,
) -> MapShape {
    let key = slot(signature, n, stream);
    if let Some(&b) = chosen().lock().get(&key) {
        return b;
    }
    let tuned = TuneKey::new(stream.device(), &kernel_name(signature), out, n)
        .ok()
        .and_then(|k| Autotuner::global().get(&k))
        .and_then(|r| r.winner.parse::<MapShape>().ok())
        .filter(|m| candidates(prog, out).contains(m))
        .unwrap_or(MapShape::DEFAULT);
    chosen().lock().insert(key, tuned);
    tuned
}

impl<'a> Expr<'a> {
    /// Tunes the shape of this expression's kernel (output type `O`) at its size on the
    /// stream's device: each candidate (the blocks of [`BLOCK_CANDIDATES`] on 16-byte
    /// vectors, and 256 and 512 threads on 8-byte ones where every streamed array has one
    /// element size) is timed (into a scratch output) and the fastest is kept, here and in the
    /// autotune cache on disk, for every later `eval` of the same structure and size bucket.
    /// Returns the winner's block. Elementwise expressions only (the reduction and filter
    /// kernels keep 256 threads); on the CPU backend, 256 at once.
    pub fn tune<O: Float>(&self, stream: &Stream) -> Result<u32> {
        Ok(self.tune_shape::<O>(stream)?.block)
    }

    /// [`Expr::tune`], returning the whole winning shape.
    pub fn tune_shape<O: Float>(&self, stream: &Stream) -> Result<MapShape> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        if prog.mode != Mode::Map || prog.len() == 0 {
            return Ok(MapShape::DEFAULT);
        }
        let n = prog.len();
        let sig = prog.signature(O::KIND);
        stream.run(
            (),
            // The CPU backend has no block size.
            |()| Ok(MapShape::DEFAULT),
            |(), _| {
                let mut out = Buffer::<O>::uninit(stream, n)?;
                let best = autotune(
                    stream,
                    &kernel_name(&sig),
                    O::KIND,
                    n,
                    &candidates(&prog, O::KIND),
                    |s, &shape| super::eval::run_with_shape(&prog, s, &mut out, shape),
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
        assert_eq!(
            (Expr::input(&x) * 2.0).tune::<f32>(&s).unwrap(),
            MapShape::DEFAULT.block
        );
    }

    #[test]
    fn shapes_print_and_parse_back_and_old_winners_still_parse() {
        for m in [
            MapShape::DEFAULT,
            MapShape {
                block: 512,
                vector_bytes: 8,
                plain: false,
            },
            MapShape {
                block: 256,
                vector_bytes: 8,
                plain: true,
            },
        ] {
            assert_eq!(m.to_string().parse::<MapShape>(), Ok(m));
        }
        assert_eq!("256".parse::<MapShape>(), Ok(MapShape::DEFAULT));
        assert!("x8".parse::<MapShape>().is_err());
        assert!("256x".parse::<MapShape>().is_err());
        assert!("256x8q".parse::<MapShape>().is_err());
        assert_eq!(
            "256x16p"
                .parse::<MapShape>()
                .map(|m| m.plain && m.vector_bytes == 16),
            Ok(true)
        );
    }

    #[test]
    fn narrow_vectors_only_where_every_array_has_one_element_size() {
        let s = Device::cpu().new_stream().unwrap();
        let x = Buffer::from_host(&s, &[1.0f32; 100]).unwrap();
        let h = Buffer::from_host(&s, &[half::bf16::ONE; 100]).unwrap();
        let same = Expr::input(&x) * 2.0;
        let mixed = Expr::input(&x) + Expr::input(&h);
        let narrow = |e: &Expr<'_>, out| {
            candidates(&Program::new(e).unwrap(), out)
                .iter()
                .any(|m| m.vector_bytes == 8)
        };
        assert!(narrow(&same, DTypeKind::F32));
        assert!(!narrow(&same, DTypeKind::BF16));
        assert!(!narrow(&mixed, DTypeKind::F32));
    }

    #[test]
    #[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
    fn every_candidate_shape_compiles() {
        let s = Device::cpu().new_stream().unwrap();
        let dir = std::env::temp_dir().join(format!("wd-fuse-tune-{}", std::process::id()));
        let cache = PtxCache::at(&dir);
        let h = Buffer::from_host(&s, &[half::bf16::ONE; 100]).unwrap();
        let x = Buffer::from_host(&s, &[1.0f32; 100]).unwrap();
        let y = Buffer::from_host(&s, &[2.0f32; 100]).unwrap();
        let bf = (Expr::input(&h) * 2.0).silu() + 1.0;
        let two = Expr::input(&x) * Expr::input(&y) * 1.5 + 0.25;
        for (e, out) in [(&bf, DTypeKind::BF16), (&two, DTypeKind::F32)] {
            let prog = Program::new(e).unwrap();
            let sig = prog.signature(out);
            for shape in candidates(&prog, out) {
                let src = super::super::registry::kernel_source_for(
                    &prog,
                    out,
                    &sig,
                    super::super::codegen::Flavor::Map(shape, Default::default()),
                );
                let block = shape.block;
                assert!(src.code.contains(&format!("__launch_bounds__({block})")));
                let ptx = cache.ptx(src, Arch::SM_90A).unwrap();
                assert!(ptx.contains(&format!(".maxntid {block}")), "{shape}");
                if shape.vector_bytes == 8 && !shape.plain {
                    assert!(ptx.contains("ld.global.cs.v2"), "{shape}: no 8-byte loads");
                }
                if shape.plain {
                    // No streaming hint on the vector path (the scalar tail has none anyway).
                    assert!(!ptx.contains(".cs."), "{shape}: a streaming hint");
                    assert!(ptx.contains("ld.global.nc.v2") || ptx.contains("ld.global.v2"));
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
