//! OCI import through the API: an OCI image layout made here from the test
//! rootfs becomes a layered image that starts sandboxes.

use std::fs;
use std::path::Path;
use std::process::Command;

use reqwest::{Method, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};
use warren_api::ErrorCode;
use warren_tests::*;

/// Writes `bytes` as a blob of the layout and returns its descriptor.
fn blob(layout: &Path, media_type: &str, bytes: &[u8]) -> serde_json::Value {
    let hex: String = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
    fs::write(layout.join("blobs/sha256").join(&hex), bytes).unwrap();
    json!({"mediaType": media_type, "digest": format!("sha256:{hex}"), "size": bytes.len()})
}

/// An OCI image layout with one uncompressed layer holding `rootfs`.
fn make_layout(rootfs: &Path, layout: &Path) {
    fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    let tar = layout.join("layer.tar");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(rootfs)
        .arg("--numeric-owner")
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(ok.success());
    let layer_bytes = fs::read(&tar).unwrap();
    fs::remove_file(&tar).unwrap();
    let layer = blob(layout, "application/vnd.oci.image.layer.v1.tar", &layer_bytes);
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]},
    });
    let config = blob(layout, "application/vnd.oci.image.config.v1+json", config.to_string().as_bytes());
    let manifest = json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config, "layers": [layer],
    });
    let manifest = blob(layout, "application/vnd.oci.image.manifest.v1+json", manifest.to_string().as_bytes());
    fs::write(layout.join("index.json"), json!({"schemaVersion": 2, "manifests": [manifest]}).to_string()).unwrap();
    fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

#[tokio::test]
async fn an_oci_layout_imports_as_a_layered_image() {
    let server = TestServer::start().await;
    let layout = server.path().join("layout");
    make_layout(&server.path().join("rootfs"), &layout);
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "ocibox", "dir": layout, "format": "oci_layout"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sb = server.create(small(json!({"image": "ocibox"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "head -1 /etc/passwd").await, "root:x:0:0:root:/root:/bin/sh\n");
    server.finish().await;
}

#[tokio::test]
async fn a_corrupt_oci_layout_is_refused_naming_dir() {
    let server = TestServer::start().await;
    let layout = server.path().join("layout");
    make_layout(&server.path().join("rootfs"), &layout);
    // Flip a byte of the layer blob: its digest no longer matches.
    let biggest = fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .flatten()
        .max_by_key(|e| e.metadata().unwrap().len())
        .unwrap()
        .path();
    let mut bytes = fs::read(&biggest).unwrap();
    bytes[600] ^= 0xff;
    fs::write(&biggest, bytes).unwrap();
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "broken", "dir": layout, "format": "oci_layout"})))
        .await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("dir"));
    assert!(body["message"].as_str().unwrap_or_default().contains("digest"), "the error says why: {body}");
    let (status, body) = server.try_create(&small(json!({"image": "broken"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("image"));
    server.finish().await;
}
