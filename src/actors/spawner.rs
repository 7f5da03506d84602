//! `Spawner`: the host side of a training strategy. A job's spawner starts its stage actors
//! (and their groups, links and devices where it finds them itself) and says, as
//! [`Capabilities`], what the Supervisor may do with them when the mesh changes: where the
//! training state lives, whether a lost rank can be dropped, whether a lost stage has twins
//! to copy from, whether the job grows, how members rejoin a rebuilt mesh. The Supervisor
//! drives every strategy through this one seam and reads its decisions off `Capabilities`;
//! it never learns which strategy it drives.
//!
//! The strategies (each in the file of its spawn code):
//!
//! | spawner | where | capabilities |
//! |---|---|---|
//! | `spawner::LocalReplicas` | data-parallel replicas in this process | [`Capabilities::data_parallel`] with [`Rejoin::Regroup`] |
//! | `pipeline_stage::LocalPipeline` | dp × pp × tp blocks and pipeline stages in this process | [`Capabilities::pipeline`], resizable along dp (ELASTIC-6) |
//! | `parameter_server::PsReplicas` | parameter-server workers and their server in this process | replicated (the server's), droppable, no growth, [`Rejoin::Regroup`] |
//! | `cluster::remote::ClusterReplicas` | data-parallel replicas across processes | [`Capabilities::data_parallel`] with [`Rejoin::Reconnect`] |
//! | `cluster::remote::ClusterPipeline` | dp × pp × tp blocks and pipeline stages across processes | [`Capabilities::pipeline`], fixed size |
//! | `cluster::remote::ClusterParameterServer` | parameter-server workers across processes, their server in the head | replicated (the server's), droppable, no growth |
//!
//! Where the next strategy plugs in: a new `Spawner` (its stage actors answer the same
//! `StageMsg`s) and, on the device side, a `GradientSync` (`parallel::sync`) for how its
//! ranks keep parameters, gradients and optimizer state in step. Its `Capabilities` tell
//! the Supervisor's recovery, resize and checkpoints what they may do; the Supervisor does
//! not change.

use std::future::Future;
use std::pin::Pin;

use ractor::ActorProcessingErr;

mod handles;
mod local_replicas;

use crate::mesh::{Layout, Rank};
pub(crate) use handles::{
    Grow, GrowArgs, GrowStage, RemoteGrowArgs, RewireArgs, RewireStages, Rewired, SpawnContext,
    Spawned, SurvivorWiring,
};
#[cfg(feature = "cluster")]
pub(crate) use handles::{GrowRemote, Grown};
pub(crate) use local_replicas::LocalReplicas;

/// What spawning a job's stages resolves to.
pub(crate) type SpawnFuture<M> =
    Pin<Box<dyn Future<Output = Result<Spawned<M>, ActorProcessingErr>> + Send>>;

/// Starts a job's stage actors and says what the Supervisor may do with them.
pub(crate) trait Spawner<M>: Send + 'static {
    /// What the strategy allows; the same before and after [`Spawner::spawn`], and for the
    /// whole job.
    fn capabilities(&self) -> Capabilities;

    /// Spawns every rank's stage actor (linked to `cx.supervisor`) with whatever groups and
    /// links they need, and hands back the stage refs and the handles the Supervisor uses
    /// when the mesh changes (grow, rewire).
    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M>;
}

/// How the members of a job take their place in a mesh rebuilt under a new generation (after
/// a loss, a resize or a roll-back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rejoin {
    /// The ranks are one data-parallel group, rebuilt in this process around the new member
    /// list: each member takes a communicator of a new in-process group
    /// (`StageMsg::Regroup`).
    Regroup,
    /// The ranks are one data-parallel group whose members connect their own data plane (a
    /// job across processes): each is asked at once to join the group of the new generation,
    /// the members named by their slots (`StageMsg::Reconnect`).
    Reconnect,
    /// The mesh keeps its shape: every rank is wired anew under the new generation, fresh
    /// stages in the place of replaced ones (`StageMsg::Rewire`, REC-6). Ranks are never
    /// dropped or added.
    Rewire,
}

impl Rejoin {
    /// Whether the job's ranks are one data-parallel group, in rank order, rebuilt around a
    /// member list: a collective's missing rank or a broken link's peer is a rank of the job,
    /// a failure regroups the survivors (or the same members, REC-4), and the group can be
    /// resized (with an elastic minimum to wait for).
    pub(crate) fn regroups(self) -> bool {
        matches!(self, Rejoin::Regroup | Rejoin::Reconnect)
    }
}

/// What a strategy allows the Supervisor to do with its ranks. Every recovery, resize and
/// checkpoint decision reads it instead of assuming a kind of job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// Every data-parallel rank holds its block's whole training state (false under ZeRO: a
    /// rank's optimizer shard exists nowhere else, so checkpoints gather every rank, a lost
    /// rank rolls back, and a resize re-shards).
    pub(crate) replicated_state: bool,
    /// A lost rank can be dropped and the group shrunk: data-parallel only, and only when
    /// the state is replicated (SV-5).
    pub(crate) droppable_replicas: bool,
    /// A lost pipeline stage has twins (the same stage of other replicas, holding the same
    /// state) to be replaced from (REC-6): pipelines only, and only when the state is
    /// replicated (SV-5).
    pub(crate) twins: bool,
    /// The job can start more data-parallel replicas while it runs (ELASTIC-1, ELASTIC-4,
    /// ELASTIC-6).
    pub(crate) can_grow: bool,
    /// Why the job's number of replicas cannot change while it runs; `None`: it can
    /// (ELASTIC-1 for data-parallel groups, ELASTIC-6 for a dp × pp × tp mesh).
    pub(crate) fixed_size: Option<&'static str>,
    /// The micro-batches each replica cuts its share into when every one weighs
    /// 1 / (micro-batches × replicas) (a block or pipeline job's walk): a size is taken only
    /// if the global batch is a multiple of replicas × this (JOB-1 at every size). `None`:
    /// each micro-batch is weighted by its share (data-parallel replicas, DP-2), any size.
    pub(crate) micro_batches: Option<u32>,
    /// How members rejoin a rebuilt mesh.
    pub(crate) rejoin: Rejoin,
}

/// How a job's ranks keep their training state, the facts every spawner's [`Capabilities`]
/// derive from, so a job in one process and the same job across processes get the same ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct StateKeeping {
    /// ZeRO shards the optimizer state (and at stages 2 and 3 more).
    pub(crate) sharded: bool,
    /// A compressed gradient reduction keeps a residual per rank (CSYNC-2).
    pub(crate) compressed: bool,
    /// Local updates: each rank steps its own parameters between synchronisations (LOCAL-4).
    pub(crate) local: bool,
}

impl StateKeeping {
    /// From `(sharded, compressed, local)`, as a replica's spec reports them.
    pub(crate) fn of((sharded, compressed, local): (bool, bool, bool)) -> Self {
        StateKeeping {
            sharded,
            compressed,
            local,
        }
    }

    /// Every replica holds the whole training state: none of it is sharded or the rank's own.
    pub(crate) fn replicated(self) -> bool {
        !self.sharded && !self.compressed && !self.local
    }
}

/// Why a local-updates job keeps its number of replicas (LOCAL-4).
const LOCAL_FIXED: &str = "local updates keep each rank's own parameters, which do not move onto another number of \
     replicas";

impl Capabilities {
    /// Data-parallel replicas: every rank a whole replica in one group that rejoins by
    /// `rejoin` (`Regroup` or `Reconnect`), drops lost ranks where its state is replicated,
    /// and can grow unless each rank steps its own parameters (LOCAL-4).
    pub(crate) fn data_parallel(keeping: StateKeeping, rejoin: Rejoin) -> Self {
        let replicated_state = keeping.replicated();
        Capabilities {
            replicated_state,
            droppable_replicas: replicated_state,
            twins: false,
            can_grow: !keeping.local,
            fixed_size: None,
            micro_batches: None,
            rejoin,
        }
    }

    /// A dp × pp × tp mesh (blocks, a pipeline) whose replicas each run `micro_batches`
    /// micro-batches a step: rewired in place; a lost stage is replaced from its twin where
    /// the state is replicated; resized along dp (ELASTIC-6) unless `fixed_size` or local
    /// updates (LOCAL-4) say why not.
    pub(crate) fn pipeline(
        keeping: StateKeeping,
        fixed_size: Option<&'static str>,
        micro_batches: u32,
    ) -> Self {
        let replicated_state = keeping.replicated();
        let fixed_size = fixed_size.or(keeping.local.then_some(LOCAL_FIXED));
        Capabilities {
            replicated_state,
            droppable_replicas: false,
            twins: replicated_state,
            can_grow: fixed_size.is_none(),
            fixed_size,
            micro_batches: Some(micro_batches),
            rejoin: Rejoin::Rewire,
        }
    }

    /// The ranks of `layout` whose snapshots together make the job's training state (a
    /// checkpoint, the state a joining replica takes): replica 0's stages when the state is
    /// replicated, every rank when each holds a shard of it. In rank order.
    pub(crate) fn state_ranks(&self, layout: Layout) -> Vec<usize> {
        if self.replicated_state {
            // Replica 0: every stage, every tensor-parallel rank of each.
            layout
                .ranks()
                .filter(|&r| layout.coord_of(r).is_some_and(|c| c.dp == 0))
                .map(Rank::index)
                .collect()
        } else {
            layout.ranks().map(Rank::index).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPLICATED: StateKeeping = StateKeeping {
        sharded: false,
        compressed: false,
        local: false,
    };
    const SHARDED: StateKeeping = StateKeeping {
        sharded: true,
        ..REPLICATED
    };

    /// A compressed or local-updates job's state is the rank's own: neither dropped nor
    /// copied from a twin, and a local-updates job never grows, in one process and across
    /// processes alike (both derive their capabilities from the same facts).
    #[test]
    fn a_ranks_own_state_is_never_replicated_and_local_updates_never_grow() {
        for keeping in [
            SHARDED,
            StateKeeping {
                compressed: true,
                ..REPLICATED
            },
            StateKeeping {
                local: true,
                ..REPLICATED
            },
        ] {
            for rejoin in [Rejoin::Regroup, Rejoin::Reconnect] {
                let caps = Capabilities::data_parallel(keeping, rejoin);
                assert!(
                    !caps.replicated_state && !caps.droppable_replicas,
                    "{keeping:?}"
                );
                assert_eq!(caps.can_grow, !keeping.local, "{keeping:?}");
            }
            for fixed in [None, Some("across processes")] {
                let caps = Capabilities::pipeline(keeping, fixed, 2);
                assert!(!caps.replicated_state && !caps.twins, "{keeping:?}");
                assert_eq!(
                    caps.can_grow,
                    fixed.is_none() && !keeping.local,
                    "{keeping:?}"
                );
            }
        }
        let across = Capabilities::pipeline(REPLICATED, Some("across processes"), 2);
        assert!(across.twins && !across.can_grow);
        assert_eq!(across.fixed_size, Some("across processes"));
    }

    #[test]
    fn replicated_state_is_read_from_replica_zero_and_shards_from_every_rank() {
        let pipeline = Layout::new(2, 3, 1).expect("a valid layout");
        assert_eq!(
            Capabilities::pipeline(REPLICATED, None, 1).state_ranks(pipeline),
            [0, 2, 4]
        );
        assert_eq!(
            Capabilities::pipeline(SHARDED, None, 1).state_ranks(pipeline),
            [0, 1, 2, 3, 4, 5]
        );
        let replicas = Layout::data_parallel(3).expect("a valid layout");
        let caps = Capabilities::data_parallel(REPLICATED, Rejoin::Regroup);
        assert_eq!(caps.state_ranks(replicas), [0]);
        let zero = Capabilities::data_parallel(SHARDED, Rejoin::Reconnect);
        assert_eq!(zero.state_ranks(replicas), [0, 1, 2]);
    }

    #[test]
    fn sharded_state_is_neither_dropped_nor_copied_from_twins() {
        for rejoin in [Rejoin::Regroup, Rejoin::Reconnect] {
            assert!(!Capabilities::data_parallel(SHARDED, rejoin).droppable_replicas);
            assert!(Capabilities::data_parallel(REPLICATED, rejoin).droppable_replicas);
        }
        assert!(!Capabilities::pipeline(SHARDED, None, 1).twins);
        assert!(Capabilities::pipeline(REPLICATED, None, 1).twins);
        assert!(
            !Capabilities::pipeline(REPLICATED, None, 1)
                .rejoin
                .regroups()
        );
    }
}
