//! The HTML report: charts and no network fetches, and (with Chromium) every chart renders
//! with ink in it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use warpdrive::Device;
use warpdrive_bench::{render_report, write_report, Ceilings, Results, Row};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("warpdrive-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A results file with bandwidth rows, a ceiling, a peer and a time-only suite.
fn sample_results() -> Results {
    let info = Device::cpu().info().unwrap();
    let ceilings = Ceilings {
        h2d_pinned_gbps: Some(55.0),
        ..Ceilings::default()
    };
    let mut rows = Vec::new();
    for (i, size) in [1u64 << 16, 1 << 20, 1 << 24, 1 << 28]
        .into_iter()
        .enumerate()
    {
        for (variant, eff) in [("warpdrive", 0.9), ("baseline", 0.5), ("torch-copy", 0.8)] {
            let gbps = 55.0 * eff * (i + 1) as f64 / 4.0;
            let us = size as f64 / (gbps * 1e3);
            let mut row =
                Row::from_samples("transfer", "h2d", size, variant, &mut [us, us * 1.1]).unwrap();
            row = row.with_bytes(size as f64);
            row.extra
                .insert("ceiling".into(), Value::from("h2d_pinned_gbps"));
            rows.push(row);
        }
    }
    let mut pipeline = Row::from_samples("transfer", "pipeline", 1 << 28, "streams-3", &mut [9e3])
        .unwrap()
        .with_bytes((1u64 << 28) as f64);
    pipeline
        .set_overlap_efficiency(&[4.0, 5.0, 2.0, 5.0], 9.0)
        .set_transfer_overhead(7.0, 9.0);
    rows.push(pipeline);
    for (variant, us) in [("disabled", 0.002), ("enabled", 0.4)] {
        rows.push(
            Row::from_samples("telemetry", "span-overhead", 1000, variant, &mut [us]).unwrap(),
        );
    }
    Results::new(&info, ceilings, rows)
}

#[test]
fn report_has_charts_and_no_network_fetches() {
    let report = render_report(&sample_results()).unwrap();
    let stems: Vec<&str> = report.charts.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(
        stems,
        ["transfer-bandwidth", "telemetry-time", "peer-ratios"],
        "{stems:?}"
    );
    for (_, _, svg) in &report.charts {
        assert!(svg.contains("<svg") && svg.contains("</svg>"));
    }
    assert_eq!(report.html.matches("<svg").count(), 3);
    assert!(report.html.contains("span-overhead"));
    // The derived figures' table: the pipeline row, overlap (16 - 9) / (16 - 5) = 0.636.
    let derived = &report.table[report.table.find("derived figures").expect("derived")..];
    assert!(
        derived.contains("pipeline") && derived.contains("0.636"),
        "{derived}"
    );
    assert!(report.html.contains("overlap_efficiency"));
    for bad in ["src=\"http", "href=\"http", "<script", "<link", "@import"] {
        assert!(!report.html.contains(bad), "{bad}");
    }
}

fn find_chromium() -> Option<PathBuf> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn chromium(bin: &Path, profile: &Path, args: &[String]) -> std::process::Output {
    let mut cmd = Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--window-size=1000,3000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args);
    cmd.output().unwrap()
}

/// Decodes an 8-bit RGB/RGBA PNG with Python's zlib and prints the share of non-white
/// pixels in each box (x, y, w, h) given as JSON on argv.
const PNG_STATS: &str = r#"
import json, struct, sys, zlib
data = open(sys.argv[1], 'rb').read()
pos, idat, w = 8, b'', 0
while pos < len(data):
    n, kind = struct.unpack('>I4s', data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b'IHDR':
        w, h, depth, color = struct.unpack('>IIBB', body[:10])
        assert depth == 8 and color in (2, 6), (depth, color)
        bpp = 3 if color == 2 else 4
    elif kind == b'IDAT':
        idat += body
    pos += 12 + n
raw, stride = zlib.decompress(idat), w * bpp
rows, prev, i = [], bytearray(stride), 0
for _ in range(h):
    f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride]); i += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b = prev[x]; c = prev[x - bpp] if x >= bpp else 0
        if f == 1: line[x] = (line[x] + a) & 255
        elif f == 2: line[x] = (line[x] + b) & 255
        elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c; pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line); prev = line
out = []
for (x0, y0, bw, bh) in json.loads(sys.argv[2]):
    ink = total = 0
    for y in range(max(0, y0), min(h, y0 + bh)):
        r = rows[y]
        for x in range(max(0, x0), min(w, x0 + bw)):
            total += 1
            if min(r[x * bpp:x * bpp + 3]) < 200: ink += 1
    out.append(ink / max(total, 1))
print(json.dumps(out))
"#;

#[test]
#[ignore = "needs chromium and python3 (apt-get install chromium; .ci/run does)"]
fn report_renders_in_headless_chromium() {
    let bin = find_chromium().expect("no chromium on PATH (apt-get install chromium)");
    let dir = tempdir("report");
    let html = write_report(&sample_results(), &dir).unwrap();
    let page = std::fs::read_to_string(&html).unwrap();
    // A copy that writes each chart's box into the DOM, for --dump-dom.
    let probe = dir.join("probe.html");
    std::fs::write(
        &probe,
        page.replace(
            "</body>",
            "<script>document.body.insertAdjacentHTML('beforeend','<pre id=\"boxes\">'+\
             JSON.stringify([...document.querySelectorAll('figure.chart svg')].map(e=>{\
             const r=e.getBoundingClientRect();return [Math.round(r.x),Math.round(r.y),\
             Math.round(r.width),Math.round(r.height)]}))+'</pre>')</script></body>",
        ),
    )
    .unwrap();
    let out = chromium(
        &bin,
        &dir.join("profile-a"),
        &["--dump-dom".into(), format!("file://{}", probe.display())],
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    // The last match: the script text holds the marker too.
    let start = dom.rfind("<pre id=\"boxes\">").expect("probe output") + 16;
    let boxes = &dom[start..start + dom[start..].find("</pre>").unwrap()];
    let parsed: Vec<Vec<i64>> = serde_json::from_str(boxes).unwrap();
    assert_eq!(parsed.len(), 3, "{boxes}");
    assert!(parsed.iter().all(|b| b[2] > 100 && b[3] > 100), "{boxes}");
    let shot = dir.join("shot.png");
    let out = chromium(
        &bin,
        &dir.join("profile-b"),
        &[
            format!("--screenshot={}", shot.display()),
            format!("file://{}", html.display()),
        ],
    );
    assert!(shot.is_file(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats = Command::new("python3")
        .args(["-c", PNG_STATS])
        .arg(&shot)
        .arg(boxes)
        .output()
        .unwrap();
    assert!(
        stats.status.success(),
        "{}",
        String::from_utf8_lossy(&stats.stderr)
    );
    let ink: Vec<f64> = serde_json::from_slice(&stats.stdout).unwrap();
    for (b, share) in parsed.iter().zip(&ink) {
        // Axes, labels, lines and bars: a blank chart would be ~0.
        assert!(*share > 0.01, "chart at {b:?} is blank ({share})");
    }
}
