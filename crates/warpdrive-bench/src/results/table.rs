//! The plain-text tables of a results file: its rows and its ceilings.

use super::ceiling_model::{Ceiling, Ceilings};
use super::schema::{Results, Row};

/// A number for the table: about four significant digits, `-` for none.
pub(crate) fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if !v.is_finite() => "-".into(),
        Some(v) => {
            let a = v.abs();
            if a >= 1000.0 {
                format!("{v:.0}")
            } else if a >= 100.0 {
                format!("{v:.1}")
            } else if a >= 1.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.3}")
            }
        }
    }
}

/// The first four columns of a row in a table: suite, case, size, variant.
pub(crate) fn row_key(r: &Row) -> [String; 4] {
    [
        r.suite.clone(),
        r.case.clone(),
        r.size.to_string(),
        r.variant.clone(),
    ]
}

/// `head` and `cells` as an aligned table: the text columns (suite, case, variant: 0, 1,
/// 3) left-aligned, the others right-aligned, a rule under the head.
pub(crate) fn aligned(head: &[&str], cells: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for row in cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cols: &mut dyn Iterator<Item = &str>| -> String {
        let parts: Vec<String> = cols
            .zip(&width)
            .enumerate()
            .map(|(i, (c, &w))| {
                if i == 0 || i == 1 || i == 3 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(&mut head.iter().copied());
    out.push('\n');
    let rule: Vec<String> = width.iter().map(|&w| "-".repeat(w)).collect();
    out.push_str(&rule.join("  "));
    out.push('\n');
    for row in cells {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// The rows as a plain aligned table (text columns left-aligned, numbers right-aligned).
pub fn format_table(results: &Results) -> String {
    const HEAD: [&str; 10] = [
        "suite",
        "case",
        "size",
        "variant",
        "median us",
        "p10 us",
        "p90 us",
        "GB/s",
        "TFLOP/s",
        "% ceiling",
    ];
    let cells: Vec<Vec<String>> = results
        .rows
        .iter()
        .map(|r| {
            let mut cells = row_key(r).to_vec();
            cells.extend(
                [
                    Some(r.median),
                    Some(r.p10),
                    Some(r.p90),
                    r.gbps,
                    r.tflops,
                    r.pct_of_ceiling,
                ]
                .map(num),
            );
            cells
        })
        .collect();
    aligned(&HEAD, &cells)
}

/// The ceilings, one per line: key, value and unit (`not measured` where not measured).
pub fn format_ceilings(ceilings: &Ceilings) -> String {
    let width = Ceiling::ALL
        .iter()
        .map(|c| c.key().len())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for c in Ceiling::ALL {
        let value = match ceilings.get(c) {
            Some(v) => format!("{:>10} {}", num(Some(v)), c.unit()),
            // Said in words: the doctor's reader is a person, not a JSON parser.
            None if c.is_gpu() => format!("{:>10} (a GPU ceiling)", "not measured"),
            None => format!("{:>10}", "not measured"),
        };
        out.push_str(&format!("{:<width$}  {value}\n", c.key()));
    }
    out
}

/// Prints [`format_table`] on stdout, then [`format_derived`](super::super::format_derived) when
/// some row has those figures.
pub fn print_table(results: &Results) {
    print!("{}", format_table(results));
    let derived = super::super::format_derived(results);
    if !derived.is_empty() {
        print!("\n{derived}");
    }
}
