//! Owns the isolation profile applied to every sandbox: which capabilities a
//! sandbox keeps, which kernel files it never sees, which system calls it may
//! make and which calls and ioctls it may not (the seccomp allowlist and deny
//! rules, whose refusals are reported as security events), which files each phase may reach and which signals and
//! abstract sockets it may use (the Landlock ruleset), and the cgroups that
//! bound it (v1 controllers where this host has them, plus a cgroup2
//! directory that later carries eBPF programs), and the reserve a node keeps
//! back from all its sandboxes together; and the kernel's audit channel
//! that reports Landlock's refusals (`audit`), and the fanotify permission
//! events that guard protected paths from outside (`fanotify`, and what a
//! tamper watch marks and refuses with them: `tamper`).
//!
//! Invariant: a profile only ever tightens.
//! Never: executes anything from a sandbox's image.

pub mod audit;
pub mod cgroup;
pub mod fanotify;
pub mod landlock;
pub mod profile;
pub mod reserve;
pub mod seccomp;
pub mod tamper;
