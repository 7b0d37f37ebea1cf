//! A crash at every disk change of a run of durable puts, removes and a compaction, then a
//! power loss or a restart; and rounds of random puts each ended by a power loss: the
//! reopened store must hold every acknowledged put. Shared by the tier tests (one folder,
//! several folders).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, RngCore};
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

/// Rounds of random puts (lengths from `len`, durability at random) and removes of 24 keys,
/// each round ended by `after(round, store)`, the store's drop and a power loss, and begun by
/// a reopen (`open`) that checks every block acknowledged as `Sync` so far. Returns how many
/// such blocks came back wrong or not at all.
pub fn power_loss_rounds(
    rounds: usize,
    r: &mut StdRng,
    disk: &SimDisk,
    open: impl Fn() -> TierStore,
    mut len: impl FnMut(&mut StdRng) -> usize,
    mut after: impl FnMut(usize, &TierStore),
) -> usize {
    let mut durable: HashMap<String, Vec<u8>> = HashMap::new();
    let mut lost = 0usize;
    for round in 0..rounds {
        let store = open();
        for (key, want) in &durable {
            match store.get_host(key) {
                Ok(got) if &got == want => {}
                other => {
                    lost += 1;
                    eprintln!("round {round}: {key} came back as {other:?}");
                }
            }
        }
        for _ in 0..r.random_range(1..8) {
            let key = format!("k{}", r.random_range(0..24));
            match r.random_range(0..4) {
                0 => {
                    if store.remove(&key).is_ok() {
                        // An unsynced remove may be undone by the power loss: the block is
                        // no longer promised either way.
                        durable.remove(&key);
                    }
                }
                n => {
                    let mut data = vec![0u8; len(r)];
                    r.fill_bytes(&mut data);
                    let d = [Durability::Memory, Durability::Disk, Durability::Sync][n - 1];
                    store.put(&key, &data, d).unwrap();
                    if d == Durability::Sync {
                        durable.insert(key, data);
                    } else {
                        durable.remove(&key);
                    }
                }
            }
        }
        after(round, &store);
        drop(store);
        disk.power_loss();
    }
    lost
}
