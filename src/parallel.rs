//! Parallel strategies: how work and data are split across the mesh.
//!
//! - [`sampler`]: which sample ids each replica reads at each step (pure);
//! - [`autocast`]: the low-precision copy a micro-batch computes with (mixed precision);
//! - [`buckets`]: how the flat gradient buffer is cut into all-reduce buckets (pure);
//! - [`compress`]: gradient compression schemes with error feedback (pure);
//! - [`local`]: synchronising less often — local SGD, DiLoCo, EASGD — as update rules (pure);
//! - `gradients` (crate-internal): flattening a model's gradients into one buffer and back (Burn);
//! - [`memory`]: what a block job's rank held during a step, instruction by instruction;
//! - `overlap` (crate-internal): a stage's collectives on a communication thread beside its
//!   compute (prefetched gathers, gradient reductions in flight);
//! - [`pipeline`]: pipeline schedules as instruction lists, their simulator and picture (pure);
//! - [`pipeline_exec`]: a stage running its list (links, VJP backward, stash, update);
//! - [`stages`]: the user's model as pipeline stages, and the trained blocks;
//! - [`tensor`]: tensor parallelism (Megatron-LM): split layers, their collectives, sharding;
//! - `sync` (crate-internal): how a rank's gradients and optimizer state stay in step with its
//!   group ([`HeldBytes`] is what a rank holds, reported in events).

pub mod autocast;
pub mod buckets;
pub mod compress;
pub(crate) mod gradients;
pub mod local;
pub mod memory;
pub mod parameter_server;
pub mod pipeline;
pub mod pipeline_exec;
pub mod sampler;
pub mod stages;
pub(crate) mod sync;
pub mod tensor;
pub mod zero;

pub use sync::HeldBytes;

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::mesh::Rank;

/// What a model factory is told when it builds one replica's model.
#[derive(Debug, Clone)]
pub struct ModelContext {
    /// The rank the model is for.
    pub rank: Rank,
    /// The device the model will train on (with autodiff).
    pub device: Device,
}

/// What to do when a replica's loss is NaN or infinite. Decided by all replicas together from
/// the all-reduced losses, so they stay identical (DP-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NonFinitePolicy {
    /// End the job with [`crate::error::Error::NonFiniteLoss`].
    #[default]
    Stop,
    /// Skip the update of that step on every replica and go on.
    Skip,
}

/// `module` with every parameter drawn now, on the calling thread (REPRO-1).
///
/// Burn initializes a parameter lazily: `LinearConfig::init` records how to draw it, and the
/// numbers are drawn from the device's random generator (process-global on Flex) on its first
/// use. A model handed to a job unused would be drawn on the stage threads, in whatever order
/// they happen to run, each taking numbers the others would have taken: the same seed would
/// give different initial models from run to run. Jobs therefore draw every parameter of the
/// model they are given (a pipeline's blocks in block order) when it is handed over; call this
/// yourself to fix the moment of the draws in your own code (right after seeding).
pub fn materialize<M: burn::module::Module>(module: M) -> M {
    struct Draw;
    impl burn::module::ModuleVisitor for Draw {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            let _ = param.val();
        }
        fn visit_int<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D, burn::tensor::Int>>,
        ) {
            let _ = param.val();
        }
        fn visit_bool<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D, burn::tensor::Bool>>,
        ) {
            let _ = param.val();
        }
    }
    module.visit(&mut Draw);
    module
}
