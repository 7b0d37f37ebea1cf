//! The floors of DESIGN.md ("Layout", issue 30): nothing imports upward and no modules form a
//! cycle. This test reads every `crate::` path in each source file under `src/` — in `use`
//! lines, expressions, types and macros, comments and string literals left out — and every
//! `super::` path that climbs to the crate root, maps it to the top-level module it names, and
//! fails on a path to a strictly higher floor or on a cycle between modules of one floor.
//! Today's violations are listed in `ALLOWED`; an entry that no longer occurs fails too, so the
//! list only shrinks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

/// Each top-level module's floor, bottom-up. Floor 0 holds the root leaves, which anyone may
/// use: `lib` (the items of `lib.rs` itself: `GIT_REV`, the `half` re-export; its other
/// re-exports resolve to the module they come from), `error` (imports nothing), `dtype` (only
/// doc links), `size` and `files` (both import `error`). `fuse` and the workloads other than
/// `moe` do not exist yet; they have their floor already.
const FLOORS: &[(&str, u32)] = &[
    ("lib", 0),
    ("error", 0),
    ("dtype", 0),
    ("size", 0),
    ("files", 0),
    ("device", 1),
    ("kernels", 1),
    ("memory", 2),
    ("transfer", 3),
    ("ops", 3),
    ("exec", 3),
    ("telemetry", 4),
    ("fuse", 4),
    ("moe", 5),
    ("actor", 5),
    ("agents", 5),
    ("tier", 5),
    ("dist", 5),
];

/// `test_support` is compiled only into the unit tests: any module's tests may use it, and it
/// may use any module (it runs bodies on a `Device` and checks the `exec` tune cache's path),
/// like an integration test. Paths from it and to it are not checked.
const TEST_ONLY: &str = "test_support";

/// Today's violations, `(file under crates/warpdrive/src, module it must stop naming, why)`.
/// Fix one, then delete its entry (the test fails until you do).
const ALLOWED: &[(&str, &str, &str)] = &[];

/// One path found in a source file.
#[derive(Debug, Clone, PartialEq)]
struct Found {
    /// 1-based line of the path's first segment below the root.
    line: usize,
    /// The path as written, e.g. `crate::ops::fill` or `super::memory::Buffer`.
    text: String,
    /// Its first segment below the crate root, e.g. `ops`.
    first: String,
}

#[test]
fn no_module_imports_upward_or_forms_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let floors: BTreeMap<&str, u32> = FLOORS.iter().copied().collect();
    let modules = top_level_modules(&src);
    let mut problems = Vec::new();
    for module in &modules {
        if module != TEST_ONLY && !floors.contains_key(module.as_str()) {
            problems.push(format!(
                "src/{module}: a top-level module with no floor; give it one in FLOORS (and in DESIGN.md)"
            ));
        }
    }
    let lib = fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
    let (reexports, lib_idents) = lib_items(&lib, &modules);

    // Every path from one top-level module to another: (file, line, text, from, to).
    let mut edges = Vec::new();
    for file in rust_files(&src) {
        let rel = file
            .strip_prefix(&src)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        let module_path = module_path(&rel);
        let Some(from) = module_path.first().cloned() else {
            continue; // lib.rs: the root itself
        };
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("read {rel}: {e}"));
        let segments: Vec<&str> = module_path.iter().map(String::as_str).collect();
        for found in find_paths(&text, &segments) {
            let to = if modules.contains(&found.first) {
                found.first.clone()
            } else if let Some(module) = reexports.get(&found.first) {
                module.clone()
            } else if found.first == "self" || lib_idents.contains(&found.first) {
                "lib".to_string()
            } else {
                problems.push(format!(
                    "src/{rel}:{}: `{}`: cannot tell which module `{}` is in",
                    found.line, found.text, found.first
                ));
                continue;
            };
            if to != from && to != TEST_ONLY && from != TEST_ONLY {
                edges.push((rel.clone(), found.line, found.text, from.clone(), to));
            }
        }
    }

    let floor = |m: &str| floors.get(m).copied().unwrap_or(u32::MAX);
    for &(file, to, _) in ALLOWED {
        let from = module_path(file).first().cloned().unwrap_or_default();
        if !edges.iter().any(|e| e.0 == file && e.4 == to) {
            problems.push(format!(
                "ALLOWED ({file}, {to}): src/{file} no longer names `{to}`; delete the entry"
            ));
        } else if floor(to) < floor(&from) {
            problems.push(format!(
                "ALLOWED ({file}, {to}): {from} may use {to} (a lower floor); delete the entry"
            ));
        }
    }
    let allowed = |file: &str, to: &str| ALLOWED.iter().any(|a| a.0 == file && a.1 == to);

    // Upward paths, and the same-floor graph for the cycle check.
    let mut same_floor: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (file, line, text, from, to) in &edges {
        if allowed(file, to) {
            continue;
        }
        let where_ = format!("src/{file}:{line}: `{text}`");
        if floor(to) > floor(from) {
            problems.push(format!(
                "{where_}: {from} (floor {}) names {to} (floor {}), a floor above it",
                floor(from),
                floor(to)
            ));
        } else if floor(to) == floor(from) {
            same_floor
                .entry((from.clone(), to.clone()))
                .or_default()
                .push(where_);
        }
    }
    let mut reported = BTreeSet::new();
    for (from, to) in same_floor.keys() {
        let Some(back) = route(&same_floor, to, from) else {
            continue;
        };
        // The cycle from -> to -> ... -> from, reported once whichever edge finds it.
        let mut cycle = vec![from.clone()];
        cycle.extend(back);
        let mut key = cycle[..cycle.len() - 1].to_vec();
        key.sort();
        if !reported.insert(key) {
            continue;
        }
        let mut message = format!("modules form a cycle: {}", cycle.join(" -> "));
        for pair in cycle.windows(2) {
            for where_ in &same_floor[&(pair[0].clone(), pair[1].clone())] {
                message.push_str(&format!("\n    {where_}"));
            }
        }
        problems.push(message);
    }

    assert!(
        problems.is_empty(),
        "the floors of DESIGN.md are broken (bottom-up: {}):\n{}",
        floor_list(),
        problems.join("\n")
    );
}

/// `device + kernels (1) < memory (2) < ...` for the failure message.
fn floor_list() -> String {
    let mut by_floor: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for &(module, floor) in FLOORS {
        by_floor.entry(floor).or_default().push(module);
    }
    let floors: Vec<String> = by_floor
        .iter()
        .map(|(floor, modules)| format!("{} ({floor})", modules.join(", ")))
        .collect();
    floors.join(" < ")
}

/// The modules on a shortest route `from` -> ... -> `to` through `graph`, `from` excluded.
fn route(
    graph: &BTreeMap<(String, String), Vec<String>>,
    from: &str,
    to: &str,
) -> Option<Vec<String>> {
    let mut came_from: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = VecDeque::from([from.to_string()]);
    while let Some(at) = queue.pop_front() {
        if at == to {
            let mut route = vec![at.clone()];
            let mut at = at;
            while let Some(prev) = came_from.get(&at) {
                route.push(prev.clone());
                at = prev.clone();
            }
            route.reverse();
            return Some(route);
        }
        for (a, b) in graph.keys() {
            if *a == at && *b != from && !came_from.contains_key(b) {
                came_from.insert(b.clone(), at.clone());
                queue.push_back(b.clone());
            }
        }
    }
    None
}

/// The top-level modules: each folder and each `.rs` file (but `lib.rs`) under `src/`.
fn top_level_modules(src: &Path) -> BTreeSet<String> {
    let mut modules = BTreeSet::new();
    for entry in fs::read_dir(src).expect("read src/") {
        let path = entry.expect("read src/").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if path.is_dir() {
            modules.insert(name.to_string());
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if stem != "lib" {
                modules.insert(stem.to_string());
            }
        }
    }
    modules
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
            let path = entry.expect("read a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The module path of a file under `src/`: `device/cuda/mod.rs` -> `[device, cuda]`,
/// `size.rs` -> `[size]`, `lib.rs` -> `[]`.
fn module_path(rel: &str) -> Vec<String> {
    let mut path: Vec<String> = rel.split('/').map(str::to_string).collect();
    if let Some(last) = path.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" && stem != "lib" {
            path.push(stem.to_string());
        }
    }
    path
}

/// What `lib.rs` offers at the root: each re-exported name with the module it comes from
/// (`lib` for another crate's, like `half`'s `bf16`), and every identifier of `lib.rs`, so a
/// root item (`GIT_REV`) resolves to `lib` and an unknown name fails instead.
fn lib_items(
    lib: &str,
    modules: &BTreeSet<String>,
) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let tokens = tokens(&strip(lib));
    let mut reexports = BTreeMap::new();
    let mut idents = BTreeSet::new();
    let mut i = 0;
    while i < tokens.len() {
        if let Tok::Ident(word) = &tokens[i].1 {
            idents.insert(word.clone());
            if word == "use" {
                let end = (i..tokens.len())
                    .find(|&j| tokens[j].1 == Tok::Punct(';'))
                    .unwrap_or(tokens.len());
                let names: Vec<&String> = tokens[i + 1..end]
                    .iter()
                    .filter_map(|t| match &t.1 {
                        Tok::Ident(w) if !["self", "as", "crate"].contains(&w.as_str()) => Some(w),
                        _ => None,
                    })
                    .collect();
                if let Some((source, names)) = names.split_first() {
                    let module = if modules.contains(*source) {
                        source.to_string()
                    } else {
                        "lib".to_string()
                    };
                    for name in names {
                        reexports.insert(name.to_string(), module.clone());
                    }
                }
            }
        }
        i += 1;
    }
    (reexports, idents)
}

/// `src` with comments, string, byte-string, raw-string and char literals blanked to spaces;
/// line breaks stay, so line numbers do too. Lifetimes (`'a`) are kept.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let n = c.len();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut i = 0;
    while i < n {
        let ch = c[i];
        if ch == '/' && at(i + 1) == '/' {
            while i < n && c[i] != '\n' {
                blank(&mut out, c[i]);
                i += 1;
            }
            continue;
        }
        if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                    continue;
                }
                out.push_str("  ");
                i += 2;
                if depth == 0 {
                    break;
                }
            }
            continue;
        }
        // A raw string `r#"..."#` (or `br"..."`), its `r` not inside an identifier.
        let starts_word =
            i == 0 || !is_ident(c[i - 1]) || (c[i - 1] == 'b' && (i < 2 || !is_ident(c[i - 2])));
        if ch == 'r' && starts_word {
            let mut j = i + 1;
            while at(j) == '#' {
                j += 1;
            }
            if at(j) == '"' {
                let hashes = j - i - 1;
                for &skipped in &c[i..=j] {
                    blank(&mut out, skipped);
                }
                i = j + 1;
                while i < n {
                    if c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                        for &skipped in &c[i..=i + hashes] {
                            blank(&mut out, skipped);
                        }
                        i += hashes + 1;
                        break;
                    }
                    blank(&mut out, c[i]);
                    i += 1;
                }
                continue;
            }
        }
        if ch == '"' {
            blank(&mut out, ch);
            i += 1;
            while i < n {
                let done = c[i] == '"';
                let skip = if c[i] == '\\' { 2 } else { 1 };
                for &skipped in &c[i..(i + skip).min(n)] {
                    blank(&mut out, skipped);
                }
                i += skip;
                if done {
                    break;
                }
            }
            continue;
        }
        if ch == '\'' && at(i + 1) == '\\' {
            // An escaped char literal: `'\n'`, `'\''`, `'\u{..}'`.
            for &skipped in &c[i..(i + 3).min(n)] {
                blank(&mut out, skipped);
            }
            i += 3;
            while i < n && c[i] != '\'' {
                blank(&mut out, c[i]);
                i += 1;
            }
            if i < n {
                blank(&mut out, c[i]);
                i += 1;
            }
            continue;
        }
        if ch == '\'' && at(i + 2) == '\'' {
            // A plain char literal `'x'` (a lifetime `'a` has no closing quote).
            for &skipped in &c[i..i + 3] {
                blank(&mut out, skipped);
            }
            i += 3;
            continue;
        }
        out.push(ch);
        i += 1;
    }
    out
}

fn is_ident(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Colons,
    Punct(char),
}

/// Identifiers, `::` and single punctuation of stripped source, each with its 1-based line.
fn tokens(stripped: &str) -> Vec<(usize, Tok)> {
    let c: Vec<char> = stripped.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if is_ident(ch) {
            let start = i;
            while i < c.len() && is_ident(c[i]) {
                i += 1;
            }
            out.push((line, Tok::Ident(c[start..i].iter().collect())));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((line, Tok::Colons));
            i += 2;
        } else {
            out.push((line, Tok::Punct(ch)));
            i += 1;
        }
    }
    out
}

/// Every path in `src` that starts at the crate root: `crate::` (and `$crate::` in macros),
/// and `super::` chains that climb out of the file's module (`module`, e.g. `[device, cuda]`)
/// and of the inline `mod x { }` blocks around them. Groups (`crate::{ops, size}`) give one
/// path per item.
fn find_paths(src: &str, module: &[&str]) -> Vec<Found> {
    let toks = tokens(&strip(src));
    let ident = |j: usize| match toks.get(j) {
        Some((_, Tok::Ident(w))) => Some(w.as_str()),
        _ => None,
    };
    let colons = |j: usize| matches!(toks.get(j), Some((_, Tok::Colons)));
    let mut out = Vec::new();
    let mut depth = 0;
    let mut inline_mods: Vec<usize> = Vec::new();
    for i in 0..toks.len() {
        match &toks[i].1 {
            Tok::Punct('{') => {
                depth += 1;
                if i >= 2 && ident(i - 2) == Some("mod") && ident(i - 1).is_some() {
                    inline_mods.push(depth);
                }
            }
            Tok::Punct('}') => {
                if inline_mods.last() == Some(&depth) {
                    inline_mods.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(word)
                if (word == "crate" || word == "super") && !(i > 0 && colons(i - 1)) =>
            {
                let mut j = i;
                if word == "crate" {
                    if !colons(i + 1) {
                        continue; // `pub(crate)`
                    }
                    j += 2;
                } else {
                    let mut climbs = 0;
                    while ident(j) == Some("super") && colons(j + 1) {
                        climbs += 1;
                        j += 2;
                    }
                    if climbs == 0 || climbs < module.len() + inline_mods.len() {
                        continue; // stays inside the top-level module
                    }
                }
                let prefix = if word == "crate" {
                    "crate::".to_string()
                } else {
                    "super::".repeat((j - i) / 2)
                };
                collect_group(&toks, j, &prefix, &mut out);
            }
            _ => {}
        }
    }
    out
}

/// The path(s) at `toks[j]`, right after `prefix` (`crate::`): one identifier, `*`, or a
/// `{ .. }` group whose items each start a path.
fn collect_group(toks: &[(usize, Tok)], j: usize, prefix: &str, out: &mut Vec<Found>) {
    let push = |k: usize, out: &mut Vec<Found>| {
        let Some((line, tok)) = toks.get(k) else {
            return;
        };
        let first = match tok {
            Tok::Ident(w) => w.clone(),
            Tok::Punct('*') => "*".to_string(),
            _ => return,
        };
        let mut text = format!("{prefix}{first}");
        let mut k = k + 1;
        while let (Some((_, Tok::Colons)), Some((_, Tok::Ident(w)))) =
            (toks.get(k), toks.get(k + 1))
        {
            text.push_str("::");
            text.push_str(w);
            k += 2;
        }
        out.push(Found {
            line: *line,
            text,
            first,
        });
    };
    if toks.get(j).map(|t| &t.1) != Some(&Tok::Punct('{')) {
        push(j, out);
        return;
    }
    let mut level = 0;
    let mut item_start = true;
    for (k, (_, tok)) in toks.iter().enumerate().skip(j) {
        match tok {
            Tok::Punct('{') => {
                level += 1;
                item_start = level == 1;
            }
            Tok::Punct('}') => {
                level -= 1;
                if level == 0 {
                    break;
                }
            }
            Tok::Punct(',') if level == 1 => item_start = true,
            _ => {
                if item_start && level == 1 {
                    push(k, out);
                }
                item_start = false;
            }
        }
    }
}

#[test]
fn path_extraction_skips_comments_and_strings_and_finds_paths_anywhere() {
    let src = r##"
// crate::a::x in a line comment, /// and crate::b in a doc comment
/* crate::c /* nested crate::d */ crate::e */
let s = "crate::f \" crate::g"; let r = r#"crate::h " crate::i"#; let b = b"crate::j";
let c = '"'; let q = '\''; let l: &'static str = "x"; fn f<'a>(x: &'a u8) {}
let v = crate::ops::fill(&x);
let t: Vec<crate::memory::Buffer<f32>> = m!(crate::exec::graph, 1);
use crate::{size, device::{Device, Stream}, self};
$crate::kernels::k!();
pub(crate) fn g() {}
"##;
    let found = find_paths(src, &["transfer"]);
    let texts: Vec<&str> = found.iter().map(|f| f.text.as_str()).collect();
    assert_eq!(
        texts,
        [
            "crate::ops::fill",
            "crate::memory::Buffer",
            "crate::exec::graph",
            "crate::size",
            "crate::device",
            "crate::self",
            "crate::kernels::k",
        ]
    );
    let lines: Vec<usize> = found.iter().map(|f| f.line).collect();
    assert_eq!(lines, [6, 7, 7, 8, 8, 8, 9]);
    let firsts: Vec<&str> = found.iter().map(|f| f.first.as_str()).collect();
    assert_eq!(firsts[..2], ["ops", "memory"]);
}

#[test]
fn super_paths_count_only_when_they_climb_to_the_root() {
    let src = "use super::super::DeviceInfo;\nuse super::super::super::memory::Buffer;\n";
    let found = find_paths(src, &["device", "cuda", "info"]);
    let texts: Vec<&str> = found.iter().map(|f| f.text.as_str()).collect();
    assert_eq!(texts, ["super::super::super::memory::Buffer"]);

    let src = "use super::ops;\nmod tests {\n    use super::*;\n    use super::super::{exec, size};\n}\nfn f() { super::kernels::k(); }\n";
    let found = find_paths(src, &["device"]);
    let texts: Vec<&str> = found.iter().map(|f| f.text.as_str()).collect();
    assert_eq!(
        texts,
        [
            "super::ops",
            "super::super::exec",
            "super::super::size",
            "super::kernels::k"
        ]
    );
}

/// The backend seam (DESIGN.md, issue 30): cudarc is named only in the CUDA backend's
/// folder, and no file above the device floor tells the backends apart (a `Device` variant,
/// the CUDA device type). Comments count too: a doc that names cudarc elsewhere would be a
/// map of a house that no longer stands.
#[test]
fn the_backends_stay_behind_the_seam() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut problems = Vec::new();
    for file in rust_files(&src) {
        let rel = file
            .strip_prefix(&src)
            .expect("a file under src")
            .to_string_lossy()
            .replace('\\', "/");
        let text = fs::read_to_string(&file).expect("read a source file");
        for (n, line) in text.lines().enumerate() {
            if !rel.starts_with("device/cuda/") && line.contains("cudarc") {
                problems.push(format!(
                    "src/{rel}:{}: names cudarc: {}",
                    n + 1,
                    line.trim()
                ));
            }
            let backend = ["Device::Cuda", "Device::Cpu", "CudaDevice", ".is_cuda()"]
                .iter()
                .find(|p| line.contains(*p));
            if let (false, Some(p)) = (rel.starts_with("device/"), backend) {
                problems.push(format!(
                    "src/{rel}:{}: tells the backends apart ({p}): {}",
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
