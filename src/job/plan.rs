//! The job as one plan value ([`JobPlan`]): which strategies and settings a builder turns on,
//! read once from its settings and checked against the one table of refused combinations
//! ([`crate::composition::REFUSALS`]) when the job is built (JOB-1, COMP-1).

use std::collections::{BTreeMap, BTreeSet};

use super::{JobBuilder, NonFinitePolicy};
use crate::composition::{self, Feature, Refused};
use crate::optim::LearningRate;
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
        match self.pipeline.as_ref().map(|p| p.schedule.as_ref()) {
            Some(Some(schedule)) => on(Feature::Pipeline, format!(".pipeline(.., {schedule:?})")),
            Some(None) => on(Feature::Blocks, Feature::Blocks.to_string()),
            None => {}
        }
        if self.tp > 1 {
            on(
                Feature::TensorParallel,
                format!(".tensor_parallel({})", self.tp),
            );
        }
        if self.zero != ZeroStage::Off {
            let how = format!(".zero({:?})", self.zero);
            if matches!(self.zero, ZeroStage::Two | ZeroStage::Three) {
                on(Feature::ZeroGradients, how.clone());
            }
            if self.zero == ZeroStage::Three {
                on(Feature::ZeroParameters, how.clone());
            }
            on(Feature::Zero, how);
        }
        match self.mixed.precision {
            Precision::Bf16 => on(Feature::Bf16, ".precision(bf16)".into()),
            Precision::F16 => on(Feature::F16, ".precision(f16)".into()),
            Precision::F32 => {}
        }
        if self.mixed.low_gradients && self.mixed.precision.is_low() {
            on(
                Feature::LowPrecisionGradients,
                Feature::LowPrecisionGradients.to_string(),
            );
        }
        if let Some(norm) = self.clip_norm {
            on(Feature::ClipGradNorm, format!(".clip_grad_norm({norm})"));
        }
        if self.accumulation > 1 {
            on(
                Feature::GradientAccumulation,
                format!(".gradient_accumulation({})", self.accumulation),
            );
        }
        if self.non_finite == NonFinitePolicy::Skip {
            on(Feature::SkipNonFinite, Feature::SkipNonFinite.to_string());
        }
        if self.compression.is_on() {
            let how = format!(".compression({})", self.compression);
            if !matches!(self.compression, Compression::Bf16 | Compression::F16) {
                on(Feature::SparseCompression, how.clone());
            }
            on(Feature::Compression, how);
        }
        if let Some(u) = &self.local_updates {
            on(Feature::LocalUpdates, format!(".local_updates({u})"));
        }
        if let Some(b) = self.parameter_server.1 {
            // Backup workers run on the server (COMP-1's closure): a job that asked only for
            // them is refused as a server job, named by its own setting.
            on(Feature::BackupWorkers, format!(".backup_workers({b})"));
            on(Feature::ParameterServer, format!(".backup_workers({b})"));
        }
        if let Some(ps) = &self.parameter_server.0 {
            let how = format!(".parameter_server({})", ps.staleness);
            if ps.staleness != Staleness::Bounded(0) {
                on(Feature::StaleUpdates, how.clone());
            }
            on(Feature::ParameterServer, how);
        }
        if matches!(self.learning_rate, LearningRate::Scheduler(_)) {
            on(Feature::LrSchedule, Feature::LrSchedule.to_string());
        }
        if self.is_remote() {
            on(
                Feature::AcrossProcesses,
                Feature::AcrossProcesses.to_string(),
            );
        }
        #[cfg(feature = "cluster")]
        if self.transport == crate::comm::DataTransport::Mpi {
            on(Feature::MpiTransport, Feature::MpiTransport.to_string());
        }
        if let Some(hooks) = &self.faults {
            on(Feature::FaultPlan, Feature::FaultPlan.to_string());
            if hooks.has_message_faults() {
                on(Feature::MessageFaults, Feature::MessageFaults.to_string());
            }
        }
        if self.recovery.roll_back {
            on(Feature::RollBack, Feature::RollBack.to_string());
        }
        if self.checkpoint_dir.is_some() || self.checkpoint_sink.is_some() {
            on(Feature::Checkpoints, Feature::Checkpoints.to_string());
        }
        JobPlan { settings: s }
    }
}
