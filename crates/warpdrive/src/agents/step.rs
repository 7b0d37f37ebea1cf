//! A step function: one agent's update written twice with the same meaning, as CUDA C (run
//! on a GPU, one thread per agent, compiled by NVRTC at run time and cached as PTX and cubin
//! by the kernel floor) and as a Rust closure (run on the CPU backend, the reference).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use twox_hash::XxHash3_64;

use crate::device::LaunchMode;
use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::{self, Arch, KernelSource, PtxCache};
use crate::memory::Buffer;
use crate::ops::{fill_grid, launch, launch_with, Args};

use super::inputs::StepInputs;
use super::population::{FieldData, FieldKind, Population};

/// Constants a step takes at most (`p[0]` to `p[7]` in its body).
pub const MAX_PARAMS: usize = 8;

/// The generated kernel's name.
const KERNEL: &str = "agents_step";
/// The generated persistent kernel's name (many steps in one cooperative launch).
const LOOP: &str = "agents_step_loop";
/// The generated kernel over a range of agents held at the start of the field buffers (a
/// tiered population's GPU tier or one staged chunk of its parked agents).
pub(crate) const RANGE: &str = "agents_step_range";

/// One agent's fields on the host, for the CPU closure: the f32 fields and the u32 fields,
/// each in the order the population holds them (element `i` is agent `i`), and the step's
/// read-only inputs ([`StepInputs`]) of each kind in the order added.
pub struct HostFields<'a> {
    /// The f32 fields, in the population's order.
    pub f32: Vec<&'a mut [f32]>,
    /// The u32 fields, in the population's order.
    pub u32: Vec<&'a mut [u32]>,
    /// The f32 inputs, in the order added (empty without inputs).
    pub inputs_f32: Vec<&'a [f32]>,
    /// The u32 inputs, in the order added (empty without inputs).
    pub inputs_u32: Vec<&'a [u32]>,
}

type CpuStep = dyn Fn(usize, &mut HostFields<'_>, &[f32]) + Send + Sync;

/// A step function: a CUDA C body and a Rust closure of the same meaning.
///
/// The CUDA C `body` is the inside of `__device__ void step(u64 i, u64 n, <one pointer per
/// field, named as the field>, <per input: a const pointer named as it and its length
/// name_len>, const float* p)`: it updates agent `i` of `n` (`x[i] += v[i] * p[0];`), fields
/// being `float*` or `u32*` by kind and `p` the step's constants. The closure gets the same
/// agent index, the fields and inputs on the host (by kind, in order) and the constants.
///
/// ```
/// use warpdrive::agents::{Population, StepFn};
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let mut agents = Population::new(4);
/// agents.add_f32(&stream, "x", &[0.0, 1.0, 2.0, 3.0])?;
/// agents.add_f32(&stream, "v", &[1.0, 1.0, -1.0, 0.5])?;
/// let drift = StepFn::new("drift", "x[i] += v[i] * p[0];", |i, f, p| {
///     f.f32[0][i] += f.f32[1][i] * p[0];
/// });
/// drift.run(&stream, &mut agents, &[2.0])?;
/// assert_eq!(agents.f32_to_host(&stream, "x")?, [2.0, 3.0, 0.0, 4.0]);
/// # Ok(())
/// # }
/// ```
pub struct StepFn {
    name: String,
    body: String,
    cpu: Arc<CpuStep>,
}

impl std::fmt::Debug for StepFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepFn({})", self.name)
    }
}

impl StepFn {
    /// A step named `name` (it labels the kernel in compile logs) with CUDA C `body` and the
    /// CPU closure `cpu` (see the type's docs).
    pub fn new(
        name: &str,
        body: &str,
        cpu: impl Fn(usize, &mut HostFields<'_>, &[f32]) + Send + Sync + 'static,
    ) -> StepFn {
        StepFn {
            name: name.to_string(),
            body: body.to_string(),
            cpu: Arc::new(cpu),
        }
    }

    /// The CUDA C this step compiles to for a population with `fields` (without the prelude,
    /// which is prepended when it is compiled).
    pub fn source(&self, fields: &[(&str, FieldKind)]) -> String {
        self.source_with(fields, &[])
    }

    /// [`source`](Self::source) for a step that also reads `inputs` ([`StepInputs::kinds`]).
    pub fn source_with(
        &self,
        fields: &[(&str, FieldKind)],
        inputs: &[(&str, FieldKind)],
    ) -> String {
        let ty = |kind: &FieldKind| match kind {
            FieldKind::F32 => "float",
            FieldKind::U32 => "u32",
        };
        let mut params = String::new();
        let mut call = String::new();
        // The range kernel's call: each field's pointer moved back by `base`, so the body
        // indexes it with the agent's global index.
        let mut shifted = String::new();
        for (name, kind) in fields {
            let _ = write!(params, ", {}* __restrict__ {name}", ty(kind));
            let _ = write!(call, ", {name}");
            let _ = write!(shifted, ", {name} - base");
        }
        for (name, kind) in inputs {
            let _ = write!(
                params,
                ", const {}* __restrict__ {name}, u64 {name}_len",
                ty(kind)
            );
            let _ = write!(call, ", {name}, {name}_len");
            let _ = write!(shifted, ", {name}, {name}_len");
        }
        let consts: Vec<String> = (0..MAX_PARAMS).map(|k| format!("float p{k}")).collect();
        let values: Vec<String> = (0..MAX_PARAMS).map(|k| format!("p{k}")).collect();
        format!(
            "// archs: sm_80 sm_90 sm_90a\n\
             // The agents step `{name}`.\n\
             __device__ __forceinline__ void agents_step_body(u64 i, u64 n{params}, const float* __restrict__ p) {{\n\
             {body}\n\
             }}\n\
             extern \"C\" __global__ void __launch_bounds__(256) {KERNEL}(u64 n{params}, {consts}) {{\n\
             \x20   const float p[{MAX_PARAMS}] = {{{values}}};\n\
             \x20   const u64 stride = (u64)gridDim.x * blockDim.x;\n\
             \x20   for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)\n\
             \x20       agents_step_body(i, n{call}, p);\n\
             }}\n\
             // Agents base .. base + count of n, their fields at the start of the buffers (a\n\
             // tiered population's GPU tier or one staged chunk): the body sees global i.\n\
             extern \"C\" __global__ void __launch_bounds__(256) {RANGE}(u64 base, u64 count, u64 n{params}, {consts}) {{\n\
             \x20   const float p[{MAX_PARAMS}] = {{{values}}};\n\
             \x20   const u64 stride = (u64)gridDim.x * blockDim.x;\n\
             \x20   for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < count; j += stride)\n\
             \x20       agents_step_body(base + j, n{shifted}, p);\n\
             }}\n\
             // Every step over every agent, the blocks meeting after each (a cooperative\n\
             // launch: all resident); `bar` counts arrivals and only grows.\n\
             extern \"C\" __global__ void __launch_bounds__(256) {LOOP}(u64 n{params}, {consts}, u64 steps, u64* bar) {{\n\
             \x20   const float p[{MAX_PARAMS}] = {{{values}}};\n\
             \x20   const u64 stride = (u64)gridDim.x * blockDim.x;\n\
             \x20   for (u64 s = 0; s < steps; ++s) {{\n\
             \x20       for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)\n\
             \x20           agents_step_body(i, n{call}, p);\n\
             \x20       __syncthreads();\n\
             \x20       if (threadIdx.x == 0) {{\n\
             \x20           __threadfence();\n\
             \x20           atomicAdd((unsigned long long*)bar, 1ull);\n\
             \x20           const u64 target = (s + 1) * (u64)gridDim.x;\n\
             \x20           u64 seen;\n\
             \x20           while (true) {{\n\
             \x20               asm volatile(\"ld.acquire.gpu.global.u64 %0, [%1];\" : \"=l\"(seen) : \"l\"(bar) : \"memory\");\n\
             \x20               if (seen >= target) break;\n\
             \x20               __nanosleep(32);\n\
             \x20           }}\n\
             \x20       }}\n\
             \x20       __syncthreads();\n\
             \x20   }}\n\
             }}\n",
            name = self.name,
            body = self.body,
            consts = consts.join(", "),
            values = values.join(", "),
        )
    }

    /// The interned kernel source for `fields` and `inputs` (one per distinct text, for the
    /// process's life, as the kernel floor's table needs `'static` sources).
    pub(crate) fn kernel(
        &self,
        fields: &[(&str, FieldKind)],
        inputs: &[(&str, FieldKind)],
    ) -> &'static KernelSource {
        intern(&self.name, self.source_with(fields, inputs))
    }

    /// The PTX of this step for a population with `fields`, compiled by NVRTC for `arch`
    /// through `cache` (needs NVRTC, not a GPU); a body that does not compile gives
    /// `Error::Compile` with NVRTC's log.
    pub fn ptx(
        &self,
        cache: &PtxCache,
        fields: &[(&str, FieldKind)],
        arch: Arch,
    ) -> Result<Arc<str>> {
        self.ptx_with(cache, fields, &[], arch)
    }

    /// [`ptx`](Self::ptx) for a step that also reads `inputs` ([`StepInputs::kinds`]).
    pub fn ptx_with(
        &self,
        cache: &PtxCache,
        fields: &[(&str, FieldKind)],
        inputs: &[(&str, FieldKind)],
        arch: Arch,
    ) -> Result<Arc<str>> {
        cache.ptx(self.kernel(fields, inputs), arch)
    }

    /// Loads this step's kernel for `fields` into the device's table (the cached cubin, else
    /// NVRTC), so the first [`run`](Self::run) launches at once. A no-op on the CPU backend.
    pub fn load(&self, stream: &Stream, fields: &[(&str, FieldKind)]) -> Result<()> {
        let src = self.kernel(fields, &[]);
        stream.run(
            (),
            |()| Ok(()),
            |(), q| kernels::function_from_cubin(q.gpu, src, KERNEL).map(|_| ()),
        )
    }

    /// Loads this step's kernel for `fields` through `cache` into a module of its own (not
    /// the device's table) and drops it: what a new process pays before its first step —
    /// NVRTC when `cache` holds no cubin for the device, else a file read and the driver's
    /// load of machine code (no JIT). A no-op on the CPU backend.
    pub fn load_fresh(
        &self,
        stream: &Stream,
        fields: &[(&str, FieldKind)],
        cache: &PtxCache,
    ) -> Result<()> {
        let src = self.kernel(fields, &[]);
        stream.run(
            (),
            |()| Ok(()),
            |(), q| kernels::load_cubin_fresh(q.gpu, cache, src, KERNEL),
        )
    }

    /// `params` padded with zeros to [`MAX_PARAMS`]; more is an error.
    pub(crate) fn params(&self, params: &[f32]) -> Result<[f32; MAX_PARAMS]> {
        if params.len() > MAX_PARAMS {
            return Err(Error::InvalidArgument(format!(
                "agents: step `{}` got {} constants, at most {MAX_PARAMS}",
                self.name,
                params.len()
            )));
        }
        let mut p = [0.0f32; MAX_PARAMS];
        p[..params.len()].copy_from_slice(params);
        Ok(p)
    }

    /// Fields and inputs on the stream's device, fields of the population's length, no input
    /// named as a field.
    pub(crate) fn check_fields(
        &self,
        stream: &Stream,
        agents: &Population,
        inputs: &StepInputs,
    ) -> Result<()> {
        for (name, data) in agents.all() {
            data.check_stream(stream, "agents step")?;
            let ok = data.len();
            if ok != agents.len() {
                return Err(Error::InvalidArgument(format!(
                    "agents: field `{name}` holds {ok} values for {} agents",
                    agents.len()
                )));
            }
        }
        for (name, data) in inputs.all() {
            data.check_stream(stream, "agents step input")?;
            let clash = agents.all().any(|(f, _)| {
                f == name
                    || name.strip_suffix("_len") == Some(f)
                    || f.strip_suffix("_len") == Some(name)
            });
            if clash {
                return Err(Error::InvalidArgument(format!(
                    "agents: step input `{name}` clashes with a field of the population"
                )));
            }
        }
        Ok(())
    }

    /// Runs the step once over every agent of `agents` with constants `params` (at most
    /// [`MAX_PARAMS`]; missing ones are 0).
    pub fn run(&self, stream: &Stream, agents: &mut Population, params: &[f32]) -> Result<()> {
        self.run_with(stream, agents, &StepInputs::new(), params)
    }

    /// [`run`](Self::run) with read-only `inputs` (messages, a graph's edges, arrays) that
    /// the body reads by name; an input named as a field (or as a field's `_len`) is an
    /// error.
    pub fn run_with(
        &self,
        stream: &Stream,
        agents: &mut Population,
        inputs: &StepInputs,
        params: &[f32],
    ) -> Result<()> {
        let p = self.params(params)?;
        self.check_fields(stream, agents, inputs)?;
        let n = agents.len();
        if n == 0 {
            return Ok(());
        }
        let src = self.kernel(&agents.fields(), &inputs.kinds());
        let cpu = Arc::clone(&self.cpu);
        stream.run(
            agents,
            |agents| {
                let mut host = HostFields {
                    f32: Vec::new(),
                    u32: Vec::new(),
                    inputs_f32: Vec::new(),
                    inputs_u32: Vec::new(),
                };
                for d in agents.all_mut() {
                    match d {
                        FieldData::F32(b) => host.f32.push(b.host_view_mut()?),
                        FieldData::U32(b) => host.u32.push(b.host_view_mut()?),
                    }
                }
                for (_, d) in inputs.all() {
                    match d {
                        FieldData::F32(b) => host.inputs_f32.push(b.host_view()?),
                        FieldData::U32(b) => host.inputs_u32.push(b.host_view()?),
                    }
                }
                for i in 0..n {
                    cpu(i, &mut host, &p);
                }
                Ok(())
            },
            |agents, q| {
                kernels::function_from_cubin(q.gpu, src, KERNEL)?;
                let grid = fill_grid(q.gpu, (src, KERNEL), n as u64, 256)?;
                let args = step_args(agents, inputs, p);
                // SAFETY: agents_step(u64 n, one pointer per field in the population's order
                // (float* or u32*, each holding n elements: checked above), per input a
                // const pointer and its length (the input's buffer, on this device: checked),
                // MAX_PARAMS floats), as `source_with` generates it; the kernel touches
                // fields below n only, and inputs as the body reads them (the caller's body
                // bounds its reads by the `_len` it is given).
                unsafe { launch(q, (src, KERNEL), grid, 256, 0, args) }
            },
        )
    }
}

impl StepFn {
    /// Runs `steps` steps (as [`run_with`](Self::run_with) would, with the same `inputs`
    /// every step: a messages snapshot is not refreshed between them) in one persistent
    /// kernel whose blocks meet at a grid-wide barrier after each step — one launch for all
    /// of them, nothing from the host in between. The grid is no larger than the GPU holds
    /// at once (a cooperative launch). Refused with an error while resident actors run on
    /// the device (a cooperative kernel and a resident one may not both fit). On the CPU
    /// backend, `steps` runs of the closure.
    pub fn run_steps(
        &self,
        stream: &Stream,
        agents: &mut Population,
        inputs: &StepInputs,
        params: &[f32],
        steps: u64,
    ) -> Result<()> {
        if stream.device().has_resident_kernel() {
            return Err(Error::Unsupported(
                "agents: a persistent step kernel while resident actors run on this GPU (they \
                 cannot both be resident; stop the actor system or step with run_with)"
                    .into(),
            ));
        }
        let p = self.params(params)?;
        self.check_fields(stream, agents, inputs)?;
        let n = agents.len();
        if stream.queue().is_none() || steps == 0 || n == 0 {
            for _ in 0..steps {
                self.run_with(stream, agents, inputs, params)?;
            }
            return Ok(());
        }
        let src = self.kernel(&agents.fields(), &inputs.kinds());
        let bar = Buffer::<u64>::zeros(stream, 1)?;
        stream.run(
            agents,
            |_| Ok(()),
            |agents, q| {
                kernels::function_from_cubin(q.gpu, src, LOOP)?;
                let grid = fill_grid(q.gpu, (src, LOOP), n as u64, 256)?;
                let args = step_args(agents, inputs, p).u64(steps).buf(&bar);
                let mode = LaunchMode {
                    cooperative: true,
                    ..LaunchMode::default()
                };
                // SAFETY: agents_step_loop(the parameters of agents_step, u64 steps, u64*
                // bar) as `source_with` generates it, the same arguments as run_with's launch
                // plus the step count and one zeroed counter (freed in stream order); a
                // cooperative launch of a grid no larger than fill_grid's resident bound, so
                // every block reaches each barrier.
                unsafe { launch_with(q, (src, LOOP), grid, 256, 0, args, mode) }
            },
        )
    }
}

impl StepFn {
    /// The CPU closure (the reference), for steps over host copies of the fields.
    pub(crate) fn cpu(&self) -> &CpuStep {
        self.cpu.as_ref()
    }

    /// Enqueues the range kernel of `src` (this step's source for the fields' kinds and
    /// `inputs`) on `stream`'s GPU: agents `base .. base + count` of `n`, whose fields are
    /// `fields` in the population's order, each holding agent `base + j` at element `j`. An
    /// error on the CPU backend, or when a field holds fewer than `count` values.
    pub(crate) fn launch_range(
        &self,
        stream: &Stream,
        src: &'static KernelSource,
        (base, count, n): (u64, u64, u64),
        fields: &[&FieldData],
        inputs: &StepInputs,
        p: [f32; MAX_PARAMS],
    ) -> Result<()> {
        if let Some(short) = fields.iter().find(|f| (f.len() as u64) < count) {
            return Err(Error::InvalidArgument(format!(
                "agents: a range step of {count} agents over a field of {}",
                short.len()
            )));
        }
        if count == 0 {
            return Ok(());
        }
        stream.run(
            (),
            |()| {
                Err(Error::Unsupported(
                    "agents: the range step kernel runs on a GPU only".into(),
                ))
            },
            |(), q| {
                kernels::function_from_cubin(q.gpu, src, RANGE)?;
                let grid = fill_grid(q.gpu, (src, RANGE), count, 256)?;
                let mut args = Args::new().u64(base).u64(count).u64(n);
                for f in fields {
                    args = args.ptr(f.device_ptr());
                }
                for (_, d) in inputs.all() {
                    args = args.ptr(d.device_ptr()).u64(d.len() as u64);
                }
                let args = p.into_iter().fold(args, Args::f32);
                // SAFETY: agents_step_range(u64 base, u64 count, u64 n, one pointer per
                // field in the population's order, per input a const pointer and its length,
                // MAX_PARAMS floats), as `source_with` generates it; every field buffer holds
                // at least `count` values (checked above) and the kernel touches elements
                // `0 .. count` of each (agent `base + j` through the pointer moved back by
                // `base`; `run_tiered`'s contract: a body touches its own agent's fields
                // only); inputs as in `run_with`.
                unsafe { launch(q, (src, RANGE), grid, 256, 0, args) }
            },
        )
    }
}

/// The step kernels' arguments: the agent count, one pointer per
/// field, a pointer and a length per input, then the constants (as `source_with` declares).
fn step_args(agents: &Population, inputs: &StepInputs, p: [f32; MAX_PARAMS]) -> Args {
    let mut args = Args::new().u64(agents.len() as u64);
    for (_, d) in agents.all() {
        args = args.ptr(d.device_ptr());
    }
    for (_, d) in inputs.all() {
        args = args.ptr(d.device_ptr()).u64(d.len() as u64);
    }
    p.into_iter().fold(args, Args::f32)
}

/// Interned step sources by text.
fn intern(name: &str, code: String) -> &'static KernelSource {
    static R: OnceLock<Mutex<HashMap<String, &'static KernelSource>>> = OnceLock::new();
    let mut reg = R.get_or_init(Default::default).lock();
    if let Some(s) = reg.get(&code) {
        return s;
    }
    let clean: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect();
    let label = format!(
        "agents-{clean}-{:016x}",
        XxHash3_64::oneshot(code.as_bytes())
    );
    // Interned for the process's life: one per distinct step text.
    let src: &'static KernelSource = Box::leak(Box::new(KernelSource {
        name: Box::leak(label.into_boxed_str()),
        code: Box::leak(code.clone().into_boxed_str()),
        shared: None,
    }));
    reg.insert(code, src);
    src
}
