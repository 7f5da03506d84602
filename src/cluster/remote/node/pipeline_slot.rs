//! A pipeline slot's two phases (REMOTE-4): `listen` binds its pipeline listeners, `wire`
//! joins its groups and connects its links under a generation.

use super::*;

/// A pipeline slot's listeners besides its data-plane one (REMOTE-4): one per kind of
/// connection, so no group takes another's.
pub(in crate::cluster::remote) struct SlotListeners {
    links: TcpListener,
    tp: TcpListener,
    model: TcpListener,
}

impl SlotListeners {
    /// Three listeners on `ip`, any free ports.
    fn bind(ip: std::net::IpAddr) -> std::io::Result<(Self, PipelineListeners)> {
        let bind = || TcpListener::bind((ip, 0));
        let me = Self {
            links: bind()?,
            tp: bind()?,
            model: bind()?,
        };
        let addrs = PipelineListeners {
            links: me.links.local_addr()?,
            tp: me.tp.local_addr()?,
            model: me.model.local_addr()?,
        };
        Ok((me, addrs))
    }

    fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            links: self.links.try_clone()?,
            tp: self.tp.try_clone()?,
            model: self.model.try_clone()?,
        })
    }
}

impl<M: Send + 'static> NodeInner<M> {
    /// A pipeline slot's first phase (REMOTE-4): starts its device and binds the listeners of
    /// its pipeline links and its tensor-parallel and model groups, on the address of its
    /// data-plane listener.
    pub(super) async fn listen(
        &self,
        slot: Rank,
        id: StageId,
    ) -> std::result::Result<PipelineListeners, RemoteError> {
        let (started, device, ip) = self.with_slot(slot, |s| {
            (
                s.device_actor.is_some(),
                s.device.clone(),
                s.listener.local_addr().map(|a| a.ip()),
            )
        })?;
        if started {
            return Err(RemoteError::Other(format!(
                "rank {} was started already",
                slot.0
            )));
        }
        let io = |e: std::io::Error| RemoteError::Other(format!("the pipeline listeners: {e}"));
        let (listeners, addrs) = SlotListeners::bind(ip.map_err(io)?).map_err(io)?;
        let (device_actor, _) = Actor::spawn(None, DeviceActor, device)
            .await
            .map_err(|e| RemoteError::Other(format!("cannot start the device: {e}")))?;
        self.with_slot(slot, |s| {
            s.device_actor = Some(device_actor);
            s.pipeline_listeners = Some(listeners);
            s.id = id;
        })?;
        Ok(addrs)
    }

    /// A pipeline slot's second phase (REMOTE-4): joins its data-parallel group (its
    /// replicas at `addrs.dp`), its tensor-parallel group and its replica's model group, and
    /// connects to its pipeline's other stages (at `addrs.links`), all at once under
    /// `generation`, then starts its stage actor; or, a stage that runs already (REC-6:
    /// another stage of the mesh was replaced), shuts its old wiring first and hands the
    /// stage the new one.
    pub(super) async fn wire(
        &self,
        slot: Rank,
        generation: Generation,
        addrs: WireAddrs,
        timeout: Duration,
    ) -> std::result::Result<(), RemoteError> {
        let other = RemoteError::Other;
        let plan = self
            .factory
            .pipeline()
            .ok_or_else(|| other("Wire in a job without a pipeline".into()))?;
        let (id, device, device_actor, listeners, stage) = self.with_slot(slot, |s| {
            // REMOTE-3: from now on an abort of an older generation leaves this one alone.
            s.shut();
            s.model_groups.clear();
            s.wired = generation;
            (
                s.id,
                s.device.clone(),
                s.device_actor.clone(),
                s.pipeline_listeners.as_ref().map(SlotListeners::try_clone),
                s.stage.clone(),
            )
        })?;
        let (Some(device_actor), Some(listeners)) = (device_actor, listeners) else {
            return Err(other(format!(
                "rank {} is not listening for pipeline links (Start first)",
                slot.0
            )));
        };
        let degree = addrs.tp.len().max(1);
        let model_rank = id.stage as usize * degree + id.tp as usize;
        if addrs.dp.len() <= id.replica as usize
            || addrs.links.len() <= id.stage as usize
            || addrs.tp.len() <= id.tp as usize
            || addrs.model.len() != addrs.links.len() * degree
        {
            return Err(other(format!(
                "{id} is outside a Wire of {} replica(s), {} stage(s), {} tensor-parallel \
                 rank(s) and a model group of {}",
                addrs.dp.len(),
                addrs.links.len(),
                addrs.tp.len(),
                addrs.model.len()
            )));
        }
        let listeners = listeners.map_err(|e| other(format!("the pipeline listeners: {e}")))?;
        let links = LinkListener::from_std(
            listeners.links,
            Rank(id.stage),
            self.token.clone(),
            self.tcp.link,
        )
        .map_err(|e| other(format!("the pipeline-link listener: {e}")))?;
        let link_config = self.tcp.link;
        let capacity = plan.link_capacity() as usize;
        let pp_addrs = addrs.links;
        let transport = self.groups.transport();
        let wires = tokio::task::spawn_blocking(move || {
            pipeline::connect_wires(&links, &pp_addrs, link_config, (capacity, transport))
        });
        let comm = async {
            if addrs.dp.len() > 1 {
                self.connect(slot, Rank(id.replica), generation, addrs.dp, None)
                    .await
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        // A flat TCP group each (their members may share a process or not).
        let group = |listener: TcpListener, rank: usize, members: Vec<SocketAddr>| async move {
            if members.len() < 2 {
                return Ok(None);
            }
            self.groups
                .join(Ok(listener), Rank(rank as u32), generation, members, None)
                .await
                .map(Some)
                .map_err(|e| other(format!("{id}: {e}")))
        };
        let tp = group(listeners.tp, id.tp as usize, addrs.tp);
        let model = group(listeners.model, model_rank, addrs.model);
        let (comm, wires, tp, model) = tokio::join!(comm, wires, tp, model);
        let (wires, closers) = wires
            .map_err(|e| other(format!("the connect task failed: {e}")))?
            .map_err(|e| other(format!("{id} could not connect its pipeline links: {e}")))?;
        let mut groups = ModelGroups::default();
        let mut shutdowns = Vec::new();
        for (joined, into) in [(tp, &mut groups.tp), (model, &mut groups.replica)] {
            if let Some(j) = joined? {
                shutdowns.push(j.shutdown);
                *into = Some(j.communicator);
            }
        }
        let links_over = format!(
            "pipeline: {} link(s) over {}",
            closers.len(),
            transport.to_string().to_uppercase()
        );
        self.with_slot(slot, |s| {
            s.wires = closers;
            s.model_groups = shutdowns;
            // What `meshwork node` prints at the end: the dp group's words, then the links.
            let group = s
                .joined
                .split(" | pipeline: ")
                .next()
                .unwrap_or("")
                .to_string();
            s.joined = format!("{group} | {links_over}");
        })?;
        let comm = comm?;
        let links = remote_links(&plan, id.stage, self.tcp.comm.timeout, wires)
            .map_err(|e| other(e.to_string()))?;
        if stage.is_some() {
            let links = Box::new(links);
            let model = Box::new(groups);
            return self
                .asker(slot, timeout)?
                .call(|reply| StageMsg::Rewire {
                    rank: slot,
                    links,
                    comm,
                    model,
                    reply,
                })
                .await;
        }
        let start = SlotStart {
            id,
            rank: slot,
            device,
            device_actor,
            comm,
            links: Some(links),
            model: groups,
            server: None,
        };
        let stage = self.factory.spawn(start).await.map_err(other)?;
        self.with_slot(slot, |s| s.stage = Some(stage))
    }
}

/// What a `Wire` joins a pipeline slot to (`StageOp::Wire`'s addresses).
pub(super) struct WireAddrs {
    pub(super) dp: Vec<SocketAddr>,
    pub(super) links: Vec<SocketAddr>,
    pub(super) tp: Vec<SocketAddr>,
    pub(super) model: Vec<SocketAddr>,
}
