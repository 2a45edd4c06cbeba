//! Security events: what a sandbox tried that the platform refused.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SecurityEventKind {
    /// A system call the seccomp profile refuses (answered with EPERM).
    Seccomp,
    /// A file access the phase's Landlock ruleset refused.
    Landlock,
    /// A connection or datagram the egress policy refused.
    NetworkBlocked,
    /// A name the platform resolver refused to resolve.
    DnsRefused,
    /// The sandbox switched phase (not a refusal; recorded for the timeline).
    PhaseChanged,
    /// The sandbox hit a resource limit (memory, pids, disk, inodes).
    LimitHit,
    /// An access to a protected path that the current phase forbids, by a
    /// process an earlier phase left running, refused by the node's tamper
    /// watch (fanotify; EPERM).
    Tamper,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecurityEvent {
    /// 1, 2, 3, ... per sandbox, in the order the events happened.
    pub seq: u64,
    /// Unix time in milliseconds.
    pub time_ms: u64,
    /// The process as seen inside the sandbox.
    pub pid: i32,
    /// Its command name; empty when it was gone before it could be read.
    pub comm: String,
    pub kind: SecurityEventKind,
    /// The refused system call, e.g. `ioctl` or `unshare`; empty for
    /// events that are not about one system call.
    #[serde(default)]
    pub syscall: String,
    /// What made it a refusal, e.g. `FICLONE (0x40049409)` or `CLONE_NEWUSER`.
    pub detail: String,
}

/// `GET /v1/sandboxes/{id}/events?after_seq=N`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecurityEventList {
    pub events: Vec<SecurityEvent>,
    /// Events lost to the sandbox's bounded event ring since `after_seq`.
    pub dropped: u64,
    /// The `seq` the next event will get: poll again with `after_seq = next_seq - 1`.
    pub next_seq: u64,
    /// Events of each kind since the sandbox started, dropped ones included.
    #[serde(default)]
    pub counts: std::collections::BTreeMap<SecurityEventKind, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only events with a larger `seq` (default 0: all kept events).
    #[serde(default)]
    pub after_seq: u64,
}
