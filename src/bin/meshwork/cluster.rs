//! `meshwork node` and `meshwork train --listen … --nodes …`: the control plane from the
//! command line (feature `cluster`).
//!
//! Where a process stands in the job, in order of precedence: the flags (`--listen`,
//! `--join`), then torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, then Slurm's
//! `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_NODELIST`. Under a launcher, `meshwork train` in
//! process 0 runs the head and in every other process runs a node with one device, so one
//! command line serves every process (`srun meshwork train …`).

use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use meshwork::cluster::control::{
    self, ControlError, FingerprintFn, Head, HeadConfig, Incompatibility, JobSpec,
    ModelFingerprint, ModelRegistry, NodeConfig, NodeReport, ProcessIndex, protocol,
};
use meshwork::cluster::control::{HostArgs, HostFactory, KeepAlive, LateEvent, LateEvents};
use meshwork::cluster::remote::{ClusterMesh, MeshJoiner};
use meshwork::cluster::rendezvous::{self, Rendezvous, Role};
use meshwork::comm::DataTransport;
use meshwork::demo::{Mlp, Sample, TeacherTask, mlp_blocks, mlp_blocks_of, mse_loss, split_mlp};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::error::Error;
use meshwork::job::{Job, JobBuilder, JobControl};
use meshwork::parallel::pipeline::even_split;
use meshwork::parallel::stages::BlockOptions;
use meshwork::parallel::zero::ZeroStage;
use meshwork::recovery::OnReplicaLoss;

use crate::demo_job::{Configure, DemoJob, RunOptions};

mod demo;
pub(crate) use demo::{HeadJob, demo_job, demo_models};
use demo::{HeadSettings, head_settings, is_gpt, ranks_per_replica};

/// The flags `meshwork train` gets with the `cluster` feature.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ClusterTrainArgs {
    /// Run the head of a multi-process job: listen for nodes here (`host:port`, port 0 for
    /// any free port; the address is printed).
    #[arg(long)]
    pub(crate) listen: Option<String>,
    /// Nodes to wait for (with --listen).
    #[arg(long)]
    nodes: Option<u32>,
    /// The job's name: nodes join the job of the same name.
    #[arg(long, default_value = "meshwork")]
    job: String,
    /// How long the head waits for its nodes, in seconds.
    #[arg(long, default_value_t = 120.0)]
    join_timeout: f64,
    /// Devices the head process itself holds (default 0 with --listen); under a launcher,
    /// the devices every process holds (default 1).
    #[arg(long)]
    local_devices: Option<u32>,
    /// The address the head's own data-plane listeners bind (default: the --listen host,
    /// or MASTER_ADDR under a launcher).
    #[arg(long)]
    data_host: Option<IpAddr>,
    /// Assemble the world, prepare every node, then stop them and exit without training.
    #[arg(long)]
    dry_run: bool,
    /// The fewest replicas a data-parallel job trains with: below it (after losses) the job
    /// waits for nodes to join.
    #[arg(long)]
    min_replicas: Option<u32>,
    /// The most replicas a data-parallel job grows to; nodes that join beyond it wait as
    /// spares (a roll-back recovery replaces a lost node with one).
    #[arg(long)]
    max_replicas: Option<u32>,
    /// TLS on the control plane: the head's certificate chain (PEM), with --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// TLS on the control plane: the head's private key (PEM), with --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Under a launcher: the certificate authorities (PEM) the processes that become nodes
    /// trust to sign the head's certificate.
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// Under a launcher: the name the head's certificate must carry (default: MASTER_ADDR or
    /// the Slurm head host).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// What moves the data plane's bytes between processes: `tcp` (meshwork's own links,
    /// live recovery) or `mpi` (the system's MPI: start every process under the MPI launcher,
    /// `mpirun -n N meshwork train --transport mpi …`, with meshwork built with the `mpi`
    /// feature; a lost process ends the job, and rerunning the command resumes it).
    #[arg(long, value_enum, default_value_t = TransportChoice::Tcp)]
    pub(crate) transport: TransportChoice,
    /// Testing: speak this control protocol version instead of the build's.
    #[arg(long, hide = true)]
    pretend_protocol_version: Option<u16>,
}

/// `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportChoice {
    /// meshwork's authenticated TCP links.
    Tcp,
    /// The system's MPI (feature `mpi`).
    Mpi,
}

impl From<TransportChoice> for DataTransport {
    fn from(choice: TransportChoice) -> Self {
        match choice {
            TransportChoice::Tcp => DataTransport::Tcp,
            TransportChoice::Mpi => DataTransport::Mpi,
        }
    }
}

/// Flags of `meshwork node`.
#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    /// The head's address (`host:port`); default: from torchrun or Slurm variables.
    #[arg(long)]
    join: Option<String>,
    /// Devices this node process holds (the head's flag of the same name; `--devices` is
    /// accepted too).
    #[arg(long = "local-devices", visible_alias = "devices", default_value_t = 1)]
    devices: u32,
    /// What this node's devices compute on: flex (Burn's CPU backend) or wgpu (a GPU, or
    /// Mesa's software Vulkan). The head's --device must name the same: a job never mixes
    /// backends, and a node of another is refused, naming both.
    #[arg(long, default_value = "flex")]
    device: BackendKind,
    /// The job's name (as given to the head).
    #[arg(long, default_value = "meshwork")]
    job: String,
    /// This node's name (default: host-pid).
    #[arg(long)]
    name: Option<String>,
    /// How long to try to reach the head and be greeted, in seconds.
    #[arg(long, default_value_t = 120.0)]
    join_timeout: f64,
    /// How long the head may stay silent once joined, in seconds.
    #[arg(long, default_value_t = 10.0)]
    head_timeout: f64,
    /// TLS on the control plane: the certificate authorities (PEM) that sign the head's
    /// certificate; the node refuses a head they did not sign.
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// The name the head's certificate must carry (default: the host of --join).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// Testing: speak this control protocol version instead of the build's.
    #[arg(long, hide = true)]
    pretend_protocol_version: Option<u16>,
    /// Testing: build a model whose fingerprint differs from the head's.
    #[arg(long, hide = true)]
    pretend_model_variant: Option<String>,
}

fn seconds(flag: &str, s: f64) -> meshwork::error::Result<Duration> {
    if s > 0.0 && s.is_finite() {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(Error::InvalidConfig(format!(
            "{flag} {s}: a positive number of seconds"
        )))
    }
}

pub(crate) fn runtime() -> meshwork::error::Result<tokio::runtime::Runtime> {
    tokio::runtime::Runtime::new().map_err(|e| Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })
}

/// The launcher's description of this process, if a launcher started it.
fn launcher() -> meshwork::error::Result<Option<Rendezvous>> {
    rendezvous::from_env(|k| std::env::var(k).ok())
        .map_err(|e| Error::from(ControlError::Rendezvous(e)))
}

/// `meshwork train` with the cluster flags or under a launcher: `None` when this is a plain
/// single-process run.
pub(crate) fn dispatch_train(
    cluster: &ClusterTrainArgs,
    spec: impl FnOnce() -> JobSpec,
    mut job: HeadJob,
) -> Option<meshwork::error::Result<()>> {
    job.elastic = (cluster.min_replicas, cluster.max_replicas);
    if let Some(listen) = &cluster.listen {
        let Some(nodes) = cluster.nodes else {
            return Some(Err(Error::InvalidConfig(
                "--listen needs --nodes N (how many nodes to wait for)".into(),
            )));
        };
        let data_host = cluster.data_host.or_else(|| {
            listen
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| a.ip())
                .filter(|ip| !ip.is_unspecified())
        });
        let local = cluster.local_devices.unwrap_or(0);
        return Some(run_head(
            cluster,
            listen.clone(),
            nodes,
            local,
            data_host,
            spec(),
            job,
        ));
    }
    if cluster.nodes.is_some() {
        return Some(Err(Error::InvalidConfig("--nodes needs --listen".into())));
    }
    if cluster.transport == TransportChoice::Mpi {
        return Some(under_mpi(cluster, spec, job));
    }
    let launched = match launcher() {
        Ok(Some(r)) if r.processes > 1 => r,
        Ok(_) => return None,
        Err(e) => return Some(Err(e)),
    };
    Some(run_launched(cluster, launched, spec(), job))
}

/// `--transport mpi`: MPI's world is the job's (RDV-4), and its bytes move through MPI.
/// Every process finalises MPI at the end of `main`.
fn under_mpi(
    cluster: &ClusterTrainArgs,
    spec: impl FnOnce() -> JobSpec,
    job: HeadJob,
) -> meshwork::error::Result<()> {
    #[cfg(feature = "mpi")]
    {
        let world = meshwork::comm::mpi::init()
            .map_err(|e| Error::InvalidConfig(format!("--transport mpi: {e}")))?;
        let launched = rendezvous::from_mpi(world, |k| std::env::var(k).ok())
            .map_err(|e| Error::from(ControlError::Rendezvous(e)))?;
        if launched.processes < 2 {
            return Err(Error::InvalidConfig(
                "--transport mpi needs at least two processes: start it under an MPI launcher \
                 (mpirun -n N meshwork train --transport mpi …)"
                    .into(),
            ));
        }
        let mut spec = spec();
        spec.job.transport = DataTransport::Mpi;
        run_launched(cluster, launched, spec, job)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (cluster, spec, job);
        Err(Error::InvalidConfig(
            "--transport mpi needs meshwork built with the `mpi` feature \
             (cargo build --release --features mpi; it needs an MPI such as libopenmpi-dev, \
             and libclang)"
                .into(),
        ))
    }
}

/// Runs this process's part of a job a launcher started: the head on process 0, a node on
/// the others.
fn run_launched(
    cluster: &ClusterTrainArgs,
    launched: Rendezvous,
    spec: JobSpec,
    job: HeadJob,
) -> meshwork::error::Result<()> {
    match launched.role() {
        Role::Head { listen, nodes } => {
            let data_host = cluster.data_host.or_else(|| {
                (launched.head_host.as_str(), 0)
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .map(|a| a.ip())
            });
            let local = cluster.local_devices.unwrap_or(1);
            run_head(cluster, listen, nodes, local, data_host, spec, job)
        }
        Role::Node { join, process } => {
            let args = NodeArgs {
                join: Some(join),
                devices: cluster.local_devices.unwrap_or(1),
                device: spec.backend,
                job: cluster.job.clone(),
                name: None,
                join_timeout: cluster.join_timeout,
                head_timeout: 10.0,
                tls_ca: cluster.tls_ca.clone(),
                tls_server_name: cluster.tls_server_name.clone(),
                pretend_protocol_version: cluster.pretend_protocol_version,
                pretend_model_variant: None,
            };
            run_node_with(args, Some(process))
        }
    }
}

fn run_head(
    cluster: &ClusterTrainArgs,
    listen: String,
    nodes: u32,
    local_devices: u32,
    data_host: Option<IpAddr>,
    spec: JobSpec,
    head_job: HeadJob,
) -> meshwork::error::Result<()> {
    let join_timeout = seconds("--join-timeout", cluster.join_timeout)?;
    // The job the nodes will build, checked as a job across processes (the table, COMP-1,
    // and the values, JOB-1) before anyone waits for a node; the world is at least the nodes
    // and the head's own devices.
    let world = nodes + local_devices;
    let mut spec = spec;
    if !head_job.batch_given {
        fit_default_batch(&mut spec, world);
    }
    // The whole description, recovery and checkpoints included: a roll-back is refused
    // without checkpoints (a row of the table), and the head is where checkpoints are written.
    if is_gpt(&spec) {
        crate::gpt_train::cluster_job(&spec)?
            .0
            .check_across_processes(world)?;
    } else {
        demo_job(&spec)?.0.check_across_processes(world)?;
    }
    tracing::info!(description = ?spec.job, "meshwork head: the job it runs");
    let secret = control::secret_from_env().map_err(ControlError::from)?;
    let fingerprint = demo_models(None).fingerprint(&spec).map_err(|reason| {
        Error::InvalidConfig(format!("the head cannot build its own model: {reason}"))
    })?;
    // The head's own data-plane listeners, adopted by its stages once the world is known.
    let head_listeners = if local_devices == 0 {
        Vec::new()
    } else {
        let Some(ip) = data_host else {
            return Err(Error::InvalidConfig(format!(
                "--local-devices {local_devices}: give --data-host (the address nodes reach this host at)"
            )));
        };
        control::bind_data_plane(ip, local_devices)?
    };
    let head_addrs: Vec<SocketAddr> = head_listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Io {
            path: "data-plane listener".into(),
            reason: e.to_string(),
        })?;
    let mut config = HeadConfig::new(listen, cluster.job.clone(), secret);
    if let Some(v) = cluster.pretend_protocol_version {
        config.protocol_version = v;
    }
    if let (Some(cert), Some(key)) = (&cluster.tls_cert, &cluster.tls_key) {
        config.tls = Some(control::HeadTls::from_pem_files(cert, key)?);
    }
    let job = cluster.job.clone();
    let dry_run = cluster.dry_run;
    let tls_line = cluster
        .tls_cert
        .as_ref()
        .map(|cert| format!("control plane: TLS, certificate {}", cert.display()));
    runtime()?.block_on(async move {
        let mut head = Head::start(config).await?;
        if let Some(line) = tls_line {
            println!("{line}");
        }
        println!(
            "meshwork head: listening on {} for job {job}, waiting for {nodes} node(s) (protocol {}, model {fingerprint})",
            head.local_addr(),
            protocol::CONTROL_PROTOCOL_VERSION,
        );
        let _ = std::io::stdout().flush();
        let assembled = match head
            .assemble(nodes as usize, &spec, fingerprint, head_addrs, join_timeout)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                head.shutdown(&format!("the head gave up: {e}")).await;
                return Err(Error::from(e));
            }
        };
        let world = &assembled.world;
        println!(
            "world assembled: {} rank(s) over {} process(es); token distributed; every node acknowledged Prepare",
            world.size(),
            world.processes.len()
        );
        for e in &world.ranks {
            println!(
                "  rank {}: process {} ({}) device {} data plane {}",
                e.rank.0, e.process.0, world.processes[e.process.0 as usize], e.device, e.addr
            );
        }
        for (name, phase) in head.heartbeat().await {
            match phase {
                Ok(p) => println!("heartbeat: {name} {p:?}"),
                Err(e) => println!("heartbeat: {name} failed: {e}"),
            }
        }
        if dry_run {
            for (name, bye) in head.shutdown("dry run over").await {
                if let Err(e) = bye {
                    println!("shutdown: {name}: {e}");
                }
            }
            println!("dry run: the nodes are stopped; no training");
            return Ok(());
        }
        // Nodes that come while the job runs join it: a data-parallel job grows onto them; in
        // a pipeline job they wait as spares that replace a lost stage (REC-6), where one can.
        // A spare replaces a lost stage from its twin (shrink, at least 2 replicas) or takes
        // a lost rank's place when the job rolls back to its checkpoint.
        let refuse = ranks_per_replica(&spec).and_then(|per_replica| {
            let replicas = assembled.world.size() as u32 / per_replica;
            let policy = &spec.job.fault_tolerance.recovery;
            let from_twin = policy.on_replica_loss == OnReplicaLoss::Shrink && replicas >= 2;
            (!from_twin && !policy.roll_back).then(|| {
                "the job is running: a block or pipeline job takes nodes only as spares for lost \
                 stages, with --on-replica-loss shrink and at least 2 replicas, or rollback"
                    .to_string()
            })
        });
        let (late, late_events) = head.admit_late(&spec, fingerprint, &assembled, refuse);
        let trained =
            train_on_world(&head, &assembled, &spec, head_listeners, &head_job, late_events).await;
        let reason = ending(&trained);
        let late_byes = late.shutdown(&reason).await;
        for (name, bye) in late_byes.into_iter().chain(head.shutdown(&reason).await) {
            if let Err(e) = bye {
                println!("shutdown: {name}: {e}");
            }
        }
        trained
    })
}

/// A default global batch (no `--batch-size`) fitted to the world the head waits for: the
/// nearest multiple of its replicas × each replica's micro-batches, said on the head's first
/// line (`mpirun -n 3 meshwork train` trains 3 replicas on 255 samples a step).
fn fit_default_batch(spec: &mut JobSpec, world: u32) {
    let per_replica = ranks_per_replica(spec).unwrap_or(1).max(1);
    let micro = spec
        .job
        .pipeline
        .as_ref()
        .map_or(1, |p| p.schedule.micro_batches().max(1))
        * spec.job.accumulation.max(1);
    let unit = (world / per_replica).max(1) as usize * micro as usize;
    let base = spec.job.batch_size.unwrap_or(1);
    let fitted = crate::settings::fit_batch(base, unit);
    if fitted != base {
        println!(
            "meshwork head: global batch {fitted} (the default {base} rounded to a multiple of \
             {unit} replica micro-batches; --batch-size sets it)"
        );
        spec.job.batch_size = Some(fitted);
    }
}

/// What the head tells its nodes when it stops them after `trained`.
pub(crate) fn ending(trained: &meshwork::error::Result<()>) -> String {
    match trained {
        Ok(()) => "the job finished".to_string(),
        Err(e) => format!("the job failed: {e}"),
    }
}

/// Trains the demo job on the assembled world: the head's own ranks (if any) in this process,
/// every other rank on its node; lost nodes are reported as the heartbeats miss them.
async fn train_on_world(
    head: &Head,
    assembled: &control::Assembled,
    spec: &JobSpec,
    head_listeners: Vec<std::net::TcpListener>,
    job: &HeadJob,
    late: LateEvents,
) -> meshwork::error::Result<()> {
    let head_stages = if head_listeners.is_empty() {
        None
    } else {
        Some(
            demo_models(None)
                .stages(HostArgs {
                    spec: spec.clone(),
                    plan: assembled.head_plan(),
                    token: assembled.token.clone(),
                    listeners: head_listeners,
                    head: None,
                })
                .map_err(Error::InvalidConfig)?,
        )
    };
    let mesh = ClusterMesh::new(assembled, &head.node_handles(), head_stages)?;
    let joiner = mesh.joiner();
    let pipelined = ranks_per_replica(spec).is_some();
    let keep_alive = head.keep_alive();
    let watchers = Box::new(move |control: JobControl| {
        vec![
            tokio::spawn(grow_onto_joining_nodes(joiner, late, control, pipelined)),
            tokio::spawn(report_lost_nodes(keep_alive)),
        ]
    });
    if is_gpt(spec) {
        let settings = |b| head_settings(job, mesh, b);
        let report = (job.save_model.clone(), job.sample);
        return crate::gpt_train::train_across(spec, settings, report, watchers).await;
    }
    let (demo, task) = demo_job(spec)?;
    demo.configure(HeadSettings { job, mesh })
        .run(RunOptions {
            steps: spec.job.steps,
            task: &task,
            save: job.save_model.clone(),
            watchers,
        })
        .await?;
    Ok(())
}

/// Grows the job onto nodes that join it while it runs (a pipeline job keeps them as spares
/// for a lost stage) and reports the ones refused or lost.
async fn grow_onto_joining_nodes(
    joiner: MeshJoiner,
    mut late: LateEvents,
    control: JobControl,
    pipelined: bool,
) {
    while let Some(event) = late.next().await {
        match event {
            LateEvent::Joined(node) => {
                let name = node.handle.name().to_string();
                let ranks: Vec<u32> = node.ranks.iter().map(|e| e.rank.0).collect();
                match joiner.add(node.handle, &node.ranks) {
                    Ok(_) if pipelined => println!(
                        "node {name} joined the running job: rank(s) {ranks:?}, waiting as a \
                         spare for a lost stage"
                    ),
                    Ok(k) => {
                        println!("node {name} joined the running job: rank(s) {ranks:?}");
                        control.add_replicas(k);
                    }
                    Err(e) => println!("node {name} cannot join the running job: {e}"),
                }
            }
            LateEvent::Refused { node, reason } => {
                println!("refused {node} from the running job: {reason}");
            }
            LateEvent::Lost { node, error } => {
                joiner.remove(&node);
                println!("node {node} lost: {error}");
            }
        }
        let _ = std::io::stdout().flush();
    }
}

/// Reports nodes lost as their heartbeats miss.
async fn report_lost_nodes(mut keep_alive: KeepAlive) {
    while let Some((name, why)) = keep_alive.next_lost().await {
        println!("node {name} lost: {why}");
        let _ = std::io::stdout().flush();
    }
}

/// `meshwork node`.
pub(crate) fn run_node(args: NodeArgs) -> meshwork::error::Result<()> {
    run_node_with(args, None)
}

fn run_node_with(args: NodeArgs, requested: Option<ProcessIndex>) -> meshwork::error::Result<()> {
    let (head, requested) = match (&args.join, requested) {
        (Some(join), requested) => (join.clone(), requested),
        (None, _) => match launcher()? {
            Some(r) => match r.role() {
                Role::Node { join, process } => (join, Some(process)),
                Role::Head { .. } => {
                    return Err(Error::InvalidConfig(format!(
                        "this is process 0 of the job ({:?} variables): process 0 is the head, run `meshwork train` there",
                        r.convention
                    )));
                }
            },
            None => {
                return Err(Error::InvalidConfig(
                    "give --join HEAD_ADDR, or run under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST)".into(),
                ));
            }
        },
    };
    if args.devices == 0 {
        return Err(Error::InvalidConfig(
            "--local-devices 0: a node holds at least one device".into(),
        ));
    }
    let secret = control::secret_from_env().map_err(ControlError::from)?;
    let mut config = NodeConfig::for_models(
        head.clone(),
        args.job.clone(),
        secret,
        args.devices,
        &demo_models(args.pretend_model_variant.clone()),
    );
    config.requested = requested;
    config.backend = args.device;
    config.join_timeout = seconds("--join-timeout", args.join_timeout)?;
    config.head_timeout = seconds("--head-timeout", args.head_timeout)?;
    if let Some(name) = args.name {
        config.name = name;
    }
    if let Some(v) = args.pretend_protocol_version {
        config.protocol_version = v;
    }
    if let Some(ca) = &args.tls_ca {
        let tls = control::NodeTls::from_pem_file(ca)?;
        config.tls = Some(match args.tls_server_name {
            Some(name) => tls.server_name(name),
            None => tls,
        });
    }
    let name = config.name.clone();
    println!(
        "meshwork node {name}: joining job {} at {head} with {} {:?} device(s)",
        args.job, args.devices, args.device
    );
    let _ = std::io::stdout().flush();
    let outcome = runtime()?.block_on(control::run_node(config, |report| {
        match report {
            NodeReport::Authenticated => println!("meshwork node {name}: authenticated"),
            NodeReport::Welcomed { head } => println!("meshwork node {name}: joined, head {head}"),
            NodeReport::Prepared { plan } => println!(
                "meshwork node {name}: prepared: process {}, ranks {:?} of {}",
                plan.process.0,
                plan.ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
                plan.world_size
            ),
        }
        let _ = std::io::stdout().flush();
    }))?;
    for (rank, steps) in &outcome.trained {
        println!(
            "meshwork node {name}: rank {} trained {steps} step(s)",
            rank.0
        );
    }
    for (rank, joined) in &outcome.data_plane {
        println!("meshwork node {name}: rank {} data plane: {joined}", rank.0);
    }
    println!(
        "meshwork node {name}: stopped by the head: {}",
        outcome.reason
    );
    Ok(())
}
