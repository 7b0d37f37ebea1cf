//! A tiered population: the seed's agent pool with a GPU tier and a host tier. Agents
//! `0 .. min(len, gpu_agents)` live on the device (a [`Population`]); the rest are parked in
//! page-locked host memory ([`PinnedBuf`]s, one per field per chunk of at most `chunk`
//! agents), so a population larger than its GPU budget still steps
//! ([`StepFn::run_tiered`](super::StepFn::run_tiered) streams the parked chunks through the
//! GPU). Agent order is global: the GPU tier first, then the parked chunks in order.

use crate::device::Stream;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::{host_vec, PinnedBuf};

use super::life::LifeCounts;
use super::population::{FieldData, FieldKind, Population};
use super::tiered_step::Staging;

/// Parked agents a chunk holds by default (4 MiB a 4-byte field): the unit the step streams
/// through the GPU, large enough that a copy runs near the link's bandwidth.
pub const DEFAULT_CHUNK: usize = 1 << 20;

/// How many agents each tier may hold (the seed's `AgentPoolConfig { gpu_agents,
/// cpu_agents }`): the GPU tier fills first, the host tier takes the rest, and a
/// population beyond both is an error. While agents are parked, stepping also holds two
/// chunks of every field on the device (the staging the parked chunks stream through).
///
/// ```
/// use warpdrive::agents::TierBudget;
///
/// // The seed's pool: 64 k agents on the GPU, 200 k on the host.
/// let pool = TierBudget::new(64_000, 200_000);
/// assert_eq!(pool.split(100_000).unwrap(), (64_000, 36_000));
/// let err = pool.split(264_001).unwrap_err().to_string();
/// assert!(err.contains("host budget is exceeded by 1 agent"), "{err}");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierBudget {
    /// Agents on the device at most.
    pub gpu_agents: usize,
    /// Agents parked in pinned host memory at most.
    pub host_agents: usize,
}

impl TierBudget {
    /// A budget of `gpu_agents` on the device and `host_agents` parked on the host.
    pub fn new(gpu_agents: usize, host_agents: usize) -> TierBudget {
        TierBudget {
            gpu_agents,
            host_agents,
        }
    }

    /// How `len` agents split, GPU first: `(on the GPU, parked)`; an error naming the
    /// budget and the excess when they do not fit.
    pub fn split(&self, len: usize) -> Result<(usize, usize)> {
        let gpu = len.min(self.gpu_agents);
        let parked = len - gpu;
        if parked > self.host_agents {
            let over = parked - self.host_agents;
            return Err(Error::InvalidArgument(format!(
                "agents: {len} agents do not fit the tier budgets ({} on the GPU, {} on the \
                 host): the host budget is exceeded by {over} agent{}",
                self.gpu_agents,
                self.host_agents,
                if over == 1 { "" } else { "s" }
            )));
        }
        Ok((gpu, parked))
    }
}

/// One field of a parked chunk.
#[derive(Debug)]
pub(crate) enum HostData {
    F32(PinnedBuf<f32>),
    U32(PinnedBuf<u32>),
}

/// `n` agents of `host` into `dev` from agent `at`, on `stream` (field `name`: the kinds
/// differ only through a bug, an error then).
pub(crate) fn upload(
    stream: &Stream,
    dev: &mut FieldData,
    at: usize,
    host: &mut HostData,
    n: usize,
    name: &str,
) -> Result<()> {
    match (dev, host) {
        (FieldData::F32(b), HostData::F32(h)) => b.copy_from_pinned_at(stream, at, h, n),
        (FieldData::U32(b), HostData::U32(h)) => b.copy_from_pinned_at(stream, at, h, n),
        _ => Err(inconsistent(name)),
    }
}

/// The first `n` agents of `dev` into `host`, on `stream` (as [`upload`], the other way).
pub(crate) fn download(
    stream: &Stream,
    dev: &FieldData,
    host: &mut HostData,
    n: usize,
    name: &str,
) -> Result<()> {
    match (dev, host) {
        (FieldData::F32(b), HostData::F32(h)) => b.copy_to_pinned_at(stream, 0, h, n),
        (FieldData::U32(b), HostData::U32(h)) => b.copy_to_pinned_at(stream, 0, h, n),
        _ => Err(inconsistent(name)),
    }
}

/// Consecutive parked agents (at most the population's `chunk` of them), one pinned block
/// per field.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) len: usize,
    pub(crate) fields: Vec<HostData>,
}

/// One field's values for every agent, on the host (gathering and relaying out).
#[derive(Debug)]
enum Column {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::F32(v) => v.len(),
            Column::U32(v) => v.len(),
        }
    }
}

/// Agents as named f32 / u32 fields over two tiers: up to a GPU budget on the device, the
/// rest parked in pinned host memory.
///
/// ```
/// use warpdrive::agents::{StepFn, StepInputs, TierBudget, TieredPopulation};
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// // Two agents on the GPU, the third parked on the host.
/// let mut agents = TieredPopulation::new(3, TierBudget::new(2, 10))?;
/// agents.add_f32(&stream, "x", &[0.0, 1.0, 2.0])?;
/// assert_eq!((agents.gpu_len(), agents.parked_len()), (2, 1));
/// let index = StepFn::new("index", "x[i] += (float)i;", |i, f, _| f.f32[0][i] += i as f32);
/// index.run_tiered(&stream, &mut agents, &StepInputs::new(), &[])?;
/// assert_eq!(agents.f32_to_host(&stream, "x")?, [0.0, 2.0, 4.0]);
/// // Beyond both budgets: an error, nothing dropped.
/// assert!(TieredPopulation::new(13, TierBudget::new(2, 10)).is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct TieredPopulation {
    pub(crate) budget: TierBudget,
    chunk: usize,
    len: usize,
    /// Agents `0 .. gpu_len`; it holds every field (of length 0 when the GPU tier is empty).
    pub(crate) gpu: Population,
    pub(crate) parked: Vec<Chunk>,
    /// The step's device staging, made on the first GPU step, kept while the fields stay
    /// (grown when a chunk needs more room).
    pub(crate) staging: Option<Staging>,
}

impl TieredPopulation {
    /// An empty population of `len` agents (no fields yet) under `budget`, parked agents in
    /// chunks of [`DEFAULT_CHUNK`]; `len` beyond the budgets is an error.
    pub fn new(len: usize, budget: TierBudget) -> Result<TieredPopulation> {
        Self::with_chunk(len, budget, DEFAULT_CHUNK)
    }

    /// As [`new`](Self::new) with parked chunks of `chunk` agents (at least 1): the step
    /// stages two chunks of every field on the device at once.
    pub fn with_chunk(len: usize, budget: TierBudget, chunk: usize) -> Result<TieredPopulation> {
        if chunk == 0 {
            return Err(Error::InvalidArgument(
                "agents: a tiered population's chunk must hold at least one agent".into(),
            ));
        }
        let (gpu, parked) = budget.split(len)?;
        Ok(TieredPopulation {
            budget,
            chunk,
            len,
            gpu: Population::new(gpu),
            parked: empty_chunks(parked, chunk)?,
            staging: None,
        })
    }

    /// How many agents, both tiers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no agents.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Agents on the device (`0 .. gpu_len()` in agent order).
    pub fn gpu_len(&self) -> usize {
        self.gpu.len()
    }

    /// Agents parked on the host (`gpu_len() .. len()`).
    pub fn parked_len(&self) -> usize {
        self.len - self.gpu.len()
    }

    /// The budgets.
    pub fn budget(&self) -> TierBudget {
        self.budget
    }

    /// Parked agents a chunk holds at most (parking agents from the GPU tier and the last
    /// chunk may leave shorter ones; [`set_chunk`](Self::set_chunk) repacks).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// How many parked chunks.
    pub fn chunks(&self) -> usize {
        self.parked.len()
    }

    /// The GPU tier: agents `0 .. gpu_len()` as a [`Population`] (its fields' buffers).
    pub fn gpu(&self) -> &Population {
        &self.gpu
    }

    /// The fields' names and kinds, in the order they were added.
    pub fn fields(&self) -> Vec<(&str, FieldKind)> {
        self.gpu.fields()
    }

    /// Adds field `name` of f32 with one value per agent: the GPU tier's part copied to the
    /// stream's device, the rest into pinned host memory. A wrong length or name is an error
    /// that changes nothing.
    pub fn add_f32(&mut self, stream: &Stream, name: &str, values: &[f32]) -> Result<()> {
        let parked = self.park(stream, name, values, HostData::F32)?;
        let g = self.gpu.len();
        self.gpu.add_f32(stream, name, &values[..g])?;
        self.push_parked(parked);
        Ok(())
    }

    /// Adds field `name` of u32 with one value per agent (as [`add_f32`](Self::add_f32)).
    pub fn add_u32(&mut self, stream: &Stream, name: &str, values: &[u32]) -> Result<()> {
        let parked = self.park(stream, name, values, HostData::U32)?;
        let g = self.gpu.len();
        self.gpu.add_u32(stream, name, &values[..g])?;
        self.push_parked(parked);
        Ok(())
    }

    /// The parked part of a new field's `values`, one pinned block a chunk.
    fn park<T: DType>(
        &self,
        stream: &Stream,
        name: &str,
        values: &[T],
        wrap: fn(PinnedBuf<T>) -> HostData,
    ) -> Result<Vec<HostData>> {
        self.check_len(name, values.len())?;
        let mut at = self.gpu.len();
        let mut out = Vec::with_capacity(self.parked.len());
        for c in &self.parked {
            out.push(wrap(PinnedBuf::from_slice(
                stream.device(),
                &values[at..at + c.len],
            )?));
            at += c.len;
        }
        Ok(out)
    }

    fn push_parked(&mut self, parked: Vec<HostData>) {
        for (c, h) in self.parked.iter_mut().zip(parked) {
            c.fields.push(h);
        }
        self.staging = None;
    }

    fn check_len(&self, name: &str, len: usize) -> Result<()> {
        if len != self.len {
            return Err(Error::InvalidArgument(format!(
                "agents: field `{name}` has {len} values for a population of {} agents",
                self.len
            )));
        }
        Ok(())
    }

    /// Position of field `name` (the GPU tier and every chunk hold the fields in one order).
    fn index(&self, name: &str) -> Result<usize> {
        self.gpu
            .all()
            .position(|(n, _)| n == name)
            .ok_or_else(|| Error::InvalidArgument(format!("agents: no field `{name}`")))
    }

    /// The f32 field `name` of every agent, in agent order (waits for the stream and for
    /// the copies of the parked chunks).
    pub fn f32_to_host(&self, stream: &Stream, name: &str) -> Result<Vec<f32>> {
        match self.column(stream, name)? {
            Column::F32(v) => Ok(v),
            Column::U32(_) => Err(wrong_kind(name, FieldKind::F32)),
        }
    }

    /// The u32 field `name` of every agent, in agent order (as
    /// [`f32_to_host`](Self::f32_to_host)).
    pub fn u32_to_host(&self, stream: &Stream, name: &str) -> Result<Vec<u32>> {
        match self.column(stream, name)? {
            Column::U32(v) => Ok(v),
            Column::F32(_) => Err(wrong_kind(name, FieldKind::U32)),
        }
    }

    fn column(&self, stream: &Stream, name: &str) -> Result<Column> {
        let k = self.index(name)?;
        let mut col = match self.gpu.data(name)? {
            FieldData::F32(b) => {
                let mut v = host_vec::<f32>("agents tiered field", self.len)?;
                v.extend_from_slice(&b.to_host(stream)?);
                Column::F32(v)
            }
            FieldData::U32(b) => {
                let mut v = host_vec::<u32>("agents tiered field", self.len)?;
                v.extend_from_slice(&b.to_host(stream)?);
                Column::U32(v)
            }
        };
        for c in &self.parked {
            match (&mut col, c.fields.get(k)) {
                (Column::F32(v), Some(HostData::F32(h))) => v.extend_from_slice(h.wait_slice()?),
                (Column::U32(v), Some(HostData::U32(h))) => v.extend_from_slice(h.wait_slice()?),
                _ => return Err(inconsistent(name)),
            }
        }
        Ok(col)
    }

    /// Every field, in order, gathered to the host.
    fn columns(&self, stream: &Stream) -> Result<Vec<(String, Column)>> {
        self.fields()
            .into_iter()
            .map(|(n, _)| Ok((n.to_string(), self.column(stream, n)?)))
            .collect()
    }

    /// Replaces both tiers with `columns` (every one of `len` values) laid out under
    /// `budget` in chunks of `chunk`; on an error the population is unchanged.
    fn relayout(
        &mut self,
        stream: &Stream,
        len: usize,
        budget: TierBudget,
        chunk: usize,
        columns: &[(String, Column)],
    ) -> Result<()> {
        let mut next = TieredPopulation::with_chunk(len, budget, chunk)?;
        for (name, col) in columns {
            match col {
                Column::F32(v) => next.add_f32(stream, name, v)?,
                Column::U32(v) => next.add_u32(stream, name, v)?,
            }
        }
        // Kept across a relayout: the staging depends on the fields only (a step grows it
        // when a chunk needs more room).
        next.staging = self.staging.take();
        *self = next;
        Ok(())
    }

    /// Re-chunks the parked agents into chunks of `chunk` (at least 1); the fields make one
    /// trip through host memory.
    pub fn set_chunk(&mut self, stream: &Stream, chunk: usize) -> Result<()> {
        let columns = self.columns(stream)?;
        self.relayout(stream, self.len, self.budget, chunk, &columns)
    }

    /// Birth and death over both tiers, with the meaning of
    /// [`Population::apply_life`]: agents whose u32 field `alive` is 0 are removed, each
    /// agent gets `min(births, max_births)` children (copies) after the survivors (both in
    /// agent order), `alive` becomes 1 and `births` 0. The tiers are then refilled GPU
    /// first. A result beyond the budgets is an error that changes nothing (no agent is
    /// dropped). The fields make one trip through host memory (the parked ones live there).
    pub fn apply_life(
        &mut self,
        stream: &Stream,
        alive: &str,
        births: &str,
        max_births: u32,
    ) -> Result<LifeCounts> {
        if alive == births {
            return Err(Error::InvalidArgument(format!(
                "agents: `{alive}` cannot be both the alive and the births field"
            )));
        }
        let av = self.u32_to_host(stream, alive)?;
        let bv = self.u32_to_host(stream, births)?;
        let survived = av.iter().filter(|&&a| a != 0).count();
        let born = bv
            .iter()
            .try_fold(0usize, |s, &b| s.checked_add(b.min(max_births) as usize));
        let total = born.and_then(|b| survived.checked_add(b)).ok_or_else(|| {
            Error::InvalidArgument("agents: birth and death overflow the agent count".into())
        })?;
        let born = total - survived;
        self.budget.split(total).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!(
                "{m} (birth and death: {survived} survivors + {born} children; nothing changed)"
            )),
            e => e,
        })?;
        let mut src = host_vec::<usize>("agents tiered life", total)?;
        src.extend(
            av.iter()
                .enumerate()
                .filter(|(_, &a)| a != 0)
                .map(|(i, _)| i),
        );
        for (i, &b) in bv.iter().enumerate() {
            src.extend(std::iter::repeat_n(i, b.min(max_births) as usize));
        }
        let mut columns = self.columns(stream)?;
        for (name, col) in &mut columns {
            *col = match col {
                Column::F32(v) => Column::F32(gather(v, &src)?),
                Column::U32(_) if name == alive => Column::U32(filled(total, 1)?),
                Column::U32(_) if name == births => Column::U32(filled(total, 0)?),
                Column::U32(v) => Column::U32(gather(v, &src)?),
            };
            debug_assert_eq!(col.len(), total);
        }
        let (budget, chunk) = (self.budget, self.chunk);
        self.relayout(stream, total, budget, chunk, &columns)?;
        Ok(LifeCounts {
            survived,
            died: av.len() - survived,
            born,
        })
    }
}

/// Chunks of `chunk` agents (the last one shorter) for `parked` agents, no fields yet;
/// more chunks than the host can list is an error.
pub(crate) fn empty_chunks(parked: usize, chunk: usize) -> Result<Vec<Chunk>> {
    let count = parked.div_ceil(chunk);
    let mut out = host_vec::<Chunk>("agents tiered chunks", count)?;
    out.extend((0..count).map(|k| Chunk {
        len: chunk.min(parked - k * chunk),
        fields: Vec::new(),
    }));
    Ok(out)
}

fn gather<T: Copy>(values: &[T], src: &[usize]) -> Result<Vec<T>> {
    let mut out = host_vec::<T>("agents tiered life", src.len())?;
    out.extend(src.iter().map(|&i| values[i]));
    Ok(out)
}

fn filled(len: usize, value: u32) -> Result<Vec<u32>> {
    let mut out = host_vec::<u32>("agents tiered life", len)?;
    out.resize(len, value);
    Ok(out)
}

fn wrong_kind(name: &str, want: FieldKind) -> Error {
    Error::InvalidArgument(format!("agents: field `{name}` is not of kind {want:?}"))
}

/// A chunk whose fields do not match the GPU tier's (cannot happen through the API).
pub(crate) fn inconsistent(name: &str) -> Error {
    Error::InvalidArgument(format!(
        "agents: field `{name}` of a parked chunk does not match the GPU tier's"
    ))
}
