//! Evaluating an expression: the program on the CPU backend, or its generated kernel,
//! compiled once per structure and launched on the lean path, on a GPU.
//!
//! Generated sources are interned for the life of the process, one per signature (a
//! `KernelSource` must be `'static` to live in the device's kernel table and the occupancy
//! cache like the embedded sources; its module stays loaded on the device anyway). The PTX
//! goes through the kernel floor's cache, on disk too, so a later process skips NVRTC.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::kernels::{self, Arch, KernelSource, PtxCache, FUSE_OPS};
use crate::memory::{check_len, Buffer};
use crate::ops::{fill_grid, float_index, launch, Args};

use super::codegen::{self, BLOCK, KERNEL};
use super::expr::Expr;
use super::program::{Class, Program};

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

/// The interned source of `prog`'s kernel with output `O`.
pub(crate) fn kernel_source<O: Float>(prog: &Program<'_>) -> &'static KernelSource {
    let sig = prog.signature(O::KIND);
    let mut reg = registry().lock();
    if let Some(s) = reg.by_signature.get(&sig) {
        return s;
    }
    let hash = xxh3_64(sig.as_bytes());
    let mut name = format!("fuse-{hash:016x}");
    let mut n = 1;
    while reg.by_name.contains_key(name.as_str()) {
        n += 1;
        name = format!("fuse-{hash:016x}-{n}");
    }
    let code = codegen::source(prog, O::KIND, &sig);
    // Interned for the process's life (see the module docs): one per distinct structure.
    let name: &'static str = Box::leak(name.into_boxed_str());
    let src: &'static KernelSource = Box::leak(Box::new(KernelSource {
        name,
        code: Box::leak(code.into_boxed_str()),
        shared: Some(&FUSE_OPS),
    }));
    reg.by_name.insert(name, sig.clone());
    reg.by_signature.insert(sig, src);
    src
}

impl<'a> Expr<'a> {
    /// Evaluates into a new buffer of `O` (f32, f16 or bf16) with the expression's shape
    /// (row-major), on `stream`.
    pub fn eval<O: Float>(&self, stream: &Stream) -> Result<Buffer<O>> {
        let prog = Program::new(self)?;
        let mut out = Buffer::uninit(stream, prog.len())?;
        run(&prog, stream, &mut out)?;
        Ok(out)
    }

    /// Evaluates into `out`, which holds the expression's elements (row-major).
    pub fn eval_into<O: Float>(&self, stream: &Stream, out: &mut Buffer<O>) -> Result<()> {
        let prog = Program::new(self)?;
        run(&prog, stream, out)
    }

    /// The PTX of this expression's kernel with output type `O`, compiled by NVRTC for `arch`
    /// through the kernel cache (memory, then disk, then NVRTC). Needs NVRTC, not a GPU.
    pub fn ptx<O: Float>(&self, arch: Arch) -> Result<Arc<str>> {
        self.ptx_with::<O>(PtxCache::global(), arch)
    }

    /// [`ptx`](Self::ptx) through `cache` (a fresh [`PtxCache::at`] a folder behaves like a
    /// new process: the benchmarks time a first compile and a start from disk with it).
    pub fn ptx_with<O: Float>(&self, cache: &PtxCache, arch: Arch) -> Result<Arc<str>> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        cache.ptx(kernel_source::<O>(&prog), arch)
    }

    /// Compiles and loads this expression's kernel with output type `O` on the stream's
    /// device now, so the first `eval` does not (a no-op on the CPU backend).
    pub fn prepare<O: Float>(&self, stream: &Stream) -> Result<()> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        stream.run(
            (),
            |()| Ok(()),
            |(), q| kernels::function(q.gpu, kernel_source::<O>(&prog), KERNEL).map(|_| ()),
        )
    }

    /// The CUDA C of this expression's kernel with output type `O` (without the prelude and
    /// `kernels/fuse.cu`, which are prepended when it is compiled).
    pub fn source<O: Float>(&self) -> Result<String> {
        let prog = Program::new(self)?;
        float_index::<O>("fuse output")?;
        Ok(kernel_source::<O>(&prog).code.to_string())
    }
}

fn run<O: Float>(prog: &Program<'_>, stream: &Stream, out: &mut Buffer<O>) -> Result<()> {
    float_index::<O>("fuse output")?;
    for input in &prog.inputs {
        input.buf.check_stream(stream)?;
    }
    out.check_stream(stream, "fuse")?;
    let (n, cols) = (prog.len(), prog.shape.cols);
    check_len("fuse (output)", out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    for input in &prog.inputs {
        // What the kernel reads of it (the shapes were checked as the graph was built; this
        // keeps the launch's bounds a fact checked here).
        let reads = match input.class {
            Class::Full => n,
            Class::Row => cols,
            Class::Col => n / cols.max(1),
            Class::Scalar => 1,
        };
        if input.buf.elements() != reads {
            return Err(Error::InvalidArgument(format!(
                "fuse: an input of {} elements where the graph reads {reads}",
                input.buf.elements()
            )));
        }
    }
    stream.run(
        out,
        |out| super::cpu::eval(prog, out.host_view_mut()?),
        |out, q| {
            let src = kernel_source::<O>(prog);
            let n = prog.len() as u64;
            let per_block = BLOCK as u64 * codegen::width(prog, O::KIND) * codegen::unroll(prog);
            let grid = fill_grid(q.gpu, (src, KERNEL), n, per_block)?;
            let mut args = Args::new();
            for input in &prog.inputs {
                args = args.ptr(input.buf.device_ptr());
            }
            args = args.buf(out).u64(n).u64(prog.shape.cols as u64);
            for &c in &prog.consts {
                args = args.f32(c);
            }
            // SAFETY: fuse_map(const I_k* in_k..., O* out, u64 n, u64 cols, float c_j...) as
            // generated from this program: one pointer per input of its element type, each
            // holding the elements its class reads for a [n / cols, cols] result (checked when
            // the expression was built: full inputs n, rows cols, columns n / cols, scalars 1),
            // `out` of type O holding n elements, then one float per constant.
            unsafe { launch(q, (src, KERNEL), grid, BLOCK, 0, args) }
        },
    )
}
