//! A crash at every disk change of a run of durable puts, removes and a compaction, then a
//! power loss or a restart: the reopened store must hold every acknowledged put. Shared by
//! the tier tests (one folder, several folders).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use warpdrive::tier::disk::SimDisk;
use warpdrive::tier::{Durability, TierConfig, TierStore};
use warpdrive::Device;

/// One crash run: `blocks[..before]` put durably and synced (a closed segment for the
/// compaction), of those `removed` removed again; then, with the crash armed, the rest put.
pub struct CrashRun<'a> {
    pub blocks: &'a [Vec<u8>],
    pub before: usize,
    pub removed: &'a [usize],
    /// Crash points tried at most; a run that reaches its end before the crash ends the loop.
    pub max_steps: u64,
}

/// Runs `run` with the crash after 0, 1, 2, ... disk changes, each on a fresh [`SimDisk`]
/// and store (`open(name)`: the store's folder and config), ending with a power loss and,
/// in a second pass, a restart. `done(store, disk, folder, acked)` says whether a run got
/// through its end (the crash fell after it), given the puts acknowledged.
pub fn crash_at_every_step(
    run: &CrashRun<'_>,
    open: impl Fn(&str) -> (PathBuf, TierConfig),
    done: impl Fn(&TierStore, &SimDisk, &std::path::Path, usize) -> bool,
) {
    let s = Device::cpu().new_stream().unwrap();
    let key = |i: usize| format!("b{i}");
    for restart in [false, true] {
        let mut finished = false;
        for crash_at in 0..run.max_steps {
            if finished {
                break;
            }
            let disk = Arc::new(SimDisk::new());
            let (path, config) = open(&format!("crash-{restart}-{crash_at}"));
            {
                let store = TierStore::open_on(disk.clone(), &path, config.clone(), &s).unwrap();
                for (i, b) in run.blocks.iter().enumerate().take(run.before) {
                    store.put(&key(i), b, Durability::Sync).unwrap();
                }
                for &i in run.removed {
                    store.remove(&key(i)).unwrap();
                }
                store.sync().unwrap();
            }
            let mut acked: HashMap<String, Vec<u8>> = (0..run.before)
                .filter(|i| !run.removed.contains(i))
                .map(|i| (key(i), run.blocks[i].clone()))
                .collect();
            disk.crash_after(crash_at);
            if let Ok(store) = TierStore::open_on(disk.clone(), &path, config.clone(), &s) {
                for (i, b) in run.blocks.iter().enumerate().skip(run.before) {
                    if store.put(&key(i), b, Durability::Sync).is_ok() {
                        acked.insert(key(i), b.clone());
                    }
                }
                finished = done(&store, &disk, &path, acked.len());
            }
            if restart {
                disk.restart();
            } else {
                disk.power_loss();
            }
            let store = TierStore::open_on(disk.clone(), &path, config.clone(), &s).unwrap();
            for (key, want) in &acked {
                assert_eq!(
                    &store.get_host(key).unwrap(),
                    want,
                    "crash after {crash_at} changes (restart: {restart}): {key}"
                );
            }
        }
        assert!(finished, "a run with no crash in reach");
    }
}
