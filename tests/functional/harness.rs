//! The harness itself: its leak check must be able to fail, and its drop
//! guard must clean up after a test that did fail.

use warren_tests::leaks::Leaks;
use warren_tests::*;

#[tokio::test]
#[should_panic(expected = "the server left behind")]
async fn leak_check_catches_a_sandbox_the_server_left() {
    let mut server = TestServer::start().await;
    server.create_small().await;
    // A crashed server cleans nothing up: finish must notice.
    server.crash().await;
    server.finish().await;
}

#[tokio::test]
async fn drop_guard_removes_what_a_failed_test_left() {
    let (data_dir, instance) = {
        let mut server = TestServer::start().await;
        let sb = server.create_small().await;
        server.crash().await;
        let leaks = Leaks::scan(&server.data_dir(), &server.instance);
        assert!(!leaks.mounts.is_empty() && !leaks.processes.is_empty(), "the sandbox {} is still there", sb.id);
        (server.data_dir(), server.instance.clone())
    };
    let leaks = Leaks::scan(&data_dir, &instance);
    assert!(leaks.is_empty(), "the drop guard left:\n{leaks}");
    assert!(leaks::instance_cgroup_dirs(&instance).is_empty());
    assert!(!data_dir.exists(), "the temp dir is removed");
}

/// A mount a test leaves in its temp dir beside the data dir (how the XFS
/// case used to leak a `/tmp/warren-test-*` dir on every run) fails
/// `finish`; the drop guard still unmounts it and removes the dir.
#[tokio::test]
async fn finish_fails_on_a_mount_left_beside_the_data_dir() {
    let server = TestServer::start().await;
    let root = server.path().to_path_buf();
    let scratch = root.join("scratch");
    std::fs::create_dir(&scratch).expect("make the scratch dir");
    rustix::mount::mount("tmpfs", &scratch, "tmpfs", rustix::mount::MountFlags::empty(), None)
        .expect("mount a tmpfs on the scratch dir");
    let outcome = tokio::spawn(server.finish()).await;
    let failure = outcome.expect_err("finish must fail with a mount left behind");
    let message = match failure.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
        Err(e) => panic!("finish was cancelled, not failed: {e}"),
    };
    assert!(message.contains("mounts remain under the test's temp dir"), "finish failed for another reason: {message}");
    assert!(leaks::mounts_under(&root).is_empty(), "the drop guard left the scratch mount");
    assert!(!root.exists(), "the drop guard left the temp dir {}", root.display());
}

/// A test process killed from outside never cleans up; the next test
/// process sweeps the cgroups of instances whose process is gone, and
/// leaves those of live processes alone.
#[test]
fn cgroups_of_dead_test_processes_are_swept_and_live_ones_kept() {
    let mut child = std::process::Command::new("true").spawn().expect("spawn true");
    let dead = child.id();
    child.wait().expect("reap true");
    let memory = std::path::Path::new("/sys/fs/cgroup/memory");
    let dead_dirs = [memory.join(format!("wt-{dead}-7")), memory.join(format!("wt-{dead}-7-vm"))];
    let live = memory.join(format!("wt-{}-9999", std::process::id()));
    for dir in dead_dirs.iter().chain([&live]) {
        std::fs::create_dir_all(dir.join("sb-left")).expect("make a cgroup");
    }
    leaks::sweep_dead_test_instances();
    for dir in &dead_dirs {
        assert!(!dir.exists(), "{} of a dead test process survived the sweep", dir.display());
    }
    assert!(live.join("sb-left").is_dir(), "the sweep removed a live process's cgroup");
    std::fs::remove_dir(live.join("sb-left")).expect("remove the sandbox cgroup");
    std::fs::remove_dir(&live).expect("remove the instance cgroup");
}

/// The same for temp dirs: a dead test process's `warren-test-*` dir is
/// unmounted and removed, a live one's kept.
#[test]
fn temp_dirs_of_dead_test_processes_are_unmounted_and_removed_and_live_ones_kept() {
    let mut child = std::process::Command::new("true").spawn().expect("spawn true");
    let dead = child.id();
    child.wait().expect("reap true");
    let parent = tempfile::tempdir().expect("make a parent dir");
    let make = |name: &str, owner: u32| {
        let dir = parent.path().join(name);
        let sandbox_root = dir.join("data/run/sb-left");
        std::fs::create_dir_all(&sandbox_root).expect("make the dirs");
        std::fs::write(dir.join(leaks::OWNER_FILE), owner.to_string()).expect("write the owner file");
        rustix::mount::mount("tmpfs", &sandbox_root, "tmpfs", rustix::mount::MountFlags::empty(), None)
            .expect("mount a tmpfs");
        dir
    };
    let dead_dir = make("warren-test-dead", dead);
    let live_dir = make("warren-test-live", std::process::id());
    leaks::sweep_dead_test_dirs(parent.path());
    assert!(leaks::mounts_under(&dead_dir).is_empty(), "a dead test process's mount survived the sweep");
    assert!(!dead_dir.exists(), "a dead test process's temp dir survived the sweep");
    assert_eq!(leaks::mounts_under(&live_dir).len(), 1, "the sweep unmounted a live process's sandbox root");
    assert!(live_dir.join(leaks::OWNER_FILE).is_file(), "the sweep removed a live process's temp dir");
    for point in leaks::mounts_under(&live_dir) {
        rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH).expect("unmount the live tmpfs");
    }
}
