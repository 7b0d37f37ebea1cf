//! Compaction's new data segment appears only by rename: a crash at any step leaves either
//! no new segment or a whole one, a leftover temporary segment is removed on reopen, and
//! every acknowledged block comes back.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{rng, seed};
use rand::RngCore;
use warpdrive::tier::disk::{Disk, SimDisk};
use warpdrive::tier::{Durability, TierConfig, TierStore};
use warpdrive::Device;

fn temp_segments(disk: &SimDisk, dir: &Path) -> Vec<String> {
    disk.list(dir)
        .unwrap()
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .filter(|n| n.ends_with(".tmp") && n.starts_with("data-"))
        .collect()
}

#[test]
fn a_compaction_crashed_at_any_step_leaves_no_temp_segment_and_loses_nothing() {
    let s = Device::cpu().new_stream().unwrap();
    let config = TierConfig::new(0, 0);
    let mut r = rng(seed("tier compact rename"));
    let blocks: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let mut v = vec![0u8; 700 + 900 * i];
            r.fill_bytes(&mut v);
            v
        })
        .collect();
    let (mut saw_temp, mut finished) = (false, false);
    for crash_at in 0..300u64 {
        if finished {
            break;
        }
        let disk = Arc::new(SimDisk::new());
        let dir = Path::new("/store/compact-rename");
        {
            let store = TierStore::open_on(disk.clone(), dir, config.clone(), &s).unwrap();
            for (i, b) in blocks.iter().enumerate() {
                store.put(&format!("b{i}"), b, Durability::Sync).unwrap();
            }
            store.remove("b1").unwrap();
            store.remove("b2").unwrap();
            store.sync().unwrap();
        }
        // A new store appends to a new segment: the one above is closed and mostly dead.
        disk.crash_after(crash_at);
        if let Ok(store) = TierStore::open_on(disk.clone(), dir, config.clone(), &s) {
            finished = store.compact().is_ok_and(|freed| freed > 0);
        }
        disk.restart();
        saw_temp |= !temp_segments(&disk, dir).is_empty();
        let store = TierStore::open_on(disk.clone(), dir, config.clone(), &s).unwrap();
        assert_eq!(
            temp_segments(&disk, dir),
            Vec::<String>::new(),
            "crash after {crash_at}"
        );
        for i in [0, 3] {
            assert_eq!(
                store.get_host(&format!("b{i}")).unwrap(),
                blocks[i],
                "crash after {crash_at}: b{i}"
            );
        }
        // And it compacts cleanly afterwards.
        store.compact().unwrap();
        for i in [0, 3] {
            assert_eq!(store.get_host(&format!("b{i}")).unwrap(), blocks[i]);
        }
    }
    assert!(finished, "a run with no crash in reach");
    assert!(
        saw_temp,
        "no crash fell between the temporary segment's write and its rename"
    );
}
