//! Landlock denials as security events (`--landlock-audit off|on|auto`).
//!
//! The kernel reports a Landlock refusal only as audit records, and only
//! while audit is enabled host-wide. A listener thread reads them
//! (`warren_guard::audit`), groups each event's records by their serial,
//! finds the sandbox (the refusing domain's creator, or the refused
//! process, through `/proc/PID/cgroup`) and records a `landlock` event.
//!
//! - `on`: with no audit daemon registered, the node registers itself as
//!   the daemon and enables audit (raising a tiny backlog limit); with one
//!   registered, it only listens on the read-log multicast group. A clean
//!   stop restores `enabled` and the backlog limit and unregisters. The
//!   node must be the daemon whenever it enables audit: without one the
//!   kernel prints every record to the kernel log.
//! - `auto` (default): listens on the read-log group if audit is already
//!   enabled; changes nothing (but undoes what a crashed `on` node left).
//! - `off`: nothing.
//!
//! What the node changed is written to `<data>/landlock-audit.json` first,
//! so that the next start after a crash can put it back (the kernel drops a
//! dead daemon by itself, but leaves audit enabled).
//! Never: touches the audit `failure` mode or the audit rules.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use warren_api::SecurityEventKind;
use warren_guard::audit::{
    parse_landlock, AuditError, AuditSocket, AuditStatus, LandlockAccess, LandlockRecord, AUDIT_CONFIG_CHANGE,
};

use crate::events::Observed;
use crate::{Inner, Node};

/// How the node gets Landlock's audit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LandlockAuditMode {
    /// Never looks at audit.
    Off,
    /// Becomes the audit daemon and enables audit when no daemon runs.
    On,
    /// Listens only when audit is already enabled on the host.
    #[default]
    Auto,
}

impl FromStr for LandlockAuditMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(LandlockAuditMode::Off),
            "on" => Ok(LandlockAuditMode::On),
            "auto" => Ok(LandlockAuditMode::Auto),
            other => Err(format!("must be off, on or auto, not {other:?}")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LandlockAuditError {
    #[error("--landlock-audit on: {0}")]
    Audit(#[from] AuditError),
    #[error("--landlock-audit: cannot start the listener thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("--landlock-audit on: cannot write {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A `limit` the kernel's backlog must at least have while the node is the
/// daemon: a burst of refusals (records are made in atomic context, which
/// never waits for room) would otherwise be lost and reported in the
/// kernel log.
const MIN_BACKLOG_LIMIT: u32 = 8192;
/// How long the listener blocks in one read: the pace of its stop checks.
const READ_TICK: Duration = Duration::from_millis(100);
/// A refusal whose event has not ended (no `AUDIT_EOE`: the process had
/// no audit context) is recorded after this long.
const PENDING_GRACE: Duration = Duration::from_millis(300);
/// Domains remembered between their first denial and their end.
const DOMAIN_CACHE: usize = 4096;
const STATE_FILE: &str = "landlock-audit.json";

/// What the node changed on the host, to put back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Takeover {
    /// This process's pid, registered as the audit daemon.
    pid: u32,
    /// `enabled` before the node set it to 1.
    enabled_before: u32,
    /// The backlog limit before the node raised it, if it did.
    backlog_limit_before: Option<u32>,
}

/// The running listener; [`Listener::stop`] (or drop) ends it and restores
/// what the node changed.
pub(crate) struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Starts listening as `mode` says. `Ok(None)`: nothing to listen to
    /// (`off`, or `auto` with audit disabled or out of reach).
    pub(crate) fn start(
        mode: LandlockAuditMode,
        node: Weak<Inner>,
        instance: String,
        data_dir: &Path,
    ) -> Result<Option<Listener>, LandlockAuditError> {
        let state_path = data_dir.join(STATE_FILE);
        let left = match mode {
            LandlockAuditMode::Off => None,
            _ => undo_crashed_takeover(&state_path),
        };
        let source = match mode {
            LandlockAuditMode::Off => return Ok(None),
            LandlockAuditMode::Auto => match auto_source() {
                Some(socket) => Source { socket, takeover: None, state_path },
                None => return Ok(None),
            },
            LandlockAuditMode::On => on_source(state_path, left)?,
        };
        source.socket.set_recv_timeout(READ_TICK)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("landlock-audit".into())
            .spawn(move || listen(source, node, instance, flag))
            .map_err(LandlockAuditError::Thread)?;
        Ok(Some(Listener { stop, thread: Some(thread) }))
    }

    /// Ends the listener and waits until what it changed is restored.
    pub(crate) fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            // The listener itself drops the node's last reference when the
            // node was never shut down: it sees the flag on its next turn.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Where records come from, and what to put back when done.
struct Source {
    socket: AuditSocket,
    takeover: Option<Takeover>,
    state_path: PathBuf,
}

fn auto_source() -> Option<AuditSocket> {
    let status = match AuditSocket::open().and_then(|mut s| s.status()) {
        Ok(status) => status,
        Err(e) => {
            tracing::info!("landlock denials are not events: cannot read the audit status ({e})");
            return None;
        }
    };
    if status.enabled == 0 {
        tracing::info!("landlock denials are not events: audit is disabled (see --landlock-audit on)");
        return None;
    }
    match AuditSocket::open_readlog() {
        Ok(socket) => Some(socket),
        Err(e) => {
            tracing::warn!("landlock denials are not events: cannot join audit's read-log group ({e})");
            None
        }
    }
}

/// `left`: a crashed node's takeover that could not be undone; its
/// "before" values are the host's own, not what the host shows now.
fn on_source(state_path: PathBuf, left: Option<Takeover>) -> Result<Source, LandlockAuditError> {
    let mut socket = AuditSocket::open()?;
    let status = socket.status()?;
    if status.pid != 0 && pid_alive(status.pid) {
        tracing::info!(daemon = status.pid, "an audit daemon runs: reading its records from the read-log group");
        if status.enabled == 0 {
            tracing::warn!("audit is disabled by the running audit daemon: no landlock events until it enables it");
        }
        return Ok(Source { socket: AuditSocket::open_readlog()?, takeover: None, state_path });
    }
    let takeover = match left {
        Some(left) => Takeover { pid: std::process::id(), ..left },
        None => Takeover {
            pid: std::process::id(),
            enabled_before: status.enabled,
            backlog_limit_before: (status.backlog_limit < MIN_BACKLOG_LIMIT).then_some(status.backlog_limit),
        },
    };
    // Written first: a crash between the next calls must be undoable.
    write_state(&state_path, &takeover)?;
    if let Err(e) = take_over(&mut socket, &status, &takeover) {
        let _ = std::fs::remove_file(&state_path);
        return Err(e.into());
    }
    tracing::info!(
        enabled_before = takeover.enabled_before,
        "registered as the audit daemon: landlock denials become events"
    );
    Ok(Source { socket, takeover: Some(takeover), state_path })
}

/// Registers first and enables second: enabled with no daemon, the kernel
/// would print records to the kernel log. On failure, undoes the steps
/// that were taken.
fn take_over(socket: &mut AuditSocket, status: &AuditStatus, takeover: &Takeover) -> Result<(), AuditError> {
    socket.set_pid(takeover.pid)?;
    if status.enabled == 0 {
        if let Err(e) = socket.set_enabled(1) {
            let _ = socket.set_pid(0);
            return Err(e);
        }
    }
    if takeover.backlog_limit_before.is_some() {
        if let Err(e) = socket.set_backlog_limit(MIN_BACKLOG_LIMIT) {
            let undo = Takeover { backlog_limit_before: None, ..*takeover };
            give_back(socket, &undo, status.enabled == 0);
            return Err(e);
        }
    }
    Ok(())
}

/// Restores `enabled` and the backlog limit, reads what the kernel queued
/// until then (the record of the change itself comes last), and only
/// then unregisters, so nothing queued is left for the kernel log.
fn give_back(socket: &mut AuditSocket, takeover: &Takeover, disable: bool) {
    if let Some(limit) = takeover.backlog_limit_before {
        if let Err(e) = socket.set_backlog_limit(limit) {
            tracing::warn!("cannot restore the audit backlog limit {limit}: {e}");
        }
    }
    if disable {
        match socket.set_enabled(0) {
            Ok(()) => drain_until_config_change(socket),
            Err(e) => tracing::warn!("cannot disable audit again: {e}"),
        }
    }
    if let Err(e) = socket.set_pid(0) {
        tracing::warn!("cannot unregister as the audit daemon: {e}");
    }
}

fn drain_until_config_change(socket: &mut AuditSocket) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut changed = false;
    while Instant::now() < deadline {
        match socket.recv() {
            Ok(Some(r)) if r.kind == AUDIT_CONFIG_CHANGE && r.text.contains("audit_enabled=0") => changed = true,
            Ok(Some(r)) => tracing::debug!(kind = r.kind, text = %r.text, "audit record after the stop"),
            // The change is recorded before `enabled` drops, so a record
            // begun just before it can still follow: wait for a quiet read.
            Ok(None) if changed => return,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("reading the audit records left: {e}");
                return;
            }
        }
    }
    tracing::warn!("audit records may be left for the kernel log: no quiet moment after disabling audit");
}

/// A takeover file from a node that did not stop cleanly: if its daemon is
/// gone and audit is still enabled, put back what it changed. Returns the
/// takeover when it is still in force (not undone).
fn undo_crashed_takeover(state_path: &Path) -> Option<Takeover> {
    let text = std::fs::read(state_path).ok()?;
    let Ok(takeover) = serde_json::from_slice::<Takeover>(&text) else {
        tracing::warn!("{} does not parse: removed", state_path.display());
        let _ = std::fs::remove_file(state_path);
        return None;
    };
    if takeover.pid != std::process::id() && pid_alive(takeover.pid) {
        // Another node on this data dir? Leave its state alone.
        return Some(takeover);
    }
    let undone = AuditSocket::open().and_then(|mut socket| {
        let status = socket.status()?;
        if status.pid != 0 && status.pid != takeover.pid && pid_alive(status.pid) {
            // Someone else's daemon now: audit is theirs.
            tracing::warn!(daemon = status.pid, "a crashed node's audit settings are left to the running daemon");
            return Ok(());
        }
        // Undone as the daemon, like a clean stop: the kernel would print
        // the record of the change to the kernel log otherwise.
        socket.set_pid(std::process::id())?;
        give_back(&mut socket, &takeover, takeover.enabled_before == 0 && status.enabled != 0);
        tracing::warn!(
            enabled = takeover.enabled_before,
            "restored the audit settings a previous node left after a crash"
        );
        Ok(())
    });
    match undone {
        Ok(()) => {
            let _ = std::fs::remove_file(state_path);
            None
        }
        Err(e) => {
            tracing::error!("cannot restore the audit settings a crashed node left: {e}");
            Some(takeover)
        }
    }
}

fn write_state(path: &Path, takeover: &Takeover) -> Result<(), LandlockAuditError> {
    let err = |source| LandlockAuditError::State { path: path.to_path_buf(), source };
    let text = serde_json::to_vec(takeover).map_err(|e| err(std::io::Error::other(e)))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The listener thread: reads records until stopped or the node is gone.
fn listen(mut source: Source, node: Weak<Inner>, instance: String, stop: Arc<AtomicBool>) {
    let mut correlator = Correlator::default();
    let lookup = ProcLookup { instance };
    while !stop.load(Ordering::SeqCst) {
        let record = match source.socket.recv() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("the landlock audit listener stops: {e}");
                break;
            }
        };
        let now = Instant::now();
        let mut ready = match record.as_ref().and_then(parse_landlock) {
            Some(r) => correlator.take(r, now, &lookup),
            None => Vec::new(),
        };
        ready.extend(correlator.expire(now, &lookup));
        if ready.is_empty() {
            continue;
        }
        let Some(inner) = node.upgrade() else { break };
        let node = Node { inner };
        for denial in ready {
            tracing::info!(sandbox = %denial.sandbox, detail = %denial.observed.detail, "landlock denial");
            node.record_event(&denial.sandbox, denial.observed);
        }
    }
    if let Some(takeover) = source.takeover {
        give_back(&mut source.socket, &takeover, takeover.enabled_before == 0);
        let _ = std::fs::remove_file(&source.state_path);
        tracing::info!("unregistered as the audit daemon");
    }
}

/// Finds the sandbox a host process belongs to.
pub(crate) trait Lookup {
    /// The sandbox id whose cgroup holds host process `pid`.
    fn sandbox_of(&self, pid: i32) -> Option<String>;
    /// Host process `pid`'s pid inside its sandbox.
    fn inner_pid(&self, pid: i32) -> Option<i32>;
}

struct ProcLookup {
    instance: String,
}

impl Lookup for ProcLookup {
    fn sandbox_of(&self, pid: i32) -> Option<String> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        sandbox_in_cgroups(&text, &self.instance)
    }

    fn inner_pid(&self, pid: i32) -> Option<i32> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        innermost_pid(&text)
    }
}

/// The sandbox id in a `/proc/PID/cgroup` text: the directory below
/// `<instance>` in any hierarchy (`4:memory:/<instance>/<id>`, or the
/// cgroup2 line `0::/<instance>/<id>/...`).
pub(crate) fn sandbox_in_cgroups(text: &str, instance: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        let mut parts = path.trim_start_matches('/').split('/');
        (parts.next()? == instance).then_some(())?;
        let id = parts.next()?;
        (!id.is_empty()).then(|| id.to_string())
    })
}

/// The last `NSpid` entry of `/proc/PID/status`: the pid in the
/// innermost pid namespace, the sandbox's.
pub(crate) fn innermost_pid(status: &str) -> Option<i32> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// A refusal ready to become an event.
#[derive(Debug)]
pub(crate) struct Denial {
    pub sandbox: String,
    pub observed: Observed,
}

#[derive(Debug)]
struct Pending {
    access: LandlockAccess,
    /// Host pid and comm from the event's `AUDIT_SYSCALL` record.
    process: Option<(i32, String)>,
    /// The refused system call's name, from the same record.
    syscall: Option<&'static str>,
    /// Sandbox pid, read while the process still lived.
    inner_pid: Option<i32>,
    since: Instant,
}

/// Groups each event's records by serial and maps domains to sandboxes.
#[derive(Debug, Default)]
pub(crate) struct Correlator {
    pending: BTreeMap<u64, Pending>,
    /// Domain id -> sandbox id, learnt from the domain's creator: the
    /// refused process may be gone before its records are read.
    domains: HashMap<u64, String>,
}

impl Correlator {
    /// Takes one record; returns the refusals it completed.
    pub(crate) fn take(&mut self, record: LandlockRecord, now: Instant, lookup: &dyn Lookup) -> Vec<Denial> {
        match record {
            LandlockRecord::Access(access) => {
                let serial = access.stamp.serial;
                self.pending
                    .insert(serial, Pending { access, process: None, syscall: None, inner_pid: None, since: now });
                Vec::new()
            }
            LandlockRecord::DomainAllocated { domain, pid, .. } => {
                if !self.domains.contains_key(&domain) {
                    if let Some(sandbox) = lookup.sandbox_of(pid) {
                        if self.domains.len() >= DOMAIN_CACHE {
                            self.domains.clear();
                        }
                        self.domains.insert(domain, sandbox);
                    }
                }
                Vec::new()
            }
            LandlockRecord::Syscall { stamp, pid, comm, syscall } => {
                if let Some(p) = self.pending.get_mut(&stamp.serial) {
                    p.syscall = syscall.and_then(|nr| warren_guard::seccomp::syscall_name(nr as i64));
                    p.inner_pid = lookup.inner_pid(pid);
                    p.process = Some((pid, comm));
                }
                Vec::new()
            }
            LandlockRecord::EndOfEvent { stamp } => match self.pending.remove(&stamp.serial) {
                Some(p) => self.finish(p, lookup).into_iter().collect(),
                None => Vec::new(),
            },
            LandlockRecord::DomainFreed { domain, .. } => {
                let serials: Vec<u64> =
                    self.pending.iter().filter(|(_, p)| p.access.domain == domain).map(|(s, _)| *s).collect();
                let gone: Vec<Pending> = serials.into_iter().filter_map(|s| self.pending.remove(&s)).collect();
                let done: Vec<Denial> = gone.into_iter().filter_map(|p| self.finish(p, lookup)).collect();
                self.domains.remove(&domain);
                done
            }
        }
    }

    /// Refusals whose event never ended, once they waited long enough.
    pub(crate) fn expire(&mut self, now: Instant, lookup: &dyn Lookup) -> Vec<Denial> {
        let old: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.since) >= PENDING_GRACE)
            .map(|(s, _)| *s)
            .collect();
        let gone: Vec<Pending> = old.into_iter().filter_map(|s| self.pending.remove(&s)).collect();
        gone.into_iter().filter_map(|p| self.finish(p, lookup)).collect()
    }

    /// The event for a refusal, if it happened in one of this node's sandboxes.
    fn finish(&self, p: Pending, lookup: &dyn Lookup) -> Option<Denial> {
        let sandbox = self
            .domains
            .get(&p.access.domain)
            .cloned()
            .or_else(|| p.process.as_ref().and_then(|(pid, _)| lookup.sandbox_of(*pid)))?;
        let mut observed = Observed::new(SecurityEventKind::Landlock, p.access.detail());
        observed.time_ms = p.access.stamp.time_ms;
        observed.syscall = p.syscall.unwrap_or_default().to_string();
        if let Some((_, comm)) = p.process {
            observed = observed.process(p.inner_pid.unwrap_or(0), comm);
        }
        Some(Denial { sandbox, observed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_guard::audit::{RawRecord, AUDIT_EOE, AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL};

    /// Host pids 100..200 are in sandbox `sb-1`, where pid 100+n is n.
    struct Fake;
    impl Lookup for Fake {
        fn sandbox_of(&self, pid: i32) -> Option<String> {
            (100..200).contains(&pid).then(|| "sb-1".to_string())
        }
        fn inner_pid(&self, pid: i32) -> Option<i32> {
            (100..200).contains(&pid).then_some(pid - 100)
        }
    }

    fn parsed(kind: u16, text: &str) -> LandlockRecord {
        parse_landlock(&RawRecord { kind, text: text.to_string() }).expect(text)
    }

    #[test]
    fn a_full_event_becomes_one_denial_of_the_creators_sandbox() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let access = r#"audit(10.5:7): domain=1f blockers=fs.read_file path="/answers/key" dev="vda" ino=1"#;
        assert!(c.take(parsed(AUDIT_LANDLOCK_ACCESS, access), now, &Fake).is_empty());
        let domain = r#"audit(10.5:7): domain=1f status=allocated mode=enforcing pid=150 uid=0 exe="/x" comm="leader""#;
        assert!(c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake).is_empty());
        let syscall =
            r#"audit(10.5:7): arch=c000003e syscall=257 success=no exit=-13 pid=160 comm="cat" exe="/bin/cat""#;
        assert!(c.take(parsed(AUDIT_SYSCALL, syscall), now, &Fake).is_empty());
        let done = c.take(parsed(AUDIT_EOE, "audit(10.5:7): "), now, &Fake);
        assert_eq!(done.len(), 1);
        let d = &done[0];
        assert_eq!(d.sandbox, "sb-1");
        assert_eq!(d.observed.kind, SecurityEventKind::Landlock);
        assert_eq!(d.observed.detail, "fs.read_file /answers/key");
        assert_eq!((d.observed.pid, d.observed.comm.as_str(), d.observed.time_ms), (60, "cat", 10_005));
        assert_eq!(d.observed.syscall, "openat");
    }

    #[test]
    fn a_known_domain_maps_later_denials_of_gone_processes() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let domain = r#"audit(1.0:1): domain=2a status=allocated mode=enforcing pid=101 uid=0 exe="/x" comm="l""#;
        c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake);
        let access = r#"audit(2.0:2): domain=2a blockers=fs.write_file path="/grader/g" dev="vda" ino=1"#;
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, access), now, &Fake);
        // Host pid 5000 is gone already (not in the fake's range).
        let syscall = r#"audit(2.0:2): arch=c000003e syscall=257 success=no exit=-13 pid=5000 comm="sh" exe="/bin/sh""#;
        c.take(parsed(AUDIT_SYSCALL, syscall), now, &Fake);
        let done = c.take(parsed(AUDIT_EOE, "audit(2.0:2): "), now, &Fake);
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].sandbox.as_str(), done[0].observed.pid), ("sb-1", 0));
    }

    #[test]
    fn events_without_an_end_are_recorded_after_a_grace_and_foreign_ones_never() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let ours = r#"audit(3.0:3): domain=3b blockers=fs.read_file path="/a" dev="vda" ino=1"#;
        let domain = r#"audit(3.0:3): domain=3b status=allocated mode=enforcing pid=120 uid=0 exe="/x" comm="l""#;
        let foreign = r#"audit(3.0:4): domain=4c blockers=fs.read_file path="/b" dev="vda" ino=1"#;
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, ours), now, &Fake);
        c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake);
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, foreign), now, &Fake);
        assert!(c.expire(now, &Fake).is_empty(), "still within the grace");
        let done = c.expire(now + PENDING_GRACE, &Fake);
        assert_eq!(done.len(), 1, "the foreign domain's refusal is not ours");
        assert_eq!(done[0].observed.detail, "fs.read_file /a");
        assert!(c.pending.is_empty());
    }

    #[test]
    fn a_freed_domain_flushes_its_refusals_and_is_forgotten() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let domain = r#"audit(1.0:1): domain=5d status=allocated mode=enforcing pid=130 uid=0 exe="/x" comm="l""#;
        c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake);
        let access = r#"audit(1.0:1): domain=5d blockers=fs.read_file path="/a" dev="vda" ino=1"#;
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, access), now, &Fake);
        let done =
            c.take(parsed(AUDIT_LANDLOCK_DOMAIN, "audit(1.1:2): domain=5d status=deallocated denials=1"), now, &Fake);
        assert_eq!(done.len(), 1);
        assert!(c.domains.is_empty());
    }

    #[test]
    fn cgroup_files_name_the_sandbox_below_the_instance() {
        let v1 = "9:name=systemd:/\n4:memory:/warren-t1/sb-0123abcd\n0::/\n";
        assert_eq!(sandbox_in_cgroups(v1, "warren-t1").as_deref(), Some("sb-0123abcd"));
        let v2 = "0::/warren-t1/sb-9/leader\n";
        assert_eq!(sandbox_in_cgroups(v2, "warren-t1").as_deref(), Some("sb-9"));
        assert_eq!(sandbox_in_cgroups(v1, "warren-t2"), None);
        assert_eq!(sandbox_in_cgroups("4:memory:/warren-t1\n", "warren-t1"), None);
        assert_eq!(sandbox_in_cgroups("4:memory:/process_api/warren-t1/x\n", "warren-t1"), None);
    }

    #[test]
    fn the_innermost_nspid_is_the_sandbox_pid() {
        assert_eq!(innermost_pid("Name:\tcat\nNSpid:\t4242\t7\n"), Some(7));
        assert_eq!(innermost_pid("Name:\tcat\nNSpid:\t4242\n"), Some(4242));
        assert_eq!(innermost_pid("Name:\tcat\n"), None);
    }

    #[test]
    fn modes_parse() {
        assert_eq!("on".parse(), Ok(LandlockAuditMode::On));
        assert_eq!("auto".parse(), Ok(LandlockAuditMode::Auto));
        assert_eq!("off".parse(), Ok(LandlockAuditMode::Off));
        assert!("yes".parse::<LandlockAuditMode>().is_err());
    }
}
