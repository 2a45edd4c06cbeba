//! Warm pools: a create that matches a pool's shape claims an idle member; a
//! claimed member is never handed out twice, so nothing of one user reaches
//! the next.

use std::time::{Duration, Instant};

use serde_json::json;
use warren_tests::*;

const POOL: &str = "image=busybox,cpus=1,memory_mib=128,disk_mib=64,pids=256,size=2";

/// Creates small sandboxes until one comes from the pool (the pool fills in
/// the background once the image exists); bounded.
async fn create_pooled(server: &TestServer) -> warren_api::SandboxInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sb = server.create_small().await;
        if sb.from_pool {
            return sb;
        }
        server.delete(&sb.id).await;
        assert!(Instant::now() < deadline, "no pooled sandbox within 60 s; log:\n{}", server.log_tail(30));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn matching_creates_claim_pool_members_that_are_never_reused() {
    let server = TestServer::start_with(&["--pool", POOL]).await;
    let first = create_pooled(&server).await;
    assert_eq!(server.sh_ok(&first.id, "echo secret > /root/answer; cat /root/answer").await, "secret\n");
    let first_host = server.sh_ok(&first.id, "hostname").await;
    server.delete(&first.id).await;

    let second = create_pooled(&server).await;
    assert_ne!(second.id, first.id);
    assert_ne!(server.sh_ok(&second.id, "hostname").await, first_host, "a member is handed out once");
    let r = server.sh(&second.id, "cat /root/answer").await;
    assert_ne!(r.exit_code, Some(0), "the previous user's file must not exist: {r:?}");
    server.delete(&second.id).await;
    server.finish().await;
}

#[tokio::test]
async fn a_create_of_another_shape_is_made_fresh() {
    let server = TestServer::start_with(&["--pool", POOL]).await;
    let _ = create_pooled(&server).await;
    let other = server.create(small(json!({"memory_mib": 96}))).await;
    assert!(!other.from_pool, "a different memory size must not claim a pool member");
    assert_eq!(server.sh_ok(&other.id, "echo fresh").await, "fresh\n");
    server.finish().await;
}
