//! The Landlock ruleset of one phase: which files the sandbox's processes
//! may reach, and the scopes (abstract unix sockets, signals) that keep
//! them inside their own domain.
//!
//! Landlock is an allow list whose rules are hierarchical: a right granted
//! on a directory holds for everything beneath it, and nothing can take it
//! back further down. So "everything except the protected path P" is built
//! from the pieces around P: every *sibling* of each ancestor of P (and of
//! P itself) gets the rights of the surroundings, P gets the rights of its
//! level, and the ancestors themselves get only what every protected path
//! beneath them may have (for one path at `none`: nothing). With no
//! protected path at all, `/` simply gets every right.
//!
//! Consequences a task author must know (they are inherent to Landlock):
//! - the entries of an ancestor directory are enumerated when the phase
//!   starts; an entry created there later is not covered by any rule and
//!   so is unreachable during the phase;
//! - nothing can be created, removed or renamed directly in an ancestor of
//!   a protected path (e.g. in `/` while `/answers` is protected), and an
//!   ancestor can only be listed as far as every protected path beneath it
//!   may be read (not at all above a path at `none`);
//! - the ruleset is bound to inodes, not names: data that was copied or
//!   hard-linked elsewhere in an earlier, looser phase is not protected.
//!
//! This module is pure planning ([`Plan`]) plus the one step that opens the
//! paths and hands the rules to the kernel ([`Plan::ruleset`]); it is run
//! by `warren-init`'s phase leader inside the sandbox, never on the host.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use landlock::{
    Access, AccessFs, BitFlags, CompatLevel, Compatible, PathBeneath, RestrictionStatus, Ruleset, RulesetAttr,
    RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

/// The Landlock ABI whose filesystem rights and scopes every phase
/// handles (ABI 6: scopes; ABI 7 only adds audit-log flags, asked for on
/// a best-effort basis).
const REQUIRED_ABI: ABI = ABI::V6;

/// More rules than this in one phase is refused: a protected path under a
/// directory with more entries would make every phase start slow.
pub const MAX_RULES: usize = 16 * 1024;

/// What a phase's processes may do under a path. Ordered: each level holds
/// every right of the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Nothing: no read, write, execute or listing.
    None,
    /// Read files, list directories, execute.
    Read,
    /// Everything.
    ReadWrite,
}

impl Level {
    /// The rights this level grants on a directory (and what is beneath it)
    /// or, with `is_dir == false`, on a single non-directory file.
    pub fn rights(self, is_dir: bool) -> BitFlags<AccessFs> {
        let all = if is_dir { AccessFs::from_all(REQUIRED_ABI) } else { AccessFs::from_file(REQUIRED_ABI) };
        match self {
            Level::None => BitFlags::EMPTY,
            Level::Read => (AccessFs::ReadFile | AccessFs::ReadDir | AccessFs::Execute) & all,
            Level::ReadWrite => all,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("protected path {path:?}: {why}")]
    InvalidPath { path: String, why: &'static str },
    #[error("protected path {path:?}: {component} is a symbolic link; protect the path it points to")]
    Symlink { path: String, component: String },
    #[error("the phase would need more than {MAX_RULES} Landlock rules (a protected path under a huge directory?)")]
    TooManyRules,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("Landlock: {0}")]
    Kernel(#[from] landlock::RulesetError),
    #[error("this kernel does not enforce Landlock ABI {REQUIRED_ABI} (status {0:?})")]
    NotEnforced(RulesetStatus),
}

impl LandlockError {
    fn io(what: impl Into<String>) -> impl FnOnce(rustix::io::Errno) -> LandlockError {
        let what = what.into();
        move |e| LandlockError::Io { what, source: e.into() }
    }
}

/// Splits a protected path into its components, refusing what is not an
/// absolute, normalized path below `/` outside the kernel's pseudo
/// filesystems (whose contents Landlock cannot meaningfully protect).
pub fn components(path: &str) -> Result<Vec<&str>, LandlockError> {
    let invalid = |why| LandlockError::InvalidPath { path: path.to_string(), why };
    let rest = path.strip_prefix('/').ok_or_else(|| invalid("not absolute"))?;
    if rest.is_empty() {
        return Err(invalid("`/` itself cannot be protected"));
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err(invalid("longer than 4096 bytes or holds NUL"));
    }
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.iter().any(|c| c.is_empty() || *c == "." || *c == "..") {
        return Err(invalid("not normalized (`.`, `..`, `//` or a trailing `/`)"));
    }
    if matches!(parts[0], "proc" | "sys" | "dev") {
        return Err(invalid("/proc, /sys and /dev cannot be protected"));
    }
    Ok(parts)
}

/// One directory or file the ruleset names, as components from `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub path: Vec<String>,
    /// The rule on the path itself (hierarchical for a directory).
    pub own: Level,
    /// For an ancestor of a protected path: every entry of it except
    /// `held_back` (the ones that are steps themselves) gets `others`.
    pub siblings: Option<Siblings>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Siblings {
    pub others: Level,
    pub held_back: BTreeSet<String>,
}

impl Step {
    /// `/a/b` for display.
    pub fn display_path(&self) -> String {
        format!("/{}", self.path.join("/"))
    }
}

/// The rules of one phase, before anything is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Parents before children.
    pub steps: Vec<Step>,
}

/// A node of the tree of protected paths and their ancestors.
#[derive(Default)]
struct Node {
    level: Option<Level>,
    children: BTreeMap<String, Node>,
}

impl Node {
    /// The lowest level among the protected paths strictly beneath.
    fn lowest_beneath(&self) -> Option<Level> {
        self.children.values().filter_map(|c| [c.level, c.lowest_beneath()].into_iter().flatten().min()).min()
    }
}

impl Plan {
    /// Plans the ruleset for `protected` (path -> level). A more specific
    /// path's level wins over an enclosing one's (`/a: none`, `/a/b: read`
    /// makes `/a/b` readable and the rest of `/a` unreachable).
    pub fn new<'a>(protected: impl IntoIterator<Item = (&'a str, Level)>) -> Result<Plan, LandlockError> {
        let mut root = Node::default();
        for (path, level) in protected {
            let mut node = &mut root;
            for part in components(path)? {
                node = node.children.entry(part.to_string()).or_default();
            }
            node.level = Some(level);
        }
        let mut steps = Vec::new();
        plan_node(&root, Vec::new(), Level::ReadWrite, &mut steps);
        Ok(Plan { steps })
    }

    /// Opens every step's path beneath `root` (the sandbox's `/`), lists
    /// the ancestors, and returns the created ruleset. `extra_files` are
    /// single files outside the sandbox's tree the phase must still reach
    /// (init's own binary, for session commands).
    pub fn ruleset(
        &self,
        root: BorrowedFd<'_>,
        extra_files: &[(BorrowedFd<'_>, Level)],
    ) -> Result<RulesetCreated, LandlockError> {
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(REQUIRED_ABI))?
            .scope(Scope::AbstractUnixSocket | Scope::Signal)?
            .create()?;
        let mut rules = 0usize;
        let mut add = |ruleset: RulesetCreated, fd: OwnedFd, level: Level, is_dir: bool| {
            rules += 1;
            if rules > MAX_RULES {
                return Err(LandlockError::TooManyRules);
            }
            Ok(ruleset.add_rule(PathBeneath::new(fd, level.rights(is_dir)))?)
        };
        for step in &self.steps {
            let Some((fd, kind)) = open_step(root, step)? else { continue };
            let is_dir = kind == FileType::Directory;
            if let (Some(siblings), true) = (&step.siblings, is_dir) {
                for (entry, entry_is_dir) in list_siblings(&fd, step, siblings)? {
                    ruleset = add(ruleset, entry, siblings.others, entry_is_dir)?;
                }
            }
            if step.own > Level::None {
                ruleset = add(ruleset, fd, step.own, is_dir)?;
            }
        }
        for (fd, level) in extra_files {
            if *level > Level::None {
                let fd = fd.try_clone_to_owned().map_err(|e| LandlockError::Io { what: "dup".into(), source: e })?;
                ruleset = add(ruleset, fd, *level, false)?;
            }
        }
        Ok(ruleset)
    }
}

fn plan_node(node: &Node, path: Vec<String>, inherited: Level, steps: &mut Vec<Step>) {
    let cap = node.level.unwrap_or(inherited);
    let own = node.lowest_beneath().map_or(cap, |lowest| lowest.min(cap));
    let siblings = (!node.children.is_empty())
        .then(|| Siblings { others: cap, held_back: node.children.keys().cloned().collect() });
    steps.push(Step { path: path.clone(), own, siblings });
    for (name, child) in &node.children {
        let mut child_path = path.clone();
        child_path.push(name.clone());
        plan_node(child, child_path, cap, steps);
    }
}

/// Opens a step's path without following any symbolic link. `None` when
/// it does not exist (then nothing beneath it can be reached either: its
/// parent's rules hold it back).
fn open_step(root: BorrowedFd<'_>, step: &Step) -> Result<Option<(OwnedFd, FileType)>, LandlockError> {
    let relative = if step.path.is_empty() { ".".to_string() } else { step.path.join("/") };
    let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::BENEATH;
    let flags = OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    match rustix::fs::openat2(root, relative.as_str(), flags, Mode::empty(), resolve) {
        Ok(fd) => {
            let kind = FileType::from_raw_mode(
                rustix::fs::fstat(&fd).map_err(LandlockError::io(step.display_path()))?.st_mode,
            );
            if kind == FileType::Symlink {
                return Err(LandlockError::Symlink { path: step.display_path(), component: step.display_path() });
            }
            Ok(Some((fd, kind)))
        }
        Err(rustix::io::Errno::NOENT) | Err(rustix::io::Errno::NOTDIR) => Ok(None),
        Err(rustix::io::Errno::LOOP) => Err(LandlockError::Symlink {
            path: step.display_path(),
            component: first_symlink(root, &step.path).unwrap_or_else(|| step.display_path()),
        }),
        Err(e) => Err(LandlockError::io(format!("open {}", step.display_path()))(e)),
    }
}

/// Names the first component of `path` that is a symbolic link, for the
/// error message.
fn first_symlink(root: BorrowedFd<'_>, path: &[String]) -> Option<String> {
    (1..=path.len()).map(|n| path[..n].join("/")).find_map(|prefix| {
        let st = rustix::fs::statat(root, prefix.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW).ok()?;
        (FileType::from_raw_mode(st.st_mode) == FileType::Symlink).then(|| format!("/{prefix}"))
    })
}

/// The entries of the directory `dir` except the held-back ones, each
/// opened (`O_PATH`, not following links) with whether it is a directory.
/// Symbolic links are left out: an access through one is checked at its
/// target, never at the link.
fn list_siblings(dir: &OwnedFd, step: &Step, siblings: &Siblings) -> Result<Vec<(OwnedFd, bool)>, LandlockError> {
    if siblings.others == Level::None {
        return Ok(Vec::new());
    }
    let readable = rustix::fs::openat(dir, ".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(LandlockError::io(format!("open {}", step.display_path())))?;
    let mut entries = Vec::new();
    let listing =
        rustix::fs::Dir::read_from(&readable).map_err(LandlockError::io(format!("list {}", step.display_path())))?;
    for entry in listing {
        let entry = entry.map_err(LandlockError::io(format!("list {}", step.display_path())))?;
        let name = entry.file_name();
        let held_back = name.to_str().is_ok_and(|n| siblings.held_back.contains(n));
        if name == c"." || name == c".." || held_back {
            continue;
        }
        let fd = match rustix::fs::openat(dir, name, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => fd,
            // Removed between the listing and now.
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(LandlockError::io(format!("open an entry of {}", step.display_path()))(e)),
        };
        let kind = FileType::from_raw_mode(
            rustix::fs::fstat(&fd)
                .map_err(LandlockError::io(format!("stat an entry of {}", step.display_path())))?
                .st_mode,
        );
        match kind {
            FileType::Symlink => {}
            FileType::Directory => entries.push((fd, true)),
            _ => entries.push((fd, false)),
        }
        if entries.len() > MAX_RULES {
            return Err(LandlockError::TooManyRules);
        }
    }
    Ok(entries)
}

/// Enforces `ruleset` on the calling thread and every process it starts
/// from now on (Landlock domains are inherited and can only tighten).
/// The caller must be single-threaded and have `no_new_privs` set.
/// Denials are logged to the kernel's audit log where it has one, also
/// after the domain's processes exec other programs.
pub fn restrict_self(ruleset: RulesetCreated) -> Result<RestrictionStatus, LandlockError> {
    let status =
        ruleset.set_compatibility(CompatLevel::BestEffort).log_new_exec(true)?.no_new_privs(true).restrict_self()?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(status),
        // Only the audit-log flag (ABI 7) is asked for on a best-effort
        // basis: a kernel of ABI 6 enforces all the rest (the ruleset's
        // rights and scopes are hard requirements of its creation).
        RulesetStatus::PartiallyEnforced if ABI::from(status.landlock) >= REQUIRED_ABI => Ok(status),
        other => Err(LandlockError::NotEnforced(other)),
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::None => "none",
            Level::Read => "read",
            Level::ReadWrite => "read_write",
        })
    }
}

/// Whether this kernel enforces what [`Plan::ruleset`] asks for.
pub fn supported() -> bool {
    Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(REQUIRED_ABI))
        .and_then(|r| r.scope(Scope::AbstractUnixSocket | Scope::Signal))
        .and_then(|r| r.create())
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn plan(paths: &[(&str, Level)]) -> Plan {
        Plan::new(paths.iter().copied()).unwrap()
    }

    fn step(path: &str, own: Level, siblings: Option<(Level, &[&str])>) -> Step {
        Step {
            path: path.split('/').filter(|c| !c.is_empty()).map(str::to_string).collect(),
            own,
            siblings: siblings
                .map(|(others, held)| Siblings { others, held_back: held.iter().map(|s| s.to_string()).collect() }),
        }
    }

    #[test]
    fn paths_must_be_absolute_normalized_and_outside_pseudo_filesystems() {
        assert_eq!(components("/answers/key").unwrap(), vec!["answers", "key"]);
        for bad in ["answers", "/", "", "/a/../b", "/a/./b", "/a//b", "/a/", "/proc", "/sys/x", "/dev/shm", "/a\0b"] {
            assert!(matches!(components(bad), Err(LandlockError::InvalidPath { .. })), "{bad:?}");
        }
        assert!(components("/procfs").is_ok(), "only the pseudo filesystems themselves");
    }

    #[test]
    fn no_protected_path_grants_everything_on_root() {
        assert_eq!(plan(&[]).steps, vec![step("/", Level::ReadWrite, None)]);
    }

    #[test]
    fn a_path_at_none_leaves_its_ancestors_bare_and_their_other_entries_open() {
        assert_eq!(
            plan(&[("/srv/answers", Level::None)]).steps,
            vec![
                step("/", Level::None, Some((Level::ReadWrite, &["srv"]))),
                step("/srv", Level::None, Some((Level::ReadWrite, &["answers"]))),
                step("/srv/answers", Level::None, None),
            ]
        );
    }

    #[test]
    fn ancestors_of_readable_paths_are_readable() {
        assert_eq!(
            plan(&[("/answers", Level::Read), ("/work", Level::ReadWrite)]).steps,
            vec![
                step("/", Level::Read, Some((Level::ReadWrite, &["answers", "work"]))),
                step("/answers", Level::Read, None),
                step("/work", Level::ReadWrite, None),
            ]
        );
    }

    #[test]
    fn the_more_specific_path_wins_and_caps_what_is_around_it() {
        assert_eq!(
            plan(&[("/a", Level::None), ("/a/b/c", Level::Read)]).steps,
            vec![
                step("/", Level::None, Some((Level::ReadWrite, &["a"]))),
                step("/a", Level::None, Some((Level::None, &["b"]))),
                step("/a/b", Level::None, Some((Level::None, &["c"]))),
                step("/a/b/c", Level::Read, None),
            ]
        );
        // A looser path inside a tighter one: the inner one is looser, the
        // rest of the outer one keeps the outer level.
        assert_eq!(
            plan(&[("/a", Level::Read), ("/a/w", Level::ReadWrite)]).steps,
            vec![
                step("/", Level::Read, Some((Level::ReadWrite, &["a"]))),
                step("/a", Level::Read, Some((Level::Read, &["w"]))),
                step("/a/w", Level::ReadWrite, None),
            ]
        );
    }

    #[test]
    fn bad_paths_fail_the_plan() {
        assert!(Plan::new([("/ok", Level::None), ("relative", Level::Read)]).is_err());
    }

    #[test]
    fn read_rights_fit_files_and_directories() {
        assert!(Level::None.rights(true).is_empty());
        assert_eq!(Level::Read.rights(false), AccessFs::ReadFile | AccessFs::Execute);
        assert!(Level::Read.rights(true).contains(AccessFs::ReadDir));
        assert!(!Level::Read.rights(true).contains(AccessFs::WriteFile));
        assert_eq!(Level::ReadWrite.rights(false), AccessFs::from_file(REQUIRED_ABI));
        assert!(Level::ReadWrite.rights(true).contains(AccessFs::Refer | AccessFs::MakeReg | AccessFs::RemoveDir));
    }

    /// Sibling enumeration on a real directory tree (no Landlock needed):
    /// every entry but the held-back one, links left out, types right.
    #[test]
    fn siblings_are_every_entry_but_the_held_back_ones_and_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("answers")).unwrap();
        std::fs::create_dir(dir.path().join("usr")).unwrap();
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        std::os::unix::fs::symlink("usr", dir.path().join("link")).unwrap();
        let root =
            rustix::fs::open(dir.path(), OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let plan = plan(&[("/answers", Level::None)]);
        let (fd, _) = open_step(root.as_fd(), &plan.steps[0]).unwrap().unwrap();
        let siblings = plan.steps[0].siblings.as_ref().unwrap();
        let mut found: Vec<(u64, bool)> = list_siblings(&fd, &plan.steps[0], siblings)
            .unwrap()
            .into_iter()
            .map(|(fd, is_dir)| (rustix::fs::fstat(&fd).unwrap().st_ino, is_dir))
            .collect();
        found.sort();
        let ino = |name: &str| {
            std::fs::symlink_metadata(dir.path().join(name)).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap()
        };
        let mut expected = vec![(ino("usr"), true), (ino("file"), false)];
        expected.sort();
        assert_eq!(found, expected);
    }

    #[test]
    fn a_symlink_on_the_way_to_a_protected_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", dir.path().join("lib")).unwrap();
        let root =
            rustix::fs::open(dir.path(), OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let plan = plan(&[("/lib/secret", Level::None)]);
        let err = open_step(root.as_fd(), &plan.steps[1]).unwrap_err();
        assert!(matches!(&err, LandlockError::Symlink { component, .. } if component == "/lib"), "{err}");
        // A missing protected path is fine: nothing can create it.
        let missing = self::plan(&[("/nothing/here", Level::None)]);
        assert!(open_step(root.as_fd(), &missing.steps[1]).unwrap().is_none());
    }
}
