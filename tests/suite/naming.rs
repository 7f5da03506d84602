//! NAME-1: no two public types of the library share a name (`mesh::Layout` and the planner's
//! `Candidate`, not two `Layout`s), so a user's `use` never needs a rename to hold both.
//! NAME-2: every invariant id (`TCP-3`) is stated once: as the first word of a list item of a
//! module doc (`//! - TCP-3 …` or `//! - **TCP-3** …`) in one file only, so two families never
//! share a name; and every id `ARCHITECTURE.md` names is stated in a module doc (of the
//! library, or of a test file for the tests' own families).
//! NAME-3: `ARCHITECTURE.md` is a map, at most 30,000 bytes; the details live in module docs.
//!
//! Text scans, no dependency: the library's sources are every `.rs` file under `src/` except
//! `src/bin` (a crate of its own).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAP_LIMIT: usize = 30_000;

fn library_sources() -> Vec<(PathBuf, String)> {
    sources_under("src")
}

/// Every `.rs` file under `dir` of the package (`src/bin` left out).
fn sources_under(dir: &str) -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                if !path.ends_with("src/bin") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                out.push((path, text));
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir), &mut out);
    assert!(out.len() > 10, "the scan found the sources under {dir}");
    out
}

/// The id an invariant list item starts with (`TCP-3` in `- **TCP-3** (…)`), if any.
fn stated_id(doc_line: &str) -> Option<String> {
    let item = doc_line.trim_start().strip_prefix("- ")?;
    let item = item.strip_prefix("**").unwrap_or(item);
    invariant_ids(item)
        .into_iter()
        .next()
        .filter(|id| item.starts_with(id.as_str()))
}

/// Every `FAMILY-n` token of `text`: a family of capitals (and digits after the first), a
/// hyphen, a number, not part of a longer word.
fn invariant_ids(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut ids = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if starts_word && bytes[i].is_ascii_uppercase() {
            let mut j = i;
            while j < bytes.len() && (bytes[j].is_ascii_uppercase() || bytes[j].is_ascii_digit()) {
                j += 1;
            }
            let mut k = j + 1;
            while j < bytes.len()
                && bytes[j] == b'-'
                && k < bytes.len()
                && bytes[k].is_ascii_digit()
            {
                k += 1;
            }
            let ends_word =
                k >= bytes.len() || !(bytes[k].is_ascii_alphanumeric() || bytes[k] == b'_');
            if k > j + 1 && ends_word {
                ids.push(text[i..k].to_string());
                i = k;
                continue;
            }
        }
        i += 1;
    }
    ids
}

#[test]
fn name_1_no_two_public_types_share_a_name() {
    let mut defined: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (path, text) in library_sources() {
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_start();
            for kind in [
                "pub struct ",
                "pub enum ",
                "pub trait ",
                "pub type ",
                "pub union ",
            ] {
                if let Some(rest) = line.strip_prefix(kind) {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    let at = format!("{}:{}", path.display(), n + 1);
                    defined.entry(name).or_default().push(at);
                }
            }
        }
    }
    assert!(
        defined.contains_key("JobBuilder"),
        "the scan sees public types"
    );
    let shared: Vec<_> = defined.iter().filter(|(_, at)| at.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "public types sharing a name: {shared:#?}"
    );
}

#[test]
fn name_2_every_invariant_id_is_stated_once_and_the_map_names_only_stated_ids() {
    let mut stated: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut in_docs = BTreeSet::new();
    // The tests' own families (LAYER, REPRO, NAME) are stated in their files' docs.
    for (path, text) in library_sources().into_iter().chain(sources_under("tests")) {
        for line in text.lines() {
            let Some(doc) = line.trim_start().strip_prefix("//!") else {
                continue;
            };
            in_docs.extend(invariant_ids(doc));
            if let Some(id) = stated_id(doc) {
                stated
                    .entry(id)
                    .or_default()
                    .insert(path.display().to_string());
            }
        }
    }
    assert!(
        stated.contains_key("TCP-3"),
        "the scan sees invariant lists"
    );
    let twice: Vec<_> = stated.iter().filter(|(_, files)| files.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "invariant ids stated in more than one file (two families sharing a name, or a \
         restatement: cite the id elsewhere, do not start a list item with it): {twice:#?}"
    );
    let map =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
    let unknown: BTreeSet<_> = invariant_ids(&map)
        .into_iter()
        .filter(|id| !in_docs.contains(id))
        .collect();
    assert!(
        unknown.is_empty(),
        "ARCHITECTURE.md names ids no module doc states: {unknown:?}"
    );
}

#[test]
fn name_3_the_architecture_map_stays_a_map() {
    let map = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
        .expect("ARCHITECTURE.md");
    assert!(
        map.len() <= MAP_LIMIT,
        "ARCHITECTURE.md is {} bytes, over {MAP_LIMIT}: move details into module docs",
        map.len()
    );
}

#[test]
fn the_id_scanner_reads_ids_and_nothing_else() {
    assert_eq!(
        invariant_ids("TCP-3, see CKPT-1..5 and LINK-10."),
        ["TCP-3", "CKPT-1", "LINK-10"]
    );
    assert!(invariant_ids("x-1 ATCP-3x A- B-x").is_empty());
    assert_eq!(
        stated_id(" - **ZERO-4** each buffer"),
        Some("ZERO-4".into())
    );
    assert_eq!(
        stated_id(" - TCP-8 (forwarding): a range"),
        Some("TCP-8".into())
    );
    assert_eq!(stated_id(" - In [`world`], CTL-4 and CTL-5"), None);
}
