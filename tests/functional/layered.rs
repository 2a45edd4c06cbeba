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
            Some(&json!({"image": "lazysnap", "scrub": ["/work/tmp", "/usr/bin/wget"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["layers"].as_array().map(Vec::len), Some(2), "the base layer + one diff layer: {body}");

    let child = server.create(small(json!({"image": "lazysnap"}))).await;
    assert_eq!(server.sh_ok(&child.id, "cat /work/answer; ls /work").await, "solved\nanswer\n");
    let r = server.sh(&child.id, "cat /etc/group").await;
    assert_ne!(r.exit_code, Some(0), "the deletion is carried as a whiteout: {r:?}");
    let r = server.sh(&child.id, "ls /usr/bin/wget").await;
    assert_ne!(r.exit_code, Some(0), "a scrubbed path of the lazily loaded base layer is gone: {r:?}");
    assert_eq!(server.sh_ok(&child.id, "readlink /bin/ls").await, "/bin/busybox\n");
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
    // Metadata arrives as one blob, not as the chunks it touches.
    assert!(l.metadata_bytes_fetched > 0 && l.metadata_chunks_fetched == 0, "{l:?}");
    assert!(l.chunks_fetched >= 1 && l.bytes_fetched > l.metadata_bytes_fetched, "{l:?}");
    // The metadata blob travels compressed, so the pages it fills can
    // outweigh the bytes fetched for it; data is fetched as it is stored.
    assert!(l.present_bytes <= l.size_bytes && l.bytes_fetched <= l.size_bytes, "{l:?}");
    assert_eq!(l.failed_fills, 0, "{l:?}");
    assert!(stats["store"]["chunks_uploaded"].as_u64() >= Some(1), "{stats}");
    server.finish().await;
}

/// The test rootfs plus two 3 MiB files of random bytes, so reading one
/// leaves the layer incomplete (and still filled lazily).
fn rootfs_with_data(server: &TestServer) -> std::path::PathBuf {
    let rootfs = server.path().join("data-rootfs");
    let copied =
        std::process::Command::new("cp").arg("-a").arg(server.path().join("rootfs")).arg(&rootfs).status().unwrap();
    assert!(copied.success());
    std::fs::create_dir_all(rootfs.join("data")).unwrap();
    for name in ["a.bin", "b.bin"] {
        let mut bytes = vec![0u8; DATA_FILE_BYTES as usize];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut bytes).unwrap();
        std::fs::write(rootfs.join("data").join(name), bytes).unwrap();
    }
    rootfs
}

const DATA_FILE_BYTES: u64 = 3 << 20;

/// Imports [`rootfs_with_data`] as the layered image `databox`; returns the
/// directory it was made from.
async fn import_databox(server: &TestServer) -> std::path::PathBuf {
    let rootfs = rootfs_with_data(server);
    let (status, body) = server
        .call(Method::POST, "/v1/images", Some(&json!({"name": "databox", "dir": rootfs, "format": "erofs"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    rootfs
}

async fn sandbox_image_stats(server: &TestServer, id: &str) -> warren_api::SandboxImageStats {
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/image-stats"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body).unwrap()
}

#[tokio::test]
async fn per_sandbox_stats_show_the_first_reader_fetching_and_the_next_hitting_the_node_cache() {
    let server = TestServer::start().await;
    import_databox(&server).await;

    let first = server.create(small(json!({"image": "databox"}))).await;
    server.sh_ok(&first.id, "cat /data/a.bin > /dev/null").await;
    let a = sandbox_image_stats(&server, &first.id).await;
    assert!(a.bytes_fetched >= DATA_FILE_BYTES && a.chunks_fetched >= 3, "the first reader fetched the file: {a:?}");
    assert!(a.bytes_accessed >= DATA_FILE_BYTES, "{a:?}");

    // The pages of the shared layer would serve the next reader without any
    // event; drop the file's pages (not the layer file's data) so its read
    // reaches the cache again.
    let mnt = server.data_dir().join("layer-cache/mnt");
    let layer = std::fs::read_dir(&mnt).unwrap().flatten().next().expect("one mounted layer").path();
    let dropped = std::process::Command::new("dd")
        .arg(format!("if={}", layer.join("data/a.bin").display()))
        .args(["iflag=nocache", "count=0", "status=none"])
        .status()
        .unwrap();
    assert!(dropped.success());

    let second = server.create(small(json!({"image": "databox"}))).await;
    server.sh_ok(&second.id, "cat /data/a.bin > /dev/null").await;
    let b = sandbox_image_stats(&server, &second.id).await;
    assert!(b.cache_hits >= 1, "the second reader found the data on the node: {b:?}");
    assert!(b.bytes_accessed >= DATA_FILE_BYTES / 2, "{b:?}");
    assert!(b.bytes_fetched < DATA_FILE_BYTES, "and did not fetch the file again: {b:?}");
    assert_eq!(sandbox_image_stats(&server, &first.id).await.bytes_fetched, a.bytes_fetched, "A's own stay A's");
    let out = std::process::Command::new(warren_binary())
        .args(["--url", &server.url, "--json", "image", "stats", "--sandbox", &second.id])
        .output()
        .expect("run the warren CLI");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: warren_api::SandboxImageStats = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((shown.sandbox_id, shown.bytes_fetched), (second.id.clone(), b.bytes_fetched));

    let (status, body) = server.call(Method::GET, "/v1/sandboxes/sb-0000000000000000/image-stats", None).await;
    assert_api_error(status, &body, warren_api::ErrorCode::NotFound, None);
    server.finish().await;
}

/// The node's default: once a sandbox that read from a layer has ended, the
/// rest of the layer is fetched in the background - also while another
/// sandbox holds the layer throughout, as a warm pool's idle members do -
/// and the next sandbox reads data nobody read before without fetching
/// anything.
#[tokio::test]
async fn by_default_a_layer_the_node_ran_is_completed_after_its_sandbox_ended() {
    let server = TestServer::start().await;
    let rootfs = import_databox(&server).await;

    let idle = server.create(small(json!({"image": "databox"}))).await;
    let first = server.create(small(json!({"image": "databox"}))).await;
    server.sh_ok(&first.id, "cat /data/a.bin > /dev/null").await;
    let read = layer_stats(&server).await;
    assert!(read[0].present_bytes < read[0].size_bytes, "one file read leaves the layer incomplete: {read:?}");
    assert_eq!(read[0].completion_units, 0, "nothing is completed while the reader lives: {read:?}");
    server.delete(&first.id).await;

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let done = loop {
        let l = layer_stats(&server).await.first().cloned().expect("the layer stays cached");
        if l.present_bytes == l.size_bytes && l.completion_running == 0 {
            break l;
        }
        assert!(std::time::Instant::now() < deadline, "the layer was not completed: {l:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(done.completion_units > 0 && done.completion_bytes >= DATA_FILE_BYTES, "{done:?}");
    assert_eq!((done.failed_completion_units, done.failed_fills), (0, 0), "{done:?}");

    // Complete, the layer serves a file nobody read before from the node.
    let second = server.create(small(json!({"image": "databox"}))).await;
    let want = std::process::Command::new("sha256sum").arg(rootfs.join("data/b.bin")).output().unwrap();
    let want = String::from_utf8_lossy(&want.stdout).split_whitespace().next().unwrap_or_default().to_string();
    let got = server.sh_ok(&second.id, "sha256sum /data/b.bin").await;
    assert_eq!(got.split_whitespace().next(), Some(want.as_str()));
    assert_eq!(sandbox_image_stats(&server, &second.id).await.bytes_fetched, 0, "nothing was fetched for it");
    assert_eq!(layer_stats(&server).await[0].bytes_fetched, done.bytes_fetched);
    assert_eq!(server.sh_ok(&idle.id, "head -c 5 /etc/group").await, "root:", "the idle sandbox lived throughout");
    server.finish().await;
}

/// An s3s-fs serving a temp dir on loopback; killed and reaped on drop.
struct S3Server {
    child: std::process::Child,
    endpoint: String,
    root: tempfile::TempDir,
}

const S3_KEY: &str = "warren-test";
const S3_SECRET: &str = "warren-test-secret";

impl S3Server {
    fn start() -> S3Server {
        use std::io::BufRead;
        let binary = std::env::var_os("WARREN_S3S_FS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/bin/s3s-fs"));
        assert!(
            binary.is_file(),
            "{} is missing: install it with crates/warren-image/scripts/s3-server.sh install",
            binary.display()
        );
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("warren")).unwrap();
        let mut child = std::process::Command::new(&binary)
            .args(["--host", "127.0.0.1", "--port", "0", "--access-key", S3_KEY, "--secret-key", S3_SECRET])
            .arg(root.path())
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Keep draining its log so it never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(at) = line.find("server is running at ") {
                    let _ = tx.send(line[at + "server is running at ".len()..].trim().to_owned());
                }
            }
        });
        let endpoint = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("s3s-fs reports its address");
        S3Server { child, endpoint, root }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn a_node_on_an_s3_blob_store_keeps_its_chunks_in_the_bucket() {
    let s3 = S3Server::start();
    let env = |k: &str, v: &str| format!("{k}={v}");
    let server = TestServer::start_launched(Launch {
        prefix: vec![
            "env".into(),
            env("WARREN_S3_ACCESS_KEY_ID", S3_KEY),
            env("WARREN_S3_SECRET_ACCESS_KEY", S3_SECRET),
        ],
        extra_args: vec!["--blob-store-s3".into(), format!("{}/warren", s3.endpoint)],
        ..Launch::default()
    })
    .await;
    import_lazybox(&server).await;
    let sb = server.create(small(json!({"image": "lazybox"}))).await;
    assert_eq!(server.sh_ok(&sb.id, "head -1 /etc/passwd").await, "root:x:0:0:root:/root:/bin/sh\n");
    let chunks = std::fs::read_dir(s3.root.path().join("warren/chunks/sha256")).map(|d| d.count()).unwrap_or(0);
    assert!(chunks > 0, "the layer's chunks are in the bucket");
    assert!(!server.data_dir().join("blobs").exists(), "and not in the node's data dir");
    server.finish().await;
}

async fn layer_stats(server: &TestServer) -> Vec<warren_api::LayerCacheStats> {
    let (status, stats) = server.call(Method::GET, "/v1/images/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{stats}");
    serde_json::from_value(stats["layers"].clone()).unwrap()
}

#[tokio::test]
async fn image_stats_count_the_access_trace_one_node_stores_and_the_next_replays() {
    let mut server = TestServer::start().await;
    import_lazybox(&server).await;
    let sb = server.create(small(json!({"image": "lazybox"}))).await;
    server.sh_ok(&sb.id, "cat /bin/busybox > /dev/null").await;
    server.delete(&sb.id).await;
    // The layer's last lease went: its trace is stored in the background.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let recorded = loop {
        let layers = layer_stats(&server).await;
        if layers.first().is_some_and(|l| l.traces_published == 1) {
            break layers[0].clone();
        }
        assert!(std::time::Instant::now() < deadline, "no trace stored: {layers:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(recorded.traced_units >= 1, "{recorded:?}");
    assert_eq!(recorded.trace_units_replayed, 0, "no trace was stored before: {recorded:?}");

    // The same node with its layer cache gone is new to the layer: the
    // create replays the stored trace.
    server.stop().await;
    std::fs::remove_dir_all(server.data_dir().join("layer-cache")).unwrap();
    server.launch().await;
    let sb = server.create(small(json!({"image": "lazybox"}))).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let replayed = loop {
        let layers = layer_stats(&server).await;
        let l = layers.first().cloned().expect("the layer is cached again");
        if l.trace_units_replayed >= 1 && l.trace_replays_running == 0 {
            break l;
        }
        assert!(std::time::Instant::now() < deadline, "the trace was not replayed: {l:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(replayed.failed_trace_units, 0, "{replayed:?}");
    assert!(replayed.trace_bytes_replayed > 0, "{replayed:?}");
    assert!(replayed.trace_units_replayed <= recorded.traced_units, "{replayed:?}");
    assert!(replayed.traced_units >= recorded.traced_units, "the replayed trace seeds the node's own: {replayed:?}");
    assert_eq!(server.sh_ok(&sb.id, "head -c 5 /etc/group").await, "root:");
    server.finish().await;
}
