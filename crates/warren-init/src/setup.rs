//! Steps 1 to 3 of the setup sequence (see `proto::setup`), run by the
//! first init (forked by the node's init zygote, or exec'd): become
//! non-dumpable, enter a fresh user namespace and, while the host maps it,
//! make the network, IPC and UTS namespaces; become root in it, unshare the
//! remaining namespaces and fork the sandbox's PID 1.
//!
//! The host exec'd this binary (or the zygote it was forked from) from its
//! own filesystem as host root, so this process's memory belongs to the
//! initial user namespace: made non-dumpable before anything else, neither
//! it nor the PID 1 forked from it can be ptraced or have its descriptors
//! opened by root inside the sandbox.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use rustix::process::DumpableBehavior;
use rustix::thread::{Gid, Uid, UnshareFlags};

use crate::error::{InitError, StepContext};
use crate::pid1;
use crate::sys::{self, Forked};
use warren_init::proto::setup::{BuildSpec, HostSays, InitSays};
use warren_init::proto::SETUP_FD;

/// Longest line the host may send on the setup socket.
const MAX_SETUP_LINE_BYTES: usize = 1 << 20;

/// The setup socket (fd [`SETUP_FD`]): one JSON object per line each way.
pub struct SetupChannel {
    socket: File,
}

impl SetupChannel {
    /// Takes ownership of the inherited setup socket.
    pub fn inherit() -> SetupChannel {
        // SAFETY: the host hands init fd SETUP_FD open, and nothing else in
        // this process owns it; it is wrapped exactly once, here.
        SetupChannel { socket: unsafe { File::from_raw_fd(SETUP_FD) } }
    }

    pub fn send(&mut self, message: &InitSays) -> Result<(), InitError> {
        let mut line = serde_json::to_vec(message).map_err(|e| InitError::Protocol(e.to_string()))?;
        line.push(b'\n');
        self.socket.write_all(&line).step(|| "write to the setup socket".into())
    }

    /// Reads one line, and nothing after it: peeks at what arrived, then
    /// takes only up to the newline (one byte per `read` would cost a
    /// system call per byte of the build order).
    fn read_line(&mut self) -> Result<Vec<u8>, InitError> {
        let mut line = Vec::new();
        let mut peeked = [0u8; 4096];
        loop {
            let n = match rustix::net::recv(&self.socket, &mut peeked, rustix::net::RecvFlags::PEEK) {
                Ok((0, _)) => return Err(InitError::Protocol("the host closed the setup socket".into())),
                Ok((n, _)) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(InitError::Sys { step: "read the setup socket".into(), source: e.into() }),
            };
            let end = peeked[..n].iter().position(|&b| b == b'\n');
            let take = end.map_or(n, |i| i + 1);
            if line.len() + take > MAX_SETUP_LINE_BYTES {
                return Err(InitError::Protocol("setup line too long".into()));
            }
            let start = line.len();
            line.resize(start + take, 0);
            self.socket.read_exact(&mut line[start..]).step(|| "read the setup socket".into())?;
            if end.is_some() {
                line.pop();
                return Ok(line);
            }
        }
    }

    /// The build order, then the sandbox's root filesystem: a detached
    /// mount the host sends after the order's line, on one byte of its
    /// own (see [`HostSays::Build`]).
    fn read_build(&mut self) -> Result<(BuildSpec, OwnedFd), InitError> {
        let line = self.read_line()?;
        let spec = match serde_json::from_slice::<HostSays>(&line) {
            Ok(HostSays::Build(spec)) => spec,
            Err(e) => return Err(InitError::Protocol(format!("bad host message: {e}"))),
        };
        // Room for a second byte, so that a host sending more is caught.
        let mut byte = [0u8; 2];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let (got, mut fds) = warren_init::proto::recv_with_fds(self.socket.as_fd(), &mut byte, &mut control)
            .step(|| "read the root filesystem from the setup socket".into())?;
        match (got.bytes, fds.pop()) {
            (1, Some(root)) if fds.is_empty() => Ok((spec, root)),
            (0, _) => Err(InitError::Protocol("the host closed the setup socket".into())),
            (bytes, root) => Err(InitError::Protocol(format!(
                "expected the root filesystem's descriptor on one byte, got {bytes} bytes and {} descriptors",
                fds.len() + usize::from(root.is_some())
            ))),
        }
    }

    /// Gives the socket's descriptor back (PID 1 replaces it with a
    /// placeholder so its number is never reused).
    pub fn into_fd(self) -> OwnedFd {
        self.socket.into()
    }
}

/// Runs the whole setup; never returns. The parent half exits 0 after
/// reporting PID 1, the child half becomes PID 1 and serves. An exec'd
/// first init enters a template mount namespace of its own first
/// (`enter_template`); one the zygote forked is in the zygote's.
pub fn run(enter_template: bool) -> ! {
    let mut channel = SetupChannel::inherit();
    let (mut channel, failure) = match prepare(&mut channel, enter_template) {
        Ok(prepared) => fork_pid1(channel, prepared),
        Err(e) => (channel, e),
    };
    let _ = channel.send(&InitSays::Failed { message: failure.to_string() });
    sys::exit_now(1)
}

/// What steps 1 and 2 produced, carried into the fork.
struct Prepared {
    spec: BuildSpec,
    /// The sandbox's root filesystem, a detached mount.
    root: OwnedFd,
    self_exe: OwnedFd,
}

fn prepare(channel: &mut SetupChannel, enter_template: bool) -> Result<Prepared, InitError> {
    rustix::process::set_dumpable_behavior(DumpableBehavior::NotDumpable)
        .step(|| "step 1: prctl(PR_SET_DUMPABLE, 0)".into())?;
    if enter_template {
        crate::template::enter().step(|| "step 1".into())?;
    }
    // Opened now, long before the pivot into the image: session commands
    // later exec this very binary through it.
    let self_exe = rustix::fs::open(
        "/proc/self/exe",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .step(|| "step 1: open /proc/self/exe".into())?;
    // SAFETY: init is single-threaded here (no thread was ever started) and
    // only NEWUSER is unshared, never the descriptor table.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWUSER) }
        .step(|| "step 1: unshare(CLONE_NEWUSER)".into())?;
    channel.send(&InitSays::UsernsReady)?;
    // While the host writes the id maps and mounts the root: the network
    // namespace is the costly one to make (half a millisecond of the
    // kernel's per-namespace set-up), and none of these three needs either.
    // Made now, they belong to the new user namespace all the same.
    // SAFETY: still single-threaded; the descriptor table is not unshared.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNET | UnshareFlags::NEWIPC | UnshareFlags::NEWUTS) }
        .step(|| "step 2: unshare(net, ipc, uts namespaces)".into())?;
    let (spec, root) = channel.read_build()?;
    become_root()?;
    // SAFETY: still single-threaded; the descriptor table is not unshared.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNS | UnshareFlags::NEWPID | UnshareFlags::NEWCGROUP) }
        .step(|| "step 3: unshare(mount, pid, cgroup namespaces)".into())?;
    Ok(Prepared { spec, root, self_exe })
}

/// Takes uid and gid 0 of the new user namespace (mapped by the host to the
/// sandbox's base id). The raw, per-thread calls are right: init has one
/// thread.
fn become_root() -> Result<(), InitError> {
    let root_gid = Gid::from_raw(0);
    let root_uid = Uid::from_raw(0);
    rustix::thread::set_thread_res_gid(root_gid, root_gid, root_gid).step(|| "step 3: setresgid(0, 0, 0)".into())?;
    // Supplementary groups inherited from the host would show up as
    // `nogroup`; drop them when the host's gid_map write allows it.
    match rustix::thread::set_thread_groups(&[]) {
        Ok(()) | Err(rustix::io::Errno::PERM) => {}
        Err(e) => return Err(e).step(|| "step 3: setgroups([])".into()),
    }
    rustix::thread::set_thread_res_uid(root_uid, root_uid, root_uid).step(|| "step 3: setresuid(0, 0, 0)".into())
}

/// Forks PID 1 of the new pid namespace. Returns only on failure, handing
/// the channel back to report it.
fn fork_pid1(mut channel: SetupChannel, prepared: Prepared) -> (SetupChannel, InitError) {
    // Closed when the parent exits: PID 1 waits for that before it speaks,
    // so the host always reads `Pid1` before `Ready` or `Failed`.
    let (parent_done_rx, parent_done_tx) = match rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) {
        Ok(pair) => pair,
        Err(e) => return (channel, InitError::Sys { step: "step 3: pipe".into(), source: e.into() }),
    };
    // SAFETY: init is single-threaded (no thread was ever started).
    match unsafe { sys::fork() } {
        Err(e) => (channel, InitError::Sys { step: "step 3: fork".into(), source: e }),
        Ok(Forked::Parent { child }) => {
            let code = match channel.send(&InitSays::Pid1 { pid: child }) {
                Ok(()) => 0,
                Err(_) => 1,
            };
            sys::exit_now(code)
        }
        Ok(Forked::Child) => {
            drop(parent_done_tx);
            pid1::run(channel, prepared.spec, prepared.root, prepared.self_exe, parent_done_rx)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_line_is_read_whole_and_nothing_after_it() {
        let (mut host, init) = UnixStream::pair().unwrap();
        let mut channel = SetupChannel { socket: File::from(OwnedFd::from(init)) };
        host.write_all(b"{\"a\":").unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            host.write_all(b"1}\nafter").unwrap();
            host
        });
        assert_eq!(channel.read_line().unwrap(), b"{\"a\":1}");
        let _host = writer.join().unwrap();
        let mut rest = [0u8; 5];
        channel.socket.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"after");
    }

    #[test]
    fn a_closed_socket_mid_line_is_a_protocol_error() {
        let (mut host, init) = UnixStream::pair().unwrap();
        let mut channel = SetupChannel { socket: File::from(OwnedFd::from(init)) };
        host.write_all(b"{\"partial\"").unwrap();
        drop(host);
        assert!(matches!(channel.read_line(), Err(InitError::Protocol(_))));
    }
}
