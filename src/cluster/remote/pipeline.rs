//! Pipelines across processes: the pipeline links of a replica as TCP links (a
//! [`PacketWire`] per pair of stages), the slots of a dp × pp job, and how the head rebuilds a
//! pipeline stage's trained blocks.
//!
//! - **REMOTE-4** a slot of a pipeline job starts in two phases: `Start` starts its device and
//!   binds a listener for pipeline links (its address goes back to the head), `Wire` (once
//!   every slot listens) joins the data-parallel group of its stage index over the world's
//!   data-plane listener and connects to its replica's other stages over the link listeners,
//!   both token-checked (LINK-1). Two listeners, so the two groups never take each other's
//!   connections.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Rebuild, SlotFactory, SlotFuture, SlotStart};
use crate::actors::pipeline_stage::{PipelineSpec, spawn_unlinked};
use crate::checkpoint::ShardSnapshot;
use crate::cluster::link::{
    LinkCloser, LinkConfig, LinkError, LinkListener, LinkReader, LinkWriter,
};
use crate::comm::tcp::{TcpGroupError, connect_mesh};
use crate::error::StageId;
use crate::mesh::{Layout, Rank};
use crate::parallel::pipeline::{Chunk, PipelineSchedule, StageIndex};
use crate::parallel::pipeline_exec::{PacketWire, WireError};
use crate::parallel::stages::PipelineModel;

/// A pipeline link to a stage in another process: one authenticated TCP link, each packet one
/// frame (crc-checked, at most the link's maximum payload).
#[derive(Debug)]
pub(crate) struct TcpWire {
    writer: Mutex<LinkWriter>,
    reader: Mutex<LinkReader>,
    max_payload: u64,
}

fn wire_error(e: LinkError) -> WireError {
    match e {
        LinkError::Timeout { .. } => WireError::TimedOut,
        other => WireError::Broken(other.to_string()),
    }
}

impl PacketWire for TcpWire {
    fn send(&self, bytes: &[u8], deadline: Instant) -> Result<(), WireError> {
        self.writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(bytes, deadline)
            .map_err(wire_error)
    }

    fn recv(&self, bytes: &mut Vec<u8>, deadline: Instant) -> Result<(), WireError> {
        self.reader
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv(bytes, self.max_payload, deadline)
            .map(|_| ())
            .map_err(wire_error)
    }
}

/// A stage's wires to its peers, by peer stage index.
pub(crate) type Wires = HashMap<u32, Arc<dyn PacketWire>>;

/// The pipeline links of stage `listener.rank()` of a replica whose stage s accepts links at
/// `addrs[s]`: a wire to every other stage, and the closers that end them from any thread.
pub(crate) fn connect_wires(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
) -> Result<(Wires, Vec<LinkCloser>), TcpGroupError> {
    let me = listener.rank();
    let mut wires = Wires::new();
    let mut closers = Vec::new();
    for (peer, link) in connect_mesh(listener, addrs, config)? {
        let (writer, reader, closer) = link.split().map_err(|e| TcpGroupError::Setup {
            rank: me,
            peer,
            detail: e.to_string(),
        })?;
        closers.push(closer);
        wires.insert(
            peer.0,
            Arc::new(TcpWire {
                writer: Mutex::new(writer),
                reader: Mutex::new(reader),
                max_payload: config.max_payload,
            }),
        );
    }
    Ok((wires, closers))
}

/// The slots of a dp × pp job: each a [`crate::actors::pipeline_stage::PipelineStageActor`].
pub(crate) struct PipelineSlots<I> {
    pub(crate) spec: Arc<PipelineSpec<I>>,
    pub(crate) layout: Layout,
}

impl<I: Send + Sync + 'static> SlotFactory<PipelineModel> for PipelineSlots<I> {
    fn pipeline(&self) -> Option<(Layout, Arc<PipelineSchedule>)> {
        Some((self.layout, self.spec.plan.clone()))
    }

    fn spawn(&self, start: SlotStart) -> SlotFuture<PipelineModel> {
        let spec = self.spec.clone();
        Box::pin(async move {
            let links = start
                .links
                .ok_or_else(|| format!("{}: no pipeline links", start.id))?;
            spawn_unlinked(
                spec,
                (start.id, start.rank),
                (start.device, start.device_actor),
                links,
                start.comm,
            )
            .await
            .map_err(|e| format!("cannot start {}: {e}", start.id))
        })
    }
}

/// How the head rebuilds a pipeline stage's trained blocks from its snapshot (one shard per
/// block, CKPT-6): each block built as every stage builds it, then restored.
pub(crate) fn rebuild_blocks<I: Send + Sync + 'static>(
    spec: Arc<PipelineSpec<I>>,
    device: burn::tensor::Device,
) -> Rebuild<PipelineModel> {
    Arc::new(move |id: StageId, shards: Vec<ShardSnapshot>| {
        let stage = StageIndex(id.stage);
        let blocks = (0..spec.plan.virtual_stages())
            .map(|c| {
                let block = spec.plan.block(stage, Chunk(c));
                let shard = shards
                    .iter()
                    .find(|s| s.shard.pp == block)
                    .ok_or_else(|| format!("the snapshot of {id} has no block {block}"))?;
                let make = &spec.stages.blocks[block as usize].build;
                let mut work = make(&device, &spec.optimizer, spec.learning_rate.clone());
                work.restore(&shard.params, None)
                    .map_err(|e| format!("block {block} of {id} does not restore: {e}"))?;
                Ok((block, work.into_module()))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(PipelineModel::from_blocks(blocks))
    })
}

/// The world ranks of stage index `stage` in every replica, and of every stage of replica
/// `replica`: who a pipeline slot groups with.
pub(crate) fn partners(layout: Layout, id: StageId) -> Option<(Vec<Rank>, Vec<Rank>)> {
    let at = |dp, pp| layout.rank_of(crate::mesh::Coord { dp, pp, tp: 0 });
    let replicas = (0..layout.dp())
        .map(|r| at(r, id.stage))
        .collect::<Option<_>>()?;
    let stages = (0..layout.pp())
        .map(|s| at(id.replica, s))
        .collect::<Option<_>>()?;
    Some((replicas, stages))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_groups_with_its_stage_index_and_its_replica() {
        // MESH-1: rank = dp + DP·pp.
        let layout = Layout::new(2, 3, 1).unwrap();
        let id = StageId {
            replica: 1,
            stage: 2,
        };
        let (replicas, stages) = partners(layout, id).unwrap();
        assert_eq!(replicas, [Rank(4), Rank(5)]);
        assert_eq!(stages, [Rank(1), Rank(3), Rank(5)]);
        let outside = StageId {
            replica: 2,
            stage: 0,
        };
        assert!(partners(layout, outside).is_none());
    }
}
