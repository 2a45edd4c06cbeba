//! Registry pull and push against a real registry: Debian's
//! `docker-registry` (the distribution API), started per test on a loopback
//! port with its own storage in the test's temp dir. Each test builds an
//! OCI image itself (gzip layers with files, a whiteout and a symlink),
//! pushes it with `oci-client`, and pulls it through Warren's API.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use warren_api::ErrorCode;
use warren_tests::*;

const GZIP_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const REGISTRY_WAIT: Duration = Duration::from_secs(30);
/// The one user of an htpasswd-protected test registry.
const USER: &str = "ci-bot";
const PASSWORD: &str = "warren-registry-pw";
/// bcrypt (cost 4, so the registry checks it fast) of [`PASSWORD`], made
/// once with Python's `crypt.crypt(PASSWORD, crypt.mksalt(METHOD_BLOWFISH, rounds=16))`.
const PASSWORD_BCRYPT: &str = "$2b$04$Kp1CeyTqp19kEctuGPvxGeoI6FUXq1OZc.DacJTtTDnp8hKmr5azC";

/// A `docker-registry serve` of this test: killed and reaped on drop.
struct Registry {
    child: Child,
    storage: PathBuf,
    /// `127.0.0.1:PORT`.
    addr: String,
}

impl Registry {
    async fn start(dir: &Path) -> Registry {
        Self::start_with(dir, "").await
    }

    /// A registry that admits only `USER` with `PASSWORD` (htpasswd auth).
    async fn start_with_htpasswd(dir: &Path) -> Registry {
        let htpasswd = dir.join("htpasswd");
        fs::write(&htpasswd, format!("{USER}:{PASSWORD_BCRYPT}\n")).unwrap();
        let auth = format!("auth:\n  htpasswd:\n    realm: warren-test\n    path: {}\n", htpasswd.display());
        Self::start_with(dir, &auth).await
    }

    /// `extra` is appended to the registry's YAML config.
    async fn start_with(dir: &Path, extra: &str) -> Registry {
        let storage = dir.join("registry-storage");
        fs::create_dir_all(&storage).unwrap();
        let config = dir.join("registry.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:0\n{extra}",
                storage.display()
            ),
        )
        .unwrap();
        let log = dir.join("registry.log");
        let out = fs::File::create(&log).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("docker-registry is installed (scripts/setup-host.sh)");
        let mut registry = Registry { child, storage, addr: String::new() };
        let deadline = tokio::time::Instant::now() + REGISTRY_WAIT;
        loop {
            let text = fs::read_to_string(&log).unwrap_or_default();
            if let Some(at) = text.find("listening on ") {
                let rest = &text[at + "listening on ".len()..];
                registry.addr =
                    rest.split(|c: char| !(c.is_ascii_digit() || c == '.' || c == ':')).next().unwrap().into();
                break;
            }
            assert!(registry.child.try_wait().unwrap().is_none(), "docker-registry exited:\n{text}");
            assert!(
                tokio::time::Instant::now() < deadline,
                "docker-registry did not listen within {REGISTRY_WAIT:?}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let probe = format!("http://{}/v2/", registry.addr);
        loop {
            let answered = reqwest::get(&probe).await.map(|r| r.status());
            if answered.is_ok_and(|s| s == StatusCode::OK || s == StatusCode::UNAUTHORIZED) {
                return registry;
            }
            assert!(tokio::time::Instant::now() < deadline, "docker-registry did not answer {probe}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.addr)
    }

    /// The file the registry serves blob `digest` from.
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage.join("docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// `tar` of `dir`'s contents (numeric owners), and its gzip.
fn tar_gz(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let out = Command::new("tar").arg("-C").arg(dir).args(["--numeric-owner", "-cf", "-", "."]).output().unwrap();
    assert!(out.status.success(), "tar: {}", String::from_utf8_lossy(&out.stderr));
    let mut gzip =
        Command::new("gzip").args(["-n", "-c"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = gzip.stdin.take().unwrap();
    let tar = out.stdout.clone();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &tar));
    let mut gz = Vec::new();
    gzip.stdout.take().unwrap().read_to_end(&mut gz).unwrap();
    writer.join().unwrap().unwrap();
    assert!(gzip.wait().unwrap().success());
    (out.stdout, gz)
}

/// The test image's two layers: the busybox rootfs plus a file the upper
/// layer deletes, and a layer with a file, a symlink to it, and that
/// whiteout.
fn image_layers(server: &TestServer) -> Vec<(Vec<u8>, Vec<u8>)> {
    let lower = server.path().join("layer-lower");
    let copied = Command::new("cp").arg("-a").arg(server.path().join("rootfs")).arg(&lower).status().unwrap();
    assert!(copied.success());
    fs::write(lower.join("etc/doomed.txt"), "deleted by the upper layer\n").unwrap();
    let upper = server.path().join("layer-upper");
    fs::create_dir_all(upper.join("srv")).unwrap();
    fs::create_dir_all(upper.join("etc")).unwrap();
    fs::write(upper.join("srv/hello.txt"), "hello from the registry\n").unwrap();
    std::os::unix::fs::symlink("hello.txt", upper.join("srv/link")).unwrap();
    fs::write(upper.join("etc/.wh.doomed.txt"), "").unwrap();
    vec![tar_gz(&lower), tar_gz(&upper)]
}

fn oci_client() -> Client {
    Client::new(ClientConfig { protocol: ClientProtocol::Http, use_monolithic_push: true, ..ClientConfig::default() })
}

/// Pushes the test image to `reference` with layer media type
/// `layer_type`; returns the layer blobs' digests.
async fn push_test_image(server: &TestServer, reference: &str, layer_type: &str) -> Vec<String> {
    push_test_image_as(server, reference, layer_type, &RegistryAuth::Anonymous).await
}

async fn push_test_image_as(
    server: &TestServer,
    reference: &str,
    layer_type: &str,
    auth: &RegistryAuth,
) -> Vec<String> {
    let layers = image_layers(server);
    let diff_ids: Vec<String> = layers.iter().map(|(tar, _)| sha256(tar)).collect();
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let config = Config::new(config.to_string().into_bytes(), OCI_CONFIG.into(), None);
    let image_layers: Vec<ImageLayer> =
        layers.into_iter().map(|(_, gz)| ImageLayer::new(gz, layer_type.into(), None)).collect();
    let digests = image_layers.iter().map(|l| l.sha256_digest()).collect();
    let reference: Reference = reference.parse().unwrap();
    oci_client().push(&reference, &image_layers, config, auth, None).await.expect("push the test image");
    digests
}

/// Pushes `blobs` and then `manifest` (raw JSON of `media_type`) to
/// `reference`; returns the manifest's descriptor.
async fn push_raw(reference: &str, blobs: &[&[u8]], manifest: &Value, media_type: &str) -> Value {
    let reference: Reference = reference.parse().unwrap();
    let client = oci_client();
    for blob in blobs {
        client.push_blob(&reference, blob, &sha256(blob)).await.expect("push a blob");
    }
    let body = serde_json::to_vec(manifest).unwrap();
    let descriptor = json!({"mediaType": media_type, "digest": sha256(&body), "size": body.len()});
    client.push_manifest_raw(&reference, body, media_type.parse().unwrap()).await.expect("push a manifest");
    descriptor
}

async fn pull(server: &TestServer, body: Value) -> (StatusCode, Value) {
    server.call(Method::POST, "/v1/images/pull", Some(&body)).await
}

async fn inspect(server: &TestServer, name: &str) -> (StatusCode, Value) {
    server.call(Method::GET, &format!("/v1/images/{name}"), None).await
}

fn layer_digests(detail: &Value) -> Vec<String> {
    detail["layers"].as_array().unwrap().iter().map(|l| l["digest"].as_str().unwrap().to_owned()).collect()
}

/// What a failed pull must not leave: a scratch dir, a layer, an image.
fn assert_nothing_published(server: &TestServer) {
    let tmp = leaks::dir_entries(&server.data_dir().join("tmp"));
    assert!(tmp.is_empty(), "a failed pull left scratch files: {tmp:?}");
    let layers = leaks::dir_entries(&server.data_dir().join("blobs/layers"));
    assert!(layers.is_empty(), "a failed pull left layers: {layers:?}");
}

#[tokio::test]
async fn a_pushed_oci_image_pulls_and_starts_sandboxes_with_its_files() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    push_test_image(&server, &registry.reference("warren/app:v1"), GZIP_LAYER).await;

    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/app:v1")})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["name"], "app", "named after the repository: {body}");
    let (status, detail) = inspect(&server, "app").await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["storage"], "erofs");
    assert_eq!(detail["config"], json!({"env": ["PATH=/bin"], "entrypoint": [], "cmd": ["/bin/sh"]}), "{detail}");
    let layers = detail["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "{detail}");
    for layer in layers {
        assert_eq!(layer["role"], "base", "{detail}");
        assert!(layer["chunk_count"].as_u64().unwrap() >= 1, "{detail}");
        assert!(layer["size_bytes"].as_u64().unwrap() > 0, "{detail}");
    }

    let sb = server.create(small(json!({"image": "app"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /srv/hello.txt").await, "hello from the registry\n");
    assert_eq!(server.sh_ok(&sb.id, "readlink /srv/link").await, "hello.txt\n");
    assert_eq!(server.sh_ok(&sb.id, "cat /srv/link").await, "hello from the registry\n");
    assert_eq!(server.sh_ok(&sb.id, "test -e /etc/doomed.txt && echo there || echo gone").await, "gone\n");
    assert_eq!(server.sh_ok(&sb.id, "head -1 /etc/passwd").await, "root:x:0:0:root:/root:/bin/sh\n");

    // In use: not removable.
    let (status, body) = server.call(Method::DELETE, "/v1/images/app", None).await;
    assert_api_error(status, &body, ErrorCode::ImageInUse, Some("name"));
    server.delete(&sb.id).await;
    server.finish().await;
}

#[tokio::test]
async fn a_warren_push_round_trips_the_exact_layers_and_roles() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    push_test_image(&server, &registry.reference("warren/app:v1"), GZIP_LAYER).await;
    let (status, body) =
        pull(&server, json!({"reference": registry.reference("warren/app:v1"), "name": "app", "role": "toolkit"}))
            .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, original) = inspect(&server, "app").await;

    let (status, pushed) = server
        .call(
            Method::POST,
            "/v1/images/app/push",
            Some(&json!({"reference": registry.reference("warren/app-erofs:v1")})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{pushed}");
    assert!(pushed["manifest_digest"].as_str().unwrap().starts_with("sha256:"), "{pushed}");

    let (status, body) =
        pull(&server, json!({"reference": registry.reference("warren/app-erofs:v1"), "name": "copy"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, copy) = inspect(&server, "copy").await;
    assert_eq!(layer_digests(&copy), layer_digests(&original), "the EROFS layers come back byte for byte");
    assert_eq!(copy["config"], original["config"], "the image config travels with the artifact");
    for layer in copy["layers"].as_array().unwrap() {
        assert_eq!(layer["role"], "toolkit", "the pushed roles come back: {copy}");
    }
    let sb = server.create(small(json!({"image": "copy"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /srv/link").await, "hello from the registry\n");

    // The registry holds EROFS files under Warren's media type.
    let manifest: Value = reqwest::Client::new()
        .get(format!("http://{}/v2/warren/app-erofs/manifests/v1", registry.addr))
        .header("Accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for layer in manifest["layers"].as_array().unwrap() {
        assert_eq!(layer["mediaType"], "application/vnd.warren.layer.v1.erofs", "{manifest}");
    }
    server.finish().await;
}

#[tokio::test]
async fn a_pulled_base_composes_with_a_workspace_layer_and_gc_frees_what_is_unreferenced() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    push_test_image(&server, &registry.reference("warren/app:v1"), GZIP_LAYER).await;
    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/app:v1"), "name": "os"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let ws_dir = server.path().join("workspace");
    fs::create_dir_all(ws_dir.join("work")).unwrap();
    fs::write(ws_dir.join("work/task.txt"), "the task\n").unwrap();
    let (status, body) = server
        .call(
            Method::POST,
            "/v1/images",
            Some(&json!({"name": "ws", "dir": ws_dir, "format": "erofs", "role": "workspace"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    let compose = json!({"name": "task", "layers": [{"image": "os", "role": "base"}, {"image": "ws"}]});
    let (status, body) = server.call(Method::POST, "/v1/images/compose", Some(&compose)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, detail) = inspect(&server, "task").await;
    let roles: Vec<&str> = detail["layers"].as_array().unwrap().iter().map(|l| l["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["base", "base", "workspace"], "{detail}");
    let sb = server.create(small(json!({"image": "task"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /work/task.txt /srv/hello.txt").await, "the task\nhello from the registry\n");
    server.delete(&sb.id).await;

    let bad = json!({"name": "bad", "layers": [{"image": "ws", "role": "toolkit"}]});
    let (status, body) = server.call(Method::POST, "/v1/images/compose", Some(&bad)).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("layers[0]"));

    // Nothing unreferenced yet; then drop the OS image and the stack.
    let (status, report) = server.call(Method::POST, "/v1/images/gc", None).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    assert_eq!(report["layers_removed"], 0, "{report}");
    for name in ["task", "os"] {
        let (status, body) = server.call(Method::DELETE, &format!("/v1/images/{name}"), None).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    }
    let (status, body) = inspect(&server, "os").await;
    assert_api_error(status, &body, ErrorCode::ImageNotFound, None);
    let (status, report) = server.call(Method::POST, "/v1/images/gc", None).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    assert_eq!(report["layers_removed"], 2, "the two OS layers: {report}");
    assert!(report["chunks_removed"].as_u64().unwrap() > 0, "{report}");
    assert!(report["cached_layers_removed"].as_u64().unwrap() >= 2, "{report}");
    assert!(report["bytes_freed"].as_u64().unwrap() > 0, "{report}");
    // The workspace image still reads back; a second collection finds nothing.
    let (status, body) = inspect(&server, "ws").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, report) = server.call(Method::POST, "/v1/images/gc", None).await;
    assert_eq!((report["layers_removed"].as_u64(), report["chunks_removed"].as_u64()), (Some(0), Some(0)), "{report}");
    server.finish().await;
}

#[tokio::test]
async fn pulling_a_missing_tag_or_an_unreachable_registry_is_a_clear_error() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    push_test_image(&server, &registry.reference("warren/app:v1"), GZIP_LAYER).await;
    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/app:nope")})).await;
    assert_api_error(status, &body, ErrorCode::NotFound, Some("reference"));
    assert!(body["message"].as_str().unwrap().contains("not found"), "{body}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (status, body) = pull(&server, json!({"reference": format!("127.0.0.1:{port}/warren/app:v1")})).await;
    assert_api_error(status, &body, ErrorCode::RegistryUnavailable, Some("reference"));

    let (status, body) = pull(&server, json!({"reference": "UPPER/Case:v1", "name": "x"})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("reference"));
    assert_nothing_published(&server);

    // Directory images inspect and remove through the same routes.
    let (status, detail) = inspect(&server, IMAGE).await;
    assert_eq!((status, detail["storage"].as_str()), (StatusCode::OK, Some("dir")), "{detail}");
    let (status, body) = server.call(Method::DELETE, "/v1/images/nothere", None).await;
    assert_api_error(status, &body, ErrorCode::ImageNotFound, Some("image"));
    let (status, body) = server.call(Method::DELETE, &format!("/v1/images/{IMAGE}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = inspect(&server, IMAGE).await;
    assert_api_error(status, &body, ErrorCode::ImageNotFound, None);
    server.finish().await;
}

#[tokio::test]
async fn a_corrupted_registry_blob_is_a_digest_mismatch_and_leaves_no_image() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    let digests = push_test_image(&server, &registry.reference("warren/app:v1"), GZIP_LAYER).await;
    // The registry serves whatever its storage holds: flip a byte of the
    // bottom layer's blob, same length.
    let blob = registry.blob_file(&digests[0]);
    let mut bytes = fs::read(&blob).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    fs::write(&blob, bytes).unwrap();

    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/app:v1"), "name": "app"})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("reference"));
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("digest mismatch") && message.contains(&digests[0]), "{body}");
    let (status, body) = inspect(&server, "app").await;
    assert_api_error(status, &body, ErrorCode::ImageNotFound, None);
    assert_nothing_published(&server);
    server.finish().await;
}

#[tokio::test]
async fn an_unknown_layer_media_type_is_refused_naming_it() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    let mystery = "application/vnd.example.mystery.v1";
    push_test_image(&server, &registry.reference("warren/odd:v1"), mystery).await;
    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/odd:v1")})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("reference"));
    assert!(body["message"].as_str().unwrap().contains(mystery), "{body}");
    let (status, body) = inspect(&server, "odd").await;
    assert_api_error(status, &body, ErrorCode::ImageNotFound, None);
    assert_nothing_published(&server);
    server.finish().await;
}

#[tokio::test]
async fn an_index_resolves_to_its_linux_amd64_docker_manifest() {
    let server = TestServer::start().await;
    let registry = Registry::start(server.path()).await;
    // linux/amd64: the test image as a Docker v2 schema 2 manifest.
    let layers = image_layers(&server);
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|(tar, _)| sha256(tar)).collect::<Vec<_>>()},
    })
    .to_string()
    .into_bytes();
    let docker_layer = "application/vnd.docker.image.rootfs.diff.tar.gzip";
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": sha256(&config), "size": config.len()},
        "layers": layers.iter().map(|(_, gz)| json!({"mediaType": docker_layer, "digest": sha256(gz), "size": gz.len()})).collect::<Vec<_>>(),
    });
    let mut blobs: Vec<&[u8]> = layers.iter().map(|(_, gz)| gz.as_slice()).collect();
    blobs.push(&config);
    let amd64 = push_raw(
        &registry.reference("warren/multi:amd64"),
        &blobs,
        &manifest,
        "application/vnd.docker.distribution.manifest.v2+json",
    )
    .await;
    // linux/arm64: a decoy whose only file says so.
    let decoy_dir = server.path().join("decoy");
    fs::create_dir_all(decoy_dir.join("srv")).unwrap();
    fs::write(decoy_dir.join("srv/hello.txt"), "arm64\n").unwrap();
    let (decoy_tar, decoy_gz) = tar_gz(&decoy_dir);
    let decoy_config =
        json!({"architecture": "arm64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [sha256(&decoy_tar)]}})
            .to_string()
            .into_bytes();
    let decoy = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": OCI_CONFIG, "digest": sha256(&decoy_config), "size": decoy_config.len()},
        "layers": [{"mediaType": GZIP_LAYER, "digest": sha256(&decoy_gz), "size": decoy_gz.len()}],
    });
    let arm64 = push_raw(
        &registry.reference("warren/multi:arm64"),
        &[&decoy_gz, &decoy_config],
        &decoy,
        "application/vnd.oci.image.manifest.v1+json",
    )
    .await;
    let with_platform = |mut d: Value, arch: &str| {
        d["platform"] = json!({"architecture": arch, "os": "linux"});
        d
    };
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [with_platform(arm64, "arm64"), with_platform(amd64, "amd64")],
    });
    push_raw(&registry.reference("warren/multi:v1"), &[], &index, "application/vnd.oci.image.index.v1+json").await;

    let (status, body) = pull(&server, json!({"reference": registry.reference("warren/multi:v1")})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sb = server.create(small(json!({"image": "multi"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /srv/hello.txt").await, "hello from the registry\n");
    assert_eq!(server.sh_ok(&sb.id, "test -e /etc/doomed.txt && echo there || echo gone").await, "gone\n");
    server.finish().await;
}

#[tokio::test]
async fn an_authenticated_registry_refuses_anonymous_and_wrong_credentials_with_typed_errors() {
    let server = TestServer::start().await;
    let registry = Registry::start_with_htpasswd(server.path()).await;
    let basic = RegistryAuth::Basic(USER.into(), PASSWORD.into());
    let reference = registry.reference("private/app:v1");
    push_test_image_as(&server, &reference, GZIP_LAYER, &basic).await;

    let (status, body) = pull(&server, json!({"reference": reference})).await;
    assert_api_error(status, &body, ErrorCode::RegistryAuthRequired, Some("auth"));
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_nothing_published(&server);

    let wrong = json!({"reference": reference, "auth": {"username": USER, "password": "not-the-password"}});
    let (status, body) = pull(&server, wrong).await;
    assert_api_error(status, &body, ErrorCode::RegistryAuthFailed, Some("auth"));
    assert!(!body.to_string().contains("not-the-password"), "the password is never echoed: {body}");
    assert_nothing_published(&server);

    let right = json!({"reference": reference, "auth": {"username": USER, "password": PASSWORD}});
    let (status, body) = pull(&server, right).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sb = server.create(small(json!({"image": "app"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /srv/hello.txt").await, "hello from the registry\n");

    // Push takes the same credentials.
    let target = registry.reference("private/app-erofs:v1");
    let (status, body) = server.call(Method::POST, "/v1/images/app/push", Some(&json!({"reference": target}))).await;
    assert_api_error(status, &body, ErrorCode::RegistryAuthRequired, Some("auth"));
    let push = json!({"reference": target, "auth": {"username": USER, "password": PASSWORD}});
    let (status, body) = server.call(Method::POST, "/v1/images/app/push", Some(&push)).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    for secret in [PASSWORD, "not-the-password"] {
        assert!(!server.log_tail(100_000).contains(secret), "the server log never holds a password");
    }
    server.delete(&sb.id).await;
    server.finish().await;
}

#[tokio::test]
async fn a_node_credentials_file_authenticates_pulls_that_bring_none() {
    let creds = tempfile::tempdir().unwrap();
    let file = creds.path().join("config.json");
    let server = TestServer::start_with(&["--registry-auth-file", file.to_str().unwrap()]).await;
    let registry = Registry::start_with_htpasswd(server.path()).await;
    let reference = registry.reference("private/app:v1");
    push_test_image_as(&server, &reference, GZIP_LAYER, &RegistryAuth::Basic(USER.into(), PASSWORD.into())).await;

    // Docker's form: base64("user:password") under the registry's host.
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    fs::write(&file, json!({"auths": {registry.addr.clone(): {"auth": encoded}}}).to_string()).unwrap();
    let (status, body) = pull(&server, json!({"reference": reference})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // The request's own credentials win over the file's.
    let wrong = json!({"reference": reference, "name": "other", "auth": {"username": USER, "password": "nope"}});
    let (status, body) = pull(&server, wrong).await;
    assert_api_error(status, &body, ErrorCode::RegistryAuthFailed, Some("auth"));
    server.finish().await;
}

/// Runs the `warren` CLI against `server` with `stdin`; returns stdout,
/// asserting success.
fn cli(server: &TestServer, args: &[&str], stdin: &str, env: &[(&str, &Path)]) -> String {
    use std::io::Write;
    let mut child = Command::new(warren_binary())
        .args(["--url", &server.url])
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, *v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the warren CLI");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "warren {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn the_cli_pulls_with_a_password_on_stdin_or_the_docker_config_of_the_user() {
    let server = TestServer::start().await;
    let registry = Registry::start_with_htpasswd(server.path()).await;
    let reference = registry.reference("private/app:v1");
    push_test_image_as(&server, &reference, GZIP_LAYER, &RegistryAuth::Basic(USER.into(), PASSWORD.into())).await;

    let out = cli(
        &server,
        &["image", "pull", &reference, "--name", "one", "--username", USER, "--password-stdin"],
        &format!("{PASSWORD}\n"),
        &[],
    );
    assert!(out.contains("pulled"), "{out}");

    // No flags: the entry for the registry in $DOCKER_CONFIG/config.json.
    let docker = server.path().join("docker-config");
    fs::create_dir_all(&docker).unwrap();
    let entry = json!({"auths": {registry.addr.clone(): {"username": USER, "password": PASSWORD}}});
    fs::write(docker.join("config.json"), entry.to_string()).unwrap();
    let out = cli(&server, &["image", "pull", &reference, "--name", "two"], "", &[("DOCKER_CONFIG", &docker)]);
    assert!(out.contains("pulled"), "{out}");
    for name in ["one", "two"] {
        let (status, detail) = inspect(&server, name).await;
        assert_eq!(status, StatusCode::OK, "{detail}");
    }
    server.finish().await;
}
