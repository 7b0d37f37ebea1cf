//! A population: agents whose state is a set of named, typed fields, each one device buffer
//! (structure of arrays: field `k` of agent `i` is element `i` of buffer `k`).

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::Buffer;

/// Names a step function's CUDA C already uses (its agent index, count and constants).
const RESERVED: &[&str] = &[
    "i", "n", "p", "t", "stride", "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7",
];

/// The element type of a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// `float` in CUDA C, `f32` in Rust.
    F32,
    /// `unsigned int` (`u32`) in CUDA C, `u32` in Rust.
    U32,
}

/// One field's buffer.
#[derive(Debug)]
pub(crate) enum FieldData {
    F32(Buffer<f32>),
    U32(Buffer<u32>),
}

impl FieldData {
    pub(crate) fn kind(&self) -> FieldKind {
        match self {
            FieldData::F32(_) => FieldKind::F32,
            FieldData::U32(_) => FieldKind::U32,
        }
    }

    pub(crate) fn device_ptr(&self) -> u64 {
        match self {
            FieldData::F32(b) => b.device_ptr(),
            FieldData::U32(b) => b.device_ptr(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            FieldData::F32(b) => b.len(),
            FieldData::U32(b) => b.len(),
        }
    }

    pub(crate) fn check_stream(&self, stream: &Stream, op: &'static str) -> Result<()> {
        match self {
            FieldData::F32(b) => b.check_stream(stream, op),
            FieldData::U32(b) => b.check_stream(stream, op),
        }
    }
}

/// Agents as structure-of-arrays fields on one device (CPU or CUDA).
///
/// ```
/// use warpdrive::agents::Population;
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let mut agents = Population::new(3);
/// agents.add_f32(&stream, "x", &[0.5, 1.5, 2.5])?;
/// agents.add_u32(&stream, "vote", &[1, 0, 1])?;
/// assert_eq!(agents.f32_to_host(&stream, "x")?, [0.5, 1.5, 2.5]);
/// // A field of the wrong length is an error, not a panic.
/// assert!(agents.add_f32(&stream, "y", &[1.0]).is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Population {
    len: usize,
    fields: Vec<(String, FieldData)>,
}

impl Population {
    /// An empty population of `len` agents (no fields yet).
    pub fn new(len: usize) -> Population {
        Population {
            len,
            fields: Vec::new(),
        }
    }

    /// How many agents.
    pub fn len(&self) -> usize {
        self.len
    }

    /// After birth and death, when every field has been rebuilt to `len` agents.
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Whether there are no agents.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fields' names and kinds, in the order they were added.
    pub fn fields(&self) -> Vec<(&str, FieldKind)> {
        self.fields
            .iter()
            .map(|(n, d)| (n.as_str(), d.kind()))
            .collect()
    }

    fn check_new(&self, name: &str, len: usize) -> Result<()> {
        check_name(name)?;
        if self.fields.iter().any(|(n, _)| n == name) {
            return Err(Error::InvalidArgument(format!(
                "agents: the population already has a field `{name}`"
            )));
        }
        if len != self.len {
            return Err(Error::InvalidArgument(format!(
                "agents: field `{name}` has {len} values for a population of {} agents",
                self.len
            )));
        }
        Ok(())
    }

    /// Adds field `name` of f32 with one value per agent, copied to the stream's device.
    pub fn add_f32(&mut self, stream: &Stream, name: &str, values: &[f32]) -> Result<()> {
        self.check_new(name, values.len())?;
        let buf = Buffer::from_host(stream, values)?;
        self.fields.push((name.to_string(), FieldData::F32(buf)));
        Ok(())
    }

    /// Adds field `name` of u32 with one value per agent, copied to the stream's device.
    pub fn add_u32(&mut self, stream: &Stream, name: &str, values: &[u32]) -> Result<()> {
        self.check_new(name, values.len())?;
        let buf = Buffer::from_host(stream, values)?;
        self.fields.push((name.to_string(), FieldData::U32(buf)));
        Ok(())
    }

    pub(crate) fn data(&self, name: &str) -> Result<&FieldData> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, d)| d)
            .ok_or_else(|| Error::InvalidArgument(format!("agents: no field `{name}`")))
    }

    pub(crate) fn data_mut(&mut self, name: &str) -> Result<&mut FieldData> {
        self.fields
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, d)| d)
            .ok_or_else(|| Error::InvalidArgument(format!("agents: no field `{name}`")))
    }

    /// The f32 field `name`'s buffer.
    pub fn f32(&self, name: &str) -> Result<&Buffer<f32>> {
        match self.data(name)? {
            FieldData::F32(b) => Ok(b),
            FieldData::U32(_) => Err(wrong_kind(name, FieldKind::F32)),
        }
    }

    /// The f32 field `name`'s buffer, to write.
    pub fn f32_mut(&mut self, name: &str) -> Result<&mut Buffer<f32>> {
        match self.data_mut(name)? {
            FieldData::F32(b) => Ok(b),
            FieldData::U32(_) => Err(wrong_kind(name, FieldKind::F32)),
        }
    }

    /// The u32 field `name`'s buffer.
    pub fn u32(&self, name: &str) -> Result<&Buffer<u32>> {
        match self.data(name)? {
            FieldData::U32(b) => Ok(b),
            FieldData::F32(_) => Err(wrong_kind(name, FieldKind::U32)),
        }
    }

    /// The u32 field `name`'s buffer, to write.
    pub fn u32_mut(&mut self, name: &str) -> Result<&mut Buffer<u32>> {
        match self.data_mut(name)? {
            FieldData::U32(b) => Ok(b),
            FieldData::F32(_) => Err(wrong_kind(name, FieldKind::U32)),
        }
    }

    /// The f32 field `name` copied to the host (waits for the stream).
    pub fn f32_to_host(&self, stream: &Stream, name: &str) -> Result<Vec<f32>> {
        self.f32(name)?.to_host(stream)
    }

    /// The u32 field `name` copied to the host (waits for the stream).
    pub fn u32_to_host(&self, stream: &Stream, name: &str) -> Result<Vec<u32>> {
        self.u32(name)?.to_host(stream)
    }

    /// Every field's buffer, in order (the step kernels take them in this order).
    pub(crate) fn all_mut(&mut self) -> impl Iterator<Item = &mut FieldData> {
        self.fields.iter_mut().map(|(_, d)| d)
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, &FieldData)> {
        self.fields.iter().map(|(n, d)| (n.as_str(), d))
    }
}

/// A field's or a step input's name: a C identifier the step kernels do not use already.
pub(crate) fn check_name(name: &str) -> Result<()> {
    let starts_well = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !starts_well || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(Error::InvalidArgument(format!(
            "agents: field name `{name}` must be a C identifier (ASCII letters, digits and \
             `_`, not starting with a digit)"
        )));
    }
    if RESERVED.contains(&name) {
        return Err(Error::InvalidArgument(format!(
            "agents: field name `{name}` is taken by the step kernels ({})",
            RESERVED.join(", ")
        )));
    }
    Ok(())
}

fn wrong_kind(name: &str, want: FieldKind) -> Error {
    Error::InvalidArgument(format!("agents: field `{name}` is not of kind {want:?}"))
}
