//! `filesystem.Filesystem`: Stat, ListDir, MakeDir, Remove and Move on the
//! node's file operations (resolved inside the sandbox root, like the v1
//! file API). Watchers are not served.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use warren_api::{FileKind, FileStat};

use super::{abs_path, unary_request, unknown_method};
use crate::connect::{self, Code, ConnectError};
use crate::{time, E2b};

/// Bound on the entries one ListDir answers with (the walk stops there).
const MAX_LIST_ENTRIES: usize = 100_000;

#[derive(Debug, Default, Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
}

#[derive(Debug, Default, Deserialize)]
struct ListDirRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: u32,
}

#[derive(Debug, Default, Deserialize)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn call(State(state): State<E2b>, Path(method): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(sandbox) = crate::sandbox_id(&headers) else {
        return ConnectError::new(Code::InvalidArgument, "no E2b-Sandbox-Id").into_response();
    };
    let answer = match method.as_str() {
        "Stat" => stat(&state, &sandbox, &headers, &body).await,
        "ListDir" => list_dir(&state, &sandbox, &headers, &body).await,
        "MakeDir" => make_dir(&state, &sandbox, &headers, &body).await,
        "Remove" => remove(&state, &sandbox, &headers, &body).await,
        "Move" => rename(&state, &sandbox, &headers, &body).await,
        other => Err(unknown_method("filesystem.Filesystem", other)),
    };
    match answer {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => e.into_response(),
    }
}

/// Go's `os.FileMode.String()` of a stat: `drwxr-xr-x`.
fn permissions(st: &FileStat) -> String {
    let kind = match st.kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    };
    let mut s = String::from(kind);
    for shift in [6u32, 3, 0] {
        let bits = (st.mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// envd's `EntryInfo` of a stat.
pub fn entry_info(st: &FileStat) -> serde_json::Value {
    let kind = match st.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let name = st.path.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("/");
    let mut e = serde_json::json!({
        "name": name,
        "type": kind,
        "path": st.path,
        // int64 is a string in proto3 JSON.
        "size": st.size_bytes.to_string(),
        "mode": st.mode,
        "permissions": permissions(st),
        // Sandboxes run as root; E2B's `user` does not exist in Warren.
        "owner": "root",
        "group": "root",
        "modifiedTime": time::rfc3339(st.modified_at_ms),
    });
    if let Some(t) = &st.symlink_target {
        e["symlinkTarget"] = t.clone().into();
    }
    e
}

async fn stat(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: PathRequest = unary_request(headers, body)?;
    let st = state.node.stat_file(sandbox, abs_path(&req.path)).await?;
    Ok(serde_json::json!({ "entry": entry_info(&st) }))
}

async fn list_dir(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: ListDirRequest = unary_request(headers, body)?;
    let depth = req.depth.max(1);
    let root = abs_path(&req.path);
    let top = state.node.stat_file(sandbox, root.clone()).await?;
    if top.kind != FileKind::Dir {
        return Err(ConnectError::new(Code::InvalidArgument, format!("path {root} is not a directory")));
    }
    let mut entries = Vec::new();
    // Breadth first; symlinked directories are listed, never entered.
    let mut level = vec![root];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let list = match state.node.list_dir(sandbox, dir).await {
                Ok(l) => l,
                // Removed or replaced while we walked: the rest still answers.
                Err(warren_node::NodeError::File(_)) if !entries.is_empty() => continue,
                Err(e) => return Err(e.into()),
            };
            for st in list.entries {
                if st.kind == FileKind::Dir {
                    next.push(st.path.clone());
                }
                entries.push(entry_info(&st));
                if entries.len() >= MAX_LIST_ENTRIES {
                    return Ok(serde_json::json!({ "entries": entries }));
                }
            }
        }
        level = next;
    }
    Ok(serde_json::json!({ "entries": entries }))
}

async fn make_dir(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: PathRequest = unary_request(headers, body)?;
    let path = abs_path(&req.path);
    match state.node.stat_file(sandbox, path.clone()).await {
        Ok(st) if st.kind == FileKind::Dir => {
            return Err(ConnectError::new(Code::AlreadyExists, format!("directory {path} already exists")))
        }
        Ok(_) => return Err(ConnectError::new(Code::AlreadyExists, format!("{path} exists and is not a directory"))),
        Err(warren_node::NodeError::File(warren_node::FileError::NotFound)) => {}
        Err(e) => return Err(e.into()),
    }
    let st = state.node.mkdir_stepped(sandbox, path, 0o755, true, None).await?.value;
    Ok(serde_json::json!({ "entry": entry_info(&st) }))
}

async fn remove(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: PathRequest = unary_request(headers, body)?;
    state.node.remove_file_stepped(sandbox, abs_path(&req.path), true, None).await?;
    Ok(serde_json::json!({}))
}

async fn rename(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: MoveRequest = unary_request(headers, body)?;
    let (from, to) = (abs_path(&req.source), abs_path(&req.destination));
    let st = state.node.rename_file(sandbox, from, to).await?;
    Ok(serde_json::json!({ "entry": entry_info(&st) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(path: &str, kind: FileKind, mode: u32) -> FileStat {
        FileStat { path: path.into(), kind, size_bytes: 5, mode, modified_at_ms: 0, symlink_target: None }
    }

    #[test]
    fn entry_info_speaks_envds_json() {
        let e = entry_info(&st("/home/user/a.txt", FileKind::File, 0o644));
        assert_eq!(e["name"], "a.txt");
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(e["size"], "5");
        assert_eq!(e["permissions"], "-rw-r--r--");
        assert_eq!(e["modifiedTime"], "1970-01-01T00:00:00.000Z");
        let d = entry_info(&st("/", FileKind::Dir, 0o755));
        assert_eq!((d["name"].as_str(), d["permissions"].as_str()), (Some("/"), Some("drwxr-xr-x")));
        let mut link = st("/l", FileKind::Symlink, 0o777);
        link.symlink_target = Some("/etc".into());
        assert_eq!(entry_info(&link)["symlinkTarget"], "/etc");
    }
}
