//! One exec as the node sees it: a durable id, bounded captures of both
//! streams, the deadline the node enforces, and readers that can join (or
//! re-join from an offset) at any time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use futures_util::Stream;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;
use warren_api::{ExecFrame, ExecOutput, ExecResult, ExecStatus, StreamName};
use warren_backend::{ExecControl, ExecEvent, ExecProcess, ExitInfo};

use crate::capture::{Capture, Chunk};
use crate::now_ms;

/// How long a killed tree may take to report its exit before the node gives up on it.
const KILL_GRACE: Duration = Duration::from_secs(10);

pub struct ExecEntry {
    pub id: String,
    pub session_id: Option<String>,
    started_at_ms: u64,
    started: Instant,
    state: Mutex<ExecState>,
    /// Bumped on every change; readers wait on it.
    version: watch::Sender<u64>,
    kill: Notify,
    kill_requested: AtomicBool,
    /// The running process's control channel while its stdin is open (an
    /// exec started with `stdin_open`); `None` once closed or ended.
    input: Mutex<Option<mpsc::Sender<ExecControl>>>,
    /// Runs once when the process has ended, before the result is
    /// published: whatever a client may rely on once it has seen the end
    /// (a session's new state) is stored by then.
    before_end: Mutex<Option<BeforeEnd>>,
}

/// See [`ExecEntry::before_end`]; gets the exit information when the
/// process exited (not when the channel to it was lost).
pub type BeforeEnd = Box<dyn FnOnce(Option<&ExitInfo>) + Send>;

/// Why stdin could not be written or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinError {
    /// The exec was started without an open stdin, closed it, or ended.
    Closed,
}

struct ExecState {
    stdout: Capture,
    stderr: Capture,
    result: Option<ExecResult>,
}

/// How an exec ended, before it is turned into an [`ExecResult`].
pub struct Finish {
    pub status: ExecStatus,
    pub exit: Option<ExitInfo>,
}

impl ExecEntry {
    pub fn new(id: String, session_id: Option<String>, output_cap: u64) -> Arc<Self> {
        Arc::new(ExecEntry {
            id,
            session_id,
            started_at_ms: now_ms(),
            started: Instant::now(),
            state: Mutex::new(ExecState {
                stdout: Capture::new(output_cap),
                stderr: Capture::new(output_cap),
                result: None,
            }),
            version: watch::channel(0).0,
            kill: Notify::new(),
            kill_requested: AtomicBool::new(false),
            input: Mutex::new(None),
            before_end: Mutex::new(None),
        })
    }

    /// Sets the hook run when the process ends, before its end is published.
    pub fn before_end(&self, hook: BeforeEnd) {
        *self.before_end.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// Runs the [`ExecEntry::before_end`] hook (once), then publishes the end.
    fn end(&self, finish: Finish) {
        let hook = self.before_end.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(hook) = hook {
            hook(finish.exit.as_ref());
        }
        self.finish(finish);
    }

    fn lock(&self) -> MutexGuard<'_, ExecState> {
        // A poisoned capture is still a valid capture: every mutation is a single append.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub fn is_finished(&self) -> bool {
        self.lock().result.is_some()
    }

    /// Returns once the exec has ended (its result is published). Cheaper
    /// than draining [`ExecEntry::stream`] for a caller that wants only the
    /// end: no task, no channel.
    pub async fn ended(&self) {
        // Subscribed before the check: a bump in between still wakes us.
        let mut version = self.version.subscribe();
        while !self.is_finished() {
            if version.changed().await.is_err() {
                return;
            }
        }
    }

    /// Asks the driving task to kill the process tree; the exec ends `killed`.
    pub fn request_kill(&self) {
        self.kill_requested.store(true, Ordering::SeqCst);
        self.kill.notify_one();
    }

    fn input(&self) -> MutexGuard<'_, Option<mpsc::Sender<ExecControl>>> {
        self.input.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `data` to the process's stdin, in order with earlier writes.
    pub async fn send_stdin(&self, data: bytes::Bytes) -> Result<(), StdinError> {
        let tx = self.input().clone().ok_or(StdinError::Closed)?;
        tx.send(ExecControl::Stdin(data)).await.map_err(|_| StdinError::Closed)
    }

    /// Closes the process's stdin (it reads end-of-file).
    pub async fn close_stdin(&self) -> Result<(), StdinError> {
        let tx = self.input().take().ok_or(StdinError::Closed)?;
        tx.send(ExecControl::StdinEof).await.map_err(|_| StdinError::Closed)
    }

    fn append(&self, stream: StreamName, data: &[u8]) {
        {
            let mut st = self.lock();
            match stream {
                StreamName::Stdout => st.stdout.append(data),
                StreamName::Stderr => st.stderr.append(data),
            }
        }
        self.bump();
    }

    /// The result so far: `running` until the exec ends.
    pub fn result(&self, with_output: bool) -> ExecResult {
        let st = self.lock();
        let mut r = st.result.clone().unwrap_or_else(|| ExecResult {
            exec_id: self.id.clone(),
            status: ExecStatus::Running,
            exit_code: None,
            signal: None,
            wall_time_secs: self.started.elapsed().as_secs_f64(),
            cpu_time_secs: 0.0,
            peak_memory_bytes: 0,
            started_at_ms: self.started_at_ms,
            ended_at_ms: None,
            session_id: self.session_id.clone(),
            output: None,
            output_expired: false,
        });
        if with_output {
            r.output = Some(ExecOutput { stdout: st.stdout.to_output(), stderr: st.stderr.to_output() });
        }
        r
    }

    fn finish(&self, finish: Finish) {
        {
            let mut st = self.lock();
            if st.result.is_some() {
                return;
            }
            let exit = finish.exit.as_ref();
            st.result = Some(ExecResult {
                exec_id: self.id.clone(),
                status: finish.status,
                exit_code: exit.and_then(|e| e.exit_code),
                signal: exit.and_then(|e| e.signal),
                wall_time_secs: self.started.elapsed().as_secs_f64(),
                cpu_time_secs: exit.map(|e| e.cpu_time.as_secs_f64()).unwrap_or(0.0),
                peak_memory_bytes: exit.map(|e| e.peak_memory_bytes).unwrap_or(0),
                started_at_ms: self.started_at_ms,
                ended_at_ms: Some(now_ms()),
                session_id: self.session_id.clone(),
                output: None,
                output_expired: false,
            });
        }
        self.bump();
    }

    /// Frames a reader at the given offsets has not seen yet; the `End` frame
    /// comes last, once the exec has ended and everything before it was read.
    fn frames_from(&self, offsets: &mut [u64; 2]) -> (Vec<ExecFrame>, bool) {
        let st = self.lock();
        let mut frames = Vec::new();
        push_frames(StreamName::Stdout, &st.stdout, &mut offsets[0], &mut frames);
        push_frames(StreamName::Stderr, &st.stderr, &mut offsets[1], &mut frames);
        let done = match &st.result {
            Some(r) => {
                frames.push(ExecFrame::End { result: Box::new(r.clone()) });
                true
            }
            None => false,
        };
        (frames, done)
    }

    /// A live stream of frames from the given offsets to the end. Dropping the
    /// stream (a client disconnecting) does not touch the exec.
    pub fn stream(
        self: &Arc<Self>,
        stdout_offset: u64,
        stderr_offset: u64,
        first: Option<ExecFrame>,
    ) -> impl Stream<Item = ExecFrame> + Send + 'static {
        let (tx, rx) = mpsc::channel::<ExecFrame>(32);
        let entry = Arc::clone(self);
        tokio::spawn(async move {
            if let Some(f) = first {
                if tx.send(f).await.is_err() {
                    return;
                }
            }
            let mut version = entry.version.subscribe();
            let mut offsets = [stdout_offset, stderr_offset];
            loop {
                version.borrow_and_update();
                let (frames, done) = entry.frames_from(&mut offsets);
                for f in frames {
                    if tx.send(f).await.is_err() {
                        return;
                    }
                }
                if done || version.changed().await.is_err() {
                    return;
                }
            }
        });
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) })
    }

    /// Pumps a started process until it ends, enforcing `deadline`. Returns
    /// the final exit information (for session state) once the result is set.
    /// With `stdin_open`, stdin stays open after `stdin` for
    /// [`ExecEntry::send_stdin`] until [`ExecEntry::close_stdin`].
    pub async fn drive(
        self: Arc<Self>,
        process: ExecProcess,
        stdin: Option<Vec<u8>>,
        stdin_open: bool,
        deadline: Instant,
    ) -> Option<ExitInfo> {
        if let Some(data) = stdin {
            if !data.is_empty() {
                let _ = process.control.send(ExecControl::Stdin(data.into())).await;
            }
        }
        if !stdin_open {
            let _ = process.control.send(ExecControl::StdinEof).await;
        }
        self.drive_fed(process, stdin_open, deadline).await
    }

    /// [`ExecEntry::drive`] for a process whose stdin was handed over with
    /// its start (`Driver::exec_fed`): only an open stdin is left to serve.
    pub async fn drive_fed(
        self: Arc<Self>,
        process: ExecProcess,
        stdin_open: bool,
        deadline: Instant,
    ) -> Option<ExitInfo> {
        if stdin_open {
            *self.input() = Some(process.control.clone());
        }
        let exit = Arc::clone(&self).pump(process, deadline).await;
        // The clone would otherwise keep the control channel (and so the
        // backend's side of the exec) alive after the process ended.
        self.input().take();
        exit
    }

    async fn pump(self: Arc<Self>, mut process: ExecProcess, deadline: Instant) -> Option<ExitInfo> {
        let mut timed_out = false;
        let mut kill_deadline: Option<Instant> = None;
        loop {
            let grace = async {
                match kill_deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = process.events.recv() => match ev {
                    Some(ExecEvent::Started { .. }) => {}
                    Some(ExecEvent::Stdout(b)) => self.append(StreamName::Stdout, &b),
                    Some(ExecEvent::Stderr(b)) => self.append(StreamName::Stderr, &b),
                    Some(ExecEvent::Exited(info)) => {
                        let status = if timed_out {
                            ExecStatus::TimedOut
                        } else if info.oom {
                            ExecStatus::Oom
                        } else if info.killed || self.kill_requested.load(Ordering::SeqCst) {
                            ExecStatus::Killed
                        } else {
                            ExecStatus::Ok
                        };
                        self.end(Finish { status, exit: Some(info.clone()) });
                        return Some(info);
                    }
                    lost => {
                        if let Some(ExecEvent::Lost(msg)) = lost {
                            tracing::warn!(exec = %self.id, "exec channel lost: {msg}");
                        }
                        let status = if timed_out { ExecStatus::TimedOut } else { ExecStatus::Killed };
                        self.end(Finish { status, exit: None });
                        return None;
                    }
                },
                _ = tokio::time::sleep_until(deadline), if !timed_out && kill_deadline.is_none() => {
                    timed_out = true;
                    kill_deadline = Some(Instant::now() + KILL_GRACE);
                    let _ = process.control.send(ExecControl::Kill).await;
                }
                _ = self.kill.notified(), if kill_deadline.is_none() => {
                    kill_deadline = Some(Instant::now() + KILL_GRACE);
                    let _ = process.control.send(ExecControl::Kill).await;
                }
                _ = grace => {
                    let status = if timed_out { ExecStatus::TimedOut } else { ExecStatus::Killed };
                    self.end(Finish { status, exit: None });
                    return None;
                }
            }
        }
    }

    /// Ends an exec that never reached a process (or was lost across a restart).
    pub fn finish_without_process(&self, status: ExecStatus) {
        self.finish(Finish { status, exit: None });
    }
}

/// Appends the frames of `capture` from `*offset` on, and moves `*offset` past them.
pub(crate) fn push_frames(name: StreamName, capture: &Capture, offset: &mut u64, frames: &mut Vec<ExecFrame>) {
    for chunk in capture.read_from(*offset) {
        match chunk {
            Chunk::Data { offset: at, bytes } => {
                *offset = at + bytes.len() as u64;
                frames.push(ExecFrame::Output {
                    stream: name,
                    offset: at,
                    data_b64: base64::engine::general_purpose::STANDARD.encode(&bytes),
                });
            }
            Chunk::Gap { offset: at, len } => {
                *offset = at + len;
                frames.push(ExecFrame::Gap { stream: name, offset: at, dropped_bytes: len });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn exited() -> ExecEvent {
        ExecEvent::Exited(ExitInfo {
            exit_code: Some(0),
            signal: None,
            killed: false,
            oom: false,
            cpu_time: Duration::ZERO,
            peak_memory_bytes: 0,
            session_state: None,
        })
    }

    /// A process the test plays: what the exec sends it, and its events.
    fn fake() -> (ExecProcess, mpsc::Receiver<ExecControl>, mpsc::Sender<ExecEvent>) {
        let (control, control_rx) = mpsc::channel(8);
        let (events_tx, events) = mpsc::channel(8);
        (ExecProcess { events, control }, control_rx, events_tx)
    }

    #[tokio::test]
    async fn open_stdin_forwards_writes_in_order_then_closes() {
        let (process, mut control, events) = fake();
        let entry = ExecEntry::new("ex-1".into(), None, 1024);
        let driving = tokio::spawn(Arc::clone(&entry).drive(
            process,
            Some(b"first ".to_vec()),
            true,
            Instant::now() + Duration::from_secs(60),
        ));
        assert!(matches!(control.recv().await, Some(ExecControl::Stdin(b)) if &b[..] == b"first "));
        // The driving task hands out the channel once it runs; wait for it.
        while entry.input().is_none() {
            tokio::task::yield_now().await;
        }
        entry.send_stdin(Bytes::from_static(b"second")).await.unwrap();
        assert!(matches!(control.recv().await, Some(ExecControl::Stdin(b)) if &b[..] == b"second"));
        entry.close_stdin().await.unwrap();
        assert!(matches!(control.recv().await, Some(ExecControl::StdinEof)));
        assert_eq!(entry.send_stdin(Bytes::from_static(b"late")).await, Err(StdinError::Closed));
        assert_eq!(entry.close_stdin().await, Err(StdinError::Closed));
        events.send(exited()).await.unwrap();
        driving.await.unwrap();
        assert_eq!(entry.result(false).status, ExecStatus::Ok);
    }

    #[tokio::test]
    async fn closed_stdin_is_closed_at_once_and_after_the_end() {
        let (process, mut control, events) = fake();
        let entry = ExecEntry::new("ex-2".into(), None, 1024);
        let driving =
            tokio::spawn(Arc::clone(&entry).drive(process, None, false, Instant::now() + Duration::from_secs(60)));
        assert!(matches!(control.recv().await, Some(ExecControl::StdinEof)));
        assert_eq!(entry.send_stdin(Bytes::from_static(b"x")).await, Err(StdinError::Closed));
        events.send(exited()).await.unwrap();
        driving.await.unwrap();
        assert!(entry.input().is_none());
    }
}
