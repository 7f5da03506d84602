//! A job across processes, embedded in a program of your own (feature `cluster`). Run
//! plainly, this program is the head: it starts two copies of itself as nodes
//! (`cluster node HEAD_ADDR`), waits for them, trains its own model (`Regressor`, described to
//! the nodes as a `ModelSpec` of a kind it registers in a `ModelRegistry`) with one replica per node, and stops them. With
//! `pipeline`, the model's two layers become two pipeline stages instead, one per node (a
//! 1 × 2 dp × pp mesh). On real machines the nodes are started by hand, torchrun or Slurm.
//!
//! With `mpi` under an MPI launcher, the launcher starts every process and MPI's world is the
//! job's; the job's bytes move through MPI (feature `mpi`).
//!
//! ```text
//! cargo run --features cluster --example cluster
//! cargo run --features cluster --example cluster -- pipeline
//! cargo build --features mpi --example cluster
//! mpirun -n 3 target/debug/examples/cluster mpi
//! ```

// ANCHOR: imports
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::cluster::control::{
    self, ClusterSecret, FingerprintFn, Head, HeadConfig, HostArgs, HostFactory, Incompatibility,
    JobSpec, ModelRegistry, ModelSpec, NodeConfig,
};
use meshwork::cluster::remote::ClusterMesh;
use meshwork::demo::{Sample, TeacherTask, batch_tensors, mlp_pipeline};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::job::{Job, JobBuilder, JobConfig, PipelineModel, Schedule};
use meshwork::job_config::PipelineConfig;
// ANCHOR_END: imports

const JOB: &str = "example";
const NODES: usize = 2;

// ANCHOR: model
/// The program's own model: plain Burn, nothing of meshwork in it.
#[derive(Module, Debug)]
struct Regressor {
    hidden: Linear,
    out: Linear,
}

impl Regressor {
    fn new([d_in, hidden, d_out]: [usize; 3], device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(d_in, hidden).init(device),
            out: LinearConfig::new(hidden, d_out).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }
}

/// The loss: the mean over the items, as every meshwork loss.
fn loss(model: &Regressor, items: &[Sample], device: &Device) -> Tensor<1> {
    let (x, y) = batch_tensors(items, device);
    let diff = model.forward(x) - y;
    (diff.clone() * diff).mean()
}

/// How the head names the model to its nodes: a kind of the program's choosing and the
/// configuration's bytes in the program's own encoding (here three little-endian widths).
const KIND: &str = "example-regressor";

fn model_spec(widths: [u32; 3]) -> ModelSpec {
    ModelSpec {
        kind: KIND.into(),
        config: widths.iter().flat_map(|w| w.to_le_bytes()).collect(),
    }
}

/// The widths a spec names; bytes from the network are checked, never trusted.
fn widths(spec: &JobSpec) -> Result<[usize; 3], Incompatibility> {
    let ModelSpec { kind, config } = &spec.model;
    if kind != KIND {
        return Err(Incompatibility::UnknownModel { kind: kind.clone() });
    }
    let words: Vec<u32> = config
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    match words[..] {
        [a, b, c] if config.len() == 12 && [a, b, c].iter().all(|w| (1..=4096).contains(w)) => {
            Ok([a as usize, b as usize, c as usize])
        }
        _ => Err(Incompatibility::Other(format!(
            "{KIND}: expected three widths of 1..=4096, got {} byte(s)",
            config.len()
        ))),
    }
}
// ANCHOR_END: model

// ANCHOR: job
/// The job, built the same way in every process: the head drives it, each node trains its
/// replica with it. Everything that shapes training is the description the head sends
/// (`spec.job`); the data is built (or read) by every process itself.
fn job(spec: &JobSpec) -> Result<JobBuilder<Regressor, Sample>, Incompatibility> {
    let (widths, device, task) = model_parts(spec)?;
    Ok(settings(Job::builder(), spec, &task)
        .initial_model(Regressor::new(widths, &device))
        .loss(loss))
}

/// The same job as a pipeline: each of the model's two layers a stage on its own node.
fn pipeline_job(
    spec: &JobSpec,
    shape: &PipelineConfig,
) -> Result<JobBuilder<PipelineModel, Sample>, Incompatibility> {
    let (widths, device, task) = model_parts(spec)?;
    if shape.stages != 2 {
        return Err(Incompatibility::Other(
            "the model has two layers: two stages".into(),
        ));
    }
    let blocks = mlp_pipeline(&widths, &[1, 1], &device)
        .ok_or_else(|| Incompatibility::Other("a block per stage".into()))?;
    Ok(settings(
        Job::builder().pipeline(blocks, shape.schedule),
        spec,
        &task,
    ))
}

/// The model's widths, the seeded device every process initializes it on, and the task.
fn model_parts(spec: &JobSpec) -> Result<([usize; 3], Device, TeacherTask), Incompatibility> {
    let widths = widths(spec)?;
    let device = MeshDevice::of_kind(BackendKind::Flex, 1)
        .map_err(|e| Incompatibility::Other(e.to_string()))?
        .remove(0);
    device.burn().seed(spec.job.seed);
    let task = TeacherTask {
        d_in: widths[0],
        d_out: widths[2],
        noise: 0.1,
        seed: spec.job.seed,
    };
    Ok((widths, device.burn().clone(), task))
}

/// What every process's job shares.
fn settings<M: Send + 'static>(
    builder: JobBuilder<M, Sample>,
    spec: &JobSpec,
    task: &TeacherTask,
) -> JobBuilder<M, Sample> {
    // The head's whole description (seed, batch, steps, optimizer and rate, the pipeline's
    // schedule, every strategy): every process trains alike; the data is this program's own.
    builder
        .with_config(spec.job.clone())
        .data(task.dataset(4096))
}

/// The model kinds this program trains: one, its own. A node fingerprints and builds the kind a
/// job names and refuses a job of a kind it has not registered.
fn models() -> ModelRegistry {
    ModelRegistry::new().register(KIND, fingerprint(), stages())
}

/// How a node builds its stages once the head prepared it: replicas, or pipeline stages.
fn stages() -> HostFactory {
    Arc::new(|args: HostArgs| {
        let host = match args.spec.job.pipeline {
            None => job(&args.spec).map(|j| j.stage_host(args)),
            Some(shape) => pipeline_job(&args.spec, &shape).map(|j| j.stage_host(args)),
        };
        host.map_err(|e| e.to_string())?.map_err(|e| e.to_string())
    })
}

/// How every process fingerprints the job's model: its structure (each parameter's shape),
/// so that a node which builds another model is refused.
fn fingerprint() -> FingerprintFn {
    Arc::new(|spec: &JobSpec| {
        let (widths, device, _) = model_parts(spec)?;
        Ok(control::structure_fingerprint(
            KIND,
            &Regressor::new(widths, &device),
        ))
    })
}
// ANCHOR_END: job

// ANCHOR: node
/// A node: join the head, serve its stages until the head ends the job.
async fn node(head: String, secret: ClusterSecret) -> Result<(), Box<dyn std::error::Error>> {
    let config = NodeConfig::for_models(head, JOB, secret, 1, &models());
    let outcome = control::run_node(config, |_| {}).await?;
    for (rank, steps) in outcome.trained {
        println!("node: rank {} trained {steps} steps", rank.0);
    }
    Ok(())
}
// ANCHOR_END: node

// ANCHOR: head
/// The job: the program's model, one replica per node, or (`pipelined`) one pipeline stage per
/// node, described once (the same value a `JobBuilder`'s setters fill, or a file holds).
fn the_spec(pipelined: bool) -> JobSpec {
    let mut job = JobConfig {
        seed: 1,
        batch_size: Some(64),
        steps: 30,
        optimizer: AdamConfig::new().into(),
        learning_rate: 3e-3,
        // A pipeline of one stage per node: a 1 × 2 dp × pp mesh.
        pipeline: pipelined.then_some(PipelineConfig {
            stages: NODES as u32,
            schedule: Schedule::OneFOneB { micro_batches: 4 },
        }),
        ..JobConfig::default()
    };
    job.comm.timeout = Duration::from_secs(20);
    JobSpec::new(model_spec([32, 64, 4]), job, BackendKind::Flex)
}

/// The head: listen on `listen`, start this program as its nodes when `start`, wait for the
/// nodes, train across them, stop them.
async fn head(
    secret: ClusterSecret,
    spec: JobSpec,
    listen: &str,
    start: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let pipelined = spec.job.pipeline.is_some();
    let mut head = Head::start(HeadConfig::new(listen, JOB, secret)).await?;
    let children = if start {
        start_nodes(head.local_addr())?
    } else {
        Vec::new()
    };
    let fingerprint = models().fingerprint(&spec)?;
    let world = head
        .assemble(
            NODES,
            &spec,
            fingerprint,
            Vec::new(),
            Duration::from_secs(60),
        )
        .await?;
    // Every rank on a node (the head holds none).
    let mesh = ClusterMesh::new(&world, &head.node_handles(), None)?;
    let summary = match &spec.job.pipeline {
        None => {
            let handle = job(&spec)?.cluster(mesh).build()?.spawn();
            handle.await?.join().await.map(|t| t.summary)
        }
        Some(shape) => {
            let handle = pipeline_job(&spec, shape)?.cluster(mesh).build()?.spawn();
            handle.await?.join().await.map(|t| t.summary)
        }
    };
    head.shutdown("the job is over").await;
    wait_for(children);
    let summary = summary?;
    println!(
        "trained across {NODES} processes ({}): loss {:.4} -> {:.4}",
        if pipelined {
            "one pipeline stage each"
        } else {
            "one replica each"
        },
        summary.first_loss.unwrap_or(f32::NAN),
        summary.last_loss.unwrap_or(f32::NAN)
    );
    Ok(())
}
// ANCHOR_END: head

// ANCHOR: mpi
/// Under an MPI launcher (`mpirun -n 3 target/debug/examples/cluster mpi`, feature `mpi`):
/// MPI's world is the job's (rank 0 the head, the others its nodes), and every group's bytes
/// move through MPI.
#[cfg(feature = "mpi")]
async fn under_mpi(secret: ClusterSecret) -> Result<(), Box<dyn std::error::Error>> {
    use meshwork::cluster::rendezvous::{self, Role};
    let world = meshwork::comm::mpi::init()?;
    let launched = rendezvous::from_mpi(world, |k| std::env::var(k).ok())?;
    match launched.role() {
        Role::Head { listen, .. } => {
            let mut spec = the_spec(false);
            spec.job.transport = meshwork::comm::DataTransport::Mpi;
            head(secret, spec, &listen, false).await
        }
        Role::Node { join, .. } => node(join, secret).await,
    }
}
// ANCHOR_END: mpi

/// Starts this program `NODES` times as a node of the head at `addr`.
fn start_nodes(addr: SocketAddr) -> std::io::Result<Vec<Child>> {
    let me = std::env::current_exe()?;
    (0..NODES)
        .map(|_| Command::new(&me).args(["node", &addr.to_string()]).spawn())
        .collect()
}

/// Waits (bounded) for the nodes to end, killing any that do not.
fn wait_for(mut children: Vec<Child>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for c in &mut children {
        while matches!(c.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Every process of the job holds the same secret (here: the head hands it to its children
    // through the environment).
    if std::env::var_os("MESHWORK_SECRET").is_none() {
        // SAFETY: set first thing, before any other thread exists.
        unsafe { std::env::set_var("MESHWORK_SECRET", "an example secret, not for real jobs") };
    }
    let secret = control::secret_from_env()?;
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Runtime::new()?;
    match args.get(1).map(String::as_str) {
        Some("node") => {
            let addr = args.get(2).cloned().ok_or("node HEAD_ADDR")?;
            runtime.block_on(node(addr, secret))
        }
        Some("pipeline") => runtime.block_on(head(secret, the_spec(true), "127.0.0.1:0", true)),
        #[cfg(feature = "mpi")]
        Some("mpi") => {
            let trained = runtime.block_on(under_mpi(secret));
            drop(runtime);
            meshwork::comm::mpi::finalize();
            trained
        }
        _ => runtime.block_on(head(secret, the_spec(false), "127.0.0.1:0", true)),
    }
}
