//! Disk pressure: what an ended sandbox leaves on the node (its record and
//! exec results, its trajectory log with kept outputs and uploads) is kept
//! for the retention times (`ended_retention`, `trajectory_retention`), or
//! less when the data directory's filesystem runs low.
//!
//! Each sandbox's kept output and uploads are bounded, but not how many
//! sandboxes end within a day: a node that churns through sandboxes whose
//! agents print a lot would fill its data disk, and then every durable
//! commit - every create, exec and delete - fails. So while less than
//! `disk_reserve_percent` of the filesystem is available, the node forgets
//! ended sandboxes early, whole (record, results, trajectory, data files),
//! the longest ended first, until it is above the reserve again or nothing
//! ended is left. A live sandbox's data is never touched here, and what is
//! forgotten early is what the retention would have forgotten later.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use warren_api::SandboxState;
use warren_store::{StateStoreExt, Table};

use crate::records::SandboxRecord;
use crate::{Node, NodeError, Result};

/// How long the node waits after a round that left the disk below its
/// reserve with nothing ended to forget: each round lists every record.
const EXHAUSTED_BACKOFF: Duration = Duration::from_secs(30);

/// When a round last found the disk still low with nothing left to forget.
#[derive(Debug, Default)]
pub(crate) struct Relief {
    exhausted_at: Mutex<Option<Instant>>,
}

impl Relief {
    /// A sandbox ended: there is something to forget again.
    pub(crate) fn sandbox_ended(&self) {
        *self.exhausted_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Whether the filesystem holding `path` has less than `reserve_percent`
/// of its size available to unprivileged writers.
pub(crate) fn below_reserve(path: &Path, reserve_percent: u8) -> Result<bool> {
    if reserve_percent == 0 {
        return Ok(false);
    }
    let fs = rustix::fs::statvfs(path).map_err(|e| NodeError::Internal(format!("statvfs {}: {e}", path.display())))?;
    let (available, size) = (u128::from(fs.f_bavail), u128::from(fs.f_blocks));
    Ok(available * 100 < size * u128::from(reserve_percent))
}

/// Forgets `ended` sandboxes (id, when it ended), the longest ended first,
/// while `low()` says the disk is below its reserve; returns the ids
/// forgotten, in that order. `forget` failing stops the round.
fn relieve(
    mut ended: Vec<(String, u64)>,
    mut low: impl FnMut() -> Result<bool>,
    mut forget: impl FnMut(&str) -> Result<()>,
) -> Result<Vec<String>> {
    ended.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    let mut forgotten = Vec::new();
    for (id, _) in ended {
        if !low()? {
            break;
        }
        forget(&id)?;
        forgotten.push(id);
    }
    Ok(forgotten)
}

impl Node {
    /// One round of [`relieve`] on this node's data directory, if its
    /// filesystem is below the reserve (blocking: run it off the runtime).
    pub(crate) fn relieve_disk_pressure(&self) -> Result<Vec<String>> {
        let (dir, reserve) = (&self.inner.cfg.data_dir, self.inner.cfg.disk_reserve_percent);
        if !below_reserve(dir, reserve)? {
            return Ok(Vec::new());
        }
        let mut exhausted_at = self.inner.pressure.exhausted_at.lock().unwrap_or_else(|p| p.into_inner());
        if exhausted_at.is_some_and(|at| at.elapsed() < EXHAUSTED_BACKOFF) {
            return Ok(Vec::new());
        }
        let forgotten = relieve(self.ended_sandboxes()?, || below_reserve(dir, reserve), |id| self.forget_all_of(id))?;
        if !forgotten.is_empty() {
            tracing::warn!(
                count = forgotten.len(),
                reserve_percent = reserve,
                "the data directory's filesystem is below its reserve: forgot the longest-ended sandboxes early"
            );
        }
        if below_reserve(dir, reserve)? {
            tracing::warn!(
                reserve_percent = reserve,
                "the data directory's filesystem is below its reserve and no ended sandbox is left to forget"
            );
            *exhausted_at = Some(Instant::now());
        } else {
            *exhausted_at = None;
        }
        Ok(forgotten)
    }

    /// Every ended sandbox the node still keeps something of, with when it
    /// ended (its record's time, else its trajectory's).
    fn ended_sandboxes(&self) -> Result<Vec<(String, u64)>> {
        let mut ended: BTreeMap<String, u64> = self.ended_trajectories()?.into_iter().collect();
        for (id, bytes) in self.store().list(Table::Sandboxes, "")? {
            let Ok(rec) = serde_json::from_slice::<SandboxRecord>(&bytes) else { continue };
            if rec.info.state == SandboxState::Ended {
                ended.insert(id, rec.info.ended_at_ms.unwrap_or(0));
            }
        }
        let live = self.live_map();
        Ok(ended.into_iter().filter(|(id, _)| !live.contains_key(id)).collect())
    }

    /// Forgets whatever is kept of the ended sandbox `id`.
    fn forget_all_of(&self, id: &str) -> Result<()> {
        if let Some(rec) = self.store().get_json::<SandboxRecord>(Table::Sandboxes, id)? {
            if rec.info.state == SandboxState::Ended {
                self.forget_ended_record(id, &rec)?;
            }
        }
        self.forget_trajectory(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(list: &[(&str, u64)]) -> Vec<(String, u64)> {
        list.iter().map(|(id, at)| (id.to_string(), *at)).collect()
    }

    #[test]
    fn the_longest_ended_go_first_and_only_while_the_disk_is_low() {
        // The disk is low for the first two looks.
        let mut looks = 0;
        let low = || {
            looks += 1;
            Ok(looks <= 2)
        };
        let mut gone = Vec::new();
        let forgotten = relieve(ended(&[("c", 30), ("a", 10), ("d", 40), ("b", 10)]), low, |id| {
            gone.push(id.to_string());
            Ok(())
        })
        .unwrap();
        // Ties go by id, so a round is the same whatever order the store listed.
        assert_eq!(forgotten, ["a", "b"]);
        assert_eq!(gone, forgotten);
    }

    #[test]
    fn nothing_goes_when_the_disk_has_room_and_a_failure_stops_the_round() {
        let forgotten = relieve(ended(&[("a", 1)]), || Ok(false), |_| panic!("forgot with room to spare")).unwrap();
        assert!(forgotten.is_empty());
        let mut tries = 0;
        let failed = relieve(
            ended(&[("a", 1), ("b", 2)]),
            || Ok(true),
            |_| {
                tries += 1;
                Err(NodeError::Internal("disk gone".into()))
            },
        );
        assert!(failed.is_err());
        assert_eq!(tries, 1);
    }

    /// On a 1 MiB tmpfs of its own (the test runs as root, as CI does):
    /// empty it has all its room; half full it is below a 60% reserve and
    /// not below a 40% one.
    #[test]
    fn the_reserve_compares_available_space_with_the_filesystem_size() {
        use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};
        let dir = tempfile::tempdir().unwrap();
        mount("tmpfs", dir.path(), "tmpfs", MountFlags::empty(), Some(c"size=1m")).expect("mount a tmpfs (root)");
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = unmount(self.0, UnmountFlags::DETACH);
            }
        }
        let _unmount = Unmount(dir.path());
        assert!(!below_reserve(dir.path(), 0).unwrap(), "0 turns the check off");
        assert!(!below_reserve(dir.path(), 100).unwrap(), "an empty tmpfs has all of its room");
        std::fs::write(dir.path().join("half"), vec![1u8; 512 << 10]).unwrap();
        assert!(below_reserve(dir.path(), 60).unwrap());
        assert!(!below_reserve(dir.path(), 40).unwrap());
        assert!(below_reserve(Path::new("/no/such/dir"), 10).is_err());
    }
}
