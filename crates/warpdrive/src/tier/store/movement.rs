//! Blocks moving between tiers on their own: promotion to the GPU by one DMA from a pinned
//! block, and eviction down (GPU → host, host → disk, small blocks batched into one write).

use std::time::Instant;

use crate::error::Result;
use crate::memory::{Buffer, PinnedBuf};

use super::super::codec;
use super::{Below, Inner, Tier, TierStore};

/// Blocks under this size that go down to the disk together share one write...
const BATCH_BELOW: usize = 64 << 10;
/// ...of about this many bytes.
const BATCH_BYTES: usize = 1 << 20;

impl TierStore {
    /// Whether the GPU tier could take `key`'s block, judged by the bytes it holds below
    /// (a compressed block's data may still turn out larger).
    pub(super) fn may_fit_gpu(&self, g: &Inner, key: &String) -> bool {
        let below = match (g.host_blocks.get(key), g.index.get(key)) {
            (Some(p), _) => p.len() as u64,
            (None, Some(at)) if at.head.is_some() => at.len,
            (None, Some(at)) => at.len.saturating_sub(codec::HEADER_BYTES as u64),
            (None, None) => return false,
        };
        g.gpu.fits(below)
    }

    /// Puts a block found below the GPU into the GPU tier when it fits there, by one DMA from
    /// its pinned block (the host tier lets its copy go); gives the block back when it does
    /// not fit (nothing moves). A block from the disk is counted as moved disk → GPU in the
    /// time since `since` (its read included); one from the host tier, in its upload's time.
    pub(super) fn promote(
        &self,
        g: &mut Inner,
        key: &String,
        below: Below,
        since: Instant,
    ) -> Result<Option<Below>> {
        let bytes = match &below {
            Below::Disk(p) => p.len() as u64,
            Below::Host => match g.host_blocks.get(key) {
                Some(p) => p.len() as u64,
                None => return Ok(Some(below)),
            },
        };
        if !g.gpu.fits(bytes) {
            return Ok(Some(below));
        }
        // Out of the host tier first, so that making room there cannot evict it; back in
        // if the move fails.
        let from_host_tier = matches!(below, Below::Host);
        let upload_started = Instant::now();
        let mut source = match below {
            Below::Disk(p) => p,
            Below::Host => match g.host_blocks.remove(key) {
                Some(p) => p,
                None => return Ok(Some(Below::Host)),
            },
        };
        let moved = self
            .make_room_on_gpu(g, bytes)
            .and_then(|()| self.upload_pinned(&mut source));
        let buf = match moved {
            Ok(buf) => buf,
            Err(e) => {
                if from_host_tier {
                    g.host_blocks.insert(key.clone(), source);
                }
                return Err(e);
            }
        };
        // The pinned block goes back to its pool, which reuses it once the DMA is done.
        drop(source);
        if from_host_tier {
            g.host.remove(key);
        }
        let (from, took) = match from_host_tier {
            true => (Tier::Host, upload_started.elapsed()),
            false => (Tier::Disk, since.elapsed()),
        };
        g.stats.moves.record(from, Tier::Gpu, bytes, took);
        g.gpu.insert(key.clone(), bytes);
        g.gpu_blocks.insert(key.clone(), buf);
        Ok(None)
    }

    /// A device copy of a pinned block: one DMA on the store's stream, no host copy.
    pub(super) fn upload_pinned(&self, p: &mut PinnedBuf<u8>) -> Result<Buffer<u8>> {
        let mut buf = Buffer::<u8>::uninit(&self.stream, p.len())?;
        buf.copy_from_pinned(&self.stream, p)?;
        Ok(buf)
    }

    /// Moves GPU victims down to the host tier (or the disk) before `incoming` bytes arrive.
    pub(super) fn make_room_on_gpu(&self, g: &mut Inner, incoming: u64) -> Result<()> {
        for (key, bytes) in g.gpu.victims(incoming) {
            let Some(buf) = g.gpu_blocks.remove(&key) else {
                continue;
            };
            g.gpu.remove(&key);
            g.stats.gpu_evictions += 1;
            metrics::counter!("warpdrive_tier_evictions_total", "tier" => "gpu").increment(1);
            if g.host.fits(bytes) {
                self.make_room_on_host(g, bytes)?;
                let since = Instant::now();
                let mut pinned = PinnedBuf::<u8>::new(self.stream.device(), buf.len())?;
                buf.copy_to_pinned(&self.stream, &mut pinned)?;
                g.stats
                    .moves
                    .record(Tier::Gpu, Tier::Host, bytes, since.elapsed());
                g.host.insert(key.clone(), bytes);
                g.host_blocks.insert(key, pinned);
            } else if !g.index.contains_key(&key) {
                let since = Instant::now();
                let data = buf.to_host(&self.stream)?;
                self.write_to_disk(g, &key, &data, false)?;
                g.stats
                    .moves
                    .record(Tier::Gpu, Tier::Disk, bytes, since.elapsed());
            }
        }
        Ok(())
    }

    /// Moves host victims to the disk (unless already there) before `incoming` bytes arrive.
    pub(super) fn make_room_on_host(&self, g: &mut Inner, incoming: u64) -> Result<()> {
        // Victims not on disk yet go down together: small ones gathered into writes of
        // about `BATCH_BYTES`, large ones one write each.
        let mut batch: Vec<(String, PinnedBuf<u8>)> = Vec::new();
        let mut batched = 0;
        for (key, _) in g.host.victims(incoming) {
            let Some(pinned) = g.host_blocks.remove(&key) else {
                continue;
            };
            g.host.remove(&key);
            g.stats.host_evictions += 1;
            metrics::counter!("warpdrive_tier_evictions_total", "tier" => "host").increment(1);
            if g.index.contains_key(&key) {
                continue;
            }
            if pinned.len() >= BATCH_BELOW {
                self.write_batch(g, &mut vec![(key, pinned)])?;
                continue;
            }
            batched += pinned.len();
            batch.push((key, pinned));
            if batched >= BATCH_BYTES {
                self.write_batch(g, &mut batch)?;
                batched = 0;
            }
        }
        self.write_batch(g, &mut batch)
    }

    /// Writes evicted blocks in one I/O and empties `batch`; when the write fails they go
    /// back to the host tier (over its budget for now) rather than being lost.
    pub(super) fn write_batch(
        &self,
        g: &mut Inner,
        batch: &mut Vec<(String, PinnedBuf<u8>)>,
    ) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let since = Instant::now();
        let written = batch
            .iter()
            .map(|(key, p)| Ok((key.as_str(), p.wait_slice()?)))
            .collect::<Result<Vec<_>>>()
            .and_then(|blocks| self.write_many_to_disk(g, &blocks, false));
        match written {
            // The one write's time is shared out by the blocks' bytes.
            Ok(()) => {
                let took = since.elapsed();
                let lens: Vec<u64> = batch.iter().map(|(_, p)| p.len() as u64).collect();
                let total: u64 = lens.iter().sum();
                for len in lens {
                    let share = match total {
                        0 => took,
                        t => took.mul_f64(len as f64 / t as f64),
                    };
                    g.stats.moves.record(Tier::Host, Tier::Disk, len, share);
                }
            }
            Err(_) => {
                for (key, p) in batch.drain(..) {
                    g.host.insert(key.clone(), p.len() as u64);
                    g.host_blocks.insert(key, p);
                }
            }
        }
        batch.clear();
        written
    }
}
