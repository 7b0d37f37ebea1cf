//! The allocation profiler, in its own binary: recording is process-wide, so no other test
//! may allocate while this one counts.

mod common;

use warpdrive::memory::{profiler, round_size, DevicePool, PoolConfig, PoolStrategy};
use warpdrive::{Buffer, Device, Error};

#[test]
fn profiler_totals_equal_the_pool_stats() {
    let dev = Device::cpu();
    let stream = dev.new_stream().unwrap();
    let pool = DevicePool::new(&dev, PoolStrategy::Caching(PoolConfig::default())).unwrap();
    profiler::clear();
    profiler::start_recording();
    let sizes = [1usize, 100, 4096, 1 << 20, 3 << 20, 77, 5000];
    let mut live = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let b = Buffer::<f32>::uninit_in(&pool, &stream, n).unwrap();
        if i % 2 == 0 {
            live.push(b);
        }
    }
    let snap = profiler::snapshot();
    let stats = pool.stats().unwrap();
    let report = snap.report(Some(&stats));
    profiler::stop_recording();
    assert_eq!(report.allocations, stats.allocations);
    assert_eq!(report.allocations, sizes.len() as u64);
    assert_eq!(report.frees, (sizes.len() / 2) as u64);
    let rounded: u64 = live
        .iter()
        .map(|b| round_size(b.size_bytes()).unwrap() as u64)
        .sum();
    assert_eq!(rounded, stats.in_use);
    let live_bytes: u64 = live.iter().map(|b| b.size_bytes() as u64).sum();
    assert_eq!(report.live_bytes, live_bytes);
    assert_eq!(
        report.peak_live_bytes, live_bytes,
        "the last allocation is the peak"
    );
    assert_eq!(report.size_max, (3 << 20) * 4);
    assert_eq!(report.fragmentation, Some(stats.fragmentation));
    // The tag is this file, the caller's.
    assert_eq!(report.by_tag.len(), 1);
    assert!(
        report.by_tag[0].tag.ends_with("profiler.rs"),
        "{:?}",
        report.by_tag
    );
    // The snapshot is JSON with every event.
    let json: serde_json::Value = serde_json::from_str(&snap.to_json()).unwrap();
    assert_eq!(
        json["events"].as_array().unwrap().len(),
        sizes.len() + sizes.len() / 2
    );

    // Recording on: an out-of-memory error names the top tags.
    profiler::start_recording();
    let too_big = dev.mem_info().unwrap().1 * 2;
    match Buffer::<u8>::uninit_in(&pool, &stream, too_big) {
        Err(Error::OutOfMemory { detail, .. }) => {
            assert!(
                detail.contains("top tags") && detail.contains("profiler.rs"),
                "{detail}"
            )
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    profiler::stop_recording();
    drop(live);
    let after = profiler::snapshot().report(None);
    assert_eq!(after.live_bytes, live_bytes, "nothing recorded while off");
}
