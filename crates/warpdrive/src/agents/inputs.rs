//! What a step reads besides its own population's fields: brute-force messages (a snapshot
//! of fields every agent may read), a graph's edges (each agent reads its neighbours), or
//! any read-only array. Each input is one device buffer that the step's CUDA C sees as a
//! `const` pointer named as the input, with its length as `<name>_len`.

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::Buffer;

use super::population::{check_name, FieldData, FieldKind, Population};

/// Read-only arrays for [`StepFn::run_with`](super::StepFn::run_with).
///
/// ```
/// use warpdrive::agents::{Population, StepFn, StepInputs};
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let mut agents = Population::new(3);
/// agents.add_f32(&stream, "v", &[1.0, 2.0, 4.0])?;
/// agents.add_f32(&stream, "sum", &[0.0; 3])?;
/// // Agent i adds the values of its graph neighbours (edges 0→1, 0→2, 2→0).
/// let mut inputs = StepInputs::new();
/// inputs.messages(&stream, &agents, &["v"])?;
/// inputs.edges(&stream, 3, &[(0, 1), (0, 2), (2, 0)])?;
/// let gather = StepFn::new(
///     "neighbours",
///     "float s = 0.0f; for (u32 e = edge_start[i]; e < edge_start[i + 1]; ++e) \
///      s += msg_v[edge_to[e]]; sum[i] = s;",
///     |i, f, _| {
///         let (start, to, v) = (f.inputs_u32[0], f.inputs_u32[1], f.inputs_f32[0]);
///         f.f32[1][i] = (start[i]..start[i + 1]).map(|e| v[to[e as usize] as usize]).sum();
///     },
/// );
/// gather.run_with(&stream, &mut agents, &inputs, &[])?;
/// assert_eq!(agents.f32_to_host(&stream, "sum")?, [6.0, 0.0, 1.0]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct StepInputs {
    arrays: Vec<(String, FieldData)>,
}

impl StepInputs {
    /// No inputs yet.
    pub fn new() -> StepInputs {
        StepInputs::default()
    }

    /// The inputs' names and kinds, in the order added.
    pub fn kinds(&self) -> Vec<(&str, FieldKind)> {
        self.arrays
            .iter()
            .map(|(n, d)| (n.as_str(), d.kind()))
            .collect()
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, &FieldData)> {
        self.arrays.iter().map(|(n, d)| (n.as_str(), d))
    }

    fn push(&mut self, name: &str, data: FieldData) -> Result<()> {
        check_name(name)?;
        if self.arrays.iter().any(|(n, _)| n == name) {
            return Err(Error::InvalidArgument(format!(
                "agents: the step inputs already have `{name}`"
            )));
        }
        self.arrays.push((name.to_string(), data));
        Ok(())
    }

    /// Adds the f32 array `name` (copied to the stream's device).
    pub fn add_f32(&mut self, stream: &Stream, name: &str, values: &[f32]) -> Result<()> {
        self.push(name, FieldData::F32(Buffer::from_host(stream, values)?))
    }

    /// Adds the u32 array `name` (copied to the stream's device).
    pub fn add_u32(&mut self, stream: &Stream, name: &str, values: &[u32]) -> Result<()> {
        self.push(name, FieldData::U32(Buffer::from_host(stream, values)?))
    }

    /// Brute-force messages: a copy (on the device, in stream order) of `agents`' fields
    /// `fields`, as inputs named `msg_<field>`: a step reads every agent's message from the
    /// state before the step, whatever the step writes meanwhile. Call it again to take a
    /// newer snapshot (the copies are replaced).
    pub fn messages(
        &mut self,
        stream: &Stream,
        agents: &Population,
        fields: &[&str],
    ) -> Result<()> {
        for field in fields {
            let name = format!("msg_{field}");
            let copy = match agents.data(field)? {
                FieldData::F32(b) => {
                    let mut c = Buffer::<f32>::uninit(stream, b.len())?;
                    crate::ops::copy(stream, b, &mut c)?;
                    FieldData::F32(c)
                }
                FieldData::U32(b) => {
                    let mut c = Buffer::<u32>::uninit(stream, b.len())?;
                    crate::ops::copy(stream, b, &mut c)?;
                    FieldData::U32(c)
                }
            };
            match self.arrays.iter_mut().find(|(n, _)| *n == name) {
                Some((_, d)) if d.kind() == copy.kind() => *d = copy,
                Some(_) => {
                    return Err(Error::InvalidArgument(format!(
                        "agents: input `{name}` exists with another kind"
                    )))
                }
                None => self.push(&name, copy)?,
            }
        }
        Ok(())
    }

    /// A graph over `agents` agents from directed `(from, to)` edges, as the inputs
    /// `edge_start` (`agents + 1` u32: agent `i`'s edges are `edge_start[i]..edge_start[i +
    /// 1]`) and `edge_to` (u32, each edge's target), edges of one agent in the order given.
    /// An endpoint outside `0..agents` or more than 2³² − 1 edges is an error.
    pub fn edges(&mut self, stream: &Stream, agents: usize, edges: &[(u32, u32)]) -> Result<()> {
        if u32::try_from(edges.len()).is_err() {
            return Err(Error::InvalidArgument(format!(
                "agents: {} edges, at most 2^32 - 1",
                edges.len()
            )));
        }
        if let Some((a, b)) = edges
            .iter()
            .find(|(a, b)| *a as usize >= agents || *b as usize >= agents)
        {
            return Err(Error::InvalidArgument(format!(
                "agents: edge ({a}, {b}) leaves a graph of {agents} agents"
            )));
        }
        let mut start = crate::memory::host_vec::<u32>("agents edge_start", agents + 1)?;
        start.resize(agents + 1, 0);
        for &(a, _) in edges {
            start[a as usize + 1] += 1;
        }
        for k in 0..agents {
            start[k + 1] += start[k];
        }
        let mut next = start.clone();
        let mut to = crate::memory::host_vec::<u32>("agents edge_to", edges.len())?;
        to.resize(edges.len(), 0);
        for &(a, b) in edges {
            let slot = &mut next[a as usize];
            to[*slot as usize] = b;
            *slot += 1;
        }
        self.add_u32(stream, "edge_start", &start)?;
        self.add_u32(stream, "edge_to", &to)
    }
}
