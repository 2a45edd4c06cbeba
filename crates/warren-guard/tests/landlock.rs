//! The ruleset builder against the real kernel: a child process (this test
//! binary, re-run with `WARREN_LANDLOCK_CHILD` naming a directory) plans
//! protected paths beneath that directory as its `/`, enforces them on
//! itself and reports what it could do.

use std::fs;
use std::io::ErrorKind;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;

use rustix::fs::{Mode, OFlags};
use warren_guard::landlock::{restrict_self, Level, Plan};

const CHILD_ENV: &str = "WARREN_LANDLOCK_CHILD";
const TEST_NAME: &str = "levels_hold_beneath_the_planned_root";

#[test]
fn levels_hold_beneath_the_planned_root() {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        return child(Path::new(&dir));
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fs::create_dir_all(root.join("answers")).unwrap();
    fs::write(root.join("answers/key"), "secret").unwrap();
    fs::create_dir_all(root.join("ref")).unwrap();
    fs::write(root.join("ref/data"), "ref").unwrap();
    fs::create_dir_all(root.join("work")).unwrap();
    fs::write(root.join("top-file"), "x").unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, root)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(report.contains("child: all checks held"), "{report}");
}

/// Runs in the child: enforce, then check. Panics (failing the child, and
/// so the parent) on the first surprise.
fn child(root: &Path) {
    let root_fd = rustix::fs::open(root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
    let plan = Plan::new([("/answers", Level::None), ("/ref", Level::Read)]).unwrap();
    restrict_self(plan.ruleset(root_fd.as_fd(), &[]).unwrap()).unwrap();
    let denied = |what: &str, r: std::io::Result<()>| {
        let e = r.expect_err(what);
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{what}: {e}");
    };
    denied("read answers/key", fs::read(root.join("answers/key")).map(drop));
    denied("list answers", fs::read_dir(root.join("answers")).map(drop));
    denied("rename answers", fs::rename(root.join("answers"), root.join("work/answers")));
    assert_eq!(fs::read_to_string(root.join("ref/data")).unwrap(), "ref");
    denied("append to ref/data", fs::OpenOptions::new().append(true).open(root.join("ref/data")).map(drop));
    denied("create in ref", fs::write(root.join("ref/new"), "x"));
    // The siblings keep every right, files and directories alike.
    fs::write(root.join("work/out"), "ok").unwrap();
    fs::create_dir(root.join("work/sub")).unwrap();
    assert_eq!(fs::read_to_string(root.join("top-file")).unwrap(), "x");
    fs::write(root.join("top-file"), "y").unwrap();
    // The ancestor itself: nothing new in it, and no listing (a path at
    // `none` is beneath it).
    denied("create in the root", fs::write(root.join("new"), "x"));
    denied("list the root", fs::read_dir(root).map(drop));
    println!("child: all checks held");
}
