//! The tiered store counts every block that crosses a tier pair (blocks, bytes, time), once
//! per hop, in `stats().moves`.

mod common;

use std::sync::Arc;

use common::{device_test, rng, seed};
use rand::RngCore;
use warpdrive::tier::disk::SimDisk;
use warpdrive::tier::moves::PairStats;
use warpdrive::tier::{Durability, Tier, TierConfig, TierStore};
use warpdrive::Device;

const LEN: usize = 4096 + 5;

fn pair(store: &TierStore, from: Tier, to: Tier) -> (u64, u64) {
    let PairStats { blocks, bytes, .. } = store.stats().moves.pair(from, to);
    (blocks, bytes)
}

device_test!(
    cpu_moves_are_counted_per_tier_pair,
    gpu_moves_are_counted_per_tier_pair,
    |dev| moves_body(dev)
);

fn moves_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("tier pair moves"));
    let mut data = vec![0u8; LEN];
    r.fill_bytes(&mut data);
    let n = LEN as u64;

    let store = TierStore::open_on(
        Arc::new(SimDisk::new()),
        "/store/pairs",
        TierConfig::new(1 << 20, 1 << 20),
        &s,
    )
    .unwrap();
    store.put("a", &data, Durability::Memory).unwrap();
    assert!(store.stats().moves.pairs().is_empty(), "a put is no move");
    store.migrate("a", Tier::Host).unwrap();
    assert_eq!(pair(&store, Tier::Gpu, Tier::Host), (1, n));
    store.migrate("a", Tier::Disk).unwrap();
    assert_eq!(pair(&store, Tier::Host, Tier::Disk), (1, n));
    store.migrate("a", Tier::Host).unwrap();
    assert_eq!(pair(&store, Tier::Disk, Tier::Host), (1, n));
    store.migrate("a", Tier::Gpu).unwrap();
    assert_eq!(pair(&store, Tier::Host, Tier::Gpu), (1, n));
    // Already on disk: dropping the memory copies moves nothing.
    store.migrate("a", Tier::Disk).unwrap();
    // Read and uploaded in one hop, counted once.
    assert_eq!(store.get("a").unwrap().to_host(&s).unwrap(), data);
    assert_eq!(pair(&store, Tier::Disk, Tier::Gpu), (1, n));
    store.put("b", &data, Durability::Memory).unwrap();
    store.migrate("b", Tier::Disk).unwrap();
    assert_eq!(pair(&store, Tier::Gpu, Tier::Disk), (1, n));
    assert_eq!(store.get_host("b").unwrap(), data);
    assert_eq!(pair(&store, Tier::Disk, Tier::Gpu), (2, 2 * n));
    let moves = store.stats().moves;
    let listed: Vec<(Tier, Tier)> = moves.pairs().iter().map(|&(f, t, _)| (f, t)).collect();
    assert_eq!(
        listed,
        vec![
            (Tier::Gpu, Tier::Host),
            (Tier::Gpu, Tier::Disk),
            (Tier::Host, Tier::Gpu),
            (Tier::Host, Tier::Disk),
            (Tier::Disk, Tier::Gpu),
            (Tier::Disk, Tier::Host),
        ]
    );
    // Evictions count too: a GPU tier of ~2 blocks sends the older ones to the host.
    let small = TierConfig::new(3 * n, 1 << 20);
    let store = TierStore::open_on(Arc::new(SimDisk::new()), "/store/pairs2", small, &s).unwrap();
    for i in 0..6 {
        store
            .put(&format!("e{i}"), &data, Durability::Memory)
            .unwrap();
    }
    let stats = store.stats();
    assert!(stats.gpu_evictions > 0, "{stats:?}");
    assert_eq!(
        pair(&store, Tier::Gpu, Tier::Host),
        (stats.gpu_evictions, stats.gpu_evictions * n)
    );

    // A block the GPU tier cannot take is read from the disk into host memory.
    let tiny = TierConfig::new(1024, 1 << 20);
    let store = TierStore::open_on(Arc::new(SimDisk::new()), "/store/pairs3", tiny, &s).unwrap();
    store.put("c", &data, Durability::Memory).unwrap();
    store.migrate("c", Tier::Disk).unwrap();
    assert_eq!(pair(&store, Tier::Host, Tier::Disk), (1, n));
    assert_eq!(store.get_host("c").unwrap(), data);
    let mut out = vec![0u8; LEN];
    store.get_host_into("c", &mut out).unwrap();
    assert_eq!(out, data);
    assert_eq!(pair(&store, Tier::Disk, Tier::Host), (2, 2 * n));
    assert_eq!(pair(&store, Tier::Disk, Tier::Gpu), (0, 0));
}
