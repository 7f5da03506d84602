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
/// `flex`, measured by `meshwork bench layer`; see the book's performance chapter). A program
/// embedding meshwork chooses its own.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
mod gpt_train;
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,ractor_cluster=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
