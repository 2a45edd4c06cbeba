//! Finding and killing an exec's whole process tree.
//!
//! A process belongs to the tree of an exec whose main process is `root`
//! when any of these holds:
//! - it is `root`, or its parent chain reaches `root` (the main process is
//!   a child subreaper, so orphans of the command reparent to it);
//! - its session id is `root` (the main process leads its own session, so
//!   descendants that outlived it and were reparented to PID 1 still carry
//!   it, unless they called `setsid` themselves);
//! - it holds one of the exec's pipes (catches daemons that did `setsid`
//!   but kept the output open: exactly the ones that keep an exec hanging).
//!
//! Killing first stops everything it finds with SIGSTOP, rescanning until a
//! scan finds nothing new (a fork bomb cannot outrun this: stopped processes
//! do not fork), then SIGKILLs the lot, and repeats while anything is left.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::time::Duration;

use crate::sys;

/// What init needs from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub state: char,
    pub ppid: i32,
    pub session: i32,
}

impl ProcStat {
    /// Parses `/proc/<pid>/stat`. The command name may hold spaces and
    /// parentheses, so fields are counted after the LAST `)`.
    pub fn parse(stat: &str) -> Option<ProcStat> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let pid = stat[..open].trim().parse().ok()?;
        let mut fields = stat.get(close + 1..)?.split_ascii_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let _pgrp = fields.next()?;
        let session = fields.next()?.parse().ok()?;
        Some(ProcStat { pid, state, ppid, session })
    }

    /// A zombie or dead process needs no killing, only reaping.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }

    /// Stopped by a signal (or traced).
    pub fn is_stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// Stops what `find` finds, rescanning until a scan finds nobody new: a
/// process may fork between the scan that found its parent and the
/// parent's stop, but stopped processes cannot fork, so this ends even for
/// a fork bomb (and for a process stuck in `D` state, which cannot fork
/// either). One already stopped when found is left as it is. Returns the
/// last scan and the pids this call stopped.
pub fn stop_all(find: impl Fn() -> Vec<ProcStat>) -> (Vec<ProcStat>, Vec<i32>) {
    let mut seen = HashSet::new();
    let mut stopped = Vec::new();
    loop {
        let found = find();
        let new: Vec<&ProcStat> = found.iter().filter(|p| seen.insert(p.pid)).collect();
        if new.is_empty() {
            return (found, stopped);
        }
        for p in new.into_iter().filter(|p| !p.is_stopped()) {
            sys::signal(p.pid, libc::SIGSTOP);
            stopped.push(p.pid);
        }
    }
}

/// The pipe inode a `/proc/<pid>/fd/<n>` link names (`pipe:[12345]`).
pub fn parse_pipe_link(link: &str) -> Option<u64> {
    link.strip_prefix("pipe:[")?.strip_suffix(']')?.parse().ok()
}

/// The live processes of the tree rooted at `root` among `procs`; pids in
/// `holders` hold one of the exec's pipes. `me` (init) is never included.
pub fn members(procs: &[ProcStat], root: i32, holders: &HashSet<i32>, me: i32) -> Vec<ProcStat> {
    let parent: HashMap<i32, i32> = procs.iter().map(|p| (p.pid, p.ppid)).collect();
    let descends_from_root = |mut pid: i32| {
        // Bounded: a pid-reuse race could in theory make a cycle.
        for _ in 0..procs.len() + 1 {
            if pid == root {
                return true;
            }
            match parent.get(&pid) {
                Some(&ppid) if ppid > 1 => pid = ppid,
                _ => return false,
            }
        }
        false
    };
    procs
        .iter()
        .filter(|p| p.pid != me && p.pid > 1 && !p.is_dead())
        .filter(|p| p.session == root || holders.contains(&p.pid) || descends_from_root(p.pid))
        .copied()
        .collect()
}

/// The live processes among `procs` whose parent chain reaches `ancestor`
/// (never `ancestor` itself). In a container init is PID 1 of the
/// sandbox's pid namespace and every other process descends from it; in a
/// VM's guest this leaves out the kernel's threads (under kthreadd, whose
/// parent is 0) and, under a full VM's systemd, the guest OS's own units.
pub fn descendants(procs: &[ProcStat], ancestor: i32) -> Vec<ProcStat> {
    let parent: HashMap<i32, i32> = procs.iter().map(|p| (p.pid, p.ppid)).collect();
    let descends = |mut pid: i32| {
        // Bounded: a pid-reuse race could in theory make a cycle.
        for _ in 0..procs.len() + 1 {
            match parent.get(&pid) {
                Some(&ppid) if ppid == ancestor => return true,
                Some(&ppid) if ppid > 0 => pid = ppid,
                _ => return false,
            }
        }
        false
    };
    procs.iter().filter(|p| p.pid != ancestor && !p.is_dead() && descends(p.pid)).copied().collect()
}

/// Every process visible in `/proc` (processes that vanish mid-scan are
/// simply not listed).
pub fn scan() -> Vec<ProcStat> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|entry| {
        let name = entry.ok()?.file_name();
        let pid: i32 = name.to_str()?.parse().ok()?;
        ProcStat::parse(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    })
    .collect()
}

/// Pids whose descriptors include one of the pipes `inodes`. Processes
/// whose fds init may not read (non-dumpable ones) are not seen here.
pub fn pipe_holders(procs: &[ProcStat], inodes: &[u64]) -> HashSet<i32> {
    let mut holders = HashSet::new();
    if inodes.is_empty() {
        return holders;
    }
    for proc in procs.iter().filter(|p| !p.is_dead()) {
        let Ok(fds) = fs::read_dir(format!("/proc/{}/fd", proc.pid)) else { continue };
        let holds = fds
            .filter_map(|fd| fs::read_link(fd.ok()?.path()).ok())
            .any(|link| link.to_str().and_then(parse_pipe_link).is_some_and(|inode| inodes.contains(&inode)));
        if holds {
            holders.insert(proc.pid);
        }
    }
    holders
}

/// Kills the tree of `root` (see the module doc) until nothing of it lives.
pub fn kill_tree(root: i32, pipe_inodes: &[u64]) {
    let me = std::process::id() as i32;
    kill_until_gone(|| {
        let procs = scan();
        let holders = pipe_holders(&procs, pipe_inodes);
        members(&procs, root, &holders, me)
    });
}

/// Kills every process of the sandbox (init's [`descendants`]) but
/// `keep`, until none is left; returns how many were killed.
pub fn kill_all_but(keep: &[i32]) -> u32 {
    let me = std::process::id() as i32;
    let killed = kill_until_gone(|| descendants(&scan(), me).into_iter().filter(|p| !keep.contains(&p.pid)).collect());
    u32::try_from(killed).unwrap_or(u32::MAX)
}

/// Stops, then kills, what `find` finds, until it finds nothing; returns
/// how many distinct processes were killed.
fn kill_until_gone(find: impl Fn() -> Vec<ProcStat>) -> usize {
    let mut killed = HashSet::new();
    loop {
        // Freeze first, so nothing forks past the kill.
        let (found, _) = stop_all(&find);
        if found.is_empty() {
            return killed.len();
        }
        for p in &found {
            sys::signal(p.pid, libc::SIGKILL);
            killed.insert(p.pid);
        }
        // Give the killed a moment to turn into zombies before rescanning,
        // so the loop does not spin while the kernel tears them down.
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: i32, ppid: i32, session: i32, state: char) -> ProcStat {
        ProcStat { pid, state, ppid, session }
    }

    #[test]
    fn descendants_are_what_hangs_off_the_ancestor_and_not_the_kernels_threads() {
        // A guest: init 1, its leader 7 and a command 9 under it, an orphan
        // 12 reparented to init, a zombie 13; kthreadd 2 and a kworker 3.
        let procs = [
            p(1, 0, 1, 'S'),
            p(2, 0, 0, 'S'),
            p(3, 2, 0, 'I'),
            p(7, 1, 7, 'S'),
            p(9, 7, 9, 'R'),
            p(12, 1, 9, 'S'),
            p(13, 1, 13, 'Z'),
        ];
        let pids = |found: Vec<ProcStat>| found.iter().map(|p| p.pid).collect::<Vec<_>>();
        assert_eq!(pids(descendants(&procs, 1)), [7, 9, 12]);
        assert_eq!(pids(descendants(&procs, 7)), [9]);
        // A container's pid 2 is an ordinary process of the sandbox.
        let container = [p(1, 0, 1, 'S'), p(2, 1, 2, 'S'), p(5, 2, 2, 'S')];
        assert_eq!(pids(descendants(&container, 1)), [2, 5]);
    }

    #[test]
    fn stat_parse_survives_hostile_command_names() {
        let stat = "4242 (evil) S 1 2 3 (x) R) T 77 4242 4242 0 -1 4194560 0";
        let s = ProcStat::parse(stat).unwrap();
        assert_eq!(s, p(4242, 77, 4242, 'T'));
        assert!(ProcStat::parse("12 (sh) S 1 12 12 0").is_some());
        assert_eq!(ProcStat::parse("12 (sh) Z 1 12 12 0").map(|s| s.is_dead()), Some(true));
        assert!(ProcStat::parse("garbage").is_none());
        assert!(ProcStat::parse("12 (sh)").is_none());
    }

    #[test]
    fn pipe_links_parse_only_pipes() {
        assert_eq!(parse_pipe_link("pipe:[123456]"), Some(123456));
        assert_eq!(parse_pipe_link("socket:[123456]"), None);
        assert_eq!(parse_pipe_link("/dev/null"), None);
        assert_eq!(parse_pipe_link("pipe:[]"), None);
    }

    #[test]
    fn members_follow_parents_sessions_and_pipes_but_not_strangers() {
        let procs = vec![
            p(1, 0, 0, 'S'),    // init
            p(10, 1, 10, 'S'),  // root of the exec, session leader
            p(11, 10, 10, 'S'), // child
            p(12, 11, 12, 'S'), // grandchild that did setsid: parent chain
            p(13, 1, 10, 'S'),  // orphan reparented to init, same session
            p(14, 1, 14, 'S'),  // setsid daemon holding a pipe
            p(15, 1, 15, 'S'),  // unrelated process of another exec
            p(16, 15, 15, 'S'), // its child
            p(17, 10, 10, 'Z'), // zombie: nothing to kill
            p(99, 1, 10, 'S'),  // "me"
        ];
        let holders: HashSet<i32> = [14].into_iter().collect();
        let mut got: Vec<i32> = members(&procs, 10, &holders, 99).iter().map(|p| p.pid).collect();
        got.sort_unstable();
        assert_eq!(got, vec![10, 11, 12, 13, 14]);
    }

    #[test]
    fn members_terminate_on_parent_cycles() {
        let procs = vec![p(20, 21, 20, 'S'), p(21, 20, 21, 'S')];
        assert!(members(&procs, 10, &HashSet::new(), 1).is_empty());
    }
}
