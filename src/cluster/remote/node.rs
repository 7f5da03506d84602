//! A process's stages (`NodeStages`, the `StageHost` a node's agent and the head's own devices
//! serve requests with): one slot per rank, each a device actor and a stage actor whose
//! communicator is a data-plane group; starting, wiring, snapshots and restores in parts.

use super::*;
use crate::cluster::control::PipelineListeners;
use crate::parallel::pipeline_exec::ModelGroups;

mod pipeline_slot;
use pipeline_slot::{SlotListeners, WireAddrs};

/// One slot of a process: its device, listener, and (once started) its actors and group.
pub(super) struct NodeSlot<M> {
    pub(super) device: MeshDevice,
    pub(super) listener: TcpListener,
    pub(super) device_actor: Option<ActorRef<DeviceMsg>>,
    pub(super) stage: Option<ActorRef<StageMsg<M>>>,
    pub(super) id: StageId,
    /// The data-plane group it is in, with its generation.
    pub(super) group: Option<(Generation, GroupShutdown)>,
    /// A pipeline slot once started: where its pipeline links and the connections of its
    /// tensor-parallel and model groups are accepted (at every Wire).
    pub(super) pipeline_listeners: Option<SlotListeners>,
    /// A pipeline slot's links to its pipeline's other stages.
    pub(super) wires: Vec<super::pipeline::WireCloser>,
    /// A pipeline slot's tensor-parallel and model groups.
    pub(super) model_groups: Vec<GroupShutdown>,
    /// The generation of its last Wire (a pipeline slot; REMOTE-3: older aborts are ignored).
    pub(super) wired: Generation,
    /// The last snapshot over one message, by transfer, until the head fetched its last part.
    pub(super) outgoing: (u64, Vec<Vec<u8>>),
    /// The restore being received: its transfer, its parts so far, the next part expected.
    pub(super) incoming: (u64, Vec<u8>, u32),
    /// Steps it trained (answered `Step` with a report).
    pub(super) steps: u64,
    /// How it last joined the data plane, in words.
    pub(super) joined: String,
}

impl<M> NodeSlot<M> {
    /// Shuts its data-plane group and pipeline links (RT-4).
    pub(super) fn shut(&mut self) {
        if let Some((_, group)) = &self.group {
            group.shutdown();
        }
        for w in &self.wires {
            w.shutdown();
        }
        for g in &self.model_groups {
            g.shutdown();
        }
    }
}

pub(super) struct NodeInner<M> {
    pub(super) factory: Arc<dyn SlotFactory<M>>,
    pub(super) token: JobToken,
    /// The data-plane groups its slots join.
    pub(super) groups: ProcessGroups,
    pub(super) plan: ProcessPlan,
    pub(super) tcp: TcpConfig,
    /// The job's fault plan as this process carries it out (FAULT-3).
    pub(super) faults: Option<Arc<crate::faults::FaultHooks>>,
    pub(super) slots: Mutex<HashMap<u32, NodeSlot<M>>>,
    /// The head's address as this process reaches it (`None`: this is the head's process).
    pub(super) head: Option<std::net::IpAddr>,
}

/// A process's stages: serves the head's [`StageRequest`]s for its slots with ordinary
/// [`StageActor`]s (or pipeline stage actors) whose communicators are TCP groups (what a
/// node's agent, and the head for its own devices, hand requests to).
pub(crate) struct NodeStages<M> {
    pub(super) inner: Arc<NodeInner<M>>,
}

impl<M> std::fmt::Debug for NodeStages<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeStages({:?})", self.inner.plan.ranks)
    }
}

impl<M: Send + 'static> NodeStages<M> {
    /// The stages of `args.plan`'s slots, started by `factory`, one device each of the
    /// backend the job's spec names.
    pub(crate) fn new(
        factory: Arc<dyn SlotFactory<M>>,
        args: HostArgs,
        tcp: TcpConfig,
        faults: Option<Arc<crate::faults::FaultHooks>>,
    ) -> Result<Self> {
        if args.listeners.len() != args.plan.ranks.len() {
            return Err(Error::InvalidConfig(format!(
                "{} data-plane listeners for ranks {:?}",
                args.listeners.len(),
                args.plan.ranks
            )));
        }
        let devices = MeshDevice::of_kind(args.spec.backend, args.plan.ranks.len())?;
        let slots = args
            .plan
            .ranks
            .iter()
            .zip(args.listeners)
            .zip(devices)
            .map(|((&slot, listener), d)| {
                let device = MeshDevice::from_burn(DeviceId(slot.0), d.kind(), d.burn().clone());
                let id = StageId {
                    replica: slot.0,
                    stage: 0,
                    tp: 0,
                };
                (
                    slot.0,
                    NodeSlot {
                        device,
                        listener,
                        device_actor: None,
                        stage: None,
                        id,
                        group: None,
                        pipeline_listeners: None,
                        wires: Vec::new(),
                        model_groups: Vec::new(),
                        wired: Generation(0),
                        outgoing: (0, Vec::new()),
                        incoming: (0, Vec::new(), 0),
                        steps: 0,
                        joined: String::new(),
                    },
                )
            })
            .collect();
        Ok(Self {
            inner: Arc::new(NodeInner {
                factory,
                groups: ProcessGroups::new(
                    args.token.clone(),
                    tcp.clone(),
                    args.spec.job.transport,
                ),
                token: args.token,
                plan: args.plan,
                tcp,
                faults,
                slots: Mutex::new(slots),
                head: args.head,
            }),
        })
    }
}

impl<M: Send + 'static> NodeInner<M> {
    pub(super) fn with_slot<T>(
        &self,
        slot: Rank,
        f: impl FnOnce(&mut NodeSlot<M>) -> T,
    ) -> std::result::Result<T, RemoteError> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        match slots.get_mut(&slot.0) {
            Some(s) => Ok(f(s)),
            None => Err(RemoteError::Other(format!(
                "rank {} is not a slot of this process (it holds {:?})",
                slot.0, self.plan.ranks
            ))),
        }
    }

    /// Joins the group of `generation` whose ranks listen at `addrs`, as `rank`, through
    /// `slot`'s listener ([`ProcessGroups::join`]); the old group (if any) is shut down first.
    pub(super) async fn connect(
        &self,
        slot: Rank,
        rank: Rank,
        generation: Generation,
        addrs: Vec<SocketAddr>,
        processes: Option<Vec<u32>>,
    ) -> std::result::Result<crate::comm::Communicator, RemoteError> {
        let listener = self.with_slot(slot, |s| {
            if let Some((_, old)) = s.group.take() {
                old.shutdown();
            }
            s.listener.try_clone()
        })?;
        let joined = self
            .groups
            .join(listener, rank, generation, addrs, processes)
            .await
            .map_err(|e| RemoteError::Other(e.to_string()))?;
        self.with_slot(slot, |s| {
            s.group = Some((generation, joined.shutdown));
            s.joined = joined.description;
        })?;
        Ok(joined.communicator)
    }

    pub(super) async fn serve(self: Arc<Self>, request: StageRequest) -> StageAnswer {
        let timeout = Duration::from_millis(request.timeout_ms);
        let step = matches!(request.op, StageOp::Step { .. });
        let answer = match self.serve_op(request.slot, request.op, timeout).await {
            Ok(answer) => answer,
            Err(e) => StageAnswer::Failed(e),
        };
        // FAULT-3: what fired here goes back with a step's answer (its stage proxy reads it),
        // for the head to publish.
        match self
            .faults
            .as_ref()
            .filter(|_| step)
            .map(|h| h.take_fired())
        {
            Some(fired) if !fired.is_empty() => {
                let fired = fired
                    .into_iter()
                    .map(|f| (u32::try_from(f.index).unwrap_or(u32::MAX), f.micro_batch))
                    .collect();
                match answer {
                    StageAnswer::Step(report) => StageAnswer::StepFired {
                        fired,
                        outcome: Ok(report),
                    },
                    StageAnswer::Failed(e) => StageAnswer::StepFired {
                        fired,
                        outcome: Err(e),
                    },
                    // A step answers Step or Failed only.
                    other => other,
                }
            }
            _ => answer,
        }
    }

    pub(super) async fn serve_op(
        &self,
        slot: Rank,
        op: StageOp,
        timeout: Duration,
    ) -> std::result::Result<StageAnswer, RemoteError> {
        match op {
            StageOp::Start { id, alone, server } => match self.factory.pipeline() {
                None => self
                    .start(slot, id, alone, server)
                    .await
                    .map(|()| StageAnswer::Done),
                Some(_) => self.listen(slot, id).await.map(StageAnswer::Listening),
            },
            StageOp::Wire {
                generation,
                dp,
                links,
                tp,
                model,
            } => self
                .wire(
                    slot,
                    generation,
                    WireAddrs {
                        dp,
                        links,
                        tp,
                        model,
                    },
                    timeout,
                )
                .await
                .map(|()| StageAnswer::Done),
            StageOp::Abort { generation } => {
                self.with_slot(slot, |s| {
                    let grouped = s.group.as_ref().map_or(Generation(0), |(g, _)| *g);
                    let current = grouped.max(s.wired);
                    if current <= generation {
                        s.shut();
                    }
                })?;
                Ok(StageAnswer::Done)
            }
            StageOp::Heartbeat => {
                let (device, id) =
                    self.with_slot(slot, |s| (s.device_actor.clone(), s.device.id()))?;
                let device = device.ok_or_else(|| not_started(slot))?;
                heartbeat(&device, id, timeout.min(HEARTBEAT_WAIT))
                    .await
                    .map(StageAnswer::Heartbeat)
                    .map_err(|e| RemoteError::from(&e))
            }
            StageOp::Init => self
                .asker(slot, timeout)?
                .call(StageMsg::Init)
                .await
                .map(|r| StageAnswer::Init {
                    before: r.before,
                    after: r.after,
                }),
            StageOp::Step {
                step,
                micro_batches,
                global_samples,
            } => self
                .asker(slot, timeout)?
                .call(|reply| StageMsg::Step {
                    step,
                    micro_batches,
                    global_samples,
                    reply,
                })
                .await
                .map(|report| {
                    let _ = self.with_slot(slot, |s| s.steps += 1);
                    StageAnswer::Step(Box::new(report))
                }),
            StageOp::Fingerprint => self
                .asker(slot, timeout)?
                .call(StageMsg::Fingerprint)
                .await
                .map(StageAnswer::Fingerprint),
            StageOp::Snapshot => {
                let shards = self.asker(slot, timeout)?.call(StageMsg::Snapshot).await?;
                self.send_snapshot(slot, &shards)
            }
            StageOp::ModelSnapshot => {
                let shards = self
                    .asker(slot, timeout)?
                    .call(StageMsg::SnapshotModel)
                    .await?;
                self.send_snapshot(slot, &shards)
            }
            StageOp::SnapshotPart { transfer, part } => self.with_slot(slot, |s| {
                let (kept, parts) = &mut s.outgoing;
                let piece = (*kept == transfer)
                    .then(|| parts.get(part as usize).cloned())
                    .flatten();
                if *kept == transfer && part as usize + 1 >= parts.len() {
                    parts.clear();
                }
                piece.map(StageAnswer::Part).ok_or_else(|| {
                    RemoteError::Other(format!(
                        "rank {} keeps no part {part} of snapshot transfer {transfer} (a newer \
                         snapshot replaced it, or it was fetched already)",
                        slot.0
                    ))
                })
            })?,
            StageOp::RestorePart {
                transfer,
                part,
                parts,
                bytes,
            } => {
                let whole = self.with_slot(slot, |s| {
                    let (current, kept, next) = &mut s.incoming;
                    if part == 0 {
                        *current = transfer;
                        kept.clear();
                        *next = 0;
                    }
                    if transfer != *current || part != *next || part >= parts {
                        *next = 0;
                        kept.clear();
                        return Err(RemoteError::Other(format!(
                            "part {part} of {parts} of restore transfer {transfer}, expected \
                             part {next} of transfer {current}"
                        )));
                    }
                    kept.extend_from_slice(&bytes);
                    *next += 1;
                    Ok((part + 1 == parts).then(|| std::mem::take(kept)))
                })??;
                match whole {
                    None => Ok(StageAnswer::Done),
                    Some(bytes) => {
                        let shards = split_shards(&bytes).map_err(RemoteError::Other)?;
                        self.restore(slot, shards, timeout).await
                    }
                }
            }
            StageOp::Restore { shards } => self.restore(slot, shards, timeout).await,
            StageOp::Regroup {
                id,
                rank,
                generation,
                addrs,
                processes,
            } => {
                let ask = self.asker(slot, timeout)?;
                let comm = self
                    .connect(slot, rank, generation, addrs, Some(processes))
                    .await?;
                ask.call(|reply| StageMsg::Regroup {
                    id,
                    rank,
                    comm,
                    reply,
                })
                .await?;
                self.with_slot(slot, |s| s.id = id)?;
                Ok(StageAnswer::Done)
            }
        }
    }

    /// The answer carrying `shards` in the checkpoint format: in one message, or (REMOTE-6)
    /// kept until the head fetched it part by part.
    fn send_snapshot(
        &self,
        slot: Rank,
        shards: &[crate::checkpoint::ShardSnapshot],
    ) -> std::result::Result<StageAnswer, RemoteError> {
        let shards: Vec<Vec<u8>> = shards
            .iter()
            .map(crate::checkpoint::format::encode_transfer)
            .collect();
        if shards.iter().map(Vec::len).sum::<usize>() <= PART_BYTES {
            return Ok(StageAnswer::Snapshot(shards));
        }
        let parts: Vec<Vec<u8>> = join_shards(&shards)
            .chunks(PART_BYTES)
            .map(<[u8]>::to_vec)
            .collect();
        let count = parts.len() as u32;
        let transfer = self.with_slot(slot, |s| {
            let transfer = s.outgoing.0 + 1;
            s.outgoing = (transfer, parts);
            transfer
        })?;
        Ok(StageAnswer::SnapshotParts {
            transfer,
            parts: count,
        })
    }

    /// Restores `slot`'s stage from shards in the checkpoint format (checksums verified).
    pub(super) async fn restore(
        &self,
        slot: Rank,
        shards: Vec<Vec<u8>>,
        timeout: Duration,
    ) -> std::result::Result<StageAnswer, RemoteError> {
        let from = Path::new("<shard from the head>");
        let shard = shards
            .iter()
            .map(|b| crate::checkpoint::format::decode_transfer(b, from))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| RemoteError::Other(e.to_string()))?;
        self.asker(slot, timeout)?
            .call(|reply| StageMsg::Restore { shard, reply })
            .await
            .map(|()| StageAnswer::Done)
    }

    /// Asks `slot`'s stage, bounded by `timeout`.
    pub(super) fn asker(
        &self,
        slot: Rank,
        timeout: Duration,
    ) -> std::result::Result<Asker<M>, RemoteError> {
        let (stage, id, device) =
            self.with_slot(slot, |s| (s.stage.clone(), s.id, s.device.id()))?;
        Ok(Asker {
            stage: stage.ok_or_else(|| not_started(slot))?,
            id,
            device,
            timeout,
        })
    }

    /// Starts `slot`'s device and stage, joined to the world's data plane of generation 0, or
    /// (`alone`: a node that joined the running job) in a group of its own until the
    /// Supervisor reconnects everyone (REMOTE-5).
    pub(super) async fn start(
        &self,
        slot: Rank,
        id: StageId,
        alone: bool,
        server: Option<u16>,
    ) -> std::result::Result<(), RemoteError> {
        let (started, device) = self.with_slot(slot, |s| (s.stage.is_some(), s.device.clone()))?;
        if started {
            return Err(RemoteError::Other(format!(
                "rank {} was started already",
                slot.0
            )));
        }
        let comm = if alone {
            let own = self.plan.addrs.get(slot.index()).copied().ok_or_else(|| {
                RemoteError::Other(format!("rank {} has no address in the world", slot.0))
            })?;
            self.connect(slot, Rank(0), Generation(0), vec![own], None)
                .await?
        } else {
            let processes = self.plan.processes.iter().map(|p| p.0).collect();
            self.connect(
                slot,
                slot,
                Generation(0),
                self.plan.addrs.clone(),
                Some(processes),
            )
            .await?
        };
        let (device_actor, _) = Actor::spawn(None, DeviceActor, device.clone())
            .await
            .map_err(|e| RemoteError::Other(format!("cannot start the device: {e}")))?;
        let start = SlotStart {
            id,
            rank: slot,
            device,
            device_actor: device_actor.clone(),
            comm: Some(comm),
            links: None,
            model: ModelGroups::default(),
            server: server.map(|port| super::ps::ServerLinkArgs {
                // The head's own stages reach its gateway on loopback.
                gateway: SocketAddr::new(
                    self.head
                        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
                    port,
                ),
                worker: slot.0,
                token: self.token.clone(),
                config: self.tcp.link,
                emulated: self.tcp.comm.link.clone(),
            }),
        };
        let stage = self
            .factory
            .spawn(start)
            .await
            .map_err(RemoteError::Other)?;
        self.with_slot(slot, |s| {
            s.device_actor = Some(device_actor);
            s.stage = Some(stage);
            s.id = id;
        })
    }
}

pub(super) fn not_started(slot: Rank) -> RemoteError {
    RemoteError::Other(format!("rank {} was not started", slot.0))
}

/// Asks a local stage actor, bounded by the request's time-out.
pub(super) struct Asker<M> {
    pub(super) stage: ActorRef<StageMsg<M>>,
    pub(super) id: StageId,
    pub(super) device: DeviceId,
    pub(super) timeout: Duration,
}

impl<M: Send + 'static> Asker<M> {
    pub(super) async fn call<T: Send + 'static>(
        &self,
        msg: impl FnOnce(RpcReplyPort<Result<T>>) -> StageMsg<M>,
    ) -> std::result::Result<T, RemoteError> {
        match self.stage.call(msg, Some(self.timeout)).await {
            Ok(CallResult::Success(Ok(v))) => Ok(v),
            Ok(CallResult::Success(Err(e))) => Err(RemoteError::from(&e)),
            Ok(CallResult::Timeout) => Err(RemoteError::Other(format!(
                "{} did not answer within {:?}",
                self.id, self.timeout
            ))),
            Ok(CallResult::SenderError) | Err(_) => Err(RemoteError::StageLost {
                device: self.device,
                stage: self.id,
                reason: "its actor stopped without answering".into(),
            }),
        }
    }
}

impl<M: Send + 'static> StageHost for NodeStages<M> {
    fn serve(&self, request: StageRequest) -> crate::cluster::control::stages::AnswerFuture {
        Box::pin(self.inner.clone().serve(request))
    }

    fn steps_trained(&self) -> Vec<(Rank, u64)> {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(Rank, u64)> = slots.iter().map(|(&r, s)| (Rank(r), s.steps)).collect();
        out.sort_unstable();
        out
    }

    fn data_plane(&self) -> Vec<(Rank, String)> {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(Rank, String)> = slots
            .iter()
            .filter(|(_, s)| !s.joined.is_empty())
            .map(|(&r, s)| (Rank(r), s.joined.clone()))
            .collect();
        out.sort_unstable();
        out
    }

    fn stop(&self) {
        let mut slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        for s in slots.values_mut() {
            s.shut();
            s.group = None;
            s.wires.clear();
            if let Some(stage) = s.stage.take() {
                stage.stop(Some("the job ended".into()));
            }
            if let Some(device) = s.device_actor.take() {
                device.stop(Some("the job ended".into()));
            }
        }
    }
}
