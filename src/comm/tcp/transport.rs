//! What moves a TCP op's bytes: one sender thread and queue per link (TCP-3), the payloads
//! it sends, the progress a waiting op reads, and the sinks that copy, reduce or widen what is
//! received straight out of the socket.

use super::*;

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) shut_down: AtomicBool,
    pub(super) closers: Vec<LinkCloser>,
}

/// The header frame of an op.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct OpHeader {
    pub(super) tag: [u8; 4],
    pub(super) generation: u64,
    pub(super) seq: u64,
    pub(super) call: CallShape,
}

/// Bytes a sender thread writes: the caller's memory, or a copy.
pub(super) enum Payload {
    Owned(Vec<u8>),
    Borrowed(RawBytes),
}

/// A range of a caller's buffer that a sender thread reads while the op runs.
pub(super) struct RawBytes {
    pub(super) ptr: *const u8,
    pub(super) len: usize,
}

// SAFETY: the op that queued it keeps the buffer alive and leaves this range unwritten until
// the sender thread acknowledged the job (TCP-4).
unsafe impl Send for RawBytes {}

pub(super) enum Job {
    Data {
        ticket: u64,
        payload: Payload,
        deadline: Instant,
    },
    Abort {
        reason: Vec<u8>,
        deadline: Instant,
    },
}

#[derive(Debug, Default)]
pub(super) struct ProgressState {
    /// The last ticket the thread is done with (written, failed or skipped).
    pub(super) processed: u64,
    /// The last ticket written successfully.
    pub(super) completed: u64,
    /// The first error; every later job is skipped.
    pub(super) error: Option<LinkError>,
}

#[derive(Debug, Default)]
pub(super) struct Progress {
    pub(super) state: Mutex<ProgressState>,
    pub(super) changed: Condvar,
}

/// A link's sender thread and its queue (TCP-3).
#[derive(Debug)]
pub(super) struct Sender {
    pub(super) queue: Option<SyncSender<Job>>,
    pub(super) progress: Arc<Progress>,
    pub(super) thread: Option<JoinHandle<()>>,
    /// The last ticket queued.
    pub(super) issued: u64,
}

impl Sender {
    pub(super) fn spawn(
        me: Rank,
        peer: Rank,
        writer: LinkWriter,
        frame_bytes: usize,
        link: Option<(Rank, LinkEmulation)>,
    ) -> std::io::Result<Self> {
        let (queue, jobs) = std::sync::mpsc::sync_channel(SEND_QUEUE);
        let progress = Arc::new(Progress::default());
        let shared = Arc::clone(&progress);
        #[cfg(test)]
        let dies = super::tests::SENDERS_DIE.get();
        let thread = std::thread::Builder::new()
            .name(format!("meshwork-tcp-{}-to-{}", me.0, peer.0))
            .spawn(move || {
                #[cfg(test)]
                super::tests::SENDERS_DIE.set(dies);
                run_sender(writer, &jobs, &shared, frame_bytes, link.as_ref())
            })?;
        Ok(Self {
            queue: Some(queue),
            progress,
            thread: Some(thread),
            issued: 0,
        })
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it is idle; every job of a finished op is
        // done (TCP-4), so this does not wait for a peer.
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

pub(super) fn run_sender(
    mut writer: LinkWriter,
    jobs: &Receiver<Job>,
    progress: &Progress,
    frame: usize,
    link: Option<&(Rank, LinkEmulation)>,
) {
    let mut failed = false;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Data {
                ticket,
                payload,
                deadline,
            } => {
                #[cfg(test)]
                if super::tests::SENDERS_DIE.get() == ticket {
                    panic!("a test's sender thread dies with a job taken");
                }
                let result = if failed {
                    Ok(())
                } else {
                    let bytes: &[u8] = match &payload {
                        Payload::Owned(bytes) => bytes,
                        // SAFETY: TCP-4: the op keeps this range alive and unwritten until
                        // `processed` reaches this ticket, which happens below.
                        Payload::Borrowed(raw) => unsafe {
                            std::slice::from_raw_parts(raw.ptr, raw.len)
                        },
                    };
                    // EMU-1: the payload leaves once the emulated link has carried it.
                    if let Some((me, link)) = link {
                        // Never past the op's deadline: the write then fails with it.
                        let left = deadline.saturating_duration_since(Instant::now());
                        std::thread::sleep(link.delay(*me, bytes.len()).min(left));
                    }
                    bytes
                        .chunks(frame.max(1))
                        .try_for_each(|chunk| writer.send(chunk, deadline))
                };
                let mut state = lock(&progress.state);
                match result {
                    Ok(()) if !failed => state.completed = ticket,
                    Ok(()) => {}
                    Err(e) => {
                        failed = true;
                        state.error.get_or_insert(e);
                    }
                }
                state.processed = ticket;
                drop(state);
                progress.changed.notify_all();
            }
            Job::Abort { reason, deadline } => {
                if !failed {
                    let _ = writer.abort(&reason, deadline);
                }
                return;
            }
        }
    }
}

#[derive(Debug)]
pub(super) struct PeerLink {
    pub(super) reader: LinkReader,
    pub(super) sender: Sender,
}

/// Writes received bytes straight into a buffer.
pub(super) struct CopySink {
    pub(super) dst: *mut u8,
    pub(super) base: usize,
}

impl PayloadSink for CopySink {
    fn piece(&mut self, offset: usize, len: usize) -> &mut [u8] {
        // SAFETY: the caller sized the frame (max_len) to the range this sink covers, which
        // lies in a buffer it owns for the op and that no sender reads now (TCP-3 waits).
        unsafe { std::slice::from_raw_parts_mut(self.dst.add(self.base + offset), len) }
    }

    fn arrived(&mut self, _offset: usize, _len: usize) {}
}

impl StepSink for CopySink {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}

/// A sink that receives a step as several frames: each frame's bytes start at `base`.
pub(super) trait StepSink: PayloadSink {
    fn set_base(&mut self, base: usize);
}

impl StepSink for ReduceSink<'_> {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}

/// Reads received f32s into a scratch piece and combines them into a buffer.
pub(super) struct ReduceSink<'a> {
    pub(super) dst: *mut f32,
    /// Bytes of the step already received.
    pub(super) base: usize,
    pub(super) scratch: &'a mut Vec<f32>,
    pub(super) op: ReduceOp,
}

impl PayloadSink for ReduceSink<'_> {
    fn piece(&mut self, _offset: usize, len: usize) -> &mut [u8] {
        let elements = len / 4;
        if self.scratch.len() < elements {
            self.scratch.resize(elements, 0.0);
        }
        // SAFETY: any byte pattern is a valid f32, u8 has no alignment, and the slice covers
        // exactly `elements` f32s of the scratch buffer (len is a multiple of 4: the reader
        // checks the granule).
        unsafe { std::slice::from_raw_parts_mut(self.scratch.as_mut_ptr().cast::<u8>(), len) }
    }

    fn arrived(&mut self, offset: usize, len: usize) {
        let (start, n) = ((self.base + offset) / 4, len / 4);
        // SAFETY: as for CopySink: this range of the buffer is this rank's to write now.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.dst.add(start), n) };
        combine(dst, &self.scratch[..n], self.op);
    }
}

/// Reads received 16-bit elements into a scratch piece and widens them into an f32 buffer:
/// copied, or combined with `op` (COMM-9).
pub(super) struct WidenSink<'a> {
    pub(super) dst: *mut f32,
    /// Bytes of the step already received.
    pub(super) base: usize,
    pub(super) scratch: &'a mut Vec<u8>,
    pub(super) dtype: DType,
    pub(super) op: Option<ReduceOp>,
}

impl PayloadSink for WidenSink<'_> {
    fn piece(&mut self, _offset: usize, len: usize) -> &mut [u8] {
        if self.scratch.len() < len {
            self.scratch.resize(len, 0);
        }
        &mut self.scratch[..len]
    }

    fn arrived(&mut self, offset: usize, len: usize) {
        let (start, n) = ((self.base + offset) / 2, len / 2);
        // SAFETY: as for CopySink: this range of the buffer is this rank's to write now.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.dst.add(start), n) };
        bits16::widen_bytes_into(self.dtype, &self.scratch[..len], dst, self.op);
    }
}

impl StepSink for WidenSink<'_> {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}
