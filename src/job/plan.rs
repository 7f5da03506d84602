//! The job as one plan value ([`JobPlan`]): which strategies and settings a builder turns on,
//! read once from its settings and checked against the one table of refused combinations
//! ([`crate::composition::REFUSALS`]) when the job is built (JOB-1, COMP-1).

use std::collections::{BTreeMap, BTreeSet};

use super::{JobBuilder, NonFinitePolicy};
use crate::composition::{self, Feature, Refused};
use crate::job_config::LrSchedule;
use crate::parallel::compress::Compression;
use crate::parallel::parameter_server::Staleness;
use crate::parallel::zero::ZeroStage;
use crate::precision::Precision;

/// What a job is made of, as far as combining strategies goes: each [`Feature`] its settings
/// turn on, and how it was set (`compression(topk:0.05)`, `tensor_parallel(2)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobPlan {
    settings: BTreeMap<Feature, String>,
}

impl JobPlan {
    /// The features the job has.
    pub fn features(&self) -> BTreeSet<Feature> {
        self.settings.keys().copied().collect()
    }

    /// How the job set `feature`, or `None` when it is off.
    pub fn setting(&self, feature: Feature) -> Option<&str> {
        self.settings.get(&feature).map(String::as_str)
    }

    /// The plan of the same job trained across processes (what a node checks, and a head
    /// before it waits for its nodes, so that a refused job is refused before anyone joins).
    #[cfg(feature = "cluster")]
    pub fn across_processes(mut self) -> Self {
        let f = Feature::AcrossProcesses;
        self.settings.entry(f).or_insert_with(|| f.to_string());
        self
    }

    /// Refuses the plan when it combines features the table refuses (COMP-1).
    pub fn check(&self) -> Result<(), Refused> {
        composition::check(&self.features(), |f| {
            self.setting(f)
                .map_or_else(|| f.to_string(), str::to_string)
        })
    }
}

/// Each setting as the job wrote it, one after another (`.blocks(..) .zero(One)`).
impl std::fmt::Display for JobPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A setting that turns on a feature and the ones it implies is written once.
        let mut settings: Vec<&str> = Vec::new();
        for how in self.settings.values() {
            if !settings.contains(&how.as_str()) {
                settings.push(how);
            }
        }
        f.write_str(&settings.join(" "))
    }
}

impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// The job's plan: which strategies and settings it combines. `build()` refuses a plan
    /// that [`JobPlan::check`] refuses, with `Error::Refused` naming the features.
    pub fn plan(&self) -> JobPlan {
        let mut s = BTreeMap::new();
        let mut on = |f: Feature, how: String| {
            s.insert(f, how);
        };
        let c = &self.config;
        match (self.pipeline.is_some(), &c.pipeline) {
            (_, Some(p)) => on(
                Feature::Pipeline,
                format!(".pipeline(.., {:?})", p.schedule),
            ),
            (true, None) => on(Feature::Blocks, Feature::Blocks.to_string()),
            (false, None) => {}
        }
        if c.tensor_parallel > 1 {
            on(
                Feature::TensorParallel,
                format!(".tensor_parallel({})", c.tensor_parallel),
            );
        }
        if c.reduction.zero != ZeroStage::Off {
            let how = format!(".zero({:?})", c.reduction.zero);
            if matches!(c.reduction.zero, ZeroStage::Two | ZeroStage::Three) {
                on(Feature::ZeroGradients, how.clone());
            }
            if c.reduction.zero == ZeroStage::Three {
                on(Feature::ZeroParameters, how.clone());
            }
            on(Feature::Zero, how);
        }
        match c.precision.compute {
            Precision::Bf16 => on(Feature::Bf16, ".precision(bf16)".into()),
            Precision::F16 => on(Feature::F16, ".precision(f16)".into()),
            Precision::F32 => {}
        }
        if c.precision.low_precision_gradients && c.precision.compute.is_low() {
            on(
                Feature::LowPrecisionGradients,
                Feature::LowPrecisionGradients.to_string(),
            );
        }
        if let Some(norm) = c.clip_norm {
            on(Feature::ClipGradNorm, format!(".clip_grad_norm({norm})"));
        }
        if c.accumulation > 1 {
            on(
                Feature::GradientAccumulation,
                format!(".gradient_accumulation({})", c.accumulation),
            );
        }
        if c.non_finite == NonFinitePolicy::Skip {
            on(Feature::SkipNonFinite, Feature::SkipNonFinite.to_string());
        }
        if c.reduction.compression.is_on() {
            let how = format!(".compression({})", c.reduction.compression);
            if !matches!(
                c.reduction.compression,
                Compression::Bf16 | Compression::F16
            ) {
                on(Feature::SparseCompression, how.clone());
            }
            on(Feature::Compression, how);
        }
        if let Some(u) = &c.reduction.local_updates {
            on(Feature::LocalUpdates, format!(".local_updates({u})"));
        }
        if let Some(b) = c.reduction.backup_workers {
            // Backup workers run on the server (COMP-1's closure): a job that asked only for
            // them is refused as a server job, named by its own setting.
            on(Feature::BackupWorkers, format!(".backup_workers({b})"));
            on(Feature::ParameterServer, format!(".backup_workers({b})"));
        }
        if let Some(ps) = &c.reduction.parameter_server {
            let how = format!(".parameter_server({})", ps.staleness);
            if ps.staleness != Staleness::Bounded(0) {
                on(Feature::StaleUpdates, how.clone());
            }
            on(Feature::ParameterServer, how);
        }
        if c.lr_schedule != LrSchedule::Constant {
            on(Feature::LrSchedule, Feature::LrSchedule.to_string());
        }
        if self.is_remote() {
            on(
                Feature::AcrossProcesses,
                Feature::AcrossProcesses.to_string(),
            );
        }
        #[cfg(feature = "cluster")]
        if c.transport == crate::comm::DataTransport::Mpi {
            on(Feature::MpiTransport, Feature::MpiTransport.to_string());
        }
        if let Some(plan) = &c.fault_tolerance.fault_plan {
            on(Feature::FaultPlan, Feature::FaultPlan.to_string());
            if plan.faults.iter().any(|f| f.kind.is_message_fault()) {
                on(Feature::MessageFaults, Feature::MessageFaults.to_string());
            }
        }
        if c.fault_tolerance.recovery.roll_back {
            on(Feature::RollBack, Feature::RollBack.to_string());
        }
        if c.checkpoints.dir.is_some() || self.checkpoint_sink.is_some() {
            on(Feature::Checkpoints, Feature::Checkpoints.to_string());
        }
        JobPlan { settings: s }
    }
}
