//! Running a peer tool once, bounded in time, and timing it without polling.
//!
//! The wait is a `poll` on a pidfd of the child, so the measured time ends
//! when the child exits, not at the next tick of a sleep loop.

use std::io::Read;
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::error::{BenchError, Result};

/// No single peer command (a container create, an exec) may take longer.
pub const TOOL_LIMIT: Duration = Duration::from_secs(30);
const MAX_STDERR_BYTES: usize = 2048;

/// The command line as one string, for messages and the report.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` with stdin and stdout on /dev/null and waits for it; returns
/// the wall time from spawn to exit. A non-zero exit is an error carrying
/// the start of its stderr.
pub fn run_timed(cmd: &mut Command) -> Result<Duration> {
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| BenchError::Spawn { program: describe(cmd), source: e })?;
    let waited = wait_bounded(&mut child, TOOL_LIMIT);
    let elapsed = started.elapsed();
    match waited {
        Ok(status) if status.success() => Ok(elapsed),
        Ok(status) => Err(BenchError::Tool {
            command: describe(cmd),
            status: status.to_string(),
            stderr: drain_available(&mut child),
        }),
        Err(BenchError::Timeout { limit, .. }) => {
            // Best effort: the child is ours, so kill and reap it before reporting.
            let _ = child.kill();
            let _ = child.wait();
            Err(BenchError::ToolTimeout { command: describe(cmd), limit })
        }
        Err(e) => Err(e),
    }
}

/// Like [`run_timed`], but the caller only wants to know it worked.
pub fn run(cmd: &mut Command) -> Result<()> {
    run_timed(cmd).map(|_| ())
}

/// Waits for `child` to exit, at most `limit`, and reaps it.
pub fn wait_bounded(child: &mut Child, limit: Duration) -> Result<std::process::ExitStatus> {
    let pid = Pid::from_raw(child.id() as i32).ok_or_else(|| BenchError::parse("child pid", child.id()))?;
    let pidfd = pidfd_open(pid, PidfdFlags::empty()).map_err(|e| BenchError::io("pidfd_open", "child", e.into()))?;
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BenchError::Timeout { what: format!("exit of pid {}", child.id()), limit });
        }
        let timeout = Timespec::try_from(left).unwrap_or(Timespec { tv_sec: 1, tv_nsec: 0 });
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(BenchError::io("poll", "pidfd", e.into())),
        }
    }
    child.wait().map_err(|e| BenchError::io("wait", format!("pid {}", child.id()), e))
}

/// Whatever the child wrote to its piped stderr that can be read without
/// blocking: a detached container may still hold the pipe's write end.
fn drain_available(child: &mut Child) -> String {
    let Some(stderr) = child.stderr.as_mut() else { return String::new() };
    if rustix::io::ioctl_fionbio(stderr.as_fd(), true).is_err() {
        return String::new();
    }
    let mut buf = vec![0u8; MAX_STDERR_BYTES];
    let mut len = 0;
    while len < buf.len() {
        match stderr.read(&mut buf[len..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
    }
    String::from_utf8_lossy(&buf[..len]).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_timed_and_failure_carries_stderr() {
        let took = run_timed(Command::new("/bin/sh").args(["-c", "sleep 0.05"])).unwrap();
        assert!(took >= Duration::from_millis(50));
        let err = run_timed(Command::new("/bin/sh").args(["-c", "echo nope >&2; exit 3"])).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("nope") && text.contains('3'), "{text}");
    }

    #[test]
    fn a_hung_child_is_killed_at_the_limit() {
        let mut child = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let err = wait_bounded(&mut child, Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, BenchError::Timeout { .. }));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn missing_programs_fail_to_spawn() {
        assert!(matches!(run(&mut Command::new("/nonexistent/tool")), Err(BenchError::Spawn { .. })));
    }
}
