//! The head's proxies for ranks in other processes: `RemoteStage` answers the Supervisor's
//! `StageMsg`s by sending `StageOp`s to the process holding the rank (REMOTE-2: a lost node
//! fails every request at once), `RemoteDevice` answers its heartbeats.

use super::*;

/// The head's proxy of a stage in another process (or in the head's own [`NodeStages`]).
pub(crate) struct RemoteStage<M>(std::marker::PhantomData<fn() -> M>);

impl<M> Default for RemoteStage<M> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M> std::fmt::Debug for RemoteStage<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteStage")
    }
}

/// What a [`RemoteStage`] starts from, and its state.
pub(crate) struct RemoteStageArgs<M> {
    pub(super) slot: Rank,
    pub(super) id: StageId,
    pub(super) device: DeviceId,
    pub(super) endpoint: Endpoint,
    /// Every slot, for its data-plane address.
    pub(super) slots: Arc<Mutex<MeshSlots>>,
    /// Rebuilds the trained model on the head from the stage's snapshot.
    pub(super) rebuild: Rebuild<M>,
    /// The newest generation a group was formed under (REMOTE-3).
    pub(super) generation: Arc<AtomicU64>,
    /// How long a request may take (the job's step time-out, which the Supervisor's own wait
    /// also is).
    pub(super) wait: Duration,
    /// The job's fault plan as the Supervisor carries it out: what fired on the node is
    /// recorded in it and published (FAULT-3).
    pub(super) faults: Option<Arc<crate::faults::FaultHooks>>,
}

impl<M> std::fmt::Debug for RemoteStageArgs<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RemoteStage({}, slot {}, {:?})",
            self.id, self.slot.0, self.endpoint
        )
    }
}

impl<M> RemoteStageArgs<M> {
    /// The stage cannot be reached (REMOTE-2).
    pub(super) fn lost(&self, why: String) -> Error {
        Error::StageLost {
            device: self.device,
            stage: self.id,
            reason: format!("{} is unreachable: {why}", self.endpoint.name()),
        }
    }

    /// Sends `op` and reads the answer with `read`; a failure on the node comes back as its
    /// error, an unreachable node as `StageLost`.
    pub(super) async fn ask<T>(
        &self,
        op: StageOp,
        timeout: Duration,
        read: impl FnOnce(StageAnswer) -> Option<T>,
    ) -> Result<T> {
        let kind = op.kind();
        let answer = match self.endpoint.call(self.slot, op, timeout).await {
            Ok(StageAnswer::StepFired { fired, outcome }) => {
                if let Some(h) = &self.faults {
                    h.record(fired.into_iter().map(|(i, m)| (i as usize, m)));
                }
                Ok(match outcome {
                    Ok(report) => StageAnswer::Step(report),
                    Err(e) => StageAnswer::Failed(e),
                })
            }
            other => other,
        };
        match answer {
            Err(why) => Err(self.lost(why)),
            Ok(StageAnswer::Failed(e)) => Err(e.into_error(&self.endpoint.name())),
            Ok(answer) => {
                let got = answer.kind();
                read(answer).ok_or_else(|| {
                    Error::Runtime(format!(
                        "{} answered {kind} for {} with {got}",
                        self.endpoint.name(),
                        self.id
                    ))
                })
            }
        }
    }

    /// The stage's snapshot (`StageOp::Snapshot`) or its model's (`StageOp::ModelSnapshot`),
    /// fetched part by part when it is over one message.
    pub(super) async fn snapshot(
        &self,
        op: StageOp,
        timeout: Duration,
    ) -> Result<Vec<ShardSnapshot>> {
        let answer = self
            .ask(op, timeout, |a| match a {
                StageAnswer::Snapshot(s) => Some(Ok(s)),
                StageAnswer::SnapshotParts { transfer, parts } => Some(Err((transfer, parts))),
                _ => None,
            })
            .await?;
        let from = format!("<snapshot of {} from {}>", self.id, self.endpoint.name());
        let shards = match answer {
            Ok(shards) => shards,
            // Over one message: fetched part by part (REMOTE-6).
            Err((transfer, parts)) => {
                let mut bytes = Vec::new();
                for part in 0..parts {
                    let op = StageOp::SnapshotPart { transfer, part };
                    let piece = self
                        .ask(op, timeout, |a| match a {
                            StageAnswer::Part(b) => Some(b),
                            _ => None,
                        })
                        .await?;
                    bytes.extend_from_slice(&piece);
                }
                split_shards(&bytes).map_err(|e| Error::Runtime(format!("{from}: {e}")))?
            }
        };
        shards
            .iter()
            .map(|bytes| {
                crate::checkpoint::format::decode_transfer(bytes, Path::new(&from))
                    .map_err(Error::from)
            })
            .collect()
    }
}

impl<M> RemoteStageArgs<M> {
    /// Sends shards (in the checkpoint format) to restore: in one message, or part by part
    /// over [`PART_BYTES`] (REMOTE-6).
    pub(super) async fn restore(&self, shards: Vec<Vec<u8>>, wait: Duration) -> Result<()> {
        let done = |a: StageAnswer| matches!(a, StageAnswer::Done).then_some(());
        let total: usize = shards.iter().map(Vec::len).sum();
        if total <= PART_BYTES {
            return self.ask(StageOp::Restore { shards }, wait, done).await;
        }
        let joined = join_shards(&shards);
        let parts = joined.len().div_ceil(PART_BYTES) as u32;
        let transfer: u64 = rand::random();
        for (part, bytes) in joined.chunks(PART_BYTES).enumerate() {
            let op = StageOp::RestorePart {
                transfer,
                part: part as u32,
                parts,
                bytes: bytes.to_vec(),
            };
            self.ask(op, wait, done).await?;
        }
        Ok(())
    }
}

impl<M> Actor for RemoteStage<M>
where
    M: Send + 'static,
{
    type Msg = StageMsg<M>;
    type State = RemoteStageArgs<M>;
    type Arguments = RemoteStageArgs<M>;

    async fn pre_start(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        args: RemoteStageArgs<M>,
    ) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        message: StageMsg<M>,
        state: &mut Self::State,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let wait = state.wait;
        match message {
            StageMsg::Init(reply) => {
                let r = state
                    .ask(StageOp::Init, wait, |a| match a {
                        StageAnswer::Init { before, after } => Some(InitReport { before, after }),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            } => {
                let op = StageOp::Step {
                    step,
                    micro_batches,
                    global_samples,
                };
                let r = state
                    .ask(op, wait, |a| match a {
                        StageAnswer::Step(report) => Some(*report),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::Fingerprint(reply) => {
                let r = state
                    .ask(StageOp::Fingerprint, wait, |a| match a {
                        StageAnswer::Fingerprint(f) => Some(f),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::TakeModel(reply) => {
                let _ = reply.send(take_model(state, wait).await);
            }
            StageMsg::Snapshot(reply) => {
                let _ = reply.send(state.snapshot(StageOp::Snapshot, wait).await);
            }
            StageMsg::SnapshotModel(reply) => {
                let _ = reply.send(state.snapshot(StageOp::ModelSnapshot, wait).await);
            }
            StageMsg::Restore { shard, reply } => {
                let shards: Vec<Vec<u8>> = shard
                    .iter()
                    .map(crate::checkpoint::format::encode_transfer)
                    .collect();
                let _ = reply.send(state.restore(shards, wait).await);
            }
            StageMsg::Reconnect {
                id,
                rank,
                generation,
                slots,
                reply,
            } => {
                let (members, known) = {
                    let mesh = lock(&state.slots);
                    let members: Option<Vec<(SocketAddr, u32)>> = slots
                        .iter()
                        .map(|s| {
                            Some((*mesh.addrs.get(s.index())?, *mesh.processes.get(s.index())?))
                        })
                        .collect();
                    (members, mesh.addrs.len())
                };
                let r = match members {
                    None => Err(Error::InvalidConfig(format!(
                        "reconnect with slots {slots:?}, not all in a world of {known}"
                    ))),
                    Some(members) => {
                        let (addrs, processes) = members.into_iter().unzip();
                        let op = StageOp::Regroup {
                            id,
                            rank,
                            generation,
                            addrs,
                            processes,
                        };
                        state
                            .ask(op, wait, |a| matches!(a, StageAnswer::Done).then_some(()))
                            .await
                    }
                };
                if r.is_ok() {
                    state.id = id;
                    state.generation.fetch_max(generation.0, Ordering::SeqCst);
                }
                let _ = reply.send(r);
            }
            StageMsg::Regroup { reply, .. } | StageMsg::Rewire { reply, .. } => {
                let _ = reply.send(Err(Error::InvalidConfig(
                    "a stage of another process joins a rebuilt group through Reconnect".into(),
                )));
            }
        }
        Ok(())
    }
}

/// The trained model of a stage in another process: its model's snapshot (the parameters as
/// the stage holds them at the end: whole blocks under ZeRO-3, once `Fingerprint` gathered
/// them), restored into a model the job builds on the head.
async fn take_model<M>(state: &RemoteStageArgs<M>, wait: Duration) -> Option<M> {
    let shards = match state.snapshot(StageOp::ModelSnapshot, wait).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("the trained model of {} is lost: {e}", state.id);
            return None;
        }
    };
    match (state.rebuild)(state.id, shards) {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::error!("the trained model of {} is lost: {e}", state.id);
            None
        }
    }
}

/// How long the head's proxy waits for a device of another process to answer a heartbeat.
const REMOTE_HEARTBEAT_WAIT: Duration = Duration::from_secs(30);

/// The head's proxy of a device in another process: answers the Supervisor's heartbeats with
/// the device's own.
#[derive(Debug, Default)]
pub(crate) struct RemoteDevice;

/// What a [`RemoteDevice`] starts from, and its state.
#[derive(Debug)]
pub(crate) struct RemoteDeviceArgs {
    pub(super) slot: Rank,
    pub(super) device: DeviceId,
    pub(super) endpoint: Endpoint,
}

impl Actor for RemoteDevice {
    type Msg = DeviceMsg;
    type State = RemoteDeviceArgs;
    type Arguments = RemoteDeviceArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<DeviceMsg>,
        args: RemoteDeviceArgs,
    ) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<DeviceMsg>,
        message: DeviceMsg,
        state: &mut Self::State,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match message {
            DeviceMsg::Heartbeat(reply) => {
                // Answered from a task: a cut-off node must not hold the next heartbeat. The
                // caller bounds its own wait; this one only ends the task of a frozen node
                // (a shorter one would fail a probe that waits longer, on a loaded machine).
                let (endpoint, slot) = (state.endpoint.clone(), state.slot);
                tokio::spawn(async move {
                    if let Ok(StageAnswer::Heartbeat(h)) = endpoint
                        .call(slot, StageOp::Heartbeat, REMOTE_HEARTBEAT_WAIT)
                        .await
                    {
                        let _ = reply.send(h);
                    }
                });
            }
            DeviceMsg::Run { label, .. } => {
                tracing::error!(
                    "device {} is in another process: it cannot run {label} from the head",
                    state.device
                );
            }
        }
        Ok(())
    }
}
