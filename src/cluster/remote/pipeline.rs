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
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Rebuild, SlotFactory, SlotFuture, SlotStart};
use crate::actors::pipeline_stage::{PipelineSpec, spawn_unlinked};
use crate::checkpoint::ShardSnapshot;
use crate::cluster::control::StageOp;
use crate::comm::net::link::{LinkCloser, LinkConfig, LinkError, LinkListener, LinkReader};
use crate::comm::tcp::{TcpGroupError, connect_mesh};
use crate::mesh::StageId;
use crate::mesh::{Layout, Rank};
use crate::parallel::pipeline::{Chunk, PipelineSchedule, StageIndex};
use crate::parallel::pipeline_exec::{PacketWire, WireError};
use crate::parallel::stages::PipelineModel;

/// A pipeline link to a stage in another process: one authenticated TCP link, each packet one
/// frame (crc-checked, at most the link's maximum payload). Sends go through a bounded queue of
/// [`link_capacity`](PipelineSchedule::link_capacity) packets to a sender thread, so a send
/// completes when the packet is queued, as on an in-process link, whatever its size: two
/// stages sending to each other at once never both block on a full socket (PIPE-4).
#[derive(Debug)]
pub(crate) struct TcpWire {
    queue: SyncSender<Vec<u8>>,
    /// Why the sender thread stopped, once it did.
    failed: Arc<Mutex<Option<String>>>,
    reader: Mutex<LinkReader>,
    max_payload: u64,
}

fn wire_error(e: LinkError) -> WireError {
    match e {
        LinkError::Timeout { .. } => WireError::TimedOut,
        other => WireError::Broken(other.to_string()),
    }
}

/// How often a send waiting for room in the queue looks again.
const QUEUE_POLL: Duration = Duration::from_micros(200);

impl PacketWire for TcpWire {
    fn send(&self, bytes: &[u8], deadline: Instant) -> Result<(), WireError> {
        if bytes.len() as u64 > self.max_payload {
            return Err(WireError::Refused(format!(
                "a packet of {} bytes is over the link's largest frame of {} bytes",
                bytes.len(),
                self.max_payload
            )));
        }
        let mut packet = bytes.to_vec();
        loop {
            match self.queue.try_send(packet) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(p)) if Instant::now() < deadline => {
                    packet = p;
                    std::thread::sleep(QUEUE_POLL);
                }
                Err(TrySendError::Full(_)) => return Err(WireError::TimedOut),
                Err(TrySendError::Disconnected(_)) => {
                    let why = self
                        .failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone();
                    return Err(WireError::Broken(
                        why.unwrap_or_else(|| "the link's sender stopped".into()),
                    ));
                }
            }
        }
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
/// `addrs[s]`: a wire to every other stage (each sending through a queue of `capacity`
/// packets), and the closers that end them from any thread.
pub(crate) fn connect_wires(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
    capacity: usize,
) -> Result<(Wires, Vec<LinkCloser>), TcpGroupError> {
    let me = listener.rank();
    let mut wires = Wires::new();
    let mut closers = Vec::new();
    for (peer, link) in connect_mesh(listener, addrs, config)? {
        let setup = |detail: String| TcpGroupError::Setup {
            rank: me,
            peer,
            detail,
        };
        let (mut writer, reader, closer) = link.split().map_err(|e| setup(e.to_string()))?;
        let (queue, packets) = sync_channel::<Vec<u8>>(capacity.max(1));
        let failed = Arc::new(Mutex::new(None));
        let failure = failed.clone();
        let io_timeout = config.io_timeout;
        std::thread::Builder::new()
            .name(format!("meshwork-pipe-{}-{}", me.0, peer.0))
            .spawn(move || {
                // Ends when the wire is dropped (the queue closes) or the link fails.
                for packet in packets {
                    if let Err(e) = writer.send(&packet, Instant::now() + io_timeout) {
                        *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                        break;
                    }
                }
            })
            .map_err(|e| setup(e.to_string()))?;
        closers.push(closer);
        wires.insert(
            peer.0,
            Arc::new(TcpWire {
                queue,
                failed,
                reader: Mutex::new(reader),
                max_payload: config.max_payload,
            }),
        );
    }
    Ok((wires, closers))
}

/// The slots of a dp × pp job: each a [`crate::actors::pipeline_stage::PipelineStageActor`].
/// A slot learns whom it groups with from the head's `Wire` (the head holds the layout and
/// which slot holds each of its ranks).
pub(crate) struct PipelineSlots<I> {
    pub(crate) spec: Arc<PipelineSpec<I>>,
}

impl<I: Send + Sync + 'static> SlotFactory<PipelineModel> for PipelineSlots<I> {
    fn pipeline(&self) -> Option<Arc<PipelineSchedule>> {
        Some(self.spec.plan.clone())
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
                let single = Arc::new(crate::parallel::tensor::TensorParallel::single());
                let mut work = make(
                    &device,
                    &spec.optimizer,
                    spec.learning_rate.clone(),
                    &single,
                )
                .map_err(|e| format!("block {block} of {id} cannot be built: {e}"))?;
                work.restore(&shard.params, None, (0, 1))
                    .map_err(|e| format!("block {block} of {id} does not restore: {e}"))?;
                Ok(crate::parallel::stages::BlockPart {
                    block,
                    tp_rank: 0,
                    module: work.into_module(),
                    unshard: None,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(PipelineModel::from_parts(blocks))
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

/// The `Wire` of every rank of a dp × pp `layout` under `generation`, by layout rank:
/// `slot_of[r]` is the slot that holds layout rank r (REC-6 moves a rank to another slot);
/// `data[slot]` and `links[slot]` are a slot's data-plane and pipeline-link listeners.
pub(crate) fn wire_ops(
    layout: Layout,
    slot_of: &[Rank],
    data: &[SocketAddr],
    links: &[Option<SocketAddr>],
    generation: crate::mesh::Generation,
) -> Result<Vec<StageOp>, String> {
    let address = |table: &dyn Fn(usize) -> Option<SocketAddr>, rank: Rank| {
        let slot = slot_of
            .get(rank.index())
            .ok_or_else(|| format!("no slot holds rank {}", rank.0))?;
        table(slot.index()).ok_or_else(|| format!("no address for slot {}", slot.0))
    };
    let data_of = |slot: usize| data.get(slot).copied();
    let link_of = |slot: usize| links.get(slot).copied().flatten();
    (0..layout.world_size())
        .map(|r| {
            let coord = layout
                .coord_of(Rank(r))
                .ok_or_else(|| format!("rank {r} is outside {layout:?}"))?;
            let id = StageId {
                replica: coord.dp,
                stage: coord.pp,
                tp: 0,
            };
            let (replicas, stages) =
                partners(layout, id).ok_or_else(|| format!("{id} is outside {layout:?}"))?;
            Ok(StageOp::Wire {
                generation,
                dp: replicas
                    .iter()
                    .map(|&q| address(&data_of, q))
                    .collect::<Result<_, String>>()?,
                links: stages
                    .iter()
                    .map(|&q| address(&link_of, q))
                    .collect::<Result<_, String>>()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// REC-6 across processes: whichever slots hold the ranks, every rank's Wire lists its
        /// stage index's replicas (by replica) and its replica's stages (by stage index) at the
        /// slots that hold them.
        #[test]
        fn every_wire_names_its_partners_where_their_slots_listen(
            dp in 1u32..4,
            pp in 1u32..4,
            seed in any::<u64>(),
        ) {
            let layout = Layout::new(dp, pp, 1).unwrap();
            let world = layout.world_size() as usize;
            // Slots: a permutation of world..2·world (replacements come from later slots).
            let mut slot_of: Vec<Rank> = (0..world).map(|r| Rank((world + r) as u32)).collect();
            let mut state = seed;
            for i in (1..world).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                slot_of.swap(i, (state >> 33) as usize % (i + 1));
            }
            let data: Vec<SocketAddr> = (0..2 * world)
                .map(|s| SocketAddr::from(([10, 0, 0, 1], 5000 + s as u16)))
                .collect();
            let links: Vec<Option<SocketAddr>> = (0..2 * world)
                .map(|s| Some(SocketAddr::from(([10, 0, 0, 2], 6000 + s as u16))))
                .collect();
            let generation = crate::mesh::Generation(3);
            let ops = wire_ops(layout, &slot_of, &data, &links, generation).unwrap();
            prop_assert_eq!(ops.len(), world);
            for (r, op) in ops.iter().enumerate() {
                let c = layout.coord_of(Rank(r as u32)).unwrap();
                let StageOp::Wire { generation: g, dp: dps, links: ls } = op else {
                    panic!("not a Wire: {op:?}");
                };
                prop_assert_eq!(*g, generation);
                prop_assert_eq!(dps.len(), dp as usize);
                prop_assert_eq!(ls.len(), pp as usize);
                for (d, addr) in dps.iter().enumerate() {
                    let q = layout.rank_of(crate::mesh::Coord { dp: d as u32, pp: c.pp, tp: 0 }).unwrap();
                    prop_assert_eq!(*addr, data[slot_of[q.index()].index()]);
                }
                for (s, addr) in ls.iter().enumerate() {
                    let q = layout.rank_of(crate::mesh::Coord { dp: c.dp, pp: s as u32, tp: 0 }).unwrap();
                    prop_assert_eq!(Some(*addr), links[slot_of[q.index()].index()]);
                }
                // A rank is its own partner at its own coordinates.
                prop_assert_eq!(dps[c.dp as usize], data[slot_of[r].index()]);
            }
        }
    }

    #[test]
    fn a_wire_without_the_link_address_of_a_partner_is_an_error() {
        let layout = Layout::new(1, 2, 1).unwrap();
        let data = [
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let links = [Some("127.0.0.1:3".parse().unwrap()), None];
        let e = wire_ops(
            layout,
            &[Rank(0), Rank(1)],
            &data,
            &links,
            crate::mesh::Generation(0),
        )
        .unwrap_err();
        assert!(e.contains("slot 1"), "{e}");
    }

    #[test]
    fn a_slot_groups_with_its_stage_index_and_its_replica() {
        // MESH-1: rank = dp + DP·pp.
        let layout = Layout::new(2, 3, 1).unwrap();
        let id = StageId {
            replica: 1,
            stage: 2,
            tp: 0,
        };
        let (replicas, stages) = partners(layout, id).unwrap();
        assert_eq!(replicas, [Rank(4), Rank(5)]);
        assert_eq!(stages, [Rank(1), Rank(3), Rank(5)]);
        let outside = StageId {
            replica: 2,
            stage: 0,
            tp: 0,
        };
        assert!(partners(layout, outside).is_none());
    }
}
