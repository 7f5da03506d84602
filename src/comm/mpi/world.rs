//! The process's MPI environment: initialised once (`MPI_THREAD_MULTIPLE`), one duplicate of
//! `MPI_COMM_WORLD` that every meshwork group's messages travel on (errors returned, never
//! fatal), the tag space those groups share (MPI-1), and the few world-wide collectives a
//! launch needs (broadcasting the head's address).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{OnceLock, PoisonError, RwLock, RwLockReadGuard};

use mpi::ffi;

use super::MpiError;

/// An MPI handle used from any thread: sound because the world was initialised with
/// `MPI_THREAD_MULTIPLE` (checked by [`init`]), under which MPI handles are thread-safe.
#[derive(Debug, Clone, Copy)]
pub(super) struct Handle<T>(pub(super) T);

// SAFETY: see the type's docs: MPI_THREAD_MULTIPLE makes every MPI call thread-safe.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

/// This process's MPI world, as meshwork uses it.
#[derive(Debug)]
pub struct MpiWorld {
    comm: Handle<ffi::MPI_Comm>,
    rank: u32,
    size: u32,
    /// Bits of a tag (`MPI_TAG_UB` + 1 is at least 2^bits).
    tag_bits: u32,
    /// The next endpoint id this process hands out (MPI-1).
    next_endpoint: AtomicU32,
    finalized: AtomicBool,
    /// Held (shared) by every op and every other use of MPI while it makes MPI calls, and
    /// (exclusive) by [`finalize`]: no MPI call runs after `MPI_Finalize`.
    in_use: RwLock<()>,
}

/// While held, MPI is initialised and not finalised ([`MpiWorld::enter`]).
pub(super) type Live = RwLockReadGuard<'static, ()>;

static WORLD: OnceLock<Result<MpiWorld, MpiError>> = OnceLock::new();

/// Checks an MPI call's return code.
pub(super) fn check(call: &'static str, code: c_int) -> Result<(), MpiError> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` has room for MPI_MAX_ERROR_STRING characters.
    let described = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    let detail = if described == ffi::MPI_SUCCESS as c_int {
        String::from_utf8_lossy(&text[..len.clamp(0, text.len() as c_int) as usize]).into_owned()
    } else {
        format!("error code {code}")
    };
    Err(MpiError::Call { call, detail })
}

/// Initialises MPI for this process (`MPI_Init_thread` asking for `MPI_THREAD_MULTIPLE`: every
/// meshwork device thread drives its own communicators) once, and returns the world; later
/// calls return the same world or the same error. An MPI that provides less than
/// `MPI_THREAD_MULTIPLE` is [`MpiError::Threading`].
pub fn init() -> Result<&'static MpiWorld, MpiError> {
    WORLD
        .get_or_init(MpiWorld::start)
        .as_ref()
        .map_err(Clone::clone)
}

/// The world, if [`init`] succeeded in this process.
pub fn world() -> Option<&'static MpiWorld> {
    WORLD.get().and_then(|w| w.as_ref().ok())
}

/// Finalises MPI if this process initialised it: call it once, at the end of `main`, on the
/// thread that called [`init`] (MPI's rule), after every group using MPI has ended. It waits
/// for ops still running (each ends within its time-out); later ops on MPI communicators fail
/// with [`crate::comm::CommError::Shutdown`]. Without it, `mpirun` reports the process as
/// having exited without finalising.
pub fn finalize() {
    let Some(world) = world() else { return };
    let _exclusive = world.in_use.write().unwrap_or_else(PoisonError::into_inner);
    if !world.finalized.swap(true, Ordering::SeqCst) {
        // SAFETY: MPI was initialised by this process and not finalised yet, and no other
        // thread is inside an MPI call (they all hold `in_use` shared while they make them).
        unsafe {
            let mut comm = world.comm.0;
            ffi::MPI_Comm_free(&mut comm);
            ffi::MPI_Finalize();
        }
    }
}

impl MpiWorld {
    fn start() -> Result<MpiWorld, MpiError> {
        let mut initialized: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time.
        check("MPI_Initialized", unsafe {
            ffi::MPI_Initialized(&mut initialized)
        })?;
        if initialized != 0 {
            return Err(MpiError::AlreadyInitialized);
        }
        let mut provided: c_int = 0;
        // SAFETY: MPI is not initialised yet (checked above; `init` runs this once).
        check("MPI_Init_thread", unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            )
        })?;
        // SAFETY: reading a constant the MPI library defines.
        if provided < unsafe { ffi::RSMPI_THREAD_MULTIPLE } {
            // SAFETY: initialised above.
            unsafe { ffi::MPI_Finalize() };
            return Err(MpiError::Threading { provided });
        }
        // SAFETY: MPI is initialised; every out-pointer is valid.
        unsafe {
            let mut comm: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
            check(
                "MPI_Comm_dup",
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm),
            )?;
            check(
                "MPI_Comm_set_errhandler",
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
            )?;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            check("MPI_Comm_rank", ffi::MPI_Comm_rank(comm, &mut rank))?;
            check("MPI_Comm_size", ffi::MPI_Comm_size(comm, &mut size))?;
            let mut flag: c_int = 0;
            let mut ub: *mut c_int = std::ptr::null_mut();
            check(
                "MPI_Comm_get_attr(MPI_TAG_UB)",
                ffi::MPI_Comm_get_attr(
                    ffi::RSMPI_COMM_WORLD,
                    ffi::MPI_TAG_UB as c_int,
                    (&mut ub as *mut *mut c_int).cast::<c_void>(),
                    &mut flag,
                ),
            )?;
            // The standard guarantees at least 32767.
            let tag_ub = if flag != 0 && !ub.is_null() {
                *ub
            } else {
                32767
            };
            Ok(MpiWorld {
                comm: Handle(comm),
                rank: u32::try_from(rank).unwrap_or(0),
                size: u32::try_from(size).unwrap_or(1),
                tag_bits: u32::BITS - (tag_ub.max(1) as u32 + 1).leading_zeros() - 1,
                next_endpoint: AtomicU32::new(0),
                finalized: AtomicBool::new(false),
                in_use: RwLock::new(()),
            })
        }
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Processes in `MPI_COMM_WORLD`.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Bits a message tag may use (`MPI_TAG_UB` + 1 ≥ 2^bits).
    pub fn tag_bits(&self) -> u32 {
        self.tag_bits
    }

    /// Whether [`finalize`] ran.
    pub fn is_finalized(&self) -> bool {
        self.finalized.load(Ordering::SeqCst)
    }

    /// MPI, kept initialised while the guard lives; `None` once finalised. Taken once per op
    /// (never nested: a waiting `finalize` would block the second).
    pub(super) fn enter(&'static self) -> Option<Live> {
        let live = self.in_use.read().unwrap_or_else(PoisonError::into_inner);
        (!self.is_finalized()).then_some(live)
    }

    pub(super) fn comm(&self) -> ffi::MPI_Comm {
        self.comm.0
    }

    /// A new endpoint of this process: what a rank of a group is addressed by (MPI-1).
    pub fn endpoint(&self) -> super::MpiEndpoint {
        super::MpiEndpoint {
            process: self.rank,
            id: self.next_endpoint.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Broadcasts `bytes` from world rank `root` to every process (a collective: every process
    /// calls it, in the same order, before its groups start); returns root's bytes.
    pub fn broadcast_bytes(&'static self, root: u32, bytes: &[u8]) -> Result<Vec<u8>, MpiError> {
        let _live = self.enter().ok_or(MpiError::Finalized)?;
        let root = c_int::try_from(root).map_err(|_| MpiError::Call {
            call: "MPI_Bcast",
            detail: format!("root {root} is not a rank"),
        })?;
        let mut len = [u64::try_from(bytes.len()).unwrap_or(u64::MAX)];
        // SAFETY: `len` is one u64; every process passes the same count and type.
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(
                len.as_mut_ptr().cast(),
                8,
                ffi::RSMPI_UINT8_T,
                root,
                self.comm.0,
            )
        })?;
        let n = usize::try_from(len[0])
            .ok()
            .filter(|&n| n <= i32::MAX as usize)
            .ok_or(MpiError::Call {
                call: "MPI_Bcast",
                detail: format!("a broadcast of {} bytes", len[0]),
            })?;
        let mut out = if self.rank == root as u32 {
            bytes.to_vec()
        } else {
            vec![0u8; n]
        };
        if n == 0 {
            // Every process knows the length: none enters a broadcast of nothing (an empty
            // vector's pointer is not one MPI accepts).
            return Ok(out);
        }
        // SAFETY: `out` holds `n` bytes on every process (the length was broadcast first).
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(
                out.as_mut_ptr().cast(),
                n as c_int,
                ffi::RSMPI_UINT8_T,
                root,
                self.comm.0,
            )
        })?;
        Ok(out)
    }

    /// Every process's `MPI_Get_processor_name` (its host, as MPI names it), in world rank
    /// order (a collective, as [`MpiWorld::broadcast_bytes`]).
    pub fn processor_names(&'static self) -> Result<Vec<String>, MpiError> {
        let _live = self.enter().ok_or(MpiError::Finalized)?;
        // SAFETY: reading a constant the MPI library defines.
        let width = unsafe { ffi::RSMPI_MAX_PROCESSOR_NAME }.max(1) as usize;
        let mut mine = vec![0u8; width];
        let mut len: c_int = 0;
        // SAFETY: `mine` has room for MPI_MAX_PROCESSOR_NAME characters.
        let named = check("MPI_Get_processor_name", unsafe {
            ffi::MPI_Get_processor_name(mine.as_mut_ptr().cast(), &mut len)
        });
        // Every process enters the all-gather, even one whose name failed (an empty name):
        // none may be left waiting for it.
        if named.is_err() {
            mine.fill(0);
        }
        let mut all = vec![0u8; width * self.size as usize];
        // SAFETY: every process sends `width` bytes and receives `width` from each process.
        check("MPI_Allgather", unsafe {
            ffi::MPI_Allgather(
                mine.as_ptr().cast(),
                width as c_int,
                ffi::RSMPI_UINT8_T,
                all.as_mut_ptr().cast(),
                width as c_int,
                ffi::RSMPI_UINT8_T,
                self.comm.0,
            )
        })?;
        named?;
        Ok(all
            .chunks(width)
            .map(|name| {
                let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                String::from_utf8_lossy(&name[..end]).into_owned()
            })
            .collect())
    }

    /// The MPI library's own `MPI_Allreduce` (f32 sum over every process of the world, one
    /// buffer per process): the reference `meshwork bench allreduce --transport mpi` puts
    /// meshwork's plans over MPI beside. Not what meshwork's groups run: its order of
    /// additions is the library's, so it is not bit-reproducible across layouts.
    pub fn library_all_reduce_sum(&'static self, buf: &mut [f32]) -> Result<(), MpiError> {
        let _live = self.enter().ok_or(MpiError::Finalized)?;
        let count = c_int::try_from(buf.len()).map_err(|_| MpiError::Call {
            call: "MPI_Allreduce",
            detail: format!("{} elements", buf.len()),
        })?;
        let send = buf.to_vec();
        // SAFETY: both buffers hold `count` f32s; every process passes the same count.
        check("MPI_Allreduce", unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                count,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.comm.0,
            )
        })
    }

    /// Ends every process of the job (`MPI_Abort`): what a rank does when it cannot go on and
    /// the launcher should stop the others.
    pub fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI is initialised.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }
}
