//! The control plane: how the processes of one job find each other, agree they build the same
//! job, and learn their ranks, the data-plane addresses and the job token. Built on
//! ractor_cluster (nodes authenticate with a shared secret; actors are addressed through
//! process groups); bulk bytes never ride on it (the data plane, [`crate::comm::net::link`], moves them).
//!
//! # Roles
//!
//! - The **head** ([`Head`]) is the process that will run the Supervisor. It listens, waits
//!   for the nodes, greets each, assigns ranks ([`world::assign_ranks`]), hands out the world
//!   and a fresh [`crate::comm::net::link::JobToken`], and checks the nodes are alive (heartbeats).
//! - A **node** ([`run_node`]) holds devices. It connects to the head and runs a
//!   `NodeAgent` actor, registered in the job's process group (scope
//!   `meshwork/<job>`, group `agents`), which answers the head's requests. ractor_cluster has
//!   no remote spawn: device-side actors are spawned by the agent, in the node's process, on
//!   the head's request.
//!
//! # The conversation (each request bounded by the RPC time-out)
//!
//! ```text
//! head                                     node agent
//!  │ Hello { job, spec, fingerprint } ──────►│ builds the model from spec, compares
//!  │◄──── Welcome { name, devices, data addrs, requested index, fingerprint }
//!  │      (or Refused { version | fingerprint | model })
//!  │ … until N nodes are welcome: assign ranks, draw the token …
//!  │ Prepare { token, world, process } ──────►│ checks its ranks' addresses are its own
//!  │◄──── Prepared { ranks }
//!  │ Heartbeat { seq } (every interval) ─────►│ resets its head time-out
//!  │◄──── Alive { seq, phase, step }
//!  │ Shutdown { reason } ────────────────────►│ the node process ends
//!  │◄──── Bye
//! ```
//!
//! # Invariants (tests name the id they check)
//!
//! - In [`protocol`], CTL-1..3: size checked before sending; decoding never trusts the input;
//!   the version is read first.
//! - In [`world`], CTL-4 and CTL-5: deterministic ranks; typed conflicts.
//! - CTL-6 (compatibility, both sides): a node joins only if it speaks the head's protocol
//!   version and builds a model with the head's fingerprint; otherwise both the head (which
//!   logs it and names it in its error if too few nodes came) and the node (which exits with
//!   it) hold an [`Incompatibility`] naming both values.
//! - CTL-7 (bounded waits): the head waits for its nodes at most the join time-out and then
//!   fails with [`ControlError::TooFewNodes`] naming who came and who was refused; a node
//!   waits for the head at most the join time-out (unreachable, not authenticated, or never
//!   greeted), and once joined stops with [`ControlError::HeadLost`] when its session closes
//!   or the head is silent for the head time-out. Every request waits at most the RPC
//!   time-out ([`ControlError::NoReply`]).
//! - CTL-8 (the secret): the secret comes from the environment or a file, never the command
//!   line; a connection that fails ractor_cluster's challenge is closed before any message
//!   reaches an actor, and the node reports [`ControlError::AuthenticationFailed`].
//! - CTL-10 (TLS, optional: [`tls`]): a head with a certificate ([`HeadConfig::tls`]) runs a
//!   TLS handshake on every connection before ractor_cluster sees it, and closes (and logs)
//!   one whose handshake fails or takes longer than [`tls::HANDSHAKE_TIMEOUT`]; a node with
//!   trusted authorities ([`NodeConfig::tls`]) refuses a head whose certificate they did not
//!   sign or that does not name the host it joins ([`ControlError::Tls`]).

use std::net::SocketAddr;
use std::time::Duration;

use burn::module::Module;

mod agent;
mod head;
pub mod models;
pub mod protocol;
pub mod secret;
mod session;
pub mod stages;
pub mod tls;
pub mod world;

pub use agent::{AgentMsg, FingerprintFn, NodeConfig, NodeOutcome, NodeReport, run_node};
pub use head::{
    Assembled, Head, HeadConfig, JoinedNode, KeepAlive, LateEvent, LateEvents, LateJoins, LateNode,
    NodeHandle,
};
pub use models::ModelRegistry;
pub use protocol::{
    CodecError, ControlMsg, Hello, Incompatibility, JobSpec, ModelFingerprint, ModelSpec, NodeInfo,
    NodePhase,
};
pub use secret::{ClusterSecret, SecretError, secret_from_env};
pub use stages::{
    HostArgs, HostFactory, PART_BYTES, PipelineListeners, RemoteError, StageAnswer, StageHost,
    StageOp, StageRequest, join_shards, split_shards,
};
pub use tls::{HeadTls, NodeTls};
pub use world::{ProcessIndex, ProcessPlan, ProcessSlot, RankEntry, World, WorldError};

const _: () = assert!(
    (protocol::MAX_CONTROL_MESSAGE as u64) * 2 < ractor_cluster::DEFAULT_MAX_INBOUND_FRAME_SIZE,
    "a control message and ractor_cluster's framing must fit one frame with room to spare"
);

/// The process group scope of job `job`: its agents join group [`AGENTS_GROUP`] there.
pub fn job_scope(job: &str) -> String {
    format!("meshwork/{job}")
}

/// The process group of a job's node agents.
pub const AGENTS_GROUP: &str = "agents";

/// Why the control plane could not do what was asked. Every variant names the peer or the
/// count it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// No usable secret.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The launcher's variables do not describe a job.
    #[error(transparent)]
    Rendezvous(#[from] super::rendezvous::RendezvousError),
    /// The head cannot listen where it was told to, or a node cannot bind its data plane.
    #[error("cannot bind {addr}: {reason}")]
    Bind {
        /// The address.
        addr: String,
        /// The system's account.
        reason: String,
    },
    /// ractor_cluster could not start (its node server or an actor).
    #[error("cluster runtime: {0}")]
    Runtime(String),
    /// CTL-7: the join time-out passed with fewer nodes than the job needs.
    #[error(
        "only {} of {expected} node(s) joined within {waited:?}{}{}",
        joined.len(),
        if joined.is_empty() { String::new() } else { format!(" (joined: {})", joined.join(", ")) },
        if refused.is_empty() { String::new() } else {
            format!("; refused: {}", refused.iter().map(|(n, r)| format!("{n}: {r}")).collect::<Vec<_>>().join("; "))
        }
    )]
    TooFewNodes {
        /// Nodes the job needs.
        expected: usize,
        /// The names of those that joined.
        joined: Vec<String>,
        /// Those refused, with why.
        refused: Vec<(String, Incompatibility)>,
        /// How long the head waited.
        waited: Duration,
    },
    /// CTL-6: this node refused the head (it was told why), or the head refused this node.
    #[error("{}: {reason}", if *by_head { format!("the head {peer} refused this node") } else { format!("this node refused the head {peer}") })]
    Refused {
        /// The other side.
        peer: String,
        /// True when the head refused the node, false when the node refused the head.
        by_head: bool,
        /// Why.
        reason: Incompatibility,
    },
    /// CTL-8: the head closed the session during ractor_cluster's challenge.
    #[error(
        "the head at {head} closed the connection before authentication: \
         the cluster secret (MESHWORK_SECRET) differs, the head expects TLS (--tls-ca), \
         or {head} is not a meshwork head"
    )]
    AuthenticationFailed {
        /// The head's address.
        head: String,
    },
    /// CTL-10: TLS on the control plane failed: a certificate or key that cannot be used, or
    /// a handshake that failed (a head whose certificate is not trusted, a peer without TLS).
    #[error("TLS: {what}: {reason}")]
    Tls {
        /// What was being done.
        what: String,
        /// What went wrong.
        reason: String,
    },
    /// CTL-7: the head could not be reached within the join time-out.
    #[error("cannot reach the head at {head} within {waited:?}: {reason}")]
    HeadUnreachable {
        /// The head's address.
        head: String,
        /// How long the node tried.
        waited: Duration,
        /// The last connection error.
        reason: String,
    },
    /// CTL-7: connected, but the head never greeted this node within the join time-out.
    #[error("the head at {head} did not greet this node within {waited:?} (another job name?)")]
    NotGreeted {
        /// The head's address.
        head: String,
        /// How long the node waited.
        waited: Duration,
    },
    /// CTL-7: the head went away after the node joined.
    #[error("lost the head at {head}: {reason}")]
    HeadLost {
        /// The head's address.
        head: String,
        /// What happened.
        reason: HeadLoss,
    },
    /// CTL-7: a peer did not answer a request within the RPC time-out (or its session ended).
    #[error("{peer} did not answer {request} within {timeout:?}{}", detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
    NoReply {
        /// Who was asked.
        peer: String,
        /// The request.
        request: &'static str,
        /// The time-out.
        timeout: Duration,
        /// What the messaging layer said, when it said something.
        detail: Option<String>,
    },
    /// A message from `peer` could not be encoded or decoded (CTL-1..3).
    #[error("control message {}{peer}: {error}", if *outgoing { "to " } else { "from " })]
    Codec {
        /// The other side.
        peer: String,
        /// True for a message this side tried to send.
        outgoing: bool,
        /// What was wrong.
        error: CodecError,
    },
    /// `peer` answered a request with a message that does not answer it.
    #[error("{peer} answered {request} with {reply}")]
    UnexpectedReply {
        /// Who answered.
        peer: String,
        /// The request.
        request: &'static str,
        /// The reply's kind.
        reply: &'static str,
    },
    /// The processes do not make a world (CTL-5).
    #[error(transparent)]
    World(#[from] WorldError),
    /// A `Prepare` this node cannot serve (its ranks' addresses are not its listeners).
    #[error("invalid Prepare from the head: {0}")]
    InvalidPrepare(String),
}

impl From<ControlError> for crate::Error {
    fn from(e: ControlError) -> Self {
        crate::Error::Control(std::sync::Arc::new(e))
    }
}

/// How the head was lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeadLoss {
    /// The control session closed (the head process ended, or the connection broke).
    #[error("the control session closed")]
    SessionClosed,
    /// No request came from the head for this long (a cut link or a stuck head).
    #[error("no heartbeat for {0:?}")]
    Silent(Duration),
}

/// A fingerprint of `module`'s structure: `kind`, then each float parameter's shape in visit
/// order (FNV-1a). Parameters' values are left out on purpose: every replica starts from rank
/// 0's parameters (DP-1), so what processes must agree on is which parameters exist.
pub fn structure_fingerprint<M: Module>(kind: &str, module: &M) -> ModelFingerprint {
    let layout = crate::parallel::gradients::ParamLayout::of(module);
    let mut h = Fnv::new();
    h.write(kind.as_bytes());
    for slot in layout.slots() {
        let dims = slot.shape.as_slice();
        h.write(&(dims.len() as u64).to_le_bytes());
        for d in dims {
            h.write(&(*d as u64).to_le_bytes());
        }
    }
    ModelFingerprint(h.0)
}

/// Adopts a node's data-plane listeners ([`NodeOutcome::listeners`], bound before the ranks
/// were known) as link listeners for its ranks in `plan`, admitting only `token`: the step
/// from an assembled world to the data plane (`comm::tcp::TcpGroup::connect(&listeners[i],
/// &plan.addrs, …)` on the `tcp-transport` branch).
pub fn link_listeners(
    listeners: Vec<std::net::TcpListener>,
    plan: &ProcessPlan,
    token: &crate::comm::net::link::JobToken,
    config: crate::comm::net::link::LinkConfig,
) -> Result<Vec<crate::comm::net::link::LinkListener>, ControlError> {
    if listeners.len() != plan.ranks.len() {
        return Err(ControlError::InvalidPrepare(format!(
            "{} listeners for ranks {:?}",
            listeners.len(),
            plan.ranks
        )));
    }
    listeners
        .into_iter()
        .zip(&plan.ranks)
        .map(|(l, &rank)| {
            let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
            crate::comm::net::link::LinkListener::from_std(l, rank, token.clone(), config).map_err(
                |e| ControlError::Bind {
                    addr,
                    reason: e.to_string(),
                },
            )
        })
        .collect()
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// This machine's name for people and node names: `$HOSTNAME`, else the kernel's, else
/// `localhost`.
pub fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "localhost".to_string())
}

/// Binds one data-plane listener per device on `ip` (port 0: the system picks free ports),
/// before the ranks and the token are known; the addresses go to the head in the Welcome.
/// Hand them to the data plane with [`crate::comm::net::link::LinkListener::from_std`] once `Prepare`
/// said which rank each serves.
pub fn bind_data_plane(
    ip: std::net::IpAddr,
    devices: u32,
) -> Result<Vec<std::net::TcpListener>, ControlError> {
    (0..devices)
        .map(|_| {
            std::net::TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| ControlError::Bind {
                addr: format!("{ip}:0"),
                reason: e.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
