//! ractor_cluster plumbing shared by the head and the nodes: a node server with an event
//! subscription, and handing it TCP streams we opened or accepted ourselves (so we choose the
//! address, learn the port the system picked, and see the local address of the connection).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};

use ractor::{Actor, ActorRef};
use ractor_cluster::node::{NodeConnectionMode, NodeServerSessionInformation};
use ractor_cluster::{NetworkStream, NodeEventSubscription, NodeServer, NodeServerMessage};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::secret::ClusterSecret;
use super::{ControlError, host_name};

/// What happened to a control session, as the node server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SessionEvent {
    /// The session passed ractor_cluster's challenge (the peer holds the secret).
    Authenticated {
        /// ractor_cluster's id of the session.
        node_id: u64,
        /// The peer's address.
        peer: String,
    },
    /// The session ended; `authenticated` says whether it had passed the challenge.
    Closed {
        /// ractor_cluster's id of the session.
        node_id: u64,
        /// The peer's address.
        peer: String,
        /// Whether it had been authenticated.
        authenticated: bool,
    },
}

struct Subscription {
    tx: mpsc::UnboundedSender<SessionEvent>,
    authenticated: std::sync::Mutex<HashSet<u64>>,
}

impl NodeEventSubscription for Subscription {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let authenticated = self
            .authenticated
            .lock()
            .map(|mut a| a.remove(&ses.node_id))
            .unwrap_or(false);
        let _ = self.tx.send(SessionEvent::Closed {
            node_id: ses.node_id,
            peer: ses.peer_addr,
            authenticated,
        });
    }

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        if let Ok(mut a) = self.authenticated.lock() {
            a.insert(ses.node_id);
        }
        let _ = self.tx.send(SessionEvent::Authenticated {
            node_id: ses.node_id,
            peer: ses.peer_addr,
        });
    }
}

/// A running ractor_cluster node server and its session events.
pub(crate) struct ClusterNode {
    pub(crate) server: ActorRef<NodeServerMessage>,
    pub(crate) events: mpsc::UnboundedReceiver<SessionEvent>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("server", &self.server.get_id())
            .finish_non_exhaustive()
    }
}

impl ClusterNode {
    /// Starts a node server named `name` (unique per process: ractor_cluster tells sessions
    /// apart by name). Its own listener binds an ephemeral port of 127.0.0.1 and is not used:
    /// we accept and connect ourselves and hand it the streams ([`ClusterNode::adopt`]).
    pub(crate) async fn start(name: &str, secret: &ClusterSecret) -> Result<Self, ControlError> {
        let server = NodeServer::new(
            0,
            secret.expose().to_string(),
            name.to_string(),
            host_name(),
            None,
            Some(NodeConnectionMode::Isolated),
        )
        .with_listen_addr(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let (server, _) = Actor::spawn(None, server, ())
            .await
            .map_err(|e| ControlError::Runtime(format!("node server: {e}")))?;
        let (tx, events) = mpsc::unbounded_channel();
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "meshwork-control".to_string(),
                subscription: Box::new(Subscription {
                    tx,
                    authenticated: std::sync::Mutex::new(HashSet::new()),
                }),
            })
            .map_err(|e| ControlError::Runtime(format!("node server subscription: {e}")))?;
        Ok(Self { server, events })
    }

    /// Hands a connected stream to the node server ([`adopt`]).
    pub(crate) fn adopt(&self, stream: TcpStream, incoming: bool) -> Result<(), ControlError> {
        adopt(&self.server, stream, incoming)
    }

    /// Hands a stream that finished its TLS handshake to the node server ([`adopt_stream`]).
    pub(crate) fn adopt_stream(
        &self,
        stream: NetworkStream,
        incoming: bool,
    ) -> Result<(), ControlError> {
        adopt_stream(&self.server, stream, incoming)
    }

    /// Stops the node server and every session it holds.
    pub(crate) fn stop(&self, reason: &str) {
        self.server.stop(Some(reason.to_string()));
    }
}

/// Hands a connected stream to `server`, which runs ractor_cluster's challenge on it
/// (`incoming`: we accepted it; otherwise we connected).
pub(crate) fn adopt(
    server: &ActorRef<NodeServerMessage>,
    stream: TcpStream,
    incoming: bool,
) -> Result<(), ControlError> {
    let io = |e: std::io::Error| ControlError::Runtime(format!("control stream: {e}"));
    stream.set_nodelay(true).map_err(io)?;
    let peer_addr = stream.peer_addr().map_err(io)?;
    let local_addr = stream.local_addr().map_err(io)?;
    adopt_stream(
        server,
        NetworkStream::Raw {
            peer_addr,
            local_addr,
            stream,
        },
        incoming,
    )
}

/// Hands `stream` (plain or TLS) to `server`, which runs ractor_cluster's challenge on it.
pub(crate) fn adopt_stream(
    server: &ActorRef<NodeServerMessage>,
    stream: NetworkStream,
    incoming: bool,
) -> Result<(), ControlError> {
    server
        .cast(NodeServerMessage::ConnectionOpened {
            stream: Box::new(stream),
            is_server: incoming,
        })
        .map_err(|e| ControlError::Runtime(format!("node server gone: {e}")))
}
