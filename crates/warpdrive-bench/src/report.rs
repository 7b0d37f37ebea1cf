//! `warpdrive report`: a results file as the plain table, SVG charts (`plotters`) and one
//! self-contained HTML page (inline SVG, no network fetches).
//!
//! Charts: bandwidth against size per suite with the ceilings the rows cite as dashed lines;
//! the time ratio of each peer row to warpdrive's row of the same case and size (above 1:
//! warpdrive is faster); and, for suites without a bandwidth, the median time per row.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::derived::format_derived;
use super::results::{format_table, Results, Row};
use warpdrive::error::{Error, Result};

const W: u32 = 900;
const H: u32 = 480;

/// A rendered report.
#[derive(Debug, Clone)]
pub struct Report {
    /// The plain-text table and the derived figures (as `warpdrive bench` prints them).
    pub table: String,
    /// (file stem, title, SVG document) per chart.
    pub charts: Vec<(String, String, String)>,
    /// The self-contained HTML page.
    pub html: String,
}

fn chart_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("chart rendering failed: {e}"))
}

/// `lo..hi` when an axis can span it: finite, increasing and, on a log axis, positive with a
/// finite `hi / lo` (plotters never finishes placing the ticks of a log axis without one).
fn axis(lo: f64, hi: f64, log: bool) -> Result<std::ops::Range<f64>> {
    let spans = if log {
        lo > 0.0 && (hi / lo).is_finite()
    } else {
        true
    };
    if lo.is_finite() && hi.is_finite() && lo < hi && spans {
        Ok(lo..hi)
    } else {
        Err(chart_error(format!(
            "the values span {lo:e}..{hi:e}, which no axis can draw"
        )))
    }
}

/// Renders the table, the charts and the page of `results`.
pub fn render_report(results: &Results) -> Result<Report> {
    let mut charts = Vec::new();
    let mut suites: Vec<&str> = results.rows.iter().map(|r| r.suite.as_str()).collect();
    suites.dedup();
    let mut seen = Vec::new();
    for suite in suites {
        if seen.contains(&suite) {
            continue;
        }
        seen.push(suite);
        let rows: Vec<&Row> = results.rows.iter().filter(|r| r.suite == suite).collect();
        if rows.iter().any(|r| r.gbps.is_some()) {
            let title = format!("{suite}: bandwidth vs size (GB/s, log scale)");
            let svg = bandwidth_chart(results, &rows, &title)?;
            charts.push((format!("{suite}-bandwidth"), title, svg));
        } else {
            let title = format!("{suite}: median time per case (µs, log scale)");
            let svg = time_chart(&rows, &title)?;
            charts.push((format!("{suite}-time"), title, svg));
        }
    }
    let ratios = peer_ratios(&results.rows);
    if !ratios.is_empty() {
        let title = "peer time / warpdrive time (above 1: warpdrive faster)".to_string();
        let svg = bar_chart(&ratios, &title, false, Some(1.0))?;
        charts.push(("peer-ratios".into(), title, svg));
    }
    let mut table = format_table(results);
    let derived = format_derived(results);
    if !derived.is_empty() {
        table = format!("{table}\n{derived}");
    }
    let html = page(results, &table, &charts);
    Ok(Report {
        table,
        charts,
        html,
    })
}

/// Writes `report.html` and one SVG per chart into `dir` (created if missing); returns the
/// HTML path.
pub fn write_report(results: &Results, dir: &Path) -> Result<PathBuf> {
    let report = render_report(results)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for (stem, _, svg) in &report.charts {
        let p = dir.join(format!("{stem}.svg"));
        std::fs::write(&p, svg).map_err(io(&p))?;
    }
    let p = dir.join("report.html");
    std::fs::write(&p, &report.html).map_err(io(&p))?;
    Ok(p)
}

fn series_label(r: &Row) -> String {
    format!("{} {}", r.case, r.variant)
}

fn palette(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

fn bandwidth_chart(results: &Results, rows: &[&Row], title: &str) -> Result<String> {
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut ceilings: BTreeMap<&'static str, f64> = BTreeMap::new();
    for r in rows {
        let Some(g) = r.gbps.filter(|g| g.is_finite() && *g > 0.0) else {
            continue;
        };
        series
            .entry(series_label(r))
            .or_default()
            .push((r.size.max(1) as f64, g));
        if let Some(c) = r.named_ceiling().filter(|c| c.unit() == "GB/s") {
            if let Some(v) = results
                .ceilings
                .get(c)
                .filter(|v| v.is_finite() && *v > 0.0)
            {
                ceilings.insert(c.key(), v);
            }
        }
    }
    let points = series.values().flatten();
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    for v in ceilings.values() {
        y1 = y1.max(*v);
    }
    if x0 > x1 {
        return Err(chart_error("no bandwidth rows"));
    }
    let (x0, x1) = (x0 / 2.0, x1 * 2.0);
    // Log scale: PCIe (tens of GB/s) and HBM (thousands) share one chart.
    let y0 = series
        .values()
        .flatten()
        .map(|p| p.1)
        .chain(ceilings.values().copied())
        .fold(f64::MAX, f64::min);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                axis(x0, x1, true)?.log_scale(),
                axis(y0 / 1.5, y1 * 1.5, true)?.log_scale(),
            )
            .map_err(chart_error)?;
        chart
            .configure_mesh()
            .x_desc("size")
            .y_desc("GB/s (log)")
            .x_label_formatter(&|x| human(*x))
            .draw()
            .map_err(chart_error)?;
        for (i, (name, mut pts)) in series.into_iter().enumerate() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = palette(i);
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(chart_error)?
                .label(name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(chart_error)?;
        }
        for (i, (key, v)) in ceilings.into_iter().enumerate() {
            let color = palette(i + 5).mix(0.8);
            chart
                .draw_series(DashedLineSeries::new(
                    [(x0, v), (x1, v)],
                    6,
                    4,
                    color.stroke_width(2),
                ))
                .map_err(chart_error)?
                .label(format!("ceiling {key}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(chart_error)?;
        root.present().map_err(chart_error)?;
    }
    Ok(svg)
}

/// (label, peer median / warpdrive median) for each peer row with a warpdrive row of the
/// same suite, case and size.
fn peer_ratios(rows: &[Row]) -> Vec<(String, f64)> {
    let peer =
        |v: &str| v.starts_with("torch-") || v.starts_with("cupy-") || v.starts_with("triton-");
    rows.iter()
        .filter(|r| peer(&r.variant))
        .filter_map(|p| {
            let ours = rows.iter().find(|w| {
                w.variant.starts_with("warpdrive")
                    && (w.suite.as_str(), w.case.as_str(), w.size)
                        == (p.suite.as_str(), p.case.as_str(), p.size)
            })?;
            (ours.median > 0.0).then(|| {
                (
                    format!("{} {} {}", p.case, human(p.size as f64), p.variant),
                    p.median / ours.median,
                )
            })
        })
        .collect()
}

fn time_chart(rows: &[&Row], title: &str) -> Result<String> {
    let bars: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.median > 0.0)
        .map(|r| {
            (
                format!("{} {}", series_label(r), human(r.size as f64)),
                r.median,
            )
        })
        .collect();
    bar_chart(&bars, title, true, None)
}

/// Horizontal-label bar chart; `log` for a log value axis, `mark` draws a reference line.
fn bar_chart(bars: &[(String, f64)], title: &str, log: bool, mark: Option<f64>) -> Result<String> {
    if bars.is_empty() {
        return Err(chart_error("no bars"));
    }
    let n = bars.len();
    let hi = bars.iter().map(|b| b.1).fold(mark.unwrap_or(0.0), f64::max);
    let lo = bars.iter().map(|b| b.1).fold(f64::MAX, f64::min);
    let height = H.max(60 + 28 * n as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, height)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_error)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(260);
        let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
        let y_fmt = move |y: &SegmentValue<usize>| match y {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        let draw = |bar: &(usize, f64), base: f64, i: usize| {
            let color = palette(i);
            Rectangle::new(
                [
                    (base, SegmentValue::Exact(bar.0)),
                    (bar.1, SegmentValue::Exact(bar.0 + 1)),
                ],
                color.mix(0.8).filled(),
            )
        };
        let items: Vec<(usize, f64)> = bars.iter().enumerate().map(|(i, b)| (i, b.1)).collect();
        if log {
            let (a, b) = (lo / 2.0, hi * 2.0);
            let mut chart = builder
                .build_cartesian_2d(axis(a, b, true)?.log_scale(), (0..n).into_segmented())
                .map_err(chart_error)?;
            chart
                .configure_mesh()
                .y_label_formatter(&y_fmt)
                .y_labels(n)
                .draw()
                .map_err(chart_error)?;
            chart
                .draw_series(items.iter().map(|bar| draw(bar, a, bar.0)))
                .map_err(chart_error)?;
        } else {
            let mut chart = builder
                .build_cartesian_2d(axis(0.0, hi * 1.15, false)?, (0..n).into_segmented())
                .map_err(chart_error)?;
            chart
                .configure_mesh()
                .y_label_formatter(&y_fmt)
                .y_labels(n)
                .draw()
                .map_err(chart_error)?;
            chart
                .draw_series(items.iter().map(|bar| draw(bar, 0.0, bar.0)))
                .map_err(chart_error)?;
            if let Some(m) = mark {
                chart
                    .draw_series(DashedLineSeries::new(
                        [(m, SegmentValue::Exact(0)), (m, SegmentValue::Exact(n))],
                        6,
                        4,
                        BLACK.stroke_width(2),
                    ))
                    .map_err(chart_error)?;
            }
        }
        root.present().map_err(chart_error)?;
    }
    Ok(svg)
}

/// 1024 → "1 Ki", 67108864 → "64 Mi".
fn human(x: f64) -> String {
    let units = ["", " Ki", " Mi", " Gi", " Ti"];
    let mut v = x;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v}{}", units[i])
    } else {
        format!("{v:.1}{}", units[i])
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn page(results: &Results, table: &str, charts: &[(String, String, String)]) -> String {
    let d = &results.device;
    let mut html = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>warpdrive report</title><style>\
         body{font-family:sans-serif;margin:24px;color:#222}\
         pre{background:#f6f6f6;padding:12px;overflow-x:auto;font-size:12px}\
         figure.chart{margin:16px 0;border:1px solid #ddd;display:inline-block}\
         figcaption{font-size:13px;padding:4px 8px;background:#fafafa}\
         </style></head><body>\n",
    );
    html.push_str(&format!(
        "<h1>warpdrive report</h1>\n<p>{} ({}) · driver {} · CUDA {} · {} · rev {}</p>\n",
        escape(&d.name),
        escape(&d.backend),
        escape(d.driver.as_deref().unwrap_or("-")),
        escape(d.cuda.as_deref().unwrap_or("-")),
        escape(&results.date),
        escape(&results.git_rev),
    ));
    for (stem, title, svg) in charts {
        // Drop the XML prolog: the SVG is inlined in HTML.
        let body = svg.find("<svg").map_or(svg.as_str(), |i| &svg[i..]);
        html.push_str(&format!(
            "<figure class=\"chart\" id=\"{}\">{body}<figcaption>{}</figcaption></figure>\n",
            escape(stem),
            escape(title)
        ));
    }
    html.push_str(&format!("<h2>Rows</h2>\n<pre>{}</pre>\n", escape(table)));
    html.push_str("</body></html>\n");
    html
}
