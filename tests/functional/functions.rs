//! The function-call backend: `POST /v1/functions/run` runs one call in a
//! fresh worker that is destroyed afterwards, with files in and out, a
//! deadline and a memory limit; calls beyond the pool's workers queue, a
//! full queue answers 429; `backend: "function"` sandboxes run every exec
//! in a fresh worker. The busybox test image has `sh` only; the
//! interpreted and compiled languages run against the default image when
//! it was built (`scripts/make-default-image.sh`).

use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{ErrorCode, ExecStatus, FetchStatus, FunctionResult};
use warren_tests::*;

const POOL: &str = "image=busybox,min=1,max=2,queue=4,memory_mib=64,disk_mib=16,pids=128";
const DEFAULT_ROOTFS: &str = "/var/cache/warren/default-rootfs";

async fn try_run(server: &TestServer, body: &Value) -> (StatusCode, Value) {
    server.call(Method::POST, "/v1/functions/run", Some(body)).await
}

async fn run(server: &TestServer, mut body: Value) -> FunctionResult {
    if body.get("image").is_none() {
        body["image"] = json!("busybox");
    }
    let (status, answer) = try_run(server, &body).await;
    assert_eq!(status, StatusCode::OK, "{body} -> {answer}\nlog:\n{}", server.log_tail(30));
    serde_json::from_value(answer.clone()).unwrap_or_else(|e| panic!("cannot parse {answer}: {e}"))
}

fn out(r: &FunctionResult) -> &str {
    &r.exec.output.as_ref().expect("a function result carries its output").stdout.text
}

fn fetched(r: &FunctionResult, path: &str) -> String {
    let f = &r.files[path];
    assert_eq!(f.status, FetchStatus::Ok, "{path}: {f:?}");
    let data = base64::engine::general_purpose::STANDARD.decode(f.data_b64.as_deref().unwrap_or_default()).unwrap();
    String::from_utf8(data).unwrap()
}

#[tokio::test]
async fn sh_code_reads_stdin_and_files_and_its_outputs_come_back() {
    let server = TestServer::start_with(&["--function-pool", POOL]).await;
    let r = run(
        &server,
        json!({
            "language": "sh",
            "code": "read name; echo \"hello $name from $(pwd)\"; cat data/in.txt; echo result > out.txt; echo oops >&2; exit 3",
            "stdin": "judge\n",
            "files": {"data/in.txt": "input line\n"},
            "fetch": ["out.txt", "/nothing/here"],
        }),
    )
    .await;
    assert_eq!(r.exec.status, ExecStatus::Ok);
    assert_eq!(r.exec.exit_code, Some(3));
    assert_eq!(out(&r), "hello judge from /work\ninput line\n");
    assert_eq!(r.exec.output.as_ref().unwrap().stderr.text, "oops\n");
    assert_eq!(fetched(&r, "out.txt"), "result\n");
    assert_eq!(r.files["/nothing/here"].status, FetchStatus::Missing);
    let t = r.timings;
    assert!(t.total_secs >= t.run_secs && t.run_secs > 0.0 && t.queue_secs >= 0.0, "{t:?}");

    let argv = run(&server, json!({"argv": ["/bin/echo", "a b"], "cwd": "/srv"})).await;
    assert_eq!(out(&argv), "a b\n");
    let cmd = run(&server, json!({"command": "pwd; echo $GREETING", "env": {"GREETING": "hi"}})).await;
    assert_eq!(out(&cmd), "/work\nhi\n");
    let binary = run(&server, json!({"command": "od -An -tx1 blob", "files_b64": {"blob": "AAH/"}})).await;
    assert_eq!(out(&binary).split_whitespace().collect::<Vec<_>>(), ["00", "01", "ff"]);
    server.finish().await;
}

#[tokio::test]
async fn bad_calls_are_refused_naming_the_field() {
    let server = TestServer::start_with(&["--function-pool", POOL]).await;
    let cases = [
        (json!({"image": "busybox"}), ErrorCode::InvalidRequest, "code"),
        (json!({"image": "busybox", "code": "print(1)"}), ErrorCode::InvalidRequest, "language"),
        (json!({"image": "busybox", "language": "cobol", "code": "x"}), ErrorCode::InvalidRequest, "language"),
        (json!({"image": "busybox", "command": "true", "timeout_secs": 0}), ErrorCode::InvalidRequest, "timeout_secs"),
        (json!({"image": "busybox", "command": "true", "memory_mib": 1}), ErrorCode::InvalidRequest, "memory_mib"),
        (
            json!({"image": "busybox", "command": "true", "fetch": ["../../etc/shadow"]}),
            ErrorCode::InvalidRequest,
            "fetch",
        ),
        (
            json!({"image": "busybox", "command": "true", "files_b64": {"x": "%%%"}}),
            ErrorCode::InvalidRequest,
            "files_b64",
        ),
        (json!({"image": "busybox", "command": "true", "colour": 1}), ErrorCode::InvalidRequest, "colour"),
        (json!({"image": "nope", "command": "true"}), ErrorCode::InvalidRequest, "image"),
    ];
    for (body, code, field) in cases {
        let (status, answer) = try_run(&server, &body).await;
        if let Some(why) = api_error_mismatch(status, &answer, code, Some(field)) {
            panic!("{body}: {why}");
        }
    }
    // busybox has sh but no python, compiler or node: the language is named.
    for language in ["python", "bash", "c", "cpp", "javascript"] {
        let body = json!({"image": "busybox", "language": language, "code": "x"});
        let (status, answer) = try_run(&server, &body).await;
        assert_api_error(status, &answer, ErrorCode::InvalidRequest, Some("language"));
        let message = answer["message"].as_str().unwrap_or_default();
        assert!(message.contains(language) && message.contains("busybox"), "{message}");
    }
    server.finish().await;
}

#[tokio::test]
async fn a_call_past_its_deadline_is_killed_and_one_past_its_memory_is_oom() {
    let server = TestServer::start_with(&["--function-pool", POOL]).await;
    let slow = run(&server, json!({"command": "echo started; sleep 600", "timeout_secs": 1})).await;
    assert_eq!(slow.exec.status, ExecStatus::TimedOut, "{slow:?}");
    assert_eq!(out(&slow), "started\n");
    // tail keeps everything after the last newline, and /dev/zero has none.
    let hog = run(&server, json!({"command": "head -c 400m /dev/zero | tail", "memory_mib": 32})).await;
    assert_eq!(hog.exec.status, ExecStatus::Oom, "{hog:?}");
    let after = run(&server, json!({"command": "echo fine"})).await;
    assert_eq!(out(&after), "fine\n");
    server.finish().await;
}

#[tokio::test]
async fn nothing_of_one_call_reaches_the_next() {
    let server = TestServer::start_with(&["--function-pool", POOL]).await;
    let first = run(
        &server,
        json!({"command": "echo secret > /root/answer; echo x > /work/left; (setsid sleep 900 </dev/null >/dev/null 2>&1 &); hostname"}),
    )
    .await;
    assert_eq!(first.exec.status, ExecStatus::Ok);
    for _ in 0..3 {
        let next = run(
            &server,
            json!({"command": "cat /root/answer /work/left 2>&1; ps -o comm | grep -c '^sleep$'; hostname"}),
        )
        .await;
        let text = out(&next);
        assert!(!text.contains("secret") && !text.contains("x\n"), "a file leaked between calls: {text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[lines.len() - 2], "0", "a process leaked between calls: {text}");
        assert_ne!(lines[lines.len() - 1], out(&first).trim(), "a worker was used twice");
    }
    // The one-use workers are destroyed: the leak check at the end finds none.
    server.finish().await;
}

/// Waits until a process whose command line is exactly `cmdline` runs on
/// the host (inside some worker).
async fn wait_for_process(cmdline: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let found = std::fs::read_dir("/proc").into_iter().flatten().flatten().any(|e| {
            let raw = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(String::from_utf8_lossy).collect::<Vec<_>>().join(" ")
                == cmdline
        });
        if found {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "`{cmdline}` never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn calls_beyond_the_workers_queue_and_a_full_queue_answers_429() {
    let server = TestServer::start_with(&["--function-pool", "image=busybox,min=1,max=1,queue=1,memory_mib=64"]).await;
    let marker = "sleep 3.14159";
    let body = json!({"image": "busybox", "argv": ["sleep", "3.14159"]});
    let busy = {
        let (http, url, body) = (server.http.clone(), server.url.clone(), body.clone());
        tokio::spawn(async move {
            api::json_response(api::send(http.post(format!("{url}/v1/functions/run")).json(&body)).await).await
        })
    };
    wait_for_process(marker).await;
    // The one worker is busy: one of these two waits in the queue, the other finds it full.
    let quick = json!({"image": "busybox", "command": "echo queued"});
    let (a, b) = tokio::join!(try_run(&server, &quick), try_run(&server, &quick));
    let (queued, refused) = if a.0 == StatusCode::OK { (a, b) } else { (b, a) };
    assert_eq!(queued.0, StatusCode::OK, "one call queues: {queued:?} / {refused:?}");
    assert_api_error(refused.0, &refused.1, ErrorCode::QueueFull, Some("image"));
    let queued: FunctionResult = serde_json::from_value(queued.1).unwrap();
    assert_eq!(out(&queued), "queued\n");
    assert!(queued.timings.queue_secs > 0.0, "it waited for the busy worker: {:?}", queued.timings);
    let (status, first) = busy.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["exec"]["status"], "ok");
    server.finish().await;
}

#[tokio::test]
async fn a_function_sandbox_runs_every_exec_in_a_fresh_worker() {
    let server = TestServer::start_with(&["--function-pool", POOL]).await;
    let sb = server.create(small(json!({"backend": "function", "memory_mib": 64, "disk_mib": 16, "pids": 128}))).await;
    assert_eq!(sb.backend, warren_api::Backend::Function);
    let first = server.sh(&sb.id, "echo kept > /root/state; hostname").await;
    assert_eq!(first.status, ExecStatus::Ok, "{first:?}");
    let second = server.sh(&sb.id, "cat /root/state 2>/dev/null || echo gone; hostname").await;
    let lines: Vec<&str> = stdout(&second).lines().collect();
    assert_eq!(lines[0], "gone", "an exec of a function sandbox saw an earlier one's file");
    assert_ne!(lines[1], stdout(&first).trim(), "two execs shared a worker");

    // What needs state between calls is refused naming the backend.
    let (status, body) =
        server.call(Method::POST, &format!("/v1/sandboxes/{}/sessions", sb.id), Some(&json!({}))).await;
    assert_api_error(status, &body, ErrorCode::Unsupported, None);
    assert!(body["message"].as_str().unwrap_or_default().contains("function"), "{body}");
    let (status, body) = server.stat(&sb.id, "/").await;
    assert_api_error(status, &body, ErrorCode::Unsupported, None);
    let phased = small(json!({"backend": "function", "phases": {"a": {}}, "phase": "a"}));
    let (status, body) = server.try_create(&phased).await;
    assert_api_error(status, &body, ErrorCode::Unsupported, None);

    // A deadline on a function sandbox's exec works as on a container's.
    let r = server
        .exec_wait(
            &sb.id,
            &warren_api::ExecRequest { timeout_secs: Some(1.0), ..warren_api::ExecRequest::shell("sleep 600") },
        )
        .await;
    assert_eq!(r.status, ExecStatus::TimedOut);
    server.delete(&sb.id).await;
    server.finish().await;
}

/// python, C and C++ (and javascript when node is there) against the
/// default image, which `scripts/test.sh` builds (cached) before the tests.
#[tokio::test]
async fn the_default_images_languages_run() {
    assert!(
        Path::new(DEFAULT_ROOTFS).join(".warren-complete").exists(),
        "no default image at {DEFAULT_ROOTFS}: run `scripts/make-default-image.sh {DEFAULT_ROOTFS}` (scripts/test.sh does)"
    );
    let server = TestServer::start().await;
    let (status, body) =
        server.call(Method::POST, "/v1/images", Some(&json!({"name": "default", "dir": DEFAULT_ROOTFS}))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let py = run(
        &server,
        json!({"image": "default", "language": "python", "code": "import sys\nprint(sum(map(int, sys.stdin.read().split())), sys.argv[1:])", "stdin": "1 2 3", "args": ["x"]}),
    )
    .await;
    assert_eq!(out(&py), "6 ['x']\n", "{py:?}");
    let c = run(
        &server,
        json!({"image": "default", "language": "c", "code": "#include <stdio.h>\nint main(int c, char **v) { printf(\"%d %s\\n\", 6 * 7, v[1]); return 0; }", "args": ["arg"]}),
    )
    .await;
    assert_eq!(out(&c), "42 arg\n", "{c:?}");
    let broken = run(&server, json!({"image": "default", "language": "c", "code": "int main( {"})).await;
    assert_ne!(broken.exec.exit_code, Some(0));
    assert!(broken.exec.output.as_ref().unwrap().stderr.text.contains("error"), "{broken:?}");
    for (language, code, tool) in [("cpp", "int main() {}", "/usr/bin/g++"), ("javascript", "1", "/usr/bin/node")] {
        let body = json!({"image": "default", "language": language, "code": code});
        let (status, answer) = try_run(&server, &body).await;
        if Path::new(DEFAULT_ROOTFS).join(tool.trim_start_matches('/')).exists() {
            assert_eq!(status, StatusCode::OK, "{answer}");
        } else {
            assert_api_error(status, &answer, ErrorCode::InvalidRequest, Some("language"));
        }
    }
    server.finish().await;
}

async fn pool_of(server: &TestServer, image: &str) -> Option<warren_api::FunctionPoolInfo> {
    let (status, body) = server.call(Method::GET, "/v1/functions/pools", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list: warren_api::FunctionPoolList = serde_json::from_value(body).unwrap();
    list.pools.into_iter().find(|p| p.image == image)
}

/// Polls the pool of `image` until `want` holds (bounded).
async fn wait_pool(server: &TestServer, image: &str, what: &str, want: impl Fn(&warren_api::FunctionPoolInfo) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        // The filler makes the configured pool once the image is imported.
        let pool = pool_of(server, image).await;
        if pool.as_ref().is_some_and(&want) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what} never happened: {pool:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_pool_grows_with_demand_and_shrinks_back_within_its_bounds() {
    let server = TestServer::start_with(&["--function-pool", "image=busybox,min=1,max=3,queue=8,memory_mib=64"]).await;
    wait_pool(&server, "busybox", "the pool filling to min", |p| p.idle == 1 && p.target == 1).await;
    // Five calls at once: three run (max), two wait; demand peaks at five.
    let body = json!({"image": "busybox", "argv": ["sleep", "1"]});
    let calls: Vec<_> = (0..5).map(|_| try_run(&server, &body)).collect();
    let answers = futures_util::future::join_all(calls).await;
    for (status, answer) in answers {
        assert_eq!(status, StatusCode::OK, "{answer}");
    }
    let grown = pool_of(&server, "busybox").await.expect("the pool is listed");
    assert_eq!(grown.target, 3, "the target follows the peak, capped at max: {grown:?}");
    wait_pool(&server, "busybox", "the pool growing to its target", |p| p.idle == 3).await;
    wait_pool(&server, "busybox", "the pool shrinking back to min after quiet windows", |p| {
        p.idle == 1 && p.target == 1
    })
    .await;
    server.finish().await;
}

/// A server with the default image imported and a pool of python fork
/// servers for it (`max` zygotes at once).
async fn python_server(max: usize) -> TestServer {
    assert!(
        Path::new(DEFAULT_ROOTFS).join(".warren-complete").exists(),
        "no default image at {DEFAULT_ROOTFS}: run `scripts/make-default-image.sh {DEFAULT_ROOTFS}` (scripts/test.sh does)"
    );
    let pool = format!("image=default,min=1,max={max},queue=8,memory_mib=128,disk_mib=64,pids=128");
    let server = TestServer::start_with(&["--function-pool", &pool]).await;
    let (status, body) =
        server.call(Method::POST, "/v1/images", Some(&json!({"name": "default", "dir": DEFAULT_ROOTFS}))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    server
}

async fn py(server: &TestServer, code: &str, extra: Value) -> FunctionResult {
    let mut body = json!({"image": "default", "language": "python", "code": code});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    run(server, body).await
}

fn err(r: &FunctionResult) -> &str {
    &r.exec.output.as_ref().expect("a function result carries its output").stderr.text
}

#[tokio::test]
async fn python_calls_fork_from_a_warm_interpreter_like_python3_c() {
    let server = python_server(2).await;
    let r = py(
        &server,
        "import os, sys\nprint(sys.stdin.read().upper(), sys.argv, os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], os.environ['GREETING'], os.getuid(), os.getgid())\nprint(open('data/in.txt').read(), end='')\nopen('out.txt', 'w').write('result')\nopen('data/in.txt', 'a').write('appended')\nprint('oops', file=sys.stderr)\nsys.exit(3)",
        json!({"stdin": "judge", "args": ["a", "b"], "files": {"data/in.txt": "input line\n"}, "fetch": ["out.txt", "data/in.txt", "/etc/hostname", "nothing"], "env": {"GREETING": "hi"}}),
    )
    .await;
    assert!(r.forked, "a python call of a pool with fork servers forks: {r:?}");
    assert_eq!(r.exec.status, ExecStatus::Ok);
    assert_eq!(r.exec.exit_code, Some(3), "{r:?}");
    // Not root (the fork server's files are root's), yet the call's
    // directory and the files given with it are its own.
    assert_eq!(out(&r), "JUDGE ['-c', 'a', 'b'] /work /work /work hi 65534 65534\ninput line\n");
    assert_eq!(err(&r), "oops\n");
    assert_eq!(fetched(&r, "out.txt"), "result");
    assert_eq!(fetched(&r, "data/in.txt"), "input line\nappended");
    assert!(!fetched(&r, "/etc/hostname").is_empty());
    assert_eq!(r.files["nothing"].status, FetchStatus::Missing);

    // An uncaught exception: the traceback starts at the code, as with -c.
    let raised = py(&server, "x = 1\n1 / 0", json!({})).await;
    assert!(raised.forked);
    assert_eq!(raised.exec.exit_code, Some(1));
    let text = err(&raised);
    assert!(
        text.starts_with("Traceback (most recent call last):\n  File \"<string>\", line 2, in <module>\n"),
        "{text}"
    );
    assert!(text.ends_with("ZeroDivisionError: division by zero\n"), "{text}");
    let message = py(&server, "import sys; print('partial', end=''); sys.exit('bye')", json!({})).await;
    assert_eq!((message.exec.exit_code, out(&message), err(&message)), (Some(1), "partial", "bye\n"));
    let main = py(
        &server,
        "import __main__, pickle\nclass A: pass\nprint(__name__, __main__.A is A, len(pickle.dumps(A())) > 0)",
        json!({}),
    )
    .await;
    assert_eq!(out(&main), "__main__ True True\n");

    // A cwd that exists in the image cannot be the call's own directory:
    // a one-use worker runs the call, with the same result.
    let tmp = py(&server, "import os; print(os.getcwd())", json!({"cwd": "/tmp"})).await;
    assert!(!tmp.forked, "{tmp:?}");
    assert_eq!(out(&tmp), "/tmp\n");
    // Other languages keep the one-use workers.
    let sh = run(&server, json!({"image": "default", "language": "bash", "code": "echo $((6*7))"})).await;
    assert!(!sh.forked);
    assert_eq!(out(&sh), "42\n");
    server.finish().await;
}

/// What a forked call prints of the metadata Landlock does not guard: the
/// mode of `/tmp`, owner, modification time and extended attributes of
/// `/etc/hostname`.
const METADATA_MARKS: &str =
    "(oct(os.stat('/tmp').st_mode), os.stat('/etc/hostname').st_uid, os.stat('/etc/hostname').st_mtime, os.listxattr('/etc/hostname'))";

#[tokio::test]
async fn nothing_of_a_forked_call_reaches_the_next_on_the_same_fork_server() {
    // One zygote: every call below is served by the same warm interpreter.
    let server = python_server(1).await;
    let first = py(
        &server,
        &r#"
import builtins, os, socket, sys
builtins.LEAKED = 'global'
sys.modules['leaked_module'] = sys
open('left', 'w').write('x')
for path in ['/tmp/x', '/root/answer', '/dev/shm/x']:
    try:
        open(path, 'w').write('secret')
        print('wrote', path)
    except PermissionError:
        print('refused', path)
# Landlock does not cover a file's mode, owner, times or xattrs.
print(MARKS)
for what, attempt in [('chmod', lambda: os.chmod('/tmp', 0o700)),
                      ('chown', lambda: os.chown('/etc/hostname', 1234, 1234)),
                      ('utime', lambda: os.utime('/etc/hostname', (12345, 12345))),
                      ('xattr', lambda: os.setxattr('/etc/hostname', 'user.leak', b'secret'))]:
    try:
        attempt()
        print('changed', what)
    except OSError:
        print('refused', what)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp('sleep', ['sleep', '1000'])
    os._exit(0)
os.wait()
print(socket.gethostname())
"#
        .replace("MARKS", METADATA_MARKS),
        json!({}),
    )
    .await;
    assert!(first.forked, "{first:?}");
    assert_eq!(first.exec.status, ExecStatus::Ok, "{first:?}");
    let lines: Vec<&str> = out(&first).lines().collect();
    assert_eq!(lines[..3], ["refused /tmp/x", "refused /root/answer", "refused /dev/shm/x"], "{lines:?}");
    let marks = lines[3];
    assert_eq!(lines[4..8], ["refused chmod", "refused chown", "refused utime", "refused xattr"], "{lines:?}");
    let hostname = lines[8];
    for _ in 0..3 {
        let next = py(
            &server,
            &r#"
import builtins, os, socket, sys
print(MARKS)
sleepers = []
for pid in os.listdir('/proc'):
    try:
        if pid.isdigit() and open('/proc/%s/cmdline' % pid, 'rb').read().startswith(b'sleep'):
            sleepers.append(pid)
    except OSError:
        pass
print(os.listdir('.'), [p for p in ['/tmp/x', '/root/answer', '/dev/shm/x'] if os.path.exists(p)])
print(hasattr(builtins, 'LEAKED'), 'leaked_module' in sys.modules, sleepers)
print(socket.gethostname())
"#
            .replace("MARKS", METADATA_MARKS),
            json!({}),
        )
        .await;
        assert!(next.forked, "{next:?}");
        let lines: Vec<&str> = out(&next).lines().collect();
        assert_eq!(lines[0], marks, "a file's mode, owner, times or xattrs changed between calls");
        assert_eq!(lines[1], "[] []", "a file leaked between calls: {lines:?}");
        assert_eq!(lines[2], "False False []", "state or a process leaked between calls: {lines:?}");
        assert_eq!(lines[3], hostname, "the calls did not share their fork server, so this proves nothing");
    }
    server.finish().await;
}

/// The pool's sandboxes (workers and fork servers) as the host sees them.
fn pool_sandboxes(server: &TestServer) -> Vec<std::ffi::OsString> {
    let dirs = warren_tests::leaks::sandbox_cgroup_dirs(&server.instance);
    let mut names: Vec<std::ffi::OsString> = dirs.iter().filter_map(|d| d.file_name().map(Into::into)).collect();
    names.sort();
    names.dedup();
    names
}

/// [`pool_sandboxes`] once two looks 500 ms apart agree (within 30 s).
async fn settled_pool_sandboxes(server: &TestServer) -> Vec<std::ffi::OsString> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut last = pool_sandboxes(server);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = pool_sandboxes(server);
        if now == last {
            return now;
        }
        assert!(tokio::time::Instant::now() < deadline, "the pool's sandboxes never settled: {now:?}");
        last = now;
    }
}

#[tokio::test]
async fn a_steady_caller_keeps_its_fork_server_and_the_pool_makes_and_drops_none() {
    // One call at a time: one zygote serves them all, and the zygote that
    // serves a call counts toward the pool's target (no spare is made
    // during a call, to be dropped after it).
    let server = python_server(1).await;
    let first = py(&server, "print('warm')", json!({})).await;
    assert!(first.forked, "{first:?}");
    wait_pool(&server, "default", "the first call to settle", |p| {
        p.busy == 0 && p.idle == 1 && p.idle_fork_servers == 1
    })
    .await;
    // The pool settles by dropping the plain worker it started with; its
    // teardown (and cgroups) may outlast the pool's counts. Wait until the
    // sandboxes stay put, so that the loop below sees only what calls do.
    let before = settled_pool_sandboxes(&server).await;
    for i in 0..8 {
        let r = py(&server, "print('again')", json!({})).await;
        assert!(r.forked && r.warm_worker, "{r:?}");
        assert_eq!(pool_sandboxes(&server), before, "call {i}: the pool made or dropped a sandbox");
    }
    server.finish().await;
}

#[tokio::test]
async fn a_forked_call_cannot_signal_or_read_its_fork_server() {
    let server = python_server(1).await;
    let r = py(
        &server,
        r#"
import os
me, reached, tried = os.getpid(), [], 0
for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != me]:
    tried += 1
    for what, attempt in [('signal', lambda: os.kill(pid, 0)),
                          ('environ', lambda: open('/proc/%d/environ' % pid, 'rb').read()),
                          ('mem', lambda: open('/proc/%d/mem' % pid, 'rb'))]:
        try:
            attempt()
            reached.append((pid, what))
        except PermissionError:
            pass
try:
    os.kill(os.getppid(), 9)
    print('killed the parent')
except PermissionError as e:
    print('parent:', e.errno)
print(tried, reached)
"#,
        json!({}),
    )
    .await;
    assert!(r.forked, "{r:?}");
    let lines: Vec<&str> = out(&r).lines().collect();
    assert_eq!(lines.len(), 2, "the call did not get to report (did it kill its leader?): {r:?}");
    assert_eq!(lines[0], "parent: 1", "{r:?}");
    let (tried, reached) = lines[1].split_once(' ').unwrap();
    // PID 1 (init), the zygote and the call's leader at least.
    assert!(tried.parse::<u32>().unwrap() >= 3, "{lines:?}");
    assert_eq!(reached, "[]", "the call reached a process outside its own domain");
    let after = py(&server, "print('fine')", json!({})).await;
    assert!(after.forked);
    assert_eq!(out(&after), "fine\n");
    server.finish().await;
}

#[tokio::test]
async fn a_forked_call_past_its_deadline_or_memory_ends_typed_and_the_pool_recovers() {
    let server = python_server(1).await;
    let slow = py(
        &server,
        "import os, time\nprint('started', flush=True)\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(600)",
        json!({"timeout_secs": 1}),
    )
    .await;
    assert!(slow.forked, "{slow:?}");
    assert_eq!(slow.exec.status, ExecStatus::TimedOut, "{slow:?}");
    assert_eq!(out(&slow), "started\n");
    let hog = py(&server, "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))", json!({})).await;
    assert!(hog.forked, "{hog:?}");
    assert_eq!(hog.exec.status, ExecStatus::Oom, "{hog:?}");
    let after = py(&server, "print('fine')", json!({})).await;
    assert!(after.forked, "{after:?}");
    assert_eq!((after.exec.status, out(&after)), (ExecStatus::Ok, "fine\n"));
    // The answer comes on the exit report; the call keeps its slot until
    // its leader has swept it away, a moment later.
    let mut pool = None;
    for _ in 0..200 {
        let (status, body) = server.call(Method::GET, "/v1/functions/pools", None).await;
        assert_eq!(status, StatusCode::OK);
        let pools: warren_api::FunctionPoolList = serde_json::from_value(body).unwrap();
        let p = pools.pools.into_iter().find(|p| p.image == "default").expect("the default image's pool");
        if p.busy == 0 {
            pool = Some(p);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(pool.is_some(), "the call's slot was never given back");
    server.finish().await;
}
