//! What a tamper watch needs that does not depend on where it runs: which
//! inodes to mark for a phase's protected paths, and how to judge an access
//! a [`fanotify`] permission event holds back. The node's watch (container
//! sandboxes, one group for the host) and a microVM's init (one group for
//! its guest) both build on it.
//!
//! Why a watch at all, beside Landlock: a process that outlives its phase
//! (`kill_running: false`, or one the agent detached) keeps its old, looser
//! domain. The kernel asks the LSM (Landlock) before fanotify, so what
//! reaches a watch is exactly what Landlock let through: the current
//! phase's own permitted accesses, and those of processes of earlier
//! phases. Judged here by the current phase's levels, the first pass and
//! the second are refused.
//!
//! Never: follows a symbolic link while marking (a path with one on the way
//! is not marked; Landlock's plan refuses such a phase anyway), nor marks a
//! directory with `FAN_ONDIR` (listing a directory is no event: names are
//! not contents, and phase leaders list directories to build a ruleset).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;

use rustix::fs::{Mode, OFlags, ResolveFlags};

use crate::fanotify::{self, Group, OpenIntent, PermissionEvent};
use crate::landlock::Level;

/// Directories below a protected path that are marked, at most this deep.
pub const MAX_DEPTH: usize = 32;
/// Inodes marked per sandbox at most; a tree beyond is marked in part.
pub const MAX_MARKS: usize = 4096;

/// At `none`: opens, exec opens and reads of the files.
pub const NONE_MASK: u64 =
    fanotify::OPEN_PERM | fanotify::OPEN_EXEC_PERM | fanotify::ACCESS_PERM | fanotify::EVENT_ON_CHILD;
/// At `read`: opens, of which those for writing are refused.
pub const READ_MASK: u64 = fanotify::OPEN_PERM | fanotify::EVENT_ON_CHILD;

/// One protected path of a phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protected {
    pub path: String,
    pub level: Level,
}

/// Whether `rules` need any mark (a path at `none` or `read`).
pub fn needs_marks(rules: &[Protected]) -> bool {
    rules.iter().any(|p| p.level != Level::ReadWrite)
}

/// One marked inode: where it is below the sandbox's root (to unmark it
/// by: a watch keeps no descriptor per mark, which would cost one per
/// directory), what it was, and its mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marked {
    pub relative: String,
    pub key: (u64, u64),
    pub mask: u64,
}

/// What [`walk`] found to mark.
pub struct Walked {
    /// Each inode with a descriptor to mark it by.
    pub inodes: Vec<(Marked, OwnedFd)>,
    /// More than [`MAX_MARKS`] inodes: the rest is left unmarked.
    pub truncated: bool,
}

/// Collects every protected path of `rules` at `none` or `read` (below
/// `root`) and every directory under it, bounded by [`MAX_DEPTH`] and
/// [`MAX_MARKS`], each with a descriptor to mark it by. Blocking.
pub fn walk(root: BorrowedFd<'_>, rules: &[Protected]) -> Walked {
    let mut walked = Walked { inodes: Vec::new(), truncated: false };
    for p in rules.iter().filter(|p| p.level != Level::ReadWrite) {
        let mask = if p.level == Level::None { NONE_MASK } else { READ_MASK };
        walk_one(root, &p.path, mask, &mut walked);
    }
    walked
}

fn walk_one(root: BorrowedFd<'_>, path: &str, mask: u64, out: &mut Walked) {
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
        let full = out.inodes.len() >= MAX_MARKS;
        match out.inodes.iter_mut().find(|(m, _)| m.key == key) {
            Some((m, _)) => m.mask |= mask,
            None if full => {
                out.truncated = true;
                return;
            }
            None => out.inodes.push((Marked { relative, key, mask }, fd)),
        }
    }
}

/// Marks what [`walk`] found; returns the marks and how many the kernel
/// refused (each is logged by the caller's means, not here).
pub fn place(group: &Group, walked: Walked) -> (Vec<Marked>, Vec<std::io::Error>) {
    let mut failed = Vec::new();
    for (m, fd) in &walked.inodes {
        if let Err(e) = group.mark(fd.as_fd(), m.mask) {
            failed.push(e);
        }
    }
    (walked.inodes.into_iter().map(|(m, _)| m).collect(), failed)
}

/// Takes off the marks of `old` (found again below `root`) whatever
/// `kept` no longer needs of them.
pub fn drop_stale(group: &Group, root: BorrowedFd<'_>, old: &[Marked], kept: &[Marked]) {
    for m in old {
        let keep = kept.iter().find(|k| k.key == m.key).map_or(0, |k| k.mask);
        unmark(group, root, m, m.mask & !keep);
    }
}

/// Takes `bits` off the mark of `m`, found again below `root`. A marked
/// directory that was renamed or replaced since keeps its mark until its
/// inode goes (at the latest with the sandbox's filesystem): harmless, as
/// accesses are judged by where the file is now.
pub fn unmark(group: &Group, root: BorrowedFd<'_>, m: &Marked, bits: u64) {
    if bits == 0 {
        return;
    }
    let Some(fd) = open_path(root, &m.relative) else { return };
    let same = rustix::fs::fstat(&fd).is_ok_and(|st| (st.st_dev, st.st_ino) == m.key);
    if same {
        let _ = group.unmark(fd.as_fd(), bits);
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

/// The access an event with `mask` holds for thread `tid` (a held thread,
/// so its `/proc` entries are stable), and the call that made it ("" if
/// unknown).
fn access_of(mask: u64, tid: i32) -> (&'static str, Access) {
    if mask & fanotify::ACCESS_PERM != 0 {
        return ("", Access::Read);
    }
    if mask & fanotify::OPEN_EXEC_PERM != 0 {
        return ("execve", Access::Open(OpenIntent::Exec));
    }
    let line = held_syscall(tid);
    let memory = |addr: u64| {
        let mem = std::fs::File::open(format!("/proc/{tid}/mem")).ok()?;
        let mut bytes = [0u8; 8];
        mem.read_exact_at(&mut bytes, addr).ok()?;
        Some(u64::from_ne_bytes(bytes))
    };
    let (syscall, intent) = fanotify::open_intent(&line, memory);
    (syscall, Access::Open(intent))
}

/// How often [`held_syscall`] reads a held thread's call before it gives up.
const SYSCALL_READS: usize = 50;

/// The held thread's `/proc/TID/syscall` line. The kernel answers
/// `running` when the thread was woken between its two looks (a thread
/// held by fanotify wakes whenever the group answers any event, finds its
/// own unanswered and sleeps again; under a one-vCPU guest a third of the
/// reads met that), so it is read again until it names a call.
fn held_syscall(tid: i32) -> String {
    let mut line = String::new();
    for attempt in 0..SYSCALL_READS {
        line = std::fs::read_to_string(format!("/proc/{tid}/syscall")).unwrap_or_default();
        if !line.starts_with("running") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(50 << attempt.min(6)));
    }
    line
}

/// Whether `level` lets `access` through (an open it cannot decode counts
/// as a write).
fn allows(level: Level, access: Access) -> bool {
    match level {
        Level::ReadWrite => true,
        Level::Read => matches!(access, Access::Read | Access::Open(OpenIntent::Read | OpenIntent::Exec)),
        Level::None => false,
    }
}

/// The level that judges an access to the file at `path` (as the sandbox
/// names it; `None` when it could not be placed): the most specific
/// protected path holding it, the strictest of all when it cannot be
/// placed, and `None` (let through) when it was moved out of every
/// protected path since its mark, judged as Landlock judges, by where it
/// is now. Returns the level and whether `path` matched a rule.
fn judging_level(rules: &[Protected], path: Option<&str>) -> Option<(Level, bool)> {
    match path {
        Some(p) => level_of(rules, p).map(|l| (l, true)),
        None => Some((strictest(rules), false)),
    }
}

/// The level of the most specific protected path that holds `path`.
fn level_of(rules: &[Protected], path: &str) -> Option<Level> {
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

/// The strictest level of `rules` (`none` without any).
fn strictest(rules: &[Protected]) -> Level {
    rules.iter().map(|p| p.level).min().unwrap_or(Level::None)
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::None => "none",
        Level::Read => "read",
        Level::ReadWrite => "read_write",
    }
}

/// A path the kernel reported for an event (`/proc/self/fd/N`'s target),
/// as the sandbox names it: without `root` (how the watcher sees the
/// sandbox's root; empty when it is `/`) and a ` (deleted)` suffix.
fn sandbox_path(reported: &str, root: &str) -> String {
    let reported = reported.strip_suffix(" (deleted)").unwrap_or(reported);
    match reported.strip_prefix(root) {
        Some(rest) if !root.is_empty() && (rest.is_empty() || rest.starts_with('/')) => {
            if rest.is_empty() {
                "/".to_string()
            } else {
                rest.to_string()
            }
        }
        _ => reported.to_string(),
    }
}

/// A thread's process id inside its innermost pid namespace, from its
/// `/proc/TID/status` (`NStgid:` lists it per namespace, outermost first).
pub fn inner_tgid(status: &str) -> Option<i32> {
    let line = status.lines().find(|l| l.starts_with("NStgid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// An access a watch refuses: the call that made it ("" if unknown) and
/// its event's detail.
#[derive(Debug)]
pub struct Refused {
    pub syscall: &'static str,
    pub detail: String,
}

/// Judges the access `event` holds by phase `phase`'s `rules`; `root` is
/// the sandbox's root as the watcher names it (empty when it is `/`).
/// `None`: let it through. Who is exempt (the platform's own processes)
/// is the caller's to decide.
pub fn judge(event: &PermissionEvent<'_>, rules: &[Protected], phase: &str, root: &str) -> Option<Refused> {
    let path = std::fs::read_link(format!("/proc/self/fd/{}", event.file.as_raw_fd()))
        .map(|p| sandbox_path(&p.to_string_lossy(), root))
        .ok();
    let (level, matched) = judging_level(rules, path.as_deref())?;
    let (syscall, access) = access_of(event.mask, event.tid);
    if allows(level, access) {
        return None;
    }
    let detail = describe_refusal(access, path.as_deref().filter(|_| matched), phase, level);
    Some(Refused { syscall, detail })
}

/// The detail of a refusal's event.
fn describe_refusal(access: Access, path: Option<&str>, phase: &str, level: Level) -> String {
    format!(
        "{} {} denied: phase {phase} level {}",
        access.describe(),
        path.unwrap_or("(a file under a protected path)"),
        level_name(level)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(list: &[(&str, Level)]) -> Vec<Protected> {
        list.iter().map(|(p, l)| Protected { path: p.to_string(), level: *l }).collect()
    }

    #[test]
    fn the_most_specific_protected_path_decides() {
        let r = rules(&[("/answers", Level::None), ("/answers/public", Level::Read), ("/work", Level::ReadWrite)]);
        assert_eq!(level_of(&r, "/answers/key"), Some(Level::None));
        assert_eq!(level_of(&r, "/answers"), Some(Level::None));
        assert_eq!(level_of(&r, "/answers/public/a/b"), Some(Level::Read));
        assert_eq!(level_of(&r, "/answers-not"), None, "a prefix is not a parent");
        assert_eq!(level_of(&r, "/work/x"), Some(Level::ReadWrite));
        assert_eq!(strictest(&r), Level::None);
        assert_eq!(strictest(&rules(&[("/a", Level::Read)])), Level::Read);
        assert_eq!(judging_level(&r, Some("/answers/key")), Some((Level::None, true)));
        assert_eq!(judging_level(&r, Some("/elsewhere")), None, "moved out: let through");
        assert_eq!(judging_level(&r, None), Some((Level::None, false)), "unplaced: the strictest");
    }

    #[test]
    fn levels_let_through_what_they_grant() {
        assert!(allows(Level::Read, Access::Read));
        assert!(allows(Level::Read, Access::Open(OpenIntent::Read)));
        assert!(allows(Level::Read, Access::Open(OpenIntent::Exec)));
        assert!(!allows(Level::Read, Access::Open(OpenIntent::Write)));
        assert!(!allows(Level::Read, Access::Open(OpenIntent::Unknown)), "undecoded counts as a write");
        assert!(!allows(Level::None, Access::Read));
        assert!(allows(Level::ReadWrite, Access::Open(OpenIntent::Write)));
    }

    #[test]
    fn reported_paths_lose_the_root() {
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
        assert_eq!(
            describe_refusal(Access::Read, Some("/a/k"), "grade", Level::None),
            "read /a/k denied: phase grade level none"
        );
    }

    /// A real group on a temporary tree (the tests run as root): marks
    /// appear in the group's fdinfo, a new rule set drops what it no
    /// longer needs.
    #[test]
    fn walked_trees_are_marked_and_stale_marks_dropped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("answers/deep/er")).unwrap();
        std::fs::write(dir.path().join("answers/key"), "secret").unwrap();
        std::fs::create_dir_all(dir.path().join("ref")).unwrap();
        std::fs::write(dir.path().join("grader.py"), "x").unwrap();
        let root = OwnedFd::from(std::fs::File::open(dir.path()).unwrap());
        let group = Group::new().expect("a fanotify group (the tests run as root)");
        let count = || {
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", group.as_fd().as_raw_fd())).unwrap();
            info.lines().filter(|l| l.starts_with("fanotify ino:")).count()
        };
        assert!(!needs_marks(&rules(&[("/answers", Level::ReadWrite)])));
        assert!(walk(root.as_fd(), &rules(&[("/answers", Level::ReadWrite)])).inodes.is_empty());

        let first = walk(root.as_fd(), &rules(&[("/answers", Level::None), ("/ref", Level::Read)]));
        assert!(!first.truncated);
        let (first, failed) = place(&group, first);
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(count(), 4, "answers, deep, er and ref");

        let second = walk(root.as_fd(), &rules(&[("/ref", Level::Read), ("/grader.py", Level::None)]));
        let (second, _) = place(&group, second);
        drop_stale(&group, root.as_fd(), &first, &second);
        assert_eq!(count(), 2, "ref and the protected file itself");
        drop_stale(&group, root.as_fd(), &second, &[]);
        assert_eq!(count(), 0);
    }
}
