//! Finding the program of an exec the way `execvp` would, but before
//! forking, so "not found" and "not executable" come back as clear errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `PATH` when the exec's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("{0}: not found")]
    NotFound(String),
    #[error("{0}: not an executable file")]
    NotExecutable(String),
}

/// The paths to try for `program`, in order. A name with a slash is the
/// only candidate (relative to `cwd`); otherwise each `PATH` entry in turn,
/// an empty entry meaning `cwd`.
pub fn candidates(program: &str, path_var: Option<&str>, cwd: &Path) -> Vec<PathBuf> {
    if program.contains('/') {
        return vec![cwd.join(program)];
    }
    path_var
        .unwrap_or(DEFAULT_PATH)
        .split(':')
        .map(|dir| if dir.is_empty() { cwd.join(program) } else { cwd.join(dir).join(program) })
        .collect()
}

/// Resolves `program` with the exec's own environment and working directory.
pub fn resolve(program: &str, env: &BTreeMap<String, String>, cwd: &Path) -> Result<PathBuf, LookupError> {
    if program.is_empty() {
        return Err(LookupError::NotFound(program.into()));
    }
    let mut saw_non_executable = false;
    for candidate in candidates(program, env.get("PATH").map(String::as_str), cwd) {
        match std::fs::metadata(&candidate) {
            Ok(meta) if meta.is_file() && is_executable(&candidate) => return Ok(candidate),
            Ok(_) => saw_non_executable = true,
            Err(_) => {}
        }
    }
    if saw_non_executable {
        Err(LookupError::NotExecutable(program.into()))
    } else {
        Err(LookupError::NotFound(program.into()))
    }
}

fn is_executable(path: &Path) -> bool {
    rustix::fs::access(path, rustix::fs::Access::EXEC_OK).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn candidates_follow_path_order_and_slash_rules() {
        let cwd = Path::new("/work");
        assert_eq!(candidates("ls", Some("/a:/b"), cwd), vec![PathBuf::from("/a/ls"), PathBuf::from("/b/ls")]);
        assert_eq!(candidates("ls", Some(":rel"), cwd), vec![PathBuf::from("/work/ls"), PathBuf::from("/work/rel/ls")]);
        assert_eq!(candidates("./x", Some("/a"), cwd), vec![PathBuf::from("/work/./x")]);
        assert_eq!(candidates("/bin/sh", None, cwd), vec![PathBuf::from("/bin/sh")]);
        assert_eq!(candidates("sh", None, cwd).len(), DEFAULT_PATH.split(':').count());
    }

    #[test]
    fn resolve_finds_the_first_executable_and_names_the_failure() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(a.join("tool"), "plain file").unwrap();
        std::fs::set_permissions(a.join("tool"), std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(b.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(b.join("tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(b.join("dir")).unwrap();

        let env = |path: String| BTreeMap::from([("PATH".to_string(), path)]);
        let both = env(format!("{}:{}", a.display(), b.display()));
        assert_eq!(resolve("tool", &both, dir.path()), Ok(b.join("tool")));
        assert_eq!(resolve("missing", &both, dir.path()), Err(LookupError::NotFound("missing".into())));
        assert_eq!(resolve("dir", &both, dir.path()), Err(LookupError::NotExecutable("dir".into())));
        assert_eq!(resolve("b/tool", &BTreeMap::new(), dir.path()), Ok(dir.path().join("b/tool")));
        assert_eq!(resolve("", &both, dir.path()), Err(LookupError::NotFound(String::new())));
    }
}
