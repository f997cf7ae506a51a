//! The queue's task and the handles to it: the controller's ([`QueueCtl`]) and the
//! callers' ([`QueueHandle`], [`IoBuffer`]).

use super::*;

/// The controller's side of a queue: its core, and the notifier of its task.
pub struct QueueCtl<D: DeviceContext> {
    core: Arc<Mutex<QueueCore<D>>>,
    /// Wakes the task after the controller changed the core (new CQ, phase).
    task: Arc<Notify>,
    /// Wakes the controller when the reserved slot completes.
    pub control_done: Arc<Notify>,
    clock: Clock,
}

/// The controller's monotonic clock, shared by its queues (device contexts come and go,
/// each with its own epoch). Tokio's clock, so that a paused runtime (a simulated network)
/// runs the controller in virtual time.
#[derive(Clone, Copy)]
pub struct Clock(pub tokio::time::Instant);

impl Clock {
    pub fn now(&self) -> Instant {
        Instant(self.0.elapsed().as_nanos() as u64)
    }
}

impl<D: DeviceContext> Clone for QueueCtl<D> {
    fn clone(&self) -> Self {
        QueueCtl {
            core: self.core.clone(),
            task: self.task.clone(),
            control_done: self.control_done.clone(),
            clock: self.clock,
        }
    }
}

impl<D: DeviceContext> QueueCtl<D> {
    pub fn lock(&self) -> MutexGuard<'_, QueueCore<D>> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tell the task that the core changed.
    pub fn poke(&self) {
        self.task.notify_one();
    }

    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Run a controller command on the reserved slot and wait for its completion, at most
    /// `timeout`. Read data, if any, is left in the slot ([`QueueCore::control_data`]).
    pub async fn control(
        &self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
        timeout: Duration,
    ) -> Result<Cqe, HostError> {
        let done = self.control_done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        self.lock()
            .post_control(self.now(), sqe, data_out, data_in)?;
        self.poke();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(d) = self.lock().take_control() {
                return match d {
                    ControlDone::Completed(cqe) => {
                        let st = cqe.nvme_status();
                        if st.is_success() {
                            Ok(cqe)
                        } else {
                            Err(HostError::from_status(st, sqe.opcode))
                        }
                    }
                    ControlDone::Lost => Err(HostError::Step("connection lost under command")),
                };
            }
            if tokio::time::timeout_at(deadline, done.as_mut())
                .await
                .is_err()
            {
                return Err(HostError::Step("controller command timed out"));
            }
            done.set(self.control_done.notified());
            done.as_mut().enable();
        }
    }
}

/// What a [`QueueHandle`] does on the queue's core itself, without its task. A trait object,
/// so that handles (and the controller's public API) do not carry the backend's type: one
/// indirect call per submission, against a lock and a post.
trait Direct: Send + Sync {
    /// Take the command here and post it if the queue has a free slot and nothing waits in
    /// its channel `tx` (so requests keep their order); else hand `reply` back.
    #[allow(clippy::too_many_arguments)]
    fn try_submit(
        &self,
        tx: &mpsc::Sender<Request>,
        clock: &Clock,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
    ) -> Option<oneshot::Sender<Result<Response, HostError>>>;
    /// [`QueueCore::register`], with the memory type erased.
    fn register(
        &self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<dyn MemView>, usize), HostError>;
    fn unregister(&self, id: u32);
    /// Keep `buf` for a later read (if `keep`), and count `copied` bytes the caller copied
    /// out of it on the data path.
    fn recycle(&self, buf: Vec<u8>, keep: bool, copied: usize);
    fn stats(&self) -> QueueStats;
}

impl<D: DeviceContext> Direct for Mutex<QueueCore<D>> {
    fn try_submit(
        &self,
        tx: &mpsc::Sender<Request>,
        clock: &Clock,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
    ) -> Option<oneshot::Sender<Result<Response, HostError>>> {
        let mut c = self.lock().unwrap_or_else(|e| e.into_inner());
        if c.accepting() && !c.backlog && tx.capacity() == tx.max_capacity() {
            let apart = crate::harness::alloc_audit::in_platform();
            c.submit_parts(clock.now(), sqe, data_out, data_in, region, reply, apart);
            c.flush_posts();
            None
        } else {
            Some(reply)
        }
    }

    fn recycle(&self, buf: Vec<u8>, keep: bool, copied: usize) {
        let mut c = self.lock().unwrap_or_else(|e| e.into_inner());
        if copied > 0 {
            c.stats.count_copy(copied);
        }
        if keep && c.spare.len() < SPARE_BUFFERS {
            c.spare.push(buf);
        }
    }

    fn stats(&self) -> QueueStats {
        self.lock().unwrap_or_else(|e| e.into_inner()).stats.clone()
    }

    fn register(
        &self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<dyn MemView>, usize), HostError> {
        let (id, mem, pad) = self
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .register(chunk, chunks)?;
        Ok((id, mem, pad))
    }

    fn unregister(&self, id: u32) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .unregister(id);
    }
}

/// A registered buffer's memory, whatever the backend's type.
trait MemView: Send + Sync {
    fn view_ptr(&self) -> *mut u8;
    fn view_read(&self, offset: usize, out: &mut [u8]);
    fn view_write(&self, offset: usize, data: &[u8]);
}

impl<M: HostBuffer> MemView for M {
    fn view_ptr(&self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn view_read(&self, offset: usize, out: &mut [u8]) {
        self.read(offset, out)
    }
    fn view_write(&self, offset: usize, data: &[u8]) {
        self.write(offset, data)
    }
}

/// Host memory registered with one I/O queue, for I/O with no copy: a write's data leaves
/// from it and a read's data lands in it ([`Controller::write_from`],
/// [`Controller::read_to`]). It is `chunks()` chunks of `chunk_len()` bytes, each with its
/// own memory region and a fresh key per command, so one command at a time may use a chunk;
/// the first chunk starts on a page boundary. The memory belongs to the queue and is
/// registered again on the new device after a recovery; it is freed once this handle is
/// dropped and no command uses it.
///
/// [`Controller::write_from`]: super::Controller::write_from
/// [`Controller::read_to`]: super::Controller::read_to
pub struct IoBuffer {
    queue: QueueHandle,
    id: u32,
    mem: Arc<dyn MemView>,
    pad: usize,
    chunk: usize,
    chunks: usize,
}

impl IoBuffer {
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Bytes of all chunks.
    pub fn len(&self) -> usize {
        self.chunk * self.chunks
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of chunk 0 (chunk `k` starts `k * chunk_len()` after it). For code
    /// that fills and reads the buffer itself (fio's I/O buffers): it must not touch a chunk
    /// while a command on it is out, as with DMA.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.mem.view_ptr().wrapping_add(self.pad)
    }

    /// Copy `data` into the buffer at `offset` (from chunk 0's start).
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len(), "write past the buffer");
        self.mem.view_write(self.pad + offset, data)
    }

    /// Copy the buffer's bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len(), "read past the buffer");
        self.mem.view_read(self.pad + offset, out)
    }

    /// The chunk that holds all of `len` bytes at `ptr`, starting at its beginning, if any.
    pub fn chunk_at(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let off = (ptr as usize).checked_sub(self.as_mut_ptr() as usize)?;
        let k = off / self.chunk;
        (off % self.chunk == 0 && k < self.chunks && len > 0 && len <= self.chunk).then_some(k)
    }

    /// The queue it is registered with.
    pub fn queue(&self) -> &QueueHandle {
        &self.queue
    }

    pub(crate) fn io(&self, chunk: usize, len: usize, write: bool) -> RegionIo {
        RegionIo {
            id: self.id,
            chunk: chunk.min(u32::MAX as usize) as u32,
            len,
            write,
        }
    }
}

impl Drop for IoBuffer {
    fn drop(&mut self) {
        self.queue.core.unregister(self.id);
    }
}

/// A cheap handle for submitting to a queue.
#[derive(Clone)]
pub struct QueueHandle {
    tx: mpsc::Sender<Request>,
    pub qid: u16,
    pub spec: QueueSpec,
    core: Arc<dyn Direct>,
    /// The queue task's notifier, and the clock it stamps posts with.
    task: Arc<Notify>,
    clock: Clock,
}

impl QueueHandle {
    /// Give back the data buffer of a read's [`Response`] once its bytes are used, for the
    /// queue to fill with a later read. Keeps a few, of at most the queue's transfer size.
    pub fn recycle(&self, buf: Vec<u8>) {
        self.recycle_copied(buf, 0);
    }

    /// [`QueueHandle::recycle`] after the caller copied `copied` bytes out of the buffer on
    /// its data path: counted in [`QueueStats::copies`] under the same lock.
    pub(crate) fn recycle_copied(&self, buf: Vec<u8>, copied: usize) {
        let keep = buf.capacity() != 0 && buf.capacity() <= self.spec.max_io;
        if keep || copied > 0 {
            self.core.recycle(buf, keep, copied);
        }
    }

    /// The queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.core.stats()
    }

    /// Submit a command and wait for its completion. An error status comes back as
    /// `HostError::Nvme`.
    pub async fn submit(
        &self,
        sqe: Sqe,
        data_out: Option<Vec<u8>>,
        data_in: usize,
    ) -> Result<Response, HostError> {
        let opcode = sqe.opcode;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request {
                sqe,
                data_out,
                data_in,
                region: None,
                reply,
                audit_apart: crate::harness::alloc_audit::in_platform(),
            })
            .await
            .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))?;
        self.finish(opcode, rx).await
    }

    /// [`QueueHandle::submit`] with the outgoing data borrowed. When the queue has a free
    /// slot and nothing waits in its channel (so requests keep their order), the command is
    /// taken right here: `data_out` is copied once, straight into the slot's registered
    /// buffer, and posted, with no buffer of its own and no hop through the queue task.
    /// Otherwise it queues like `submit`.
    pub async fn submit_slice(
        &self,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
    ) -> Result<Response, HostError> {
        self.submit_direct(sqe, data_out, data_in, None).await
    }

    /// Submit a command whose data is in a registered buffer ([`IoBuffer`]) of this queue:
    /// nothing is copied. Taken here or queued as [`QueueHandle::submit_slice`].
    pub(crate) async fn submit_region(
        &self,
        sqe: Sqe,
        region: RegionIo,
    ) -> Result<Response, HostError> {
        self.submit_direct(sqe, None, 0, Some(region)).await
    }

    /// Allocate and register an [`IoBuffer`] of `chunks` chunks of `chunk` bytes (at most
    /// the queue's transfer size) with this queue.
    pub fn register_buffer(&self, chunk: usize, chunks: usize) -> Result<IoBuffer, HostError> {
        let (id, mem, pad) = self.core.register(chunk, chunks)?;
        Ok(IoBuffer {
            queue: self.clone(),
            id,
            mem,
            pad,
            chunk,
            chunks,
        })
    }

    /// Is `other` a handle of this very queue?
    pub fn same(&self, other: &QueueHandle) -> bool {
        Arc::ptr_eq(&self.task, &other.task)
    }

    async fn submit_direct(
        &self,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
    ) -> Result<Response, HostError> {
        let opcode = sqe.opcode;
        let (reply, rx) = oneshot::channel();
        let reply =
            self.core
                .try_submit(&self.tx, &self.clock, sqe, data_out, data_in, region, reply);
        match reply {
            // The task re-arms its I/O timeout for the new command.
            None => self.task.notify_one(),
            Some(reply) => {
                if let Some(d) = data_out {
                    // The queued request carries a copy of the data.
                    self.core.recycle(Vec::new(), false, d.len());
                }
                self.tx
                    .send(Request {
                        sqe,
                        data_out: data_out.map(<[u8]>::to_vec),
                        data_in,
                        region,
                        reply,
                        audit_apart: crate::harness::alloc_audit::in_platform(),
                    })
                    .await
                    .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))?
            }
        }
        self.finish(opcode, rx).await
    }

    async fn finish(
        &self,
        opcode: u8,
        rx: oneshot::Receiver<Result<Response, HostError>>,
    ) -> Result<Response, HostError> {
        let r = rx
            .await
            .map_err(|_| HostError::Gone(format!("queue {} stopped", self.qid)))??;
        let st = r.cqe.nvme_status();
        if st.is_success() {
            Ok(r)
        } else {
            Err(HostError::from_status(st, opcode))
        }
    }
}

/// Start a queue's task over `core`. The task lives as long as the controller: across
/// recoveries it only changes which CQ it polls.
pub fn spawn<D: DeviceContext>(
    core: QueueCore<D>,
    clock: Clock,
) -> (QueueHandle, QueueCtl<D>, tokio::task::JoinHandle<()>) {
    let spec = core.spec;
    let (tx, rx) = mpsc::channel(spec.size);
    let core = Arc::new(Mutex::new(core));
    let ctl = QueueCtl {
        core: core.clone(),
        task: Arc::new(Notify::new()),
        control_done: Arc::new(Notify::new()),
        clock,
    };
    let handle = QueueHandle {
        tx,
        qid: spec.qid,
        spec,
        core,
        task: ctl.task.clone(),
        clock,
    };
    let jh = tokio::spawn(run(ctl.clone(), rx));
    (handle, ctl, jh)
}

async fn run<D: DeviceContext>(ctl: QueueCtl<D>, mut rx: mpsc::Receiver<Request>) {
    let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
    let mut open = true;
    // A request taken from the channel after callers filled the last free slot directly
    // (`QueueHandle::submit_slice`): it goes first once a slot is free.
    let mut stash: Option<Request> = None;
    // One timer for the life of the task, moved only earlier (see `EarliestTimer`): an
    // early fire finds nothing expired and is armed again.
    let timer = EarliestTimer::new();
    tokio::pin!(timer);
    loop {
        // Completions were handed to their callers this iteration.
        let mut reaped = false;
        let (cq, accepting, next_timeout, closed) = {
            let mut c = ctl.lock();
            if c.accepting() {
                if let Some(r) = stash.take() {
                    c.backlog = false;
                    let now = ctl.now();
                    c.submit(now, r);
                    c.flush_posts();
                }
            }
            (
                c.cq(),
                c.accepting() && stash.is_none(),
                c.next_timeout(),
                matches!(c.phase, Phase::Closed(_)),
            )
        };
        if closed && !open {
            break;
        }
        if let Some(t) = next_timeout {
            let at = tokio::time::Instant::now() + t.saturating_since(ctl.now());
            timer.as_mut().arm(at);
        }
        wcs.clear();
        // Biased, so that a simulated run replays (tokio's unbiased choice is random), with
        // the timer first: a deadline is ready once, and a queue whose completions never
        // stop must still see the commands that stopped.
        tokio::select! {
            biased;
            _ = &mut timer => {
                ctl.lock().check_timeouts(ctl.now());
            }
            req = rx.recv(), if open && accepting => match req {
                Some(r) => {
                    let mut c = ctl.lock();
                    let now = ctl.now();
                    if !c.accepting() {
                        // Direct submissions took the slots since the loop looked.
                        c.backlog = true;
                        stash = Some(r);
                    } else {
                        c.submit(now, r);
                    }
                    while c.accepting() && stash.is_none() {
                        match rx.try_recv() {
                            Ok(r) => c.submit(now, r),
                            Err(_) => break,
                        }
                    }
                }
                None => {
                    open = false;
                    // Every handle is gone: nobody waits for the held requests.
                    if ctl.lock().idle() {
                        break;
                    }
                }
            },
            _ = ctl.task.notified() => {}
            n = async {
                match &cq {
                    Some((dev, cq)) => dev.wait_cq(*cq, 256, &mut wcs).await,
                    None => std::future::pending().await,
                }
            } => {
                let mut c = ctl.lock();
                // The controller may have swapped the verbs while we waited: what came from
                // an old CQ belongs to a connection that is already gone.
                let current = match (&cq, c.cq_any()) {
                    (Some((h0, q0)), Some((h1, q1))) => h0.same(&h1) && *q0 == q1,
                    _ => false,
                };
                if current {
                    if n == 0 {
                        c.on_device_gone();
                    } else {
                        c.heard(ctl.now());
                        for wc in &wcs {
                            c.on_wc(wc);
                        }
                        reaped = true;
                    }
                }
            }
        }
        {
            let mut c = ctl.lock();
            c.flush_posts();
            if c.take_control_fresh() {
                // Every enabled waiter: the controller's keep-alive watch and a bring-up
                // command can both be registered; a single permit could go to the wrong one.
                ctl.control_done.notify_waiters();
            }
        }
        if reaped {
            // The callers first: on a runtime of one thread they run only once this task
            // is pending, and what the loop does next (its timer, its waiters made again,
            // a look at the CQ) would stand between a completion and its caller. The
            // runtime keeps yielded tasks in a list of its own that grows (once, amortized)
            // the first time more tasks yield in one tick than before: the runtime's
            // bookkeeping, counted with the platform's by the allocation audit.
            crate::harness::alloc_audit::Platform::new(tokio::task::yield_now()).await;
        }
    }
}
