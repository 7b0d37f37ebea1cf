use super::*;
use serde_json::Value;
use std::collections::BTreeSet;

use super::super::stats::Stats;

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Equal up to float parsing (serde_json's default parser may differ in the last ulp).
fn same(a: &Results, b: &Results) {
    fn close(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
                _ => x == y,
            },
            (Value::Array(x), Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(x, y)| close(x, y))
            }
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
            }
            _ => a == b,
        }
    }
    let (va, vb) = (
        serde_json::to_value(a).unwrap(),
        serde_json::to_value(b).unwrap(),
    );
    assert!(close(&va, &vb), "{va:#}\n!=\n{vb:#}");
}

fn sample_results() -> Results {
    let info = warpdrive::Device::cpu().info().unwrap();
    let ceilings = Ceilings {
        host_memcpy_gbps: Some(39.6),
        ..Ceilings::default()
    };
    let row = Row::from_samples(
        "transfer",
        "h2d",
        1 << 26,
        "warpdrive",
        &mut [1500.0, 1520.0, 1560.0],
    )
    .unwrap()
    .with_bytes((1u64 << 26) as f64)
    .against(Ceiling::HostMemcpy, &ceilings);
    Results::new(&info, ceilings, vec![row])
}

#[test]
fn json_has_exactly_the_bench_md_keys_and_nulls() {
    let r = sample_results();
    let v: Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
    assert_eq!(
        keys(&v),
        set(&["schema", "date", "git_rev", "device", "ceilings", "rows"])
    );
    assert_eq!(v["schema"], "warpdrive-bench/1");
    assert_eq!(v["git_rev"], warpdrive::GIT_REV);
    assert_eq!(
        keys(&v["device"]),
        set(&[
            "backend",
            "name",
            "compute_capability",
            "sms",
            "memory_bytes",
            "driver",
            "cuda",
            "pcie",
            "numa_node"
        ])
    );
    assert_eq!(v["device"]["backend"], "cpu");
    for k in [
        "compute_capability",
        "sms",
        "driver",
        "cuda",
        "pcie",
        "numa_node",
    ] {
        assert!(
            v["device"][k].is_null(),
            "device.{k} should be null on the CPU"
        );
    }
    assert_eq!(
        keys(&v["ceilings"]),
        Ceiling::ALL.iter().map(|c| c.key().to_string()).collect()
    );
    assert_eq!(v["ceilings"]["host_memcpy_gbps"], 39.6);
    for c in Ceiling::ALL.iter().filter(|c| **c != Ceiling::HostMemcpy) {
        assert!(
            v["ceilings"][c.key()].is_null(),
            "{} should be null",
            c.key()
        );
    }
    let row = &v["rows"][0];
    assert_eq!(
        keys(row),
        set(&[
            "suite",
            "case",
            "size",
            "variant",
            "median",
            "p10",
            "p90",
            "unit",
            "gbps",
            "tflops",
            "pct_of_ceiling",
            "extra"
        ])
    );
    assert_eq!(row["unit"], "us");
    assert_eq!(row["size"], 1u64 << 26);
    assert_eq!(row["median"], 1520.0);
    assert!(row["tflops"].is_null());
    assert!(row["gbps"].as_f64().unwrap() > 44.0);
    assert!(row["pct_of_ceiling"].as_f64().is_some());
    assert_eq!(row["extra"]["ceiling"], "host_memcpy_gbps");
}

#[test]
fn json_field_order_follows_bench_md() {
    let text = sample_results().to_json().unwrap();
    let pos = |k: &str| text.find(&format!("\"{k}\"")).unwrap();
    let top = ["schema", "date", "git_rev", "device", "ceilings", "rows"];
    assert!(top.windows(2).all(|w| pos(w[0]) < pos(w[1])));
    let row = [
        "suite", "case", "size", "variant", "median", "p10", "p90", "unit", "gbps",
    ];
    assert!(row.windows(2).all(|w| pos(w[0]) < pos(w[1])));
}

#[test]
fn json_round_trips_and_checks_schema() {
    let r = sample_results();
    let text = r.to_json().unwrap();
    same(&Results::from_json(&text).unwrap(), &r);
    let other = text.replace("warpdrive-bench/1", "warpdrive-bench/9");
    assert!(Results::from_json(&other).is_err());
}

#[test]
fn write_json_creates_the_file() {
    let dir = std::env::temp_dir().join(format!("wd-results-{}", std::process::id()));
    let path = dir.join("sub").join("r.json");
    let r = sample_results();
    r.write_json(&path).unwrap();
    same(&Results::read_json(&path).unwrap(), &r);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn write_json_replaces_the_file_instead_of_writing_into_it() {
    let dir = std::env::temp_dir().join(format!("wd-results-atomic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("r.json");
    std::fs::write(&path, "good").unwrap();
    // Another name for the old file: it keeps its text unless the write went into it.
    let old = dir.join("old.json");
    let _ = std::fs::remove_file(&old);
    std::fs::hard_link(&path, &old).unwrap();
    let r = sample_results();
    r.write_json(&path).unwrap();
    same(&Results::read_json(&path).unwrap(), &r);
    assert_eq!(std::fs::read_to_string(&old).unwrap(), "good");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn derived_figures() {
    let stats = Stats {
        median: 1000.0,
        p10: 900.0,
        p90: 1100.0,
    };
    // 1e9 bytes in 1 ms = 1000 GB/s; 2e12 flops in 1 ms = 2000 TFLOP/s.
    let r = Row::new("s", "c", 1, "v", stats)
        .with_bytes(1e9)
        .with_flops(2e12);
    assert!((r.gbps.unwrap() - 1000.0).abs() < 1e-9);
    assert!((r.tflops.unwrap() - 2000.0).abs() < 1e-9);
    let zero = Row::new(
        "s",
        "c",
        1,
        "v",
        Stats {
            median: 0.0,
            ..stats
        },
    )
    .with_bytes(1.0);
    assert_eq!(zero.gbps, None);
}

#[test]
fn percent_of_ceiling_per_metric() {
    let c = Ceilings {
        d2d_copy_gbps: Some(4000.0),
        launch_us: Some(2.0),
        cpu_gemm_f32_gflops: Some(100.0),
        ..Ceilings::default()
    };
    let stats = |m| Stats {
        median: m,
        p10: m,
        p90: m,
    };
    let r = Row::new("s", "c", 1, "v", stats(1.0))
        .with_bytes(2e6)
        .against(Ceiling::D2dCopy, &c);
    assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
    assert_eq!(r.extra["ceiling"], "d2d_copy_gbps");
    let r = Row::new("s", "c", 1, "v", stats(4.0)).against(Ceiling::Launch, &c);
    assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
    // 5e4 flops in 1 µs = 0.05 TFLOP/s = 50 GFLOP/s.
    let r = Row::new("s", "c", 1, "v", stats(1.0))
        .with_flops(5e4)
        .against(Ceiling::CpuGemmF32, &c);
    assert!((r.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
    // Unmeasured ceiling: no percentage, no key.
    let r = Row::new("s", "c", 1, "v", stats(1.0))
        .with_bytes(1.0)
        .against(Ceiling::H2dPinned, &c);
    assert_eq!(r.pct_of_ceiling, None);
    assert!(!r.extra.contains_key("ceiling"));
}

#[test]
fn ceiling_keys_round_trip() {
    for c in Ceiling::ALL {
        assert_eq!(Ceiling::from_key(c.key()), Some(c));
        assert!(c.key().starts_with(c.case()));
    }
    assert_eq!(Ceiling::from_key("nope"), None);
    let mut ceilings = Ceilings::default();
    for (i, c) in Ceiling::ALL.into_iter().enumerate() {
        ceilings.set(c, Some(i as f64));
    }
    for (i, c) in Ceiling::ALL.into_iter().enumerate() {
        assert_eq!(ceilings.get(c), Some(i as f64));
    }
}

#[test]
fn add_rows_fills_percentages_from_named_ceilings() {
    let mut r = sample_results();
    r.ceilings.h2d_pinned_gbps = Some(50.0);
    let peer = Row::new(
        "transfer",
        "h2d",
        1,
        "torch-pinned",
        Stats {
            median: 1.0,
            p10: 1.0,
            p90: 1.0,
        },
    )
    .with_bytes(25e3)
    .with_extra("ceiling", "h2d_pinned_gbps");
    r.add_rows([peer]);
    let last = r.rows.last().unwrap();
    assert!((last.pct_of_ceiling.unwrap() - 50.0).abs() < 1e-9);
}

#[test]
fn dates() {
    assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339_utc(59), "1970-01-01T00:00:59Z");
    assert_eq!(rfc3339_utc(86_399), "1970-01-01T23:59:59Z");
    assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339_utc(951_868_800), "2000-03-01T00:00:00Z");
    assert_eq!(rfc3339_utc(1_709_164_800), "2024-02-29T00:00:00Z");
    assert_eq!(rfc3339_utc(1_735_689_599), "2024-12-31T23:59:59Z");
    assert_eq!(rfc3339_utc(1_795_316_400), "2026-11-22T03:00:00Z");
    assert_eq!(rfc3339_utc(4_107_542_400), "2100-03-01T00:00:00Z");
    assert_eq!(rfc3339_utc(-1), "1969-12-31T23:59:59Z");
    assert_eq!(rfc3339_utc(-86_400 * 365), "1969-01-01T00:00:00Z");
    let now = now_rfc3339();
    assert_eq!(now.len(), 20, "{now}");
    assert!(now.ends_with('Z') && now.as_bytes()[10] == b'T');
}

#[test]
fn table_aligns_and_shows_nulls_as_dashes() {
    let t = format_table(&sample_results());
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[0].starts_with("suite"));
    assert!(lines[0].contains("% ceiling"));
    assert!(lines[2].contains("transfer") && lines[2].contains("warpdrive"));
    assert!(lines[2].contains(" - "), "tflops is null: {}", lines[2]);
    let ceilings = format_ceilings(&sample_results().ceilings);
    assert_eq!(ceilings.lines().count(), 10);
    assert!(!ceilings.contains("null"), "{ceilings}");
    assert!(ceilings.contains("not measured"), "{ceilings}");
}
