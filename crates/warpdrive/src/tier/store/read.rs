//! Gets: a block found in the highest tier that holds it, promoted to the GPU on the way,
//! into a device buffer, a new host `Vec` or the caller's slice.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops;
use crate::transfer;

use super::super::codec;
use super::{check_key, Below, Inner, Tier, TierStore};

impl TierStore {
    /// The block under `key` on the stream's device, promoted to the GPU tier when it came
    /// from below.
    pub fn get(&self, key: &str) -> Result<Buffer<u8>> {
        check_key(key)?;
        let key = key.to_string();
        let mut g = self.inner.lock();
        let loaded = match g.gpu_blocks.contains_key(&key) {
            true => {
                self.gpu_hit(&mut g, &key);
                None
            }
            false => {
                let since = Instant::now();
                let below = self.find_below_gpu(&mut g, &key)?;
                self.promote(&mut g, &key, below, since)?
            }
        };
        // From the GPU tier's block when it holds one (a block promoted just now crossed the
        // link once); else (too large for the tier) the one upload is the caller's copy.
        let out = match (g.gpu_blocks.get(&key), loaded) {
            (Some(src), _) => {
                let mut out = Buffer::<u8>::uninit(&self.stream, src.len())?;
                ops::copy(&self.stream, src, &mut out)?;
                out
            }
            (None, Some(Below::Disk(mut p))) => self.upload_pinned(&mut p)?,
            (None, Some(Below::Host)) => match g.host_blocks.get_mut(&key) {
                Some(p) => self.upload_pinned(p)?,
                None => return Err(Error::NotFound { key }),
            },
            (None, None) => return Err(Error::NotFound { key }),
        };
        self.prefetch_after(&mut g, &key)?;
        Ok(out)
    }

    /// The block under `key` in host memory.
    pub fn get_host(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key)?;
        let key = key.to_string();
        let mut g = self.inner.lock();
        let data = match g.gpu_blocks.get(&key) {
            Some(src) => {
                let data = src.to_host(&self.stream)?;
                self.gpu_hit(&mut g, &key);
                data
            }
            None if !g.host_blocks.contains_key(&key) && !self.may_fit_gpu(&g, &key) => {
                // Straight into the caller's Vec: the GPU tier could not take it anyway.
                let since = Instant::now();
                let fresh = transfer::fresh_landing;
                let streamed =
                    self.read_disk_streamed(&mut g, &key, fresh, |v| Ok(v.as_mut_slice()));
                if let Some(data) = streamed? {
                    g.stats.moves.record(
                        Tier::Disk,
                        Tier::Host,
                        data.len() as u64,
                        since.elapsed(),
                    );
                    self.prefetch_after(&mut g, &key)?;
                    return Ok(data);
                }
                let data = self.read_disk(&mut g, &key, |h, p| codec::decode_parts(h, p, &key))?;
                g.stats
                    .moves
                    .record(Tier::Disk, Tier::Host, data.len() as u64, since.elapsed());
                data
            }
            None => {
                let since = Instant::now();
                let below = self.find_below_gpu(&mut g, &key)?;
                let data = match (&below, g.host_blocks.get(&key)) {
                    (Below::Disk(p), _) | (Below::Host, Some(p)) => {
                        transfer::fresh_copy(self.stream.device(), p.wait_slice()?)?
                    }
                    (Below::Host, None) => return Err(Error::NotFound { key }),
                };
                self.promote(&mut g, &key, below, since)?;
                data
            }
        };
        self.prefetch_after(&mut g, &key)?;
        Ok(data)
    }

    /// As [`get_host`](Self::get_host) into `out`, which must be exactly the block's length
    /// (`LengthMismatch` otherwise): a block read from the disk lands in `out` itself,
    /// checksum verified, with no new memory (whose page faults cost a large read more than
    /// its copy: bench/NOTES.md). After an error `out` holds no block's bytes: a block that
    /// fails its checksum, or whose read failed partway, is zeroed out of it.
    pub fn get_host_into(&self, key: &str, out: &mut [u8]) -> Result<()> {
        check_key(key)?;
        let key = key.to_string();
        let want = out.len();
        let fits = |len: usize| match len == want {
            true => Ok(()),
            false => Err(Error::LengthMismatch {
                op: "TierStore::get_host_into",
                left: want,
                right: len,
            }),
        };
        let mut g = self.inner.lock();
        crate::tier::disk::stamp::mark("get: key, lock");
        if let Some(src) = g.gpu_blocks.get(&key) {
            fits(src.len())?;
            src.copy_to_host(&self.stream, out)?;
            self.gpu_hit(&mut g, &key);
        } else if !g.host_blocks.contains_key(&key) && !self.may_fit_gpu(&g, &key) {
            let since = Instant::now();
            crate::tier::disk::stamp::mark("get: tier checks");
            let landed = self.land_from_disk(&mut g, &key, out, &fits);
            crate::tier::disk::stamp::mark("get: return");
            // A failed checksum, or an I/O error after some pieces landed in place: bytes
            // never verified. Errors raised before any byte lands leave `out` as it was.
            if let Err(e) = &landed {
                if !matches!(e, Error::LengthMismatch { .. } | Error::NotFound { .. }) {
                    out.fill(0);
                }
            }
            landed?;
            g.stats
                .moves
                .record(Tier::Disk, Tier::Host, want as u64, since.elapsed());
        } else {
            let since = Instant::now();
            let below = self.find_below_gpu(&mut g, &key)?;
            match (&below, g.host_blocks.get(&key)) {
                (Below::Disk(p), _) | (Below::Host, Some(p)) => {
                    let data = p.wait_slice()?;
                    fits(data.len())?;
                    out.copy_from_slice(data);
                }
                (Below::Host, None) => return Err(Error::NotFound { key }),
            }
            self.promote(&mut g, &key, below, since)?;
        }
        crate::tier::disk::stamp::mark("get: move stats");
        self.prefetch_after(&mut g, &key)
    }

    /// `key`'s block read from the disk into `out` (its length checked by `fits`): landed
    /// piece by piece when large and plain, else read whole and decoded into it.
    fn land_from_disk(
        &self,
        g: &mut Inner,
        key: &String,
        out: &mut [u8],
        fits: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        if self.read_disk_in_place(g, key, fits, out)? {
            return Ok(());
        }
        let streamed = self
            .read_disk_streamed(
                g,
                key,
                |len| fits(len).map(|()| &mut *out),
                |o| Ok(&mut **o),
            )?
            .is_some();
        if streamed {
            return Ok(());
        }
        self.read_disk(g, key, move |header, payload| {
            let make = move |len| fits(len).map(|()| out);
            codec::decode_parts_into(header, payload, key, make, |o| Ok(&mut **o)).map(drop)
        })
    }

    pub(super) fn gpu_hit(&self, g: &mut Inner, key: &String) {
        g.gpu.touch(key);
        g.stats.gpu_hits += 1;
        metrics::counter!("warpdrive_tier_hits_total", "tier" => "gpu").increment(1);
        if g.prefetched.remove(key) {
            g.stats.prefetch_hits += 1;
        }
    }
}
