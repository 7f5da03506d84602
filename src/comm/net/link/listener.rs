//! Accepting links: [`LinkListener`] checks each connecting peer's hello (job token, rank,
//! protocol) within the handshake limits and refuses a stranger with a typed [`Rejection`].

use super::*;

/// The handshake payload: bincode of this struct (fixed-width integers).
#[derive(Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) token: [u8; 32],
    pub(super) rank: u32,
}

pub(super) fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// A listening socket that admits only connections that show the job token.
#[derive(Debug)]
pub struct LinkListener {
    pub(super) listener: TcpListener,
    pub(super) rank: Rank,
    pub(super) token: JobToken,
    pub(super) config: LinkConfig,
}

impl LinkListener {
    /// Binds `addr` (use port 0 for an ephemeral port) for rank `rank` of the job `token`.
    pub fn bind(
        addr: impl ToSocketAddrs,
        rank: Rank,
        token: JobToken,
        config: LinkConfig,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            rank,
            token,
            config,
        })
    }

    /// Adopts a listener bound earlier (the control plane binds one per device before the
    /// ranks and the token are known, to announce its address) for rank `rank` of the job
    /// `token`.
    pub fn from_std(
        listener: TcpListener,
        rank: Rank,
        token: JobToken,
        config: LinkConfig,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            rank,
            token,
            config,
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The rank this listener admits connections for.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The limits of the links it accepts.
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// The job token connections must show (to connect to the other ranks with).
    pub(crate) fn token(&self) -> &JobToken {
        &self.token
    }

    /// Waits up to the handshake time-out for one connection and runs the handshake.
    ///
    /// A connection without the token is closed, logged and returned as
    /// [`LinkError::Rejected`] (LINK-1); call `accept` again to wait for the next one.
    pub fn accept(&self) -> Result<Link, LinkError> {
        self.accept_within(self.config.handshake_timeout)
    }

    /// As [`LinkListener::accept`], but waits at most `timeout` for a connection to arrive
    /// (the handshake that follows still has the handshake time-out).
    pub fn accept_within(&self, wait: Duration) -> Result<Link, LinkError> {
        let timeout = self.config.handshake_timeout;
        let deadline = Instant::now() + wait;
        let unknown = Peer {
            addr: None,
            rank: None,
        };
        let (stream, from) = loop {
            match self.listener.accept() {
                Ok(conn) => break conn,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(LinkError::Timeout {
                            peer: unknown,
                            awaiting: Awaiting::Accept,
                            after: wait,
                        });
                    }
                    std::thread::sleep(ACCEPT_POLL);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(LinkError::Io {
                        peer: unknown,
                        awaiting: Awaiting::Accept,
                        source,
                    });
                }
            }
        };
        let peer = Peer {
            addr: Some(from),
            rank: None,
        };
        let io_err = |source| LinkError::Io {
            peer,
            awaiting: Awaiting::Hello,
            source,
        };
        // The accepted socket may inherit non-blocking mode on some platforms.
        stream.set_nonblocking(false).map_err(io_err)?;
        stream.set_nodelay(true).map_err(io_err)?;
        let mut link = Link::new(stream, self.rank, peer, self.config);

        let reject = |link: &mut Link, reason: Rejection| {
            tracing::warn!(
                %from,
                ?reason,
                rank = self.rank.0,
                "refused a data-plane connection without the job token"
            );
            link.shut_down();
            LinkError::Rejected { from, reason }
        };
        let mut payload = Vec::new();
        let hello = match link.read_frame(
            &mut payload,
            HANDSHAKE_MAX_PAYLOAD,
            Instant::now() + timeout,
            timeout,
            Awaiting::Hello,
        ) {
            Ok(header) => header,
            Err(e) => {
                let reason = match e {
                    LinkError::Frame { source, .. } => Rejection::BadFrame(source),
                    LinkError::Timeout { .. } => Rejection::HelloTimeout,
                    _ => Rejection::NoHello,
                };
                return Err(reject(&mut link, reason));
            }
        };
        if hello.kind != FrameKind::Hello || hello.seq != 0 {
            return Err(reject(&mut link, Rejection::NotHello(hello.kind)));
        }
        let hello = match bincode::serde::decode_from_slice::<Hello, _>(&payload, bincode_config())
        {
            Ok((hello, used)) if used == payload.len() => hello,
            _ => return Err(reject(&mut link, Rejection::MalformedHello)),
        };
        if !self.token.matches(&hello.token) {
            return Err(reject(&mut link, Rejection::WrongToken));
        }
        link.peer.rank = Some(Rank(hello.rank));
        let ack = bincode::serde::encode_to_vec(self.rank.0, bincode_config())
            .expect("a u32 always encodes");
        link.write_frame(FrameKind::Ack, 0, &ack, Instant::now() + timeout, timeout)?;
        link.recv_seq = 1;
        link.send_seq = 1;
        Ok(link)
    }
}
