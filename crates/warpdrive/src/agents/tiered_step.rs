//! Stepping a [`TieredPopulation`]: the GPU tier in place, and the parked chunks streamed
//! through device staging — upload, step, download — on two lanes (streams), chunk `k` on
//! lane `k % 2`, so one chunk's copies overlap the other's kernel. The step sees every
//! agent's global index and the whole population's count, as on an untiered population.

use crate::device::{Event, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{host_vec, Buffer, PinnedBuf};

use super::inputs::StepInputs;
use super::population::{FieldData, FieldKind};
use super::step::{HostFields, StepFn};
use super::tiered::{download, inconsistent, upload, Chunk, HostData, TieredPopulation};

/// A tiered population's device staging: two lanes, each a stream and one chunk of every
/// field.
pub(crate) struct Staging {
    lanes: [(Stream, Vec<FieldData>); 2],
    /// Agents each lane's buffers hold.
    cap: usize,
    /// Ordering events, recorded again every step: the caller's stream before the step
    /// (the lanes wait for it), and each lane after its last chunk (the caller waits).
    start: Event,
    done: [Event; 2],
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staging({} fields)", self.lanes[0].1.len())
    }
}

impl Staging {
    /// Two lanes on `stream`'s device with `chunk` agents of each of `fields`.
    fn new(stream: &Stream, fields: &[(&str, FieldKind)], chunk: usize) -> Result<Staging> {
        let lane = || -> Result<(Stream, Vec<FieldData>)> {
            let s = stream.device().new_stream()?;
            let mut bufs = Vec::with_capacity(fields.len());
            for (_, kind) in fields {
                // Allocated in the lane's order, so freeing it waits for the lane's work.
                bufs.push(match kind {
                    FieldKind::F32 => FieldData::F32(Buffer::uninit(&s, chunk)?),
                    FieldKind::U32 => FieldData::U32(Buffer::uninit(&s, chunk)?),
                });
            }
            Ok((s, bufs))
        };
        let device = stream.device();
        Ok(Staging {
            lanes: [lane()?, lane()?],
            cap: chunk,
            start: device.new_sync_event()?,
            done: [device.new_sync_event()?, device.new_sync_event()?],
        })
    }
}

impl StepFn {
    /// Runs the step once over every agent of a [`TieredPopulation`], with the meaning of
    /// [`run_with`](Self::run_with) on the same agents held in one [`Population`]
    /// (`i` is the agent's global index, `n` the whole population's count): the GPU tier in
    /// place, then each parked chunk copied to the device, stepped and copied back, on two
    /// streams so copies overlap kernels; `stream` waits for all of it. The body must touch
    /// only its own agent's fields (a parked agent's neighbours are not on the device; read
    /// other agents through `inputs`). On the CPU backend, the closure over every agent in
    /// order.
    ///
    /// [`Population`]: super::Population
    pub fn run_tiered(
        &self,
        stream: &Stream,
        agents: &mut TieredPopulation,
        inputs: &StepInputs,
        params: &[f32],
    ) -> Result<()> {
        let p = self.params(params)?;
        self.check_fields(stream, &agents.gpu, inputs)?;
        let n = agents.len();
        if n == 0 {
            return Ok(());
        }
        if stream.queue().is_none() {
            return self.run_tiered_cpu(agents, inputs, &p);
        }
        let owned: Vec<(String, FieldKind)> = agents
            .fields()
            .into_iter()
            .map(|(n, k)| (n.to_string(), k))
            .collect();
        let fields: Vec<(&str, FieldKind)> = owned.iter().map(|(n, k)| (n.as_str(), *k)).collect();
        let src = self.kernel(&fields, &inputs.kinds());
        let g = agents.gpu_len();
        // Room for the longest chunk (at most `chunk()` agents, fewer when fewer are parked).
        let need = agents.parked.iter().map(|c| c.len).max().unwrap_or(0);
        if need > 0 && agents.staging.as_ref().is_none_or(|s| s.cap < need) {
            agents.staging = Some(Staging::new(stream, &fields, need)?);
        }
        let TieredPopulation {
            gpu,
            parked,
            staging,
            ..
        } = agents;
        let staging = match staging.as_mut() {
            Some(s) if !parked.is_empty() => {
                // Before the GPU tier's kernel, so the first chunk's upload overlaps it.
                stream.record(&s.start)?;
                Some(s)
            }
            _ => None,
        };
        let tier: Vec<&FieldData> = gpu.all().map(|(_, d)| d).collect();
        self.launch_range(stream, src, (0, g as u64, n as u64), &tier, inputs, p)?;
        let Some(staging) = staging else {
            return Ok(());
        };
        for (lane, _) in &staging.lanes {
            lane.wait(&staging.start)?;
        }
        let mut base = g as u64;
        for (k, c) in parked.iter_mut().enumerate() {
            let (lane, bufs) = &mut staging.lanes[k % 2];
            for ((buf, host), (name, _)) in bufs.iter_mut().zip(&mut c.fields).zip(&fields) {
                upload(lane, buf, 0, host, c.len, name)?;
            }
            let refs: Vec<&FieldData> = bufs.iter().collect();
            self.launch_range(lane, src, (base, c.len as u64, n as u64), &refs, inputs, p)?;
            base += c.len as u64;
            for ((buf, host), (name, _)) in bufs.iter().zip(&mut c.fields).zip(&fields) {
                download(lane, buf, host, c.len, name)?;
            }
        }
        for ((lane, _), done) in staging.lanes.iter().zip(&staging.done) {
            lane.record(done)?;
            stream.wait(done)?;
        }
        Ok(())
    }

    /// The CPU backend: the closure over every agent in order, on host copies of the fields
    /// (the reference a GPU tiered step is checked against), written back to both tiers.
    fn run_tiered_cpu(
        &self,
        agents: &mut TieredPopulation,
        inputs: &StepInputs,
        p: &[f32],
    ) -> Result<()> {
        let n = agents.len();
        let mut f32s: Vec<Vec<f32>> = Vec::new();
        let mut u32s: Vec<Vec<u32>> = Vec::new();
        for (k, (name, d)) in agents.gpu.all().enumerate() {
            match d {
                FieldData::F32(b) => f32s.push(whole(
                    b.host_view()?,
                    &agents.parked,
                    (k, name),
                    n,
                    |h| match h {
                        HostData::F32(h) => Some(h),
                        HostData::U32(_) => None,
                    },
                )?),
                FieldData::U32(b) => u32s.push(whole(
                    b.host_view()?,
                    &agents.parked,
                    (k, name),
                    n,
                    |h| match h {
                        HostData::U32(h) => Some(h),
                        HostData::F32(_) => None,
                    },
                )?),
            }
        }
        let mut host = HostFields {
            f32: f32s.iter_mut().map(Vec::as_mut_slice).collect(),
            u32: u32s.iter_mut().map(Vec::as_mut_slice).collect(),
            inputs_f32: Vec::new(),
            inputs_u32: Vec::new(),
        };
        for (_, d) in inputs.all() {
            match d {
                FieldData::F32(b) => host.inputs_f32.push(b.host_view()?),
                FieldData::U32(b) => host.inputs_u32.push(b.host_view()?),
            }
        }
        let cpu = self.cpu();
        for i in 0..n {
            cpu(i, &mut host, p);
        }
        drop(host);
        let g = agents.gpu_len();
        let (mut f, mut u) = (f32s.into_iter(), u32s.into_iter());
        let names: Vec<String> = agents.gpu.all().map(|(n, _)| n.to_string()).collect();
        for (k, (d, name)) in agents.gpu.all_mut().zip(&names).enumerate() {
            match d {
                FieldData::F32(b) => {
                    let v = f.next().ok_or_else(|| inconsistent(name))?;
                    b.host_view_mut()?.copy_from_slice(&v[..g]);
                    scatter(&v[g..], &mut agents.parked, (k, name), |h| match h {
                        HostData::F32(h) => Some(h),
                        HostData::U32(_) => None,
                    })?;
                }
                FieldData::U32(b) => {
                    let v = u.next().ok_or_else(|| inconsistent(name))?;
                    b.host_view_mut()?.copy_from_slice(&v[..g]);
                    scatter(&v[g..], &mut agents.parked, (k, name), |h| match h {
                        HostData::U32(h) => Some(h),
                        HostData::F32(_) => None,
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// Field `k` of every agent: the GPU tier's values `gpu`, then each parked chunk's.
fn whole<T: DType>(
    gpu: &[T],
    parked: &[Chunk],
    (k, name): (usize, &str),
    n: usize,
    pick: impl Fn(&HostData) -> Option<&PinnedBuf<T>>,
) -> Result<Vec<T>> {
    let mut v = host_vec::<T>("agents tiered step", n)?;
    v.extend_from_slice(gpu);
    for c in parked {
        let h = c
            .fields
            .get(k)
            .and_then(&pick)
            .ok_or_else(|| inconsistent(name))?;
        v.extend_from_slice(h.wait_slice()?);
    }
    Ok(v)
}

/// Writes `values` (the parked agents' field `k`, in order) back into the chunks.
fn scatter<T: DType>(
    values: &[T],
    parked: &mut [Chunk],
    (k, name): (usize, &str),
    pick: impl Fn(&mut HostData) -> Option<&mut PinnedBuf<T>>,
) -> Result<()> {
    let mut at = 0;
    for c in parked {
        let h = c
            .fields
            .get_mut(k)
            .and_then(&pick)
            .ok_or_else(|| inconsistent(name))?;
        h.wait_slice_mut()?.copy_from_slice(&values[at..at + c.len]);
        at += c.len;
    }
    Ok(())
}
