//! Security events: every refused system call is recorded with the process
//! that tried it, and the trainer can read them over the API.

use reqwest::{Method, StatusCode};
use warren_api::{SecurityEventKind, SecurityEventList};
use warren_tests::*;

async fn events(server: &TestServer, id: &str, after_seq: u64) -> SecurityEventList {
    let (status, body) =
        server.call(Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq={after_seq}"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body).expect("a SecurityEventList")
}

#[tokio::test]
async fn refused_syscalls_become_events_the_api_lists() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    assert!(events(&server, &sb.id, 0).await.events.is_empty(), "a fresh sandbox has no events");

    let r =
        server.sh(&sb.id, "mkdir -p /mnt && mount -t tmpfs none /mnt; unshare -n true; chroot / true; echo done").await;
    assert_eq!(stdout(&r), "done\n", "refusals are errors, not kills: {r:?}");
    let list = events(&server, &sb.id, 0).await;
    let syscalls: Vec<&str> = list.events.iter().map(|e| e.syscall.as_str()).collect();
    for wanted in ["mount", "unshare", "chroot"] {
        assert!(syscalls.contains(&wanted), "no `{wanted}` event in {syscalls:?}");
    }
    assert!(list.events.iter().all(|e| e.kind == SecurityEventKind::Seccomp && e.pid > 0));
    assert!(list.events.windows(2).all(|w| w[0].seq < w[1].seq), "events are ordered");

    // Polling from the last seen seq returns only what is new.
    let last = list.next_seq - 1;
    server.sh(&sb.id, "chroot / true").await;
    let newer = events(&server, &sb.id, last).await;
    assert_eq!(newer.events.len(), 1, "{newer:?}");
    assert_eq!((newer.events[0].syscall.as_str(), newer.events[0].comm.as_str()), ("chroot", "chroot"));
    server.finish().await;
}

const DEFAULT_ROOTFS: &str = "/var/cache/warren/default-rootfs";

/// The seccomp allowlist leaves ordinary work alone: python3 (with
/// threads, subprocesses and sockets), gcc and g++ compiling and running,
/// git init/add/commit/log, pytest, perl, a fifo and coreutils run in the
/// default image, and the allowlist refuses none of it.
#[tokio::test]
async fn the_default_images_toolchain_runs_under_the_allowlist_without_events() {
    assert!(
        std::path::Path::new(DEFAULT_ROOTFS).join(".warren-complete").exists(),
        "no default image at {DEFAULT_ROOTFS}: run `scripts/make-default-image.sh {DEFAULT_ROOTFS}` (scripts/test.sh does)"
    );
    let server = TestServer::start().await;
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&serde_json::json!({"name": "default", "dir": DEFAULT_ROOTFS})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sb = server.create(small(serde_json::json!({"image": "default", "memory_mib": 512, "disk_mib": 256}))).await;
    let steps = [
        (
            "python3 -c 'import subprocess, threading, socket, json, ssl; t = threading.Thread(target=print, args=(\"thread\",)); t.start(); t.join(); print(subprocess.run([\"echo\", \"sub\"], capture_output=True, text=True).stdout.strip(), socket.socketpair()[0].family.name)'",
            "thread\nsub AF_UNIX\n",
        ),
        (
            "cd /tmp && printf '#include <stdio.h>\\n#include <pthread.h>\\nstatic void *f(void *a) { return a; }\\nint main(void) { pthread_t t; pthread_create(&t, 0, f, 0); pthread_join(t, 0); printf(\"%%d\\\\n\", 6 * 7); return 0; }\\n' > a.c && gcc -O2 -pthread -o a a.c && ./a",
            "42\n",
        ),
        ("cd /tmp && printf '#include <iostream>\\nint main() { std::cout << \"cpp\" << std::endl; }\\n' > b.cc && g++ -o b b.cc && ./b", "cpp\n"),
        (
            "cd /tmp && git init -q r && cd r && echo x > f && git add f && git -c user.name=a -c user.email=a@b commit -qm first && git log --format=%s",
            "first\n",
        ),
        ("cd /tmp && printf 'def test_a():\\n    assert 1\\n' > test_a.py && python3 -m pytest -q -p no:cacheprovider test_a.py | grep -o '1 passed'", "1 passed\n"),
        ("cd /tmp && mkfifo ff && (echo fifo > ff &) && cat ff && cp a a2 && mv a2 a3 && rm a3 ff && perl -e 'print \"perl\\n\"' && ls / | grep -c '^usr$'", "fifo\nperl\n1\n"),
    ];
    for (command, want) in steps {
        let r = server.sh(&sb.id, command).await;
        assert_eq!((stdout(&r), r.exit_code), (want, Some(0)), "`{command}`: {r:?}");
    }
    // The one refusal: coreutils' cp tries a reflink first (a deny rule,
    // FICLONE), then copies.
    let list = events(&server, &sb.id, 0).await;
    let refused: Vec<(&str, &str, &str)> =
        list.events.iter().map(|e| (e.comm.as_str(), e.syscall.as_str(), e.detail.as_str())).collect();
    assert_eq!(refused, vec![("cp", "ioctl", "FICLONE (0x40049409)")], "ordinary work was refused");
    server.delete(&sb.id).await;
    server.finish().await;
}
