//! The tamper watch: fanotify permission events on protected paths, for
//! container sandboxes.
//!
//! Landlock holds each phase's processes to that phase's rules, but a
//! process that outlives its phase (`kill_running: false`, or one the agent
//! detached) keeps its old, looser domain, and Landlock's refusals are only
//! seen when audit is on. The kernel asks the LSM (Landlock) before
//! fanotify, so what reaches this watch is exactly what Landlock let
//! through: the current phase's own permitted accesses, and those of
//! processes of earlier phases.
//!
//! One fanotify group per node (made when the first sandbox needs it).
//! For each live container sandbox whose current phase has paths at `none`
//! or `read`, the protected path and every directory below it (bounded:
//! [`MAX_DEPTH`], [`MAX_MARKS`]) carry an inode mark: at `none`, opens, exec
//! opens and reads (`FAN_ACCESS_PERM`) of the files; at `read`, opens, of
//! which those for writing (or with `O_TRUNC`) are refused: the event does
//! not carry the opener's flags, so the watch reads them from the held
//! thread's `/proc/TID/syscall` (an open it cannot decode counts as a write).
//! Directories are marked without `FAN_ONDIR`: listing one is not an event
//! (names are not contents), and the phase leader lists directories while
//! it builds a ruleset.
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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use rustix::fs::{Mode, OFlags, ResolveFlags};
use tokio::sync::mpsc;
use warren_api::{AccessLevel, Backend, SecurityEventKind};
use warren_guard::fanotify::{self, Group, OpenIntent, PermissionEvent, ALL_PERM_EVENTS};

use crate::events::Observed;
use crate::landlock_audit::sandbox_in_cgroups;
use crate::{Inner, Node};

/// Directories below a protected path that are marked, at most this deep.
pub(crate) const MAX_DEPTH: usize = 32;
/// Inodes marked per sandbox at most; a tree beyond is marked in part
/// (and the node logs it).
pub(crate) const MAX_MARKS: usize = 4096;
/// How long the answering thread waits for events between stop checks.
const WAIT_TICK_MS: i32 = 100;
/// Refusals waiting to be recorded; beyond it they are dropped (and logged).
const EVENT_QUEUE: usize = 1024;

const NONE_MASK: u64 =
    fanotify::OPEN_PERM | fanotify::OPEN_EXEC_PERM | fanotify::ACCESS_PERM | fanotify::EVENT_ON_CHILD;
const READ_MASK: u64 = fanotify::OPEN_PERM | fanotify::EVENT_ON_CHILD;

/// A refusal on its way to the sandbox's timeline.
type Refusal = (String, Observed);

/// One protected path of a sandbox's current phase.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Protected {
    path: String,
    level: AccessLevel,
}

/// One marked inode: where it was below the sandbox's root (to unmark it
/// by: the watch keeps no descriptor per mark, which would cost the node
/// one per directory), what it was, and its mask.
struct Marked {
    relative: String,
    key: (u64, u64),
    mask: u64,
}

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
        if !rules.iter().any(|p| p.level != AccessLevel::ReadWrite) {
            self.forget(id);
            return;
        }
        // Walked with no lock held: the answering thread must never wait
        // for a walk (and directories are marked without FAN_ONDIR, so
        // opening them for the walk is no event anyway).
        let mut wanted: Vec<(Marked, OwnedFd)> = Vec::new();
        for p in rules.iter().filter(|p| p.level != AccessLevel::ReadWrite) {
            let mask = if p.level == AccessLevel::None { NONE_MASK } else { READ_MASK };
            walk(root.as_fd(), &p.path, mask, &mut wanted, id);
        }
        let Some(group) = self.group() else { return };
        let host_root = std::fs::read_link(format!("/proc/self/fd/{}", root.as_raw_fd()))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut marks = self.marks();
        let mut placed = 0;
        for (m, fd) in &wanted {
            match group.mark(fd.as_fd(), m.mask) {
                Ok(()) => placed += 1,
                Err(e) => tracing::warn!(sandbox = %id, "tamper watch: cannot mark an inode: {e}"),
            }
        }
        let marked: Vec<Marked> = wanted.into_iter().map(|(m, _)| m).collect();
        if let Some(old) = marks.remove(id) {
            for m in &old.marked {
                let keep = marked.iter().find(|w| w.key == m.key).map_or(0, |w| w.mask);
                unmark(&group, old.root.as_fd(), m, m.mask & !keep);
            }
        }
        tracing::info!(sandbox = %id, phase, marks = placed, "tamper watch: protected paths marked");
        let entry = SandboxMarks { phase: phase.to_string(), rules, marked, root, host_root };
        marks.insert(id.to_string(), entry);
    }

    /// Drops every mark of sandbox `id` (it ended, or its phase protects
    /// nothing).
    pub(crate) fn forget(&self, id: &str) {
        let Some(old) = self.marks().remove(id) else { return };
        if let Some(group) = lock(&self.running).as_ref().map(|r| Arc::clone(&r.group)) {
            for m in &old.marked {
                unmark(&group, old.root.as_fd(), m, ALL_PERM_EVENTS);
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

/// Takes `bits` off the mark of `m`, found again below `root`. A marked
/// directory that was renamed or replaced since keeps its mark until its
/// inode goes (at the latest with the sandbox's filesystem): harmless, as
/// accesses are judged by where the file is now.
fn unmark(group: &Group, root: BorrowedFd<'_>, m: &Marked, bits: u64) {
    if bits == 0 {
        return;
    }
    let Some(fd) = open_path(root, &m.relative) else { return };
    let same = rustix::fs::fstat(&fd).is_ok_and(|st| (st.st_dev, st.st_ino) == m.key);
    if same {
        let _ = group.unmark(fd.as_fd(), bits);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Collects the protected path `path` (below `root`) and every directory
/// under it, bounded, each with a descriptor to mark it by. Paths with a
/// symbolic link on the way are not followed (a phase with one is refused
/// by Landlock's plan anyway).
fn walk(root: BorrowedFd<'_>, path: &str, mask: u64, out: &mut Vec<(Marked, OwnedFd)>, id: &str) {
    let top = path.trim_start_matches('/');
    let top = if top.is_empty() { "." } else { top };
    let Some(fd) = open_path(root, top) else { return };
    let mut stack = vec![(fd, top.to_string(), 0usize)];
    while let Some((fd, relative, depth)) = stack.pop() {
        let Ok(st) = rustix::fs::fstat(&fd) else { continue };
        let key = (st.st_dev, st.st_ino);
        let is_dir = rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory;
        if is_dir && depth < MAX_DEPTH {
            for name in subdirectories(&fd) {
                if let Some(child) = open_path(fd.as_fd(), &name) {
                    stack.push((child, format!("{relative}/{name}"), depth + 1));
                }
            }
        }
        let full = out.len() >= MAX_MARKS;
        match out.iter_mut().find(|(m, _)| m.key == key) {
            Some((m, _)) => m.mask |= mask,
            None if full => {
                tracing::warn!(sandbox = %id, path, "tamper watch: more than {MAX_MARKS} directories; the rest is unmarked");
                return;
            }
            None => out.push((Marked { relative, key, mask }, fd)),
        }
    }
}

/// `O_PATH`, beneath `dir`, following no symbolic link at all.
fn open_path(dir: BorrowedFd<'_>, relative: &str) -> Option<OwnedFd> {
    let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::BENEATH;
    let flags = OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    rustix::fs::openat2(dir, relative, flags, Mode::empty(), resolve).ok()
}

/// The names of the directories directly in `dir` (an `O_PATH` fd).
fn subdirectories(dir: &OwnedFd) -> Vec<String> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let Ok(opened) = rustix::fs::openat(dir, ".", flags, Mode::empty()) else { return Vec::new() };
    let Ok(entries) = rustix::fs::Dir::read_from(&opened) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type() == rustix::fs::FileType::Directory)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "." && n != "..")
        .collect()
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
        let path = std::fs::read_link(format!("/proc/self/fd/{}", event.file.as_raw_fd()))
            .map(|p| sandbox_path(&p.to_string_lossy(), &host_root))
            .ok();
        let matched = path.as_deref().and_then(|p| level_of(&rules, p));
        let level = match (&path, matched) {
            (_, Some(level)) => level,
            // Moved out of every protected path (a stale mark): judged, as
            // Landlock judges, by where it is now.
            (Some(_), None) => return None,
            // Cannot be placed at all: held to the strictest of them.
            (None, None) => strictest(&rules),
        };
        let (syscall, access) = access_of(event.mask, tid);
        let allowed = match level {
            AccessLevel::ReadWrite => true,
            AccessLevel::Read => matches!(access, Access::Read | Access::Open(OpenIntent::Read | OpenIntent::Exec)),
            AccessLevel::None => false,
        };
        if allowed {
            return None;
        }
        let inner = std::fs::read_to_string(format!("/proc/{tid}/status")).ok().and_then(|s| inner_tgid(&s));
        if inner == Some(1) {
            // The sandbox's init: outside every domain by design, and the
            // platform's own code, like the file API.
            return None;
        }
        let comm = std::fs::read_to_string(format!("/proc/{tid}/comm")).unwrap_or_default().trim_end().to_string();
        let mut detail = format!(
            "{} {} denied: phase {phase} level {}",
            access.describe(),
            path.as_deref().filter(|_| matched.is_some()).unwrap_or("(a file under a protected path)"),
            level_name(level)
        );
        if inner.is_none() {
            detail.push_str(&format!(" (host pid {tid})"));
        }
        let mut observed = Observed::new(SecurityEventKind::Tamper, detail).process(inner.unwrap_or(0), comm);
        observed.syscall = syscall.to_string();
        Some((sandbox, observed))
    }
}

/// A thread's process id inside its innermost pid namespace, from its
/// `/proc/TID/status` (`NStgid:` lists it per namespace, outermost first).
fn inner_tgid(status: &str) -> Option<i32> {
    let line = status.lines().find(|l| l.starts_with("NStgid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// What a held access is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// A read through an open descriptor (`FAN_ACCESS_PERM`).
    Read,
    Open(OpenIntent),
}

impl Access {
    fn describe(self) -> String {
        match self {
            Access::Read => "read".to_string(),
            Access::Open(OpenIntent::Exec) => "exec".to_string(),
            Access::Open(intent) => format!("open({})", intent.as_str()),
        }
    }
}

/// The access an event holds, and the call that made it ("" if unknown).
fn access_of(mask: u64, tid: i32) -> (&'static str, Access) {
    if mask & fanotify::ACCESS_PERM != 0 {
        return ("", Access::Read);
    }
    if mask & fanotify::OPEN_EXEC_PERM != 0 {
        return ("execve", Access::Open(OpenIntent::Exec));
    }
    let line = std::fs::read_to_string(format!("/proc/{tid}/syscall")).unwrap_or_default();
    let memory = |addr: u64| {
        let mem = std::fs::File::open(format!("/proc/{tid}/mem")).ok()?;
        let mut bytes = [0u8; 8];
        mem.read_exact_at(&mut bytes, addr).ok()?;
        Some(u64::from_ne_bytes(bytes))
    };
    let (syscall, intent) = fanotify::open_intent(&line, memory);
    (syscall, Access::Open(intent))
}

/// A path the kernel reported for an event, as the sandbox names it.
fn sandbox_path(reported: &str, host_root: &str) -> String {
    let reported = reported.strip_suffix(" (deleted)").unwrap_or(reported);
    match reported.strip_prefix(host_root) {
        Some(rest) if !host_root.is_empty() && (rest.is_empty() || rest.starts_with('/')) => {
            if rest.is_empty() {
                "/".to_string()
            } else {
                rest.to_string()
            }
        }
        _ => reported.to_string(),
    }
}

/// The level of the most specific protected path that holds `path`.
fn level_of(rules: &[Protected], path: &str) -> Option<AccessLevel> {
    rules
        .iter()
        .filter(|p| {
            p.path == "/"
                || path == p.path
                || path.strip_prefix(p.path.as_str()).is_some_and(|rest| rest.starts_with('/'))
        })
        .max_by_key(|p| p.path.len())
        .map(|p| p.level)
}

fn strictest(rules: &[Protected]) -> AccessLevel {
    let rank = |l: AccessLevel| match l {
        AccessLevel::None => 0,
        AccessLevel::Read => 1,
        AccessLevel::ReadWrite => 2,
    };
    rules.iter().map(|p| p.level).min_by_key(|l| rank(*l)).unwrap_or(AccessLevel::None)
}

fn level_name(level: AccessLevel) -> &'static str {
    match level {
        AccessLevel::None => "none",
        AccessLevel::Read => "read",
        AccessLevel::ReadWrite => "read_write",
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
                    spec.protected_paths.iter().map(|(path, level)| Protected { path: path.clone(), level: *level })
                })
                .into_iter()
                .flatten()
                .collect();
            (phase, rules)
        };
        if !rules.iter().any(|p| p.level != AccessLevel::ReadWrite) {
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
        list.iter().map(|(p, l)| Protected { path: p.to_string(), level: *l }).collect()
    }

    #[test]
    fn the_most_specific_protected_path_decides() {
        let r = rules(&[
            ("/answers", AccessLevel::None),
            ("/answers/public", AccessLevel::Read),
            ("/work", AccessLevel::ReadWrite),
        ]);
        assert_eq!(level_of(&r, "/answers/key"), Some(AccessLevel::None));
        assert_eq!(level_of(&r, "/answers"), Some(AccessLevel::None));
        assert_eq!(level_of(&r, "/answers/public/a/b"), Some(AccessLevel::Read));
        assert_eq!(level_of(&r, "/answers-not"), None, "a prefix is not a parent");
        assert_eq!(level_of(&r, "/work/x"), Some(AccessLevel::ReadWrite));
        assert_eq!(strictest(&r), AccessLevel::None);
        assert_eq!(strictest(&rules(&[("/a", AccessLevel::Read)])), AccessLevel::Read);
    }

    #[test]
    fn reported_paths_lose_the_host_root() {
        assert_eq!(sandbox_path("/run/warren/sb-1/rootfs/answers/key", "/run/warren/sb-1/rootfs"), "/answers/key");
        assert_eq!(sandbox_path("/answers/key (deleted)", "/run/warren/sb-1/rootfs"), "/answers/key");
        assert_eq!(sandbox_path("/run/warren/sb-1/rootfs2/x", "/run/warren/sb-1/rootfs"), "/run/warren/sb-1/rootfs2/x");
        assert_eq!(sandbox_path("/answers/key", ""), "/answers/key");
    }

    #[test]
    fn the_innermost_tgid_is_the_sandbox_pid() {
        let status = "Name:\tcat\nTgid:\t4242\nNgid:\t0\nPid:\t4243\nNStgid:\t4242\t17\nNSpid:\t4243\t18\n";
        assert_eq!(inner_tgid(status), Some(17));
        assert_eq!(inner_tgid("NStgid:\t1\n"), Some(1));
        assert_eq!(inner_tgid("Name:\tx\n"), None);
    }

    #[test]
    fn accesses_read_as_the_detail_says() {
        assert_eq!(Access::Read.describe(), "read");
        assert_eq!(Access::Open(OpenIntent::Read).describe(), "open(read)");
        assert_eq!(Access::Open(OpenIntent::Write).describe(), "open(write)");
        assert_eq!(Access::Open(OpenIntent::Exec).describe(), "exec");
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
