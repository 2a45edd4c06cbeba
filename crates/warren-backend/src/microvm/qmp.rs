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

use serde_json::Value;

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

/// Connects, leaves capabilities negotiation, runs `command` and returns
/// its `return` value; an `error` answer is an error naming QEMU's reason.
fn execute(sock: &Path, command: &str) -> Result<Value> {
    let io = |what: &str, e: std::io::Error| BackendError::io(format!("QMP {what} on {}", sock.display()), e);
    let stream = UnixStream::connect(sock).map_err(|e| io("connect", e))?;
    stream.set_read_timeout(Some(QMP_TIMEOUT)).map_err(|e| io("set timeout", e))?;
    stream.set_write_timeout(Some(QMP_TIMEOUT)).map_err(|e| io("set timeout", e))?;
    let mut writer = stream.try_clone().map_err(|e| io("clone", e))?;
    let mut reader = BufReader::new(stream);
    let greeting = read_message(&mut reader).map_err(|e| io("greeting", e))?;
    if greeting.get("QMP").is_none() {
        return Err(BackendError::Protocol(format!("not a QMP greeting: {greeting}")));
    }
    request(&mut reader, &mut writer, "qmp_capabilities")?;
    request(&mut reader, &mut writer, command)
}

fn request(reader: &mut impl BufRead, writer: &mut impl Write, command: &str) -> Result<Value> {
    let io = |e: std::io::Error| BackendError::io(format!("QMP {command}"), e);
    let line = format!("{}\n", serde_json::json!({ "execute": command }));
    writer.write_all(line.as_bytes()).map_err(io)?;
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

    #[test]
    fn no_qemu_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(stop(&dir.path().join("qmp.sock")).is_err());
    }
}
