//! LAYER-1: imports only point down the layer order of `ARCHITECTURE.md`, and no import circle
//! joins two units of the code map.
//! LAYER-2: no import circle joins two modules inside a layer either: the modules are the
//! crate's top-level ones and their children (`actors::stage`, `actors::supervisor`,
//! `comm::tcp`: what the code map names), each with everything under it; an import between a
//! module and one of its own ancestors is containment, not an edge.
//!
//! A hand parser, no dependency: every file under `src/` (but `src/bin`, a crate of its own
//! that sees meshwork only through its public API) is read with comments, strings and
//! character literals blanked; every path that starts with `crate::`, `super::` or `self::`
//! (in `use` trees, brace groups expanded, and anywhere else in code: signatures, fn bodies,
//! expressions) is resolved to the module it names. Doc links are comments, so they do not
//! count.
//!
//! Test code is exempt: files named `tests.rs` and inline `#[cfg(test)] mod … { … }` blocks.
//! They are compiled into the test build only, never into the library, and a test may use a
//! fixture from a higher layer (the demo model, `testing`) to exercise a lower one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, bottom first, and the module-path prefixes they hold. A module belongs to the
/// unit of its longest matching prefix; `""` is the crate root (`lib.rs`, the prelude).
/// Keep in step with the top of `ARCHITECTURE.md`.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "core",
        &[
            "mesh",
            "config",
            "precision",
            "trace",
            "recovery",
            "stragglers",
            "scaling",
            "planner",
            "parallel::sampler",
            "parallel::pipeline",
            "parallel::buckets",
            "parallel::compress",
            "parallel::local",
            "kernels::products",
            "composition",
        ],
    ),
    ("comm", &["comm"]),
    ("checkpoint", &["checkpoint"]),
    (
        "train",
        &[
            "parallel",
            "kernels",
            "optim",
            "device",
            "data",
            "faults",
            "job_config",
        ],
    ),
    ("outcome", &["error", "report", "events"]),
    ("runtime", &["actors"]),
    ("cluster", &["cluster"]),
    ("job", &["job", "testing", "demo", ""]),
];

/// Items the crate root re-exports from a lower module (`crate::Error` is `crate::error::Error`).
const ROOT_REEXPORTS: &[(&str, &str)] = &[("Error", "error"), ("Result", "error")];

/// One path found in a file.
#[derive(Debug, Clone)]
struct Import {
    file: String,
    line: usize,
    /// The module of the file.
    from: Vec<String>,
    /// The resolved path, crate-relative.
    path: Vec<String>,
}

/// Blank comments, string and character literals (keeping line breaks), so that only code is
/// left to scan.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, s: &[u8]| {
        out.extend(s.iter().map(|&c| if c == b'\n' { b'\n' } else { b' ' }))
    };
    while i < b.len() {
        let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if b[i..].starts_with(b"//") {
            let end = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| i + p);
            blank(&mut out, &b[i..end]);
            i = end;
        } else if b[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &b[i..j.min(b.len())]);
            i = j.min(b.len());
        } else if !ident_before
            && (b[i..].starts_with(b"r#")
                || b[i..].starts_with(b"r\"")
                || b[i..].starts_with(b"br"))
        {
            // A raw string: r"…", r#"…"#, br"…" (but r#ident is a raw identifier).
            let start = i;
            let mut j = i + if b[i] == b'b' { 2 } else { 1 };
            let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
            j += hashes;
            if j < b.len() && b[j] == b'"' {
                let mut close = vec![b'"'];
                close.extend(std::iter::repeat_n(b'#', hashes));
                let end = (j + 1..b.len())
                    .find(|&k| b[k..].starts_with(&close))
                    .map_or(b.len(), |k| k + close.len());
                blank(&mut out, &b[start..end]);
                i = end;
            } else {
                out.push(b[i]);
                i += 1;
            }
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            blank(&mut out, &b[i..end]);
            i = end;
        } else if b[i] == b'\'' {
            // A character literal ('a', '\n', '\u{1F600}'), not a lifetime ('a).
            let len = if b.get(i + 1) == Some(&b'\\') {
                b.get(i + 3..)
                    .and_then(|r| r.iter().position(|&c| c == b'\''))
                    .map(|p| p + 4)
            } else {
                let ch = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + ch) == Some(&b'\'')).then_some(ch + 2)
            };
            match len {
                Some(n) => {
                    blank(&mut out, &b[i..i + n]);
                    i += n;
                }
                None => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// Blank the bodies of inline `#[cfg(test)] mod name { … }` blocks.
fn blank_test_modules(code: &mut String) {
    let mut from = 0;
    while let Some(p) = code[from..].find("#[cfg(test)]") {
        let at = from + p;
        from = at + 1;
        let rest = &code[at + "#[cfg(test)]".len()..];
        let trimmed = rest.trim_start();
        let after = trimmed.strip_prefix("pub ").unwrap_or(trimmed);
        let Some(after) = after.strip_prefix("mod ") else {
            continue;
        };
        let name_len = after
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        if !after[name_len..].trim_start().starts_with('{') {
            continue; // `mod tests;`: that file is skipped by name
        }
        let open = code.len() - after[name_len..].len() + after[name_len..].find('{').unwrap();
        let mut depth = 0;
        let mut end = code.len();
        for (k, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        let blanked: String = code[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        code.replace_range(at..end, &blanked);
    }
}

/// Inline modules (`mod name { … }`) of a file: their span and name, outermost first.
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let mut spans = Vec::new();
    let mut from = 0;
    while let Some(p) = code[from..].find("mod ") {
        let at = from + p;
        from = at + 4;
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let after = &code[at + 4..];
        let name_len = after.find(|c: char| !is_ident(c)).unwrap_or(after.len());
        let rest = after[name_len..].trim_start();
        if name_len == 0 || !rest.starts_with('{') {
            continue;
        }
        let open = code.len() - rest.len();
        let mut depth = 0;
        let mut end = code.len();
        for (k, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        spans.push((open, end, after[..name_len].to_string()));
    }
    spans
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Expand a `use` tree (`crate::a::{b, c::{d, e as f}, self}`) into its paths.
fn expand_tree(tree: &str) -> Vec<String> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
        for (i, c) in s.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts
    }
    fn rec(prefix: &str, s: &str, out: &mut Vec<String>) {
        for item in split_top(s) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            if let Some(open) = item.find('{') {
                let inner = &item[open + 1..item.rfind('}').unwrap_or(item.len())];
                rec(&format!("{prefix}{}", &item[..open]), inner, out);
            } else {
                let item = item.split(" as ").next().unwrap_or(item).trim();
                let joined = format!("{prefix}{item}");
                out.push(joined.trim_end_matches("::self").to_string());
            }
        }
    }
    let flat: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let flat = flat.replace(" ::", "::").replace(":: ", "::");
    let mut out = Vec::new();
    rec("", &flat, &mut out);
    out
}

/// Resolve a path seen in module `from` to a crate-relative path; `None` for paths that do not
/// start at the crate, the file's module or a parent.
fn resolve(from: &[String], path: &str) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").map(str::trim).collect();
    let mut module = from.to_vec();
    let mut rest = &segs[..];
    match segs.first().copied() {
        Some("crate") => {
            module.clear();
            rest = &segs[1..];
        }
        Some("super") | Some("self") => {
            while let Some(&first) = rest.first() {
                match first {
                    "super" => {
                        module.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    module.extend(rest.iter().filter(|s| !s.is_empty()).map(|s| s.to_string()));
    Some(module)
}

/// Every crate path in one file's source.
fn imports_of(file: &str, module: &[String], src: &str) -> Vec<Import> {
    let mut code = strip(src);
    blank_test_modules(&mut code);
    let line_of = |code: &str, at: usize| code[..at].matches('\n').count() + 1;
    let inline = inline_modules(&code);
    let module_at = |at: usize| -> Vec<String> {
        let mut m = module.to_vec();
        m.extend(
            inline
                .iter()
                .filter(|(s, e, _)| *s <= at && at < *e)
                .map(|(_, _, n)| n.clone()),
        );
        m
    };
    let mut found = Vec::new();
    let mut push = |at: usize, line: usize, path: &str| {
        let from = module_at(at);
        if let Some(p) = resolve(&from, path) {
            found.push(Import {
                file: file.to_string(),
                line,
                from,
                path: p,
            });
        }
    };
    // `use` trees first, then blank them so the scan below does not see them twice.
    let mut i = 0;
    while let Some(p) = code[i..].find("use ") {
        let at = i + p;
        i = at + 4;
        let before = code[..at].chars().next_back();
        if before.is_some_and(is_ident) {
            continue;
        }
        let tree_start = at + 4;
        let Some(end) = code[tree_start..].find(';').map(|e| tree_start + e) else {
            break;
        };
        let tree = code[tree_start..end].trim();
        if !(tree.starts_with("crate") || tree.starts_with("super") || tree.starts_with("self")) {
            continue;
        }
        let line = line_of(&code, at);
        for path in expand_tree(tree) {
            push(at, line, &path);
        }
        let blanked: String = code[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        code.replace_range(at..end, &blanked);
        i = end;
    }
    // Paths anywhere else: `crate::a::b`, `super::super::x`.
    let bytes = code.as_bytes();
    let mut k = 0;
    while k < code.len() {
        let starts = ["crate::", "super::"]
            .iter()
            .any(|s| code[k..].starts_with(s));
        let before_ok = k == 0
            || !(is_ident(bytes[k - 1] as char) || bytes[k - 1] == b'$' || bytes[k - 1] == b':');
        if starts && before_ok {
            let end = code[k..]
                .find(|c: char| !(is_ident(c) || c == ':'))
                .map_or(code.len(), |e| k + e);
            let path = code[k..end].trim_end_matches(':');
            push(k, line_of(&code, k), path);
            k = end;
        } else {
            k += 1;
        }
    }
    found
}

/// The unit (longest matching prefix of [`LAYERS`]) and layer index of a module path.
fn unit_of(path: &[String]) -> Option<(&'static str, usize)> {
    let joined = path.join("::");
    LAYERS
        .iter()
        .enumerate()
        .flat_map(|(layer, (_, prefixes))| prefixes.iter().map(move |p| (*p, layer)))
        .filter(|(p, _)| {
            if p.is_empty() {
                path.is_empty()
            } else {
                joined == *p || joined.starts_with(&format!("{p}::"))
            }
        })
        .max_by_key(|(p, _)| p.len())
}

/// The module an import names: the longest prefix of its path that is a module of the crate
/// (items and re-exports of the root are mapped through [`ROOT_REEXPORTS`]).
fn target_module(path: &[String], modules: &BTreeSet<Vec<String>>) -> Vec<String> {
    if let [item, ..] = path
        && let Some((_, m)) = ROOT_REEXPORTS.iter().find(|(name, _)| name == item)
    {
        return vec![m.to_string()];
    }
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
        .unwrap_or_default()
}

#[derive(Debug, Default)]
struct Report {
    imports: usize,
    violations: Vec<String>,
    unmapped: Vec<String>,
    cycle: Option<Vec<String>>,
    /// A circle among modules (LAYER-2), each edge with one import that makes it.
    module_cycle: Option<Vec<String>>,
}

/// The module of the code map a module path belongs to (LAYER-2): its first two segments.
fn map_module(path: &[String]) -> String {
    path.iter().take(2).cloned().collect::<Vec<_>>().join("::")
}

/// Check sources given as (path under `src/`, text).
fn check(files: &[(String, String)]) -> Report {
    let module_of = |f: &str| -> Vec<String> {
        let f = f.trim_end_matches(".rs");
        if f == "lib" {
            return Vec::new();
        }
        f.split('/').map(str::to_string).collect()
    };
    let mut report = Report::default();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(f, _)| module_of(f)).collect();
    let mut graph: BTreeMap<&'static str, BTreeSet<&'static str>> = BTreeMap::new();
    let mut modules_graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut witness: BTreeMap<(String, String), String> = BTreeMap::new();
    for (file, src) in files {
        let module = module_of(file);
        if module.last().is_some_and(|m| m == "tests") {
            continue;
        }
        let Some((from_unit, from_layer)) = unit_of(&module) else {
            report.unmapped.push(file.clone());
            continue;
        };
        for imp in imports_of(file, &module, src) {
            report.imports += 1;
            let target = target_module(&imp.path, &modules);
            let Some((to_unit, to_layer)) = unit_of(&target) else {
                report
                    .unmapped
                    .push(format!("{}:{} {}", imp.file, imp.line, imp.path.join("::")));
                continue;
            };
            if to_unit != from_unit {
                graph.entry(from_unit).or_default().insert(to_unit);
            }
            let (a, b) = (map_module(&module), map_module(&target));
            let contains = |outer: &str, inner: &str| {
                outer.is_empty() || inner == outer || inner.starts_with(&format!("{outer}::"))
            };
            if !contains(&a, &b) && !contains(&b, &a) {
                witness
                    .entry((a.clone(), b.clone()))
                    .or_insert_with(|| format!("src/{}:{}", imp.file, imp.line));
                modules_graph.entry(a).or_default().insert(b);
            }
            if to_layer > from_layer {
                report.violations.push(format!(
                    "src/{}:{}: `{}` (layer {}) imports `crate::{}` (module `{}`, layer {}), a higher layer",
                    imp.file,
                    imp.line,
                    imp.from.join("::"),
                    LAYERS[from_layer].0,
                    imp.path.join("::"),
                    target.join("::"),
                    LAYERS[to_layer].0,
                ));
            }
        }
    }
    report.cycle = find_cycle(&graph);
    report.module_cycle = find_cycle(&modules_graph).map(|c| {
        c.windows(2)
            .map(|e| {
                let at = &witness[&(e[0].clone(), e[1].clone())];
                format!("{} -> {} ({at})", e[0], e[1])
            })
            .collect()
    });
    report
}

/// A cycle in a graph, if any (depth-first search).
fn find_cycle<N: Ord + Clone + ToString>(graph: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<String>> {
    fn visit<N: Ord + Clone + ToString>(
        n: &N,
        graph: &BTreeMap<N, BTreeSet<N>>,
        state: &mut BTreeMap<N, u8>,
        stack: &mut Vec<N>,
    ) -> Option<Vec<String>> {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).unwrap();
                    let mut cycle: Vec<String> =
                        stack[at..].iter().map(ToString::to_string).collect();
                    cycle.push(m.to_string());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n).copied().unwrap_or(0) == 0
            && let Some(c) = visit(n, graph, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn read_sources(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("src/ is readable")
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if path.is_dir() {
            if rel != "bin" {
                read_sources(&path, root, out);
            }
        } else if rel.ends_with(".rs") && path.file_name().is_none_or(|n| n != "tests.rs") {
            out.push((
                rel,
                std::fs::read_to_string(&path).expect("a source file is UTF-8"),
            ));
        }
    }
}

#[test]
fn imports_point_down_the_layer_order_and_form_no_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_sources(&root, &root, &mut files);
    let report = check(&files);
    // The parser must have read the crate: a checker that parses nothing passes everything.
    assert!(
        files.len() > 50,
        "read only {} files under src/",
        files.len()
    );
    assert!(
        report.imports > 300,
        "found only {} crate imports in src/",
        report.imports
    );
    assert!(
        report.unmapped.is_empty(),
        "modules in no layer of LAYERS: {:#?}",
        report.unmapped
    );
    assert!(
        report.violations.is_empty(),
        "{} import(s) point up the layer order (ARCHITECTURE.md, LAYER-1):\n{}",
        report.violations.len(),
        report.violations.join("\n")
    );
    assert_eq!(
        report.cycle, None,
        "an import circle among the units of LAYERS"
    );
    assert_eq!(
        report.module_cycle, None,
        "an import circle among the modules of the code map (LAYER-2)"
    );
}

#[test]
fn checker_finds_a_circle_between_two_modules_of_one_layer_but_not_with_a_parent() {
    let report = example(&[
        (
            "actors.rs",
            "pub mod stage;\npub mod supervisor;\nfn f() -> self::stage::StageMsg { todo!() }\n",
        ),
        (
            "actors/stage.rs",
            "mod replica;\nuse crate::actors::panic_text;\n",
        ),
        (
            "actors/stage/replica.rs",
            "use crate::actors::supervisor::spawn::Grow;\nuse super::StageMsg;\n",
        ),
        ("actors/supervisor.rs", "pub mod spawn;\n"),
        (
            "actors/supervisor/spawn.rs",
            "use crate::actors::stage::StageMsg;\nuse super::super::panic_text;\n",
        ),
    ]);
    assert_eq!(report.cycle, None, "{report:#?}");
    assert_eq!(
        report.module_cycle,
        Some(vec![
            "actors::stage -> actors::supervisor (src/actors/stage/replica.rs:1)".to_string(),
            "actors::supervisor -> actors::stage (src/actors/supervisor/spawn.rs:1)".to_string(),
        ]),
        "{report:#?}"
    );
    let parent_only = example(&[
        (
            "actors.rs",
            "pub mod stage;\nfn f() -> self::stage::StageMsg { todo!() }\n",
        ),
        ("actors/stage.rs", "use crate::actors::panic_text;\n"),
    ]);
    assert_eq!(parent_only.module_cycle, None, "{parent_only:#?}");
}

fn example(files: &[(&str, &str)]) -> Report {
    check(
        &files
            .iter()
            .map(|(f, s)| (f.to_string(), s.to_string()))
            .collect::<Vec<_>>(),
    )
}

#[test]
fn checker_finds_an_upward_import_in_use_trees_paths_and_fn_bodies() {
    let report = example(&[
        ("comm.rs", "pub mod tcp;\nuse crate::mesh::Rank;\n"),
        (
            "comm/tcp.rs",
            "use crate::{mesh::{Rank, Generation as G}, actors::stage::StageMsg};\n\
             fn f() { let x = crate::job::Job::builder(); }\n\
             use super::super::cluster::control;\n",
        ),
        ("mesh.rs", "pub struct Rank;\n"),
        (
            "actors.rs",
            "pub mod stage;\nmod local { fn f() -> super::stage::StageMsg { todo!() } }",
        ),
        ("actors/stage.rs", "use crate::comm::tcp::TcpGroup;\n"),
        ("job.rs", ""),
        ("cluster.rs", ""),
        ("cluster/control.rs", ""),
    ]);
    assert_eq!(report.imports, 8, "{report:#?}");
    assert_eq!(report.violations.len(), 3, "{report:#?}");
    assert!(report.violations[0].starts_with("src/comm/tcp.rs:1: `comm::tcp` (layer comm)"));
    assert!(report.violations[0].contains("`crate::actors::stage::StageMsg`"));
    assert!(report.violations[0].contains("layer runtime"));
    assert!(
        report.violations[1].contains(":3:") && report.violations[1].contains("cluster::control")
    );
    assert!(
        report.violations[2].contains(":2:") && report.violations[2].contains("crate::job::Job")
    );
    assert_eq!(
        report.cycle,
        Some(vec![
            "actors".to_string(),
            "comm".to_string(),
            "actors".to_string()
        ])
    );
}

#[test]
fn checker_ignores_comments_strings_doc_links_and_test_modules() {
    let report = example(&[
        (
            "mesh.rs",
            "//! See [`crate::job::Job`].\n\
             /* crate::actors::x /* nested crate::job */ */\n\
             const S: &str = \"crate::actors::stage\";\n\
             const R: &str = r#\"use crate::job::Job;\"#;\n\
             const C: char = '\"'; fn f<'a>(x: &'a u8) -> u8 { *x }\n\
             #[cfg(test)]\nmod tests { use crate::job::Job; fn g() { crate::actors::f() } }\n\
             pub(crate) fn ok() -> crate::trace::Span { todo!() }\n",
        ),
        ("trace.rs", ""),
        ("job.rs", ""),
        ("actors.rs", ""),
    ]);
    assert_eq!(report.violations, Vec::<String>::new());
    assert_eq!(report.imports, 1, "crate::trace::Span only: {report:#?}");
}

#[test]
fn checker_refuses_a_module_outside_every_layer_and_maps_root_reexports() {
    let report = example(&[
        (
            "mesh.rs",
            "use crate::newthing::X;\nfn f() -> crate::Result<()> { Ok(()) }\n",
        ),
        ("newthing.rs", ""),
        ("error.rs", ""),
    ]);
    assert_eq!(report.unmapped.len(), 2, "{report:#?}");
    assert!(
        report.unmapped.iter().all(|u| u.contains("newthing")),
        "{report:#?}"
    );
    assert_eq!(report.violations.len(), 1, "{report:#?}");
    assert!(
        report.violations[0].contains("module `error`, layer outcome"),
        "{report:#?}"
    );
}

/// The pipeline's walk and what it stands on — the instruction walk, the block seam it calls
/// (`BlockStep`), the links, the step's record, its errors, the wire format, the overlap
/// lane, the schedule, the memory points and the collectives as values — name no Burn type:
/// the walk is unit-tested with a fake block (`pipeline_exec/walk/tests.rs`). The block's
/// Burn work is `typed_stage.rs`, the actor's seam `work.rs`.
const BURN_FREE: &[&str] = &[
    "parallel/pipeline_exec/walk.rs",
    "parallel/pipeline_exec/block.rs",
    "parallel/pipeline_exec/links.rs",
    "parallel/pipeline_exec/timeline.rs",
    "parallel/pipeline_exec/error.rs",
    "parallel/pipeline_exec/wire.rs",
    "parallel/pipeline_exec/overlap.rs",
    "parallel/memory.rs",
    "parallel/pipeline.rs",
    "parallel/pipeline/schedule.rs",
    "parallel/pipeline/simulate.rs",
    "parallel/sync/collective.rs",
];

/// Burn's crate and the names of Burn types here and in meshwork: a file that names none of
/// them and imports no glob (which could bring them from a parent) reaches no Burn type.
const BURN_NAMES: &[&str] = &[
    "burn",
    "Tensor",
    "TensorData",
    "Device",
    "Module",
    "Autodiff",
    "AnyTensor",
    "Boundary",
    "InputsFn",
    "TypedStage",
    "StageWork",
];

/// Where a file's code (comments, strings and test modules aside) names Burn or imports a
/// glob: (line, what).
fn burn_in(src: &str) -> Vec<(usize, String)> {
    let mut code = strip(src);
    blank_test_modules(&mut code);
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        if line.contains("::*") {
            found.push((n + 1, "a glob import".to_string()));
        }
        for word in line.split(|c: char| !is_ident(c)) {
            if BURN_NAMES.contains(&word) {
                found.push((n + 1, word.to_string()));
            }
        }
    }
    found
}

#[test]
fn the_pipeline_walk_and_its_seams_name_no_burn_type() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut bad = Vec::new();
    for file in BURN_FREE {
        let src = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("{file} is listed as free of Burn but not readable: {e}"));
        bad.extend(
            burn_in(&src)
                .into_iter()
                .map(|(line, what)| format!("{file}:{line}: {what}")),
        );
    }
    assert!(bad.is_empty(), "Burn reached the walk:\n{}", bad.join("\n"));
}

#[test]
fn the_burn_check_finds_a_burn_type_and_a_glob_but_not_comments_or_tests() {
    let found = burn_in(
        "// Tensor in a comment\nuse super::*;\nfn f(d: &Device) -> DeviceId { todo!() }\n\
         const S: &str = \"burn\";\n#[cfg(test)]\nmod tests { use burn::tensor::Tensor; }\n",
    );
    assert_eq!(
        found,
        vec![(2, "a glob import".to_string()), (3, "Device".to_string())]
    );
}
