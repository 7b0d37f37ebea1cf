//! A store over several disk folders, each with its page size and byte budget: blocks are
//! placed by size, spill to the next folder when one is over budget, come back after a reopen
//! and a power loss from every folder; a full or missing folder is a clear error.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{rng, seed};
use rand::{Rng, RngCore};
use warpdrive::tier::disk::{Disk, SimDisk};
use warpdrive::tier::{DiskFolder, Durability, TierConfig, TierStore};
use warpdrive::{Device, Error};

const SMALL_PAGE: u64 = 4096;
const LARGE_PAGE: u64 = 1 << 20;

fn block(r: &mut impl RngCore, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.fill_bytes(&mut v);
    v
}

/// A store in `/store/<name>` with a small-page folder and a large-page one.
fn two_folders(name: &str, small_budget: u64, large_budget: u64) -> (PathBuf, TierConfig) {
    let root = PathBuf::from(format!("/store/{name}"));
    let mut config = TierConfig::new(0, 0);
    config.disk_folders = vec![
        DiskFolder::new(root.join("small"), SMALL_PAGE, small_budget),
        DiskFolder::new(root.join("large"), LARGE_PAGE, large_budget),
    ];
    (root, config)
}

fn segments(disk: &SimDisk, dir: &Path) -> usize {
    disk.list(dir)
        .unwrap()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .count()
}

/// [`segments`], or `None` where the disk fails (after a simulated crash).
fn segments_now(disk: &SimDisk, dir: &Path) -> Option<usize> {
    let files = disk.list(dir).ok()?;
    Some(
        files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "seg"))
            .count(),
    )
}

#[test]
fn blocks_go_to_the_folder_their_size_picks_and_come_back_after_a_reopen() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let (root, config) = two_folders("place", u64::MAX, u64::MAX);
    let mut r = rng(seed("tier folders place"));
    // Up to a small page, past it (to the large folder), past every page (largest too).
    let blocks: Vec<Vec<u8>> = [100, 4096, 4097, 70_000, (1 << 20) + 1]
        .iter()
        .map(|&n| block(&mut r, n))
        .collect();
    {
        let store = TierStore::open_on(disk.clone(), &root, config.clone(), &s).unwrap();
        store.put("a", &blocks[0], Durability::Sync).unwrap();
        store.put("b", &blocks[1], Durability::Sync).unwrap();
        assert_eq!(segments(&disk, &root.join("small")), 1);
        assert_eq!(segments(&disk, &root.join("large")), 0);
        for (i, b) in blocks.iter().enumerate().skip(2) {
            store.put(&format!("k{i}"), b, Durability::Sync).unwrap();
        }
        assert_eq!(segments(&disk, &root.join("large")), 1);
        let small = disk.list(&root.join("small")).unwrap();
        let small_bytes: u64 = small.iter().map(|p| disk.len(p).unwrap().unwrap()).sum();
        assert!(
            small_bytes < 3 * 4096 + 100,
            "{small_bytes} bytes in the small folder"
        );
        // The index stays in the store's folder, no data there.
        assert_eq!(segments(&disk, &root), 0);
    }
    disk.power_loss();
    let store = TierStore::open_on(disk.clone(), &root, config, &s).unwrap();
    assert_eq!(store.get_host("a").unwrap(), blocks[0]);
    assert_eq!(store.get_host("b").unwrap(), blocks[1]);
    for (i, b) in blocks.iter().enumerate().skip(2) {
        assert_eq!(&store.get_host(&format!("k{i}")).unwrap(), b);
    }
    // Removes and a compaction across folders keep the rest.
    store.remove("a").unwrap();
    store.remove("k3").unwrap();
    store.compact().unwrap();
    assert_eq!(store.get_host("b").unwrap(), blocks[1]);
    assert_eq!(store.get_host("k4").unwrap(), blocks[4]);
}

#[test]
fn a_folder_over_its_budget_spills_to_the_next_and_all_full_is_a_clear_error() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    // Two small pages, one large one.
    let (root, config) = two_folders("spill", 2 * SMALL_PAGE, LARGE_PAGE);
    let mut r = rng(seed("tier folders spill"));
    let store = TierStore::open_on(disk.clone(), &root, config.clone(), &s).unwrap();
    let small: Vec<Vec<u8>> = (0..3).map(|_| block(&mut r, 1000)).collect();
    store.put("s0", &small[0], Durability::Sync).unwrap();
    store.put("s1", &small[1], Durability::Sync).unwrap();
    assert_eq!(segments(&disk, &root.join("large")), 0);
    // Each block takes a whole page of its folder.
    assert_eq!(store.disk_folder_bytes(), vec![2 * SMALL_PAGE, 0]);
    // The small folder is full: the third goes to the large one.
    store.put("s2", &small[2], Durability::Sync).unwrap();
    assert_eq!(segments(&disk, &root.join("large")), 1);
    assert_eq!(store.disk_folder_bytes(), vec![2 * SMALL_PAGE, LARGE_PAGE]);
    // The large folder's one page is taken: nothing fits anywhere.
    let big = block(&mut r, 100_000);
    let e = store.put("big", &big, Durability::Sync).unwrap_err();
    assert!(
        matches!(&e, Error::Io { .. }) && e.to_string().contains("budget"),
        "{e}"
    );
    assert!(e.to_string().contains("large"), "{e}");
    // The store goes on: the small blocks are there.
    for (i, b) in small.iter().enumerate() {
        assert_eq!(&store.get_host(&format!("s{i}")).unwrap(), b);
    }
    drop(store);
    disk.power_loss();
    let store = TierStore::open_on(disk.clone(), &root, config, &s).unwrap();
    for (i, b) in small.iter().enumerate() {
        assert_eq!(&store.get_host(&format!("s{i}")).unwrap(), b);
    }
    assert!(store.get_host("big").is_err());
    // Charges are rebuilt on reopen, and a remove with a compaction gives the page back.
    assert_eq!(store.disk_folder_bytes(), vec![2 * SMALL_PAGE, LARGE_PAGE]);
    store.remove("s2").unwrap();
    store.compact().unwrap();
    assert_eq!(store.disk_folder_bytes(), vec![2 * SMALL_PAGE, 0]);
    store.put("big", &big, Durability::Sync).unwrap();
    assert_eq!(store.get_host("big").unwrap(), big);
}

#[test]
fn a_folder_missing_at_reopen_is_an_error_naming_it() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let (root, config) = two_folders("missing", u64::MAX, u64::MAX);
    let mut r = rng(seed("tier folders missing"));
    {
        let store = TierStore::open_on(disk.clone(), &root, config.clone(), &s).unwrap();
        store
            .put("large", &block(&mut r, 100_000), Durability::Sync)
            .unwrap();
    }
    // The large folder's mount point moved: the index still has a block there.
    let mut moved = config.clone();
    moved.disk_folders[1].path = root.join("elsewhere");
    let e = TierStore::open_on(disk.clone(), &root, moved, &s).unwrap_err();
    assert!(e.to_string().contains("elsewhere"), "{e}");
    // A config that dropped the folder altogether.
    let mut fewer = config.clone();
    fewer.disk_folders.truncate(1);
    let e = TierStore::open_on(disk.clone(), &root, fewer, &s).unwrap_err();
    assert!(e.to_string().contains("folder #1"), "{e}");
    // A folder with no blocks yet is created; the right config still opens.
    let mut more = config.clone();
    more.disk_folders
        .push(DiskFolder::new(root.join("new"), LARGE_PAGE, u64::MAX));
    TierStore::open_on(disk.clone(), &root, more, &s).unwrap();
    TierStore::open_on(disk.clone(), &root, config, &s).unwrap();
}

#[test]
fn a_folder_removed_on_the_os_disk_is_an_error_naming_it() {
    let s = Device::cpu().new_stream().unwrap();
    let root = std::env::temp_dir().join(format!("wd-tier-folders-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut config = TierConfig::new(0, 0);
    config.disk_folders = vec![
        DiskFolder::new(root.join("small"), SMALL_PAGE, u64::MAX),
        DiskFolder::new(root.join("large"), LARGE_PAGE, u64::MAX),
    ];
    let mut r = rng(seed("tier folders os"));
    let (a, b) = (block(&mut r, 1000), block(&mut r, 200_000));
    {
        let store = TierStore::open(&root, config.clone(), &s).unwrap();
        store.put("a", &a, Durability::Sync).unwrap();
        store.put("b", &b, Durability::Sync).unwrap();
    }
    {
        let store = TierStore::open(&root, config.clone(), &s).unwrap();
        assert_eq!(store.get_host("a").unwrap(), a);
        assert_eq!(store.get_host("b").unwrap(), b);
    }
    std::fs::remove_dir_all(root.join("large")).unwrap();
    let e = TierStore::open(&root, config, &s).unwrap_err();
    assert!(e.to_string().contains("large"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Random puts of every size class and removes over three folders with small budgets, a
/// power loss after each round, a reopen: every `Sync` put is back; 100 rounds.
#[test]
fn durable_puts_over_several_folders_survive_power_losses() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let root = PathBuf::from("/store/power");
    let mut config = TierConfig::new(0, 16 << 10);
    config.disk_folders = vec![
        DiskFolder::new(root.join("a"), 4096, 64 << 20),
        DiskFolder::new(root.join("b"), 16 << 10, 64 << 20),
        DiskFolder::new(root.join("c"), 64 << 10, u64::MAX),
    ];
    let mut r = rng(seed("tier folders power"));
    let mut used = [false; 3];
    let open = || TierStore::open_on(disk.clone(), &root, config.clone(), &s).unwrap();
    let lost = common::crash::power_loss_rounds(
        100,
        &mut r,
        &disk,
        open,
        |r| [r.random_range(1..4096), r.random_range(4096..20_000)][r.random_range(0..2)],
        |round, store| {
            if round % 10 == 9 {
                store.compact().unwrap();
            }
            for (f, used) in ["a", "b", "c"].iter().zip(&mut used) {
                *used |= segments(&disk, &root.join(f)) > 0;
            }
        },
    );
    assert_eq!(lost, 0, "acknowledged blocks lost");
    assert_eq!(used, [true; 3], "folders a, b and c all took blocks");
}

/// A crash at every disk change of durable puts into two folders, removes and a compaction
/// of both, then a power loss or a restart: the reopened store holds every acknowledged put.
#[test]
fn a_crash_at_any_disk_step_over_two_folders_loses_no_acknowledged_put() {
    let mut r = rng(seed("tier folders crash steps"));
    // Small and large in turn: each folder gets a closed segment the compaction rewrites.
    let lens = [1000, 10_000, 1200, 11_000, 900, 9000];
    let blocks: Vec<Vec<u8>> = lens.iter().map(|&n| block(&mut r, n)).collect();
    let run = common::crash::CrashRun {
        blocks: &blocks,
        before: 4,
        removed: &[2, 3],
        max_steps: 800,
    };
    common::crash::crash_at_every_step(
        &run,
        |name| {
            let (root, mut config) = two_folders(name, 1 << 20, 1 << 30);
            config.disk_folders[1].page = 64 << 10;
            (root, config)
        },
        |store, disk, root, acked| {
            acked == 4
                && store.compact().is_ok_and(|freed| freed > 0)
                && segments_now(disk, &root.join("small")) == Some(2)
                && segments_now(disk, &root.join("large")) == Some(2)
        },
    );
}

/// Two folders swapped in the config, or an empty folder where one with blocks should be
/// (an unmounted disk), are refused by each folder's mark, not read as blocks lost.
#[test]
fn swapped_or_emptied_folders_are_refused_by_their_marks() {
    let s = Device::cpu().new_stream().unwrap();
    let disk = Arc::new(SimDisk::new());
    let (root, config) = two_folders("marks", u64::MAX, u64::MAX);
    let mut r = rng(seed("tier folders marks"));
    let (a, b) = (block(&mut r, 1000), block(&mut r, 100_000));
    {
        let store = TierStore::open_on(disk.clone(), &root, config.clone(), &s).unwrap();
        store.put("a", &a, Durability::Sync).unwrap();
        store.put("b", &b, Durability::Sync).unwrap();
    }
    let mut swapped = config.clone();
    swapped.disk_folders.swap(0, 1);
    let e = TierStore::open_on(disk.clone(), &root, swapped, &s).unwrap_err();
    assert!(e.to_string().contains("mark"), "{e}");
    // An empty folder in the large one's place.
    let mut emptied = config.clone();
    emptied.disk_folders[1].path = root.join("empty");
    disk.create_dir_all(&root.join("empty")).unwrap();
    let e = TierStore::open_on(disk.clone(), &root, emptied, &s).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    // Nothing was lost by the refusals.
    let store = TierStore::open_on(disk.clone(), &root, config, &s).unwrap();
    assert_eq!(store.get_host("a").unwrap(), a);
    assert_eq!(store.get_host("b").unwrap(), b);
}
