//! # meshwork
//!
//! Train [Burn](https://burn.dev) models on many devices at once, as actors embedded in your
//! own program. See `ARCHITECTURE.md` for the code map and the book for a tutorial.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub(crate) mod actors;
pub mod checkpoint;
#[cfg(feature = "cluster")]
pub mod cluster;
pub mod comm;
pub mod composition;
pub mod config;
pub mod data;
pub mod demo;
pub mod device;
pub mod error;
pub mod events;
pub mod faults;
pub mod job;
pub mod job_config;
pub mod kernels;
pub mod mesh;
pub mod optim;
pub mod parallel;
pub mod planner;
pub mod precision;
pub mod recovery;
pub mod report;
pub mod scaling;
pub mod stragglers;
pub mod testing;
pub mod trace;

pub use error::{Error, Result};

/// The types most programs need: `use meshwork::prelude::*;`.
pub mod prelude {
    pub use crate::comm::{Algorithm, ReduceOp};
    pub use crate::composition::Feature;
    #[cfg(feature = "burn-dataset")]
    pub use crate::data::FromBurn;
    pub use crate::data::{Dataset, InMemoryDataset};
    pub use crate::device::{BackendKind, MeshDevice};
    pub use crate::error::{Error, Result};
    pub use crate::events::{JobEvent, StepDone};
    pub use crate::job::{
        EventStream, EventsError, FaultTolerance, Job, JobBuilder, JobHandle, ModelContext,
        NonFinitePolicy, Trained,
    };
    pub use crate::mesh::{Layout, Rank};
    pub use crate::parallel::compress::Compression;
    pub use crate::parallel::local::LocalUpdates;
    pub use crate::parallel::parameter_server::{ParameterServer, Staleness};
    pub use crate::parallel::pipeline::Schedule;
    pub use crate::parallel::pipeline_exec::{AnyTensor, Boundary};
    pub use crate::parallel::stages::{BlockOptions, PipelineStages};
    pub use crate::parallel::zero::ZeroStage;
    pub use crate::precision::{LossScalerConfig, Precision};
    pub use crate::recovery::RecoveryPolicy;
}
