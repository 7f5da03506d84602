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

/// COMP-3: the composition matrix in the book is the one table's, as `matrix_markdown` writes
/// it. `MESHWORK_BLESS=1 cargo test --test book composition` rewrites the snippet.
#[test]
fn the_books_composition_matrix_is_the_table() {
    let path = root().join("book/snippets/composition.md");
    let want = meshwork::composition::matrix_markdown();
    if std::env::var_os("MESHWORK_BLESS").is_some() {
        std::fs::write(&path, &want).expect("snippet writable");
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "book/snippets/composition.md is not the table's matrix: rerun with MESHWORK_BLESS=1"
    );
    let chapter = std::fs::read_to_string(root().join("book/src/status.md")).unwrap();
    assert!(chapter.contains("{{#include ../snippets/composition.md}}"));
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
        "book/snippets/kubernetes.yaml",
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
                        "bubble_simulated",
                        "peak_stash",
                        "peak_activation_bytes",
                    ]
                } else if args.contains("bench layer") {
                    &[
                        "job_samples_per_s",
                        "burn_loop_samples_per_s",
                        "matmul_bound_samples_per_s",
                        "job_over_bound",
                    ]
                } else if args.contains(" plan ") || args.starts_with("plan ") {
                    &["layout", "predicted", "unfit"]
                } else if args.contains("bench gpt") {
                    &[
                        "dp",
                        "meshwork_windows_per_s",
                        "meshwork_validation_loss",
                        "achieved_gflops_per_core",
                        "matmul_gflops_per_core",
                    ]
                } else if args.contains("bench optimizer") {
                    &[
                        "rule",
                        "burn_ns",
                        "flat_ns",
                        "memcpy_ns",
                        "flat_over_memcpy",
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
        if args.contains("--svg scaling.svg") {
            let svg = std::fs::read_to_string(dir.join("scaling.svg")).expect("picture written");
            assert!(svg.starts_with("<svg") && svg.contains("Amdahl"), "{svg}");
        }
        if args.contains("--save-model") {
            assert!(dir.join("demo-model.bpk").exists(), "the model was written");
        }
        ran += 1;
    }
    assert!(ran >= 4);
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The book's shell files parse (`bash -n`) and each runs meshwork.
#[test]
fn book_shell_snippets_parse() {
    for f in [
        "book/snippets/commands.sh",
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
        assert!(
            text.contains("meshwork ") || text.contains("cargo run --release -- "),
            "{f} runs meshwork"
        );
    }
}

/// `meshwork <command> --help` (for `bench`, `bench <which> --help`).
#[cfg(feature = "cluster")]
fn help(command: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .args(command)
        .arg("--help")
        .output()
        .expect("meshwork runs");
    assert!(out.status.success(), "meshwork {command:?} --help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `help` lists `flag` (`--steps <STEPS>`, `--dry-run  Assemble…`).
#[cfg(feature = "cluster")]
fn lists(help: &str, flag: &str) -> bool {
    help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n"))
}

/// The `--flags` of a command's words, values and `=value` left out.
#[cfg(feature = "cluster")]
fn flags<'a>(words: impl Iterator<Item = &'a str>) -> Vec<String> {
    words
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| {
            w.split('=')
                .next()
                .unwrap_or(w)
                .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .to_string()
        })
        .collect()
}

/// Every flag the book gives to meshwork is one the CLI has: in the shell files, each command
/// (`meshwork train …`, `cargo run --release -- bench dp …`) against its own `--help`; in the
/// chapters' text, every `--flag` in inline code against the help of every command (Cargo's
/// own flags before ` -- `, every other cargo command and other programs' commands left out).
#[cfg(feature = "cluster")]
#[test]
fn book_flags_are_the_clis() {
    let benches: Vec<String> = help(&["bench"])
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "help")
        .map(str::to_string)
        .collect();
    assert!(benches.len() >= 4, "bench commands: {benches:?}");
    let mut helps = std::collections::BTreeMap::new();
    helps.insert("train".to_string(), help(&["train"]));
    helps.insert("node".to_string(), help(&["node"]));
    helps.insert("plan".to_string(), help(&["plan"]));
    for b in &benches {
        helps.insert(format!("bench {b}"), help(&["bench", b]));
    }
    let mut checked = 0;
    // The shell files: each meshwork command against its own flags.
    for f in [
        "book/snippets/commands.sh",
        "book/snippets/multi-machine.sh",
        "book/snippets/meshwork.sbatch",
    ] {
        let text = std::fs::read_to_string(root().join(f)).unwrap();
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(at) = words
                .iter()
                .position(|w| *w == "meshwork" || *w == "--")
                .filter(|&at| words.get(at + 1).is_some())
            else {
                continue;
            };
            let mut command = words[at + 1].to_string();
            let mut rest = at + 2;
            if command == "bench" {
                command = format!("bench {}", words[at + 2]);
                rest += 1;
            }
            let help = helps
                .get(&command)
                .unwrap_or_else(|| panic!("`meshwork {command}` is no command (in {f}: {line})"));
            for flag in flags(words[rest..].iter().copied()) {
                assert!(
                    lists(help, &flag),
                    "`meshwork {command}` has no {flag} (in {f})"
                );
                checked += 1;
            }
        }
    }
    // The chapters: every flag in inline code is one of some meshwork command.
    let mut files = Vec::new();
    markdown_files(&root().join("book/src"), &mut files);
    let others = [
        "srun", "sbatch", "mpirun", "openssl", "torchrun", "mdbook", "ssh", "git",
    ];
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for span in text.split('`').skip(1).step_by(2) {
            // Environment variables before the command (`BURN_DEVICE=flex cargo test …`).
            let words: Vec<&str> = span
                .split_whitespace()
                .skip_while(|w| {
                    w.split_once('=')
                        .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
                })
                .collect();
            let from = match words.first() {
                // `cargo run … -- <meshwork's flags>`; any other cargo command's flags, also
                // after ` -- ` (`cargo test … -- --nocapture`), are Cargo's or libtest's.
                Some(&"cargo") if words.get(1) == Some(&"run") => {
                    match words.iter().position(|w| *w == "--") {
                        Some(at) => at + 1,
                        None => continue,
                    }
                }
                Some(&"cargo") => continue,
                Some(w) if others.contains(w) => continue,
                _ => 0,
            };
            for flag in flags(words[from..].iter().copied()) {
                assert!(
                    helps.values().any(|h| lists(h, &flag)),
                    "{} names {flag} (in `{span}`), which no meshwork command has",
                    file.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 50, "checked {checked} flags");
}

/// The lines between `ANCHOR: name` and `ANCHOR_END: name` of a book snippet, comments left
/// out.
#[cfg(feature = "cluster")]
fn anchor_lines(file: &str, name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(file)).expect("snippet readable");
    text.lines()
        .skip_while(|l| l.trim() != format!("# ANCHOR: {name}"))
        .skip(1)
        .take_while(|l| l.trim() != format!("# ANCHOR_END: {name}"))
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// A port nothing listens on now, for a recipe's `29500`.
#[cfg(feature = "cluster")]
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string()
}

/// A shell running one command of the book; killed when dropped (also when the test fails).
#[cfg(feature = "cluster")]
struct Shell {
    name: &'static str,
    child: std::process::Child,
    log: PathBuf,
}

#[cfg(feature = "cluster")]
impl Shell {
    /// Runs `script` in bash in `dir`, with `HOME` there and the `meshwork` under test first
    /// on `PATH`; output to `dir/<name>.log`.
    fn start(name: &'static str, dir: &Path, script: &str) -> Shell {
        let bin = Path::new(env!("CARGO_BIN_EXE_meshwork"));
        let path = format!(
            "{}:{}",
            bin.parent().expect("the binary's folder").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new("bash")
            .args(["-c", script])
            .current_dir(dir)
            .env("HOME", dir)
            .env("PATH", path)
            .env("RUST_LOG", "warn,ractor_cluster=error")
            .env("BURN_DEVICE", "flex")
            .env_remove("MESHWORK_SECRET")
            .env_remove("MESHWORK_SECRET_FILE")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("SLURM_PROCID")
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("bash runs");
        Shell { name, child, log }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) for the command to end; its output.
    fn finish(&mut self, timeout: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                let out = self.output();
                assert!(status.success(), "{} failed ({status}):\n{out}", self.name);
                return out;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} still running after {timeout:?}:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

#[cfg(feature = "cluster")]
impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The chapter "Running on several machines" as a reader runs it, on one machine: the secret's
/// commands, then the head's command and the nodes' command (twice, as on two hosts), as
/// written but for the head's host name (`head-host` is this machine) and its port (a free
/// one), to the end of training.
#[cfg(feature = "cluster")]
#[test]
fn multi_machine_recipe_trains_as_written() {
    use std::time::Duration;
    let file = "book/snippets/multi-machine.sh";
    // The secret's commands: made once (on a shared file system), exported in every shell.
    let (exports, once): (Vec<String>, Vec<String>) = anchor_lines(file, "secret")
        .into_iter()
        .partition(|l| l.starts_with("export "));
    assert!(
        !exports.is_empty() && !once.is_empty(),
        "make and export a secret"
    );
    let secret = exports.join("\n");
    let head = anchor_lines(file, "head");
    let node = anchor_lines(file, "nodes");
    assert_eq!(
        (head.len(), node.len()),
        (1, 1),
        "one head and one node command"
    );
    assert!(
        !head[0].contains("--dry-run"),
        "the recipe trains: {}",
        head[0]
    );
    let port = free_port();
    let here = |line: &str| {
        line.replace("head-host", "127.0.0.1")
            .replace("29500", &port)
    };
    let dir = TempDir::new("recipe");
    std::fs::create_dir_all(dir.path()).unwrap();
    let script = |line: &str| format!("set -euo pipefail\n{secret}\nexec {}", here(line));
    Shell::start("secret", dir.path(), &once.join("\n")).finish(Duration::from_secs(10));
    let mut head_shell = Shell::start("head", dir.path(), &script(&head[0]));
    let mut nodes: Vec<Shell> = ["node a", "node b"]
        .into_iter()
        .map(|name| Shell::start(name, dir.path(), &script(&node[0])))
        .collect();
    let out = head_shell.finish(Duration::from_secs(240));
    assert!(
        out.contains("world assembled: 4 rank(s) over 3 process(es)"),
        "{out}"
    );
    let steps: u64 = head[0]
        .split_whitespace()
        .skip_while(|w| *w != "--steps")
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("the recipe gives --steps");
    for n in &mut nodes {
        let out = n.finish(Duration::from_secs(60));
        assert!(
            out.contains(&format!("trained {steps} step(s)")),
            "{}: {out}",
            n.name
        );
    }
    assert!(
        dir.join("demo.bpk").exists(),
        "the head wrote the trained model:\n{out}"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The chapter's certificates, made with its `openssl` commands (for `localhost` instead of
/// `head-host`), carry a TLS job: the head presents them, both nodes trust the authority and
/// train (a few steps instead of the default, to keep the test short).
#[cfg(feature = "cluster")]
#[test]
fn the_books_certificates_carry_a_tls_job() {
    use std::time::Duration;
    let file = "book/snippets/multi-machine.sh";
    let certs = anchor_lines(file, "tls-certs");
    let tls = anchor_lines(file, "tls");
    assert!(
        certs.iter().any(|l| l.starts_with("openssl x509")),
        "{certs:?}"
    );
    assert_eq!(tls.len(), 2, "one head and one node command: {tls:?}");
    let secret = anchor_lines(file, "secret");
    let port = free_port();
    let here = |line: &str| {
        line.replace("head-host", "localhost")
            .replace("29500", &port)
    };
    let dir = TempDir::new("tls-recipe");
    std::fs::create_dir_all(dir.path()).unwrap();
    let made: Vec<String> = secret.iter().chain(&certs).map(|l| here(l)).collect();
    Shell::start(
        "certificates",
        dir.path(),
        &format!("set -euo pipefail\n{}", made.join("\n")),
    )
    .finish(Duration::from_secs(30));
    let exports: Vec<&String> = secret.iter().filter(|l| l.starts_with("export ")).collect();
    let script = |line: String| {
        format!(
            "set -euo pipefail\n{}\nexec {line}",
            exports
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    let mut head = Shell::start(
        "head",
        dir.path(),
        &script(format!("{} --steps 5", here(&tls[0]))),
    );
    let mut nodes: Vec<Shell> = ["node a", "node b"]
        .into_iter()
        .map(|name| Shell::start(name, dir.path(), &script(here(&tls[1]))))
        .collect();
    let out = head.finish(Duration::from_secs(120));
    assert!(out.contains("control plane: TLS"), "{out}");
    for n in &mut nodes {
        let out = n.finish(Duration::from_secs(60));
        assert!(out.contains("trained 5 step(s)"), "{}: {out}", n.name);
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The book's Kubernetes manifests (`book/snippets/kubernetes.yaml`) fit meshwork's rendezvous:
/// an indexed Job whose pods run `meshwork train` with flags the CLI has; a headless Service
/// selecting those pods whose name is the Job's subdomain, so `MASTER_ADDR` (pod 0 under it)
/// resolves, on the `MASTER_PORT` it exposes; the secret from the Secret's key; and each pod's
/// variables (its completion index as `RANK`) make pod 0 the head listening on that port and
/// every other pod a node joining it, as torchrun's convention reads them (RDV-1).
#[cfg(feature = "cluster")]
#[test]
fn the_books_kubernetes_manifests_fit_the_rendezvous() {
    use meshwork::cluster::rendezvous::{self, Role};
    use yaml_rust2::{Yaml, YamlLoader};

    let text = std::fs::read_to_string(root().join("book/snippets/kubernetes.yaml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("the manifests are YAML");
    let of_kind = |kind: &str| -> &Yaml {
        let found: Vec<&Yaml> = docs
            .iter()
            .filter(|d| d["kind"].as_str() == Some(kind))
            .collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0]
    };
    let (secret, service, job) = (of_kind("Secret"), of_kind("Service"), of_kind("Job"));
    let str_of = |y: &Yaml, what: &str| -> String {
        y.as_str()
            .map(str::to_string)
            .or_else(|| y.as_i64().map(|i| i.to_string()))
            .unwrap_or_else(|| panic!("{what} is not set"))
    };

    // The Job: indexed, every pod at once.
    let spec = &job["spec"];
    assert_eq!(spec["completionMode"].as_str(), Some("Indexed"));
    let world = spec["completions"].as_i64().expect("completions");
    assert_eq!(
        spec["parallelism"].as_i64(),
        Some(world),
        "every process at once"
    );
    let pod = &spec["template"]["spec"];
    let job_name = str_of(&job["metadata"]["name"], "the Job's name");

    // The Service: headless, named as the pods' subdomain, selecting the Job's pods.
    let service_name = str_of(&service["metadata"]["name"], "the Service's name");
    assert_eq!(
        service["spec"]["clusterIP"].as_str(),
        Some("None"),
        "headless"
    );
    assert_eq!(
        service["spec"]["publishNotReadyAddresses"].as_bool(),
        Some(true)
    );
    assert_eq!(str_of(&pod["subdomain"], "subdomain"), service_name);
    let labels = &spec["template"]["metadata"]["labels"];
    for (k, v) in service["spec"]["selector"].as_hash().expect("a selector") {
        assert_eq!(
            &labels[k.as_str().unwrap()],
            v,
            "the Service selects the Job's pods"
        );
    }

    // The container: meshwork train with the CLI's flags, torchrun's variables.
    let containers = pod["containers"].as_vec().expect("containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    let command: Vec<String> = c["command"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|w| str_of(w, "command"))
        .collect();
    assert_eq!(command, ["meshwork", "train"]);
    let args: Vec<String> = c["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|w| str_of(w, "args"))
        .collect();
    let train = help(&["train"]);
    for flag in flags(args.iter().map(String::as_str)) {
        assert!(lists(&train, &flag), "`meshwork train` has no {flag}");
    }
    let mut env = std::collections::BTreeMap::new();
    for var in c["env"].as_vec().expect("env") {
        env.insert(str_of(&var["name"], "a variable's name"), var);
    }
    let index_ref = "metadata.annotations['batch.kubernetes.io/job-completion-index']";
    assert_eq!(
        env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some(index_ref),
        "RANK is the pod's completion index"
    );
    assert_eq!(
        str_of(&env["WORLD_SIZE"]["value"], "WORLD_SIZE"),
        world.to_string()
    );
    let head = str_of(&env["MASTER_ADDR"]["value"], "MASTER_ADDR");
    assert_eq!(
        head,
        format!("{job_name}-0.{service_name}"),
        "pod 0 under the Service"
    );
    let port = str_of(&env["MASTER_PORT"]["value"], "MASTER_PORT");
    let ports: Vec<String> = service["spec"]["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|p| str_of(&p["port"], "port"))
        .collect();
    assert!(
        ports.contains(&port),
        "the Service exposes {port}: {ports:?}"
    );
    let from_secret = &env["MESHWORK_SECRET"]["valueFrom"]["secretKeyRef"];
    assert_eq!(
        str_of(&from_secret["name"], "the secret's name"),
        str_of(&secret["metadata"]["name"], "the Secret's name")
    );
    let key = str_of(&from_secret["key"], "the secret's key");
    assert!(
        !secret["stringData"][key.as_str()].is_badvalue(),
        "the Secret has {key}"
    );

    // Each pod's variables, as the rendezvous reads them.
    for index in 0..world {
        let rank = index.to_string();
        let vars = |k: &str| match k {
            "RANK" => Some(rank.clone()),
            "WORLD_SIZE" => Some(world.to_string()),
            "MASTER_ADDR" => Some(head.clone()),
            "MASTER_PORT" => Some(port.clone()),
            _ => None,
        };
        let r = rendezvous::from_env(vars)
            .expect("the variables parse")
            .expect("a launcher's variables");
        assert_eq!((r.process.0 as i64, r.processes as i64), (index, world));
        match r.role() {
            Role::Head { listen, nodes } => {
                assert_eq!(index, 0);
                assert_eq!(listen, format!("0.0.0.0:{port}"));
                assert_eq!(nodes as i64, world - 1);
            }
            Role::Node { join, .. } => {
                assert_ne!(index, 0);
                assert_eq!(join, format!("{head}:{port}"));
            }
        }
    }
}
