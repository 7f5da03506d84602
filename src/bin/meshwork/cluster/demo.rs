//! The demo jobs `meshwork train` runs across processes: the job spec of its flags, the
//! registered models (the demo MLP and GPT) with their fingerprints and stage hosts, and the
//! builder every process makes from a spec.

use super::*;

/// The demo model's fingerprint as this build makes it (`variant`: pretend another build).
fn demo_fingerprint(
    spec: &JobSpec,
    variant: Option<&str>,
) -> Result<ModelFingerprint, Incompatibility> {
    let device = MeshDevice::of_kind(BackendKind::Flex, 1)
        .map_err(|e| Incompatibility::Other(e.to_string()))?;
    let fingerprint = if is_gpt(spec) {
        meshwork::demo::gpt::gpt_fingerprint(spec, device[0].burn())?
    } else {
        meshwork::demo::cluster_fingerprint(spec, device[0].burn())?
    };
    Ok(match variant {
        // Another build's model: its structure hashes differently.
        Some(v) => ModelFingerprint(v.bytes().fold(fingerprint.0, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })),
        None => fingerprint,
    })
}

/// What the head does with the trained job beyond the spec: where the model goes, how a lost
/// node is handled.
#[derive(Debug, Clone)]
pub(crate) struct HeadJob {
    pub(crate) save_model: Option<std::path::PathBuf>,
    /// `--sample N` of `--model gpt`: characters sampled from the trained model.
    pub(crate) sample: Option<usize>,
    /// The replicas a data-parallel job may have (`--min-replicas`, `--max-replicas`); a bound
    /// not given is the job description's.
    pub(crate) elastic: (Option<u32>, Option<u32>),
    /// Whether `--batch-size` was given; if not, the head fits the spec's default batch to
    /// the world it waits for ([`crate::settings::fit_batch`]).
    pub(crate) batch_given: bool,
}

/// Samples in the demo job's dataset (as in a single-process `meshwork train`).
const DEMO_SAMPLES: usize = 16_384;

/// The demo job of `meshwork train` as `spec` describes it, built the same way in every
/// process (the head's and every node's stages train with the same settings) and the same
/// way as a single-process run: the teacher task, the MLP (or its pipeline blocks) initialized
/// on a Flex device seeded with the job's seed, Adam.
pub(crate) fn demo_job(spec: &JobSpec) -> meshwork::error::Result<(DemoJob, TeacherTask)> {
    let widths = meshwork::demo::mlp_widths(&spec.model)
        .map_err(|e| Error::InvalidConfig(format!("meshwork train runs the demo MLP: {e}")))?;
    let (Some(&d_in), Some(&d_out)) = (widths.first(), widths.last()) else {
        return Err(Error::InvalidConfig("the demo MLP has no layers".into()));
    };
    let task = TeacherTask {
        d_in,
        d_out,
        noise: 0.1,
        seed: spec.job.seed,
    };
    let device = MeshDevice::of_kind(BackendKind::Flex, 1)?.remove(0);
    device.burn().seed(spec.job.seed);
    let options = BlockOptions::default();
    let job = match &spec.job.pipeline {
        // ZeRO-3 and recomputation work per block: the MLP as blocks of one layer each, as in
        // one process.
        None if spec.job.reduction.zero == ZeroStage::Three || spec.job.recompute => {
            DemoJob::Blocks(
                Job::builder().blocks(mlp_blocks(&widths, options, device.burn()).ok_or_else(
                    || Error::Runtime("the demo MLP did not cut into blocks".into()),
                )?),
            )
        }
        None => DemoJob::Replicas(
            Job::builder()
                .initial_model(Mlp::new(&widths, device.burn()))
                .loss(mse_loss),
        ),
        Some(shape) => {
            let schedule = shape.schedule;
            let blocks = (shape.stages * schedule.virtual_stages()) as usize;
            let layers = widths.len() - 1;
            let stages = even_split(layers, blocks)
                .and_then(|split| split_mlp(&widths, &split, device.burn()))
                .map(|parts| mlp_blocks_of(parts, options))
                .ok_or_else(|| {
                    Error::InvalidConfig(format!(
                        "{} stages × {} virtual stages: the demo MLP has {layers} layers, so at \
                         most {layers} blocks",
                        shape.stages,
                        schedule.virtual_stages()
                    ))
                })?;
            DemoJob::Pipeline(Job::builder().pipeline(stages, schedule), schedule)
        }
    };
    Ok((job.configure(SpecSettings { spec, task: &task }), task))
}

/// The settings of the demo job every process shares.
struct SpecSettings<'a> {
    spec: &'a JobSpec,
    task: &'a TeacherTask,
}

impl Configure for SpecSettings<'_> {
    fn apply<M: Send + 'static>(self, builder: JobBuilder<M, Sample>) -> JobBuilder<M, Sample> {
        builder
            .with_config(self.spec.job.clone())
            .data(self.task.dataset(DEMO_SAMPLES))
    }
}

/// What the head adds to the demo job: its checkpoints, recovery, elastic range and mesh.
pub(super) struct HeadSettings<'a> {
    pub(super) job: &'a HeadJob,
    pub(super) mesh: ClusterMesh,
}

impl Configure for HeadSettings<'_> {
    fn apply<M: Send + 'static>(self, builder: JobBuilder<M, Sample>) -> JobBuilder<M, Sample> {
        head_settings(self.job, self.mesh, builder)
    }
}

/// What the head adds to any of its jobs (the MLP's or the GPT's).
pub(super) fn head_settings<M: Send + 'static, I: Send + Sync + 'static>(
    job: &HeadJob,
    mesh: ClusterMesh,
    builder: JobBuilder<M, I>,
) -> JobBuilder<M, I> {
    let ft = &builder.config().fault_tolerance;
    let (min, max) = (
        job.elastic.0.unwrap_or(ft.elastic_min),
        job.elastic.1.unwrap_or(ft.elastic_max),
    );
    builder.elastic(min, max).cluster(mesh)
}

/// The ranks of one replica of a block or pipeline job (stages × tensor-parallel degree);
/// `None` for a data-parallel job of the whole model (which grows onto nodes that join).
pub(super) fn ranks_per_replica(spec: &JobSpec) -> Option<u32> {
    let job = &spec.job;
    let blocks = job.pipeline.is_some()
        || is_gpt(spec)
        || job.reduction.zero == ZeroStage::Three
        || job.recompute;
    blocks
        .then(|| job.pipeline.as_ref().map_or(1, |p| p.stages.max(1)) * job.tensor_parallel.max(1))
}

/// Whether `spec` is a job of the demo GPT (`--model gpt`), not of the demo MLP.
pub(super) fn is_gpt(spec: &JobSpec) -> bool {
    spec.model.kind == meshwork::demo::gpt::GPT_KIND
}

/// The model kinds `meshwork` trains across processes: the demo MLP and the demo GPT
/// (`variant`: pretend another build's, whose fingerprints differ).
pub(crate) fn demo_models(variant: Option<String>) -> ModelRegistry {
    let pretend = variant.clone();
    let fingerprint: FingerprintFn =
        Arc::new(move |spec: &JobSpec| demo_fingerprint(spec, variant.as_deref()));
    let gpt_fingerprint: FingerprintFn =
        Arc::new(move |spec: &JobSpec| demo_fingerprint(spec, pretend.as_deref()));
    ModelRegistry::new()
        .register(meshwork::demo::MLP_KIND, fingerprint, demo_stages())
        .register(meshwork::demo::gpt::GPT_KIND, gpt_fingerprint, gpt_stages())
}

/// How a process builds its stages of a `--model gpt` job: the GPT job of the head's spec.
fn gpt_stages() -> HostFactory {
    Arc::new(|args: HostArgs| {
        let (builder, _, _) =
            crate::gpt_train::cluster_job(&args.spec).map_err(|e| e.to_string())?;
        builder.stage_host(args).map_err(|e| e.to_string())
    })
}

/// How a node (and the head, for its own devices) builds its stages: the demo job of the
/// head's spec.
fn demo_stages() -> HostFactory {
    Arc::new(|args: HostArgs| {
        let (job, _) = demo_job(&args.spec).map_err(|e| e.to_string())?;
        match job {
            DemoJob::Replicas(b) => b.stage_host(args),
            DemoJob::Blocks(b) | DemoJob::Pipeline(b, _) => b.stage_host(args),
        }
        .map_err(|e| e.to_string())
    })
}
