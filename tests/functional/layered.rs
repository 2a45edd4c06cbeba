//! Layered images: a directory imported as an EROFS layer into the blob
//! store starts sandboxes through the node's lazy layer cache - mounted once,
//! shared read-only, with the sandbox's writes in its own upper layer.

use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_tests::*;

/// Imports the test rootfs as the layered image `lazybox`.
async fn import_lazybox(server: &TestServer) {
    let rootfs = server.path().join("rootfs");
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "lazybox", "dir": rootfs, "format": "erofs"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
}

#[tokio::test]
async fn an_erofs_image_starts_sandboxes_that_share_its_layer() {
    let server = TestServer::start().await;
    import_lazybox(&server).await;

    let one = server.create(small(json!({"image": "lazybox"}))).await;
    let two = server.create(small(json!({"image": "lazybox"}))).await;
    assert_eq!(
        server.sh_ok(&one.id, "head -1 /etc/passwd; stat -c %u /bin/busybox").await,
        "root:x:0:0:root:/root:/bin/sh\n0\n"
    );
    server.sh_ok(&one.id, "echo mine > /etc/motd").await;
    let r = server.sh(&two.id, "cat /etc/motd").await;
    assert_ne!(r.exit_code, Some(0), "writes stay in the writer's own upper layer: {r:?}");
    let r = server.sh(&two.id, "echo x > /etc/group").await;
    assert_eq!(r.exit_code, Some(0), "the overlay makes the image writable per sandbox: {r:?}");
    assert_eq!(server.sh_ok(&one.id, "head -c 5 /etc/group").await, "root:", "...without touching the shared layer");

    // One EROFS filesystem (one device) serves both sandboxes: each sees an
    // idmapped clone of the cache's single mount.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let data = server.data_dir();
    let erofs: Vec<&str> =
        mounts.lines().filter(|l| l.contains(" - erofs ") && l.contains(data.to_str().unwrap())).collect();
    let mut devices: Vec<&str> = erofs.iter().filter_map(|l| l.split_whitespace().nth(2)).collect();
    devices.dedup();
    assert_eq!(devices.len(), 1, "one shared layer filesystem: {erofs:#?}");
    assert!(erofs.iter().any(|l| l.contains("/layer-cache/mnt/")), "mounted once by the cache: {erofs:#?}");
    server.finish().await;
}

#[tokio::test]
async fn a_missing_layered_image_is_a_bad_request_naming_image() {
    let server = TestServer::start().await;
    let (status, body) = server.try_create(&small(json!({"image": "nowhere"}))).await;
    assert_api_error(status, &body, warren_api::ErrorCode::InvalidRequest, Some("image"));
    server.finish().await;
}

#[tokio::test]
async fn pack_of_a_layered_sandbox_adds_one_diff_layer() {
    let server = TestServer::start().await;
    import_lazybox(&server).await;
    let sb = server.create(small(json!({"image": "lazybox"}))).await;
    server
        .sh_ok(&sb.id, "mkdir -p /work/tmp && echo solved > /work/answer && echo junk > /work/tmp/x && rm /etc/group")
        .await;
    let (status, body) = server
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/pack", sb.id),
            Some(&json!({"image": "lazysnap", "scrub": ["/work/tmp"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["layers"].as_array().map(Vec::len), Some(2), "the base layer + one diff layer: {body}");

    let child = server.create(small(json!({"image": "lazysnap"}))).await;
    assert_eq!(server.sh_ok(&child.id, "cat /work/answer; ls /work").await, "solved\nanswer\n");
    let r = server.sh(&child.id, "cat /etc/group").await;
    assert_ne!(r.exit_code, Some(0), "the deletion is carried as a whiteout: {r:?}");
    server.finish().await;
}

#[tokio::test]
async fn image_stats_report_what_the_lazy_cache_fetched() {
    let server = TestServer::start().await;
    let (_, empty) = server.call(Method::GET, "/v1/images/stats", None).await;
    assert_eq!(empty["layers"].as_array().map(Vec::len), Some(0), "nothing cached before first use: {empty}");
    import_lazybox(&server).await;
    let sb = server.create(small(json!({"image": "lazybox"}))).await;
    server.sh_ok(&sb.id, "cat /bin/busybox > /dev/null").await;

    let (status, stats) = server.call(Method::GET, "/v1/images/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{stats}");
    let layers: Vec<warren_api::LayerCacheStats> = serde_json::from_value(stats["layers"].clone()).unwrap();
    assert_eq!(layers.len(), 1, "{stats}");
    let l = &layers[0];
    assert!(l.mounted && l.leases >= 1, "{l:?}");
    assert!(l.metadata_chunks_fetched >= 1 && l.chunks_fetched >= l.metadata_chunks_fetched, "{l:?}");
    assert!(l.present_bytes <= l.size_bytes && l.bytes_fetched >= l.present_bytes, "{l:?}");
    assert_eq!(l.failed_fills, 0, "{l:?}");
    assert!(stats["store"]["chunks_uploaded"].as_u64() >= Some(1), "{stats}");
    server.finish().await;
}
