//! The book's code is real: every Rust block is included from a compiled example, and every
//! other block is included from a file this test parses or runs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use meshwork::testing::TempDir;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("book/src is readable") {
        let p = entry.expect("directory entry").path();
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
}

/// (language, body, file) of every fenced block of the book.
fn blocks() -> Vec<(String, String, PathBuf)> {
    let mut files = Vec::new();
    markdown_files(&root().join("book/src"), &mut files);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable chapter");
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if let Some(lang) = line.strip_prefix("```") {
                let body: Vec<&str> = lines
                    .by_ref()
                    .take_while(|l| !l.starts_with("```"))
                    .collect();
                out.push((lang.to_string(), body.join("\n"), f.clone()));
            }
        }
    }
    out
}

/// The file and anchor of a `{{#include path:anchor}}` block, resolved from the chapter.
fn include(body: &str, chapter: &Path) -> Option<(PathBuf, Option<String>)> {
    let inner = body
        .trim()
        .strip_prefix("{{#include ")?
        .strip_suffix("}}")?;
    let (path, anchor) = match inner.rsplit_once(':') {
        Some((p, a)) => (p, Some(a.to_string())),
        None => (inner, None),
    };
    Some((chapter.parent()?.join(path), anchor))
}

#[test]
fn every_book_block_is_included_from_a_checked_file() {
    let all = blocks();
    assert!(all.len() >= 6, "the book has code blocks");
    let mut included = BTreeSet::new();
    for (lang, body, chapter) in &all {
        let (file, anchor) = include(body, chapter).unwrap_or_else(|| {
            panic!(
                "a {lang:?} block in {} is not an include: {body}",
                chapter.display()
            )
        });
        let file = file
            .canonicalize()
            .unwrap_or_else(|_| panic!("{} exists", file.display()));
        let text = std::fs::read_to_string(&file).expect("included file readable");
        if let Some(a) = anchor {
            assert!(
                text.contains(&format!("ANCHOR: {a}")),
                "anchor {a} in {}",
                file.display()
            );
            assert!(text.contains(&format!("ANCHOR_END: {a}")));
        }
        if lang.starts_with("rust") {
            let examples = root().join("examples").canonicalize().unwrap();
            assert!(
                file.starts_with(&examples),
                "Rust blocks come from examples/"
            );
        }
        included.insert(
            file.strip_prefix(root().canonicalize().unwrap())
                .unwrap()
                .to_path_buf(),
        );
    }
    // The non-Rust files, each checked by a test below.
    for f in [
        "book/snippets/Cargo-dependency.toml",
        "book/snippets/commands.sh",
        "book/snippets/faults.json",
        "book/snippets/multi-machine.sh",
        "book/snippets/meshwork.sbatch",
    ] {
        assert!(
            included.contains(Path::new(f)),
            "{f} is included by the book"
        );
    }
}

#[test]
fn schedule_pictures_are_what_the_library_draws_today() {
    use meshwork::parallel::pipeline::{Costs, Schedule, render_svg, simulate};
    for schedule in [
        Schedule::GPipe { micro_batches: 8 },
        Schedule::OneFOneB { micro_batches: 8 },
        Schedule::Interleaved {
            micro_batches: 8,
            virtual_stages: 2,
        },
    ] {
        let v = u64::from(schedule.virtual_stages());
        let plan = schedule.instructions(4).expect("valid schedule");
        let report = simulate(&plan, &Costs::new(2 / v, 4 / v)).expect("simulates");
        let path = root().join(format!("book/src/images/{}.svg", schedule.name()));
        let committed = std::fs::read_to_string(&path).expect("picture committed");
        assert_eq!(
            committed,
            render_svg(&report.timeline),
            "{} is stale: rerun `cargo run --example pipeline_schedules -- book/src/images`",
            path.display()
        );
    }
}

#[test]
fn the_books_fault_plan_parses_and_names_every_kind_it_shows() {
    use meshwork::faults::{FaultKind, FaultPlan};
    let text = std::fs::read_to_string(root().join("book/snippets/faults.json")).unwrap();
    let plan = FaultPlan::from_json(&text).expect("the book's fault plan is valid");
    assert_eq!(plan.seed, 42);
    let kinds: Vec<&FaultKind> = plan.faults.iter().map(|f| &f.kind).collect();
    assert!(matches!(
        kinds[..],
        [
            FaultKind::Kill,
            FaultKind::DropMessage { message: 0 },
            FaultKind::Panic,
            FaultKind::CorruptMessage { message: 1 },
            FaultKind::Slow { .. }
        ]
    ));
}

#[test]
fn dependency_snippet_parses_and_pins_our_burn_version() {
    let snippet: toml::Table = toml::from_str(
        &std::fs::read_to_string(root().join("book/snippets/Cargo-dependency.toml")).unwrap(),
    )
    .expect("the snippet is valid TOML");
    let ours: toml::Table =
        toml::from_str(&std::fs::read_to_string(root().join("Cargo.toml")).unwrap()).unwrap();
    let version = |t: &toml::Table| {
        t["dependencies"]["burn"]["version"]
            .as_str()
            .map(str::to_string)
    };
    assert_eq!(version(&snippet), version(&ours));
    assert!(snippet["dependencies"].get("meshwork").is_some());
    assert!(snippet["dependencies"].get("tokio").is_some());
}

#[test]
fn every_command_of_the_book_runs() {
    let script = std::fs::read_to_string(root().join("book/snippets/commands.sh")).unwrap();
    let dir = TempDir::new("book");
    std::fs::create_dir_all(dir.path()).unwrap();
    let mut ran = 0;
    for line in script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let args = line
            .strip_prefix("cargo run --release -- ")
            .unwrap_or_else(|| panic!("book command is not `cargo run --release -- …`: {line}"));
        // Paths into the book are relative to the repository.
        let args: Vec<String> = args
            .split_whitespace()
            .map(|a| {
                if a.starts_with("book/") {
                    root().join(a).display().to_string()
                } else {
                    a.to_string()
                }
            })
            .collect();
        let args = args.join(" ");
        let out = Command::new(env!("CARGO_BIN_EXE_meshwork"))
            .args(args.split_whitespace())
            .current_dir(dir.path())
            .output()
            .expect("the meshwork binary runs");
        assert!(
            out.status.success(),
            "`{line}` failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if args.contains("--json") {
            let stdout = String::from_utf8_lossy(&out.stdout);
            for l in stdout.lines() {
                let v: serde_json::Value =
                    serde_json::from_str(l).expect("one JSON object per line");
                let keys: &[&str] = if args.contains("pipeline") {
                    &[
                        "pp",
                        "micro_batches",
                        "schedule",
                        "samples_per_s",
                        "bubble_measured",
                        "bubble_theoretical",
                        "peak_stash",
                        "peak_activation_bytes",
                    ]
                } else {
                    &[
                        "world",
                        "bytes",
                        "algo",
                        "algbw_gbps",
                        "busbw_gbps",
                        "memcpy_gbps",
                    ]
                };
                for key in keys {
                    assert!(v.get(key).is_some(), "key {key} in {l}");
                }
            }
        }
        if args.contains("--timeline") {
            let svg = std::fs::read_to_string(dir.join("pipeline.svg")).expect("timeline written");
            assert!(svg.starts_with("<svg"));
        }
        if args.contains("--save-model") {
            assert!(dir.join("demo-model.mpk").exists(), "the model was written");
        }
        ran += 1;
    }
    assert!(ran >= 4);
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The multi-machine chapter's shell: both files parse (`bash -n`); with the `cluster`
/// feature, every flag given to `meshwork train` or `meshwork node` is one the command has.
#[test]
fn multi_machine_scripts_parse_and_use_real_flags() {
    for f in [
        "book/snippets/multi-machine.sh",
        "book/snippets/meshwork.sbatch",
    ] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(root().join(f))
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "{f} does not parse: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(root().join(f)).unwrap();
        let mut commands = 0;
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(at) = words.iter().position(|w| *w == "meshwork") else {
                continue;
            };
            let sub = words[at + 1];
            assert!(["train", "node"].contains(&sub), "{line}");
            commands += 1;
            #[cfg(feature = "cluster")]
            {
                let help = Command::new(env!("CARGO_BIN_EXE_meshwork"))
                    .args([sub, "--help"])
                    .output()
                    .expect("meshwork runs");
                let help = String::from_utf8_lossy(&help.stdout);
                for flag in words[at + 2..].iter().filter(|w| w.starts_with("--")) {
                    assert!(
                        help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                        "`meshwork {sub}` has no {flag} (in {f})"
                    );
                }
            }
        }
        assert!(commands >= 1, "{f} runs meshwork");
    }
}
