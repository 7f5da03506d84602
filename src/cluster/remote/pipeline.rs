//! Pipelines across processes: the pipeline links of a replica as TCP links (a
//! [`PacketWire`] per pair of stages; on the MPI transport an MPI packet channel each, the TCP
//! link its bootstrap), the slots of a dp × pp job, and how the head rebuilds a
//! pipeline stage's trained blocks.
//!
//! - Here, as REMOTE-4 (in `cluster::remote`) says, a slot of a pipeline job starts in two
//!   phases: `Start` starts its device and
//!   binds three listeners — pipeline links, tensor-parallel group, model group — (their
//!   addresses go back to the head), `Wire` (once every slot listens) joins the data-parallel
//!   group of its (stage, tp rank) over the world's data-plane listener, connects to its
//!   pipeline's other stages over the link listeners, and joins its tensor-parallel group and
//!   its replica's model group over theirs, all token-checked (LINK-1). A listener per kind, so
//!   no group takes another's connections.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Rebuild, SlotFactory, SlotFuture, SlotStart};
use crate::actors::pipeline_stage::{PipelineSpec, spawn_unlinked};
use crate::checkpoint::ShardSnapshot;
use crate::cluster::control::{PipelineListeners, StageOp};
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

/// Ends a pipeline wire from any thread: its TCP link, or an MPI wire's flag.
#[derive(Debug)]
pub(crate) enum WireCloser {
    /// A TCP wire's link.
    Tcp(LinkCloser),
    /// An MPI wire's channel (`comm::mpi::MpiPackets::closer`).
    #[cfg(feature = "mpi")]
    Mpi(Arc<std::sync::atomic::AtomicBool>),
}

impl WireCloser {
    /// Ends the wire: a waiting send or receive fails at once (TCP) or at its next poll (MPI).
    pub(crate) fn shutdown(&self) {
        match self {
            WireCloser::Tcp(c) => c.shutdown(),
            #[cfg(feature = "mpi")]
            WireCloser::Mpi(flag) => flag.store(true, std::sync::atomic::Ordering::SeqCst),
        }
    }
}

/// The pipeline links of stage `listener.rank()` of a replica whose stage s accepts links at
/// `addrs[s]`: a wire to every other stage (each sending through a queue of `capacity`
/// packets), and the closers that end them from any thread. On the MPI transport the TCP
/// links are a bootstrap: each pair exchanges its MPI endpoints over its link, and the wire
/// is an MPI packet channel (REMOTE-4).
pub(crate) fn connect_wires(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
    (capacity, transport): (usize, crate::comm::DataTransport),
) -> Result<(Wires, Vec<WireCloser>), TcpGroupError> {
    let me = listener.rank();
    let mut wires = Wires::new();
    let mut closers = Vec::new();
    #[cfg(feature = "mpi")]
    let endpoint = match transport {
        crate::comm::DataTransport::Mpi => Some(
            crate::comm::mpi::world()
                .map(|w| (w, w.endpoint()))
                .ok_or_else(|| TcpGroupError::Setup {
                    rank: me,
                    peer: me,
                    detail: "the job's pipeline links are MPI's and MPI is not initialised".into(),
                })?,
        ),
        crate::comm::DataTransport::Tcp => None,
    };
    #[cfg(not(feature = "mpi"))]
    if transport == crate::comm::DataTransport::Mpi {
        return Err(TcpGroupError::Setup {
            rank: me,
            peer: me,
            detail: "the job's pipeline links are MPI's; this build has no `mpi` feature".into(),
        });
    }
    for (peer, link) in connect_mesh(listener, addrs, config)? {
        let setup = |detail: String| TcpGroupError::Setup {
            rank: me,
            peer,
            detail,
        };
        let (mut writer, reader, closer) = link.split().map_err(|e| setup(e.to_string()))?;
        #[cfg(feature = "mpi")]
        let mut reader = reader;
        #[cfg(feature = "mpi")]
        if let Some((world, mine)) = endpoint {
            let deadline = Instant::now() + config.handshake_timeout;
            writer
                .send(&mine.to_bytes(), deadline)
                .map_err(|e| setup(format!("sending its MPI endpoint: {e}")))?;
            let mut theirs = Vec::new();
            reader
                .recv(&mut theirs, 8, deadline)
                .map_err(|e| setup(format!("reading the peer's MPI endpoint: {e}")))?;
            let theirs = crate::comm::mpi::MpiEndpoint::from_bytes(&theirs)
                .ok_or_else(|| setup(format!("{} bytes are not an MPI endpoint", theirs.len())))?;
            let packets = crate::comm::mpi::MpiPackets::new(
                world,
                (mine, me.index()),
                (theirs, peer.index()),
                capacity,
            )
            .map_err(|e| setup(e.to_string()))?;
            closers.push(WireCloser::Mpi(packets.closer()));
            wires.insert(
                peer.0,
                Arc::new(MpiWire {
                    packets,
                    max_payload: config.max_payload,
                }),
            );
            continue;
        }
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
        closers.push(WireCloser::Tcp(closer));
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

/// A pipeline link to a stage in another process over MPI (feature `mpi`): each packet one
/// MPI message on an [`MpiPackets`](crate::comm::mpi::MpiPackets) channel, at most
/// [`link_capacity`](PipelineSchedule::link_capacity) of them in flight, so a send completes
/// when MPI has the packet, as on a TCP wire's queue (PIPE-4).
#[cfg(feature = "mpi")]
#[derive(Debug)]
pub(crate) struct MpiWire {
    packets: crate::comm::mpi::MpiPackets,
    max_payload: u64,
}

#[cfg(feature = "mpi")]
impl PacketWire for MpiWire {
    fn send(&self, bytes: &[u8], deadline: Instant) -> Result<(), WireError> {
        if bytes.len() as u64 > self.max_payload {
            return Err(WireError::Refused(format!(
                "a packet of {} bytes is over the link's largest of {} bytes",
                bytes.len(),
                self.max_payload
            )));
        }
        self.packets.send(bytes, deadline).map_err(mpi_wire_error)
    }

    fn recv(&self, bytes: &mut Vec<u8>, deadline: Instant) -> Result<(), WireError> {
        let max = usize::try_from(self.max_payload).unwrap_or(usize::MAX);
        self.packets
            .recv(bytes, max, deadline)
            .map_err(mpi_wire_error)
    }
}

#[cfg(feature = "mpi")]
fn mpi_wire_error(e: crate::comm::mpi::PacketsError) -> WireError {
    match e {
        crate::comm::mpi::PacketsError::TimedOut => WireError::TimedOut,
        other => WireError::Broken(other.to_string()),
    }
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
                (start.comm, start.model),
            )
            .await
            .map_err(|e| format!("cannot start {}: {e}", start.id))
        })
    }
}

/// How the head rebuilds a pipeline stage's trained blocks from its model snapshot (one
/// shard per block, CKPT-6, taken by `ModelSnapshot`: the blocks' parameters as the stage
/// holds them at the end, whole under ZeRO-3): each block built as every stage builds it —
/// a tensor-parallel rank's slice of it —, then restored. The slices are put together by
/// [`PipelineModel::merge`] (TP-3).
pub(crate) fn rebuild_blocks<I: Send + Sync + 'static>(
    spec: Arc<PipelineSpec<I>>,
    device: burn::tensor::Device,
    tp: u32,
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
                let built = &spec.stages.blocks[block as usize];
                let unshard = built.tensor_parallel.as_ref().map(|(_, u)| u.clone());
                // A replicated block is whole on every tensor-parallel rank.
                let (tp_rank, degree) = match unshard {
                    Some(_) => (id.tp as usize, tp as usize),
                    None => (0, 1),
                };
                let slice = Arc::new(crate::parallel::tensor::TensorParallel::detached(
                    tp_rank, degree,
                ));
                let mut work =
                    (built.build)(&device, &spec.optimizer, spec.learning_rate.clone(), &slice)
                        .map_err(|e| format!("block {block} of {id} cannot be built: {e}"))?;
                if spec.recompute {
                    work.recompute_always();
                }
                // The parameters keep the ids this process drew for the block (another process
                // drew the snapshot's): every tensor-parallel rank's slice of a block then has
                // the same ids, which is how its slices are matched when they are put together.
                let drawn: HashMap<String, u64> = work
                    .module_params()
                    .params()
                    .iter()
                    .map(|p| (p.name.clone(), p.id))
                    .collect();
                let params = crate::checkpoint::ShardParams::from_params(
                    shard
                        .params
                        .params()
                        .iter()
                        .map(|p| crate::checkpoint::NamedParam {
                            id: drawn.get(&p.name).copied().unwrap_or(p.id),
                            ..p.clone()
                        })
                        .collect(),
                );
                work.restore(&params, None, (0, 1))
                    .map_err(|e| format!("block {block} of {id} does not restore: {e}"))?;
                Ok(crate::parallel::stages::BlockPart {
                    block,
                    tp_rank: id.tp,
                    module: work.into_module(),
                    unshard,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(PipelineModel::from_parts(blocks))
    })
}

/// Who a pipeline rank of a dp × pp × tp mesh groups with, as world ranks (MESH-1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Partners {
    /// Its (stage, tensor-parallel rank) in every replica, by replica: its data-parallel group.
    pub(crate) replicas: Vec<Rank>,
    /// Every stage of its pipeline (its replica and tensor-parallel rank), by stage index.
    pub(crate) stages: Vec<Rank>,
    /// Every tensor-parallel rank of its (replica, stage), by tensor-parallel rank.
    pub(crate) tp: Vec<Rank>,
    /// Every rank of its replica, in rank order (stage-major): its model group.
    pub(crate) model: Vec<Rank>,
}

/// The partners of the rank at `id` (`id.tp` its tensor-parallel rank), or `None` outside
/// `layout`.
pub(crate) fn partners(layout: Layout, id: StageId) -> Option<Partners> {
    let at = |dp, pp, tp| layout.rank_of(crate::mesh::Coord { dp, pp, tp });
    let replicas = (0..layout.dp())
        .map(|r| at(r, id.stage, id.tp))
        .collect::<Option<_>>()?;
    let stages = (0..layout.pp())
        .map(|s| at(id.replica, s, id.tp))
        .collect::<Option<_>>()?;
    let tp = (0..layout.tp())
        .map(|t| at(id.replica, id.stage, t))
        .collect::<Option<_>>()?;
    let model = (0..layout.pp())
        .flat_map(|s| (0..layout.tp()).map(move |t| (s, t)))
        .map(|(s, t)| at(id.replica, s, t))
        .collect::<Option<_>>()?;
    Some(Partners {
        replicas,
        stages,
        tp,
        model,
    })
}

/// The place of layout rank `rank` as a stage id (its tensor-parallel rank included).
pub(crate) fn stage_id(layout: Layout, rank: Rank) -> Option<StageId> {
    layout.coord_of(rank).map(|c| StageId {
        replica: c.dp,
        stage: c.pp,
        tp: c.tp,
    })
}

/// The `Wire` of every rank of a dp × pp × tp `layout` under `generation`, by layout rank:
/// `slot_of[r]` is the slot that holds layout rank r (REC-6 moves a rank to another slot);
/// `data[slot]` and `listeners[slot]` are a slot's data-plane listener and its pipeline
/// listeners (links, tensor-parallel and model groups).
pub(crate) fn wire_ops(
    layout: Layout,
    slot_of: &[Rank],
    data: &[SocketAddr],
    listeners: &[Option<PipelineListeners>],
    generation: crate::mesh::Generation,
) -> Result<Vec<StageOp>, String> {
    let address = |table: &dyn Fn(usize) -> Option<SocketAddr>, rank: Rank| {
        let slot = slot_of
            .get(rank.index())
            .ok_or_else(|| format!("no slot holds rank {}", rank.0))?;
        table(slot.index()).ok_or_else(|| format!("no address for slot {}", slot.0))
    };
    let listener = |slot: usize| listeners.get(slot).copied().flatten();
    let data_of = |slot: usize| data.get(slot).copied();
    let link_of = |slot: usize| listener(slot).map(|l| l.links);
    let tp_of = |slot: usize| listener(slot).map(|l| l.tp);
    let model_of = |slot: usize| listener(slot).map(|l| l.model);
    let addresses = |table: &dyn Fn(usize) -> Option<SocketAddr>, ranks: &[Rank]| {
        ranks
            .iter()
            .map(|&q| address(table, q))
            .collect::<Result<Vec<_>, String>>()
    };
    (0..layout.world_size())
        .map(|r| {
            let id = stage_id(layout, Rank(r))
                .ok_or_else(|| format!("rank {r} is outside {layout:?}"))?;
            let p = partners(layout, id).ok_or_else(|| format!("{id} is outside {layout:?}"))?;
            Ok(StageOp::Wire {
                generation,
                dp: addresses(&data_of, &p.replicas)?,
                links: addresses(&link_of, &p.stages)?,
                tp: addresses(&tp_of, &p.tp)?,
                model: addresses(&model_of, &p.model)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn listeners(slot: usize) -> PipelineListeners {
        let at = |net: u8| SocketAddr::from(([10, 0, 0, net], 6000 + slot as u16));
        PipelineListeners {
            links: at(2),
            tp: at(3),
            model: at(4),
        }
    }

    proptest! {
        /// REC-6 across processes: whichever slots hold the ranks, every rank's Wire lists its
        /// data-parallel group (by replica), its pipeline's stages (by stage index), its
        /// tensor-parallel group (by tp rank) and its replica's model group (rank order) at the
        /// slots that hold them, each on its own listener.
        #[test]
        fn every_wire_names_its_partners_where_their_slots_listen(
            dp in 1u32..4,
            pp in 1u32..4,
            tp in 1u32..3,
            seed in any::<u64>(),
        ) {
            let layout = Layout::new(dp, pp, tp).unwrap();
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
            let heard: Vec<Option<PipelineListeners>> =
                (0..2 * world).map(|s| Some(listeners(s))).collect();
            let generation = crate::mesh::Generation(3);
            let ops = wire_ops(layout, &slot_of, &data, &heard, generation).unwrap();
            prop_assert_eq!(ops.len(), world);
            let slot = |c: crate::mesh::Coord| slot_of[layout.rank_of(c).unwrap().index()].index();
            for (r, op) in ops.iter().enumerate() {
                let c = layout.coord_of(Rank(r as u32)).unwrap();
                let StageOp::Wire { generation: g, dp: dps, links: ls, tp: tps, model } = op else {
                    panic!("not a Wire: {op:?}");
                };
                prop_assert_eq!(*g, generation);
                prop_assert_eq!(dps.len(), dp as usize);
                prop_assert_eq!(ls.len(), pp as usize);
                prop_assert_eq!(tps.len(), tp as usize);
                prop_assert_eq!(model.len(), (pp * tp) as usize);
                for (d, addr) in dps.iter().enumerate() {
                    let q = slot(crate::mesh::Coord { dp: d as u32, pp: c.pp, tp: c.tp });
                    prop_assert_eq!(*addr, data[q]);
                }
                for (s, addr) in ls.iter().enumerate() {
                    let q = slot(crate::mesh::Coord { dp: c.dp, pp: s as u32, tp: c.tp });
                    prop_assert_eq!(*addr, listeners(q).links);
                }
                for (t, addr) in tps.iter().enumerate() {
                    let q = slot(crate::mesh::Coord { dp: c.dp, pp: c.pp, tp: t as u32 });
                    prop_assert_eq!(*addr, listeners(q).tp);
                }
                for (i, addr) in model.iter().enumerate() {
                    let (s, t) = (i as u32 / tp, i as u32 % tp);
                    let q = slot(crate::mesh::Coord { dp: c.dp, pp: s, tp: t });
                    prop_assert_eq!(*addr, listeners(q).model);
                }
                // A rank is its own partner at its own coordinates.
                prop_assert_eq!(dps[c.dp as usize], data[slot_of[r].index()]);
                prop_assert_eq!(tps[c.tp as usize], listeners(slot_of[r].index()).tp);
                prop_assert_eq!(
                    model[(c.pp * tp + c.tp) as usize],
                    listeners(slot_of[r].index()).model
                );
            }
        }
    }

    #[test]
    fn a_wire_without_the_listeners_of_a_partner_is_an_error() {
        let layout = Layout::new(1, 2, 1).unwrap();
        let data = [
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let heard = [Some(listeners(0)), None];
        let e = wire_ops(
            layout,
            &[Rank(0), Rank(1)],
            &data,
            &heard,
            crate::mesh::Generation(0),
        )
        .unwrap_err();
        assert!(e.contains("slot 1"), "{e}");
    }

    #[test]
    fn a_slot_groups_with_its_replicas_its_pipeline_its_tp_group_and_its_replica() {
        // MESH-1: rank = tp + TP·(dp + DP·pp).
        let layout = Layout::new(2, 3, 2).unwrap();
        let id = StageId {
            replica: 1,
            stage: 2,
            tp: 1,
        };
        let p = partners(layout, id).unwrap();
        assert_eq!(p.replicas, [Rank(9), Rank(11)]);
        assert_eq!(p.stages, [Rank(3), Rank(7), Rank(11)]);
        assert_eq!(p.tp, [Rank(10), Rank(11)]);
        assert_eq!(
            p.model,
            [Rank(2), Rank(3), Rank(6), Rank(7), Rank(10), Rank(11)]
        );
        let outside = StageId {
            replica: 2,
            stage: 0,
            tp: 0,
        };
        assert!(partners(layout, outside).is_none());
    }
}
