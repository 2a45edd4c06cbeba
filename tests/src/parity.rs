//! The parity suite: one set of behavioural cases that every backend
//! (`function`, `container`, `microvm`, `vm`) passes the same way, so that
//! moving a task between backends is one parameter. `tests/functional/
//! parity.rs` runs it once per backend.
//!
//! The cases: exec (argv and shell forms, environment, exit codes and
//! signals, cwd, stdin, separate streams, ordered streaming, a deadline
//! that kills the whole tree and keeps the partial output, capped output
//! with head, tail and a count of what was dropped, kill of a running
//! exec, a missing program naming its field), limits (memory -> `oom`,
//! a full disk -> `ENOSPC` inside, more processes than `pids` -> held at
//! the limit, the sandbox usable after each),
//! sessions, files (round trip, typed errors, `..` and symlinks that stay
//! inside), `pack_diff` into an image a new sandbox starts from, phases
//! (protected paths; a job kept from an earlier phase held to the current
//! one's by the tamper watch, with a `tamper` event), security events, pause and resume, and the typed end reasons
//! `idle_timeout`, `lifetime` and `deleted`.
//!
//! Where a backend differs by design the difference is asserted, not
//! skipped: a function sandbox keeps no state between calls, so sessions,
//! files and `pack_diff` answer the typed `unsupported` error naming the backend, and
//! its hostname is its worker's (a worker is made before anyone asks for
//! it), not the sandbox id.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{
    Backend, EndReason, ErrorCode, ExecFrame, ExecRequest, ExecResult, ExecStatus, FileKind, FileList, FileStat,
    SandboxInfo, SandboxState, StreamName,
};

use crate::guest::pause_or_resume;
use crate::{
    assert_api_error, b64, chunked_body, end_result, frame_bytes, from_json, pattern, stderr, stdout, TestServer,
};

/// How one backend's sandboxes are asked for.
pub struct Subject<'a> {
    pub server: &'a TestServer,
    pub backend: Backend,
    /// The create request (backend, image, resources), `env` and the
    /// timers are added per case.
    pub create: Value,
}

impl Subject<'_> {
    fn memory_mib(&self) -> u64 {
        self.create["memory_mib"].as_u64().expect("the create request names memory_mib")
    }

    fn disk_mib(&self) -> u64 {
        self.create["disk_mib"].as_u64().expect("the create request names disk_mib")
    }

    /// Whether calls share state (a function sandbox's do not).
    fn stateful(&self) -> bool {
        self.backend != Backend::Function
    }

    async fn create_with(&self, extra: Value) -> SandboxInfo {
        let mut body = self.create.clone();
        if let (Some(base), Value::Object(extra)) = (body.as_object_mut(), extra) {
            base.extend(extra);
        }
        let (status, answer) = self.server.try_create(&body).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{:?} create failed: {answer}\nlog:\n{}",
            self.backend,
            self.server.log_tail(30)
        );
        let info: SandboxInfo = from_json(answer);
        assert_eq!((info.backend, info.state), (self.backend, SandboxState::Running), "{info:?}");
        info
    }

    /// The main sandbox of the suite, with `FROM_SANDBOX=s` in its
    /// environment and, where the backend has them, the phases of
    /// [`phase_cases`].
    pub async fn create(&self) -> SandboxInfo {
        let extra = json!({"env": {"FROM_SANDBOX": "s"}});
        self.create_with(if self.stateful() { with_phases(extra) } else { extra }).await
    }
}

/// Every case on `id` (made by [`Subject::create`]), and the timer end
/// reasons on sandboxes of their own; the caller deletes `id`.
pub async fn run_all(subject: &Subject<'_>, id: &str) {
    // The timers run while the cases do (a VM's boot is the slow part).
    let timers = spawn_timer_sandboxes(subject).await;
    exec_cases(subject, id).await;
    limit_cases(subject, id).await;
    session_cases(subject, id).await;
    file_cases(subject, id).await;
    pack_cases(subject, id).await;
    phase_cases(subject, id).await;
    event_cases(subject, id).await;
    timer_ends(subject, timers).await;
    pause_cases(subject, id).await;
}

fn with<F: FnOnce(&mut ExecRequest)>(mut req: ExecRequest, f: F) -> ExecRequest {
    f(&mut req);
    req
}

pub async fn exec_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    // argv and shell forms, the sandbox's environment and hostname.
    let r = server.exec_wait(id, &ExecRequest::argv(["printf", "%s|", "a b", "$HOME", "c"])).await;
    assert_eq!(stdout(&r), "a b|$HOME|c|");
    let r = server.sh(id, "echo $((6 * 7)) $FROM_SANDBOX; hostname").await;
    let mut lines = stdout(&r).lines();
    assert_eq!(lines.next(), Some("42 s"), "{r:?}");
    let hostname = lines.next().unwrap_or_default();
    match subject.stateful() {
        true => assert_eq!(hostname, id, "the hostname is the sandbox id"),
        false => assert!(!hostname.is_empty(), "a function worker has a hostname"),
    }

    // Exit codes and signals.
    for (cmd, code) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        let r = server.sh(id, cmd).await;
        assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, Some(code), None), "`{cmd}`");
    }
    let r = server.sh(id, "kill -9 $$").await;
    assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, None, Some(9)), "{r:?}");

    // cwd, stdin, separate streams.
    let r = server.exec_wait(id, &with(ExecRequest::argv(["pwd"]), |r| r.cwd = Some("/tmp".into()))).await;
    assert_eq!(stdout(&r), "/tmp\n");
    let r = server.exec_wait(id, &with(ExecRequest::argv(["cat"]), |r| r.stdin = Some("line1\nü\n".into()))).await;
    assert_eq!(stdout(&r), "line1\nü\n");
    let r = server.sh(id, "echo out; echo err >&2; echo out2").await;
    assert_eq!((stdout(&r), stderr(&r)), ("out\nout2\n", "err\n"));

    // Streaming: ordered, contiguous frames on both streams.
    let cmd = "i=0; while [ $i -lt 200 ]; do i=$((i+1)); echo out-$i; echo err-$i >&2; done";
    let frames = server.exec_stream(id, &ExecRequest::shell(cmd)).await;
    assert!(matches!(frames[0], ExecFrame::Started { .. }), "{:?}", frames[0]);
    let want_out: String = (1..=200).map(|i| format!("out-{i}\n")).collect();
    let want_err: String = (1..=200).map(|i| format!("err-{i}\n")).collect();
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stdout)).expect("utf-8"), want_out);
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stderr)).expect("utf-8"), want_err);

    // A deadline kills the whole tree and keeps the partial output.
    let req =
        with(ExecRequest::argv(["sh", "-c", "sleep 1000 & echo started; sleep 1000"]), |r| r.timeout_secs = Some(2.0));
    let r = server.exec_wait(id, &req).await;
    assert_eq!((r.status, stdout(&r)), (ExecStatus::TimedOut, "started\n"), "{r:?}");
    assert_no_sleep_left(server, id).await;

    // Output past the cap keeps a head and a tail and counts everything.
    let total: u64 = 5_000_000;
    let req = with(ExecRequest::shell(format!("yes | head -c {total}")), |r| r.output_cap_bytes = Some(65_536));
    let r = server.exec_wait(id, &req).await;
    let out = &r.output.as_ref().expect("output").stdout;
    assert_eq!((r.exit_code, out.total_bytes), (Some(0), total), "{r:?}");
    assert!(out.dropped_bytes > 0, "{out:?}");
    assert_eq!(b64(&out.data_b64).len() as u64 + out.dropped_bytes, total);

    // Kill of a running exec.
    let mut stream = server.exec_open(id, &ExecRequest::shell("echo first; sleep 1000")).await;
    let exec_id = stream.exec_id().await;
    assert!(matches!(stream.next().await, Some(ExecFrame::Output { offset: 0, .. })));
    let (status, body) = server.kill_exec(id, &exec_id).await;
    assert_eq!(status.as_u16(), 202, "{body}");
    assert_eq!(end_result(&stream.collect().await).status, ExecStatus::Killed);
    assert_no_sleep_left(server, id).await;

    // A missing program names the field.
    let (status, body) = server.try_exec_wait(id, &json!({"argv": ["/no/such/program"]})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("argv"));
}

/// Memory and disk: the command that passes the limit fails in the typed
/// way, and the sandbox goes on.
pub async fn limit_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    // `tail` keeps everything after the last newline; /dev/zero has none.
    let r = server.sh(id, &format!("head -c {}m /dev/zero | tail", 4 * subject.memory_mib())).await;
    assert_eq!(r.status, ExecStatus::Oom, "{r:?}");
    assert_eq!(server.sh_ok(id, "echo alive").await, "alive\n", "the sandbox outlives its command's OOM kill");

    let r =
        server.sh(id, &format!("dd if=/dev/zero of=/fill bs=1M count={}; rm -f /fill", subject.disk_mib() + 32)).await;
    assert!(stderr(&r).contains("No space left"), "a write past the disk size fails with ENOSPC: {r:?}");
    assert_eq!(server.sh_ok(id, "echo fits > /small && cat /small").await, "fits\n", "the disk has room again");
    assert_eq!(server.get(id).await.state, SandboxState::Running);

    // More processes than the pids limit: an inner shell starts sleeps
    // until a fork fails (which ends it), then the outer one counts them
    // with builtins only (at the limit nothing new can start) and kills
    // its whole process group. A child the inner shell forked may not have
    // exec'd `sleep` yet on a busy host (it is still `sh`): every `sh` but
    // the outer one counts too (CI once counted 30 and 107 sleeps of ~250).
    let pids = subject.create["pids"].as_u64().expect("the create request names pids");
    let bomb = format!(
        "sh -c 'i=0; while [ $i -lt {} ]; do sleep 1000 >/dev/null 2>&1 & i=$((i+1)); done' 2>/dev/null; \
         n=0; for p in /proc/[0-9]*; do [ \"$p\" = /proc/$$ ] && continue; read -r c < $p/comm \
         && {{ [ \"$c\" = sleep ] || [ \"$c\" = sh ]; }} && n=$((n+1)); done 2>/dev/null; \
         echo $n; kill -9 0",
        pids + 100
    );
    let r = server.sh(id, &bomb).await;
    let started: u64 = stdout(&r).trim().parse().unwrap_or_else(|_| panic!("a count: {r:?}"));
    assert!(
        started < pids && started > pids / 2,
        "{:?}: {started} sleeps ran under a pids limit of {pids}: {r:?}",
        subject.backend
    );
    assert_no_sleep_left(server, id).await;
    assert_eq!(server.sh_ok(id, "echo alive").await, "alive\n", "the sandbox outlives its pids limit");
    if subject.stateful() {
        // The node's limit watch saw both (a VM's init counts them for it).
        for field in ["memory_mib", "pids"] {
            wait_limit_hit(subject, id, field).await;
        }
    }
}

/// Waits (a bounded number of looks) for a `limit_hit` event about `field`.
async fn wait_limit_hit(subject: &Subject<'_>, id: &str, field: &str) {
    let prefix = format!("{field}: ");
    let mut seen = Value::Null;
    for _ in 0..240 {
        let (status, list) =
            subject.server.call(Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq=0"), None).await;
        assert_eq!(status, StatusCode::OK, "{list}");
        let events = list["events"].as_array().cloned().unwrap_or_default();
        if events
            .iter()
            .any(|e| e["kind"] == "limit_hit" && e["detail"].as_str().is_some_and(|d| d.starts_with(&prefix)))
        {
            return;
        }
        seen = list;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("{:?}: no limit_hit event about {field}: {seen}", subject.backend);
}

pub async fn session_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    if !subject.stateful() {
        let (status, body) =
            server.call(Method::POST, &format!("/v1/sandboxes/{id}/sessions"), Some(&json!({"cwd": "/"}))).await;
        assert_unsupported(subject.backend, status, &body);
        return;
    }
    let session = server.create_session(id, json!({"cwd": "/"})).await;
    let r = server.session_exec(id, &session.id, "cd /tmp && export GREETING=hi").await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = server.session_exec(id, &session.id, "echo $PWD $GREETING").await;
    assert_eq!(stdout(&r), "/tmp hi\n", "cwd and exports persist across a session's commands");
    let r = server.sh(id, "echo [$GREETING]").await;
    assert_eq!(stdout(&r), "[]\n", "a plain exec does not see the session's exports");
}

const MIB: usize = 1 << 20;

pub async fn file_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    if !subject.stateful() {
        let (status, body) = server.put_file(id, "/tmp/x", "x", None).await;
        assert_unsupported(subject.backend, status, &body);
        let (status, body) = server.stat(id, "/tmp").await;
        assert_unsupported(subject.backend, status, &body);
        return;
    }
    let (status, body) = server.mkdir(id, json!({"path": "/work", "parents": true})).await;
    assert!(status == StatusCode::CREATED || status == StatusCode::CONFLICT, "{status} {body}");

    // Round trip, streamed both ways.
    let data = pattern(3 * MIB + 123);
    let (status, body) = server.put_file(id, "/work/blob.bin", chunked_body(&data), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let stat: FileStat = from_json(body);
    assert_eq!((stat.path.as_str(), stat.kind, stat.size_bytes), ("/work/blob.bin", FileKind::File, data.len() as u64));
    let (status, got) = server.get_file(id, "/work/blob.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert!(got.as_ref() == data.as_slice(), "downloaded {} bytes differ from the {} uploaded", got.len(), data.len());
    assert_eq!(server.sh_ok(id, "wc -c < /work/blob.bin").await.trim(), data.len().to_string());

    // stat, list, mkdir, remove and their typed errors.
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b", "parents": true})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = server.mkdir(id, json!({"path": "/work/a/b"})).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    server.put_file_ok(id, "/work/a/b/x.txt", "hello").await;
    let (status, body) = server.list_dir(id, "/work/a/b").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let entries: Vec<(String, u64)> =
        from_json::<FileList>(body).entries.iter().map(|e| (e.path.clone(), e.size_bytes)).collect();
    assert_eq!(entries, vec![("/work/a/b/x.txt".to_string(), 5)]);
    let (status, body) = server.stat(id, "/work/nope").await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let (status, body) = server.remove_file(id, "/work/a", false).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.remove_file(id, "/work/a", true).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(server.sh_ok(id, "ls -A /work").await, "blob.bin\n", "the tree is gone inside too");

    // `..` and symlinks resolve inside the sandbox's root, never above it.
    server.sh_ok(id, "ln -s / /evil && ln -s ../../../../ /up && echo inside > /tmp/t").await;
    for path in ["/evil/tmp/t", "/up/up/tmp/t", "/../../../../tmp/t"] {
        let (status, body) = server.get_file(id, path).await;
        assert_eq!((status, body.as_ref()), (StatusCode::OK, b"inside\n".as_slice()), "{path}");
    }
    let (status, body) = server.put_file(id, "/up/../tmp/via-up.txt", "landed", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(server.sh_ok(id, "cat /tmp/via-up.txt").await, "landed");
}

/// Refused system calls become security events, read after the result.
/// `pack_diff`: the writable layer (new files, owners, modes, hard and
/// symbolic links, a deleted file of the image) becomes an image that
/// starts a new sandbox of the same backend, without the scrubbed paths
/// (the sandbox's own and one only the image's layer holds); the source
/// sandbox is unchanged.
pub async fn pack_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    let path = format!("/v1/sandboxes/{id}/pack");
    let image = format!("packed-{}", subject.backend.as_str());
    if !subject.stateful() {
        let (status, body) = server.call(Method::POST, &path, Some(&json!({"image": image}))).await;
        assert_unsupported(subject.backend, status, &body);
        return;
    }
    // A file of the image whose loss the guest does not notice: the busybox
    // image has no motd, Debian's systemd image needs its groups.
    let gone = server.sh_ok(id, "for f in /etc/motd /etc/group; do [ -e $f ] && echo $f && break; done").await;
    let gone = gone.trim();
    assert!(!gone.is_empty(), "the image has /etc/motd or /etc/group");
    server
        .sh_ok(
            id,
            &format!(
                "mkdir -p /packed/build && echo fixed > /packed/code.py && echo leak > /packed/build/answer \
                 && chown 1234:5678 /packed/code.py && chmod 4750 /packed/code.py && ln /packed/code.py /packed/hard \
                 && ln -s code.py /packed/soft && rm {gone}"
            ),
        )
        .await;
    // `/bin/tar` is the image's (in Debian's image through its `/bin -> usr/bin` link).
    assert_eq!(server.sh_ok(id, "[ -e /bin/tar ] && echo yes").await, "yes\n", "the image has /bin/tar");
    let scrub = json!({"image": image, "scrub": ["/packed/build", "/bin/tar"]});
    let (status, body) = server.call(Method::POST, &path, Some(&scrub)).await;
    assert_eq!(status, StatusCode::CREATED, "{:?}: {body}\nlog:\n{}", subject.backend, server.log_tail(30));

    let child = subject.create_with(json!({"image": image})).await;
    let out = server
        .sh_ok(
            &child.id,
            &format!(
                "cat /packed/code.py; stat -c '%u:%g %a %h' /packed/code.py; readlink /packed/soft; ls /packed; \
                 [ -e {gone} ] && echo {gone} is back || echo {gone} stays deleted; \
                 [ -e /bin/tar ] && echo tar is there || echo tar is scrubbed"
            ),
        )
        .await;
    assert_eq!(
        out,
        format!("fixed\n1234:5678 4750 2\ncode.py\ncode.py\nhard\nsoft\n{gone} stays deleted\ntar is scrubbed\n"),
        "{:?}: content, owner, mode, links and the deletion carry over; the scrubbed paths are gone\nlog:\n{}",
        subject.backend,
        server.log_tail(30)
    );
    let ended = server.delete(&child.id).await;
    assert_eq!(ended.end_reason, Some(EndReason::Deleted), "{ended:?}");
    assert_eq!(
        server.sh_ok(id, "cat /packed/build/answer; [ -e /bin/tar ] && echo tar").await,
        "leak\ntar\n",
        "the source sandbox keeps its files"
    );
}

/// `work` protects nothing; `tidy` neither (a switch to it kills what
/// `work` left running); `grade` hides `/work/answers`.
fn phases() -> Value {
    json!({"work": {}, "tidy": {}, "grade": {"protected_paths": {"/work/answers": "none", "/work/tests": "read"}}})
}

/// Phases: a switch kills what earlier phases left running; protected
/// paths hold for root in a container and a microVM (whose root has none
/// of a guest root's ways around them), and a full VM, whose systemd would
/// run anything outside the phase's rules, refuses them as unsupported
/// (the sandbox stays in its phase). A function sandbox has no phases.
pub async fn phase_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    if !subject.stateful() {
        let (status, body) = server.try_create(&with_phases(subject.create.clone())).await;
        assert_unsupported(subject.backend, status, &body);
        return;
    }
    let phase_path = format!("/v1/sandboxes/{id}/phase");
    server
        .sh_ok(
            id,
            "mkdir -p /work/answers /work/tests && echo secret > /work/answers/key && echo check > /work/tests/t \
             && (sleep 1000 >/dev/null 2>&1 &)",
        )
        .await;
    let (status, body) = server.call(Method::PUT, &phase_path, Some(&json!({"name": "tidy"}))).await;
    assert_eq!(status, StatusCode::OK, "{:?}: {body}", subject.backend);
    assert_eq!(body["phase"], "tidy", "{body}");
    assert_no_sleep_left(server, id).await;

    // A job of `tidy` that reads the answers when asked to, kept into
    // `grade`: it has `tidy`'s Landlock domain, so only the tamper watch
    // (the node's for a container, the guest's own for a microVM) holds it
    // to `grade`'s rules.
    let reader = "while :; do if [ -e /tmp/go ]; then cat /work/answers/key > /tmp/leak 2>&1; rm /tmp/go; fi; \
                  sleep 0.05; done";
    server.sh_ok(id, &format!("({reader}) >/dev/null 2>&1 &")).await;
    let keep = json!({"name": "grade", "kill_running": false});
    let (status, body) = server.call(Method::PUT, &phase_path, Some(&keep)).await;
    match subject.backend {
        Backend::Vm => {
            assert_unsupported(subject.backend, status, &body);
            assert_eq!(server.get(id).await.phase.as_deref(), Some("tidy"), "a refused switch changes nothing");
            assert_eq!(server.sh_ok(id, "cat /work/answers/key").await, "secret\n");
            let (status, body) = server.call(Method::PUT, &phase_path, Some(&json!({"name": "work"}))).await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        _ => {
            assert_eq!(status, StatusCode::OK, "{:?}: {body}", subject.backend);
            let r = server.sh(id, "cat /work/answers/key").await;
            assert_ne!(r.exit_code, Some(0), "a hidden path is hidden from root: {r:?}");
            assert!(stderr(&r).contains("Permission denied"), "{r:?}");
            // Read-only holds for truncate(2) too (Landlock ABI 3).
            let r = server
                .sh(id, "cat /work/tests/t; truncate -s 0 /work/tests/t; echo x >> /work/tests/t; cat /work/tests/t")
                .await;
            assert_eq!(stdout(&r), "check\ncheck\n", "{r:?}");
            // The tamper watch judges each of these opens: every one passes.
            let reads = "n=0; for i in $(seq 30); do cat /work/tests/t >/dev/null || n=$((n+1)); done; echo refused=$n";
            assert_eq!(server.sh_ok(id, reads).await, "refused=0\n", "{:?}", subject.backend);
            assert_no_way_around_the_rules(subject.backend, server, id).await;
            let leaked =
                server.sh_ok(id, "touch /tmp/go; while [ -e /tmp/go ]; do sleep 0.05; done; cat /tmp/leak").await;
            assert!(
                leaked.contains("Operation not permitted") && !leaked.contains("secret"),
                "{:?}: the tamper watch holds the kept job: {leaked}",
                subject.backend
            );
            assert_tamper_event(subject.backend, server, id, "/work/answers/key").await;
            let (status, body) = server.call(Method::PUT, &phase_path, Some(&json!({"name": "work"}))).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            assert_eq!(server.sh_ok(id, "cat /work/answers/key").await, "secret\n");
        }
    }
    // The default switch ended the kept job.
    assert_none_left(server, id, "[/]tmp/go").await;
}

/// Waits (bounded) for a `tamper` event about `path`: a watch answers an
/// access first and records its refusal right after.
async fn assert_tamper_event(backend: Backend, server: &TestServer, id: &str, path: &str) {
    let mut events = Value::Null;
    for _ in 0..200 {
        let (status, list) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq=0"), None).await;
        assert_eq!(status, StatusCode::OK, "{list}");
        let found = list["events"].as_array().is_some_and(|all| {
            all.iter().any(|e| e["kind"] == "tamper" && e["detail"].as_str().is_some_and(|d| d.contains(path)))
        });
        if found {
            return;
        }
        events = list;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{backend:?}: no tamper event about {path} in {events}");
}

/// In a phase that hides `/work/answers`, root has none of the ways around
/// a path rule that a guest kernel's root would have: no disk to read raw
/// (none in `/dev`, and none of its own making), no capability for kernel
/// memory, modules or the kernel's own interfaces, no sysctl naming a
/// program the kernel would run as root outside the phase.
async fn assert_no_way_around_the_rules(backend: Backend, server: &TestServer, id: &str) {
    let tries = server
        .sh(
            id,
            "echo disks: $(find /dev -type b | wc -l); \
             mknod /tmp/disk b 254 0 2>/dev/null && echo mknod: made; \
             echo '|/tmp/helper' > /proc/sys/kernel/core_pattern 2>/dev/null && echo core_pattern: set; \
             cap=$(awk '/^CapEff/ {print $2}' /proc/self/status); \
             echo rawio-admin-module: $(( (0x$cap >> 16) & 0x23 ))",
        )
        .await;
    assert_eq!(stdout(&tries), "disks: 0\nrawio-admin-module: 0\n", "{backend:?}: {tries:?}");
    if backend == Backend::Microvm {
        // The kernel runs `kernel.modprobe` as full root when a process
        // asks for a socket family it has no module of: it is empty.
        assert_eq!(server.sh_ok(id, "cat /proc/sys/kernel/modprobe").await, "\n");
        let raw = server.sh(id, "head -c 64 /proc/kcore | wc -c").await;
        assert_eq!(stdout(&raw).trim(), "0", "{raw:?}");
    }
}

/// `request` with [`phases`], starting in `work`.
fn with_phases(mut request: Value) -> Value {
    request["phases"] = phases();
    request["phase"] = json!("work");
    request
}

pub async fn event_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    let r = server.sh(id, "mkdir -p /mnt/x && mount -t tmpfs none /mnt/x; unshare -n true; echo done").await;
    assert_eq!(stdout(&r), "done\n", "{r:?}");
    let (status, list) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq=0"), None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let syscalls: Vec<&str> =
        list["events"].as_array().expect("events").iter().filter_map(|e| e["syscall"].as_str()).collect();
    for wanted in ["mount", "unshare"] {
        assert!(syscalls.contains(&wanted), "{:?}: no `{wanted}` event in {syscalls:?}", subject.backend);
    }
}

/// How long the ticker is watched running, and paused.
const WINDOW: Duration = Duration::from_secs(3);
/// Prints a line about every 10 ms for as long as it runs.
const TICKER: &str = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.01; done";

/// A running exec makes no progress while its sandbox is paused (what it
/// printed across a paused window is less than across as long a running
/// one); reading the sandbox or its exec does not resume it; the next exec
/// does. Ends with the sandbox paused.
pub async fn pause_cases(subject: &Subject<'_>, id: &str) {
    let server = subject.server;
    let mut ticker = server.exec_open(id, &ExecRequest::shell(TICKER)).await;
    let ticker_id = ticker.exec_id().await;
    assert!(matches!(ticker.next().await, Some(ExecFrame::Output { .. })), "the ticker prints");
    drop(ticker);

    let before_run = printed(server, id, &ticker_id).await;
    tokio::time::sleep(WINDOW).await;
    let ran = printed(server, id, &ticker_id).await - before_run;

    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    let before_pause = printed(server, id, &ticker_id).await;
    tokio::time::sleep(WINDOW).await;
    let across_pause = printed(server, id, &ticker_id).await - before_pause;
    assert_eq!(server.get(id).await.state, SandboxState::Paused, "neither GET nor the probe ends the pause");
    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    eprintln!("{:?}: the ticker printed {ran} bytes running, {across_pause} paused", subject.backend);
    assert!(across_pause < ran, "the ticker ran while paused: {across_pause} bytes paused, {ran} running");

    pause_or_resume(server, id, "resume", SandboxState::Running).await;
    let resumed = printed(server, id, &ticker_id).await;
    moves_past(server, id, &ticker_id, resumed).await;

    // The next exec resumes a paused sandbox, and the ticker moves on.
    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
    let paused_at = printed(server, id, &ticker_id).await;
    assert_eq!(server.sh_ok(id, "echo awake").await, "awake\n");
    assert_eq!(server.get(id).await.state, SandboxState::Running);
    moves_past(server, id, &ticker_id, paused_at).await;

    let (status, body) = server.kill_exec(id, &ticker_id).await;
    assert_eq!(status.as_u16(), 202, "{body}");
    let ended = server.wait_exec(id, &ticker_id, Duration::from_secs(60)).await;
    assert_eq!(ended.status, ExecStatus::Killed, "{ended:?}");
    // Left paused: the suite's last step, the delete, is of a paused sandbox.
    pause_or_resume(server, id, "pause", SandboxState::Paused).await;
}

/// Bytes the exec printed so far (its record, which does not resume the sandbox).
async fn printed(server: &TestServer, id: &str, exec_id: &str) -> u64 {
    let r: ExecResult = server.get_exec(id, exec_id).await;
    r.output.as_ref().map_or(0, |o| o.stdout.total_bytes)
}

async fn moves_past(server: &TestServer, id: &str, exec_id: &str, after: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n = printed(server, id, exec_id).await;
        if n > after {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the exec stays at {n} bytes, not past {after}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sandboxes that end by their timers while the other cases run.
pub struct TimerSandboxes {
    idle: String,
    lifetime: String,
}

/// Long enough for a full VM's boot to finish inside it: the lifetime
/// counts from the create.
const LIFETIME_SECS: u64 = 10;

async fn spawn_timer_sandboxes(subject: &Subject<'_>) -> TimerSandboxes {
    let (idle, lifetime) = tokio::join!(
        subject.create_with(json!({"idle_timeout_secs": 2})),
        subject.create_with(json!({"idle_timeout_secs": 3600, "lifetime_secs": LIFETIME_SECS})),
    );
    TimerSandboxes { idle: idle.id, lifetime: lifetime.id }
}

async fn timer_ends(subject: &Subject<'_>, timers: TimerSandboxes) {
    let server = subject.server;
    for (id, want) in [(&timers.idle, EndReason::IdleTimeout), (&timers.lifetime, EndReason::Lifetime)] {
        let ended = server.wait_ended(id, Duration::from_secs(120)).await;
        assert_eq!(ended.end_reason, Some(want), "{:?}: {ended:?}", subject.backend);
        let (status, body) = server.try_exec_wait(id, &json!({"argv": ["true"]})).await;
        assert_eq!(status, StatusCode::GONE, "an ended sandbox refuses execs: {body}");
    }
}

fn assert_unsupported(backend: Backend, status: StatusCode, body: &Value) {
    assert_api_error(status, body, ErrorCode::Unsupported, None);
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains(backend.as_str()), "the error names the backend {backend:?}: {body}");
}

/// Bounded: no `sleep 1000` of an exec left in the sandbox. Reads /proc, so
/// it means the same on busybox and on a full Debian.
async fn assert_no_sleep_left(server: &TestServer, id: &str) {
    assert_none_left(server, id, "^sleep 1000 $").await;
}

/// Bounded: no process whose command line matches `pattern` (a `grep`
/// regex that must not match itself) left in the sandbox.
async fn assert_none_left(server: &TestServer, id: &str, pattern: &str) {
    let count = format!(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '{pattern}'; true"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = server.sh(id, &count).await;
        // Right after a kill at the pids limit the dying processes still
        // count until init has reaped them: a fork can fail for a moment.
        let reaping = stderr(&r).contains("can't fork");
        if !reaping {
            assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(0)), "{r:?}");
            if stdout(&r).trim() == "0" {
                return;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "`{pattern}` survives its exec: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
