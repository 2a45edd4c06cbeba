//! `warren-init`: PID 1 of a container sandbox (see the library's doc for
//! what it owns). Started by the host with the setup socket at fd 3 and the
//! control listener at fd 4 (forked so by the node's init zygote, see
//! `zygote`, or exec'd); or by a microVM's kernel as its PID 1 (see
//! `vm`); or by a full VM's systemd as its agent service (see
//! `vm::systemd`); or, inside a sandbox, by PID 1 as a phase
//! leader (see `leader`), or by a session shell in report-state mode (see
//! `session`).

mod error;
mod events;
mod exec;
mod fileserve;
mod leader;
mod pack;
mod pathsearch;
mod phase;
mod pid1;
mod reaper;
mod rootfs;
mod seal;
mod seccomp;
mod serve;
mod session;
mod setup;
mod sys;
mod template;
mod tree;
mod vm;
mod zygote;

fn main() {
    // Only a microVM's kernel starts this binary as PID 1 of its pid
    // namespace: a container's first init is a host process.
    if rustix::process::getpid().is_init() {
        vm::run()
    }
    let mut args = std::env::args_os().skip(1);
    if let Some(mode) = args.next() {
        if mode == session::REPORT_STATE_ARG {
            session::report_state_main(args)
        }
        if mode == vm::SERVICE_ARG {
            vm::service_main()
        }
        if mode == warren_init::proto::zygote::ARG {
            // Before the first fork: every first init inherits the setting.
            one_malloc_arena();
            zygote::main()
        }
    }
    one_malloc_arena();
    setup::run(true)
}

/// A container's PID 1 has a few threads (the seccomp supervisor, one
/// per connection) and glibc would give each its own
/// arena: a 64 MiB reservation apiece, each with a page of its own plus a
/// page table to map it, in PID 1 and again in every leader forked from
/// it. Its threads allocate little and rarely at once, so one shared
/// arena costs no speed and saves those pages in every idle sandbox.
fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: called before this process starts any thread; `mallopt`
    // only sets a tunable of the allocator.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
