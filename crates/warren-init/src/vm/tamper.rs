//! A VM's tamper watch: the guest's own fanotify group on the current
//! phase's protected paths, so that a process kept running from an earlier
//! phase (`kill_running: false`) is held to the current phase's `none` and
//! `read` paths as in a container, where the node's watch does this (see
//! `warren_guard::tamper` for why Landlock alone does not).
//!
//! One thread owns the group. It is started before PID 1 takes on the
//! seccomp profile, which refuses `fanotify_*` to everything in the
//! sandbox (as the seccomp supervisor is), so it is the one place in the
//! guest that can mark inodes; the connection that switches a phase asks it
//! to and waits until the marks are placed, so the switch answers only once
//! the new rules are watched.
//!
//! It answers every event: an access by init itself (the file API, the
//! pack of the writable layer) passes, as the node's own accesses do for a
//! container; any other is judged by the current phase's level for the
//! file's path, and a refusal is answered first, then recorded as a
//! `tamper` event in PID 1's event log.
//! Never: holds an event while it waits for anything but `/proc` reads of
//! the held thread.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::event::{eventfd, EventfdFlags, PollFd, PollFlags};
use rustix::fs::{Mode, OFlags};
use warren_guard::fanotify::{Group, PermissionEvent};
use warren_guard::landlock::Level;
use warren_guard::tamper::{self as marks, Marked, Protected};
use warren_init::proto::{PathAccess, PhaseRules, SecurityEvent, SecurityEventKind};

use crate::events::EventLog;

/// The watch thread's stack: it walks trees and formats a few strings.
const WATCH_STACK_BYTES: usize = 256 * 1024;

/// A phase's rules, to be watched; the sender learns when they are.
struct Protect {
    phase: String,
    rules: Vec<Protected>,
    done: SyncSender<()>,
}

/// The handle PID 1's connections use (cheap to clone).
#[derive(Clone)]
pub struct TamperWatch {
    requests: SyncSender<Protect>,
    wake: Arc<OwnedFd>,
}

impl TamperWatch {
    /// Starts the watch thread with its group, or `None` when the guest
    /// cannot make one (the thread reports why on the console). Must run
    /// before the seccomp profile is installed on this process.
    pub fn start(events: Arc<EventLog>) -> Option<TamperWatch> {
        let group = match Group::new() {
            Ok(group) => group,
            Err(e) => {
                eprintln!("warren-init: no tamper watch (fanotify: {e})");
                return None;
            }
        };
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).ok()?);
        let root = rustix::fs::open("/", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).ok()?;
        let (requests, inbox) = mpsc::sync_channel(4);
        let own_pid = std::process::id() as i32;
        let watcher =
            Watcher { group, root, events, own_pid, phase: String::new(), rules: Vec::new(), marked: Vec::new() };
        let woken = Arc::clone(&wake);
        std::thread::Builder::new()
            .name("tamper".into())
            .stack_size(WATCH_STACK_BYTES)
            .spawn(move || watcher.run(&woken, &inbox))
            .ok()?;
        Some(TamperWatch { requests, wake })
    }

    /// Makes `rules` what the watch holds processes to, and returns once
    /// their marks are placed (at once if the watch thread is gone).
    pub fn protect(&self, rules: &PhaseRules) {
        let (done, placed) = mpsc::sync_channel(1);
        let protected = rules
            .protected_paths
            .iter()
            .map(|(path, access)| Protected { path: path.clone(), level: level(*access) })
            .collect();
        let request = Protect { phase: rules.name.clone(), rules: protected, done };
        if self.requests.send(request).is_err() {
            return;
        }
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        let _ = placed.recv();
    }
}

fn level(access: PathAccess) -> Level {
    match access {
        PathAccess::None => Level::None,
        PathAccess::Read => Level::Read,
        PathAccess::ReadWrite => Level::ReadWrite,
    }
}

/// The watch thread's state.
struct Watcher {
    group: Group,
    /// The guest's root, where the marks are found again to drop them.
    root: OwnedFd,
    events: Arc<EventLog>,
    /// PID 1 of a microVM; the agent service's pid in a full VM.
    own_pid: i32,
    phase: String,
    rules: Vec<Protected>,
    marked: Vec<Marked>,
}

impl Watcher {
    fn run(mut self, wake: &OwnedFd, inbox: &Receiver<Protect>) {
        loop {
            let mut fds = [PollFd::new(&self.group, PollFlags::IN), PollFd::new(wake, PollFlags::IN)];
            match rustix::event::poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    eprintln!("warren-init: the tamper watch stops: {e}");
                    return;
                }
            }
            let mut counter = [0u8; 8];
            let _ = rustix::io::read(wake, &mut counter);
            while let Ok(request) = inbox.try_recv() {
                self.protect(request);
            }
            match self.group.read() {
                Ok(events) => events.into_iter().for_each(|e| self.judge(e)),
                Err(e) => {
                    eprintln!("warren-init: the tamper watch stops: {e}");
                    return;
                }
            }
        }
    }

    fn protect(&mut self, request: Protect) {
        let walked = marks::walk(self.root.as_fd(), &request.rules);
        if walked.truncated {
            eprintln!("warren-init: tamper watch: more than {} directories; the rest is unmarked", marks::MAX_MARKS);
        }
        let (marked, failed) = marks::place(&self.group, walked);
        if let Some(e) = failed.first() {
            eprintln!("warren-init: tamper watch: {} inodes not marked ({e})", failed.len());
        }
        marks::drop_stale(&self.group, self.root.as_fd(), &self.marked, &marked);
        (self.phase, self.rules, self.marked) = (request.phase, request.rules, marked);
        let _ = request.done.send(());
    }

    /// Answers one event, and records it when it is a refusal.
    fn judge(&self, event: PermissionEvent<'_>) {
        match self.refusal(&event) {
            None => {
                let _ = event.answer(true);
            }
            Some(refusal) => {
                let _ = event.answer(false);
                self.events.record(refusal);
            }
        }
    }

    fn refusal(&self, event: &PermissionEvent<'_>) -> Option<SecurityEvent> {
        let tid = event.tid;
        let tgid = std::fs::read_to_string(format!("/proc/{tid}/status")).ok().and_then(|s| marks::inner_tgid(&s));
        if tgid == Some(self.own_pid) {
            // This process: the platform's own code (the file API, the pack).
            return None;
        }
        let refused = marks::judge(event, &self.rules, &self.phase, "")?;
        let comm = std::fs::read_to_string(format!("/proc/{tid}/comm")).unwrap_or_default().trim_end().to_string();
        let time_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Some(SecurityEvent {
            seq: 0,
            time_ms,
            pid: tgid.unwrap_or(tid),
            comm,
            kind: SecurityEventKind::Tamper,
            syscall: refused.syscall.to_string(),
            detail: refused.detail,
        })
    }
}
