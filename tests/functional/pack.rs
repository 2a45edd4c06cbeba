//! `pack_diff`: a sandbox's writable layer becomes the top layer of a new
//! image that starts new sandboxes - with deletions, ownership and modes
//! carried over, and scrubbed paths gone from the new image (also those
//! only a lower layer holds).

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
            // `/usr/bin/wget` (an applet's link) and `/etc/passwd` are the base layer's,
            // which the sandbox never wrote; `/work/build` is its own.
            Some(&json!({"image": "snap", "scrub": ["/work/build", "/usr/bin/wget", "/root/../etc/passwd"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["layers"].as_array().map(Vec::len), Some(2), "base layer + the packed one: {body}");

    let child = server.create(small(json!({"image": "snap"}))).await;
    let out = server.sh_ok(&child.id, "cat /work/code.py; stat -c '%u:%g %a' /work/code.py; ls /work").await;
    assert_eq!(out, "fixed\n1234:5678 4750\ncode.py\n", "content, owner and mode carry over; the scrubbed dir is gone");
    let r = server.sh(&child.id, "cat /etc/group").await;
    assert_ne!(r.exit_code, Some(0), "a file deleted in the packed sandbox stays deleted: {r:?}");
    let left =
        server.sh_ok(&child.id, "for p in /usr/bin/wget /etc/passwd; do [ -e $p ] || [ -L $p ] && echo $p; done; true");
    assert_eq!(left.await, "", "scrubbed paths of the base layer are gone from the new image");
    assert_eq!(
        server.sh_ok(&child.id, "readlink /usr/bin/wc; stat -c '%a %u:%g' /usr/bin /etc").await,
        "/bin/busybox\n755 0:0\n755 0:0\n",
        "the rest of their directories stays as it was"
    );

    // The source sandbox keeps running and is unchanged.
    assert_eq!(server.sh_ok(&sb.id, "cat /work/build/answer; readlink /usr/bin/wget").await, "leak\n/bin/busybox\n");
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
