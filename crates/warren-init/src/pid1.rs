//! Step 4 of the setup sequence, run by PID 1 of the new pid namespace:
//! build the sandbox's view of the system, seal the process, take on the
//! seccomp profile, start the first phase's leader (see `leader`), then
//! serve.

use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::Arc;

use crate::error::{InitError, StepContext};
use crate::events::EventLog;
use crate::leader::StartError;
use crate::phase::Phases;
use crate::reaper::Registry;
use crate::setup::SetupChannel;
use crate::{rootfs, seal, seccomp, serve, sys};
use warren_init::proto::setup::{BuildSpec, InitSays};
use warren_init::proto::PhaseRules;
use warren_init::proto::{LISTEN_FD, SETUP_FD};

/// The descriptor number PID 1 keeps its own executable at (the first one
/// after the setup socket and the listener).
pub const SELF_EXE_FD: i32 = LISTEN_FD + 1;

pub fn run(mut channel: SetupChannel, spec: BuildSpec, root: OwnedFd, self_exe: OwnedFd, parent_done: OwnedFd) -> ! {
    let built = build(&spec, root);
    wait_for_parent(parent_done);
    let built = built.and_then(|()| settle_fds(self_exe)).and_then(restrict);
    let built =
        built.and_then(|(self_exe, children, events)| Ok((first_phase(self_exe, spec.phase)?, children, events)));
    let ((phases, registry), children, events) = match built {
        Ok(ready) => ready,
        Err(e) => {
            let said = match e {
                InitError::PhaseRejected(message) => InitSays::PhaseRejected { message },
                e => InitSays::Failed { message: e.to_string() },
            };
            let _ = channel.send(&said);
            sys::exit_now(1)
        }
    };
    if channel.send(&InitSays::Ready).is_err() {
        sys::exit_now(1)
    }
    if retire_setup_socket(channel).is_err() {
        // The host already read `Ready`; ending the sandbox is the only way
        // left to tell it.
        sys::exit_now(1)
    }
    serve::run(phases, events, serve::Reaping { registry, children })
}

fn build(spec: &BuildSpec, root: OwnedFd) -> Result<(), InitError> {
    rootfs::build(root)?;
    rustix::system::sethostname(spec.hostname.as_bytes())
        .step(|| format!("step 4: sethostname({:?})", spec.hostname))?;
    if spec.loopback {
        sys::bring_loopback_up().step(|| "step 4: bring up lo".into())?;
    }
    seal::apply()
}

/// Leaves open only 0-2, the setup socket, the listener and this binary.
fn settle_fds(self_exe: OwnedFd) -> Result<OwnedFd, InitError> {
    let self_exe = sys::move_fd(self_exe, SELF_EXE_FD).step(|| "step 4: move /proc/self/exe".into())?;
    sys::close_from(SELF_EXE_FD + 1).step(|| "step 4: close_range".into())?;
    Ok(self_exe)
}

/// Last, once nothing but serving is left: from here on PID 1 and
/// everything it starts run under the seccomp profile. `SIGCHLD` is
/// blocked (and its signalfd made) first, while PID 1 has no other thread,
/// so every thread it starts has it blocked too (see `sys::child_exit_fd`).
fn restrict(self_exe: OwnedFd) -> Result<(OwnedFd, OwnedFd, Arc<EventLog>), InitError> {
    let children = sys::child_exit_fd().step(|| "step 4: signalfd(SIGCHLD)".into())?;
    let events = Arc::new(EventLog::new(crate::events::CAPACITY));
    seccomp::start(&events)?;
    Ok((self_exe, children, events))
}

/// After the seccomp filter (so every leader, and every process it
/// starts, runs under it): the registry PID 1's service loop reaps for,
/// and the first phase's leader.
fn first_phase(self_exe: OwnedFd, rules: PhaseRules) -> Result<(Arc<Phases>, Arc<Registry>), InitError> {
    let registry = Registry::new();
    let name = rules.name.clone();
    let phases = Phases::start(Arc::clone(&registry), self_exe, rules).map_err(|e| match e {
        StartError::Rejected(message) => InitError::PhaseRejected(message),
        StartError::Io(e) => InitError::Sys { step: format!("step 4: start phase `{name}`"), source: e },
    })?;
    Ok((Arc::new(phases), registry))
}

/// Blocks until the forking parent has exited (its end of the pipe closes),
/// i.e. until it has sent `Pid1`.
fn wait_for_parent(parent_done: OwnedFd) {
    let mut byte = [0u8; 1];
    loop {
        match rustix::io::read(&parent_done, &mut byte) {
            Err(rustix::io::Errno::INTR) => {}
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

/// Closes the setup socket but keeps its number taken by `/dev/null`, so no
/// later pipe or connection ever gets fd 3: session commands rely on fds 3
/// and 4 being free to overwrite in the child.
fn retire_setup_socket(channel: SetupChannel) -> Result<(), InitError> {
    let placeholder = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .step(|| "open /dev/null".into())?;
    // dup3 closes the socket's descriptor when it puts the placeholder
    // there, so the socket's handle is given up, not closed.
    let _socket_fd = channel.into_fd().into_raw_fd();
    let placeholder = sys::move_fd(placeholder, SETUP_FD).step(|| "retire the setup socket".into())?;
    let _kept_forever = placeholder.into_raw_fd();
    Ok(())
}
