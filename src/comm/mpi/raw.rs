//! The few non-blocking MPI calls the transport makes, each behind a function that states
//! what it needs from its caller: `MPI_Isend` of an owned buffer, `MPI_Irecv` into a borrowed
//! one, `MPI_Test`, `MPI_Cancel`, and `MPI_Improbe`/`MPI_Mrecv` for abort messages.

use std::ffi::c_int;

use mpi::ffi;

use super::MpiError;
use super::world::{Handle, MpiWorld, check};

/// A send in flight and the bytes it reads: they live as long as the request (MPI-2).
#[derive(Debug)]
pub(super) struct PendingSend {
    request: Handle<ffi::MPI_Request>,
    bytes: Vec<u8>,
    /// The receiver's rank in the group (for errors).
    peer: usize,
}

impl PendingSend {
    /// The receiver's rank in the group.
    pub(super) fn peer(&self) -> usize {
        self.peer
    }

    /// Whether the send completed (its buffer is free again).
    pub(super) fn test(&mut self) -> Result<bool, MpiError> {
        test(&mut self.request).map(|done| done.is_some())
    }

    /// Keeps the send's buffer alive for the rest of the process: MPI may still read it.
    pub(super) fn forget(self) {
        std::mem::forget(self.bytes);
    }
}

/// Starts sending `bytes` to world rank `process` with `tag` (group rank `peer`'s).
pub(super) fn isend(
    world: &MpiWorld,
    bytes: Vec<u8>,
    (process, tag, peer): (c_int, c_int, usize),
) -> Result<PendingSend, MpiError> {
    let count = c_int::try_from(bytes.len()).map_err(|_| MpiError::Call {
        call: "MPI_Isend",
        detail: format!("a message of {} bytes", bytes.len()),
    })?;
    let mut request: ffi::MPI_Request = unsafe_null_request();
    // SAFETY: `bytes` is moved into the returned PendingSend with the request and stays alive
    // (and unmoved: a Vec's heap buffer does not move with the Vec) until the request
    // completed or it is forgotten (MPI-2).
    check("MPI_Isend", unsafe {
        ffi::MPI_Isend(
            bytes.as_ptr().cast(),
            count,
            ffi::RSMPI_UINT8_T,
            process,
            tag,
            world.comm(),
            &mut request,
        )
    })?;
    Ok(PendingSend {
        request: Handle(request),
        bytes,
        peer,
    })
}

/// A receive in flight into a buffer its caller keeps borrowed until it completed or was
/// cancelled (its drop, also on an unwind).
#[derive(Debug)]
pub(super) struct PendingRecv {
    request: Handle<ffi::MPI_Request>,
}

/// Starts receiving at most `len` bytes from world rank `process` with `tag` into `ptr`.
///
/// # Safety
/// `ptr` is valid for `len` bytes of writes, and nothing else reads or writes them until the
/// returned receive completed ([`PendingRecv::test`] returned a count) or was cancelled.
pub(super) unsafe fn irecv(
    world: &MpiWorld,
    ptr: *mut u8,
    len: usize,
    process: c_int,
    tag: c_int,
) -> Result<PendingRecv, MpiError> {
    let count = c_int::try_from(len).map_err(|_| MpiError::Call {
        call: "MPI_Irecv",
        detail: format!("a message of {len} bytes"),
    })?;
    let mut request: ffi::MPI_Request = unsafe_null_request();
    // SAFETY: forwarded to the caller.
    check("MPI_Irecv", unsafe {
        ffi::MPI_Irecv(
            ptr.cast(),
            count,
            ffi::RSMPI_UINT8_T,
            process,
            tag,
            world.comm(),
            &mut request,
        )
    })?;
    Ok(PendingRecv {
        request: Handle(request),
    })
}

impl PendingRecv {
    /// The received byte count once the receive completed. After an error MPI has ended the
    /// request (it is null), so nothing is left to cancel.
    pub(super) fn test(&mut self) -> Result<Option<usize>, MpiError> {
        test(&mut self.request)
    }

    fn is_active(&self) -> bool {
        self.request.0 != unsafe_null_request()
    }
}

/// Dropping a receive still active cancels it and waits until MPI let go of its buffer (a
/// receive cancels at once, or completes if its message already matched; a message that
/// matched only in part completes as its sender sends the rest).
impl Drop for PendingRecv {
    fn drop(&mut self) {
        if self.is_active() {
            // SAFETY: the request is an active receive of this process; its op holds MPI live
            // (`MpiWorld::enter`) for as long as the request exists.
            unsafe {
                ffi::MPI_Cancel(&mut self.request.0);
                ffi::MPI_Wait(&mut self.request.0, ffi::RSMPI_STATUS_IGNORE);
            }
        }
    }
}

fn unsafe_null_request() -> ffi::MPI_Request {
    // SAFETY: reading an extern constant the MPI library defines.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// `MPI_Test`: the byte count once the request completed (0 for a send).
fn test(request: &mut Handle<ffi::MPI_Request>) -> Result<Option<usize>, MpiError> {
    let mut flag: c_int = 0;
    let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
    // SAFETY: the request is active or null; `status` has room for one status.
    check("MPI_Test", unsafe {
        ffi::MPI_Test(&mut request.0, &mut flag, status.as_mut_ptr())
    })?;
    if flag == 0 {
        return Ok(None);
    }
    let mut count: c_int = 0;
    // SAFETY: MPI_Test filled the status (a completed request).
    let status = unsafe { status.assume_init() };
    check("MPI_Get_count", unsafe {
        ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count)
    })?;
    if status.MPI_ERROR != 0 && status.MPI_ERROR != ffi::MPI_SUCCESS as c_int {
        check("MPI_Test (status)", status.MPI_ERROR)?;
    }
    Ok(Some(usize::try_from(count).unwrap_or(0)))
}

/// `MPI_Improbe` then `MPI_Mrecv`: the whole message from `process` with `tag`, if one is
/// waiting.
pub(super) fn take_message(
    world: &MpiWorld,
    process: c_int,
    tag: c_int,
) -> Result<Option<Vec<u8>>, MpiError> {
    let mut flag: c_int = 0;
    let mut message: ffi::MPI_Message = unsafe { ffi::RSMPI_MESSAGE_NULL };
    let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
    // SAFETY: out-pointers valid for one value each.
    check("MPI_Improbe", unsafe {
        ffi::MPI_Improbe(
            process,
            tag,
            world.comm(),
            &mut flag,
            &mut message,
            status.as_mut_ptr(),
        )
    })?;
    if flag == 0 {
        return Ok(None);
    }
    // SAFETY: Improbe matched a message and filled the status.
    let status = unsafe { status.assume_init() };
    let mut count: c_int = 0;
    // SAFETY: as above.
    check("MPI_Get_count", unsafe {
        ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count)
    })?;
    let len = usize::try_from(count).unwrap_or(0);
    let mut bytes = vec![0u8; len];
    // SAFETY: `bytes` has room for the matched message's `count` bytes.
    check("MPI_Mrecv", unsafe {
        ffi::MPI_Mrecv(
            bytes.as_mut_ptr().cast(),
            count,
            ffi::RSMPI_UINT8_T,
            &mut message,
            ffi::RSMPI_STATUS_IGNORE,
        )
    })?;
    Ok(Some(bytes))
}

/// One wait between two polls of a request: spin briefly (most messages are near), then back
/// off, so ranks sharing cores (oversubscribed runs) leave each other time.
pub(super) fn pause(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    if *polls > 64 {
        std::thread::sleep(std::time::Duration::from_micros(u64::from(
            (*polls).min(2_000) / 10,
        )));
    } else {
        std::hint::spin_loop();
    }
}
