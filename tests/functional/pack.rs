//! `pack_diff`: a sandbox's writable layer becomes the top layer of a new
//! image that starts new sandboxes - with deletions, ownership and modes
//! carried over, and scrubbed paths gone.

use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_api::ErrorCode;
use warren_tests::*;

#[tokio::test]
async fn a_packed_sandbox_starts_new_sandboxes_with_its_changes() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    server
        .sh_ok(
            &sb.id,
            "mkdir -p /work/build && echo fixed > /work/code.py && echo leak > /work/build/answer \
             && chown 1234:5678 /work/code.py && chmod 4750 /work/code.py && rm /etc/group",
        )
        .await;
    let (status, body) = server
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/pack", sb.id),
            Some(&json!({"image": "snap", "scrub": ["/work/build"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["layers"].as_array().map(Vec::len), Some(2), "base layer + the packed one: {body}");

    let child = server.create(small(json!({"image": "snap"}))).await;
    let out = server.sh_ok(&child.id, "cat /work/code.py; stat -c '%u:%g %a' /work/code.py; ls /work").await;
    assert_eq!(out, "fixed\n1234:5678 4750\ncode.py\n", "content, owner and mode carry over; the scrubbed dir is gone");
    let r = server.sh(&child.id, "cat /etc/group").await;
    assert_ne!(r.exit_code, Some(0), "a file deleted in the packed sandbox stays deleted: {r:?}");
    assert_eq!(server.sh_ok(&child.id, "cat /etc/passwd | head -c 4").await, "root", "base files are still there");

    // The source sandbox keeps running and is unchanged.
    assert_eq!(server.sh_ok(&sb.id, "cat /work/build/answer").await, "leak\n");
    server.finish().await;
}

#[tokio::test]
async fn pack_rejects_bad_requests_naming_the_field() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let path = format!("/v1/sandboxes/{}/pack", sb.id);
    let (status, body) = server.call(Method::POST, &path, Some(&json!({"image": "x", "scrub": ["relative"]}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("scrub[0]"));
    let (status, body) = server.call(Method::POST, &path, Some(&json!({"image": "bad name!"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("name"));
    let (status, body) = server.call(Method::POST, &path, Some(&json!({"image": "busybox"}))).await;
    assert_api_error(status, &body, ErrorCode::ImageInUse, Some("name"));
    server.finish().await;
}
