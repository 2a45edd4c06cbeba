//! Landlock denials as security events (`--landlock-audit off|on|auto`).
//!
//! The kernel reports a Landlock refusal only as audit records, and only
//! while audit is enabled host-wide. A listener thread reads them
//! (`warren_guard::audit`), finds the sandbox (the refusing domain's
//! creator, or the refused process, through `/proc/PID/cgroup`) and records
//! a `landlock` event.
//!
//! - `auto` (default) and `on`: with no audit daemon registered, the node
//!   registers itself as the daemon, adds a `never,task` rule (unless one
//!   is in force: tasks then get no audit context, so enabling audit puts
//!   no work on every system call of the host), enables audit and raises a
//!   tiny backlog limit; with a daemon registered, it only listens on the
//!   read-log multicast group. A clean stop deletes exactly the rule it
//!   added, restores `enabled` and the backlog limit and unregisters. The
//!   node must be the daemon whenever it enables audit: without one the
//!   kernel prints every record to the kernel log. When audit cannot be
//!   had, `on` refuses to start and `auto` warns and runs without events
//!   (`GET /v1/stats` `landlock_events` says why).
//! - `off`: nothing (but undoes what a crashed node left, below).
//!
//! Records of tasks without a context have no `AUDIT_SYSCALL`, and each
//! has a serial of its own: the correlator then takes them one by one,
//! mapping the refusing domain to its creator's sandbox.
//!
//! What the node changed is written to `<data>/landlock-audit.json` first,
//! so that the next start after a crash can put it back (the kernel drops a
//! dead daemon by itself, but leaves audit enabled and the rule in place).
//! Never: touches the audit `failure` mode, or a rule it did not add.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use warren_api::{LandlockEvents, SecurityEventKind};
use warren_guard::audit::{
    parse_landlock, AuditError, AuditRule, AuditSocket, AuditStatus, LandlockAccess, LandlockRecord,
    AUDIT_CONFIG_CHANGE,
};

use crate::events::Observed;
use crate::{Inner, Node};

/// How the node gets Landlock's audit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LandlockAuditMode {
    /// Never looks at audit.
    Off,
    /// Becomes the audit daemon and enables audit when no daemon runs;
    /// refuses to start when audit cannot be had.
    On,
    /// Like `on`, but when audit cannot be had (no `CAP_AUDIT_CONTROL`, not
    /// in the initial user and pid namespaces) the node warns and runs
    /// without `landlock` events.
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
    #[error("cannot read Landlock's audit records: {0}")]
    Audit(#[from] AuditError),
    #[error("--landlock-audit: cannot start the listener thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("cannot write {path}: {source}")]
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
    /// Whether the node added the `never,task` rule (and so deletes it).
    #[serde(default)]
    never_rule: bool,
}

/// The running listener; [`Listener::stop`] (or drop) ends it and restores
/// what the node changed.
pub(crate) struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// What `GET /v1/stats` says; the thread marks it unavailable if it ends.
    status: Arc<Mutex<LandlockEvents>>,
}

impl Listener {
    /// Starts listening as `mode` says. Without a thread (`off`, or `auto`
    /// where audit cannot be had) the listener only holds the reason.
    pub(crate) fn start(
        mode: LandlockAuditMode,
        node: Weak<Inner>,
        instance: String,
        data_dir: &Path,
    ) -> Result<Listener, LandlockAuditError> {
        let state_path = data_dir.join(STATE_FILE);
        // Also with `off`: what a crashed node of this data dir left is
        // undone (nothing is touched when it left nothing).
        let left = undo_crashed_takeover(&state_path);
        if mode == LandlockAuditMode::Off {
            if left.is_some() {
                tracing::warn!("--landlock-audit off: a crashed node's audit settings could not be restored");
            }
            return Ok(Listener::idle("--landlock-audit off".into()));
        }
        let mut attempt = take_source(state_path.clone(), left);
        if matches!(&attempt, Err(LandlockAuditError::Audit(e)) if e.is_exists()) {
            // Another node registered as the daemon since the status was
            // read (two starting at once): listen to it instead.
            attempt = take_source(state_path, left);
        }
        let source = match attempt.and_then(|s| {
            s.socket.set_recv_timeout(READ_TICK)?;
            Ok(s)
        }) {
            Ok(source) => source,
            Err(e) if mode == LandlockAuditMode::Auto => {
                tracing::warn!(
                    "landlock denials are NOT security events on this node: {e} (enabling audit needs \
                     CAP_AUDIT_CONTROL in the initial user and pid namespaces; `--landlock-audit off` says \
                     this is intended, `on` makes it fatal)"
                );
                return Ok(Listener::idle(format!("audit cannot be enabled: {e}")));
            }
            Err(e) => return Err(e),
        };
        let status =
            Arc::new(Mutex::new(LandlockEvents { available: source.available, detail: source.detail.clone() }));
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let shown = Arc::clone(&status);
        let thread = std::thread::Builder::new()
            .name("landlock-audit".into())
            .spawn(move || listen(source, node, instance, flag, shown))
            .map_err(LandlockAuditError::Thread)?;
        Ok(Listener { stop, thread: Some(thread), status })
    }

    fn idle(detail: String) -> Listener {
        Listener {
            stop: Arc::new(AtomicBool::new(true)),
            thread: None,
            status: Arc::new(Mutex::new(LandlockEvents { available: false, detail })),
        }
    }

    pub(crate) fn status(&self) -> LandlockEvents {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
    /// A `never,task` rule is in force: the refused tasks have no audit
    /// context, so records come one by one (no `AUDIT_SYSCALL`).
    no_context: bool,
    available: bool,
    detail: String,
}

impl Node {
    /// `GET /v1/stats` `landlock_events`.
    pub(crate) fn landlock_events(&self) -> LandlockEvents {
        match self.inner.landlock_audit.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(listener) => listener.status(),
            None => LandlockEvents { available: false, detail: "the node is not running".into() },
        }
    }
}

/// `left`: a crashed node's takeover that could not be undone; its
/// "before" values are the host's own, not what the host shows now.
fn take_source(state_path: PathBuf, left: Option<Takeover>) -> Result<Source, LandlockAuditError> {
    let mut socket = AuditSocket::open()?;
    let status = socket.status()?;
    let me = std::process::id();
    if status.pid != 0 && status.pid != me && pid_alive(status.pid) {
        tracing::info!(daemon = status.pid, "an audit daemon runs: reading its records from the read-log group");
        let mut detail =
            format!("reading the records of the audit daemon (pid {}) from the read-log group", status.pid);
        if status.enabled == 0 {
            tracing::warn!("audit is disabled by the running audit daemon: no landlock events until it enables it");
            detail.push_str("; it keeps audit disabled");
        }
        let socket = AuditSocket::open_readlog()?;
        // Another daemon's rules decide who has a context: expect one.
        return Ok(Source {
            socket,
            takeover: None,
            state_path,
            no_context: false,
            available: status.enabled != 0,
            detail,
        });
    }
    let rule_in_force = socket.list_rules()?.iter().any(AuditRule::is_task_never);
    let takeover = match left {
        Some(left) => Takeover { pid: me, never_rule: left.never_rule || !rule_in_force, ..left },
        None => Takeover {
            pid: me,
            enabled_before: status.enabled,
            backlog_limit_before: (status.backlog_limit < MIN_BACKLOG_LIMIT).then_some(status.backlog_limit),
            never_rule: !rule_in_force,
        },
    };
    // Written first: a crash between the next calls must be undoable.
    write_state(&state_path, &takeover)?;
    if let Err(e) = take_over(&mut socket, &status, &takeover, rule_in_force) {
        let _ = std::fs::remove_file(&state_path);
        return Err(e.into());
    }
    tracing::info!(
        enabled_before = takeover.enabled_before,
        never_rule_added = takeover.never_rule,
        "registered as the audit daemon: landlock denials become events"
    );
    let detail = "registered as the audit daemon (audit enabled, `never,task` rule in force)".to_string();
    Ok(Source { socket, takeover: Some(takeover), state_path, no_context: true, available: true, detail })
}

/// Registers first, adds the rule second and enables last: enabled with no
/// daemon, the kernel would print records to the kernel log, and a task
/// created while audit is on and the rule is not yet there gets a context
/// for good. On failure, undoes the steps that were taken.
fn take_over(
    socket: &mut AuditSocket,
    status: &AuditStatus,
    takeover: &Takeover,
    rule_in_force: bool,
) -> Result<(), AuditError> {
    socket.set_pid(takeover.pid)?;
    let nothing_else = Takeover { backlog_limit_before: None, ..*takeover };
    if !rule_in_force {
        match socket.add_rule(&AuditRule::task_never()) {
            Ok(()) => {}
            // Added since the list was read: in force, and deleted at the stop.
            Err(e) if e.is_exists() => {}
            Err(e) => {
                let _ = socket.set_pid(0);
                return Err(e);
            }
        }
    }
    if status.enabled == 0 {
        if let Err(e) = socket.set_enabled(1) {
            give_back(socket, &nothing_else, false);
            return Err(e);
        }
    }
    if takeover.backlog_limit_before.is_some() {
        if let Err(e) = socket.set_backlog_limit(MIN_BACKLOG_LIMIT) {
            give_back(socket, &nothing_else, status.enabled == 0);
            return Err(e);
        }
    }
    Ok(())
}

/// Restores the backlog limit, deletes the rule the node added, restores
/// `enabled`, reads what the kernel queued
/// until then (the record of the change itself comes last), and only
/// then unregisters, so nothing queued is left for the kernel log.
fn give_back(socket: &mut AuditSocket, takeover: &Takeover, disable: bool) {
    if let Some(limit) = takeover.backlog_limit_before {
        if let Err(e) = socket.set_backlog_limit(limit) {
            tracing::warn!("cannot restore the audit backlog limit {limit}: {e}");
        }
    }
    if takeover.never_rule {
        match socket.delete_rule(&AuditRule::task_never()) {
            // ENOENT: a crash came before the rule was added, or someone deleted it.
            Err(e) if !e.is_not_found() => tracing::warn!("cannot delete the `never,task` audit rule: {e}"),
            _ => {}
        }
    }
    if disable {
        match socket.set_enabled(0) {
            Ok(()) => drain_until_config_change(socket),
            Err(e) => tracing::warn!("cannot disable audit again: {e}"),
        }
    } else if takeover.never_rule {
        // Audit stays enabled: the record of the rule's removal is queued
        // for this daemon, and would reach the kernel log once it is gone.
        drain_until_quiet(socket);
    }
    if let Err(e) = socket.set_pid(0) {
        tracing::warn!("cannot unregister as the audit daemon: {e}");
    }
}

fn drain_until_quiet(socket: &mut AuditSocket) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match socket.recv() {
            Ok(Some(r)) => tracing::debug!(kind = r.kind, text = %r.text, "audit record after the stop"),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("reading the audit records left: {e}");
                return;
            }
        }
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
fn listen(
    mut source: Source,
    node: Weak<Inner>,
    instance: String,
    stop: Arc<AtomicBool>,
    status: Arc<Mutex<LandlockEvents>>,
) {
    let mut correlator = Correlator { no_context: source.no_context, ..Correlator::default() };
    let lookup = ProcLookup { instance };
    while !stop.load(Ordering::SeqCst) {
        let record = match source.socket.recv() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("the landlock audit listener stops: landlock denials are no longer events: {e}");
                let detail = format!("the audit listener stopped: {e}");
                *status.lock().unwrap_or_else(|p| p.into_inner()) = LandlockEvents { available: false, detail };
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
    /// No record of a refusal has an event context (a `never,task` rule is
    /// in force): nothing follows an access record, so one whose domain is
    /// known is an event at once.
    no_context: bool,
}

impl Correlator {
    /// Takes one record; returns the refusals it completed.
    pub(crate) fn take(&mut self, record: LandlockRecord, now: Instant, lookup: &dyn Lookup) -> Vec<Denial> {
        match record {
            LandlockRecord::Access(access) => {
                let serial = access.stamp.serial;
                let pending = Pending { access, process: None, syscall: None, inner_pid: None, since: now };
                if self.no_context && self.domains.contains_key(&pending.access.domain) {
                    return self.finish(pending, lookup).into_iter().collect();
                }
                self.pending.insert(serial, pending);
                Vec::new()
            }
            LandlockRecord::DomainAllocated { stamp, domain, pid, .. } => {
                if !self.domains.contains_key(&domain) {
                    if let Some(sandbox) = lookup.sandbox_of(pid) {
                        if self.domains.len() >= DOMAIN_CACHE {
                            self.domains.clear();
                        }
                        self.domains.insert(domain, sandbox);
                    }
                }
                // Within an event context the domain record shares the
                // access's serial and the event goes on; a refusal of the
                // domain with another serial had no context: it is complete.
                let alone: Vec<u64> = self
                    .pending
                    .iter()
                    .filter(|(s, p)| p.access.domain == domain && **s != stamp.serial)
                    .map(|(s, _)| *s)
                    .collect();
                let done: Vec<Pending> = alone.into_iter().filter_map(|s| self.pending.remove(&s)).collect();
                done.into_iter().filter_map(|p| self.finish(p, lookup)).collect()
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
    fn without_contexts_records_become_events_one_by_one() {
        let mut c = Correlator { no_context: true, ..Correlator::default() };
        let now = Instant::now();
        // A domain's first refusal: the access record, then the domain's
        // record with a serial of its own (no event context to share).
        let access = r#"audit(10.5:7): domain=1f blockers=fs.read_file path="/answers/key" dev="vda" ino=1"#;
        assert!(c.take(parsed(AUDIT_LANDLOCK_ACCESS, access), now, &Fake).is_empty(), "whose domain is unknown");
        let domain = r#"audit(10.5:8): domain=1f status=allocated mode=enforcing pid=150 uid=0 exe="/x" comm="leader""#;
        let done = c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake);
        assert_eq!(done.len(), 1, "the domain record completes the refusal");
        let d = &done[0];
        assert_eq!((d.sandbox.as_str(), d.observed.detail.as_str()), ("sb-1", "fs.read_file /answers/key"));
        assert_eq!((d.observed.pid, d.observed.comm.as_str(), d.observed.syscall.as_str()), (0, "", ""));
        // Later refusals of the known domain need no other record.
        let again = r#"audit(10.6:9): domain=1f blockers=fs.write_file path="/answers/key" dev="vda" ino=1"#;
        let done = c.take(parsed(AUDIT_LANDLOCK_ACCESS, again), now, &Fake);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].observed.detail, "fs.write_file /answers/key");
        assert!(c.pending.is_empty());
        // A refusal in a domain that is not this node's is never an event.
        let foreign = r#"audit(10.7:10): domain=4c blockers=fs.read_file path="/b" dev="vda" ino=1"#;
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, foreign), now, &Fake);
        let foreign_domain =
            r#"audit(10.7:11): domain=4c status=allocated mode=enforcing pid=7 uid=0 exe="/x" comm="x""#;
        assert!(c.take(parsed(AUDIT_LANDLOCK_DOMAIN, foreign_domain), now, &Fake).is_empty());
        assert!(c.pending.is_empty() && !c.domains.contains_key(&0x4c));
    }

    #[test]
    fn a_contextless_refusal_is_recognised_by_its_serial_when_contexts_are_expected() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let access = r#"audit(1.0:20): domain=6e blockers=fs.read_file path="/a" dev="vda" ino=1"#;
        c.take(parsed(AUDIT_LANDLOCK_ACCESS, access), now, &Fake);
        let domain = r#"audit(1.0:21): domain=6e status=allocated mode=enforcing pid=140 uid=0 exe="/x" comm="l""#;
        let done = c.take(parsed(AUDIT_LANDLOCK_DOMAIN, domain), now, &Fake);
        assert_eq!(done.len(), 1, "no grace needed");
        // A known domain's next refusal may still have a context: it waits.
        let next = r#"audit(1.1:22): domain=6e blockers=fs.read_file path="/a" dev="vda" ino=1"#;
        assert!(c.take(parsed(AUDIT_LANDLOCK_ACCESS, next), now, &Fake).is_empty());
        assert_eq!(c.expire(now + PENDING_GRACE, &Fake).len(), 1);
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
