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
    make_layout_with_config(rootfs, layout, json!({"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]}));
}

/// [`make_layout`] with `container_config` as the image config's `config`.
fn make_layout_with_config(rootfs: &Path, layout: &Path, container_config: serde_json::Value) {
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
        "config": container_config,
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

/// The test rootfs plus `/srv/app` (the image's working directory) and a
/// tool on a PATH entry only the image's `Env` names.
fn rootfs_with_app(server: &TestServer) -> std::path::PathBuf {
    let rootfs = server.path().join("app-rootfs");
    let copied = Command::new("cp").arg("-a").arg(server.path().join("rootfs")).arg(&rootfs).status().unwrap();
    assert!(copied.success());
    fs::create_dir_all(rootfs.join("srv/app")).unwrap();
    fs::create_dir_all(rootfs.join("opt/tools")).unwrap();
    let tool = rootfs.join("opt/tools/hello-tool");
    fs::write(&tool, "#!/bin/sh\necho tool says $GREETING\n").unwrap();
    fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    rootfs
}

#[tokio::test]
async fn an_oci_image_config_sets_the_environment_and_working_directory_of_execs() {
    let server = TestServer::start().await;
    let layout = server.path().join("layout");
    let config = json!({
        "Env": ["PATH=/opt/tools:/bin", "GREETING=from-image", "MODE=image"],
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["echo default command"],
        "WorkingDir": "/srv/app",
        "User": "1000",
    });
    make_layout_with_config(&rootfs_with_app(&server), &layout, config);
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "appimg", "dir": layout, "format": "oci_layout"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    let (status, detail) = server.call(Method::GET, "/v1/images/appimg", None).await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["config"]["entrypoint"], json!(["/bin/sh", "-c"]), "{detail}");
    assert_eq!(detail["config"]["cmd"], json!(["echo default command"]), "{detail}");
    assert_eq!(detail["config"]["working_dir"], "/srv/app", "{detail}");
    assert_eq!(detail["config"]["user"], "1000", "{detail}");

    // The image's Env and WorkingDir are every exec's defaults...
    let sb = server.create(small(json!({"image": "appimg"}))).await;
    assert_eq!(
        server.sh_ok(&sb.id, "pwd; echo $GREETING $MODE; hello-tool").await,
        "/srv/app\nfrom-image image\ntool says from-image\n"
    );
    // ...an exec's own env and cwd override them...
    let r = server
        .exec_wait(
            &sb.id,
            &warren_api::ExecRequest {
                cwd: Some("/".into()),
                env: [("MODE".to_string(), "exec".to_string())].into(),
                ..warren_api::ExecRequest::shell("pwd; echo $GREETING $MODE")
            },
        )
        .await;
    assert_eq!(stdout(&r), "/\nfrom-image exec\n", "{r:?}");
    // ...and so do the create request's env and a session's start.
    let session = server.create_session(&sb.id, json!({})).await;
    assert_eq!(session.cwd, "/srv/app");
    let other = server.create(small(json!({"image": "appimg", "env": {"MODE": "request"}}))).await;
    assert_eq!(server.sh_ok(&other.id, "echo $GREETING $MODE").await, "from-image request\n");

    // A composed image keeps the config of the image it takes layers from.
    let (status, body) = server
        .call(Method::POST, "/v1/images/compose", Some(&json!({"name": "stacked", "layers": [{"image": "appimg"}]})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, detail) = server.call(Method::GET, "/v1/images/stacked", None).await;
    assert_eq!(detail["config"]["working_dir"], "/srv/app", "{detail}");
    let third = server.create(small(json!({"image": "stacked"}))).await;
    assert_eq!(server.sh_ok(&third.id, "pwd").await, "/srv/app\n");

    // `warren run` without a command runs the image's Entrypoint + Cmd.
    let out = std::process::Command::new(warren_binary())
        .args(["--url", &server.url, "run", "--image", "appimg", "--memory-mib", "128"])
        .output()
        .expect("run the warren CLI");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "default command\n");
    server.finish().await;
}

#[tokio::test]
async fn an_image_config_with_a_relative_working_dir_is_refused_naming_dir() {
    let server = TestServer::start().await;
    let layout = server.path().join("layout");
    make_layout_with_config(&server.path().join("rootfs"), &layout, json!({"WorkingDir": "srv"}));
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "badcfg", "dir": layout, "format": "oci_layout"})))
        .await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("dir"));
    assert!(body["message"].as_str().unwrap_or_default().contains("WorkingDir"), "{body}");
    server.finish().await;
}
