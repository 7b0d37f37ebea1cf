//! Parking and unparking: moving agents between a [`TieredPopulation`]'s tiers when its
//! budget changes, copying only the agents that move (the GPU tier's last agents down to
//! new pinned chunks, or the first parked agents up), in agent order, on the stream.

use crate::device::Stream;
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{Buffer, PinnedBuf};

use super::population::FieldData;
use super::tiered::{
    empty_chunks, inconsistent, upload, Chunk, HostData, TierBudget, TieredPopulation,
};

impl TieredPopulation {
    /// Moves agents between the tiers so that the GPU tier holds `min(len, gpu_agents)` of
    /// them under the new `budget`, agent order kept: parking the GPU tier's last agents
    /// (copied down into new pinned chunks placed before the parked ones) or unparking the
    /// first parked ones (copied up; a chunk taken in part keeps its tail). Only the agents
    /// that move cross PCIe, enqueued on `stream`. A population beyond the new budget is an
    /// error naming the excess and changes nothing.
    pub fn set_budget(&mut self, stream: &Stream, budget: TierBudget) -> Result<()> {
        let (target, _) = budget.split(self.len())?;
        let g = self.gpu_len();
        if target < g {
            self.park_last(stream, g - target)?;
        } else if target > g {
            self.unpark_first(stream, target - g)?;
        }
        self.budget = budget;
        Ok(())
    }

    /// Moves the GPU tier's last `m` agents to the front of the parked tier.
    fn park_last(&mut self, stream: &Stream, m: usize) -> Result<()> {
        let keep = self.gpu_len() - m;
        let mut moved = empty_chunks(m, self.chunk())?;
        let mut kept = Vec::new();
        for (_, d) in self.gpu.all() {
            let mut at = keep;
            kept.push(match d {
                FieldData::F32(b) => {
                    for c in &mut moved {
                        c.fields.push(HostData::F32(down(stream, b, at, c.len)?));
                        at += c.len;
                    }
                    FieldData::F32(prefix(stream, b, keep)?)
                }
                FieldData::U32(b) => {
                    for c in &mut moved {
                        c.fields.push(HostData::U32(down(stream, b, at, c.len)?));
                        at += c.len;
                    }
                    FieldData::U32(prefix(stream, b, keep)?)
                }
            });
        }
        self.replace_gpu(stream, kept, keep)?;
        moved.append(&mut self.parked);
        self.parked = moved;
        Ok(())
    }

    /// Moves the first `m` parked agents to the end of the GPU tier.
    fn unpark_first(&mut self, stream: &Stream, m: usize) -> Result<()> {
        let g = self.gpu_len();
        // The chunks wholly taken, and the one taken in part (its index and agents taken).
        let (mut whole, mut left) = (0, m);
        while let Some(c) = self.parked.get(whole).filter(|c| left >= c.len && left > 0) {
            left -= c.len;
            whole += 1;
        }
        // The part-taken chunk's tail, copied on the host before its block is used.
        let tail = match left {
            0 => None,
            _ => Some(self.tail_of(whole, left)?),
        };
        let names: Vec<String> = self.gpu.all().map(|(n, _)| n.to_string()).collect();
        let mut grown = Vec::with_capacity(names.len());
        for (k, ((_, d), name)) in self.gpu.all().zip(&names).enumerate() {
            let taken = self.parked.iter_mut().take(whole + usize::from(left > 0));
            let mut out = match d {
                FieldData::F32(b) => FieldData::F32(grow(stream, b, g + m)?),
                FieldData::U32(b) => FieldData::U32(grow(stream, b, g + m)?),
            };
            let mut at = g;
            for c in taken {
                let n = c.len.min(g + m - at);
                let host = c.fields.get_mut(k).ok_or_else(|| inconsistent(name))?;
                upload(stream, &mut out, at, host, n, name)?;
                at += n;
            }
            grown.push(out);
        }
        self.replace_gpu(stream, grown, g + m)?;
        // Dropped blocks go back to the pinned pool once the copies above have run.
        let rest = self.parked.split_off(whole + usize::from(left > 0));
        self.parked = tail.into_iter().chain(rest).collect();
        Ok(())
    }

    /// Chunk `c`'s agents from `from` on, in new pinned blocks.
    fn tail_of(&self, c: usize, from: usize) -> Result<Chunk> {
        let chunk = &self.parked[c];
        let mut fields = Vec::with_capacity(chunk.fields.len());
        for h in &chunk.fields {
            let device = match h {
                HostData::F32(b) => b.device(),
                HostData::U32(b) => b.device(),
            };
            fields.push(match h {
                HostData::F32(b) => {
                    HostData::F32(PinnedBuf::from_slice(device, &b.wait_slice()?[from..])?)
                }
                HostData::U32(b) => {
                    HostData::U32(PinnedBuf::from_slice(device, &b.wait_slice()?[from..])?)
                }
            });
        }
        Ok(Chunk {
            len: chunk.len - from,
            fields,
        })
    }

    /// Makes `fields` (in order, `len` agents each) the GPU tier; the old buffers, read by
    /// copies just enqueued on `stream`, are freed in its order.
    fn replace_gpu(&mut self, stream: &Stream, fields: Vec<FieldData>, len: usize) -> Result<()> {
        for (old, new) in self.gpu.all_mut().zip(fields) {
            match old {
                FieldData::F32(b) => b.record_stream(stream)?,
                FieldData::U32(b) => b.record_stream(stream)?,
            }
            *old = new;
        }
        self.gpu.set_len(len);
        Ok(())
    }
}

/// `len` agents of `b` from `at`, copied down into a new pinned block on `stream`.
fn down<T: DType>(stream: &Stream, b: &Buffer<T>, at: usize, len: usize) -> Result<PinnedBuf<T>> {
    let mut h = PinnedBuf::new(stream.device(), len)?;
    b.copy_to_pinned_at(stream, at, &mut h, len)?;
    Ok(h)
}

/// A new buffer of `b`'s first `len` elements (a device copy on `stream`).
fn prefix<T: DType>(stream: &Stream, b: &Buffer<T>, len: usize) -> Result<Buffer<T>> {
    let mut out = Buffer::uninit(stream, len)?;
    out.copy_rows_from(stream, (0, 0), (b, 0, 0), len, 1)?;
    Ok(out)
}

/// A new buffer of `len` elements starting with `b`'s (the rest written by the caller).
fn grow<T: DType>(stream: &Stream, b: &Buffer<T>, len: usize) -> Result<Buffer<T>> {
    let mut out = Buffer::uninit(stream, len)?;
    out.copy_rows_from(stream, (0, 0), (b, 0, 0), b.len(), 1)?;
    Ok(out)
}
