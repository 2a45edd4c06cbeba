//! The in-sandbox agent: PID 1 of every container sandbox and of every
//! microVM's guest (see `vm`), and in a full VM a service of the guest's
//! systemd (see `vm::systemd`).
//!
//! Owns: building the sandbox from inside (the template mount namespace
//! its zygote starts first inits in, namespaces it enters, its mounts,
//! `pivot_root`, masks, capability drop, the seccomp filter and the record of
//! what it refused), reaping orphans, running commands with their output
//! streamed back, killing whole process trees on request, and phases: one
//! leader process per phase holds the phase's Landlock domain and starts
//! every command of that phase. The library half is the wire protocol
//! shared with the node side, and the file API's in-root resolution
//! ([`files`]): the node runs it on a container's root from the host, a
//! microVM's init on its own root for the node.
//!
//! Invariants: talks to the node only over file descriptors it inherited
//! (the setup socket and the control listener) or, in a microVM, over the
//! one virtio-serial port the node attached (multiplexed, see [`mux`]);
//! never execs a binary of the
//! image for platform work; writes no logs inside the sandbox.
//! Never: trusts a peer that lives inside the sandbox's own pid namespace;
//! enters a Landlock domain itself (PID 1 must stay able to start a later,
//! looser phase).

pub mod files;
pub mod mux;
pub mod proto;
