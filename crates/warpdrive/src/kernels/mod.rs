//! CUDA C kernel sources, compiled by NVRTC for the device's own architecture and cached on
//! disk as PTX.
//!
//! Sources are self-contained: they include no CUDA headers (a host with only the driver and
//! NVRTC has none). [`PRELUDE`] is prepended to every source, then the source's shared
//! fragment if it has one (the MoE sources share [`MOE_SHARED`]). Each source declares the
//! architectures it supports on a line `// archs: sm_80 sm_90 sm_90a`; it is compiled for the
//! device's own architecture when declared, else for the highest declared one the device can
//! run (PTX is forward compatible; `a` targets such as `sm_90a` are not).
//!
//! The cache lives under `$XDG_CACHE_HOME/warpdrive/ptx/` (fallback `~/.cache/warpdrive/ptx/`),
//! one file per source hash + arch + NVRTC version, written atomically (temp file + rename);
//! each file carries a checksum of its body, so a corrupt file is detected and recompiled.
//! PTX read from disk that the driver then rejects is discarded and compiled anew, once
//! ([`PtxCache::load`]). A folder that cannot be written is reported once (a warning) and the
//! cache keeps compiled PTX in memory only.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

pub use crate::device::Arch;
use crate::device::{Function, Gpu, Module};
use crate::error::{Error, Result};

/// Shared definitions prepended to every kernel source.
pub const PRELUDE: &str = include_str!("prelude.cu");

/// A kernel source file embedded in the library.
#[derive(Debug)]
pub struct KernelSource {
    /// File stem, unique among sources (`basic`).
    pub name: &'static str,
    /// The CUDA C text, without the prelude.
    pub code: &'static str,
    /// Definitions shared with sibling sources, prepended after the prelude: a fragment (no
    /// `// archs:` line, not in [`SOURCES`]) whose `name` labels its lines in compile logs.
    pub shared: Option<&'static KernelSource>,
}

/// `fill` and `axpy` behind the foundation ops, and the empty kernel the doctor times.
pub static BASIC: KernelSource = KernelSource {
    name: "basic",
    code: include_str!("basic.cu"),
    shared: None,
};

/// Test kernels of the exec floor (a trapping kernel for the device-loss test).
pub static EXEC: KernelSource = KernelSource {
    name: "exec",
    code: include_str!("exec.cu"),
    shared: None,
};

/// Fused maps (`act(a·x + b)` → cast), binary ops and SwiGLU.
pub static ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    code: include_str!("elementwise.cu"),
    shared: None,
};

/// Deterministic sum / max / mean, whole buffer (two passes) and per row.
pub static REDUCE: KernelSource = KernelSource {
    name: "reduce",
    code: include_str!("reduce.cu"),
    shared: None,
};

/// Row softmax.
pub static SOFTMAX: KernelSource = KernelSource {
    name: "softmax",
    code: include_str!("softmax.cu"),
    shared: None,
};

/// Many buffers packed into one and unpacked back, one launch each.
pub static SEGMENTS: KernelSource = KernelSource {
    name: "segments",
    code: include_str!("segments.cu"),
    shared: None,
};

/// Gradient compression: int8 block quantization with error feedback.
pub static QUANT: KernelSource = KernelSource {
    name: "quant",
    code: include_str!("quant.cu"),
    shared: None,
};

/// Gradient compression: top-k per block with error feedback and momentum (DGC).
pub static SPARSE: KernelSource = KernelSource {
    name: "sparse",
    code: include_str!("sparse.cu"),
    shared: None,
};

/// The resident actor loop: a fragment the actor floor completes with its handlers and
/// compiles at run time (not in [`SOURCES`]).
pub static ACTOR_LOOP: KernelSource = KernelSource {
    name: "actor_loop",
    code: include_str!("actor_loop.cu"),
    shared: None,
};

/// The actors suite's baselines: a doorbell kernel and a one-message kernel.
pub static ACTOR_PROBE: KernelSource = KernelSource {
    name: "actor_probe",
    code: include_str!("actor_probe.cu"),
    shared: None,
};

/// Row top-k and the fused MoE router.
pub static TOPK: KernelSource = KernelSource {
    name: "topk",
    code: include_str!("topk.cu"),
    shared: None,
};

/// Histogram, exclusive scan, stable sort by key, gather / scatter rows.
pub static PERMUTE: KernelSource = KernelSource {
    name: "permute",
    code: include_str!("permute.cu"),
    shared: None,
};

/// GPU agents: the uniform grid of spatial messages, the Circles move, the single vote.
pub static AGENTS: KernelSource = KernelSource {
    name: "agents",
    code: include_str!("agents.cu"),
    shared: None,
};

/// Graphs launched from the device: the latency probe and the dispatcher (`exec::Dispatcher`).
/// Relocatable code linked with the CUDA device runtime (`// links: cudadevrt`).
pub static DEVICE_LAUNCH: KernelSource = KernelSource {
    name: "device_launch",
    code: include_str!("device_launch.cu"),
    shared: None,
};

/// Device-initiated puts and signals through peer-mapped memory (`dist::PeerMapped`).
pub static PEER: KernelSource = KernelSource {
    name: "peer",
    code: include_str!("peer.cu"),
    shared: None,
};

/// What the MoE sources share (dispatch block, row top-k, the grouped GEMM's parameters,
/// tiles, MMA loop and stage loads, the routers' parameters): prepended to each of them.
pub static MOE_SHARED: KernelSource = KernelSource {
    name: "moe_shared",
    code: include_str!("moe_shared.cu"),
    shared: None,
};

/// The MoE layer's seeded weights, the SwiGLU of its cuBLAS path and its combine.
pub static MOE: KernelSource = KernelSource {
    name: "moe",
    code: include_str!("moe.cu"),
    shared: Some(&MOE_SHARED),
};

/// The MoE routing: grouped sigmoid router, dispatch, and the router (logits, softmax top-k
/// and dispatch in one kernel).
pub static MOE_ROUTER: KernelSource = KernelSource {
    name: "moe_router",
    code: include_str!("moe_router.cu"),
    shared: Some(&MOE_SHARED),
};

/// The MoE router on thread-block clusters (sm_90 and later only).
pub static MOE_ROUTER_CLUSTER: KernelSource = KernelSource {
    name: "moe_router_cluster",
    code: include_str!("moe_router_cluster.cu"),
    shared: Some(&MOE_SHARED),
};

/// The MoE device-driven grouped GEMM on tensor cores (mma.sync).
pub static MOE_GEMM: KernelSource = KernelSource {
    name: "moe_gemm",
    code: include_str!("moe_gemm.cu"),
    shared: Some(&MOE_SHARED),
};

/// The MoE prefill tiles on Hopper's warpgroup MMA (sm_90a only).
pub static MOE_WGMMA: KernelSource = KernelSource {
    name: "moe_wgmma",
    code: include_str!("moe_wgmma.cu"),
    shared: Some(&MOE_SHARED),
};

/// The one-token MoE decode kernel (the whole layer in one launch).
pub static MOE_DECODE: KernelSource = KernelSource {
    name: "moe_decode",
    code: include_str!("moe_decode.cu"),
    shared: Some(&MOE_SHARED),
};

/// The operations of the kernels the `fuse` module generates (max and min that keep NaN,
/// select, activations, rounding casts): a fragment prepended to each of them, not in
/// [`SOURCES`] (the fuse tests compile it with every generated kernel).
pub static FUSE_OPS: KernelSource = KernelSource {
    name: "fuse_ops",
    code: include_str!("fuse.cu"),
    shared: None,
};

/// Every embedded source (the compile test builds each for each declared architecture).
pub static SOURCES: &[&KernelSource] = &[
    &BASIC,
    &ELEMENTWISE,
    &REDUCE,
    &SOFTMAX,
    &TOPK,
    &QUANT,
    &SPARSE,
    &SEGMENTS,
    &PERMUTE,
    &MOE,
    &MOE_ROUTER,
    &MOE_ROUTER_CLUSTER,
    &MOE_GEMM,
    &MOE_WGMMA,
    &MOE_DECODE,
    &EXEC,
    &ACTOR_PROBE,
    &AGENTS,
    &PEER,
    &DEVICE_LAUNCH,
];

impl KernelSource {
    /// The architectures this source declares on its `// archs:` line.
    pub fn archs(&self) -> Result<Vec<Arch>> {
        let line = self
            .code
            .lines()
            .find_map(|l| l.trim().strip_prefix("// archs:"))
            .ok_or_else(|| Error::Compile {
                kernel: self.name.into(),
                arch: "-".into(),
                log: "source declares no `// archs:` line".into(),
            })?;
        line.split_whitespace()
            .map(|a| {
                Arch::parse(a).ok_or_else(|| Error::Compile {
                    kernel: self.name.into(),
                    arch: a.into(),
                    log: format!("`{a}` is not an architecture name"),
                })
            })
            .collect()
    }

    /// True when the source declares `// links: cudadevrt`: it is compiled relocatable and
    /// linked with the CUDA device runtime when loaded (it launches graphs from the device).
    pub fn links_device_runtime(&self) -> bool {
        self.code
            .lines()
            .any(|l| l.trim().strip_prefix("// links:").map(str::trim) == Some("cudadevrt"))
    }

    /// The declared architecture to build for a device of architecture `device`.
    pub fn arch_for(&self, device: Arch) -> Result<Arch> {
        let archs = self.archs()?;
        if archs.contains(&device) {
            return Ok(device);
        }
        let plain = |a: &Arch| (a.major, a.minor);
        archs
            .iter()
            .filter(|a| !a.specific && plain(a) <= plain(&device))
            .max()
            .copied()
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "kernel source `{}` supports {} but the device is {device}",
                    self.name,
                    archs.iter().map(Arch::name).collect::<Vec<_>>().join(" ")
                ))
            })
    }
}

/// Kernel `name` of `source` on `gpu`: compiled for its architecture through the PTX cache
/// and loaded on first use, then from the device's own table.
pub(crate) fn function(
    gpu: &Gpu,
    source: &'static KernelSource,
    name: &'static str,
) -> Result<Function> {
    gpu.function(source.name, name, || {
        let arch = source.arch_for(gpu.arch())?;
        load_module(gpu, source, arch)
    })
}

/// `source` built for `arch` through the PTX cache and loaded on `gpu` (linked with the device
/// runtime when the source asks for it).
fn load_module(gpu: &Gpu, source: &KernelSource, arch: Arch) -> Result<Module> {
    PtxCache::global().load(source, arch, |ptx| {
        if source.links_device_runtime() {
            gpu.load_module_with_device_runtime(ptx)
        } else {
            gpu.load_module(ptx)
        }
    })
}

/// The sources the floors below the workloads use (fills, maps, reductions, softmax,
/// segments, permutes, top-k, compression): what the actor loop loads before it starts
/// (with those already loaded), unless asked for every source.
pub static COMMON: &[&KernelSource] = &[
    &BASIC,
    &ELEMENTWISE,
    &REDUCE,
    &SOFTMAX,
    &SEGMENTS,
    &PERMUTE,
    &TOPK,
    &QUANT,
    &SPARSE,
];

/// Loads kernels now rather than at their first launch: a kernel loaded lazily may wait for
/// the device to go idle, which it never does while a resident kernel (the actors) runs.
/// Loads every kernel of [`COMMON`] and of every source this device has loaded already, or
/// with `all` of every embedded source the device can run (the MoE layer's too: slow the
/// first time on a machine, when each is compiled). Returns how many kernels it loaded.
pub(crate) fn load_eagerly(gpu: &Gpu, all: bool) -> Result<usize> {
    let mut loaded = 0;
    for source in SOURCES {
        let wanted =
            all || COMMON.iter().any(|c| c.name == source.name) || gpu.has_module(source.name);
        let Ok(arch) = source.arch_for(gpu.arch()) else {
            continue;
        };
        if !wanted {
            continue;
        }
        let ptx = PtxCache::global().ptx(source, arch)?;
        let module = gpu.module(source.name, || load_module(gpu, source, arch))?;
        loaded += gpu.load_module_eagerly(&module, &ptx)?;
    }
    Ok(loaded)
}

/// NVRTC's version as `major.minor`, or an error saying how to make it available.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    crate::device::nvrtc_version()
}

/// FNV-1a, 64 bits: a stable hash (std's hasher may change between Rust releases, which
/// would orphan the cache).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate parts so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const HEADER: &str = "// warpdrive-ptx v1";

/// Compiled PTX, in memory and on disk.
pub struct PtxCache {
    dir: Option<PathBuf>,
    memory: Mutex<HashMap<String, Entry>>,
    compiles: AtomicUsize,
    /// Set when a write to `dir` failed (and was reported): later compiles stay in memory.
    unwritable: AtomicBool,
    /// Cubins (machine code for one architecture) by key, beside the PTX.
    cubins: Mutex<HashMap<String, Arc<[u8]>>>,
}

/// PTX held in memory, and whether this cache compiled it (else it came from disk).
#[derive(Clone)]
struct Entry {
    ptx: Arc<str>,
    compiled_here: bool,
}

impl PtxCache {
    /// The process-wide cache in the default folder.
    pub fn global() -> &'static PtxCache {
        static CACHE: OnceLock<PtxCache> = OnceLock::new();
        CACHE.get_or_init(|| PtxCache::at_optional(default_dir()))
    }

    /// A cache in `dir` (tests; a fresh value behaves like a new process).
    pub fn at(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache::at_optional(Some(dir.into()))
    }

    fn at_optional(dir: Option<PathBuf>) -> PtxCache {
        PtxCache {
            dir,
            memory: Mutex::new(HashMap::new()),
            compiles: AtomicUsize::new(0),
            unwritable: AtomicBool::new(false),
            cubins: Mutex::new(HashMap::new()),
        }
    }

    /// How many times this cache has invoked NVRTC.
    pub fn compiles(&self) -> usize {
        self.compiles.load(Ordering::Relaxed)
    }

    /// The file a source compiled for `arch` is cached in.
    pub fn path_for(&self, source: &KernelSource, arch: Arch) -> Result<Option<PathBuf>> {
        let key = self.key(source, arch)?;
        Ok(self.file(&key))
    }

    fn file(&self, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.ptx")))
    }

    fn key(&self, source: &KernelSource, arch: Arch) -> Result<String> {
        let (major, minor) = nvrtc_version()?;
        let options = crate::device::compile_options(arch, source.links_device_runtime()).join(" ");
        let mut parts = vec![PRELUDE.as_bytes()];
        parts.extend(source.shared.map(|f| f.code.as_bytes()));
        parts.extend([source.code.as_bytes(), options.as_bytes()]);
        let hash = fnv1a(&parts);
        Ok(format!(
            "{}-{hash:016x}-{arch}-nvrtc{major}.{minor}",
            source.name
        ))
    }

    /// PTX for `source` built for `arch`: from memory, else disk, else NVRTC (then stored).
    pub fn ptx(&self, source: &KernelSource, arch: Arch) -> Result<Arc<str>> {
        Ok(self.entry(source, arch)?.ptx)
    }

    /// `load` (the driver's module load) applied to the PTX of `source` built for `arch`.
    /// PTX this cache did not compile (it came from disk) that `load` rejects is discarded,
    /// compiled anew and loaded once more; when that fails too, [`Error::ModuleLoad`] holds
    /// both errors. A lost device is returned as it is (nothing to retry on).
    pub fn load<M>(
        &self,
        source: &KernelSource,
        arch: Arch,
        mut load: impl FnMut(&str) -> Result<M>,
    ) -> Result<M> {
        let entry = self.entry(source, arch)?;
        let cached = match load(&entry.ptx) {
            Ok(module) => return Ok(module),
            Err(e) if entry.compiled_here || e.is_device_lost() => return Err(e),
            Err(e) => e,
        };
        tracing::warn!(
            "cached PTX of kernel {} for {arch} did not load ({cached}); compiling it anew",
            source.name
        );
        // Replaces the rejected entry in memory and on disk.
        let key = self.key(source, arch)?;
        let again = self
            .compile_and_keep(source, arch, &key)
            .and_then(|ptx| load(&ptx));
        again.map_err(|e| {
            if e.is_device_lost() {
                return e;
            }
            Error::ModuleLoad {
                kernel: source.name.into(),
                arch: arch.name(),
                cached: cached.to_string(),
                recompiled: e.to_string(),
            }
        })
    }

    fn entry(&self, source: &KernelSource, arch: Arch) -> Result<Entry> {
        let key = self.key(source, arch)?;
        self.entry_for(key, || self.compile(source, arch))
    }

    /// The entry under `key`: from memory, else disk, else `compile` (then stored).
    fn entry_for(&self, key: String, compile: impl FnOnce() -> Result<String>) -> Result<Entry> {
        if let Some(e) = self.memory.lock().get(&key) {
            return Ok(e.clone());
        }
        if let Some(ptx) = self.file(&key).as_deref().and_then(read_cached) {
            let entry = Entry {
                ptx: ptx.into(),
                compiled_here: false,
            };
            self.memory.lock().insert(key, entry.clone());
            return Ok(entry);
        }
        let ptx = self.keep(&key, compile()?.into());
        Ok(Entry {
            ptx,
            compiled_here: true,
        })
    }

    /// Compiles, then keeps the PTX in memory and on disk.
    fn compile_and_keep(&self, source: &KernelSource, arch: Arch, key: &str) -> Result<Arc<str>> {
        Ok(self.keep(key, self.compile(source, arch)?.into()))
    }

    /// Keeps `ptx` in memory and (unless the folder proved unwritable) on disk; the first
    /// failed write is reported and ends the disk writes of this cache.
    fn keep(&self, key: &str, ptx: Arc<str>) -> Arc<str> {
        let file = self
            .file(key)
            .filter(|_| !self.unwritable.load(Ordering::Relaxed));
        if let Some(file) = file {
            if let Err(e) = write_atomic(&file, &ptx) {
                if !self.unwritable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "PTX cache folder cannot be written ({e}); compiled kernels stay in memory"
                    );
                }
            }
        }
        let entry = Entry {
            ptx: ptx.clone(),
            compiled_here: true,
        };
        self.memory.lock().insert(key.to_string(), entry);
        ptx
    }

    /// PTX of a source made at run time (`text`, without the prelude, which is prepended),
    /// named `name` in its cache key and compile log; cached like the embedded sources.
    pub fn generated(&self, name: &str, text: &str, arch: Arch) -> Result<Arc<str>> {
        let (major, minor) = nvrtc_version()?;
        let options = crate::device::compile_options(arch, false).join(" ");
        let hash = fnv1a(&[PRELUDE.as_bytes(), text.as_bytes(), options.as_bytes()]);
        let key = format!("{name}-{hash:016x}-{arch}-nvrtc{major}.{minor}");
        let entry = self.entry_for(key, || {
            self.compiles.fetch_add(1, Ordering::Relaxed);
            let full = format!("{PRELUDE}\n#line 1 \"{name}.cu\"\n{text}");
            crate::device::compile_ptx(
                name,
                full,
                arch,
                crate::device::compile_options(arch, false),
            )
        })?;
        Ok(entry.ptx)
    }

    /// The cubin of `source` for `arch` (machine code the driver loads without a JIT; only a
    /// device of exactly `arch` runs it): from memory, else disk (`<key>.cubin` beside the
    /// PTX, checksummed like it), else NVRTC, which gives the PTX too (kept as [`ptx`] would).
    ///
    /// [`ptx`]: Self::ptx
    pub fn cubin(&self, source: &KernelSource, arch: Arch) -> Result<Arc<[u8]>> {
        let key = self.key(source, arch)?;
        if let Some(c) = self.cubins.lock().get(&key) {
            return Ok(c.clone());
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{key}.cubin")));
        if let Some(bytes) = file.as_deref().and_then(read_cached_bytes) {
            let c: Arc<[u8]> = bytes.into();
            self.cubins.lock().insert(key, c.clone());
            return Ok(c);
        }
        nvrtc_version()?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let (ptx, cubin) = crate::device::compile_image(source.name, self.full_text(source), arch)?;
        self.keep(&key, ptx.into());
        if let Some(file) = file.filter(|_| !self.unwritable.load(Ordering::Relaxed)) {
            if let Err(e) = write_atomic_bytes(&file, &cubin) {
                if !self.unwritable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "kernel cache folder cannot be written ({e}); compiled kernels stay in memory"
                    );
                }
            }
        }
        let c: Arc<[u8]> = cubin.into();
        self.cubins.lock().insert(key, c.clone());
        Ok(c)
    }

    /// The whole text NVRTC compiles for `source`: the prelude, its fragment, its code.
    fn full_text(&self, source: &KernelSource) -> String {
        let shared = source
            .shared
            .map(|f| format!("#line 1 \"{}.cu\"\n{}\n", f.name, f.code))
            .unwrap_or_default();
        format!(
            "{PRELUDE}\n{shared}#line 1 \"{}.cu\"\n{}",
            source.name, source.code
        )
    }

    /// Runs NVRTC; a rejected source returns its log.
    pub fn compile(&self, source: &KernelSource, arch: Arch) -> Result<String> {
        nvrtc_version()?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let options = crate::device::compile_options(arch, source.links_device_runtime());
        crate::device::compile_ptx(source.name, self.full_text(source), arch, options)
    }
}

fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("warpdrive").join("ptx"))
}

/// A cached file's body when its header checksum matches; `None` (recompile) otherwise.
fn read_cached(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let (header, body) = text.split_once('\n')?;
    let mut words = header.strip_prefix(HEADER)?.split_whitespace();
    let sum = words.next()?.strip_prefix("fnv=")?;
    let len: usize = words.next()?.strip_prefix("len=")?.parse().ok()?;
    let valid = body.len() == len && sum == format!("{:016x}", fnv1a(&[body.as_bytes()]));
    if !valid {
        tracing::warn!("PTX cache file {} is corrupt; recompiling", path.display());
    }
    valid.then(|| body.to_string())
}

const CUBIN_HEADER: &str = "// warpdrive-cubin v1";

/// A cached cubin's bytes when its header checksum matches; `None` (recompile) otherwise.
fn read_cached_bytes(path: &Path) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    let split = data.iter().position(|&b| b == b'\n')?;
    let (header, body) = (
        std::str::from_utf8(&data[..split]).ok()?,
        &data[split + 1..],
    );
    let mut words = header.strip_prefix(CUBIN_HEADER)?.split_whitespace();
    let sum = words.next()?.strip_prefix("fnv=")?;
    let len: usize = words.next()?.strip_prefix("len=")?.parse().ok()?;
    let valid = body.len() == len && sum == format!("{:016x}", fnv1a(&[body]));
    if !valid {
        tracing::warn!(
            "cubin cache file {} is corrupt; recompiling",
            path.display()
        );
    }
    valid.then(|| body.to_vec())
}

/// Writes a cubin with its checksum header, atomically (as [`write_atomic`]).
fn write_atomic_bytes(path: &Path, cubin: &[u8]) -> Result<()> {
    let mut data = format!(
        "{CUBIN_HEADER} fnv={:016x} len={}\n",
        fnv1a(&[cubin]),
        cubin.len()
    )
    .into_bytes();
    data.extend_from_slice(cubin);
    crate::files::write_atomic(path, &data)
}

/// Kernel `name` of `source` on `gpu`, loaded from its cubin (no JIT: the cubin is cached on
/// disk, so a later process starts from it) when `source` is built for the device's own
/// architecture, else, or when the cubin does not load, from PTX as [`function`].
pub(crate) fn function_from_cubin(
    gpu: &Gpu,
    source: &'static KernelSource,
    name: &'static str,
) -> Result<Function> {
    gpu.function(source.name, name, || {
        let arch = source.arch_for(gpu.arch())?;
        if arch == gpu.arch() {
            match PtxCache::global()
                .cubin(source, arch)
                .and_then(|c| gpu.load_module_image(&c))
            {
                Ok(m) => return Ok(m),
                Err(e) if e.is_device_lost() => return Err(e),
                Err(e) => tracing::warn!(
                    "the cubin of kernel {} did not load ({e}); loading its PTX",
                    source.name
                ),
            }
        }
        PtxCache::global().load(source, arch, |ptx| gpu.load_module(ptx))
    })
}

/// Loads `source`'s cubin for the device's architecture from `cache` into a module of its
/// own (not the device's table), gets kernel `name` from it, and drops both: what a new
/// process pays before its first launch of the kernel (NVRTC when `cache` has no cubin).
pub(crate) fn load_cubin_fresh(
    gpu: &Gpu,
    cache: &PtxCache,
    source: &KernelSource,
    name: &str,
) -> Result<()> {
    let arch = source.arch_for(gpu.arch())?;
    let module = gpu.load_module_image(&cache.cubin(source, arch)?)?;
    gpu.generated_function(&module, name).map(|_| ())
}

/// Writes `ptx` with its checksum header to a temp file and renames it into place, so a
/// reader never sees half a file.
fn write_atomic(path: &Path, ptx: &str) -> Result<()> {
    let text = format!(
        "{HEADER} fnv={:016x} len={}\n{ptx}",
        fnv1a(&[ptx.as_bytes()]),
        ptx.len()
    );
    crate::files::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names_round_trip() {
        for s in ["sm_80", "sm_90", "sm_90a", "sm_100", "sm_120a"] {
            assert_eq!(Arch::parse(s).map(|a| a.name()), Some(s.to_string()));
        }
        assert_eq!(Arch::parse("sm_9"), None);
        assert_eq!(Arch::parse("compute_90"), None);
        assert_eq!(Arch::from_compute_capability(9, 0).name(), "sm_90a");
        assert_eq!(Arch::from_compute_capability(8, 9).name(), "sm_89");
    }

    #[test]
    fn arch_selection() {
        static SRC: KernelSource = KernelSource {
            name: "t",
            code: "// archs: sm_80 sm_90a\n",
            shared: None,
        };
        let pick = |s: &str| SRC.arch_for(Arch::parse(s).unwrap()).map(|a| a.name());
        assert_eq!(pick("sm_90a").unwrap(), "sm_90a");
        assert_eq!(pick("sm_89").unwrap(), "sm_80");
        assert_eq!(pick("sm_100").unwrap(), "sm_80");
        assert!(pick("sm_75").is_err());
    }

    #[test]
    fn wgmma_and_cluster_sources_build_only_where_they_run() {
        let pick = |src: &KernelSource, s: &str| src.arch_for(Arch::parse(s).unwrap());
        // Off sm_90a the plan sees no arch for the wgmma source and takes moe_gemm's tiles; a
        // load there is refused with a message naming the source.
        assert_eq!(pick(&MOE_WGMMA, "sm_90a").unwrap(), Arch::SM_90A);
        for s in ["sm_80", "sm_90", "sm_100"] {
            let e = pick(&MOE_WGMMA, s).unwrap_err().to_string();
            assert!(e.contains("moe_wgmma"), "{e}");
        }
        assert!(pick(&MOE_ROUTER_CLUSTER, "sm_89").is_err());
        assert_eq!(pick(&MOE_ROUTER_CLUSTER, "sm_100").unwrap().name(), "sm_90");
        assert_eq!(pick(&MOE_GEMM, "sm_89").unwrap().name(), "sm_80");
    }

    #[test]
    fn every_source_declares_archs() {
        for s in SOURCES {
            assert!(!s.archs().unwrap().is_empty(), "{}", s.name);
        }
    }

    #[test]
    fn cache_files_detect_corruption() {
        let dir = std::env::temp_dir().join(format!("wd-ptxfile-{}", std::process::id()));
        let path = dir.join("x.ptx");
        write_atomic(&path, ".version 8.0\n// body\n").unwrap();
        assert_eq!(
            read_cached(&path).as_deref(),
            Some(".version 8.0\n// body\n")
        );
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("garbage");
        std::fs::write(&path, text).unwrap();
        assert_eq!(read_cached(&path), None);
        std::fs::write(&path, "not a cache file").unwrap();
        assert_eq!(read_cached(&path), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
