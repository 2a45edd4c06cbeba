//! The tamper watch: fanotify permission events on protected paths, for
//! container sandboxes.
//!
//! Why a watch beside Landlock, and what it marks and refuses: see
//! `warren_guard::tamper`, which this watch and a microVM's init share.
//!
//! One fanotify group per node (made when the first sandbox needs it).
//! For each live container sandbox whose current phase has paths at `none`
//! or `read`, the protected path and every directory below it carry an
//! inode mark: at `none`, opens, exec opens and reads (`FAN_ACCESS_PERM`)
//! of the files; at `read`, opens, of which those for writing (or with
//! `O_TRUNC`) are refused: the event does not carry the opener's flags, so
//! the watch reads them from the held thread's `/proc/TID/syscall` (an
//! open it cannot decode counts as a write).
//!
//! The thread that answers looks up the accessing thread's sandbox by its
//! cgroup; an access from any other process (the node's own file API, the
//! host) is allowed silently. A refusal is answered first and recorded as a
//! `tamper` event through a queue, so no answer waits for the store.
//! Invariant: every event is answered (the guard's [`PermissionEvent`]
//! allows on drop), and stopping closes the group, which lets every queued
//! access through.
//! Never: marks anything for a sandbox without protected paths, or keeps
//! the marks (and the root descriptor) of a sandbox past its end: they are
//! dropped before the driver unmounts its root.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use tokio::sync::mpsc;
use warren_api::{AccessLevel, Backend, SecurityEventKind};
use warren_guard::fanotify::{Group, PermissionEvent, ALL_PERM_EVENTS};
use warren_guard::landlock::Level;
use warren_guard::tamper::{self as marks, Marked, Protected, MAX_MARKS};

use crate::events::Observed;
use crate::landlock_audit::sandbox_in_cgroups;
use crate::{Inner, Node};

/// How long the answering thread waits for events between stop checks.
const WAIT_TICK_MS: i32 = 100;
/// Refusals waiting to be recorded; beyond it they are dropped (and logged).
const EVENT_QUEUE: usize = 1024;

/// A refusal on its way to the sandbox's timeline.
type Refusal = (String, Observed);

struct SandboxMarks {
    phase: String,
    rules: Vec<Protected>,
    marked: Vec<Marked>,
    /// The sandbox's root (as the file API opens it), to find the marked
    /// inodes again; dropped, like every mark, before the sandbox's root
    /// is unmounted.
    root: OwnedFd,
    /// The sandbox root as the host names it, cut off the paths the kernel
    /// reports for an event when they start with it.
    host_root: String,
}

struct Running {
    group: Arc<Group>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The node's tamper watch (see the module doc).
pub(crate) struct TamperWatch {
    instance: String,
    marks: Arc<Mutex<HashMap<String, SandboxMarks>>>,
    running: Mutex<Option<Running>>,
    /// Set once the watch is stopped: no group is made again.
    stopped: AtomicBool,
    refusals: mpsc::Sender<Refusal>,
}

impl TamperWatch {
    /// A watch with no group yet; the receiver gets its refusals (see
    /// [`record_refusals`]).
    pub(crate) fn new(instance: String) -> (TamperWatch, mpsc::Receiver<Refusal>) {
        let (refusals, rx) = mpsc::channel(EVENT_QUEUE);
        let watch = TamperWatch {
            instance,
            marks: Arc::default(),
            running: Mutex::new(None),
            stopped: AtomicBool::new(false),
            refusals,
        };
        (watch, rx)
    }

    fn marks(&self) -> MutexGuard<'_, HashMap<String, SandboxMarks>> {
        lock(&self.marks)
    }

    /// Makes `rules` (phase `phase`) what guards sandbox `id`: marks the
    /// paths at `none` and `read` below `root` (the sandbox's root as the
    /// file API opens it) and drops the marks the previous rules needed and
    /// these do not. Blocking (walks the protected trees).
    fn protect(&self, id: &str, phase: &str, rules: Vec<Protected>, root: OwnedFd) {
        if !marks::needs_marks(&rules) {
            self.forget(id);
            return;
        }
        // Walked with no lock held: the answering thread must never wait
        // for a walk (and directories are marked without FAN_ONDIR, so
        // opening them for the walk is no event anyway).
        let walked = marks::walk(root.as_fd(), &rules);
        if walked.truncated {
            tracing::warn!(sandbox = %id, "tamper watch: more than {MAX_MARKS} directories; the rest is unmarked");
        }
        let Some(group) = self.group() else { return };
        let host_root = std::fs::read_link(format!("/proc/self/fd/{}", root.as_raw_fd()))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut all = self.marks();
        let (marked, failed) = marks::place(&group, walked);
        for e in &failed {
            tracing::warn!(sandbox = %id, "tamper watch: cannot mark an inode: {e}");
        }
        let placed = marked.len() - failed.len();
        if let Some(old) = all.remove(id) {
            marks::drop_stale(&group, old.root.as_fd(), &old.marked, &marked);
        }
        tracing::info!(sandbox = %id, phase, marks = placed, "tamper watch: protected paths marked");
        let entry = SandboxMarks { phase: phase.to_string(), rules, marked, root, host_root };
        all.insert(id.to_string(), entry);
    }

    /// Drops every mark of sandbox `id` (it ended, or its phase protects
    /// nothing).
    pub(crate) fn forget(&self, id: &str) {
        let Some(old) = self.marks().remove(id) else { return };
        if let Some(group) = lock(&self.running).as_ref().map(|r| Arc::clone(&r.group)) {
            for m in &old.marked {
                marks::unmark(&group, old.root.as_fd(), m, ALL_PERM_EVENTS);
            }
        }
        tracing::info!(sandbox = %id, "tamper watch: marks removed");
    }

    /// The group, made (with its answering thread) on first use.
    fn group(&self) -> Option<Arc<Group>> {
        let mut running = lock(&self.running);
        if let Some(r) = running.as_ref() {
            return Some(Arc::clone(&r.group));
        }
        if self.stopped.load(Ordering::SeqCst) {
            return None;
        }
        let group = match Group::new() {
            Ok(g) => Arc::new(g),
            Err(e) => {
                tracing::warn!("tamper watch off: cannot make a fanotify group ({e})");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let answerer = Answerer {
            group: Arc::clone(&group),
            instance: self.instance.clone(),
            marks: Arc::clone(&self.marks),
            refusals: self.refusals.clone(),
        };
        let flag = Arc::clone(&stop);
        let thread = match std::thread::Builder::new().name("tamper-watch".into()).spawn(move || answerer.run(&flag)) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("tamper watch off: cannot start its thread ({e})");
                return None;
            }
        };
        *running = Some(Running { group: Arc::clone(&group), stop, thread: Some(thread) });
        Some(group)
    }

    /// Ends the answering thread and closes the group: the kernel lets
    /// every access still waiting through, and every mark goes with it.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let running = lock(&self.running).take();
        if let Some(mut r) = running {
            r.stop.store(true, Ordering::SeqCst);
            if let Some(thread) = r.thread.take() {
                let _ = thread.join();
            }
        }
        self.marks().clear();
    }
}

impl Drop for TamperWatch {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The answering thread's state.
struct Answerer {
    group: Arc<Group>,
    instance: String,
    marks: Arc<Mutex<HashMap<String, SandboxMarks>>>,
    refusals: mpsc::Sender<Refusal>,
}

impl Answerer {
    fn run(self, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            match self.group.wait(WAIT_TICK_MS) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => {
                    tracing::error!("tamper watch stops: {e}");
                    break;
                }
            }
            let events = match self.group.read() {
                Ok(events) => events,
                Err(e) => {
                    tracing::error!("tamper watch stops: {e}");
                    break;
                }
            };
            for event in events {
                self.judge(event);
            }
        }
    }

    /// Answers one event and queues its refusal, if it is one.
    fn judge(&self, event: PermissionEvent<'_>) {
        let Some(refusal) = self.refusal(&event) else {
            let _ = event.answer(true);
            return;
        };
        let _ = event.answer(false);
        tracing::info!(sandbox = %refusal.0, detail = %refusal.1.detail, "tamper refused");
        if self.refusals.try_send(refusal).is_err() {
            tracing::warn!("tamper watch: the event queue is full; a refusal is not recorded");
        }
    }

    /// The event, when the access it holds is one to refuse.
    fn refusal(&self, event: &PermissionEvent<'_>) -> Option<Refusal> {
        let tid = event.tid;
        let cgroups = std::fs::read_to_string(format!("/proc/{tid}/cgroup")).ok()?;
        let sandbox = sandbox_in_cgroups(&cgroups, &self.instance)?;
        let (phase, rules, host_root) = {
            let marks = lock(&self.marks);
            let m = marks.get(&sandbox)?;
            (m.phase.clone(), m.rules.clone(), m.host_root.clone())
        };
        let refused = marks::judge(event, &rules, &phase, &host_root)?;
        let inner = std::fs::read_to_string(format!("/proc/{tid}/status")).ok().and_then(|s| marks::inner_tgid(&s));
        if inner == Some(1) {
            // The sandbox's init: outside every domain by design, and the
            // platform's own code, like the file API.
            return None;
        }
        let comm = std::fs::read_to_string(format!("/proc/{tid}/comm")).unwrap_or_default().trim_end().to_string();
        let mut detail = refused.detail;
        if inner.is_none() {
            detail.push_str(&format!(" (host pid {tid})"));
        }
        let mut observed = Observed::new(SecurityEventKind::Tamper, detail).process(inner.unwrap_or(0), comm);
        observed.syscall = refused.syscall.to_string();
        Some((sandbox, observed))
    }
}

/// The guard's level for an API access level.
fn guard_level(level: AccessLevel) -> Level {
    match level {
        AccessLevel::None => Level::None,
        AccessLevel::Read => Level::Read,
        AccessLevel::ReadWrite => Level::ReadWrite,
    }
}

/// Records the watch's refusals in their sandboxes' timelines until the
/// watch or the node is gone.
pub(crate) fn record_refusals(node: Weak<Inner>, mut refusals: mpsc::Receiver<Refusal>) {
    tokio::spawn(async move {
        while let Some((sandbox, observed)) = refusals.recv().await {
            let Some(inner) = node.upgrade() else { break };
            Node { inner }.record_event(&sandbox, observed);
        }
    });
}

impl Node {
    /// Makes the tamper watch guard sandbox `id` as its current phase says
    /// (container sandboxes only; nothing is marked without protected paths
    /// at `none` or `read`).
    pub(crate) async fn watch_protected_paths(&self, id: &str) {
        let Ok(live) = self.live_as_is(id) else { return };
        if live.handle.backend != Backend::Container {
            return;
        }
        let (phase, rules) = {
            let rec = live.record();
            let phase = rec.info.phase.clone().unwrap_or_default();
            let rules: Vec<Protected> = rec
                .info
                .phases
                .get(&phase)
                .map(|spec| {
                    spec.protected_paths
                        .iter()
                        .map(|(path, level)| Protected { path: path.clone(), level: guard_level(*level) })
                })
                .into_iter()
                .flatten()
                .collect();
            (phase, rules)
        };
        if !marks::needs_marks(&rules) {
            self.inner.tamper.forget(id);
            return;
        }
        let root = match live.driver.fs_root(&live.handle) {
            Ok(root) => root,
            Err(e) => {
                tracing::warn!(sandbox = %id, "tamper watch: cannot open the sandbox's root: {e}");
                return;
            }
        };
        let node = self.clone();
        let sandbox = id.to_string();
        let _ = tokio::task::spawn_blocking(move || node.inner.tamper.protect(&sandbox, &phase, rules, root.dir)).await;
        // Ended meanwhile: its end may have dropped the marks before they
        // were placed.
        if self.live_as_is(id).is_err() {
            self.inner.tamper.forget(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(list: &[(&str, AccessLevel)]) -> Vec<Protected> {
        list.iter().map(|(p, l)| Protected { path: p.to_string(), level: guard_level(*l) }).collect()
    }

    /// A real group on a temporary tree: marks appear in the group's
    /// fdinfo, a phase change replaces them, and forgetting drops them.
    #[test]
    fn marks_follow_the_rules_and_go_when_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("answers/deep/er")).unwrap();
        std::fs::write(dir.path().join("answers/key"), "secret").unwrap();
        std::fs::create_dir_all(dir.path().join("ref")).unwrap();
        let root = || OwnedFd::from(std::fs::File::open(dir.path()).unwrap());
        let (watch, _rx) = TamperWatch::new("warren-tamper-unit".into());
        let count = |watch: &TamperWatch| {
            let Some(group) = lock(&watch.running).as_ref().map(|r| Arc::clone(&r.group)) else { return 0 };
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", group.as_fd().as_raw_fd())).unwrap();
            info.lines().filter(|l| l.starts_with("fanotify ino:")).count()
        };
        watch.protect("sb-1", "rollout", rules(&[("/answers", AccessLevel::ReadWrite)]), root());
        assert_eq!(count(&watch), 0, "read_write needs no marks");
        watch.protect(
            "sb-1",
            "rollout",
            rules(&[("/answers", AccessLevel::None), ("/ref", AccessLevel::Read)]),
            root(),
        );
        assert!(lock(&watch.running).is_some(), "a fanotify group (the tests run as root)");
        assert_eq!(count(&watch), 4, "answers, deep, er and ref");
        watch.protect("sb-1", "grade", rules(&[("/ref", AccessLevel::Read)]), root());
        assert_eq!(count(&watch), 1);
        // A protected file is marked itself.
        std::fs::write(dir.path().join("grader.py"), "x").unwrap();
        watch.protect(
            "sb-1",
            "grade",
            rules(&[("/ref", AccessLevel::Read), ("/grader.py", AccessLevel::None)]),
            root(),
        );
        assert_eq!(count(&watch), 2);
        watch.forget("sb-1");
        assert_eq!(count(&watch), 0);
        watch.stop();
    }
}
