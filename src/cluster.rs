//! Several processes and hosts (behind the `cluster` cargo feature), on two planes:
//!
//! - the **control plane** ([`control`], on ractor_cluster): the head and its nodes find each
//!   other ([`rendezvous`] reads torchrun's and Slurm's variables), check they speak the same
//!   protocol and build the same model, agree on ranks, and hand out every rank's data-plane
//!   address and the per-job token; then heartbeats and shutdown. Small messages only.
//! - the **data plane** lives below, in [`crate::comm::net`] (frames and authenticated TCP
//!   links) and [`crate::comm::tcp`] (the TCP transport behind `Communicator`): the control
//!   plane hands it its inputs ([`control::World::plan_for`], [`control::link_listeners`]).
//!
//! `rendezvous` must not depend on `actors`, `job` or Burn. `control` and `remote` sit above
//! the runtime (the layer order at the top of `ARCHITECTURE.md`).
//!
//! # Training across processes
//!
//! [`remote`] wires the two planes into a job: the head's Supervisor drives every rank through
//! proxies (`RemoteStage`, `RemoteDevice`) that send [`control::StageRequest`]s to the process
//! holding the rank, where a `NodeStages` (crate-internal) serves them with ordinary stage actors
//! whose communicators are TCP (or MPI) groups. Data-parallel jobs, dp × pp × tp block and
//! pipeline jobs (`remote::pipeline`: pipeline links as TCP links, REMOTE-4; a lost stage
//! replaced from its twin on a waiting node, REMOTE-7) and parameter-server jobs
//! (`remote::ps`) all run this way. A process that holds several ranks
//! of a data-parallel job joins its group hierarchically ([`crate::comm::hierarchical`],
//! HIER-1/2: in shared memory inside the process, one leader per process over TCP).

pub mod control;
pub mod remote;
pub mod rendezvous;

/// A process of the job: 0 is the head, nodes are 1.. in the order of
/// [`control::world::assign_ranks`]. Here, below both planes' modules, because the
/// rendezvous names the index a launcher gives a process and the control plane builds the
/// world from those indices.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    Default,
)]
pub struct ProcessIndex(pub u32);
