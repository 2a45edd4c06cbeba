//! Files inside a sandbox. Every path is resolved inside the sandbox root.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileStat {
    /// Absolute path inside the sandbox.
    pub path: String,
    pub kind: FileKind,
    pub size_bytes: u64,
    /// Permission bits, e.g. 420 for 0644.
    pub mode: u32,
    pub modified_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileList {
    pub path: String,
    pub entries: Vec<FileStat>,
}

/// Query of the file routes: `?path=/abs/path`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    pub path: String,
    /// For uploads: permission bits of a new file (default 0644), octal string like "755".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// For remove: remove directories with their contents.
    #[serde(default)]
    pub recursive: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    /// Permission bits, octal string like "755" (default "755").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default)]
    pub parents: bool,
}

/// Parses an octal permission string ("644", "0755") into bits.
pub fn parse_mode(s: &str) -> Option<u32> {
    let m = u32::from_str_radix(s, 8).ok()?;
    (m <= 0o7777).then_some(m)
}
