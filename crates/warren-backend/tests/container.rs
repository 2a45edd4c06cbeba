//! The container driver against the real kernel and the real `warren-init`
//! (run as root; build `warren-init` first). Each test has its own run
//! directory, cgroup instance and uid ranges, and ends by checking that no
//! mount, cgroup, process or directory of it is left.

mod support;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use support::{exec_spec, pid1, run, sh, Bench};
use warren_backend::{BackendError, Driver, ExecControl, ExecEvent, Liveness};

#[tokio::test]
async fn create_exec_echo_destroy_leaves_nothing() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("echo")).await.unwrap();
    assert_eq!(bench.driver.probe(&handle).await, Liveness::Alive);

    let done = run(&bench.driver, &handle, exec_spec(&["echo", "hello"]), None).await;
    assert_eq!(done.stdout, "hello\n");
    assert_eq!((done.exit.exit_code, done.exit.signal, done.exit.oom), (Some(0), None, false));

    let usage = bench.driver.usage(&handle).unwrap();
    assert!(usage.pids >= 1 && usage.memory_bytes > 0, "{usage:?}");

    let pid = pid1(&handle);
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for controller in ["cpu", "cpuacct", "memory", "pids", "freezer"] {
        let line = cgroups.lines().find(|l| l.split(':').nth(1) == Some(controller)).unwrap();
        assert!(line.ends_with(&format!("/{}/echo", bench.instance)), "{line}");
    }
    assert!(cgroups.lines().any(|l| l == format!("0::/{}/echo", bench.instance)), "{cgroups}");
    bench.driver.destroy(&handle).await.unwrap();
    assert!(!fs::exists(format!("/proc/{pid}")).unwrap(), "PID 1 was not reaped");
    support::assert_clean(&bench.run_dir, &bench.instance);
    bench.finish().await;
}

#[tokio::test]
async fn stdin_flows_in_and_kill_ends_the_tree() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("stdin")).await.unwrap();
    let done = run(&bench.driver, &handle, exec_spec(&["cat"]), Some("to cat\n")).await;
    assert_eq!(done.stdout, "to cat\n");

    let mut process = bench.driver.exec(&handle, exec_spec(&["sleep", "1000"])).await.unwrap();
    assert!(matches!(process.events.recv().await, Some(ExecEvent::Started { .. })));
    process.control.send(ExecControl::Kill).await.unwrap();
    match process.events.recv().await {
        Some(ExecEvent::Exited(exit)) => assert!(exit.killed && !exit.oom, "{exit:?}"),
        other => panic!("expected Exited, got {other:?}"),
    }

    let missing = bench.driver.exec(&handle, exec_spec(&["no-such-program"])).await;
    assert!(matches!(missing, Err(BackendError::ProgramNotFound(_))), "{:?}", missing.err());
    bench.driver.destroy(&handle).await.unwrap();
    bench.finish().await;
}

#[tokio::test]
async fn image_root_is_root_inside_and_new_files_belong_to_the_range_on_the_host() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("owner")).await.unwrap();
    let root = bench.driver.fs_root(&handle).unwrap();
    assert!(root.uid >= warren_backend::container::ContainerConfig::DEFAULT_UID_BASE_START);
    assert_eq!(root.uid, root.gid);

    let done = run(&bench.driver, &handle, exec_spec(&["stat", "-c", "%u %g", "/bin/busybox"]), None).await;
    assert_eq!(done.stdout, "0 0\n", "stderr: {}", done.stderr);
    let done = run(&bench.driver, &handle, sh("echo made > /tmp/made && id -u"), None).await;
    assert_eq!(done.stdout, "0\n", "stderr: {}", done.stderr);

    let upper_file = bench.run_dir.join("owner/rw/upper/tmp/made");
    let meta = fs::metadata(&upper_file).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (root.uid, root.gid));
    // The layer itself is untouched: root-owned, no new file.
    assert_eq!(fs::metadata(bench.layer.join("bin/busybox")).unwrap().uid(), 0);
    assert!(!bench.layer.join("tmp/made").exists());
    drop(root);
    bench.driver.destroy(&handle).await.unwrap();
    bench.finish().await;
}

#[tokio::test]
async fn memory_hog_is_killed_and_reported_as_oom_while_the_sandbox_lives() {
    let bench = Bench::new();
    let mut spec = bench.spec("oom");
    spec.resources.memory_mib = 32;
    let handle = bench.driver.create(&spec).await.unwrap();
    // Doubles a shell string until the 32 MiB limit stops it.
    let done = run(&bench.driver, &handle, sh("a=xxxxxxxxxxxxxxxx; while :; do a=$a$a; done"), None).await;
    assert_eq!(done.exit.signal, Some(libc::SIGKILL), "{done:?}");
    assert!(done.exit.oom && !done.exit.killed, "{:?}", done.exit);
    assert!(bench.cgroup("oom").oom_kills().unwrap() >= 1);
    assert_eq!(bench.driver.probe(&handle).await, Liveness::Alive, "init itself was OOM-killed");
    let after = run(&bench.driver, &handle, exec_spec(&["true"]), None).await;
    assert_eq!(after.exit.exit_code, Some(0));
    bench.driver.destroy(&handle).await.unwrap();
    bench.finish().await;
}

#[tokio::test]
async fn fork_bomb_stays_inside_the_pids_limit_and_destroy_ends_it() {
    let bench = Bench::new();
    let mut spec = bench.spec("bomb");
    spec.resources.pids = 32;
    let handle = bench.driver.create(&spec).await.unwrap();
    let mut bomb = bench.driver.exec(&handle, sh("f() { f | f & }; f; sleep 1000")).await.unwrap();
    assert!(matches!(bomb.events.recv().await, Some(ExecEvent::Started { .. })));

    // Wait until the kernel refused a fork because of the limit.
    let events = bench.cgroup("bomb").path("pids").join("pids.events");
    let deadline = Instant::now() + Duration::from_secs(30);
    while fs::read_to_string(&events).unwrap().trim() == "max 0" {
        assert!(Instant::now() < deadline, "the bomb never reached the limit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let usage = bench.driver.usage(&handle).unwrap();
    assert!(usage.pids <= 32, "{usage:?}");

    bench.driver.destroy(&handle).await.unwrap();
    drop(bomb);
    bench.finish().await;
}

#[tokio::test]
async fn disk_limit_gives_enospc_inside_and_the_host_is_untouched() {
    let bench = Bench::new();
    let mut spec = bench.spec("disk");
    spec.resources.disk_mib = 8;
    spec.resources.memory_mib = 256;
    let handle = bench.driver.create(&spec).await.unwrap();
    let done =
        run(&bench.driver, &handle, exec_spec(&["dd", "if=/dev/zero", "of=/big", "bs=1M", "count=32"]), None).await;
    assert_ne!(done.exit.exit_code, Some(0), "{done:?}");
    assert!(done.stderr.contains("No space left on device"), "{}", done.stderr);

    let usage = bench.driver.usage(&handle).unwrap();
    assert!(usage.disk_bytes <= 8 << 20 && usage.disk_bytes > 4 << 20, "{usage:?}");
    let big = fs::metadata(bench.run_dir.join("disk/rw/upper/big")).unwrap();
    assert!(big.len() <= 8 << 20);
    // The host's filesystem under the run dir still takes writes.
    fs::write(bench.run_dir.join("host-probe"), vec![0u8; 1 << 20]).unwrap();
    fs::remove_file(bench.run_dir.join("host-probe")).unwrap();
    bench.driver.destroy(&handle).await.unwrap();
    bench.finish().await;
}

#[tokio::test]
async fn destroy_is_idempotent() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("twice")).await.unwrap();
    bench.driver.destroy(&handle).await.unwrap();
    bench.driver.destroy(&handle).await.unwrap();
    assert_eq!(bench.driver.probe(&handle).await, Liveness::Dead { oom: false });
    assert!(matches!(bench.driver.exec(&handle, exec_spec(&["true"])).await, Err(BackendError::Gone)));
    bench.finish().await;
}

#[tokio::test]
async fn create_with_a_missing_layer_leaves_nothing() {
    let bench = Bench::new();
    let mut spec = bench.spec("nolayer");
    spec.layers.push(bench.run_dir.join("does-not-exist"));
    let err = bench.driver.create(&spec).await.unwrap_err();
    assert!(matches!(err, BackendError::Setup(_)), "{err:?}");
    support::assert_clean(&bench.run_dir, &bench.instance);
    bench.finish().await;
}

#[tokio::test]
async fn create_that_init_rejects_after_pid1_leaves_nothing() {
    let bench = Bench::new();
    let mut spec = bench.spec("badhost");
    // Longer than the kernel's 64-byte hostname: PID 1 fails while building.
    spec.hostname = "h".repeat(100);
    let err = bench.driver.create(&spec).await.unwrap_err();
    assert!(matches!(err, BackendError::Setup(_)), "{err:?}");
    support::assert_clean(&bench.run_dir, &bench.instance);
    bench.finish().await;
}

#[tokio::test]
async fn sweep_removes_a_sandbox_whose_handle_was_lost_and_keeps_the_rest() {
    let bench = Bench::new();
    let lost = bench.driver.create(&bench.spec("lost")).await.unwrap();
    let kept = bench.driver.create(&bench.spec("kept")).await.unwrap();
    let lost_pid1 = pid1(&lost);
    drop(lost);

    let report = bench.driver.sweep(&["kept".to_string()]).await.unwrap();
    assert_eq!(report.sandboxes_removed, vec!["lost".to_string()]);
    assert!(!fs::exists(format!("/proc/{lost_pid1}")).unwrap());
    assert!(!bench.run_dir.join("lost").exists());
    assert_eq!(bench.driver.probe(&kept).await, Liveness::Alive);
    let done = run(&bench.driver, &kept, exec_spec(&["echo", "still here"]), None).await;
    assert_eq!(done.stdout, "still here\n");
    bench.finish().await;
}

#[tokio::test]
async fn probe_says_dead_after_pid1_is_killed_from_outside() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("killed")).await.unwrap();
    let pid = pid1(&handle);
    // SAFETY: kill(2) of the sandbox's PID 1, which this test just made.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match bench.driver.probe(&handle).await {
            Liveness::Dead { oom } => {
                assert!(!oom);
                break;
            }
            Liveness::Alive | Liveness::Unresponsive => {
                assert!(Instant::now() < deadline, "still not dead after SIGKILL")
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bench.driver.destroy(&handle).await.unwrap();
    assert!(!fs::exists(format!("/proc/{pid}")).unwrap());
    bench.finish().await;
}

/// A PID 1 that is there but cannot answer (stopped from outside) is
/// `Unresponsive`, not dead; once it runs again it answers.
#[tokio::test]
async fn probe_says_unresponsive_while_pid1_is_stopped() {
    let bench = Bench::new();
    let handle = bench.driver.create(&bench.spec("stopped")).await.unwrap();
    let pid = pid1(&handle);
    // SAFETY: kill(2) of the sandbox's PID 1, which this test just made.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    assert_eq!(bench.driver.probe(&handle).await, Liveness::Unresponsive);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(bench.driver.probe(&handle).await, Liveness::Alive);
    bench.driver.destroy(&handle).await.unwrap();
    assert!(!fs::exists(format!("/proc/{pid}")).unwrap());
    bench.finish().await;
}

#[tokio::test]
async fn an_abandoned_create_is_cleaned_up_in_the_background() {
    let bench = Bench::new();
    // Dropping the create future after its first poll (init spawned, setup
    // under way) must not leak the half-made sandbox.
    let abandoned = tokio::time::timeout(Duration::ZERO, bench.driver.create(&bench.spec("abandoned"))).await;
    assert!(abandoned.is_err(), "create finished within its first poll");
    let deadline = Instant::now() + Duration::from_secs(30);
    while bench.run_dir.join("abandoned").exists() {
        assert!(Instant::now() < deadline, "the abandoned sandbox was never removed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    support::assert_clean(&bench.run_dir, &bench.instance);
    bench.finish().await;
}
