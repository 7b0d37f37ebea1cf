//! Birth and death: after a step marks each agent alive or not and sets how many children it
//! has, the population is rebuilt in one pass per field — survivors first, in order, then
//! each parent's children (copies of the parent) in parent order — by a stream compaction
//! (per-block counts, a scan of the blocks, a block scan that writes each new agent's
//! source) and one gather per field.

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::AGENTS;
use crate::memory::Buffer;
use crate::ops::permute::{exclusive_scan, gather_rows};
use crate::ops::{fill, launch, Args};

use super::population::{FieldData, Population};

/// Agents a block of the life kernels handles (256 threads × 8 consecutive agents).
const TILE: usize = 2048;

/// What [`Population::apply_life`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LifeCounts {
    /// Agents that lived on.
    pub survived: usize,
    /// Agents removed.
    pub died: usize,
    /// Children added.
    pub born: usize,
}

impl Population {
    /// Applies the step's verdicts: agents whose u32 field `alive` is 0 are removed, and each
    /// agent (dead or alive) gets `min(births, max_births)` children, copies of it in every
    /// field, appended after the survivors (survivors keep their order; children follow
    /// their parents' order). Afterwards `alive` is 1 and `births` 0 for every agent. Waits
    /// for the stream (the new size is read back). The new population must stay below 2³²
    /// agents: `len · (1 + max_births)` above that is an error before anything runs.
    pub fn apply_life(
        &mut self,
        stream: &Stream,
        alive: &str,
        births: &str,
        max_births: u32,
    ) -> Result<LifeCounts> {
        let n = self.len();
        let fits = (n as u64)
            .checked_mul(1 + u64::from(max_births))
            .is_some_and(|m| m <= u64::from(u32::MAX));
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "agents: {n} agents with up to {max_births} children each may exceed 2^32 - 1"
            )));
        }
        if alive == births {
            return Err(Error::InvalidArgument(format!(
                "agents: `{alive}` cannot be both the alive and the births field"
            )));
        }
        let (alive_buf, births_buf) = (self.u32(alive)?, self.u32(births)?);
        alive_buf.check_stream(stream, "agents apply_life")?;
        births_buf.check_stream(stream, "agents apply_life")?;
        if n == 0 {
            return Ok(LifeCounts {
                survived: 0,
                died: 0,
                born: 0,
            });
        }
        let blocks = n.div_ceil(TILE);
        let mut block_alive = Buffer::<u32>::uninit(stream, blocks)?;
        let mut block_births = Buffer::<u32>::uninit(stream, blocks)?;
        stream.run(
            (&mut block_alive, &mut block_births),
            |(ba, bb)| {
                let (av, bv) = (alive_buf.host_view()?, births_buf.host_view()?);
                for (b, (sa, sb)) in ba
                    .host_view_mut()?
                    .iter_mut()
                    .zip(bb.host_view_mut()?.iter_mut())
                    .enumerate()
                {
                    let tile = b * TILE..((b + 1) * TILE).min(n);
                    *sa = av[tile.clone()].iter().filter(|&&v| v != 0).count() as u32;
                    *sb = bv[tile].iter().map(|&v| v.min(max_births)).sum();
                }
                Ok(())
            },
            |(ba, bb), q| {
                let args = Args::new()
                    .buf(alive_buf)
                    .buf(births_buf)
                    .u64(n as u64)
                    .u32(max_births)
                    .buf(ba)
                    .buf(bb);
                // SAFETY: agents_life_count(const u32* alive, const u32* births, u64 n, u32
                // max_births, u32* block_alive, u32* block_births), blocks of 256 over tiles
                // of TILE: alive and births hold n (the population's fields), the outputs one
                // word per block.
                unsafe {
                    launch(
                        q,
                        (&AGENTS, "agents_life_count"),
                        blocks as u32,
                        256,
                        0,
                        args,
                    )
                }
            },
        )?;
        let mut alive_base = Buffer::<u32>::uninit(stream, blocks + 1)?;
        let mut births_base = Buffer::<u32>::uninit(stream, blocks + 1)?;
        exclusive_scan(stream, &block_alive, &mut alive_base)?;
        exclusive_scan(stream, &block_births, &mut births_base)?;
        let survived = alive_base.to_host(stream)?[blocks] as usize;
        let born = births_base.to_host(stream)?[blocks] as usize;
        let total = survived + born;
        let mut src = Buffer::<u32>::uninit(stream, total)?;
        stream.run(
            &mut src,
            |src| {
                let (av, bv) = (alive_buf.host_view()?, births_buf.host_view()?);
                let out = src.host_view_mut()?;
                let mut at = 0;
                for (i, &a) in av.iter().enumerate() {
                    if a != 0 {
                        out[at] = i as u32;
                        at += 1;
                    }
                }
                for (i, &b) in bv.iter().enumerate() {
                    for _ in 0..b.min(max_births) {
                        out[at] = i as u32;
                        at += 1;
                    }
                }
                Ok(())
            },
            |src, q| {
                let args = Args::new()
                    .buf(alive_buf)
                    .buf(births_buf)
                    .u64(n as u64)
                    .u32(max_births)
                    .buf(&alive_base)
                    .buf(&births_base)
                    .buf(src);
                // SAFETY: agents_life_plan(alive, births, n, max_births, const u32*
                // alive_base, const u32* births_base, u32* src), the same grid as the count:
                // the bases hold blocks + 1 words, the scans of that grid's counts, so every
                // index written is below survived + born = src.len().
                unsafe {
                    launch(
                        q,
                        (&AGENTS, "agents_life_plan"),
                        blocks as u32,
                        256,
                        0,
                        args,
                    )
                }
            },
        )?;
        for field in self.all_mut() {
            match field {
                FieldData::F32(b) => {
                    let mut out = Buffer::<f32>::uninit(stream, total)?;
                    gather_rows(stream, b, 1, &src, &mut out)?;
                    *b = out;
                }
                FieldData::U32(b) => {
                    let mut out = Buffer::<u32>::uninit(stream, total)?;
                    gather_rows(stream, b, 1, &src, &mut out)?;
                    *b = out;
                }
            }
        }
        self.set_len(total);
        fill(stream, self.u32_mut(alive)?, 1)?;
        fill(stream, self.u32_mut(births)?, 0)?;
        Ok(LifeCounts {
            survived,
            died: n - survived,
            born,
        })
    }
}
