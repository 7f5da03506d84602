//! The data plane's wire (behind the `cluster` cargo feature): how bulk bytes move between
//! ranks in different processes. The wire format ([`frame`]: versioned, checksummed,
//! length-prefixed frames; pure, fuzzed) and authenticated, bounded TCP links between two
//! ranks ([`link`], blocking `std::net`).
//!
//! Neither depends on anything above `comm` (actors, the control plane, `job`, Burn). The
//! control plane (`cluster::control`) hands out the listeners' addresses and the per-job
//! token.
//!
//! ```
//! use meshwork::comm::net::link::{JobToken, Link, LinkConfig, LinkListener};
//! use meshwork::mesh::Rank;
//!
//! let token = JobToken::random();
//! let listener = LinkListener::bind("127.0.0.1:0", Rank(0), token.clone(), LinkConfig::default())?;
//! let addr = listener.local_addr()?;
//! let peer = std::thread::spawn(move || -> Result<Vec<u8>, meshwork::comm::net::link::LinkError> {
//!     let mut link = Link::connect(addr, Rank(1), Rank(0), &token, LinkConfig::default())?;
//!     let mut buf = Vec::new();
//!     link.recv_frame(&mut buf)?;
//!     Ok(buf)
//! });
//! let mut link = listener.accept()?;
//! link.send_frame(b"gradients")?;
//! assert_eq!(peer.join().unwrap()?, b"gradients");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The TCP transport behind `Communicator`
//!
//! [`crate::comm::tcp`] builds on these pieces: a group forms a full mesh of [`link::Link`]s
//! (the lower rank of each pair listens, the higher connects; the token check keeps strangers
//! out), splits each into a [`link::LinkWriter`] driven by a sender thread and a
//! [`link::LinkReader`] read by the rank's own thread (so two ranks sending to each other at
//! once never deadlock), and runs the pure [`crate::comm::plan`] plans: one or more data
//! frames per send step, received piece by piece straight into the buffer, a header frame per
//! op for COMM-1/COMM-2, and a [`frame::FrameKind::Close`] frame carrying the failure when a
//! rank gives up. Its module docs hold its invariants (TCP-1..6).

pub mod frame;
pub mod link;
