//! Paths as the file API receives them: absolute, inside the sandbox.

use super::{FileError, Result};

/// Longest path the API accepts, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

/// An absolute path inside the sandbox, lexically normalised: no empty, `.`
/// or `..` components, so a final component is always a plain name.
///
/// `..` is folded here, clamped at `/`, only so that "parent + name" is well
/// defined. It is not the defence against escapes: every path is resolved by
/// the kernel with `RESOLVE_IN_ROOT`, which also confines `..` inside symlink
/// targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPath {
    components: Vec<String>,
}

impl SandboxPath {
    pub fn parse(raw: &str) -> Result<Self> {
        if !raw.starts_with('/') {
            return Err(FileError::InvalidPath(format!("`{raw}` is not absolute")));
        }
        if raw.contains('\0') {
            return Err(FileError::InvalidPath("path contains a NUL byte".into()));
        }
        if raw.len() > MAX_PATH_BYTES {
            return Err(FileError::InvalidPath(format!("path is longer than {MAX_PATH_BYTES} bytes")));
        }
        Ok(Self::root().join(raw))
    }

    pub fn root() -> Self {
        SandboxPath { components: Vec::new() }
    }

    pub fn is_root(&self) -> bool {
        self.components.is_empty()
    }

    /// `self` followed by `rel`; an absolute `rel` replaces `self`, as a
    /// symlink target does.
    pub fn join(&self, rel: &str) -> Self {
        let mut components = if rel.starts_with('/') { Vec::new() } else { self.components.clone() };
        for part in rel.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    components.pop();
                }
                name => components.push(name.to_owned()),
            }
        }
        SandboxPath { components }
    }

    pub fn parent(&self) -> Self {
        let mut components = self.components.clone();
        components.pop();
        SandboxPath { components }
    }

    /// The last component; `None` for `/`.
    pub fn file_name(&self) -> Option<&str> {
        self.components.last().map(String::as_str)
    }

    /// The first `len` components.
    pub fn prefix(&self, len: usize) -> Self {
        SandboxPath { components: self.components[..len.min(self.components.len())].to_vec() }
    }

    pub fn depth(&self) -> usize {
        self.components.len()
    }

    /// The path relative to the root, as `openat2` wants it; `.` for `/`.
    pub fn relative(&self) -> String {
        if self.is_root() {
            ".".to_owned()
        } else {
            self.components.join("/")
        }
    }
}

impl std::fmt::Display for SandboxPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_root() {
            return f.write_str("/");
        }
        for c in &self.components {
            write!(f, "/{c}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(raw: &str) -> String {
        SandboxPath::parse(raw).unwrap().to_string()
    }

    #[test]
    fn normalises_dots_slashes_and_clamps_dotdot_at_root() {
        assert_eq!(norm("/"), "/");
        assert_eq!(norm("//a//b/./c/"), "/a/b/c");
        assert_eq!(norm("/a/../b"), "/b");
        assert_eq!(norm("/../../etc/passwd"), "/etc/passwd");
        assert_eq!(norm("/a/.."), "/");
    }

    #[test]
    fn rejects_relative_nul_and_overlong_paths() {
        assert!(matches!(SandboxPath::parse("a/b"), Err(FileError::InvalidPath(_))));
        assert!(matches!(SandboxPath::parse(""), Err(FileError::InvalidPath(_))));
        assert!(matches!(SandboxPath::parse("/a\0b"), Err(FileError::InvalidPath(_))));
        let long = format!("/{}", "a".repeat(MAX_PATH_BYTES));
        assert!(matches!(SandboxPath::parse(&long), Err(FileError::InvalidPath(_))));
        let max = format!("/{}", "a".repeat(MAX_PATH_BYTES - 1));
        assert!(SandboxPath::parse(&max).is_ok());
    }

    #[test]
    fn join_follows_symlink_target_rules() {
        let p = SandboxPath::parse("/usr/bin").unwrap();
        assert_eq!(p.join("python3").to_string(), "/usr/bin/python3");
        assert_eq!(p.join("../lib/x").to_string(), "/usr/lib/x");
        assert_eq!(p.join("/etc/x").to_string(), "/etc/x");
        assert_eq!(p.join("../../../../x").to_string(), "/x");
    }

    #[test]
    fn relative_form_for_openat2() {
        assert_eq!(SandboxPath::root().relative(), ".");
        assert_eq!(SandboxPath::parse("/a/b").unwrap().relative(), "a/b");
        assert_eq!(SandboxPath::parse("/a/b").unwrap().parent().to_string(), "/a");
        assert_eq!(SandboxPath::parse("/a/b").unwrap().prefix(1).to_string(), "/a");
    }
}
