//! A small QEMU Machine Protocol client: one connection per command to the
//! QMP socket QEMU serves in the sandbox's run directory (`qmp.sock`).
//!
//! Blocking on purpose: `Driver::resume` is called inline on a request's
//! path and a QMP round trip is a few local socket writes and reads, well
//! below what a thread hop would cost. A connection per command keeps no
//! state that could go stale across a QEMU crash; QEMU's QMP server takes
//! one client at a time, and the node serialises pause and resume.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::{BackendError, Result};

/// Bounds each read and write: a QEMU that stops answering makes the
/// command fail instead of hanging the caller.
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// QMP answers and events are one JSON object a line; nothing we ask for
/// comes near this.
const MAX_LINE_BYTES: u64 = 64 << 10;

/// What `query-status` says of the guest's vCPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub running: bool,
    /// QEMU's run state (`running`, `paused`, `shutdown`, ...).
    pub status: String,
}

/// Stops the guest's vCPUs (QMP `stop`); its memory and devices stay as
/// they are. Returns once every vCPU has stopped.
pub fn stop(sock: &Path) -> Result<()> {
    execute(sock, "stop").map(drop)
}

/// Lets a stopped guest run again (QMP `cont`).
pub fn cont(sock: &Path) -> Result<()> {
    execute(sock, "cont").map(drop)
}

pub fn query_status(sock: &Path) -> Result<Status> {
    let answer = execute(sock, "query-status")?;
    let running = answer.get("running").and_then(Value::as_bool);
    let status = answer.get("status").and_then(Value::as_str);
    match (running, status) {
        (Some(running), Some(status)) => Ok(Status { running, status: status.to_string() }),
        _ => Err(BackendError::Protocol(format!("QMP query-status answered {answer}"))),
    }
}

/// Writes the guest's state (memory and devices) to `file` as a migration
/// stream and returns once it is complete. The guest should be stopped
/// first (then the stream is one consistent moment). The descriptor goes
/// to QEMU over the socket (`getfd`): QEMU is chrooted and may not spawn,
/// so neither `file:` (not in 7.2) nor `exec:` is open to it.
pub fn migrate_to_file(sock: &Path, file: &std::fs::File, timeout: Duration) -> Result<()> {
    use std::os::fd::AsFd;
    let mut session = Session::open(sock)?;
    // QEMU's default bandwidth cap paces a stream meant for a socket to
    // another host; a local file takes it as fast as it comes.
    session.request("migrate-set-parameters", json!({ "max-bandwidth": i64::MAX >> 1 }))?;
    session.request_with_fd("getfd", json!({ "fdname": "snapshot" }), file.as_fd())?;
    session.request("migrate", json!({ "uri": "fd:snapshot" }))?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let state = session.request("query-migrate", json!({}))?;
        match state.get("status").and_then(Value::as_str) {
            Some("completed") => return Ok(()),
            Some("failed" | "cancelled") => {
                let why = state.get("error-desc").and_then(Value::as_str).unwrap_or("no reason given");
                return Err(BackendError::Protocol(format!("QEMU's migration to a file failed: {why}")));
            }
            _ if std::time::Instant::now() >= deadline => {
                let _ = session.request("migrate_cancel", json!({}));
                return Err(BackendError::Protocol(format!("QEMU's migration did not finish within {timeout:?}")));
            }
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Waits until a QEMU started with `-incoming` has loaded the stream: its
/// run state leaves `inmigrate`. A guest snapshotted while stopped stays
/// stopped (`cont` starts it).
pub fn wait_incoming(sock: &Path, timeout: Duration) -> Result<Status> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match query_status(sock) {
            Ok(status) if status.status != "inmigrate" => return Ok(status),
            Ok(_) => {}
            // QEMU creates its socket a moment after it starts.
            Err(BackendError::Gone) if std::time::Instant::now() >= deadline => {
                return Err(BackendError::Protocol(format!(
                    "QEMU did not serve QMP on {} within {timeout:?}",
                    sock.display()
                )))
            }
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        if std::time::Instant::now() >= deadline {
            return Err(BackendError::Protocol(format!("QEMU did not load the snapshot within {timeout:?}")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Connects, leaves capabilities negotiation, runs `command` and returns
/// its `return` value; an `error` answer is an error naming QEMU's reason.
fn execute(sock: &Path, command: &str) -> Result<Value> {
    Session::open(sock)?.request(command, Value::Null)
}

/// The first vCPU's instruction pointer, read `samples` times in a row
/// (QEMU's `info registers`): where a guest that does not come up is.
pub fn instruction_pointers(sock: &Path, samples: usize) -> Result<Vec<u64>> {
    let mut session = Session::open(sock)?;
    let mut rips = Vec::with_capacity(samples);
    for _ in 0..samples {
        let answer = session.request("human-monitor-command", json!({ "command-line": "info registers" }))?;
        let text = answer.as_str().unwrap_or_default();
        let rip = text
            .split_whitespace()
            // `EIP=` before the guest enters long mode.
            .find_map(|word| word.strip_prefix("RIP=").or_else(|| word.strip_prefix("EIP=")))
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .ok_or_else(|| BackendError::Protocol(format!("no RIP in QEMU's registers: {text}")))?;
        rips.push(rip);
    }
    Ok(rips)
}

/// One QMP connection past capabilities negotiation.
struct Session {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Session {
    fn open(sock: &Path) -> Result<Session> {
        let io = |what: &str, e: std::io::Error| BackendError::io(format!("QMP {what} on {}", sock.display()), e);
        let stream = crate::unix_sock::connect_std(sock).map_err(|e| match e.kind() {
            // No QEMU serves the socket: it exited (and the VM with it) or
            // the sandbox's directory was removed. Either way the VM is
            // gone, which callers answer as such rather than as a fault.
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => BackendError::Gone,
            _ => io("connect", e),
        })?;
        stream.set_read_timeout(Some(QMP_TIMEOUT)).map_err(|e| io("set timeout", e))?;
        stream.set_write_timeout(Some(QMP_TIMEOUT)).map_err(|e| io("set timeout", e))?;
        let writer = stream.try_clone().map_err(|e| io("clone", e))?;
        let mut reader = BufReader::new(stream);
        let greeting = read_message(&mut reader).map_err(|e| io("greeting", e))?;
        if greeting.get("QMP").is_none() {
            return Err(BackendError::Protocol(format!("not a QMP greeting: {greeting}")));
        }
        let mut session = Session { reader, writer };
        session.request("qmp_capabilities", Value::Null)?;
        Ok(session)
    }

    fn request(&mut self, command: &str, arguments: Value) -> Result<Value> {
        let line = request_line(command, arguments);
        self.writer.write_all(line.as_bytes()).map_err(|e| BackendError::io(format!("QMP {command}"), e))?;
        answer(&mut self.reader, command)
    }

    /// As [`Session::request`], with `fd` passed along (SCM_RIGHTS).
    fn request_with_fd(&mut self, command: &str, arguments: Value, fd: std::os::fd::BorrowedFd<'_>) -> Result<Value> {
        use std::os::fd::AsFd;
        let line = request_line(command, arguments);
        let sent = warren_init::proto::send_with_fds(self.writer.as_fd(), line.as_bytes(), &[fd])
            .map_err(|e| BackendError::io(format!("QMP {command}"), e))?;
        if sent != line.len() {
            // QEMU takes the descriptor with the first byte; the rest is plain.
            self.writer
                .write_all(&line.as_bytes()[sent..])
                .map_err(|e| BackendError::io(format!("QMP {command}"), e))?;
        }
        answer(&mut self.reader, command)
    }
}

fn request_line(command: &str, arguments: Value) -> String {
    let request = match arguments {
        Value::Null => json!({ "execute": command }),
        arguments => json!({ "execute": command, "arguments": arguments }),
    };
    format!("{request}\n")
}

fn answer(reader: &mut impl BufRead, command: &str) -> Result<Value> {
    let io = |e: std::io::Error| BackendError::io(format!("QMP {command}"), e);
    loop {
        let message = read_message(reader).map_err(io)?;
        // Events (STOP, RESUME, ...) may come before the answer.
        if let Some(value) = message.get("return") {
            return Ok(value.clone());
        }
        if let Some(error) = message.get("error") {
            let why = error.get("desc").and_then(Value::as_str).unwrap_or("no description");
            return Err(BackendError::Protocol(format!("QMP {command} failed: {why}")));
        }
    }
}

fn read_message(reader: &mut impl BufRead) -> std::io::Result<Value> {
    let mut line = String::new();
    let n = reader.take(MAX_LINE_BYTES).read_line(&mut line)?;
    if n == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "QEMU closed the QMP socket"));
    }
    if !line.ends_with('\n') {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "QMP line too long"));
    }
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A real QEMU held before its first instruction (`-S`): its vCPU sits
    /// at the x86 reset vector.
    #[test]
    fn a_stopped_qemu_reports_its_reset_vector() {
        let qemu = Path::new("/usr/bin/qemu-system-x86_64");
        if !qemu.is_file() {
            eprintln!("NOTE: no {}: the QMP register read is checked by the microVM suite only", qemu.display());
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let mut child = std::process::Command::new(qemu)
            .args(["-M", "microvm", "-accel", "tcg", "-nodefaults", "-no-user-config", "-display", "none", "-S"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut rips = None;
        for _ in 0..500 {
            match instruction_pointers(&sock, 2) {
                Ok(r) => {
                    rips = Some(r);
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(rips, Some(vec![0xfff0, 0xfff0]));
    }

    /// A stand-in for QEMU's QMP server: greets, then answers each command
    /// from `answers` in order, with an event before the first.
    fn fake_qemu(listener: UnixListener, answers: Vec<&'static str>) -> std::thread::JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut out = conn.try_clone().unwrap();
            out.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n").unwrap();
            let mut seen = Vec::new();
            let mut lines = BufReader::new(conn).lines();
            for (i, answer) in answers.into_iter().enumerate() {
                seen.push(lines.next().unwrap().unwrap());
                if i == 1 {
                    out.write_all(b"{\"event\": \"STOP\", \"timestamp\": {}}\n").unwrap();
                }
                out.write_all(answer.as_bytes()).unwrap();
                out.write_all(b"\n").unwrap();
            }
            seen
        })
    }

    #[test]
    fn commands_skip_events_and_read_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let server = fake_qemu(
            UnixListener::bind(&sock).unwrap(),
            vec![r#"{"return": {}}"#, r#"{"return": {"running": false, "status": "paused"}}"#],
        );
        let status = query_status(&sock).unwrap();
        assert_eq!(status, Status { running: false, status: "paused".into() });
        let seen = server.join().unwrap();
        assert_eq!(seen, [r#"{"execute":"qmp_capabilities"}"#, r#"{"execute":"query-status"}"#]);
    }

    #[test]
    fn an_error_answer_is_an_error_with_qemus_reason() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let server = fake_qemu(
            UnixListener::bind(&sock).unwrap(),
            vec![r#"{"return": {}}"#, r#"{"error": {"class": "GenericError", "desc": "no way"}}"#],
        );
        let err = cont(&sock).unwrap_err().to_string();
        assert!(err.contains("no way"), "{err}");
        server.join().unwrap();
    }

    /// A QMP server that takes the descriptor `getfd` passes, writes into
    /// it as QEMU's migration would, and reports the migration complete.
    #[test]
    fn migrate_to_file_hands_qemu_the_file_and_waits_for_completion() {
        use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            conn.write_all(b"{\"QMP\": {}}\n").unwrap();
            let mut seen = Vec::new();
            let mut polls = 0;
            loop {
                let mut buf = [0u8; 4096];
                let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let got = recvmsg(&conn, &mut [std::io::IoSliceMut::new(&mut buf)], &mut control, RecvFlags::empty())
                    .unwrap();
                if got.bytes == 0 {
                    return seen;
                }
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(fds) = message {
                        for fd in fds {
                            std::fs::File::from(fd).write_all(b"guest state").unwrap();
                        }
                    }
                }
                let line: Value = serde_json::from_slice(&buf[..got.bytes]).unwrap();
                let command = line["execute"].as_str().unwrap().to_string();
                let answer = match command.as_str() {
                    "query-migrate" if polls == 0 => r#"{"return": {"status": "active"}}"#,
                    "query-migrate" => r#"{"return": {"status": "completed"}}"#,
                    _ => r#"{"return": {}}"#,
                };
                polls += usize::from(command == "query-migrate");
                seen.push(command);
                conn.write_all(format!("{answer}\n").as_bytes()).unwrap();
            }
        });
        let path = dir.path().join("mem");
        let file = std::fs::File::create(&path).unwrap();
        migrate_to_file(&sock, &file, Duration::from_secs(10)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"guest state", "QEMU got the file's descriptor");
        drop(file);
        let seen = server.join().unwrap();
        assert_eq!(
            seen,
            ["qmp_capabilities", "migrate-set-parameters", "getfd", "migrate", "query-migrate", "query-migrate"]
        );
    }

    #[test]
    fn no_qemu_is_a_gone_vm() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        assert!(matches!(stop(&sock), Err(BackendError::Gone)), "no socket");
        // A socket left by a QEMU that was killed: nobody listens.
        drop(UnixListener::bind(&sock).unwrap());
        assert!(matches!(stop(&sock), Err(BackendError::Gone)), "a stale socket");
    }
}
