//! The tiered store's index log on the simulated disk (power loss, crashes at every step,
//! a full disk, torn and damaged files) and on the operating system's files.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::warnings_during;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warpdrive::tier::disk::{Disk, OsDisk, SimDisk};
use warpdrive::tier::log::{
    IndexLog, Location, Record, BLOCK_HEAD, COMPACT_FILE, LOG_FILE, MAX_KEY_BYTES,
};
use warpdrive::Error;

type Index = BTreeMap<String, Location>;

const DIR: &str = "/store";

fn sim() -> Arc<SimDisk> {
    Arc::new(SimDisk::new())
}

fn open(disk: &Arc<SimDisk>) -> (IndexLog, Index) {
    IndexLog::open(disk.clone(), Path::new(DIR)).unwrap()
}

fn log_path() -> PathBuf {
    Path::new(DIR).join(LOG_FILE)
}

fn at(n: u64) -> Location {
    Location {
        folder: (n % 2) as u32,
        segment: n % 3,
        offset: n * 4096,
        len: 100 + n,
        // Blocks stored bare (their header in the record) and old-format ones, mixed.
        head: (n % 4 != 3).then_some([n as u8; BLOCK_HEAD]),
    }
}

fn put(key: &str, n: u64) -> Record {
    Record::Put {
        key: key.to_string(),
        at: at(n),
    }
}

fn remove(key: &str) -> Record {
    Record::Remove {
        key: key.to_string(),
    }
}

fn apply(index: &mut Index, record: &Record) {
    match record {
        Record::Put { key, at } => index.insert(key.clone(), *at),
        Record::Remove { key } => index.remove(key),
    };
}

fn is_no_space(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
}

/// The index after each step since the last reopen, and the first one a power loss may go
/// back to (the last acknowledged as durable).
struct History {
    states: Vec<Index>,
    durable_from: usize,
}

impl History {
    fn new(start: Index) -> Self {
        History {
            states: vec![start],
            durable_from: 0,
        }
    }

    fn current(&self) -> &Index {
        &self.states[self.states.len() - 1]
    }

    /// A record appended (or perhaps appended, when its call failed); `durable` when the
    /// call acknowledged it as synced.
    fn record(&mut self, record: &Record, durable: bool) {
        let mut next = self.current().clone();
        apply(&mut next, record);
        self.states.push(next);
        if durable {
            self.durable();
        }
    }

    /// Everything so far acknowledged as durable (a sync or a compaction returned Ok).
    fn durable(&mut self) {
        self.durable_from = self.states.len() - 1;
    }

    /// The replayed index is the state after some prefix of the history that holds every
    /// acknowledged record; then the history starts again from it.
    fn check_and_restart(&mut self, replayed: Index) -> Result<(), String> {
        if !self.states[self.durable_from..].contains(&replayed) {
            return Err(format!(
                "replayed {replayed:?} is no state from the last durable one on: {:?}",
                &self.states[self.durable_from..]
            ));
        }
        *self = History::new(replayed);
        Ok(())
    }
}

/// Appends `record` and notes it in `history`; false when the append failed.
fn append(log: &mut IndexLog, history: &mut History, record: &Record, sync: bool) -> bool {
    let ok = log.append(record, sync).is_ok();
    history.record(record, ok && sync);
    ok
}

/// One body for both disks: records survive a reopen, compaction keeps the live ones.
fn round_trip(disk: Arc<dyn Disk>, dir: &Path) {
    let (mut log, index) = IndexLog::open(disk.clone(), dir).unwrap();
    assert!(index.is_empty());
    assert_eq!(disk.len(&dir.join(LOG_FILE)).unwrap(), Some(0));
    let records = [
        put("a", 1),
        put("b/ключ", 2),
        put("a", 3),
        remove("b/ключ"),
        remove("never"),
        put("c", 4),
        put("", 5),
    ];
    let mut expected = Index::new();
    for (i, r) in records.iter().enumerate() {
        log.append(r, i % 2 == 0).unwrap();
        apply(&mut expected, r);
    }
    log.sync().unwrap();
    assert_eq!(log.records(), records.len() as u64);
    assert_eq!(disk.len(log.path()).unwrap(), Some(log.bytes()));
    assert_eq!(log.dead_ratio(expected.len()), 4.0 / 7.0);
    drop(log);

    let (mut log, index) = IndexLog::open(disk.clone(), dir).unwrap();
    assert_eq!(index, expected);
    assert_eq!(log.records(), records.len() as u64);
    log.compact(&index).unwrap();
    assert_eq!((log.records(), log.dead_ratio(index.len())), (3, 0.0));
    log.append(&put("d", 6), true).unwrap();
    apply(&mut expected, &put("d", 6));
    assert_eq!(
        disk.list(dir).unwrap(),
        vec![dir.join(LOG_FILE)],
        "no compaction file left"
    );
    drop(log);
    let (log, index) = IndexLog::open(disk, dir).unwrap();
    assert_eq!(index, expected);
    assert_eq!(log.records(), 4);
}

#[test]
fn records_round_trip_on_the_simulated_disk() {
    round_trip(sim(), Path::new(DIR));
}

#[test]
fn records_round_trip_on_os_files() {
    let dir = std::env::temp_dir().join(format!("wd-tier-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    round_trip(Arc::new(OsDisk::new()), &dir.join("store"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn synced_records_survive_power_loss_and_unsynced_ones_may_not() {
    let disk = sim();
    let (mut log, _) = open(&disk);
    log.append(&put("a", 1), true).unwrap();
    log.append(&put("b", 2), false).unwrap();
    drop(log);
    disk.power_loss();
    let (mut log, index) = open(&disk);
    assert_eq!(index, Index::from([("a".into(), at(1))]));
    // A group commit: unsynced appends, then one sync.
    log.append(&put("b", 2), false).unwrap();
    log.append(&remove("a"), false).unwrap();
    log.sync().unwrap();
    drop(log);
    disk.power_loss();
    assert_eq!(open(&disk).1, Index::from([("b".into(), at(2))]));
}

#[test]
fn a_failed_sync_writes_the_records_in_doubt_again() {
    let disk = sim();
    let (mut log, _) = open(&disk);
    let records = [put("a", 1), put("b", 2), remove("a"), put("c", 3)];
    log.append(&records[0], true).unwrap();
    log.append(&records[1], false).unwrap();
    log.append(&records[2], false).unwrap();
    disk.fail_next_sync();
    assert!(log.sync().is_err());
    // The kernel dropped the records it failed to write: the log writes them again before
    // this sync counts.
    log.append(&records[3], true).unwrap();
    drop(log);
    disk.power_loss();
    let mut expected = Index::new();
    records.iter().for_each(|r| apply(&mut expected, r));
    assert_eq!(open(&disk).1, expected);
}

#[test]
fn unsynced_records_are_synced_once_a_mebibyte_gathers() {
    let disk = sim();
    let (mut log, _) = open(&disk);
    let mut n = 0;
    while log.bytes() < 3 << 20 {
        log.append(&put(&format!("key{n:08}"), n), false).unwrap();
        n += 1;
    }
    drop(log);
    disk.power_loss();
    let (log, index) = open(&disk);
    assert!(log.bytes() >= 2 << 20, "{} bytes kept", log.bytes());
    // A prefix: the first keys, in order.
    assert_eq!(index.len() as u64, log.records());
    assert_eq!(
        index.keys().last(),
        Some(&format!("key{:08}", index.len() - 1))
    );
}

#[test]
fn keys_longer_than_4_kib_are_refused_and_the_log_goes_on() {
    let disk = sim();
    let (mut log, _) = open(&disk);
    let long = "x".repeat(MAX_KEY_BYTES + 1);
    for r in [put(&long, 1), remove(&long)] {
        let e = log.append(&r, true).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("4096")),
            "{e}"
        );
    }
    let e = log
        .compact(&Index::from([(long.clone(), at(1))]))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let longest = "y".repeat(MAX_KEY_BYTES);
    log.append(&put(&longest, 2), true).unwrap();
    assert_eq!(log.records(), 1);
    drop(log);
    assert_eq!(open(&disk).1, Index::from([(longest, at(2))]));
}

/// A log of `records` synced records and the file length after each.
fn written(disk: &Arc<SimDisk>, records: &[Record]) -> Vec<u64> {
    let (mut log, _) = open(disk);
    records
        .iter()
        .map(|r| {
            log.append(r, true).unwrap();
            log.bytes()
        })
        .collect()
}

#[test]
fn a_torn_tail_is_dropped_at_every_cut_and_later_appends_work() {
    let records = [put("a", 1), remove("a"), put("b", 2)];
    let ends = written(&sim(), &records);
    let kept = Index::new(); // after the first two records
    for cut in ends[1] + 1..ends[2] {
        let disk = sim();
        written(&disk, &records);
        disk.truncate(&log_path(), cut).unwrap();
        let mut replayed = None;
        let warnings = warnings_during(|| replayed = Some(open(&disk)));
        let (mut log, index) = replayed.unwrap();
        assert_eq!(index, kept, "cut at {cut}");
        assert!(
            warnings.contains("index.log") && warnings.contains("dropping"),
            "{warnings}"
        );
        assert_eq!(log.records(), 2);
        assert_eq!(disk.len(&log_path()).unwrap(), Some(ends[1]), "cut off");
        log.append(&put("c", 3), true).unwrap();
        drop(log);
        disk.power_loss();
        let (_, index) = open(&disk);
        assert_eq!(index, Index::from([("c".into(), at(3))]), "cut at {cut}");
    }
}

#[test]
fn a_flipped_byte_ends_the_replay_at_its_record() {
    let records: Vec<Record> = (0..5).map(|i| put(&format!("k{i}"), i)).collect();
    let ends = written(&sim(), &records);
    let upto = |n: usize| {
        let mut index = Index::new();
        records[..n].iter().for_each(|r| apply(&mut index, r));
        index
    };
    // Every byte of the third record, header and payload; then one of the last.
    for offset in (ends[1]..ends[2]).chain([ends[4] - 1]) {
        let disk = sim();
        written(&disk, &records);
        disk.flip_byte(&log_path(), offset).unwrap();
        let (mut log, index) = open(&disk);
        let whole = if offset < ends[2] { 2 } else { 4 };
        assert_eq!(index, upto(whole), "byte {offset} flipped");
        assert_eq!(log.bytes(), ends[whole - 1]);
        log.append(&put("after", 9), true).unwrap();
        drop(log);
        let mut expected = upto(whole);
        apply(&mut expected, &put("after", 9));
        assert_eq!(open(&disk).1, expected, "byte {offset} flipped");
    }
}

#[test]
fn a_full_disk_is_an_error_and_the_log_stays_usable() {
    for short_writes in [false, true] {
        let disk = sim();
        let (mut log, _) = open(&disk);
        disk.set_short_writes(short_writes);
        // Room for a few records (a bare block's put is ~80 bytes).
        disk.set_capacity(Some(400));
        let mut history = History::new(Index::new());
        let mut i = 0;
        let e = loop {
            let r = put(&format!("key{i}"), i);
            match log.append(&r, true) {
                Ok(()) => history.record(&r, true),
                Err(e) => break e,
            }
            i += 1;
        };
        assert!(is_no_space(&e), "{e}");
        assert!(i > 2, "some records fit");
        let file = disk.len(&log_path()).unwrap().unwrap();
        assert_eq!(file > log.bytes(), short_writes, "a short write's part");
        // Still full: still an error, and nothing half-written stays behind it.
        assert!(is_no_space(&log.append(&put("more", 1), true).unwrap_err()));
        // Compaction needs room too; its failure leaves the old log in use.
        let e = log.compact(history.current()).unwrap_err();
        assert!(is_no_space(&e), "{e}");
        assert_eq!(disk.len(&Path::new(DIR).join(COMPACT_FILE)).unwrap(), None);

        disk.set_capacity(None);
        let r = put("after", 99);
        log.append(&r, true).unwrap();
        history.record(&r, true);
        assert_eq!(disk.len(&log_path()).unwrap(), Some(log.bytes()));
        drop(log);
        disk.power_loss();
        let (mut log, index) = open(&disk);
        assert_eq!(&index, history.current(), "short writes: {short_writes}");
        log.compact(&index).unwrap();
        drop(log);
        disk.power_loss();
        assert_eq!(open(&disk).1, index);
    }
}

#[test]
fn power_loss_while_the_disk_is_full_gives_a_consistent_prefix() {
    let disk = sim();
    let (mut log, _) = open(&disk);
    disk.set_short_writes(true);
    disk.set_capacity(Some(300));
    let mut history = History::new(Index::new());
    for i in 0..40 {
        let r = if i % 3 == 2 {
            remove(&format!("key{}", i - 1))
        } else {
            put(&format!("key{i}"), i)
        };
        let sync = i % 4 == 0;
        match log.append(&r, sync) {
            Ok(()) => history.record(&r, sync),
            Err(e) => {
                assert!(is_no_space(&e), "{e}");
                break;
            }
        }
    }
    drop(log);
    disk.power_loss();
    disk.set_capacity(None);
    let (_, index) = open(&disk);
    history.check_and_restart(index).unwrap();
}

/// A scripted workload: puts, removes, syncs and a compaction, stopping at the first
/// error (the simulated process died). Returns whether it ran to its end.
fn workload(log: &mut IndexLog, history: &mut History) -> bool {
    for i in 0..12u64 {
        let key = format!("k{}", i % 5);
        let r = if i % 4 == 3 {
            remove(&key)
        } else {
            put(&key, i)
        };
        let sync = i % 3 != 1;
        if !append(log, history, &r, sync) {
            return false;
        }
        if i == 7 {
            if log.compact(history.current()).is_err() {
                return false;
            }
            history.durable();
        }
    }
    true
}

/// Runs the workload on a log with a torn tail, the simulated process dying after
/// `changes` changes to the disk; then a power loss (or a restart: a `kill -9`) and a
/// reopen must give a state holding every acknowledged record, and no leftover file.
/// Returns whether the workload ran to its end.
fn crash_and_reopen(changes: u64, power_loss: bool) -> bool {
    let disk = sim();
    // A torn tail for `open` to cut, so its steps are crashed in too.
    let (mut log, start) = open(&disk);
    log.append(&put("old", 1), true).unwrap();
    log.append(&put("torn", 2), true).unwrap();
    drop(log);
    let torn = disk.len(&log_path()).unwrap().unwrap() - 1;
    disk.truncate(&log_path(), torn).unwrap();
    disk.sync(&log_path()).unwrap();
    let mut history = History::new(start);
    history.record(&put("old", 1), true);

    disk.crash_after(changes);
    let finished = match IndexLog::open(disk.clone(), Path::new(DIR)) {
        Ok((mut log, index)) => {
            assert_eq!(&index, history.current());
            workload(&mut log, &mut history)
        }
        Err(_) => false,
    };
    let how = if power_loss {
        disk.power_loss();
        "power loss"
    } else {
        disk.restart();
        "restart"
    };
    let (_, index) = open(&disk);
    if let Err(e) = history.check_and_restart(index) {
        panic!("{how} after {changes} changes: {e}");
    }
    assert_eq!(
        disk.list(Path::new(DIR)).unwrap(),
        vec![log_path()],
        "{how} after {changes} changes"
    );
    finished
}

#[test]
fn a_crash_at_any_step_loses_nothing_acknowledged() {
    for power_loss in [true, false] {
        // Each step of the workload is one change or a few: it finishes well before 200.
        let crash_points = (0..200)
            .position(|changes| crash_and_reopen(changes, power_loss))
            .expect("the workload finishes");
        assert!(crash_points > 20, "{crash_points}");
    }
}

#[test]
fn two_hundred_and_fifty_power_losses_lose_no_acknowledged_record() {
    let mut rng = StdRng::seed_from_u64(0x7134);
    let disk = sim();
    let (mut log, index) = open(&disk);
    let mut history = History::new(index);
    let (mut power_losses, mut acknowledged, mut lost) = (0, 0u64, 0);
    for round in 0..250u64 {
        if rng.random_bool(0.3) {
            disk.crash_after(rng.random_range(0..12));
        }
        for i in 0..rng.random_range(1..16u64) {
            let key = format!("k{}", rng.random_range(0..20));
            let r = if rng.random_bool(0.25) {
                remove(&key)
            } else {
                put(&key, round * 100 + i)
            };
            let sync = rng.random_bool(0.5);
            if !append(&mut log, &mut history, &r, sync) {
                break;
            }
            acknowledged += u64::from(sync);
            if rng.random_bool(0.05) {
                if log.compact(history.current()).is_err() {
                    break;
                }
                history.durable();
            }
        }
        drop(log);
        disk.power_loss();
        power_losses += 1;
        let index;
        (log, index) = open(&disk);
        if let Err(e) = history.check_and_restart(index) {
            eprintln!("round {round}: {e}");
            lost += 1;
        }
    }
    assert!(acknowledged > 500, "{acknowledged}");
    assert_eq!((power_losses, lost), (250, 0));
}

#[derive(Debug, Clone)]
enum Op {
    Put {
        key: u8,
        n: u64,
        sync: bool,
    },
    Remove {
        key: u8,
        sync: bool,
    },
    Sync,
    Compact,
    /// The process dies after this many more changes to the disk.
    Crash(u64),
    /// The next sync fails, dropping the writes it did not write back.
    FailSync,
    PowerLoss,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..8, 0u64..1000, any::<bool>()).prop_map(|(key, n, sync)| Op::Put { key, n, sync }),
        2 => (0u8..8, any::<bool>()).prop_map(|(key, sync)| Op::Remove { key, sync }),
        1 => Just(Op::Sync),
        1 => Just(Op::Compact),
        1 => (0u64..6).prop_map(Op::Crash),
        1 => Just(Op::FailSync),
        2 => Just(Op::PowerLoss),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Against a model: after every power loss the replayed index is the state after some
    /// prefix of the operations that holds every one acknowledged as durable.
    #[test]
    fn the_log_replays_a_prefix_holding_every_synced_record(ops in prop::collection::vec(op(), 1..60)) {
        let disk = sim();
        let (mut log, index) = open(&disk);
        let mut history = History::new(index);
        // A crash is armed, so an error means the process died (a failed sync alone leaves
        // it running); dead until the power loss.
        let (mut crash_armed, mut dead) = (false, false);
        for op in ops.iter().chain([&Op::PowerLoss]) {
            match op {
                Op::PowerLoss => {
                    drop(log);
                    disk.power_loss();
                    let index;
                    (log, index) = open(&disk);
                    history.check_and_restart(index).map_err(TestCaseError::fail)?;
                    (crash_armed, dead) = (false, false);
                }
                _ if dead => {}
                Op::Put { key, n, sync } => {
                    let ok = append(&mut log, &mut history, &put(&format!("key{key}"), *n), *sync);
                    dead = !ok && crash_armed;
                }
                Op::Remove { key, sync } => {
                    let ok = append(&mut log, &mut history, &remove(&format!("key{key}")), *sync);
                    dead = !ok && crash_armed;
                }
                Op::Sync => match log.sync() {
                    Ok(()) => history.durable(),
                    Err(_) => dead = crash_armed,
                },
                Op::Compact => match log.compact(history.current()) {
                    Ok(()) => history.durable(),
                    Err(_) => dead = crash_armed,
                },
                Op::Crash(changes) => {
                    disk.crash_after(*changes);
                    crash_armed = true;
                }
                Op::FailSync => disk.fail_next_sync(),
            }
        }
    }
}
