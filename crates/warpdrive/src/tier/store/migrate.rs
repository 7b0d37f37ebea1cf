//! Explicit moves: a block sent up to the GPU or host tier, or down to the disk.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::memory::PinnedBuf;

use super::{check_key, publish_occupancy, Below, Inner, Tier, TierStore};

/// The highest tier holding `key`.
fn highest_tier(g: &Inner, key: &String) -> Option<Tier> {
    if g.gpu.contains(key) {
        Some(Tier::Gpu)
    } else if g.host.contains(key) {
        Some(Tier::Host)
    } else {
        g.index.contains_key(key).then_some(Tier::Disk)
    }
}

impl TierStore {
    /// Moves the block under `key` to tier `to`: up to the GPU or the host (making room
    /// there as a put does), or down to the disk (written there unless it is already, then
    /// dropped from the memory tiers). A pinned block does not move down.
    pub fn migrate(&self, key: &str, to: Tier) -> Result<()> {
        check_key(key)?;
        let started = std::time::Instant::now();
        let key = key.to_string();
        let mut g = self.inner.lock();
        let from = highest_tier(&g, &key);
        let r = self.migrate_locked(&mut g, key, to);
        if let (Ok(()), Some(from)) = (&r, from) {
            metrics::histogram!(
                "warpdrive_tier_migration_seconds",
                "from" => from.name(),
                "to" => to.name()
            )
            .record(started.elapsed().as_secs_f64());
        }
        publish_occupancy(&g);
        r
    }

    fn migrate_locked(&self, g: &mut Inner, key: String, to: Tier) -> Result<()> {
        let pinned = g.gpu.is_pinned(&key) || g.host.is_pinned(&key);
        match to {
            Tier::Gpu => {
                if g.gpu.contains(&key) {
                    return Ok(());
                }
                let since = Instant::now();
                let below = self.find_below_gpu(g, &key)?;
                if let Some(below) = self.promote(g, &key, below, since)? {
                    let bytes = match below {
                        Below::Disk(p) => p.len(),
                        Below::Host => g.host_blocks.get(&key).map_or(0, |p| p.len()),
                    };
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} ({bytes} bytes) does not fit the GPU tier's budget"
                    )));
                }
                Ok(())
            }
            Tier::Host => {
                if g.host.contains(&key) {
                    return Ok(());
                }
                if pinned {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} is pinned"
                    )));
                }
                let bytes;
                let since = Instant::now();
                let pinned_copy = match g.gpu_blocks.get(&key) {
                    Some(buf) => {
                        bytes = buf.len() as u64;
                        let mut p = PinnedBuf::<u8>::new(self.stream.device(), buf.len())?;
                        buf.copy_to_pinned(&self.stream, &mut p)?;
                        g.stats
                            .moves
                            .record(Tier::Gpu, Tier::Host, bytes, since.elapsed());
                        p
                    }
                    None => match self.find_below_gpu(g, &key)? {
                        Below::Disk(p) => {
                            bytes = p.len() as u64;
                            g.stats
                                .moves
                                .record(Tier::Disk, Tier::Host, bytes, since.elapsed());
                            p
                        }
                        Below::Host => return Ok(()),
                    },
                };
                if !g.host.fits(bytes) {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} ({bytes} bytes) does not fit the host tier's budget"
                    )));
                }
                self.make_room_on_host(g, bytes)?;
                g.gpu.remove(&key);
                g.gpu_blocks.remove(&key);
                g.host.insert(key.clone(), bytes);
                g.host_blocks.insert(key, pinned_copy);
                Ok(())
            }
            Tier::Disk => {
                if pinned {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} is pinned"
                    )));
                }
                if !g.index.contains_key(&key) {
                    let since = Instant::now();
                    // Encoded straight from the pinned block when the host holds it.
                    if let Some(p) = g.host_blocks.remove(&key) {
                        let written = self.write_to_disk(g, &key, p.wait_slice()?, false);
                        let bytes = p.len() as u64;
                        if written.is_err() {
                            g.host_blocks.insert(key.clone(), p);
                        }
                        written?;
                        g.stats
                            .moves
                            .record(Tier::Host, Tier::Disk, bytes, since.elapsed());
                    } else if let Some(buf) = g.gpu_blocks.get(&key) {
                        let data = buf.to_host(&self.stream)?;
                        self.write_to_disk(g, &key, &data, false)?;
                        let bytes = data.len() as u64;
                        g.stats
                            .moves
                            .record(Tier::Gpu, Tier::Disk, bytes, since.elapsed());
                    } else {
                        return Err(Error::NotFound { key });
                    }
                }
                self.drop_from_memory(g, &key);
                Ok(())
            }
        }
    }
}
