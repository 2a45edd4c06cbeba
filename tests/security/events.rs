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
