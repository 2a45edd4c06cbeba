//! The file requests of [`warren_init::proto`], served on a connection's
//! own thread: a microVM's node cannot open the guest's root, so init runs
//! the file code (`warren_init::files`) on its own `/` (the overlay root
//! it switched into), with the same resolution inside the root as the
//! node applies to a container.
//!
//! A container's init answers these too (its `/` is the sandbox's root),
//! though the node serves a container's files from the host.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;

use rustix::fs::{Mode, OFlags};
use warren_init::files::{self, FileError, FsRoot};
use warren_init::mux::MAX_CHUNK_BYTES;
use warren_init::proto::{self, FrameKind, Request, Response, WireFileError};

/// Serves `request` if it is a file request; gives it back otherwise.
pub(crate) fn serve(request: Request, conn: &mut UnixStream) -> Option<Request> {
    serve_in("/", request, conn)
}

/// [`serve`] with the directory `top` as the root (a test's directory).
fn serve_in(top: &str, request: Request, conn: &mut UnixStream) -> Option<Request> {
    let answer = match request {
        Request::StatFile { path } => {
            with_root(top, |root| files::stat(root, &path)).map(|stat| Response::FileStat { stat })
        }
        Request::ListDir { path } => {
            with_root(top, |root| files::list(root, &path)).map(|list| Response::FileList { list })
        }
        Request::Mkdir { path, mode, parents } => {
            with_root(top, |root| files::mkdir(root, &path, mode, parents)).map(|stat| Response::FileStat { stat })
        }
        Request::RemoveFile { path, recursive } => {
            with_root(top, |root| files::remove(root, &path, recursive)).map(|()| Response::FileDone)
        }
        Request::RenameFile { from, to } => {
            with_root(top, |root| files::rename(root, &from, &to)).map(|stat| Response::FileStat { stat })
        }
        Request::ReadFile { path } => {
            read(top, conn, &path);
            return None;
        }
        Request::WriteFile { path, mode } => {
            write(top, conn, &path, mode);
            return None;
        }
        other => return Some(other),
    };
    let _ = proto::write_json(conn, FrameKind::Response, &answer.unwrap_or_else(|e| error(&e)));
    None
}

/// The guest's root as the file code wants it. Init is the guest's root
/// user, so new files belong to uid and gid 0, as files a command creates.
fn root(top: &str) -> Result<FsRoot, FileError> {
    let dir = rustix::fs::open(top, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| FileError::io("open the root", e.into()))?;
    Ok(FsRoot { dir, uid: 0, gid: 0 })
}

fn with_root<T>(top: &str, f: impl FnOnce(&FsRoot) -> Result<T, FileError>) -> Result<T, FileError> {
    f(&root(top)?)
}

fn error(e: &FileError) -> Response {
    Response::FileError { error: WireFileError::from(e) }
}

fn read(top: &str, conn: &mut UnixStream, path: &str) {
    let opened = with_root(top, |root| files::open_read(root, path)).and_then(|f| {
        let size = f.metadata().map_err(|e| FileError::io("stat", e))?.len();
        Ok((f, size))
    });
    let (mut file, size_bytes) = match opened {
        Ok(opened) => opened,
        Err(e) => {
            let _ = proto::write_json(conn, FrameKind::Response, &error(&e));
            return;
        }
    };
    if proto::write_json(conn, FrameKind::Response, &Response::FileOpened { size_bytes }).is_err() {
        return;
    }
    let mut buf = vec![0u8; MAX_CHUNK_BYTES];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if proto::write_frame(conn, FrameKind::Stdout, &buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // No `FileEnd`: the node reports the download as broken off.
            Err(_) => return,
        }
    }
    let _ = proto::write_json(conn, FrameKind::Response, &Response::FileEnd);
}

fn write(top: &str, conn: &mut UnixStream, path: &str, mode: u32) {
    let mut writer = match with_root(top, |root| files::create_write(root, path, mode)) {
        Ok(w) => w,
        Err(e) => {
            let _ = proto::write_json(conn, FrameKind::Response, &error(&e));
            return;
        }
    };
    if proto::write_json(conn, FrameKind::Response, &Response::FileReady).is_err() {
        return;
    }
    let mut size_bytes = 0u64;
    loop {
        match proto::read_frame(conn) {
            Ok(Some((FrameKind::Stdin, chunk))) => {
                if let Err(e) = writer.append(&chunk) {
                    // Dropping the writer removes the staged file; the node
                    // stops sending once it reads this.
                    let _ = proto::write_json(conn, FrameKind::Response, &error(&e));
                    return;
                }
                size_bytes += chunk.len() as u64;
            }
            Ok(Some((FrameKind::StdinEof, _))) => break,
            // The node went away or broke the protocol: nothing lands.
            _ => return,
        }
    }
    if proto::write_json(conn, FrameKind::Response, &Response::FileStaged { size_bytes }).is_err() {
        return;
    }
    if let Ok(Some((FrameKind::Commit, _))) = proto::read_frame(conn) {
        let answer = match writer.commit() {
            Ok(stat) => Response::FileStat { stat },
            Err(e) => error(&e),
        };
        let _ = proto::write_json(conn, FrameKind::Response, &answer);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};
    use std::path::Path;
    use std::thread::JoinHandle;

    use warren_init::proto::WireFileErrorKind;

    use super::*;

    /// Serves `request` in `top` on one end of a socketpair; the test talks
    /// on the other.
    fn start(top: &Path, request: Request) -> (UnixStream, JoinHandle<Option<Request>>) {
        let (client, mut server) = UnixStream::pair().unwrap();
        let top = top.to_str().unwrap().to_string();
        (client, std::thread::spawn(move || serve_in(&top, request, &mut server)))
    }

    fn response(conn: &mut UnixStream) -> Response {
        let (kind, payload) = proto::read_frame(conn).unwrap().expect("an answer");
        assert_eq!(kind, FrameKind::Response);
        serde_json::from_slice(&payload).unwrap()
    }

    fn one(top: &Path, request: Request) -> Response {
        let (mut conn, served) = start(top, request);
        let answer = response(&mut conn);
        assert!(served.join().unwrap().is_none(), "a file request is answered here");
        answer
    }

    fn error_kind(answer: Response) -> WireFileErrorKind {
        match answer {
            Response::FileError { error } => error.kind,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    fn upload(top: &Path, path: &str, data: &[u8]) -> (UnixStream, JoinHandle<Option<Request>>) {
        let (mut conn, served) = start(top, Request::WriteFile { path: path.into(), mode: 0o640 });
        assert_eq!(response(&mut conn), Response::FileReady);
        for chunk in data.chunks(100_000) {
            proto::write_frame(&mut conn, FrameKind::Stdin, chunk).unwrap();
        }
        proto::write_frame(&mut conn, FrameKind::StdinEof, &[]).unwrap();
        assert_eq!(response(&mut conn), Response::FileStaged { size_bytes: data.len() as u64 });
        (conn, served)
    }

    #[test]
    fn an_upload_lands_only_on_commit_and_a_read_streams_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3 * MAX_CHUNK_BYTES + 17).map(|i| (i % 251) as u8).collect();

        let (conn, served) = upload(dir.path(), "/f.bin", &data);
        assert!(!dir.path().join("f.bin").exists(), "a staged upload is not the file yet");
        drop(conn);
        served.join().unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "an upload whose connection closed before the commit leaves {left:?}");

        let (mut conn, served) = upload(dir.path(), "/f.bin", &data);
        proto::write_frame(&mut conn, FrameKind::Commit, &[]).unwrap();
        let Response::FileStat { stat } = response(&mut conn) else { panic!("no stat after the commit") };
        served.join().unwrap();
        assert_eq!((stat.path.as_str(), stat.size_bytes, stat.mode & 0o7777), ("/f.bin", data.len() as u64, 0o640));
        assert_eq!(std::fs::read(dir.path().join("f.bin")).unwrap(), data);
        assert_eq!(std::fs::metadata(dir.path().join("f.bin")).unwrap().permissions().mode() & 0o7777, 0o640);

        let (mut conn, served) = start(dir.path(), Request::ReadFile { path: "/f.bin".into() });
        assert_eq!(response(&mut conn), Response::FileOpened { size_bytes: data.len() as u64 });
        let mut got = Vec::new();
        loop {
            match proto::read_frame(&mut conn).unwrap().expect("a frame before FileEnd") {
                (FrameKind::Stdout, chunk) => {
                    assert!(chunk.len() <= MAX_CHUNK_BYTES);
                    got.extend_from_slice(&chunk);
                }
                (FrameKind::Response, payload) => {
                    assert_eq!(serde_json::from_slice::<Response>(&payload).unwrap(), Response::FileEnd);
                    break;
                }
                (kind, _) => panic!("unexpected {kind:?} frame"),
            }
        }
        served.join().unwrap();
        assert!(got == data, "read back {} bytes, not the {} written", got.len(), data.len());
    }

    #[test]
    fn paths_stay_inside_the_root_and_errors_keep_their_kind() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path();
        std::fs::create_dir(top.join("sub")).unwrap();
        std::fs::write(top.join("inside.txt"), "in").unwrap();
        symlink("/", top.join("evil")).unwrap();
        symlink("../../../../..", top.join("sub/up")).unwrap();

        for path in ["/evil/inside.txt", "/sub/up/inside.txt", "/../../inside.txt", "/sub/up/evil/sub/../inside.txt"] {
            match one(top, Request::StatFile { path: path.into() }) {
                Response::FileStat { stat } => assert_eq!(stat.size_bytes, 2, "{path} is the root's inside.txt"),
                other => panic!("stat {path}: {other:?}"),
            }
        }
        // The host's /tmp exists; the root has none, so a write through the
        // absolute link finds nothing instead of landing on the host.
        let name = format!("warren-fileserve-test-{}", std::process::id());
        let (mut conn, served) = start(top, Request::WriteFile { path: format!("/evil/tmp/{name}"), mode: 0o644 });
        assert_eq!(error_kind(response(&mut conn)), WireFileErrorKind::NotFound);
        served.join().unwrap();
        assert!(!Path::new("/tmp").join(&name).exists(), "the upload reached the host's /tmp");

        let made = one(top, Request::Mkdir { path: "/evil/made".into(), mode: 0o700, parents: false });
        assert!(matches!(made, Response::FileStat { .. }), "{made:?}");
        assert!(top.join("made").is_dir());
        let again = one(top, Request::Mkdir { path: "/made".into(), mode: 0o700, parents: false });
        assert_eq!(error_kind(again), WireFileErrorKind::Conflict);
        assert_eq!(error_kind(one(top, Request::ListDir { path: "/nope".into() })), WireFileErrorKind::NotFound);
        assert_eq!(error_kind(one(top, Request::ReadFile { path: "/sub".into() })), WireFileErrorKind::IsDirectory);
        let renamed = one(top, Request::RenameFile { from: "/made".into(), to: "/sub/up/moved".into() });
        assert!(matches!(&renamed, Response::FileStat { stat } if stat.path == "/sub/up/moved"), "{renamed:?}");
        assert!(top.join("moved").is_dir());

        // Removing the link to `/` removes the link only.
        assert_eq!(one(top, Request::RemoveFile { path: "/evil".into(), recursive: true }), Response::FileDone);
        assert!(top.join("inside.txt").is_file() && !top.join("evil").exists());

        let (_conn, served) = start(top, Request::Ping);
        assert_eq!(served.join().unwrap(), Some(Request::Ping), "other requests go back to the caller");
    }
}
