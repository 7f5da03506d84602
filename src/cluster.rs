//! Several processes and hosts (behind the `cluster` cargo feature), on two planes:
//!
//! - the **control plane** ([`control`], on ractor_cluster): the head and its nodes find each
//!   other ([`rendezvous`] reads torchrun's and Slurm's variables), check they speak the same
//!   protocol and build the same model, agree on ranks, and hand out every rank's data-plane
//!   address and the per-job token; then heartbeats and shutdown. Small messages only.
//! - the **data plane**: how bulk bytes move between ranks in different processes: the wire
//!   format ([`frame`], pure) and authenticated, bounded TCP links between two ranks ([`link`],
//!   blocking `std::net`).
//!
//! `frame`, `link` and `rendezvous` must not depend on `actors`, `job` or Burn; `comm::tcp`
//! depends on them, not the reverse. `control` sits above the runtime (it uses Burn only to
//! fingerprint a model's structure) and hands the data plane its inputs
//! ([`control::World::plan_for`], [`control::link_listeners`]).
//!
//! ```
//! use meshwork::cluster::link::{JobToken, Link, LinkConfig, LinkListener};
//! use meshwork::mesh::Rank;
//!
//! let token = JobToken::random();
//! let listener = LinkListener::bind("127.0.0.1:0", Rank(0), token.clone(), LinkConfig::default())?;
//! let addr = listener.local_addr()?;
//! let peer = std::thread::spawn(move || -> Result<Vec<u8>, meshwork::cluster::link::LinkError> {
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
//! rank gives up. Its module docs hold its invariants (TCP-1..6). The control plane ([`control`]) hands out the listeners' addresses and the token
//! (`control::link_listeners`, `control::World::plan_for`).
//!
//! # Training across processes
//!
//! [`remote`] wires the two planes into a job: the head's Supervisor drives every rank through
//! proxies (`RemoteStage`, `RemoteDevice`) that send [`control::StageRequest`]s to the process
//! holding the rank, where a [`remote::NodeStages`] serves them with ordinary stage actors
//! whose communicators are TCP groups. Data-parallel jobs and dp × pp pipeline jobs
//! (`remote::pipeline`: pipeline links as TCP links, REMOTE-4; a lost stage replaced from
//! its twin on a waiting node, REMOTE-7) both run this way. A process that holds several ranks
//! of a data-parallel job joins its group hierarchically ([`crate::comm::hierarchical`],
//! HIER-1/2: in shared memory inside the process, one leader per process over TCP).

pub mod control;
pub mod frame;
pub mod link;
pub mod remote;
pub mod rendezvous;
