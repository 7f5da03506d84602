//! Joining a TCP group: its settings, the listeners and connections that make one authenticated
//! link per pair of ranks (accepting from lower ranks, connecting to higher ones), and the
//! handle that shuts the group down.

use super::*;

/// Settings of a TCP group. Plain data with defaults; builder methods set one field each.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TcpConfig {
    /// Time-out and algorithm of the ops.
    pub comm: CommConfig,
    /// Limits of the links (largest frame, how long forming a link may take).
    pub link: LinkConfig,
    /// The largest payload of one data frame: a plan step larger than this is sent as several
    /// frames. At most [`LinkConfig::max_payload`], a multiple of 4.
    pub frame_bytes: usize,
}

impl Default for TcpConfig {
    /// The default [`CommConfig`] and [`LinkConfig`], frames of up to 512 KiB (small enough
    /// that a ring step of a few MiB is sent on frame by frame, TCP-8).
    fn default() -> Self {
        Self {
            comm: CommConfig::default(),
            link: LinkConfig::default(),
            frame_bytes: 512 << 10,
        }
    }
}

impl TcpConfig {
    /// Sets the op time-out.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.comm.timeout = timeout;
        self
    }

    /// Sets the algorithm collectives request.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.comm.algorithm = algorithm;
        self
    }

    /// Sets the link limits.
    pub fn with_link(mut self, link: LinkConfig) -> Self {
        self.link = link;
        self
    }

    /// Sets [`TcpConfig::frame_bytes`].
    pub fn with_frame_bytes(mut self, bytes: usize) -> Self {
        self.frame_bytes = bytes;
        self
    }
}

/// Why a TCP group could not be formed. Every variant names the rank concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpGroupError {
    /// The listener's rank is not a rank of a group of `world` (one address per rank).
    #[error("rank {} is not in a group of {world} addresses", rank.0)]
    InvalidRank {
        /// The listener's rank.
        rank: Rank,
        /// The number of addresses passed.
        world: usize,
    },
    /// The configuration cannot work (frame size zero, not a multiple of 4, or above the
    /// link's maximum payload).
    #[error("frame_bytes {frame_bytes} must be a positive multiple of 4 of at most {max_payload}")]
    InvalidFrameBytes {
        /// [`TcpConfig::frame_bytes`].
        frame_bytes: usize,
        /// [`LinkConfig::max_payload`].
        max_payload: u64,
    },
    /// Connecting to a lower rank failed (refused handshake: wrong token; nobody listening
    /// until the handshake time-out; the wrong rank answered).
    #[error("rank {} could not connect to rank {}: {source}", rank.0, peer.0)]
    Connect {
        /// This rank.
        rank: Rank,
        /// The rank it connected to.
        peer: Rank,
        /// What went wrong.
        #[source]
        source: LinkError,
    },
    /// Higher ranks never connected within the handshake time-out.
    #[error("rank {}: ranks {missing:?} did not connect within {waited:?}", rank.0)]
    Missing {
        /// This rank.
        rank: Rank,
        /// The ranks that never connected.
        missing: Vec<Rank>,
        /// How long it waited.
        waited: Duration,
    },
    /// The operating system refused to duplicate a socket or start a sender thread.
    #[error("rank {}: setting up the link to rank {} failed: {detail}", rank.0, peer.0)]
    Setup {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: Rank,
        /// The system's error.
        detail: String,
    },
}

/// A rank's side of a TCP group, formed by [`TcpGroup::connect`]: its links to every other
/// rank. Hand it to the rank's thread as a [`Communicator`]; keep a [`TcpShutdown`] to stop it
/// from elsewhere.
#[derive(Debug)]
pub struct TcpGroup {
    pub(super) comm: TcpCommunicator,
}

impl TcpGroup {
    /// Forms rank `listener.rank()`'s side of a group whose rank r listens at `addrs[r]`:
    /// accepts a link from every higher rank on `listener` and connects to every lower rank
    /// (TCP-1), each within the link's handshake time-out. Connections without the listener's
    /// job token are refused and never become links (LINK-1). Every rank of the group must
    /// call this with the same addresses, generation and token.
    pub fn connect(
        listener: &LinkListener,
        addrs: &[SocketAddr],
        generation: Generation,
        config: TcpConfig,
    ) -> Result<TcpGroup, TcpGroupError> {
        let me = listener.rank();
        let world = addrs.len();
        if me.index() >= world {
            return Err(TcpGroupError::InvalidRank { rank: me, world });
        }
        let max_payload = config.link.max_payload;
        if config.frame_bytes == 0
            || !config.frame_bytes.is_multiple_of(4)
            || config.frame_bytes as u64 > max_payload
        {
            return Err(TcpGroupError::InvalidFrameBytes {
                frame_bytes: config.frame_bytes,
                max_payload,
            });
        }
        let links = connect_mesh(listener, addrs, config.link)?;

        let mut peers: Vec<Option<PeerLink>> = (0..world).map(|_| None).collect();
        let mut closers = Vec::new();
        for (peer, link) in links {
            let setup = |detail: String| TcpGroupError::Setup {
                rank: me,
                peer,
                detail,
            };
            let (writer, reader, closer) = link.split().map_err(|e| setup(e.to_string()))?;
            let link = config.comm.link.clone().map(|l| (me, l));
            let sender = Sender::spawn(me, peer, writer, config.frame_bytes, link)
                .map_err(|e| setup(e.to_string()))?;
            closers.push(closer);
            peers[peer.index()] = Some(PeerLink { reader, sender });
        }
        let comm = TcpCommunicator {
            rank: me,
            world,
            generation,
            seq: 0,
            timeout: config.comm.timeout,
            algorithm: config.comm.algorithm,
            partial_sums: config.comm.partial_sums,
            last_algorithm: None,
            sent: vec![0; world],
            received: vec![0; world],
            peers,
            shared: Arc::new(Shared {
                shut_down: AtomicBool::new(false),
                closers,
            }),
            failure: None,
            header: Vec::new(),
            work: Vec::new(),
            scratch: Vec::new(),
            scratch16: Vec::new(),
            plan_cache: None,
            data_bytes_sent: 0,
            forwarded_parts: 0,
            forwards: config.comm.link.is_none(),
        };
        Ok(TcpGroup { comm })
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.comm.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.comm.world
    }

    /// The group's generation.
    pub fn generation(&self) -> Generation {
        self.comm.generation
    }

    /// A handle that shuts this rank's side of the group down from any thread (TCP-6).
    pub fn shutdown_handle(&self) -> TcpShutdown {
        TcpShutdown {
            shared: Arc::clone(&self.comm.shared),
        }
    }

    /// The rank's communicator, to be moved to the thread that runs its ops.
    pub fn into_communicator(self) -> Communicator {
        Communicator::tcp(self.comm)
    }
}

/// Rank `listener.rank()`'s links to every other rank of a group whose rank r listens at
/// `addrs[r]`, in rank order: accepted from every higher rank, connected to every lower one
/// (TCP-1), all within the link's handshake time-out; only token-holders become links
/// (LINK-1). What [`TcpGroup::connect`] and the pipeline links across processes are made of.
pub(crate) fn connect_mesh(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let world = addrs.len();
    if me.index() >= world {
        return Err(TcpGroupError::InvalidRank { rank: me, world });
    }
    let started = Instant::now();
    let deadline = started + config.handshake_timeout;
    let (accepted, connected) = std::thread::scope(|scope| {
        let acceptor = scope.spawn(|| accept_all(listener, world, deadline, started));
        let connected = connect_all(listener, addrs, config, deadline);
        let accepted = acceptor
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (accepted, connected)
    });
    let mut links = connected?;
    links.extend(accepted?);
    links.sort_by_key(|(rank, _)| *rank);
    Ok(links)
}

/// Accepts a link from every higher rank before `deadline`. Connections from strangers (no
/// token: refused by the listener) or from ranks that are not expected are dropped and the
/// wait goes on.
fn accept_all(
    listener: &LinkListener,
    world: usize,
    deadline: Instant,
    started: Instant,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let mut missing = peers_with_role(me, world, LinkRole::Accept);
    let mut links = Vec::new();
    while !missing.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TcpGroupError::Missing {
                rank: me,
                missing,
                waited: started.elapsed(),
            });
        }
        match listener.accept_within(left) {
            Ok(link) => match link.peer().rank {
                Some(peer) if missing.contains(&peer) => {
                    missing.retain(|r| *r != peer);
                    links.push((peer, link));
                }
                other => {
                    tracing::warn!(
                        rank = me.0,
                        peer = ?other,
                        "dropped a data-plane link from a rank this group does not expect"
                    );
                }
            },
            // Refused connections were logged by the listener (LINK-1); a time-out is
            // checked against the deadline above.
            Err(LinkError::Rejected { .. } | LinkError::Timeout { .. }) => {}
            Err(e) => {
                tracing::warn!(rank = me.0, error = %e, "a data-plane handshake failed");
            }
        }
    }
    Ok(links)
}

/// Connects to every lower rank, retrying a refused TCP connection (a listener not bound yet)
/// until `deadline`.
fn connect_all(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
    deadline: Instant,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let token = listener.token();
    let mut links = Vec::new();
    for peer in peers_with_role(me, addrs.len(), LinkRole::Connect) {
        let link = loop {
            match crate::comm::net::link::Link::connect(
                addrs[peer.index()],
                me,
                peer,
                token,
                config,
            ) {
                Ok(link) => break link,
                Err(LinkError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(source) => {
                    return Err(TcpGroupError::Connect {
                        rank: me,
                        peer,
                        source,
                    });
                }
            }
        };
        links.push((peer, link));
    }
    Ok(links)
}

/// Shuts one rank's side of a TCP group down from any thread (TCP-6): its links are closed, a
/// waiting op fails with [`CommError::Shutdown`], and so does every later op.
#[derive(Debug, Clone)]
pub struct TcpShutdown {
    pub(super) shared: Arc<Shared>,
}

impl TcpShutdown {
    /// Shuts down (idempotent).
    pub fn shutdown(&self) {
        self.shared.shut_down.store(true, Ordering::SeqCst);
        for closer in &self.shared.closers {
            closer.shutdown();
        }
    }

    /// Whether [`TcpShutdown::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.shared.shut_down.load(Ordering::SeqCst)
    }
}
