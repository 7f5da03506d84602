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
//! `frame`, `link` and `rendezvous` must not depend on `actors`, `job` or Burn; `comm` will
//! depend on them, not the reverse. `control` sits above the runtime (it uses Burn only to
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
//! # Where this is going: a TCP transport behind `Communicator`
//!
//! Today [`crate::comm`]'s only transport is in-process (`comm::local`). The next step puts a
//! TCP transport behind the same `Communicator` API, executing the same pure
//! [`crate::comm::plan`] plans. The intended mapping:
//!
//! - **Mesh of links.** When a group forms, every rank opens one [`link::Link`] to each peer
//!   it exchanges data with in any plan it may run (for ring: its two neighbours; for
//!   recursive doubling and direct: every peer). By convention the lower rank listens and the
//!   higher rank connects ([`link::Link::connect`] names the rank it expects), so each pair has
//!   exactly one link. The listener's address and the [`link::JobToken`] come from the control
//!   plane ([`control`]: a node binds its listeners before joining, announces their addresses,
//!   and gets the world and the token in `Prepare`).
//! - **`Step::Send { to, range }`**: encode `buf[range]` as little-endian bytes
//!   ([`frame::put_f32s`] for f32; f16/bf16 likewise, 2 bytes each) into a reusable scratch
//!   buffer and [`link::Link::send_frame`] it on the link to `to`. One step, one frame; the
//!   receiver knows the range from its own plan (PLAN-1), so frames carry no range.
//! - **`Step::RecvReduce { from, range }`**: [`link::Link::recv_frame`] from `from` into a
//!   reusable buffer, check its length is `range.len() * element size`
//!   ([`frame::get_f32s`] does), and combine element-wise into `buf[range]` with the reduce op
//!   (in f32 for f16/bf16, as COMM-5 requires).
//! - **`Step::RecvCopy { from, range }`**: as RecvReduce, but overwrite `buf[range]`.
//! - **`Step::Finish`** is local, as in-process. **`Step::ReducePeers` / `Step::CopyFrom`**
//!   read peers' memory and only exist in the direct (shared-memory) algorithm: a TCP group
//!   must choose ring or tree (ring by default across processes), and a hierarchical
//!   all-reduce runs direct inside a process, then ring across processes, then direct again.
//! - **`Step::Barrier`**: an empty data frame to every peer, then one from every peer.
//! - **PLAN-2 says sends never block.** A TCP send blocks once the peer's window is full
//!   (LINK-5: there is deliberately no unbounded queue). So a rank must not block in a send
//!   while its peer blocks in a send to it: the transport runs each link's sends on a sender
//!   thread (or splits the stream with `try_clone` into a send half and a receive half),
//!   with a bounded queue of at most one plan step per link, while the device thread
//!   performs the receives. A two-rank ring, where the next and previous rank are the same
//!   peer, is the case that deadlocks without it.
//! - **Sequence numbers and validation.** COMM-1's per-communicator sequence number and
//!   COMM-2's cross-rank validation need a small header frame per op (kind, dtype, length,
//!   root, op) exchanged before the data frames: reuse [`frame::FrameKind::Data`] with a
//!   bincode payload, or add a kind (a new kind is a protocol version bump).
//! - **Failures.** A [`link::LinkError`] maps to `CommError`: `Timeout` names the peer rank
//!   (COMM-3), any other error poisons the group; the link is already closed (LINK-4).

pub mod control;
pub mod frame;
pub mod link;
pub mod rendezvous;
