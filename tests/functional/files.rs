//! Files: streamed upload and download, stat, list, mkdir, remove, modes,
//! and path resolution that never leaves the sandbox's root - whatever
//! `..` and symlinks made inside the sandbox say.

use std::fs;

use reqwest::StatusCode;
use serde_json::json;
use warren_api::{ErrorCode, FileKind, FileList, FileStat};
use warren_tests::rootfs::SANDBOX_HOSTNAME_FILE;
use warren_tests::*;

const MIB: usize = 1 << 20;

#[tokio::test]
async fn large_file_round_trips_streamed() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let data = pattern(20 * MIB);
    let (status, body) = server.put_file(&sb.id, "/work/blob.bin", chunked_body(&data), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let stat: FileStat = from_json(body);
    assert_eq!((stat.path.as_str(), stat.kind, stat.size_bytes), ("/work/blob.bin", FileKind::File, data.len() as u64));

    let (status, got) = server.get_file(&sb.id, "/work/blob.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert!(got.as_ref() == data.as_slice(), "downloaded {} bytes differ from the {} uploaded", got.len(), data.len());
    let inside = server.sh_ok(&sb.id, "wc -c < /work/blob.bin; od -An -tx1 -N4 /work/blob.bin").await;
    let want = format!("{}\n{}", data.len(), data[..4].iter().map(|b| format!(" {b:02x}")).collect::<String>());
    assert_eq!(inside.trim_end(), want, "the sandbox sees the same bytes");
    server.finish().await;
}

#[tokio::test]
async fn stat_list_mkdir_and_remove() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let (status, body) = server.mkdir(&sb.id, json!({"path": "/work/a/b", "parents": true})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(from_json::<FileStat>(body).kind, FileKind::Dir);
    let (status, body) = server.mkdir(&sb.id, json!({"path": "/work/a/b"})).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.mkdir(&sb.id, json!({"path": "/work/missing/child"})).await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let url = format!("/v1/sandboxes/{}/files/mkdir", sb.id);
    let (status, body) = server.call(reqwest::Method::POST, &url, None).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("path"));

    server.put_file_ok(&sb.id, "/work/a/b/x.txt", "hello").await;
    server.put_file_ok(&sb.id, "/work/a/b/y.txt", "longer text").await;
    let (status, body) = server.list_dir(&sb.id, "/work/a/b").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list: FileList = from_json(body);
    let mut entries: Vec<(String, u64)> = list.entries.iter().map(|e| (e.path.clone(), e.size_bytes)).collect();
    entries.sort();
    assert_eq!(entries, vec![("/work/a/b/x.txt".to_string(), 5), ("/work/a/b/y.txt".to_string(), 11)]);

    let (status, body) = server.stat(&sb.id, "/work/a").await;
    assert_eq!((status, from_json::<FileStat>(body).kind), (StatusCode::OK, FileKind::Dir));
    let (status, body) = server.stat(&sb.id, "/work/nope").await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let (status, _) = server.get_file(&sb.id, "/work/a").await;
    assert_eq!(status, StatusCode::CONFLICT, "downloading a directory is a conflict");
    let (status, body) = server.list_dir(&sb.id, "/work/a/b/x.txt").await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));

    let (status, body) = server.remove_file(&sb.id, "/work/a/b/x.txt", false).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = server.stat(&sb.id, "/work/a/b/x.txt").await;
    assert_api_error(status, &body, ErrorCode::FileNotFound, Some("path"));
    let (status, body) = server.remove_file(&sb.id, "/work/a", false).await;
    assert_api_error(status, &body, ErrorCode::FileConflict, Some("path"));
    let (status, body) = server.remove_file(&sb.id, "/work/a", true).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert_eq!(server.sh_ok(&sb.id, "ls -A /work").await, "", "the tree is gone inside too");
    server.finish().await;
}

#[tokio::test]
async fn modes_are_applied_and_files_belong_to_sandbox_root() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let (status, body) = server.put_file(&sb.id, "/work/run.sh", "#!/bin/sh\necho ran-$1\n", Some("755")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(from_json::<FileStat>(body).mode & 0o7777, 0o755);
    let r = server.exec_wait(&sb.id, &warren_api::ExecRequest::argv(["/work/run.sh", "ok"])).await;
    assert_eq!(stdout(&r), "ran-ok\n", "an uploaded 0755 script runs");

    server.put_file_ok(&sb.id, "/work/plain.txt", "x").await;
    let (status, body) = server.mkdir(&sb.id, json!({"path": "/work/private", "mode": "700"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let listing = server.sh_ok(&sb.id, "stat -c '%a %u %g %n' /work/run.sh /work/plain.txt /work/private").await;
    assert_eq!(listing, "755 0 0 /work/run.sh\n644 0 0 /work/plain.txt\n700 0 0 /work/private\n");

    let (status, body) = server.put_file(&sb.id, "/work/bad-mode", "x", Some("999")).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("mode"));
    let (status, body) = server.put_file(&sb.id, "relative.txt", "x", None).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("path"));
    server.finish().await;
}

/// A file on the host, outside the sandbox, that no path must reach.
struct HostSecret {
    marker: String,
    size: u64,
    /// Absolute host path of the secret file.
    file: String,
    /// Absolute host path of the directory holding it.
    dir: String,
}

fn plant_host_secret(server: &TestServer) -> HostSecret {
    let marker = unique_marker("host-secret");
    let dir = server.path().join("host-only");
    fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret.txt");
    // Long and odd-sized, so no symlink or sandbox file has its size by chance.
    fs::write(&file, format!("{marker}\n").repeat(37)).unwrap();
    let size = fs::metadata(&file).unwrap().len();
    HostSecret { marker, size, file: file.display().to_string(), dir: dir.display().to_string() }
}

/// A download must either fail with a client error or give sandbox content;
/// it never gives the host's secret.
async fn assert_not_leaked(server: &TestServer, id: &str, path: &str, secret: &HostSecret) {
    let (status, body) = server.get_file(id, path).await;
    let text = String::from_utf8_lossy(&body);
    assert!(!text.contains(&secret.marker), "GET {path} returned the host's secret");
    assert!(status == StatusCode::OK || status.is_client_error(), "GET {path}: {status} {text}");
}

#[tokio::test]
async fn symlinks_and_dotdot_cannot_reach_host_files() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let secret = plant_host_secret(&server);
    let host_hostname = fs::read_to_string("/etc/hostname").unwrap_or_default();
    server
        .sh_ok(
            &sb.id,
            &format!(
                "ln -s / /evil && ln -s ../../../../ /up && ln -s {file} /direct-file && ln -s {dir} /direct-dir",
                file = secret.file,
                dir = secret.dir
            ),
        )
        .await;

    let (status, body) = server.get_file(&sb.id, "/evil/etc/hostname").await;
    if status == StatusCode::OK {
        assert_eq!(body.as_ref(), SANDBOX_HOSTNAME_FILE.as_bytes(), "/evil/etc/hostname is the sandbox's file");
    } else {
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
    assert_ne!(host_hostname.as_bytes(), SANDBOX_HOSTNAME_FILE.as_bytes(), "the test can tell the two apart");
    let (status, body) = server.get_file(&sb.id, "/../../../../etc/passwd").await;
    assert!(
        status.is_client_error() || body.as_ref() == b"root:x:0:0:root:/root:/bin/sh\n",
        "`..` above / stays at the sandbox's root: {status} {}",
        String::from_utf8_lossy(&body)
    );

    for path in [
        format!("/evil{}", secret.file),
        format!("/up{}", secret.file),
        format!("/up/up/up{}", secret.file),
        format!("/tmp/../../..{}", secret.file),
        "/direct-file".to_string(),
        "/direct-dir/secret.txt".to_string(),
        secret.file.clone(),
    ] {
        assert_not_leaked(&server, &sb.id, &path, &secret).await;
        let (status, body) = server.stat(&sb.id, &path).await;
        assert!(status.is_client_error() || status == StatusCode::OK, "stat {path}: {status} {body}");
        assert_ne!(body["size_bytes"], json!(secret.size), "stat {path} sees the host file: {body}");
    }
    for dir in [format!("/evil{}", secret.dir), "/direct-dir".to_string()] {
        let (_, body) = server.list_dir(&sb.id, &dir).await;
        assert!(!body.to_string().contains("secret.txt"), "listing {dir} shows the host dir: {body}");
    }
    assert!(fs::read_to_string(&secret.file).unwrap().starts_with(&secret.marker));
    server.finish().await;
}

#[tokio::test]
async fn upload_through_a_symlink_to_a_host_path_lands_inside() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let secret = plant_host_secret(&server);
    // Inside, the host's directory path exists too, so following the links
    // inside the root has somewhere to land.
    server
        .sh_ok(
            &sb.id,
            &format!(
                "mkdir -p {dir} && ln -s {dir} /hostdir && ln -s ../../../../../../..{dir} /updir \
                 && ln -s {file} /direct-file",
                dir = secret.dir,
                file = secret.file
            ),
        )
        .await;

    for (via, name) in [("/hostdir", "via-abs.txt"), ("/updir", "via-dotdot.txt")] {
        let content = unique_marker(name);
        let (status, body) = server.put_file(&sb.id, &format!("{via}/{name}"), content.clone(), None).await;
        assert!(status.is_success() || status.is_client_error(), "upload through {via}: {status} {body}");
        let host_copy = std::path::Path::new(&secret.dir).join(name);
        assert!(!host_copy.exists(), "upload through {via} wrote to the host at {}", host_copy.display());
        if status.is_success() {
            let inside = server.sh_ok(&sb.id, &format!("cat {}/{name}", secret.dir)).await;
            assert_eq!(inside, content, "the upload through {via} landed inside the sandbox");
        }
    }

    let (status, body) = server.put_file(&sb.id, "/direct-file", "overwritten", None).await;
    assert!(status.is_success() || status.is_client_error(), "upload onto /direct-file: {status} {body}");
    assert!(fs::read_to_string(&secret.file).unwrap().starts_with(&secret.marker), "the host file is untouched");
    let (status, body) = server.mkdir(&sb.id, json!({"path": "/hostdir/newdir"})).await;
    assert!(status.is_success() || status.is_client_error(), "mkdir through /hostdir: {status} {body}");
    assert!(!std::path::Path::new(&secret.dir).join("newdir").exists(), "mkdir through a symlink reached the host");
    let (status, body) = server.remove_file(&sb.id, "/direct-file", false).await;
    assert!(status.is_success() || status.is_client_error(), "remove /direct-file: {status} {body}");
    assert!(std::path::Path::new(&secret.file).exists(), "removing a symlink inside removed the host file");
    server.finish().await;
}
