//! Packets of any length between two endpoints, in order: what a pipeline's link between two
//! stages in different processes sends over MPI (`cluster::remote::pipeline`'s MPI wire). A
//! send returns once MPI has the packet (a copy), with at most `capacity` packets of this end
//! still in flight, as a link's bounded queue (PIPE-4); a receive polls for the next packet
//! (`MPI_Improbe`, then `MPI_Mrecv` of its exact length) until its deadline (MPI-2). Tags as
//! for groups (MPI-1): the receiving endpoint and the sending end's index.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::raw::{self, PendingSend};
use super::{MpiEndpoint, MpiError, MpiWorld, RANK_BITS, STREAM, endpoint_bits, tag};

/// Why a packet did not go or come.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PacketsError {
    /// The deadline passed.
    #[error("no room or no packet before the deadline")]
    TimedOut,
    /// The channel was closed ([`MpiPackets::closer`]) or MPI finalised.
    #[error("the channel was closed")]
    Closed,
    /// A packet over the receiver's limit.
    #[error("a packet of {len} bytes, over the limit of {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An MPI call failed.
    #[error(transparent)]
    Mpi(#[from] MpiError),
}

/// One end of an ordered packet channel to another endpoint.
#[derive(Debug)]
pub struct MpiPackets {
    mpi: &'static MpiWorld,
    peer: c_int,
    to: c_int,
    from: c_int,
    capacity: usize,
    pending: Mutex<Vec<PendingSend>>,
    closed: Arc<AtomicBool>,
}

impl MpiPackets {
    /// The end at endpoint `mine` (this process's), numbered `me`, of a channel to the end at
    /// `theirs`, numbered `them` (numbers below 4096 that tell the ends apart, such as stage
    /// indices: packets to an endpoint from several ends are matched by them); at most
    /// `capacity` of this end's packets in flight.
    pub fn new(
        mpi: &'static MpiWorld,
        (mine, me): (MpiEndpoint, usize),
        (theirs, them): (MpiEndpoint, usize),
        capacity: usize,
    ) -> Result<Self, MpiError> {
        if mine.process != mpi.rank() {
            return Err(MpiError::Endpoints(format!(
                "{mine:?} is not this process's ({})",
                mpi.rank()
            )));
        }
        let ends = 1usize << RANK_BITS;
        if me >= ends || them >= ends || (me == them && mine == theirs) {
            return Err(MpiError::Endpoints(format!(
                "ends {me} and {them}: two different numbers below {ends}"
            )));
        }
        let limit = 1u64 << endpoint_bits(mpi.tag_bits());
        if let Some(e) = [mine, theirs]
            .into_iter()
            .find(|e| u64::from(e.id) >= limit)
        {
            return Err(MpiError::EndpointsExhausted { endpoint: e, limit });
        }
        Ok(Self {
            mpi,
            peer: c_int::try_from(theirs.process).unwrap_or(c_int::MAX),
            to: tag(theirs.id, me, mpi.tag_bits()) | STREAM,
            from: tag(mine.id, them, mpi.tag_bits()) | STREAM,
            capacity: capacity.max(1),
            pending: Mutex::new(Vec::new()),
            closed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Closes the channel from any thread: a waiting send or receive fails with
    /// [`PacketsError::Closed`] at its next poll.
    pub fn closer(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.closed)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Polls `ready` (with MPI live) until it answers, the deadline passes or the channel
    /// closes.
    fn poll<T>(
        &self,
        deadline: Instant,
        mut ready: impl FnMut(&Self) -> Result<Option<T>, PacketsError>,
    ) -> Result<T, PacketsError> {
        let mut polls: u32 = 0;
        loop {
            {
                let Some(_live) = self.mpi.enter() else {
                    return Err(PacketsError::Closed);
                };
                if self.is_closed() {
                    return Err(PacketsError::Closed);
                }
                if let Some(done) = ready(self)? {
                    return Ok(done);
                }
            }
            if Instant::now() >= deadline {
                return Err(PacketsError::TimedOut);
            }
            raw::pause(&mut polls);
        }
    }

    /// Frees the sends that completed; how many are still in flight.
    fn reap(&self) -> Result<usize, MpiError> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let mut i = 0;
        while i < pending.len() {
            if pending[i].test()? {
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(pending.len())
    }

    /// Sends one packet (a copy of `bytes`), once fewer than `capacity` are in flight.
    pub fn send(&self, bytes: &[u8], deadline: Instant) -> Result<(), PacketsError> {
        self.poll(deadline, |c| {
            if c.reap()? >= c.capacity {
                return Ok(None);
            }
            let send = raw::isend(c.mpi, bytes.to_vec(), (c.peer, c.to, 0))?;
            c.pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(send);
            Ok(Some(()))
        })
    }

    /// Receives the next packet into `bytes` (its contents replaced); one over `max` bytes is
    /// an error (and consumed).
    pub fn recv(
        &self,
        bytes: &mut Vec<u8>,
        max: usize,
        deadline: Instant,
    ) -> Result<(), PacketsError> {
        let packet = self.poll(deadline, |c| {
            // Our own sends progress while we wait.
            c.reap()?;
            Ok(raw::take_message(c.mpi, c.peer, c.from)?)
        })?;
        if packet.len() > max {
            return Err(PacketsError::TooLarge {
                len: packet.len(),
                max,
            });
        }
        *bytes = packet;
        Ok(())
    }
}

impl Drop for MpiPackets {
    fn drop(&mut self) {
        let pending = std::mem::take(
            self.pending
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        // MPI-2: sends still in flight keep reading their buffers; never free them.
        let _live = self.mpi.enter();
        for mut send in pending {
            let done = _live.is_some() && send.test().unwrap_or(false);
            if !done {
                send.forget();
            }
        }
    }
}
