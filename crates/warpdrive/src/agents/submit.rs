//! Job submission: a population made from host fields, its step loaded, uploaded and run
//! once — one call, with the time of each stage.

use std::time::{Duration, Instant};

use crate::device::Stream;
use crate::error::{Error, Result};

use super::population::{FieldKind, Population};
use super::step::StepFn;

/// One field's starting values on the host.
#[derive(Debug, Clone, Copy)]
pub enum HostField<'a> {
    /// An f32 field.
    F32(&'a [f32]),
    /// A u32 field.
    U32(&'a [u32]),
}

/// Where a [`submit`] spent its time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SubmitTimes {
    /// Loading the step's kernel: the cached cubin, or NVRTC on a cold cache (nothing once
    /// this process has loaded it).
    pub load: Duration,
    /// Uploading the fields.
    pub upload: Duration,
    /// The first step, until the stream has finished it.
    pub first_step: Duration,
    /// The whole call.
    pub total: Duration,
}

/// A submitted job: its population after the first step, and the times.
#[derive(Debug)]
pub struct Submission {
    pub population: Population,
    pub times: SubmitTimes,
}

/// Makes a population of `len` agents from `fields` (each `len` values; names and kinds as
/// [`Population::add_f32`] / [`Population::add_u32`] check them), loads `step` for it,
/// uploads it and runs the step once with `params`, waiting for the stream: a job from
/// nothing to its first step, timed by stage.
///
/// ```
/// use warpdrive::agents::{submit, HostField, StepFn};
/// use warpdrive::Device;
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let step = StepFn::new("grow", "x[i] *= p[0];", |i, f, p| f.f32[0][i] *= p[0]);
/// let job = submit(&stream, 2, &[("x", HostField::F32(&[1.0, 2.0]))], &step, &[3.0])?;
/// assert_eq!(job.population.f32_to_host(&stream, "x")?, [3.0, 6.0]);
/// assert!(job.times.total >= job.times.first_step);
/// # Ok(())
/// # }
/// ```
pub fn submit(
    stream: &Stream,
    len: usize,
    fields: &[(&str, HostField<'_>)],
    step: &StepFn,
    params: &[f32],
) -> Result<Submission> {
    let start = Instant::now();
    // Lengths first: a wrong one is the caller's error, found before any compile.
    for (name, f) in fields {
        let got = match f {
            HostField::F32(v) => v.len(),
            HostField::U32(v) => v.len(),
        };
        if got != len {
            return Err(Error::InvalidArgument(format!(
                "agents: field `{name}` has {got} values for a job of {len} agents"
            )));
        }
    }
    let kinds: Vec<(&str, FieldKind)> = fields
        .iter()
        .map(|(name, f)| {
            let kind = match f {
                HostField::F32(_) => FieldKind::F32,
                HostField::U32(_) => FieldKind::U32,
            };
            (*name, kind)
        })
        .collect();
    step.load(stream, &kinds)?;
    let loaded = Instant::now();
    let mut population = Population::new(len);
    for (name, f) in fields {
        match f {
            HostField::F32(v) => population.add_f32(stream, name, v)?,
            HostField::U32(v) => population.add_u32(stream, name, v)?,
        }
    }
    stream.synchronize()?;
    let uploaded = Instant::now();
    step.run(stream, &mut population, params)?;
    stream.synchronize()?;
    let done = Instant::now();
    Ok(Submission {
        population,
        times: SubmitTimes {
            load: loaded - start,
            upload: uploaded - loaded,
            first_step: done - uploaded,
            total: done - start,
        },
    })
}
