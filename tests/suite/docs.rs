//! The docs say each fact once, and say it true. STATUS-1 (the status page is the code's
//! table, and its tests exist) is stated in `composition::status` and tested here, with the
//! docs' own rules:
//!
//! - DOCS-1: no page but the status page states where a capability works ("not yet",
//!   "works in one process", "not across processes" and the like); text in code spans and
//!   blocks is not read, and neither are the troubleshooting page's quoted errors, which
//!   DOCS-2 checks instead.
//! - DOCS-2: every error the troubleshooting page quotes (a `>` line) is what a format string
//!   of the library prints (its pieces in order, four words at least), or shares five words
//!   in a row with one: it quotes a real message. Not checked: errors quoted inline (in a code
//!   span), and what a quote says in a placeholder's place or beyond its five words.
//! - DOCS-3: every relative link of the book, README.md and ARCHITECTURE.md names a file that
//!   exists and, with `#anchor`, a heading of that page.
//! - DOCS-4: every table of measured figures in the book names, in the paragraphs around it,
//!   its command, its build (release or debug), the machine and the date.
//!
//! `MESHWORK_BLESS=1 cargo test --test suite docs::` rewrites the generated snippets.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.md` page of the book, README.md and ARCHITECTURE.md.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("readable directory") {
            let p = entry.expect("directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    walk(&root().join("book/src"), &mut out);
    out.sort();
    out
}

/// The folder a page's relative links start from: its own, but the book's for a generated
/// snippet (its links are read where a chapter includes it).
fn link_base(page: &Path) -> PathBuf {
    let folder = page.parent().expect("a page's folder");
    if folder.ends_with("book/snippets") {
        root().join("book/src")
    } else {
        folder.to_path_buf()
    }
}

/// The page's prose lines (1-based line numbers): fenced blocks left out, inline code spans
/// blanked (a span may wrap onto the next line of its paragraph).
fn prose(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut in_code = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if line.trim().is_empty() {
            in_code = false;
        }
        if fenced || line.trim_start().starts_with("{{#include") {
            continue;
        }
        let mut kept = String::new();
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                kept.push(' ');
            } else if !in_code {
                kept.push(c);
            }
        }
        out.push((i + 1, kept));
    }
    out
}

#[test]
fn status_1_the_status_page_is_the_table_and_names_real_tests() {
    use meshwork::composition::status::{limitations_markdown, status_markdown};
    for (snippet, want, page) in [
        ("status.md", status_markdown(), "status.md"),
        ("limitations.md", limitations_markdown(), "faq.md"),
    ] {
        let path = root().join("book/snippets").join(snippet);
        if std::env::var_os("MESHWORK_BLESS").is_some() {
            std::fs::write(&path, &want).expect("snippet writable");
        }
        assert!(
            read(&path) == want,
            "book/snippets/{snippet} is not the status table's: rerun with MESHWORK_BLESS=1"
        );
        let page = read(&root().join("book/src").join(page));
        assert!(page.contains(&format!("{{{{#include ../snippets/{snippet}}}}}")));
    }
    let page = read(&root().join("book/src/status.md"));
    assert!(page.contains("{{#include ../snippets/composition.md}}"));
    for c in meshwork::composition::status::CAPABILITIES {
        for proof in c.proofs {
            if let meshwork::composition::status::Proof::Test(test) = proof {
                let (file, function) = test.split_once("::").expect("file::function");
                let text = read(&root().join(file));
                assert!(
                    text.contains(&format!("fn {function}(")),
                    "{}: {test} is not a test of {file}",
                    c.name
                );
            }
        }
    }
}

/// What states a capability's status: said on the status page only.
const STATUS_PHRASES: &[&str] = &[
    "not yet",
    "works in one process",
    "only in one process",
    "in one process only",
    "not across processes",
    "run across processes",
    "refused across processes",
    "not supported",
    "unsupported",
    "isn't supported",
];

#[test]
fn docs_1_only_the_status_page_states_a_status() {
    let mut found = Vec::new();
    for page in pages() {
        let name = page.strip_prefix(root()).unwrap_or(&page).to_path_buf();
        if name.ends_with("book/src/status.md") {
            continue;
        }
        let quotes_errors = name.ends_with("book/src/troubleshooting.md");
        for (n, line) in prose(&read(&page)) {
            if quotes_errors && line.trim_start().starts_with('>') {
                continue;
            }
            let lower = line.to_lowercase();
            for phrase in STATUS_PHRASES {
                if lower.contains(phrase) {
                    found.push(format!("{}:{n}: {phrase:?}", name.display()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "these pages state a status; say it in composition::status (the status page) and \
         link to it:\n{}",
        found.join("\n")
    );
}

/// The string literals of every `.rs` file under `dir`, one per line (comments left out).
fn string_literals(dir: &Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).expect("readable directory") {
        let p = entry.expect("directory entry").path();
        if p.is_dir() {
            string_literals(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = read(&p);
            let mut chars = text.chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    '/' if chars.peek() == Some(&'/') => {
                        chars.by_ref().take_while(|&c| c != '\n').for_each(drop);
                    }
                    // '"' is a character, not a string.
                    '\'' if chars.peek() == Some(&'"') => {
                        chars.next();
                    }
                    '"' => {
                        while let Some(c) = chars.next() {
                            match c {
                                '\\' => match chars.next() {
                                    // A continuation: the next line's indent is not text.
                                    Some('\n') => {
                                        while chars.peek().is_some_and(|c| c.is_whitespace()) {
                                            chars.next();
                                        }
                                        out.push(' ');
                                    }
                                    Some(e) => out.push(e),
                                    None => {}
                                },
                                '"' => break,
                                c => out.push(c),
                            }
                        }
                        out.push('\n');
                    }
                    _ => {}
                }
            }
        }
    }
}

/// The literal words of a message: lower case, outer punctuation trimmed; a word holding a
/// value (a digit, `…`, or a `{}` placeholder of a format string) is left out, so a quote
/// with values and the format string that printed it read the same.
fn literal_words(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || "`*\"".contains(c))
        .map(|w| w.trim_matches(|c: char| "()[]:;,.'".contains(c)))
        .filter(|w| {
            !w.is_empty()
                && !w.contains(|c: char| c.is_ascii_digit() || "{}…".contains(c))
                && !w.contains("...")
        })
        .map(str::to_lowercase)
        .collect()
}

/// A format string's literal pieces, split at its `{}` placeholders, each as its words.
fn segments(line: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut piece = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '{' {
            chars.by_ref().take_while(|&c| c != '}').for_each(drop);
            out.push(literal_words(&std::mem::take(&mut piece)));
        } else {
            piece.push(c);
        }
    }
    out.push(literal_words(&piece));
    out.retain(|s| !s.is_empty());
    out
}

/// Whether `quote` (its literal words) is what `format` (its pieces) prints: every piece in
/// order, at least `least` words in all. (What a placeholder printed is not checked: a
/// message quoted with words of its own after a placeholder passes.)
fn prints(format: &[Vec<String>], quote: &str, least: usize) -> bool {
    if format.iter().map(Vec::len).sum::<usize>() < least {
        return false;
    }
    let mut rest = quote;
    format.iter().all(|piece| {
        let piece = format!(" {} ", piece.join(" "));
        match rest.find(&piece) {
            Some(at) => {
                rest = &rest[at + piece.len() - 1..];
                true
            }
            None => false,
        }
    })
}

#[test]
fn docs_2_the_troubleshooting_page_quotes_real_errors() {
    // A whole format string of four words, or five words in a row of one.
    const LEAST: usize = 4;
    const RUN: usize = 5;
    let mut literals = String::new();
    string_literals(&root().join("src"), &mut literals);
    let formats: Vec<Vec<Vec<String>>> = literals.lines().map(segments).collect();
    let page = read(&root().join("book/src/troubleshooting.md"));
    // A quote is a run of `>` lines.
    let mut quotes: Vec<(usize, String)> = Vec::new();
    let mut open = false;
    for (i, line) in page.lines().enumerate() {
        match line.trim_start().strip_prefix('>') {
            Some(rest) if open => {
                let last = quotes.last_mut().expect("an open quote");
                last.1.push(' ');
                last.1.push_str(rest);
            }
            Some(rest) => {
                quotes.push((i + 1, rest.to_string()));
                open = true;
            }
            None => open = false,
        }
    }
    assert!(quotes.len() > 5, "the troubleshooting page quotes errors");
    let mut invented = Vec::new();
    for (line, quote) in &quotes {
        let w = literal_words(quote);
        let words = format!(" {} ", w.join(" "));
        let real = w.len() < LEAST
            || formats.iter().any(|f| prints(f, &words, LEAST))
            || w.windows(RUN).any(|run| {
                let run = format!(" {} ", run.join(" "));
                formats
                    .iter()
                    .flatten()
                    .any(|piece| format!(" {} ", piece.join(" ")).contains(&run))
            });
        if !real {
            invented.push(format!("troubleshooting.md:{line}: {quote}"));
        }
    }
    assert!(
        invented.is_empty(),
        "quoted errors that no message of the code contains:\n{}",
        invented.join("\n")
    );
}

/// mdBook's id of a heading: lower case, spaces to `-`, other punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(page: &str) -> Vec<String> {
    let mut fenced = false;
    page.lines()
        .filter_map(|l| {
            let t = l.trim_start();
            if t.starts_with("```") {
                fenced = !fenced;
            }
            (!fenced && t.starts_with('#')).then(|| slug(t.trim_start_matches('#')))
        })
        .collect()
}

/// The targets of the `[text](target)` links of `line`.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].to_string());
        rest = &after[end..];
    }
    out
}

#[test]
fn docs_3_every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let snippets = ["status.md", "limitations.md", "composition.md"]
        .map(|f| root().join("book/snippets").join(f));
    for page in pages().into_iter().chain(snippets) {
        let text = read(&page);
        for (n, line) in prose(&text) {
            for target in link_targets(&line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = match target.split_once('#') {
                    Some((f, a)) => (f, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved = if file.is_empty() {
                    page.clone()
                } else {
                    link_base(&page).join(file)
                };
                let name = page
                    .strip_prefix(root())
                    .unwrap_or(&page)
                    .display()
                    .to_string();
                if !resolved.exists() {
                    broken.push(format!("{name}:{n}: {target} (no such file)"));
                    continue;
                }
                if let Some(anchor) = anchor
                    && resolved.extension().is_some_and(|e| e == "md")
                    && !anchors(&read(&resolved)).iter().any(|a| a == anchor)
                {
                    broken.push(format!("{name}:{n}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Words of a table's header that make it a table of measured figures.
const MEASURED: &[&str] = &[
    "GB/s",
    "samples/s",
    "windows/s",
    "µs",
    " ms",
    "GFLOP",
    "time",
    "speed-up",
    "per step",
];

/// DOCS-4: every table of measured figures in the book says, within the paragraphs around
/// it, the command that measured it, the build (release or debug), the machine and the date.
#[test]
fn docs_4_every_figure_table_names_its_command_build_machine_and_date() {
    const AROUND: usize = 14;
    let mut bare = Vec::new();
    for page in pages() {
        let name = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        if !name.starts_with("book/") {
            continue;
        }
        let lines: Vec<String> = read(&page).lines().map(str::to_string).collect();
        let mut i = 0;
        while i < lines.len() {
            let is_row = |l: &str| l.trim_start().starts_with('|');
            if !is_row(&lines[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < lines.len() && is_row(&lines[i]) {
                i += 1;
            }
            let header = &lines[start];
            if !MEASURED.iter().any(|w| header.contains(w)) {
                continue;
            }
            let around =
                lines[start.saturating_sub(AROUND)..(i + AROUND).min(lines.len())].join("\n");
            let has_date = around.as_bytes().windows(10).any(|w| {
                w[..4].iter().all(u8::is_ascii_digit)
                    && w[4] == b'-'
                    && w[5..7].iter().all(u8::is_ascii_digit)
                    && w[7] == b'-'
                    && w[8..].iter().all(u8::is_ascii_digit)
            });
            let has_command = ["meshwork ", "cargo run", "compare.sh", "cargo bench"]
                .iter()
                .any(|c| around.contains(c));
            let has_build = ["release", "debug", "dev binary"]
                .iter()
                .any(|b| around.contains(b));
            let has_machine = ["core", "Xeon", "EPYC", "machine", "host"]
                .iter()
                .any(|m| around.contains(m));
            let missing: Vec<&str> = [
                (has_command, "command"),
                (has_build, "build"),
                (has_machine, "machine"),
                (has_date, "date"),
            ]
            .into_iter()
            .filter_map(|(has, what)| (!has).then_some(what))
            .collect();
            if !missing.is_empty() {
                bare.push(format!("{name}:{}: no {}", start + 1, missing.join(", ")));
            }
        }
    }
    assert!(
        bare.is_empty(),
        "figure tables that do not say where they come from:\n{}",
        bare.join("\n")
    );
}
