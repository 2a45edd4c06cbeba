//! What the driver remembers about a sandbox: the handle's state, the files
//! under its run directory, the identity of its PID 1, and its uid range.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::{BackendError, Result};

/// How many uids and gids each sandbox maps (root to 65535 inside).
pub(crate) const IDS_PER_SANDBOX: u32 = 65_536;

/// The files and mount points under `run_dir/<id>/`, all on the sandbox's
/// own tmpfs.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    dir: PathBuf,
}

impl Layout {
    pub(crate) fn new(run_dir: &Path, id: &str) -> Layout {
        Layout { dir: run_dir.join(id) }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
    /// Holds the writable layer, on the sandbox's tmpfs at [`Layout::dir`]
    /// (whose size is the disk limit).
    pub(crate) fn rw(&self) -> PathBuf {
        self.dir.join("rw")
    }
    pub(crate) fn upper(&self) -> PathBuf {
        self.rw().join("upper")
    }
    pub(crate) fn work(&self) -> PathBuf {
        self.rw().join("work")
    }
    pub(crate) fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
    pub(crate) fn ctl_sock(&self) -> PathBuf {
        self.dir.join("ctl.sock")
    }
    /// Holds the uid slot; written first so that a half-made sandbox keeps
    /// its range reserved until it is swept.
    pub(crate) fn slot_file(&self) -> PathBuf {
        self.dir.join("slot")
    }
    /// A copy of the handle's state, so a sweep can find PID 1 without one.
    pub(crate) fn state_file(&self) -> PathBuf {
        self.dir.join("state.json")
    }
}

/// A process identified by pid and start time, so a recycled pid is never
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ProcessId {
    pub(crate) pid: i32,
    /// Field 22 of `/proc/<pid>/stat`, in clock ticks since boot.
    pub(crate) start_time: u64,
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub(crate) state: char,
    pub(crate) start_time: u64,
}

impl ProcessId {
    /// Reads the start time of a live `pid`.
    pub(crate) fn of(pid: i32) -> io::Result<ProcessId> {
        let stat = proc_stat(pid)?.ok_or_else(|| io::Error::from(ErrorKind::NotFound))?;
        Ok(ProcessId { pid, start_time: stat.start_time })
    }

    /// The process as it is now, if `pid` still names the same process
    /// (possibly a zombie).
    pub(crate) fn stat(&self) -> Option<ProcStat> {
        proc_stat(self.pid).ok().flatten().filter(|stat| stat.start_time == self.start_time)
    }

    /// Same process and not yet dead.
    pub(crate) fn is_running(&self) -> bool {
        self.stat().is_some_and(|stat| !matches!(stat.state, 'Z' | 'X' | 'x'))
    }
}

/// `Ok(None)` when there is no such process.
pub(crate) fn proc_stat(pid: i32) -> io::Result<Option<ProcStat>> {
    let text = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => text,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => return Ok(None),
        Err(e) => return Err(e),
    };
    parse_stat(&text).map(Some).ok_or_else(|| io::Error::new(ErrorKind::InvalidData, "unparsable /proc/<pid>/stat"))
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) may contain spaces and parentheses; it ends
    // at the last ')'. Fields from 3 on follow, space separated.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 22 is the 20th after the state (field 3).
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// The driver's part of a [`crate::SandboxHandle`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandleState {
    pub(crate) pid1: ProcessId,
    /// First host uid (and gid) of the sandbox's range; root inside.
    pub(crate) uid_base: u32,
    pub(crate) slot: u32,
    pub(crate) dir: PathBuf,
}

impl HandleState {
    pub(crate) fn to_json(&self) -> serde_json::Value {
        // A struct of plain fields always serializes.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    pub(crate) fn from_json(value: &serde_json::Value) -> Result<HandleState> {
        serde_json::from_value(value.clone()).map_err(|e| BackendError::Protocol(format!("bad container handle: {e}")))
    }

    pub(crate) fn save(&self, layout: &Layout) -> Result<()> {
        let path = layout.state_file();
        let text = serde_json::to_vec(self).map_err(|e| BackendError::Protocol(e.to_string()))?;
        fs::write(&path, text).map_err(|e| BackendError::io(format!("write {}", path.display()), e))
    }

    /// `None` when the sandbox never got that far (or the file is damaged:
    /// the cgroup still finds every process).
    pub(crate) fn load(layout: &Layout) -> Option<HandleState> {
        let text = fs::read(layout.state_file()).ok()?;
        serde_json::from_slice(&text).ok()
    }
}

/// Hands out uid slots: slot `n` maps `uid_base_start + n * 65536`. The
/// slot files under the run directory are the record, so the choice
/// survives a restart; they are read once, on the first claim, and from
/// then on the book follows every claim and release itself, so a create
/// does not read one file per running sandbox.
#[derive(Debug)]
pub(crate) struct SlotBook {
    run_dir: PathBuf,
    uid_base_start: u32,
    capacity: u32,
    /// `None` until the slot files have been read.
    taken: Mutex<Option<BTreeSet<u32>>>,
}

impl SlotBook {
    pub(crate) fn new(run_dir: PathBuf, uid_base_start: u32) -> SlotBook {
        // The last id (u32::MAX) means "no id" to the kernel.
        let capacity = (u32::MAX - uid_base_start) / IDS_PER_SANDBOX;
        SlotBook { run_dir, uid_base_start, capacity, taken: Mutex::new(None) }
    }

    /// A book of `capacity` plain numbers (a VM's QEMU takes one host id,
    /// not a range): use the slots, not [`SlotBook::uid_base`].
    pub(crate) fn numbers(run_dir: PathBuf, capacity: u32) -> SlotBook {
        SlotBook { run_dir, uid_base_start: 0, capacity, taken: Mutex::new(None) }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    pub(crate) fn uid_base(&self, slot: u32) -> u32 {
        self.uid_base_start + slot * IDS_PER_SANDBOX
    }

    fn lock(&self) -> MutexGuard<'_, Option<BTreeSet<u32>>> {
        self.taken.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Picks the lowest slot no sandbox holds and records it in `layout`'s
    /// slot file.
    pub(crate) fn claim_slot(&self, layout: &Layout) -> Result<u32> {
        let mut guard = self.lock();
        let taken = match guard.as_mut() {
            Some(taken) => taken,
            None => guard.insert(self.taken_on_disk()?),
        };
        // The first gap in the sorted set, or the slot after the last.
        let slot = taken.iter().zip(0u32..).find(|&(&s, i)| s != i).map_or(taken.len() as u32, |(_, i)| i);
        if slot >= self.capacity() {
            return Err(BackendError::Exhausted(format!("all {} uid ranges are in use", self.capacity())));
        }
        let path = layout.slot_file();
        fs::write(&path, slot.to_string()).map_err(|e| BackendError::io(format!("write {}", path.display()), e))?;
        taken.insert(slot);
        Ok(slot)
    }

    /// Frees `slot` once the directory that held it is gone.
    pub(crate) fn release(&self, slot: u32) {
        if let Some(taken) = self.lock().as_mut() {
            taken.remove(&slot);
        }
    }

    /// The slot `layout`'s slot file records, if it can be read.
    pub(crate) fn recorded(layout: &Layout) -> Option<u32> {
        fs::read_to_string(layout.slot_file()).ok()?.trim().parse().ok()
    }

    fn taken_on_disk(&self) -> Result<BTreeSet<u32>> {
        let entries =
            fs::read_dir(&self.run_dir).map_err(|e| BackendError::io(format!("read {}", self.run_dir.display()), e))?;
        Ok(entries.flatten().filter_map(|entry| SlotBook::recorded(&Layout { dir: entry.path() })).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_parentheses_in_the_name() {
        let text = "42 (a) b) (c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_stat(text), Some(ProcStat { state: 'S', start_time: 987654 }));
        assert_eq!(parse_stat("42 (x) S 1"), None);
    }

    #[test]
    fn own_process_identity_is_stable_and_running() {
        let me = ProcessId::of(std::process::id() as i32).unwrap();
        assert!(me.is_running());
        let other = ProcessId { start_time: me.start_time + 1, ..me };
        assert!(!other.is_running());
    }

    #[test]
    fn slots_fill_gaps_and_persist_in_files() {
        let dir = tempfile::tempdir().unwrap();
        let book = SlotBook::new(dir.path().to_path_buf(), 1 << 30);
        let layouts: Vec<Layout> = (0..4).map(|i| Layout::new(dir.path(), &format!("s{i}"))).collect();
        for l in &layouts {
            fs::create_dir(l.dir()).unwrap();
        }
        assert_eq!(book.claim_slot(&layouts[0]).unwrap(), 0);
        assert_eq!(book.claim_slot(&layouts[1]).unwrap(), 1);
        fs::remove_dir_all(layouts[0].dir()).unwrap();
        book.release(0);
        assert_eq!(book.claim_slot(&layouts[2]).unwrap(), 0);
        assert_eq!(book.uid_base(1), (1 << 30) + 65_536);
        let last = book.uid_base(book.capacity() - 1);
        assert!(last.checked_add(IDS_PER_SANDBOX - 1).is_some_and(|top| top < u32::MAX));
        // A new book (a restarted server) learns the taken slots from the files.
        let restarted = SlotBook::new(dir.path().to_path_buf(), 1 << 30);
        assert_eq!(restarted.claim_slot(&layouts[3]).unwrap(), 2);
        assert_eq!(SlotBook::recorded(&layouts[3]), Some(2));
    }

    #[test]
    fn a_full_slot_book_says_the_node_is_out_of_room() {
        let dir = tempfile::tempdir().unwrap();
        // Room for exactly one range below u32::MAX.
        let book = SlotBook::new(dir.path().to_path_buf(), u32::MAX - IDS_PER_SANDBOX - 1);
        assert_eq!(book.capacity(), 1);
        let layouts: Vec<Layout> = (0..2).map(|i| Layout::new(dir.path(), &format!("s{i}"))).collect();
        for l in &layouts {
            fs::create_dir(l.dir()).unwrap();
        }
        assert_eq!(book.claim_slot(&layouts[0]).unwrap(), 0);
        let err = book.claim_slot(&layouts[1]).unwrap_err();
        assert!(matches!(err, BackendError::Exhausted(_)), "{err:?}");
        assert!(err.is_exhaustion());
        assert_eq!(SlotBook::recorded(&layouts[1]), None, "a refused claim records nothing");
    }
}
