//! `meshwork`: the command line.
//!
//! - `meshwork train …` trains the demo model (a noisy linear teacher, see `meshwork::demo`)
//!   on logical devices, with a progress bar and a final report;
//! - `meshwork bench allreduce …` measures collective bandwidth (like nccl-tests);
//! - `meshwork bench dp …` measures data-parallel weak scaling against a plain Burn loop;
//! - `meshwork bench tensor …` measures one tensor-parallel GPT layer against tp 1;
//! - `meshwork bench layer …` measures one GPT layer per core against its matmul bound and
//!   PyTorch;
//! - `meshwork node …` (feature `cluster`) joins a multi-process job whose head is
//!   `meshwork train --listen … --nodes …`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The command line's allocator: mimalloc keeps the pages of freed buffers for the next
/// step's tensors of the same sizes, where the system allocator returns large buffers to the
/// kernel and every step faults them in again (a quarter of a transformer layer's step time on
/// `flex`, measured by `meshwork bench layer`; see the book's performance chapter), once
/// [`tune_allocator`] has set it so. A program embedding meshwork chooses its own.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` and `mi_option_allow_thp` in the `mi_option_t` enum of the
/// mimalloc (v3) that libmimalloc-sys 0.1.49 builds (`c_src/mimalloc/v3/include/mimalloc.h`),
/// which the crate does not name; a test checks them by their defaults.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Two of mimalloc's defaults cost a training step time on `flex`, which allocates every
/// result afresh (issue 50: a third of a GPT's step was the kernel zeroing pages):
/// - it returns freed memory of over 512 KiB to the kernel a second after it is freed (its
///   purge delay), and the next step faults every page in again: kept instead, as PyTorch's
///   caching allocator keeps freed blocks (the process holds its peak step's memory);
/// - it asks for transparent huge pages on its large regions (`madvise`), and the kernel
///   compacts memory to find them when they fault in: turned off for the process
///   (`PR_SET_THP_DISABLE`, what mimalloc does at start with `MIMALLOC_ALLOW_THP=0`), as
///   PyTorch asks for none by default.
///
/// Measured with the dev binary, `meshwork train --model gpt --dp 1 --steps 8 --d-model 256
/// --layers 4 --heads 8 --context 128 --batch-size 16`, three alternated runs each (the
/// book's performance chapter has the figures). `MIMALLOC_PURGE_DELAY` and
/// `MIMALLOC_ALLOW_THP` in the environment still decide when they are set.
fn tune_allocator() {
    for (variable, option, value) in [
        ("MIMALLOC_PURGE_DELAY", MI_OPTION_PURGE_DELAY, -1),
        ("MIMALLOC_ALLOW_THP", MI_OPTION_ALLOW_THP, 0),
    ] {
        if std::env::var_os(variable).is_none() {
            // SAFETY: sets one of mimalloc's option values (an atomic in the library); any
            // thread may, at any time.
            unsafe { libmimalloc_sys::mi_option_set(option, value) };
        }
    }
    // mimalloc reads `allow_thp` once, when it starts (before `main`), and then turns huge
    // pages off for the process with `prctl`: set later, the option alone changed nothing
    // (the process still held 393 MB of huge pages). Done here as mimalloc would have.
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE takes integer arguments and sets a flag of this process.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
}

mod allreduce_bench;
mod bench;
mod bench_run;
#[cfg(feature = "cluster")]
mod cluster;
mod comm_bench;
mod comm_svg;
mod demo_job;
#[cfg(feature = "cluster")]
mod dp_across;
mod dp_bench;
mod gpt_bench;
mod gpt_train;
mod job_file;
#[cfg(feature = "cluster")]
mod launched;
mod layer_bench;
mod layout_bench;
#[cfg(feature = "cluster")]
mod local_nodes;
mod memory_bench;
mod memory_svg;
#[cfg(feature = "mpi")]
mod mpi_bench;
mod optimizer_bench;
mod pipeline_bench;
mod plan;
mod recovery_bench;
mod scale_bench;
mod scaling_svg;
mod settings;
#[cfg(feature = "cluster")]
mod tcp_bench;
mod tensor_bench;
mod tensor_svg;
mod train;

/// Train Burn models on many devices at once.
#[derive(Debug, Parser)]
#[command(name = "meshwork", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train the demo model (the main job).
    Train(Box<train::TrainArgs>),
    /// Join a multi-process job as a node (feature `cluster`): connect to the head, hold
    /// devices, follow the head until it ends the job.
    #[cfg(feature = "cluster")]
    Node(cluster::NodeArgs),
    /// Every layout of a model over a machine, ranked by predicted step time, with its bytes
    /// per device and why the others do not fit; `--check K` runs the K fastest.
    Plan(Box<plan::PlanArgs>),
    /// Benchmarks: collectives and data-parallel scaling.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,ractor_cluster=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // `meshwork train --config`: a flag given on the command line overrides its key.
    if let (Command::Train(args), Some(("train", m))) = (&mut cli.command, matches.subcommand()) {
        args.given = m
            .ids()
            .filter(|id| {
                m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)
            })
            .map(|id| id.to_string())
            .collect();
    }
    let result = match cli.command {
        Command::Train(args) => train::run(*args),
        Command::Bench { which } => bench::run(which),
        Command::Plan(args) => plan::run(*args),
        #[cfg(feature = "cluster")]
        Command::Node(args) => cluster::run_node(args),
    };
    match result {
        Ok(()) => {
            // Under `--transport mpi` every process finalises MPI (mpirun counts a process
            // that exits without it as failed).
            #[cfg(feature = "mpi")]
            meshwork::comm::mpi::finalize();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            // A failed process of an MPI job ends the whole job at once, named by the
            // launcher's report (MPI_Finalize would wait for the others instead).
            #[cfg(feature = "mpi")]
            if let Some(world) = meshwork::comm::mpi::world() {
                world.abort(1);
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod allocator_tests {
    use super::{MI_OPTION_ALLOW_THP, MI_OPTION_PURGE_DELAY};

    /// The option numbers name the options meant: each reads its mimalloc v3 default before
    /// anything sets it (the purge delay's 1000 ms is no other option's default), and the
    /// option before `allow_thp`, `page_cross_thread_max_reclaim`, reads its 32.
    #[test]
    fn the_option_numbers_are_the_purge_delay_and_huge_pages() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some()
            || std::env::var_os("MIMALLOC_ALLOW_THP").is_some()
        {
            return;
        }
        // SAFETY: reads option values.
        let read = |option| unsafe { libmimalloc_sys::mi_option_get(option) };
        assert_eq!(read(MI_OPTION_PURGE_DELAY), 1000, "not the purge delay");
        assert_eq!(read(MI_OPTION_ALLOW_THP), 1, "not allow_thp");
        assert_eq!(
            read(MI_OPTION_ALLOW_THP - 1),
            32,
            "not page_cross_thread_max_reclaim"
        );
    }
}
