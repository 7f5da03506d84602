//! Nodes that join a job after its world was assembled (elastic growth across processes).
//!
//! While the job runs, a task of the head keeps watching the job's process group. A node that
//! appears is greeted like the first ones (the same spec and model fingerprint, CTL-6), gets
//! the next process index and the next ranks of the world (the world only grows: a lost node's
//! ranks stay numbered), and is prepared with the same job token. Once it acknowledges, it is
//! reported as a [`LateNode`]; the program adds its ranks to the mesh and grows the job onto
//! them. The task heartbeats the late nodes (their head time-out must not expire) and reports
//! the ones that stop answering.
//!
//! - CTL-9: a late node is admitted only with the head's protocol version and model
//!   fingerprint and a name no other node has, and only when the job accepts nodes (the
//!   program says; `meshwork train` admits them to every job); otherwise it is refused with
//!   the reason, on both sides.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{ActorId, ActorRef};
use tokio::sync::mpsc;

use super::{Caller, Head, JoinedNode, NodeHandle};
use crate::cluster::control::agent::AgentMsg;
use crate::cluster::control::protocol::{
    ControlMsg, Hello, Incompatibility, JobSpec, ModelFingerprint, NodeInfo, Prepare,
};
use crate::cluster::control::world::{ProcessIndex, RankEntry, World};
use crate::cluster::control::{AGENTS_GROUP, ControlError, job_scope};
use crate::comm::net::link::JobToken;
use crate::mesh::Rank;

/// What happens to nodes that come to a running job ([`Head::admit_late`]).
#[derive(Debug)]
pub enum LateEvent {
    /// A node joined and was prepared: its ranks wait to become replicas.
    Joined(LateNode),
    /// A node was refused (it, or the head, said why).
    Refused {
        /// The node's name, or its address.
        node: String,
        /// Why.
        reason: Incompatibility,
    },
    /// A node that joined late stopped answering heartbeats.
    Lost {
        /// The node's name.
        node: String,
        /// What went wrong.
        error: ControlError,
    },
}

/// A node prepared for a running job.
#[derive(Debug, Clone)]
pub struct LateNode {
    /// How to drive its stages.
    pub handle: NodeHandle,
    /// Its ranks, continuing the world's numbering.
    pub ranks: Vec<RankEntry>,
}

/// The head's side of late joins: stops the watching task when dropped; tells the late
/// nodes to stop with [`LateJoins::shutdown`].
#[derive(Debug)]
pub struct LateJoins {
    task: tokio::task::JoinHandle<()>,
    nodes: Arc<Mutex<Vec<JoinedNode>>>,
    caller: Caller,
}

/// The events of late joins, in order.
#[derive(Debug)]
pub struct LateEvents {
    rx: mpsc::UnboundedReceiver<LateEvent>,
}

impl LateEvents {
    /// The next event; `None` once the head stopped watching.
    pub async fn next(&mut self) -> Option<LateEvent> {
        self.rx.recv().await
    }
}

impl LateJoins {
    /// Stops watching, then tells every late node to stop (`reason` is for their logs) and
    /// waits for each Bye within the RPC time-out.
    pub async fn shutdown(self, reason: &str) -> Vec<(String, Result<(), ControlError>)> {
        self.task.abort();
        let nodes: Vec<JoinedNode> = self
            .nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        super::say_bye(self.caller, nodes, reason).await
    }
}

impl Drop for LateJoins {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Everything the watching task needs.
struct Watch {
    caller: Caller,
    job: String,
    hello: ControlMsg,
    fingerprint: ModelFingerprint,
    world: World,
    token: JobToken,
    accept: Option<String>,
    heartbeat: Duration,
    known: HashSet<ActorId>,
    names: HashSet<String>,
    nodes: Arc<Mutex<Vec<JoinedNode>>>,
    tx: mpsc::UnboundedSender<LateEvent>,
}

impl Head {
    /// Starts admitting nodes that come to the running job of `spec` (CTL-9): each is greeted
    /// and prepared as the next process of `assembled`'s world, with its token, and reported
    /// on the returned [`LateEvents`]. `refuse`: why this job takes no more nodes (they are
    /// refused with it), or `None` to admit them.
    pub fn admit_late(
        &self,
        spec: &JobSpec,
        fingerprint: ModelFingerprint,
        assembled: &super::Assembled,
        refuse: Option<String>,
    ) -> (LateJoins, LateEvents) {
        let (tx, rx) = mpsc::unbounded_channel();
        let nodes = Arc::new(Mutex::new(Vec::new()));
        let caller = self.caller();
        let watch = Watch {
            caller,
            job: self.config.job.clone(),
            hello: ControlMsg::Hello(Hello {
                job: self.config.job.clone(),
                head: self.config.name.clone(),
                spec: spec.clone(),
                fingerprint,
            }),
            fingerprint,
            world: assembled.world.clone(),
            token: assembled.token.clone(),
            accept: refuse,
            heartbeat: self.config.heartbeat_interval,
            known: self.nodes.iter().map(|n| n.agent.get_id()).collect(),
            names: self.nodes.iter().map(|n| n.info.name.clone()).collect(),
            nodes: nodes.clone(),
            tx,
        };
        let task = tokio::spawn(watch.run());
        (
            LateJoins {
                task,
                nodes,
                caller,
            },
            LateEvents { rx },
        )
    }
}

impl Watch {
    async fn run(mut self) {
        let scope = job_scope(&self.job);
        let group = AGENTS_GROUP.to_string();
        // Heartbeats on their own task: an admission (two RPCs) or a dead node's silence never
        // delays another node's heartbeat past its head time-out.
        let beats = tokio::spawn(beat(
            self.caller,
            self.heartbeat,
            self.nodes.clone(),
            self.tx.clone(),
        ));
        let _stop_beats = AbortOnDrop(beats);
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            let fresh: Vec<ActorRef<AgentMsg>> = ractor::pg::get_scoped_members(&scope, &group)
                .into_iter()
                .filter(|cell| !cell.get_id().is_local() && !self.known.contains(&cell.get_id()))
                .map(ActorRef::from)
                .collect();
            for agent in fresh {
                self.known.insert(agent.get_id());
                // One at a time: each takes the next process index.
                self.admit(agent).await;
            }
        }
    }

    /// Greets `agent`, and prepares it if it may join.
    async fn admit(&mut self, agent: ActorRef<AgentMsg>) {
        let peer = format!("a node session {}", agent.get_id());
        let info: NodeInfo = match self.caller.call(&agent, &peer, &self.hello).await {
            Ok(ControlMsg::Welcome(info)) => info,
            Ok(ControlMsg::Refused(reason)) => {
                let _ = self.tx.send(LateEvent::Refused { node: peer, reason });
                return;
            }
            Ok(other) => {
                let reason =
                    Incompatibility::Other(format!("answered Hello with {}", other.kind()));
                let _ = self.tx.send(LateEvent::Refused { node: peer, reason });
                return;
            }
            Err(e) => {
                let reason = Incompatibility::Other(e.to_string());
                let _ = self.tx.send(LateEvent::Refused { node: peer, reason });
                return;
            }
        };
        let refusal = if info.fingerprint != self.fingerprint {
            Some(Incompatibility::Fingerprint {
                head: self.fingerprint,
                node: info.fingerprint,
            })
        } else if let Some(why) = &self.accept {
            Some(Incompatibility::Other(why.clone()))
        } else if self.names.contains(&info.name) || info.devices == 0 {
            Some(Incompatibility::Other(format!(
                "another node is named {} (or it holds no device)",
                info.name
            )))
        } else {
            None
        };
        if let Some(reason) = refusal {
            tracing::warn!("refused {} from the running job: {reason}", info.name);
            self.caller.refuse(&agent, &reason);
            let _ = self.tx.send(LateEvent::Refused {
                node: info.name,
                reason,
            });
            return;
        }
        let process = ProcessIndex(self.world.processes.len() as u32);
        let mut world = self.world.clone();
        world.processes.push(info.name.clone());
        let first = world.ranks.len() as u32;
        let ranks: Vec<RankEntry> = info
            .data_addrs
            .iter()
            .enumerate()
            .map(|(d, &addr)| RankEntry {
                rank: Rank(first + d as u32),
                process,
                device: d as u32,
                addr,
            })
            .collect();
        world.ranks.extend(ranks.iter().cloned());
        let prepare = ControlMsg::Prepare(Prepare {
            token: *self.token.as_bytes(),
            world: world.clone(),
            process,
        });
        let expected: Vec<Rank> = ranks.iter().map(|e| e.rank).collect();
        let name = info.name.clone();
        let answer = self.caller.call(&agent, &name, &prepare).await;
        let reason = match answer {
            Ok(ControlMsg::Prepared { ranks: got }) if got == expected => None,
            Ok(ControlMsg::Prepared { ranks: got }) => Some(format!(
                "acknowledged ranks {got:?}, the world gives it {expected:?}"
            )),
            Ok(ControlMsg::Refused(why)) => Some(why.to_string()),
            Ok(other) => Some(format!("answered Prepare with {}", other.kind())),
            Err(e) => Some(e.to_string()),
        };
        if let Some(reason) = reason {
            let reason = Incompatibility::Other(reason);
            self.caller.refuse(&agent, &reason);
            let _ = self.tx.send(LateEvent::Refused { node: name, reason });
            return;
        }
        tracing::info!("{name} joined the running job as process {}", process.0);
        self.world = world;
        self.names.insert(name.clone());
        let handle = NodeHandle {
            name: name.clone(),
            agent: agent.clone(),
            version: self.caller.version,
        };
        self.nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(JoinedNode { info, agent });
        let _ = self.tx.send(LateEvent::Joined(LateNode { handle, ranks }));
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every `interval`, a heartbeat to every late node, each on a task of its own; a node that does
/// not answer within the RPC time-out is dropped and reported once.
async fn beat(
    caller: Caller,
    interval: Duration,
    nodes: Arc<Mutex<Vec<JoinedNode>>>,
    tx: mpsc::UnboundedSender<LateEvent>,
) {
    let mut tick = tokio::time::interval(interval);
    let mut seq = 1u64 << 48;
    loop {
        tick.tick().await;
        seq += 1;
        let alive: Vec<(ActorRef<AgentMsg>, String)> = nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|n| (n.agent.clone(), n.info.name.clone()))
            .collect();
        for (agent, name) in alive {
            let (nodes, tx) = (nodes.clone(), tx.clone());
            let msg = ControlMsg::Heartbeat { seq };
            tokio::spawn(async move {
                let error = match caller.call(&agent, &name, &msg).await {
                    Ok(ControlMsg::Alive { .. }) => return,
                    Ok(other) => ControlError::UnexpectedReply {
                        peer: name.clone(),
                        request: "Heartbeat",
                        reply: other.kind(),
                    },
                    Err(e) => e,
                };
                let id = agent.get_id();
                let removed = {
                    let mut nodes = nodes.lock().unwrap_or_else(|e| e.into_inner());
                    let before = nodes.len();
                    nodes.retain(|n| n.agent.get_id() != id);
                    nodes.len() < before
                };
                if removed {
                    let _ = tx.send(LateEvent::Lost { node: name, error });
                }
            });
        }
    }
}
