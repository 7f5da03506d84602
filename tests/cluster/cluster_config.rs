//! A job as a file across processes (issue 51): the recipe chapter's composition of the small
//! GPT (dp 2 × pp 2 × tp 2, ZeRO-1, bf16, clipping, accumulation, warm-up and cosine),
//! written by `meshwork train --print-config`, trained with `--config` by a head and four node
//! processes and in one process: the same parameters, bitwise, every rank trained in a node.
//! The commands are the book's (`book/snippets/multi-machine.sh`, anchor `recipe`), with a
//! smaller GPT, local addresses and the test's paths.
#![cfg(feature = "cluster")]

use std::path::PathBuf;
use std::time::Duration;

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, parameter_bits};

use crate::cluster_procs::Proc;
use crate::cluster_tensor::{STEPS, gpt_flags, load_gpt};
use crate::cluster_training::{ranks_trained, run_to_end};

#[test]
fn the_recipe_from_a_file_trains_across_node_processes_as_in_one_process() {
    let dir = TempDir::new("recipe-file");
    std::fs::create_dir_all(dir.path()).unwrap();
    let book = BookRecipe::read();
    let config = book.write_file(&dir);
    let alone = book.in_one_process(&dir, &config);

    let across = dir.join("across.mpk");
    let across_path = across.display().to_string();
    let node: Vec<&str> = book.node.iter().map(String::as_str).collect();
    let head = BookRecipe::paths(&book.head, &config, &across_path);
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let (out, procs) = run_to_end("recipe-file", &vec![&node[..]; book.nodes], &head);
    assert!(
        out.contains("world assembled: 8 rank(s) over 5 process(es)"),
        "{out}"
    );
    assert!(
        out.contains(".tensor_parallel(2)") && out.contains(".zero(One)"),
        "{out}"
    );
    // Really distributed: every rank of the 2 × 2 × 2 mesh trained every step in a node.
    assert_eq!(
        ranks_trained(&procs, 2, STEPS),
        (0..8).collect::<Vec<u32>>()
    );
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    assert!(
        parameter_bits(&load_gpt(&across, &device)) == parameter_bits(&load_gpt(&alone, &device)),
        "the file's job across processes ends bitwise where it ends in one process"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The book's commands for the recipe on several machines: what follows `meshwork` in the
/// `--print-config` line (up to the redirection), the head's flags after its `--listen` and
/// `--nodes`, how many nodes it waits for, a node's flags after its `--join`, and the mpirun
/// line's process count and `meshwork train` flags (its `--transport mpi` left to the
/// test's launcher).
pub(crate) struct BookRecipe {
    print: Vec<String>,
    head: Vec<String>,
    nodes: usize,
    node: Vec<String>,
    pub(crate) mpirun_n: String,
    pub(crate) mpirun: Vec<String>,
}

impl BookRecipe {
    pub(crate) fn read() -> Self {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/book/snippets/multi-machine.sh"
        );
        let text = std::fs::read_to_string(path).expect("the book's snippet");
        let lines: Vec<Vec<String>> = text
            .lines()
            .skip_while(|l| l.trim() != "# ANCHOR: recipe")
            .take_while(|l| l.trim() != "# ANCHOR_END: recipe")
            .filter(|l| l.starts_with("meshwork "))
            .map(|l| l.split_whitespace().skip(1).map(str::to_string).collect())
            .collect();
        let [print, head, node] = &lines[..] else {
            panic!("the recipe's anchor has a print, a head and a node line: {lines:?}");
        };
        let print: Vec<String> = print.iter().take_while(|w| *w != ">").cloned().collect();
        assert!(print.iter().any(|w| w == "--print-config"), "{print:?}");
        let after = |words: &[String], flag: &str| -> (String, Vec<String>) {
            let at = words.iter().position(|w| w == flag).expect(flag);
            (words[at + 1].clone(), words[at + 2..].to_vec())
        };
        let (_, rest) = after(head, "--listen");
        let (nodes, head) = after(&rest, "--nodes");
        let (_, node) = after(node, "--join");
        let mpirun: Vec<String> = text
            .lines()
            .skip_while(|l| l.trim() != "# ANCHOR: recipe")
            .find(|l| l.starts_with("mpirun "))
            .expect("the recipe's mpirun line")
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let (mpirun_n, _) = after(&mpirun, "-n");
        let (_, train) = after(&mpirun, "meshwork");
        let mut flags = train.into_iter();
        let mut mpirun = Vec::new();
        while let Some(w) = flags.next() {
            if w == "--transport" {
                assert_eq!(flags.next().as_deref(), Some("mpi"), "the MPI transport");
            } else {
                mpirun.push(w);
            }
        }
        Self {
            print,
            head,
            nodes: nodes.parse().expect("--nodes N"),
            node,
            mpirun_n,
            mpirun,
        }
    }

    /// Writes the recipe's file in `dir` with the book's `--print-config` line on the tests'
    /// small GPT (its `--save-model` is the CLI's own, not the job's); returns its path.
    pub(crate) fn write_file(&self, dir: &TempDir) -> String {
        let unsaved = dir.join("unused.mpk");
        let size = gpt_flags(&unsaved, STEPS);
        let size = size.chunks(2).filter(|pair| pair[0] != "--model");
        let recipe: Vec<&str> = self
            .print
            .iter()
            .map(String::as_str)
            .chain(size.flatten().map(String::as_str))
            .collect();
        let mut print = Proc::spawn("recipe-print", &recipe, None);
        let (status, _) = print.wait_exit(Duration::from_secs(60));
        assert!(status.success(), "{}", print.output());
        let file = dir.join("recipe.toml");
        std::fs::write(&file, print.output() + "\n").unwrap();
        file.display().to_string()
    }

    /// The file's job in one process; returns the trained model's path.
    pub(crate) fn in_one_process(&self, dir: &TempDir, config: &str) -> PathBuf {
        let alone = dir.join("alone.mpk");
        let alone_path = alone.display().to_string();
        let mut one = Proc::spawn(
            "recipe-file-alone",
            &["train", "--config", config, "--save-model", &alone_path],
            None,
        );
        let (status, _) = one.wait_exit(Duration::from_secs(180));
        assert!(status.success(), "in one process:\n{}", one.output());
        alone
    }

    /// `words` with the book's file and model names replaced by the test's.
    pub(crate) fn paths(words: &[String], config: &str, model: &str) -> Vec<String> {
        words
            .iter()
            .map(|w| match w.as_str() {
                "recipe.toml" => config.to_string(),
                "gpt.bpk" => model.to_string(),
                _ => w.clone(),
            })
            .collect()
    }
}
