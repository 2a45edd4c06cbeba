//! The chunked blob store on a local directory and on a real S3-compatible
//! server (s3s-fs, started per test on 127.0.0.1 with an OS-chosen port).
//! Run as root (layers are built with mkfs.erofs from trees with owners).

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use tempfile::TempDir;
use warren_image::blob::{BlobError, BlobStore, ChunkSource, LayerMeta, S3Config};
use warren_image::erofs::{self, BuildOptions, BuiltLayer};
use warren_image::layer::{LayerError, LayerManifest, LayerRole};
use warren_image::metablob;

const KIB: u64 = 1024;

/// Deterministic bytes that do not compress or repeat across seeds.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Builds a layer of `files` files of `file_len` bytes each, file `i`
/// holding `noise(file_len, seeds(i))`.
fn build_layer(dir: &Path, name: &str, files: usize, file_len: usize, seeds: impl Fn(usize) -> u64) -> BuiltLayer {
    let src = dir.join(format!("{name}-src"));
    fs::create_dir_all(&src).unwrap();
    for i in 0..files {
        fs::write(src.join(format!("file-{i:04}")), noise(file_len, seeds(i))).unwrap();
    }
    let opts = BuildOptions { timestamps: erofs::Timestamps::Fixed(0), ..BuildOptions::default() };
    erofs::build_from_dir(&src, &dir.join(format!("{name}.erofs")), &opts).unwrap()
}

fn meta(name: &str, version: &str, role: LayerRole) -> LayerMeta {
    LayerMeta { name: name.into(), version: version.into(), role }
}

fn count_files(dir: &Path) -> usize {
    match fs::read_dir(dir) {
        Ok(entries) => entries.count(),
        Err(_) => 0,
    }
}

/// The behaviour every backend must show, on `store` whose objects live
/// under the local directory `objects` (to count and to corrupt them).
async fn exercise_store(store: BlobStore, objects: &Path, work: &Path) {
    let base = build_layer(work, "base", 24, 50_000, |i| i as u64);
    let chunk_dir = objects.join("chunks/sha256");

    // Push: manifest matches the file, chunks tile it, objects are stored.
    let manifest = store.push_layer(&base.path, &meta("base", "1", LayerRole::Base)).await.unwrap();
    assert_eq!(manifest.digest, base.digest);
    assert_eq!(manifest.size, base.size);
    assert_eq!(manifest.metadata_ranges, base.metadata_ranges);
    assert_eq!(manifest.chunks.len() as u64, base.size.div_ceil(store.chunk_size()));
    let unique: std::collections::HashSet<_> = manifest.chunks.iter().collect();
    assert_eq!(count_files(&chunk_dir), unique.len());
    assert!(objects.join("layers/base/1.json").is_file());
    assert_eq!(store.get_layer_manifest("base", "1").await.unwrap(), manifest);

    // Every chunk fetched is the file's bytes; the counters follow.
    let file = fs::read(&base.path).unwrap();
    let before = store.stats();
    for index in 0..manifest.chunks.len() {
        let (offset, len) = manifest.chunk_extent(index).unwrap();
        let chunk = ChunkSource::fetch_chunk(&store, &manifest, index).await.unwrap();
        assert_eq!(&chunk[..], &file[offset as usize..(offset + len) as usize]);
    }
    let after = store.stats();
    assert_eq!(after.chunks_fetched - before.chunks_fetched, manifest.chunks.len() as u64);
    assert_eq!(after.bytes_fetched - before.bytes_fetched, base.size);
    let past = store.fetch_chunk(&manifest, manifest.chunks.len()).await.unwrap_err();
    assert!(matches!(past, BlobError::ChunkIndex { .. }), "{past}");

    // Eager pull reassembles the exact file.
    let pulled = work.join("pulled.erofs");
    store.pull_layer_eager(&manifest, &pulled).await.unwrap();
    assert_eq!(fs::read(&pulled).unwrap(), file);

    // The metadata blob holds exactly the file's metadata pages.
    let blob_ref = manifest.metadata_blob.clone().expect("a pushed layer has a metadata blob");
    let blob = store.fetch_metadata_blob(&manifest).await.unwrap();
    let ranges = metablob::decode(&blob, &blob_ref.digest, &manifest.metadata_pages()).unwrap();
    let carried: u64 = ranges.iter().map(|(_, b)| b.len() as u64).sum();
    assert!(carried >= base.metadata_ranges.iter().map(|r| r.1).sum::<u64>());
    assert!(carried < base.size / 4, "{carried} of {} bytes are metadata", base.size);
    for (offset, bytes) in ranges {
        assert_eq!(bytes, &file[offset as usize..offset as usize + bytes.len()]);
    }
    // It is stored compressed, under the digest of the stored bytes.
    let stored = blob_ref.stored.clone().expect("a pushed layer's blob is stored compressed");
    let blob_path = objects.join(format!("metadata/sha256/{}", &stored.digest[7..]));
    assert_eq!(fs::metadata(&blob_path).unwrap().len(), stored.size);
    assert!(stored.size < blob_ref.size, "compressed {} of {} bytes", stored.size, blob_ref.size);
    assert_eq!(metablob::digest(&blob), blob_ref.digest, "the fetch hands out the inflated blob");

    // Pushing the same layer again stores nothing new.
    let uploaded = store.stats().chunks_uploaded;
    assert_eq!(store.push_layer(&base.path, &meta("base", "1", LayerRole::Base)).await.unwrap(), manifest);
    assert_eq!(store.stats().chunks_uploaded, uploaded);

    // A manifest stored before metadata blobs existed gets one when the
    // same file is pushed again; no chunk moves.
    let legacy = LayerManifest { metadata_blob: None, ..manifest.clone() };
    fs::write(objects.join("layers/base/1.json"), legacy.to_json().unwrap()).unwrap();
    fs::remove_file(&blob_path).unwrap();
    assert!(matches!(store.fetch_metadata_blob(&legacy).await, Err(BlobError::NoMetadataBlob(_))));
    assert_eq!(store.push_layer(&base.path, &meta("base", "1", LayerRole::Base)).await.unwrap(), manifest);
    assert_eq!(store.get_layer_manifest("base", "1").await.unwrap(), manifest);
    assert_eq!(store.stats().chunks_uploaded, uploaded);
    assert_eq!(store.fetch_metadata_blob(&manifest).await.unwrap(), blob);
    // A blob stored uncompressed (manifests from before compression) is
    // still served, under its own digest.
    let raw_ref = warren_image::layer::MetadataBlobRef { stored: None, ..blob_ref.clone() };
    let raw = LayerManifest { metadata_blob: Some(raw_ref), ..manifest.clone() };
    fs::write(objects.join(format!("metadata/sha256/{}", &blob_ref.digest[7..])), &blob).unwrap();
    assert_eq!(store.fetch_metadata_blob(&raw).await.unwrap(), blob);
    fs::remove_file(objects.join(format!("metadata/sha256/{}", &blob_ref.digest[7..]))).unwrap();

    // Pieces. A store that records 16 KiB piece digests: a layer first
    // pushed without them gets them on the next push, and no chunk moves.
    let pieced_store = store.clone().with_piece_size(Some(16 * KIB)).unwrap();
    let plain_store = store.clone().with_piece_size(None).unwrap();
    let layer = build_layer(work, "pieced", 6, 50_000, |i| 500 + i as u64);
    let plain = plain_store.push_layer(&layer.path, &meta("pieced", "1", LayerRole::Base)).await.unwrap();
    assert_eq!((plain.piece_size, plain.pieces.len()), (None, 0));
    let whole = store.clone().with_piece_size(Some(64 * KIB)).unwrap();
    assert_eq!(whole.piece_size(), None, "a 64 KiB piece in a 64 KiB chunk is no piece");
    let err = store.fetch_pieces(&plain, 0, 1).await.unwrap_err();
    assert!(matches!(err, BlobError::PieceRange { .. }), "{err}");
    let uploaded = store.stats().chunks_uploaded;
    let pieced = pieced_store.push_layer(&layer.path, &meta("pieced", "1", LayerRole::Base)).await.unwrap();
    assert_eq!(pieced.piece_size, Some(16 * KIB));
    assert_eq!(pieced.pieces.len() as u64, layer.size.div_ceil(16 * KIB));
    assert_eq!((&pieced.chunks, &pieced.digest), (&plain.chunks, &plain.digest));
    assert_eq!(store.stats().chunks_uploaded, uploaded, "adding pieces moved no chunk");
    assert_eq!(store.get_layer_manifest("pieced", "1").await.unwrap(), pieced);
    // Pushing it again without pieces keeps the stored manifest.
    assert_eq!(plain_store.push_layer(&layer.path, &meta("pieced", "1", LayerRole::Base)).await.unwrap(), pieced);

    // A run of pieces is one ranged GET, each piece the file's bytes.
    let file = fs::read(&layer.path).unwrap();
    let before = store.stats();
    let run = store.fetch_pieces(&pieced, 1, 3).await.unwrap();
    assert_eq!(run.len(), 3);
    for (k, piece) in run.iter().enumerate() {
        let (offset, len) = pieced.fetch_unit_extent(1 + k).unwrap();
        assert_eq!(&piece[..], &file[offset as usize..(offset + len) as usize]);
    }
    let after = store.stats();
    assert_eq!(after.range_requests - before.range_requests, 1);
    assert_eq!(after.pieces_fetched - before.pieces_fetched, 3);
    assert_eq!(after.bytes_fetched - before.bytes_fetched, 48 * KIB);
    assert_eq!(after.chunks_fetched, before.chunks_fetched, "no whole chunk was read");
    // The last piece of the layer may be short; it is fetched as it is.
    let last = pieced.pieces.len() - 1;
    let tail = store.fetch_pieces(&pieced, last, 1).await.unwrap();
    assert_eq!(&tail[0][..], &file[(last as u64 * 16 * KIB) as usize..]);
    // A run that crosses a chunk border is not one object's range.
    let err = store.fetch_pieces(&pieced, 3, 2).await.unwrap_err();
    assert!(matches!(err, BlobError::PieceRange { .. }), "{err}");
    // Bytes that do not match a piece's digest fail the whole run.
    let mut forged = pieced.clone();
    forged.pieces[2] = format!("sha256:{}", "0".repeat(64));
    let rejected = store.stats().chunks_rejected;
    let err = store.fetch_pieces(&forged, 1, 3).await.unwrap_err();
    assert!(matches!(err, BlobError::PieceCorrupt { index: 2, .. }), "{err}");
    assert_eq!(store.stats().chunks_rejected, rejected + 1);

    // Another file under the same name and version is refused.
    let other = build_layer(work, "other", 3, 10_000, |i| 1000 + i as u64);
    let err = store.push_layer(&other.path, &meta("base", "1", LayerRole::Base)).await.unwrap_err();
    assert!(matches!(err, BlobError::LayerExists { .. }), "{err}");

    // A layer sharing most files shares their chunks (the changed file is
    // the last one, so no data before it moves).
    let toolkit1 = build_layer(work, "toolkit1", 24, 50_000, |i| 100 + i as u64);
    let toolkit2 = build_layer(work, "toolkit2", 24, 50_000, |i| if i == 23 { 999 } else { 100 + i as u64 });
    let tk1 = store.push_layer(&toolkit1.path, &meta("toolkit", "1", LayerRole::Toolkit)).await.unwrap();
    let stats = store.stats();
    let tk2 = store.push_layer(&toolkit2.path, &meta("toolkit", "2", LayerRole::Toolkit)).await.unwrap();
    let sent = store.stats().chunks_uploaded - stats.chunks_uploaded;
    let deduplicated = store.stats().chunks_deduplicated - stats.chunks_deduplicated;
    assert!(sent < tk2.chunks.len() as u64 / 2, "sent {sent} of {} chunks", tk2.chunks.len());
    assert!(deduplicated > 0);

    // Composing images copies no data: only image manifests appear.
    let chunks_before = count_files(&chunk_dir);
    let v1 = store.compose_image("py", "v1", &[("base", "1"), ("toolkit", "1")]).await.unwrap();
    let v2 = store.compose_image("py", "v2", &[("base", "1"), ("toolkit", "2")]).await.unwrap();
    assert_eq!(count_files(&chunk_dir), chunks_before);
    assert_eq!(v1.layers[0], v2.layers[0]);
    assert_eq!(store.get_image_manifest("py", "v2").await.unwrap(), v2);
    assert_eq!(store.image_layers(&v2).await.unwrap(), vec![manifest.clone(), tk2.clone()]);
    // A layer version is never rewritten, so its manifest is read once: a
    // second read of v2's layers comes from memory, even with the stored
    // manifest moved away (a create from a known image reads only the
    // image's manifest).
    let stored = objects.join("layers/toolkit/2.json");
    let aside = work.join("toolkit-2.json");
    fs::rename(&stored, &aside).unwrap();
    assert_eq!(store.image_layers(&v2).await.unwrap(), vec![manifest.clone(), tk2.clone()]);
    fs::rename(&aside, &stored).unwrap();
    let missing = store.compose_image("py", "v3", &[("base", "1"), ("toolkit", "9")]).await.unwrap_err();
    assert!(matches!(missing, BlobError::NotFound(_)), "{missing}");

    // A layer manifest swapped for another layer is caught through the image.
    let forged = LayerManifest { name: "toolkit".into(), version: "1".into(), ..tk2.clone() };
    fs::write(objects.join("layers/toolkit/1.json"), forged.to_json().unwrap()).unwrap();
    let err = store.image_layers(&v1).await.unwrap_err();
    assert!(matches!(err, BlobError::Manifest(LayerError::DigestMismatch { .. })), "{err}");
    fs::write(objects.join("layers/toolkit/1.json"), tk1.to_json().unwrap()).unwrap();

    // A corrupted chunk is an error, never data; the eager pull leaves
    // nothing behind.
    let victim = manifest.chunks[1].trim_start_matches("sha256:");
    let victim_path = chunk_dir.join(victim);
    let mut bytes = fs::read(&victim_path).unwrap();
    bytes[100] ^= 0xff;
    fs::write(&victim_path, &bytes).unwrap();
    let rejected = store.stats().chunks_rejected;
    let err = store.fetch_chunk(&manifest, 1).await.unwrap_err();
    assert!(matches!(err, BlobError::ChunkCorrupt { index: 1, .. }), "{err}");
    assert_eq!(store.stats().chunks_rejected, rejected + 1);
    let pull_dir = work.join("pull");
    fs::create_dir(&pull_dir).unwrap();
    let err = store.pull_layer_eager(&manifest, &pull_dir.join("base.erofs")).await.unwrap_err();
    assert!(matches!(err, BlobError::ChunkCorrupt { .. }), "{err}");
    assert_eq!(count_files(&pull_dir), 0);

    // So is a corrupted or truncated metadata blob.
    let mut bytes = fs::read(&blob_path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&blob_path, &bytes).unwrap();
    let err = store.fetch_metadata_blob(&manifest).await.unwrap_err();
    assert!(matches!(err, BlobError::MetadataCorrupt { .. }), "{err}");
    fs::write(&blob_path, &bytes[..last]).unwrap();
    let err = store.fetch_metadata_blob(&manifest).await.unwrap_err();
    assert!(matches!(err, BlobError::MetadataCorrupt { .. }), "{err}");
}

#[tokio::test]
async fn local_store_pushes_dedups_verifies_and_composes() {
    let tmp = TempDir::new().unwrap();
    let objects = tmp.path().join("store");
    let store = BlobStore::local(&objects).unwrap().with_chunk_size(64 * KIB).unwrap();
    let work = tmp.path().join("work");
    fs::create_dir(&work).unwrap();
    exercise_store(store, &objects, &work).await;
}

#[tokio::test]
async fn reopened_store_serves_what_another_handle_pushed() {
    let tmp = TempDir::new().unwrap();
    let objects = tmp.path().join("store");
    let layer = build_layer(tmp.path(), "base", 4, 30_000, |i| i as u64);
    let first = BlobStore::local(&objects).unwrap();
    let pushed = first.push_layer(&layer.path, &meta("base", "7", LayerRole::Base)).await.unwrap();
    assert_eq!(pushed.chunk_size, first.chunk_size());

    // A second store with another chunk size still reads the layer as it
    // was chunked.
    let second = BlobStore::local(&objects).unwrap().with_chunk_size(4096).unwrap();
    let manifest = second.get_layer_manifest("base", "7").await.unwrap();
    let dest = tmp.path().join("copy.erofs");
    second.pull_layer_eager(&manifest, &dest).await.unwrap();
    assert_eq!(fs::read(&dest).unwrap(), fs::read(&layer.path).unwrap());
}

#[test]
fn chunk_sizes_must_be_block_multiples_and_powers_of_two() {
    let tmp = TempDir::new().unwrap();
    let store = BlobStore::local(tmp.path()).unwrap();
    for ok in [256 * KIB, 1024 * KIB, 4096 * KIB] {
        assert_eq!(store.clone().with_chunk_size(ok).unwrap().chunk_size(), ok);
    }
    for bad in [0, 1000, 2048, 3 * 4096, 128 << 20] {
        assert!(matches!(store.clone().with_chunk_size(bad), Err(BlobError::InvalidChunkSize(_))), "{bad}");
    }
}

#[tokio::test]
async fn pushing_a_file_that_is_not_erofs_is_refused_before_any_upload() {
    let tmp = TempDir::new().unwrap();
    let objects = tmp.path().join("store");
    let store = BlobStore::local(&objects).unwrap();
    let junk = tmp.path().join("junk");
    fs::write(&junk, noise(100_000, 1)).unwrap();
    let err = store.push_layer(&junk, &meta("junk", "1", LayerRole::Other)).await.unwrap_err();
    assert!(matches!(err, BlobError::Erofs(_)), "{err}");
    assert_eq!(count_files(&objects), 0);
}

#[tokio::test]
async fn names_that_would_leave_the_store_prefix_are_refused() {
    let tmp = TempDir::new().unwrap();
    let store = BlobStore::local(&tmp.path().join("store")).unwrap();
    let layer = build_layer(tmp.path(), "base", 1, 100, |i| i as u64);
    let err = store.push_layer(&layer.path, &meta("..", "1", LayerRole::Base)).await.unwrap_err();
    assert!(matches!(err, BlobError::Manifest(LayerError::InvalidName { .. })), "{err}");
}

/// An s3s-fs process serving a temp dir, killed (by its pid) when dropped.
struct S3Server {
    child: Child,
    endpoint: String,
    root: TempDir,
}

const S3_BUCKET: &str = "warren";
const S3_KEY: &str = "warren-test";
const S3_SECRET: &str = "warren-test-secret";

impl S3Server {
    fn start() -> Self {
        let binary = s3s_fs_binary();
        let root = TempDir::new().unwrap();
        fs::create_dir(root.path().join(S3_BUCKET)).unwrap();
        let mut child = Command::new(&binary)
            .args(["--host", "127.0.0.1", "--port", "0", "--access-key", S3_KEY, "--secret-key", S3_SECRET])
            .arg(root.path())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Keep draining the log so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(at) = line.find("server is running at ") {
                    let _ = tx.send(line[at + "server is running at ".len()..].trim().to_owned());
                }
            }
        });
        let endpoint = match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(endpoint) => endpoint,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("s3s-fs did not report its address");
            }
        };
        Self { child, endpoint, root }
    }

    fn config(&self) -> S3Config {
        S3Config {
            endpoint: self.endpoint.clone(),
            bucket: S3_BUCKET.into(),
            region: "us-east-1".into(),
            access_key_id: S3_KEY.into(),
            secret_access_key: S3_SECRET.into(),
            allow_http: true,
        }
    }

    fn objects(&self) -> PathBuf {
        self.root.path().join(S3_BUCKET)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3s_fs_binary() -> PathBuf {
    let candidates = std::env::var_os("WARREN_S3S_FS")
        .map(PathBuf::from)
        .into_iter()
        .chain([Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/bin/s3s-fs")])
        .chain(
            std::env::var_os("PATH")
                .into_iter()
                .flat_map(|p| std::env::split_paths(&p).map(|d| d.join("s3s-fs")).collect::<Vec<_>>()),
        );
    for candidate in candidates {
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "\n\n*** The S3 blob-store tests need the s3s-fs server and it is not installed. ***\n\
         Install it with:\n    crates/warren-image/scripts/s3-server.sh install\n\
         (cargo install s3s-fs --version 0.14.1 --locked --features binary --root target/tools)\n\
         or point WARREN_S3S_FS at an s3s-fs binary.\n\n"
    );
}

#[tokio::test]
async fn s3_store_pushes_dedups_verifies_and_composes_against_a_real_server() {
    let server = S3Server::start();
    let store = BlobStore::s3(&server.config()).unwrap().with_chunk_size(64 * KIB).unwrap();
    let work = TempDir::new().unwrap();
    exercise_store(store, &server.objects(), work.path()).await;
}

#[tokio::test]
async fn s3_store_with_wrong_credentials_is_refused_by_the_server() {
    let server = S3Server::start();
    let config = S3Config { secret_access_key: "wrong".into(), ..server.config() };
    let store = BlobStore::s3(&config).unwrap();
    let err = store.get_layer_manifest("base", "1").await.unwrap_err();
    assert!(matches!(err, BlobError::Store { .. }), "{err}");
    assert!(err.to_string().contains("403") || err.to_string().contains("Forbidden"), "{err}");
}

/// Chunk-size trade-off: dedup between two similar layers and push time.
/// Two kinds of "similar": v2 edits a few files in place (no data moves),
/// v3 also adds and removes a file (data and inode numbers after them move).
/// Run with `cargo test --release -p warren-image --test blob -- --ignored
/// --nocapture` (WARREN_MEASURE_TREE picks the tree, default
/// /usr/lib/python3).
#[tokio::test]
#[ignore = "measurement, prints a table"]
async fn measure_chunk_sizes() {
    let tmp = TempDir::new().unwrap();
    let source =
        std::env::var_os("WARREN_MEASURE_TREE").map(PathBuf::from).unwrap_or_else(|| "/usr/lib/python3".into());
    let copy = |name: &str| {
        let dst = tmp.path().join(name);
        let status = Command::new("cp").arg("-a").arg(&source).arg(&dst).status().unwrap();
        assert!(status.success());
        dst
    };
    let v1_src = copy("v1");
    let v2_src = copy("v2");
    let files = large_files(&v2_src);
    for path in files.iter().step_by(files.len() / 8) {
        let mut bytes = fs::read(path).unwrap();
        bytes[1000] ^= 0x55;
        fs::write(path, bytes).unwrap();
    }
    let v3_src = copy("v3");
    let files = large_files(&v3_src);
    fs::remove_file(&files[files.len() / 2]).unwrap();
    fs::write(v3_src.join("added.py"), noise(70_000, 5)).unwrap();

    let opts = BuildOptions::default();
    let v1 = erofs::build_from_dir(&v1_src, &tmp.path().join("v1.erofs"), &opts).unwrap();
    let v2 = erofs::build_from_dir(&v2_src, &tmp.path().join("v2.erofs"), &opts).unwrap();
    let v3 = erofs::build_from_dir(&v3_src, &tmp.path().join("v3.erofs"), &opts).unwrap();
    let meta_bytes: u64 = v1.metadata_ranges.iter().map(|r| r.1).sum();
    println!("source {} | v1 {} bytes ({} metadata)", source.display(), v1.size, meta_bytes);
    println!("{:>6} {:>11} {:>8} {:>8} {:>8} {:>8}", "chunk", "push v1 ms", "v2 new", "v2 dup%", "v3 new", "v3 dup%");
    for chunk in [256 * KIB, 1024 * KIB, 4096 * KIB] {
        let store =
            BlobStore::local(&tmp.path().join(format!("store-{chunk}"))).unwrap().with_chunk_size(chunk).unwrap();
        let t = Instant::now();
        store.push_layer(&v1.path, &meta("tk", "1", LayerRole::Toolkit)).await.unwrap();
        let push1 = t.elapsed();
        let mut cols = Vec::new();
        for (version, layer) in [("2", &v2), ("3", &v3)] {
            let before = store.stats();
            let m = store.push_layer(&layer.path, &meta("tk", version, LayerRole::Toolkit)).await.unwrap();
            let new = store.stats().chunks_uploaded - before.chunks_uploaded;
            let dup = store.stats().chunks_deduplicated - before.chunks_deduplicated;
            cols.push(format!("{:>8} {:>7.1}%", new, 100.0 * dup as f64 / m.chunks.len() as f64));
        }
        println!("{:>5}K {:>11.1} {} {}", chunk / KIB, push1.as_secs_f64() * 1e3, cols[0], cols[1]);
    }
}

fn large_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() && e.metadata().unwrap().len() > 2000 {
                files.push(e.path());
            }
        }
    }
    files.sort();
    files
}

#[tokio::test]
async fn garbage_collection_removes_only_what_no_image_or_lease_needs() {
    let tmp = TempDir::new().unwrap();
    let objects = tmp.path().join("store");
    let store = BlobStore::local(&objects).unwrap().with_chunk_size(64 * KIB).unwrap();
    let none = std::collections::HashSet::new();
    // An empty store has nothing to list or collect.
    assert!(store.list_images().await.unwrap().is_empty());
    assert_eq!(store.collect_garbage(&none).await.unwrap().bytes_freed, 0);

    let a = build_layer(tmp.path(), "a", 4, 100_000, |i| i as u64);
    let b = build_layer(tmp.path(), "b", 4, 100_000, |i| 100 + i as u64);
    store.push_layer(&a.path, &meta("a", "1", LayerRole::Base)).await.unwrap();
    let b_manifest = store.push_layer(&b.path, &meta("b", "1", LayerRole::Toolkit)).await.unwrap();
    store.compose_image("one", "latest", &[("a", "1")]).await.unwrap();
    store.compose_image("two", "latest", &[("a", "1"), ("b", "1")]).await.unwrap();
    let names: Vec<String> = store.list_images().await.unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["one", "two"]);
    let chunks_before = count_files(&objects.join("chunks/sha256"));
    assert_eq!(count_files(&objects.join("metadata/sha256")), 2);
    // Access traces are stored by layer digest and read back as stored.
    assert!(store.fetch_trace(&b_manifest).await.unwrap().is_none(), "no trace yet");
    let trace = bytes::Bytes::from_static(br#"{"version":1,"unit_size":16384,"runs":[[3,2]]}"#);
    store.put_trace(&b_manifest, trace.clone()).await.unwrap();
    assert_eq!(store.fetch_trace(&b_manifest).await.unwrap(), Some(trace));
    let a_manifest = store.get_layer_manifest("a", "1").await.unwrap();
    store.put_trace(&a_manifest, bytes::Bytes::from_static(b"{}")).await.unwrap();
    assert_eq!(count_files(&objects.join("traces/sha256")), 2);

    let report = store.collect_garbage(&none).await.unwrap();
    assert_eq!((report.layers_removed, report.chunks_removed, report.bytes_freed), (0, 0, 0));
    assert!(report.kept_layer_digests.contains(&b_manifest.digest));

    store.delete_image("two", "latest").await.unwrap();
    assert!(matches!(store.delete_image("two", "latest").await, Err(BlobError::NotFound(_))));
    // A layer still in use (leased by a sandbox) survives with its chunks.
    let leased = std::collections::HashSet::from([b_manifest.digest.clone()]);
    assert_eq!(store.collect_garbage(&leased).await.unwrap().layers_removed, 0);

    let report = store.collect_garbage(&none).await.unwrap();
    assert_eq!(report.layers_removed, 1);
    assert_eq!(report.chunks_removed as usize, chunks_before - count_files(&objects.join("chunks/sha256")));
    assert!(report.chunks_removed > 0 && report.bytes_freed > 400_000, "{report:?}");
    assert!(matches!(store.get_layer_manifest("b", "1").await, Err(BlobError::NotFound(_))));
    assert!(store.fetch_trace(&b_manifest).await.unwrap().is_none(), "the removed layer's trace went with it");
    assert!(store.fetch_trace(&a_manifest).await.unwrap().is_some(), "a kept layer's trace stays");
    // What image `one` needs is all still there.
    let a_manifest = store.get_layer_manifest("a", "1").await.unwrap();
    assert_eq!(count_files(&objects.join("metadata/sha256")), 1);
    store.fetch_metadata_blob(&a_manifest).await.unwrap();
    let dest = tmp.path().join("a-copy.erofs");
    store.pull_layer_eager(&a_manifest, &dest).await.unwrap();
    assert_eq!(fs::read(&dest).unwrap(), fs::read(&a.path).unwrap());
}
