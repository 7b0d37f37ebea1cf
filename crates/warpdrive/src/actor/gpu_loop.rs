//! The resident kernel: its source made from the actors' handlers, its descriptors and
//! device memory, the launch, and the host's view of it (`kernels/actor_loop.cu`).

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::host::ActorShared;
use super::ring;
use super::spec::ErasedSpec;
use super::system::Loop;
use crate::device::{LaunchMode, ResidentGuard, SharedWords};
use crate::error::{Error, Result};
use crate::kernels::{PtxCache, ACTOR_LOOP};
use crate::memory::Buffer;
use crate::{Device, Event, Stream};

/// Descriptor words per actor (`D_WORDS` in the kernel) and their indices.
const DESC_WORDS: usize = 32;
const D_BLOCK: usize = 0;
const D_STATE: usize = 1;
const D_DEV_RING: usize = 2;
const D_FWD_RING: usize = 3;
const D_LANES: usize = 4;
const D_CAPACITY: usize = 5;
const D_IN_SW: usize = 6;
const D_OUT_SW: usize = 7;
const D_BATCH: usize = 8;
const D_STARVATION: usize = 9;
const D_KIND: usize = 10;
const D_OUTBOX_BASE: usize = 11;
const D_FWD_CAPACITY: usize = 12;
const D_DEV_CAPACITY: usize = 13;
const D_WMAX: usize = 14;
const D_PICK_MAX: usize = 15;
const D_LANE_BASE: usize = 16;
const D_SYS: usize = 20;
const D_IN_STAGE: usize = 21;
const D_TRACE_BASE: usize = 22;
const D_TRACE_EVERY: usize = 23;
const D_PARALLEL: usize = 24;
const D_QUICK_STREAM: usize = 25;
const D_WIDE: usize = 26;
const D_TAIL_HINT: usize = 27;
/// Vectors (16 bytes) the loop reads in one round of loads (`ONE_TRIP_VECTORS`).
const ONE_TRIP_VECTORS: usize = 96;
/// Words before a device ring's slots (its head, then padding to 16 bytes).
const DEV_RING_SLOTS: usize = 2;
/// Shared memory a block stages inputs and outputs in, at most (bytes).
const IN_STAGE_BYTES: usize = 48 * 1024;
const OUT_STAGE_BYTES: usize = 32 * 1024;

/// The running kernel and the device memory it uses.
pub(crate) struct GpuLoop {
    /// Where state reads and copies go: never the loop's own stream, which the loop holds.
    side: Stream,
    done: Event,
    states: Vec<Option<Buffer<u8>>>,
    _descs: Buffer<u64>,
    _dev_rings: Vec<Option<Buffer<u64>>>,
    _stream: Stream,
    guard: Option<ResidentGuard>,
    /// The loop's kernel and its module, held while the loop may run: unloading a module
    /// waits for its kernels, which this one never leaves on its own.
    _kernel: crate::device::Function,
}

pub(crate) fn start(
    device: &Device,
    sys: &Arc<SharedWords>,
    actors: &[Arc<ActorShared>],
    specs: Vec<ErasedSpec>,
    preload_all: bool,
    trace_every: u32,
    reply_gap: bool,
) -> Result<GpuLoop> {
    let gpu = device.gpu("the actor loop")?;
    let t0 = Instant::now();
    let ptx = compile(&specs, gpu.arch(), reply_gap)?;
    let module = gpu.load_module(&ptx)?;
    let f = gpu.generated_function(&module, "actor_loop")?;
    tracing::debug!("actor loop: compiled and loaded in {:?}", t0.elapsed());
    let n = crate::kernels::load_eagerly(gpu, preload_all)?;
    let side = device.new_stream()?;
    // A graph capture makes the cuBLAS handle first; making it waits for the device.
    gpu.prepare_blas(side.gpu("the actor loop")?.stream)?;
    tracing::debug!(
        "actor loop: {n} kernels loaded eagerly by {:?}",
        t0.elapsed()
    );

    let targets: Vec<bool> = (0..specs.len())
        .map(|i| specs.iter().any(|s| s.forward_to == Some(i)))
        .collect();
    let mut dev_rings = Vec::with_capacity(specs.len());
    for (spec, &target) in specs.iter().zip(&targets) {
        dev_rings.push(if target {
            let words = spec
                .capacity
                .checked_mul(ring::slot_words(spec.in_bytes))
                .and_then(|w| w.checked_add(DEV_RING_SLOTS))
                .ok_or_else(|| Error::InvalidArgument("device ring too large".into()))?;
            Some(Buffer::<u64>::zeros(&side, words)?)
        } else {
            None
        });
    }
    let mut states = Vec::with_capacity(specs.len());
    let mut descs = vec![0u64; specs.len() * DESC_WORDS];
    let mut shared_bytes = 0usize;
    for (i, (spec, actor)) in specs.iter().zip(actors).enumerate() {
        let state = if spec.state.is_empty() {
            None
        } else {
            Some(Buffer::from_host(&side, &spec.state)?)
        };
        let d = &mut descs[i * DESC_WORDS..(i + 1) * DESC_WORDS];
        let in_sw = ring::slot_words(spec.in_bytes);
        let out_sw = ring::slot_words(spec.out_bytes);
        let ranks = spec.lanes + targets[i] as usize;
        // At least two slots even for a batch of one: the second tells the loop whether the
        // ring is drained (actor_loop.cu, next_window).
        let wmax = (IN_STAGE_BYTES / (ranks * in_sw * 4)).clamp(1, spec.batch.max(2));
        let pick_max = (OUT_STAGE_BYTES / (out_sw * 4)).clamp(1, spec.batch);
        // The window after an empty read that follows a stream (`wide_window`; actor_loop.cu
        // keeps two slots after a lone message): as many as every lane's window read in one
        // round of loads, so a burst after a pause is read in fewer, wider reads.
        let narrow = 2.min(wmax);
        let wide = if spec.wide_window {
            (ONE_TRIP_VECTORS / (ranks * in_sw / 2)).clamp(narrow, wmax)
        } else {
            narrow
        };
        let in_stage = ranks * wmax * in_sw;
        shared_bytes = shared_bytes.max((in_stage + pick_max * out_sw) * 4);
        d[D_BLOCK] = actor.block.device_ptr();
        d[D_STATE] = state.as_ref().map_or(0, |b| b.device_ptr());
        d[D_DEV_RING] = dev_rings[i].as_ref().map_or(0, |b| b.device_ptr());
        if let Some(t) = spec.forward_to {
            d[D_FWD_RING] = dev_rings[t].as_ref().map_or(0, |b| b.device_ptr());
            d[D_FWD_CAPACITY] = specs[t].capacity as u64;
        }
        d[D_LANES] = spec.lanes as u64;
        d[D_CAPACITY] = spec.capacity as u64;
        d[D_IN_SW] = in_sw as u64;
        d[D_OUT_SW] = out_sw as u64;
        d[D_BATCH] = spec.batch as u64;
        d[D_STARVATION] = spec.starvation_limit as u64;
        d[D_KIND] = i as u64;
        d[D_OUTBOX_BASE] = actor.outbox.base as u64;
        d[D_DEV_CAPACITY] = spec.capacity as u64;
        d[D_WMAX] = wmax as u64;
        d[D_PICK_MAX] = pick_max as u64;
        for (l, lane) in actor.lanes.iter().enumerate() {
            d[D_LANE_BASE + l] = lane.base as u64;
        }
        d[D_SYS] = sys.device_ptr();
        d[D_IN_STAGE] = in_stage as u64;
        d[D_TRACE_BASE] = actor.trace_base as u64;
        d[D_TRACE_EVERY] = trace_every as u64;
        // Without state a handler is a function of its message: one message per thread.
        d[D_PARALLEL] = spec.state.is_empty() as u64;
        d[D_QUICK_STREAM] = spec.quick_stream as u64;
        d[D_WIDE] = wide as u64;
        d[D_TAIL_HINT] = spec.tail_hint as u64;
        states.push(state);
    }
    let descs = Buffer::from_host(&side, &descs)?;
    side.synchronize()?;
    tracing::debug!("actor loop: memory ready by {:?}", t0.elapsed());

    let stream = device.new_stream()?;
    let done = device.new_sync_event()?;
    let guard = gpu.resident_guard();
    let q = stream.gpu("the actor loop")?;
    let mut args = [descs.device_ptr(), specs.len() as u64];
    let mut params: Vec<*mut c_void> = args
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: the kernel takes (const u64* descs, u32 n_actors): `descs` holds n_actors
    // descriptors of DESC_WORDS words, each naming memory that lives as long as this loop
    // (the actors' shared blocks are held by the system until the loop has ended, or leaked
    // if it never does); the driver copies the parameter values during the call.
    let launched = unsafe {
        q.gpu.launch(
            q.stream,
            &f,
            (specs.len() as u32, 1, 1),
            (32, 1, 1),
            shared_bytes as u32,
            &mut params,
            LaunchMode {
                cooperative: true,
                ..LaunchMode::default()
            },
        )
    };
    if let Err(e) = launched {
        drop(guard);
        return Err(match e {
            Error::Driver { message, .. } if message.contains("COOPERATIVE_LAUNCH_TOO_LARGE") => {
                Error::InvalidArgument(format!(
                    "{} actors with {shared_bytes} bytes of staging each do not fit on the GPU \
                     at once: fewer actors or smaller batches",
                    specs.len()
                ))
            }
            e => e,
        });
    }
    stream.record(&done)?;
    tracing::debug!(
        "actor loop: {} actors launched ({shared_bytes} bytes of shared memory each) by {:?}",
        specs.len(),
        t0.elapsed()
    );
    Ok(GpuLoop {
        side,
        done,
        states,
        _descs: descs,
        _dev_rings: dev_rings,
        _stream: stream,
        guard: Some(guard),
        _kernel: f,
    })
}

impl Loop for GpuLoop {
    fn join(&mut self, timeout: Duration) -> Result<bool> {
        let t0 = Instant::now();
        while !self.done.query()? {
            if t0.elapsed() > timeout {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
        self.guard.take();
        Ok(true)
    }

    fn running(&self) -> Result<bool> {
        Ok(!self.done.query()?)
    }

    fn state(&self, actor: usize) -> Result<Vec<u8>> {
        match self.states.get(actor) {
            Some(Some(b)) => b.to_host(&self.side),
            // An actor without state bytes (`S = ()`) has no buffer.
            Some(None) => Ok(Vec::new()),
            None => Err(Error::InvalidArgument(format!("no actor {actor}"))),
        }
    }
}

/// The loop's PTX for `specs` on `arch`, through the PTX cache.
pub(crate) fn compile(
    specs: &[ErasedSpec],
    arch: crate::kernels::Arch,
    reply_gap: bool,
) -> Result<Arc<str>> {
    PtxCache::global().generated("actor_loop", &source(specs, reply_gap)?, arch)
}

/// The loop's source: the fragment, each actor's handler in its namespace with checks of
/// its types' sizes, and the dispatch.
fn source(specs: &[ErasedSpec], reply_gap: bool) -> Result<String> {
    // `ActorSpec::quick_stream`'s path is compiled in only where an actor asks for it (the
    // loop is at its register limit: the flag alone costs spills).
    let mut text = String::new();
    if specs.iter().any(|s| s.quick_stream) {
        text.push_str("#define ACTOR_QUICK_STREAM 1\n");
    }
    // `ActorSpec::tail_hint`'s loads and windows, likewise only where an actor asks (in such
    // a loop an actor without it loads its command as before and its tails stay 0).
    if specs.iter().any(|s| s.tail_hint) {
        text.push_str("#define ACTOR_TAIL_HINT 1\n");
    }
    // `SystemConfig::reply_gap`, for every actor of the loop.
    if reply_gap {
        text.push_str("#define ACTOR_REPLY_GAP 1\n");
    }
    text.push_str(ACTOR_LOOP.code);
    for (i, spec) in specs.iter().enumerate() {
        let handler = spec.cuda.as_deref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "actor {}: no CUDA handler (`ActorSpec::cuda`)",
                spec.name
            ))
        })?;
        let file: String = spec
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let name = &spec.name;
        let _ = writeln!(
            text,
            "namespace actor_{i} {{\n#line 1 \"actor_{file}.cu\"\n{handler}\n}}"
        );
        let _ = writeln!(text, "#line 1 \"actor_{file}_checks.cu\"");
        for (ty, bytes) in [("In", spec.in_bytes), ("Out", spec.out_bytes)] {
            let _ = writeln!(
                text,
                "static_assert(sizeof(actor_{i}::{ty}) == {bytes}, \"actor {name}: {ty} is {bytes} bytes in Rust\");"
            );
        }
        if !spec.state.is_empty() {
            let bytes = spec.state.len();
            let _ = writeln!(
                text,
                "static_assert(sizeof(actor_{i}::State) == {bytes}, \"actor {name}: State is {bytes} bytes in Rust\");"
            );
        }
    }
    text.push_str("#line 1 \"actor_dispatch.cu\"\n");
    text.push_str(
        "__device__ void actor_dispatch(u32 kind, const void* in, void* out, void* state, ActorCtx* ctx) {\n    switch (kind) {\n",
    );
    for i in 0..specs.len() {
        let _ = writeln!(
            text,
            "    case {i}: actor_{i}::handle((const actor_{i}::In*)in, (actor_{i}::Out*)out, (actor_{i}::State*)state, ctx); break;"
        );
    }
    text.push_str("    default: break;\n    }\n}\n");
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_wraps_each_handler_and_checks_sizes() {
        let spec = super::super::ActorSpec::<u32, u64, u32>::new("a b", 0)
            .cuda("struct In { u32 x; }; struct Out { u64 y; }; struct State { u32 n; };\n__device__ void handle(const In* i, Out* o, State* s, ActorCtx*) { o->y = i->x; }")
            .erase()
            .unwrap();
        let text = source(&[spec], false).unwrap();
        assert!(text.contains("namespace actor_0 {\n#line 1 \"actor_a_b.cu\""));
        assert!(text.contains("sizeof(actor_0::Out) == 8"));
        assert!(text.contains("sizeof(actor_0::State) == 4"));
        assert!(text.contains("case 0: actor_0::handle("));
        // `ActorSpec::tail_hint` (on by default) compiles its path in; off, the loop is as
        // before.
        assert!(text.contains("#define ACTOR_TAIL_HINT 1"));
        let off = super::super::ActorSpec::<u32, u64, u32>::new("off", 0)
            .cuda("")
            .tail_hint(false)
            .erase()
            .unwrap();
        assert!(!source(&[off], false).unwrap().contains("ACTOR_TAIL_HINT 1"));
    }
}
