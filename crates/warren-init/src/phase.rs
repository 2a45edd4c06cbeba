//! PID 1's side of phases: which phase is current, its leader (see
//! `leader`), and the switch from one phase to the next.
//!
//! A switch holds the lock every spawn takes. With `kill_running` it first
//! kills every process of the sandbox except PID 1 and the old leader:
//! found by scanning /proc, so nothing escapes by `setsid` or a double
//! fork, and nothing of an earlier phase, which may have had looser rights,
//! lives on into the new one. Then it starts the new phase's leader (a
//! ruleset that cannot be built leaves the old phase current), makes it
//! current and retires the old leader: the switch answers once that leader
//! has exited and been reaped. Without `kill_running`, running
//! processes keep the domain (the rights) of the phase they started in.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use warren_init::proto::PhaseRules;

use crate::leader::{Leader, SpawnError, SpawnOrder, StartError};
use crate::reaper::{ExitWaiter, Registry};
use crate::tree;

pub struct Phases {
    registry: Arc<Registry>,
    /// This binary: leaders are exec'd from it, sessions hand it on.
    self_exe: OwnedFd,
    current: Mutex<Current>,
}

struct Current {
    rules: PhaseRules,
    /// `None` after the leader broke, until the next spawn starts another.
    leader: Option<Leader>,
}

impl Phases {
    /// Starts the first phase's leader.
    pub fn start(registry: Arc<Registry>, self_exe: OwnedFd, rules: PhaseRules) -> Result<Phases, StartError> {
        let leader = Leader::start(&registry, self_exe.as_fd(), &rules)?;
        Ok(Phases { registry, self_exe, current: Mutex::new(Current { rules, leader: Some(leader) }) })
    }

    pub fn self_exe(&self) -> BorrowedFd<'_> {
        self.self_exe.as_fd()
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `order`'s process in the current phase, registered with the
    /// reaper. A leader that died before it started the process is
    /// replaced, and the order sent again, once; one lost after it started
    /// the process is replaced for the next spawn.
    pub fn spawn(&self, order: &SpawnOrder, fds: &[BorrowedFd<'_>]) -> io::Result<(i32, ExitWaiter)> {
        let mut current = self.lock();
        let mut last_error = None;
        for _attempt in 0..2 {
            let leader = match current.leader.take() {
                Some(leader) => leader,
                None => Leader::start(&self.registry, self.self_exe.as_fd(), &current.rules)?,
            };
            let leader = current.leader.insert(leader);
            match self.registry.spawn_registered(|| leader.spawn(order, fds).map(|pid| (pid, pid))) {
                Ok(spawned) => {
                    if leader.is_lost() {
                        if let Some(lost) = current.leader.take() {
                            lost.kill(&self.registry);
                        }
                    }
                    return Ok(spawned);
                }
                Err(SpawnError::Exec(e)) => return Err(e),
                Err(SpawnError::LeaderGone(e)) => {
                    if let Some(gone) = current.leader.take() {
                        gone.kill(&self.registry);
                    }
                    last_error = Some(e);
                }
                Err(SpawnError::Leader(e)) => {
                    if let Some(broken) = current.leader.take() {
                        broken.kill(&self.registry);
                    }
                    return Err(io::Error::new(e.kind(), format!("phase leader broke: {e}")));
                }
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("phase leader failed")))
    }

    /// Makes `rules` the current phase; returns how many processes were
    /// killed. On error the earlier phase stays current (with
    /// `kill_running`, its processes are gone all the same).
    pub fn switch(&self, rules: PhaseRules, kill_running: bool) -> Result<u32, StartError> {
        // Held throughout: no exec starts in either phase meanwhile.
        let mut current = self.lock();
        // Killed before the new ruleset is built, so nothing of the old
        // phase can rename or replace what the new phase's rules are being
        // attached to while the ancestors are listed.
        let killed = match kill_running {
            true => tree::kill_all_but(&current.leader.iter().map(Leader::pid).collect::<Vec<_>>()),
            false => 0,
        };
        let leader = Leader::start(&self.registry, self.self_exe.as_fd(), &rules)?;
        let old = std::mem::replace(&mut *current, Current { rules, leader: Some(leader) });
        if let Some(old_leader) = old.leader {
            old_leader.retire(&self.registry);
        }
        Ok(killed)
    }
}
