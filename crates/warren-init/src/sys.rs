//! The system calls `rustix` does not wrap (or wraps in a way init cannot
//! use), each behind a safe function. All `unsafe` of init's own logic
//! outside `pre_exec` hooks lives here.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// What `fork` returned to this process.
pub enum Forked {
    Parent { child: i32 },
    Child,
}

/// Forks the calling process.
///
/// # Safety
/// After `fork` the child may only use state no other thread could have
/// held locked at the fork: anything, when the process is single-threaded;
/// otherwise only its own descriptors and memory and glibc's allocator
/// (whose `fork` resets its locks in the child). The phase leader relies
/// on the second case.
pub unsafe fn fork() -> io::Result<Forked> {
    // SAFETY: the caller guarantees the child touches no state another
    // thread could have held locked mid-update.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        child => Ok(Forked::Parent { child }),
    }
}

/// Ends the process at once, without running destructors or `atexit`
/// handlers (the forking parent must not flush or free anything it shares
/// with the child).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` takes no pointers and never returns.
    unsafe { libc::_exit(code) }
}

/// Waits until any child has exited and returns its pid WITHOUT reaping it,
/// so the pid cannot be reused before the caller decides who gets the status.
pub fn wait_any_exited_peek() -> io::Result<i32> {
    // SAFETY: an all-zero `siginfo_t` is a valid value of this plain C struct.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable siginfo_t for the call's duration.
    let rc = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT | libc::__WALL) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: waitid filled `info` for a child that changed state, so the
    // child-related fields of the union are the ones set.
    Ok(unsafe { info.si_pid() })
}

/// Like [`wait_any_exited_peek`], without blocking: `None` when no child
/// has exited (yet), or when there is no child at all.
pub fn exited_child_peek() -> io::Result<Option<i32>> {
    // SAFETY: an all-zero `siginfo_t` is a valid value of this plain C struct.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOWAIT | libc::WNOHANG | libc::__WALL;
    // SAFETY: `info` is a valid, writable siginfo_t for the call's duration.
    let rc = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, flags) };
    if rc == -1 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ECHILD) => Ok(None),
            _ => Err(err),
        };
    }
    // SAFETY: with WNOHANG, waitid leaves `info` zeroed when no child
    // changed state, and otherwise fills the child-related fields.
    let pid = unsafe { info.si_pid() };
    Ok((pid != 0).then_some(pid))
}

/// Blocks `SIGCHLD` in the calling thread (and so in every thread it
/// starts later) and returns a descriptor that becomes readable when one
/// is pending: a child's end can then wake a `poll` loop.
///
/// Must run before the process has any other thread: a thread that does
/// not block the signal could take it, and the descriptor would miss it.
/// Every process forked from here must unblock it again (a leader does
/// in `prepare_leader`; std's `Command` does on its own).
pub fn child_exit_fd() -> io::Result<OwnedFd> {
    // SAFETY: an all-zero `sigset_t` is valid storage; sigemptyset then
    // initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid and writable; the calls only read or write it
    // and this thread's signal mask.
    unsafe {
        if libc::sigemptyset(&mut set) == -1 || libc::sigaddset(&mut set, libc::SIGCHLD) == -1 {
            return Err(io::Error::last_os_error());
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    // SAFETY: `set` is a valid signal set; -1 asks for a new descriptor.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
    if fd == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: signalfd just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Empties a [`child_exit_fd`]: the pending `SIGCHLD` only says "some
/// child ended", and the caller then looks at every child.
pub fn drain_child_exit_fd(fd: BorrowedFd<'_>) {
    let mut buf = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
    loop {
        match rustix::io::read(fd, &mut buf) {
            Ok(n) if n > 0 => {}
            Err(rustix::io::Errno::INTR) => {}
            _ => return,
        }
    }
}

/// The wait status and resource usage of a reaped process.
pub struct Reaped {
    pub status: i32,
    pub rusage: libc::rusage,
}

/// Reaps `pid` if it has exited; `Ok(None)` while it runs. Never blocks:
/// a caller that looked at a zombie before taking the lock it reaps under
/// may find its pid reaped by another thread meanwhile and already reused
/// by a process that still runs.
pub fn reap_if_exited(pid: i32) -> io::Result<Option<Reaped>> {
    let mut status = 0;
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `status` and `rusage` are valid and writable for the call.
        let rc = unsafe { libc::wait4(pid, &mut status, libc::__WALL | libc::WNOHANG, &mut rusage) };
        if rc == pid {
            return Ok(Some(Reaped { status, rusage }));
        }
        if rc == 0 {
            return Ok(None);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The pid of the process at the other end of a unix socket, as seen from
/// this process's pid namespace: 0 when the peer lives outside it.
///
/// (`rustix`'s `socket_peercred` cannot be used: its `Pid` is non-zero by
/// type, and 0 is exactly the answer that matters here.)
pub fn peer_pid(socket: BorrowedFd<'_>) -> io::Result<i32> {
    let mut cred = libc::ucred { pid: -1, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable ucred and `len` holds its exact size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::other("short SO_PEERCRED answer"));
    }
    Ok(cred.pid)
}

/// Closes every descriptor numbered `first` or above.
pub fn close_from(first: RawFd) -> io::Result<()> {
    // SAFETY: close_range only closes descriptors; the caller owns all of
    // them (init is single-threaded and holds no other handle to them).
    if unsafe { libc::close_range(first as libc::c_uint, libc::c_uint::MAX, 0) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves `fd` to the exact number `target` (close-on-exec), closing
/// whatever was there. Returns the descriptor now owning `target`.
pub fn move_fd(fd: OwnedFd, target: RawFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() == target {
        return Ok(fd);
    }
    // SAFETY: dup3 only duplicates `fd`; replacing `target` is the point,
    // and the caller owns whatever descriptor had that number.
    let rc = unsafe { libc::dup3(fd.as_raw_fd(), target, libc::O_CLOEXEC) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: dup3 succeeded, so `target` is an open descriptor that nothing
    // else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(target) })
}

/// Sets `IFF_UP` on the loopback interface of this network namespace.
pub fn bring_loopback_up() -> io::Result<()> {
    let sock = inet_socket(rustix::net::AddressFamily::INET)?;
    bring_up(&sock, "lo")
}

/// Gives interface `name` the IPv4 address `addr`/`prefix`, brings it up
/// and routes everything beyond its network through `gateway`.
pub fn configure_ipv4(name: &str, addr: Ipv4Addr, prefix: u8, gateway: Ipv4Addr) -> io::Result<()> {
    let sock = inet_socket(rustix::net::AddressFamily::INET)?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_v4(addr);
    ioctl(&sock, libc::SIOCSIFADDR, &mut req)?;
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix.min(32))).unwrap_or(0);
    req.ifr_ifru.ifru_netmask = sockaddr_v4(Ipv4Addr::from(mask));
    ioctl(&sock, libc::SIOCSIFNETMASK, &mut req)?;
    bring_up(&sock, name)?;
    // SAFETY: an all-zero `rtentry` is a valid value of this plain C
    // struct (null device: the kernel picks it by the gateway).
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr_v4(gateway);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(&sock, libc::SIOCADDRT, &mut route)
}

/// Gives interface `name` (up already) the IPv6 address `addr`/`prefix`
/// and routes everything beyond its network through `gateway`.
pub fn configure_ipv6(name: &str, addr: Ipv6Addr, prefix: u8, gateway: Ipv6Addr) -> io::Result<()> {
    let sock = inet_socket(rustix::net::AddressFamily::INET6)?;
    let c_name = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c_name` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    let index = libc::c_int::try_from(index).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    let mut address =
        libc::in6_ifreq { ifr6_addr: in6(addr), ifr6_prefixlen: u32::from(prefix.min(128)), ifr6_ifindex: index };
    ioctl(&sock, libc::SIOCSIFADDR, &mut address)?;
    let mut route = In6Rtmsg {
        dst: in6(Ipv6Addr::UNSPECIFIED),
        src: in6(Ipv6Addr::UNSPECIFIED),
        gateway: in6(gateway),
        kind: 0,
        dst_len: 0,
        src_len: 0,
        metric: 1,
        info: 0,
        flags: (libc::RTF_UP | libc::RTF_GATEWAY) as u32,
        ifindex: index,
    };
    ioctl(&sock, libc::SIOCADDRT, &mut route)
}

/// The kernel's `struct in6_rtmsg` (`linux/ipv6_route.h`), which the libc
/// crate declares with private fields.
#[repr(C)]
struct In6Rtmsg {
    dst: libc::in6_addr,
    src: libc::in6_addr,
    gateway: libc::in6_addr,
    kind: u32,
    dst_len: u16,
    src_len: u16,
    metric: u32,
    info: libc::c_ulong,
    flags: u32,
    ifindex: libc::c_int,
}

fn in6(addr: Ipv6Addr) -> libc::in6_addr {
    libc::in6_addr { s6_addr: addr.octets() }
}

/// A datagram socket of `family`, for the interface and route ioctls.
fn inet_socket(family: rustix::net::AddressFamily) -> io::Result<OwnedFd> {
    use rustix::net::{socket_with, SocketFlags, SocketType};
    Ok(socket_with(family, SocketType::DGRAM, SocketFlags::CLOEXEC, None)?)
}

/// An `ifreq` naming interface `name`, all else zero.
fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    // SAFETY: an all-zero `ifreq` is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "interface name too long"));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn bring_up(sock: &OwnedFd, name: &str) -> io::Result<()> {
    let mut req = ifreq(name)?;
    ioctl(sock, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS just set the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    ioctl(sock, libc::SIOCSIFFLAGS, &mut req)
}

/// One of the socket ioctls above on `arg` (an `ifreq`, `in6_ifreq`,
/// `rtentry` or `in6_rtmsg`).
fn ioctl<T>(sock: &OwnedFd, request: libc::c_ulong, arg: &mut T) -> io::Result<()> {
    // SAFETY: every caller passes the struct its request reads or writes
    // on its socket's family (SIOC[GS]IF* an `ifreq`, or an `in6_ifreq` on
    // an IPv6 socket; SIOCADDRT an `rtentry`, or an `in6_rtmsg` on an IPv6
    // socket), valid for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, arg as *mut T) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn sockaddr_v4(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(addr.octets()) },
        sin_zero: [0; 8],
    };
    // SAFETY: both are 16 bytes of plain data; the kernel reads a
    // `sockaddr` as the `sockaddr_in` its family names.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Drops capability `number` from the bounding set. `Ok(false)` when the
/// kernel does not know the capability (the end of the list).
pub fn drop_bounding_capability(number: u32) -> io::Result<bool> {
    // SAFETY: PR_CAPBSET_DROP takes a capability number and no pointers.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, number as libc::c_ulong, 0, 0, 0) };
    if rc == -1 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EINVAL) => Ok(false),
            _ => Err(err),
        };
    }
    Ok(true)
}

/// Sends `signal` to `pid`; a process that is already gone is not an error.
pub fn signal(pid: i32, signal: i32) {
    // SAFETY: kill takes no pointers. Failure (ESRCH: the process is gone)
    // is what the caller's next scan observes anyway.
    unsafe { libc::kill(pid, signal) };
}

/// The kernel's `struct sigaction` for `rt_sigaction` (x86_64 and the
/// generic layout): not glibc's, which differs.
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// Sets every signal's disposition to the default, in a child between
/// `fork` and `exec`. Ignored signals survive `exec`; a command must not
/// inherit whatever the host process happened to ignore. Raw system calls,
/// because glibc refuses to touch its internal signals (32, 33), and
/// because this runs where only async-signal-safe calls are allowed.
///
/// # Safety
/// Only for a single-threaded child about to `exec`: it also drops any
/// handler the parent's libraries installed.
pub unsafe fn reset_signal_dispositions() {
    let default = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
    for signal in 1..=64 {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: `default` is a valid kernel sigaction and the size is the
        // kernel's sigset size; an unknown signal number only fails EINVAL.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                &default as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// Installs `program` as a seccomp filter of the calling thread (and of
/// every thread and process it creates from now on), with a listener for
/// its `SECCOMP_RET_USER_NOTIF` results, which is returned (close-on-exec).
///
/// `WAIT_KILLABLE_RECV`: once the supervisor has taken a notification,
/// only a fatal signal interrupts the caller, so an ordinary signal cannot
/// make it retry the call and be recorded twice.
pub fn install_seccomp_listener(program: &[warren_guard::seccomp::sock_filter]) -> io::Result<OwnedFd> {
    let filter: Vec<libc::sock_filter> =
        program.iter().map(|i| libc::sock_filter { code: i.code, jt: i.jt, jf: i.jf, k: i.k }).collect();
    let len = u16::try_from(filter.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let fprog = libc::sock_fprog { len, filter: filter.as_ptr().cast_mut() };
    let flags = libc::SECCOMP_FILTER_FLAG_NEW_LISTENER | libc::SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV;
    // SAFETY: `fprog` points at `filter`, which outlives the call; the
    // kernel copies the program and only reads it.
    let rc = unsafe { libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, flags, &fprog) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: with NEW_LISTENER the kernel returns a new descriptor that
    // nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

/// Waits for the next refused call on a seccomp listener.
pub fn seccomp_receive(listener: BorrowedFd<'_>) -> io::Result<libc::seccomp_notif> {
    // SAFETY: an all-zero `seccomp_notif` is a valid value of this plain C
    // struct, and the kernel demands a zeroed buffer.
    let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: NOTIF_RECV writes one `seccomp_notif` into the buffer, whose
    // size the command number encodes.
    let rc = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_RECV, &mut notif) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(notif)
}

/// Whether notification `id` still waits for an answer, i.e. whether its
/// caller is still the process its pid named when it was received.
pub fn seccomp_still_waiting(listener: BorrowedFd<'_>, id: u64) -> bool {
    // SAFETY: NOTIF_ID_VALID only reads the u64 it is given.
    unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_ID_VALID, &id) == 0 }
}

/// Fails the refused call `id` with `errno`.
pub fn seccomp_fail(listener: BorrowedFd<'_>, id: u64, errno: i32) -> io::Result<()> {
    let answer = libc::seccomp_notif_resp { id, val: 0, error: -errno, flags: 0 };
    // SAFETY: NOTIF_SEND only reads the `seccomp_notif_resp` it is given.
    let rc = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_SEND, &answer) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
