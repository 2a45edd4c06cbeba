//! The last step of setup: PID 1 takes on the sandbox's seccomp profile
//! (`warren_guard::seccomp`), so every process it ever starts inherits it,
//! and supervises the calls the profile refuses: each becomes a security
//! event before the caller gets its `EPERM`.
//!
//! Why in PID 1 and not in each child before `exec`: one filter and one
//! listener for the sandbox's whole life, nothing per exec, and no window
//! in which a process of the sandbox runs without it. PID 1's own calls
//! after setup (accept, poll, fork without namespace flags, pthread_create
//! whose `clone3` gets ENOSYS and falls back to `clone`, wait, kill) and its
//! phase leaders' (the `landlock_*` calls, `clone(CLONE_PARENT)`, exec) are
//! all on the profile's allowlist; `tests/seccomp.rs` and every sandbox
//! test would show a refusal of one as an event or a failed start.
//!
//! The supervisor thread is started *before* the filter is installed, so
//! it is the one thread of the sandbox that never runs under it: a
//! supervisor whose own refused call waited for itself would hang. If it
//! ever stops, its end of the listener closes and the kernel fails every
//! later refused call with `ENOSYS`: still refused, only unrecorded.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use warren_guard::seccomp::{self as profile, Delivery, SANDBOX_PROFILE};
use warren_init::proto::{SecurityEvent, SecurityEventKind};

use crate::error::{InitError, StepContext};
use crate::events::EventLog;
use crate::sys;

/// The supervisor's stack: it formats a few strings per event.
const SUPERVISOR_STACK_BYTES: usize = 128 * 1024;

/// The profile compiled, once per process: the init zygote compiles it
/// before its first fork ([`precompile`]), so the first init of every
/// container sandbox inherits it instead of compiling it again (a tenth of
/// a millisecond of every create).
static PROGRAM: OnceLock<profile::BpfProgram> = OnceLock::new();

fn program() -> Result<&'static profile::BpfProgram, InitError> {
    if let Some(program) = PROGRAM.get() {
        return Ok(program);
    }
    let compiled = profile::compile(&SANDBOX_PROFILE, Delivery::Notify)?;
    Ok(PROGRAM.get_or_init(|| compiled))
}

/// Compiles the profile now, for the processes this one forks. A failure
/// is left for each sandbox's own [`start`] to report.
pub fn precompile() {
    let _ = program();
}

/// Applies the profile to the calling thread (PID 1's only one) and
/// starts its supervisor. Returns where the events go.
pub fn start(events: &Arc<EventLog>) -> Result<(), InitError> {
    let program = program()?;
    let (hand_over, listener_rx) = mpsc::sync_channel::<OwnedFd>(1);
    let log = Arc::clone(events);
    std::thread::Builder::new()
        .name("seccomp".into())
        .stack_size(SUPERVISOR_STACK_BYTES)
        // Without a listener (installation failed), the thread just ends.
        .spawn(move || {
            if let Ok(listener) = listener_rx.recv() {
                supervise(&listener, &log)
            }
        })
        .step(|| "step 4: start the seccomp supervisor".into())?;
    let listener = sys::install_seccomp_listener(program).step(|| "step 4: seccomp(SET_MODE_FILTER)".into())?;
    hand_over.send(listener).map_err(|_| InitError::Refused("step 4: the seccomp supervisor is gone".into()))?;
    Ok(())
}

/// Records and answers refused calls until the listener breaks.
fn supervise(listener: &OwnedFd, events: &EventLog) {
    loop {
        let notif = match sys::seccomp_receive(listener.as_fd()) {
            Ok(notif) => notif,
            // ENOENT: the caller died or was interrupted before we took it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::ENOENT)) => continue,
            Err(_) => return,
        };
        answer(listener.as_fd(), &notif, events);
    }
}

/// Records one refused call, then fails it: by the time the caller sees
/// its error, the event is there for the host to read.
fn answer(listener: BorrowedFd<'_>, notif: &libc::seccomp_notif, events: &EventLog) {
    let denial = profile::describe(&SANDBOX_PROFILE, notif.data.nr, notif.data.arch, &notif.data.args);
    let tid = notif.pid as i32;
    let caller = Caller::look_up(tid);
    // The pid may have been reused if the caller died meanwhile; only a
    // still-waiting notification proves /proc described the caller.
    let caller = if sys::seccomp_still_waiting(listener, notif.id) { caller } else { Caller::gone(tid) };
    events.record(SecurityEvent {
        seq: 0,
        time_ms: now_ms(),
        pid: caller.pid,
        comm: caller.comm,
        kind: SecurityEventKind::Seccomp,
        syscall: denial.syscall,
        detail: denial.detail,
    });
    // ENOENT: the caller is gone; nobody is left to answer.
    let _ = sys::seccomp_fail(listener, notif.id, denial.errno);
}

/// The process a refused call came from.
struct Caller {
    pid: i32,
    comm: String,
}

impl Caller {
    /// From `/proc/<tid>/status` (the sandbox's own /proc: pids as seen
    /// inside): the thread group id and the command name.
    fn look_up(tid: i32) -> Caller {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
            return Caller::gone(tid);
        };
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        Caller {
            pid: field("Tgid:").and_then(|v| v.parse().ok()).unwrap_or(tid),
            comm: field("Name:").unwrap_or_default().to_string(),
        }
    }

    fn gone(tid: i32) -> Caller {
        Caller { pid: tid, comm: String::new() }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
