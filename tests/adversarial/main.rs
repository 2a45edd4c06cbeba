//! The adversarial suite (issue 4, item 8): every DSec incident, the
//! container escape classes and the denial-of-service attacks, each as a
//! script an agent could run, with the outcome that means "stopped and
//! seen". After every case the host (files, mounts, processes, kernel log),
//! the node agent and a neighbour sandbox are checked unchanged; every
//! failing case is reported, not just the first. Run as root:
//! `cargo test -p warren-tests --test adversarial -- --test-threads=2`.

mod cases;
mod host;
mod suite;
mod xfs;

use reqwest::StatusCode;
use serde_json::json;
use warren_api::ErrorCode;
use warren_tests::*;

use crate::suite::{Case, Expect, Suite};

#[tokio::test]
async fn shared_sandbox_cases() {
    let mut suite = Suite::start().await;
    suite.run_all(&cases::shared()).await;
    suite.finish("shared-sandbox cases").await;
}

#[tokio::test]
async fn seccomp_rule_probes() {
    let mut suite = Suite::start().await;
    suite.run_all(&cases::seccomp_rules()).await;
    suite.finish("one case per seccomp deny rule").await;
}

#[tokio::test]
async fn own_sandbox_cases() {
    let mut suite = Suite::start().await;
    suite.run_all(&cases::own()).await;
    suite.finish("own-sandbox (destructive) cases").await;
}

/// The same cases against a microVM (`cases::own_for_microvm` says what
/// differs): its guest's init is the same `warren-init` with the same
/// profile, capabilities, masks and `/dev`, so what an agent can do inside
/// must be refused and seen the same way.
#[tokio::test]
async fn microvm_cases() {
    let mut suite = Suite::start_on(&[], json!({"backend": "microvm", "memory_mib": 256})).await;
    suite.run_all(&cases::shared()).await;
    suite.run_all(&cases::seccomp_rules()).await;
    suite.run_all(&cases::own_for_microvm()).await;
    suite.finish("microVM cases").await;
}

/// The incident itself: `XFS_IOC_SWAPEXT` (and its successor
/// `XFS_IOC_EXCHANGE_RANGE`) against a protected file on a real XFS
/// filesystem inside the sandbox. Refused with EPERM, recorded, and the
/// filesystem stays healthy.
#[tokio::test]
async fn dsec_xfs_ioc_swapext_on_a_real_xfs_filesystem() {
    let mut suite = Suite::start().await;
    let xfs = xfs::Xfs::make(&suite.server.path().join("xfs"));
    suite.server.sh_ok(&suite.victim.id, "mkdir -p /mnt/xfs").await;
    let pid1 = sandbox_pid1(&suite.server.instance, &suite.victim.id).expect("the victim's PID 1");
    xfs.bind_into(pid1, "/mnt/xfs").expect("attach the XFS mount inside the sandbox");
    let script = "stat -f -c 'fstype %T' /mnt/xfs
cat /mnt/xfs/protected/answer.txt 2>/dev/null || echo protected-unreadable
echo mine > /mnt/xfs/agent/tmp
{probe} xfs /mnt/xfs/protected/answer.txt /mnt/xfs/agent/tmp
{probe} xfs /mnt/xfs/agent/tmp /mnt/xfs/agent/tmp2";
    let expect = Expect {
        seccomp_detail: vec![
            ("ioctl".into(), "XFS_IOC_SWAPEXT (0xc0c0586d)".into()),
            ("ioctl".into(), "XFS_IOC_EXCHANGE_RANGE (0x40285881)".into()),
        ],
        ..Expect::default()
    }
    .has("fstype xfs")
    .has("protected-unreadable")
    .has("XFS_IOC_SWAPEXT -1 EPERM")
    .has("XFS_IOC_EXCHANGE_RANGE -1 EPERM")
    .lacks(xfs::PROTECTED_TEXT.trim())
    .lacks("XFS_IOC_SWAPEXT 0 OK")
    .lacks("XFS_IOC_EXCHANGE_RANGE 0 OK");
    suite.run_all(&[Case::new("dsec_xfs_ioc_swapext_on_protected_file", script, expect)]).await;
    if let Err(why) = xfs.healthy() {
        suite.failures.push(format!("dsec_xfs_ioc_swapext_on_protected_file: {why}"));
    }
    // Unmounted before the suite ends: the mount sits in the server's temp
    // dir, which the suite's end removes (a mount in it kept the whole dir).
    drop(xfs);
    suite.finish("XFS_IOC_SWAPEXT on real XFS").await;
}

/// The forged-RPC incident at its worst: the sandbox is handed its real
/// control socket (bind-mounted in, and opened to everyone for the test).
/// It connects, sends a ping and an exec as the host would, and gets
/// nothing: init answers only peers outside the sandbox's pid namespace.
#[tokio::test]
async fn dsec_forged_messages_on_the_real_control_socket() {
    use std::os::unix::fs::PermissionsExt;
    let mut suite = Suite::start().await;
    let id = suite.victim.id.clone();
    suite.server.sh_ok(&id, "touch /tmp/ctl.sock").await;
    let pid1 = sandbox_pid1(&suite.server.instance, &id).expect("the victim's PID 1");
    let sock = suite.server.data_dir().join("run").join(&id).join("ctl.sock");
    let mode = |m: u32| std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(m)).expect("chmod ctl.sock");
    mode(0o666);
    xfs::attach_into(&sock, pid1, "/tmp/ctl.sock").expect("attach the control socket inside the sandbox");
    let script = "{probe} forge /tmp/ctl.sock; sleep 0.5; test -e /tmp/forged && echo FORGED || echo not-forged";
    // The connect must succeed (else the case proves nothing), the answer must not come.
    let expect = Expect::default().has("connect-type1 0 OK").has("answered 0").has("not-forged");
    suite.run_all(&[Case::new("dsec_forged_messages_on_the_real_control_socket", script, expect)]).await;
    mode(0o600);
    let r = suite.server.sh(&id, "echo still-served").await;
    assert_eq!(stdout(&r), "still-served\n", "the host's own channel still works");
    suite.finish("forged messages on the real control socket").await;
}

#[tokio::test]
async fn inode_and_open_file_caps_are_validated_and_shown() {
    let server = TestServer::start().await;
    for (field, value) in [("inodes", json!(1)), ("inodes", json!(1u64 << 40)), ("open_files", json!(3))] {
        let (status, body) = server.try_create(&small(json!({ field: value }))).await;
        assert_api_error(status, &body, ErrorCode::InvalidRequest, Some(field));
    }
    let sb = server.create(small(json!({"inodes": 5000, "open_files": 256}))).await;
    assert_eq!((sb.resources.inodes, sb.resources.open_files), (5000, 256));
    assert_eq!(server.sh_ok(&sb.id, "ulimit -n").await.trim(), "256");
    let default = server.create(small(json!({"disk_mib": 8}))).await;
    assert_eq!(default.resources.inodes, warren_api::default_inodes(8));
    assert_eq!(default.resources.open_files, warren_api::DEFAULT_OPEN_FILES);
    let (status, _) = server.try_get(&default.id).await;
    assert_eq!(status, StatusCode::OK);
    server.finish().await;
}

#[test]
fn the_suite_covers_the_incidents_and_escape_classes() {
    let names: Vec<String> =
        [cases::shared(), cases::own(), cases::seccomp_rules()].concat().into_iter().map(|c| c.name).collect();
    assert!(names.len() + 1 >= 40, "only {} cases", names.len() + 1);
    for wanted in [
        "dsec_forged_control_messages",
        "dsec_platform_logs_and_data_are_not_inside",
        "dsec_overwriting_bin_sh_and_bin_bash",
        "dsec_port_scan_for_mirrors",
        "dsec_grep_r_over_proc",
        "dsec_grep_over_proc_finds_no_host_secret",
        "dsec_yes_flood_stays_bounded",
        "dsec_sysrq_and_proc_sys_writes",
        "dsec_module_loading",
        "cve_2019_5736_proc_self_exe_overwrite",
        "cve_2024_21626_leaked_fds",
        "hostile_cwd_proc_self_fd",
        "cve_2025_31133_masked_path_symlink_swap",
        "cve_2018_15664_file_api_symlink_race",
        "cve_2022_0492_cgroup_release_agent",
        "shocker_open_by_handle",
        "io_uring_setup",
        "keyctl_and_keyrings",
        "perf_event_open",
        "bpf_program_load",
        "userfaultfd",
        "ptrace_and_memory_of_warren_init",
        "raw_and_packet_sockets",
        "udp_and_ipv6_egress",
        "dns_to_a_foreign_resolver",
        "dos_fork_bomb",
        "dos_memory_bomb_ends_as_oom",
        "dos_disk_fill",
        "dos_inode_flood_explicit_cap",
        "seccomp_rule_ioctl",
        "seccomp_rule_clone3",
    ] {
        assert!(names.iter().any(|n| n == wanted), "no case {wanted}");
    }
    let mut sorted = names.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), names.len(), "case names are unique");
}

/// The after-case checks can fail: a changed sentinel file and a process
/// with a sandbox uid outside every sandbox cgroup are both reported.
#[test]
fn host_checks_see_a_changed_file_and_an_escaped_process() {
    let dir = tempfile::tempdir().unwrap();
    let sentinel = host::Sentinel::plant(&dir.path().join("sentinel"), "marker", Vec::new());
    let before = host::HostState::take(&sentinel);
    assert!(before.changes(&host::HostState::take(&sentinel)).is_empty(), "nothing changed yet");
    std::fs::write(sentinel.dir.join("answers.txt"), "overwritten\n").unwrap();
    std::fs::write(sentinel.dir.join("new.txt"), "dropped by an escapee\n").unwrap();
    let changes = before.changes(&host::HostState::take(&sentinel));
    // The file's content, the directory's entry count, the new file.
    assert_eq!(changes.len(), 3, "{changes:?}");

    let uid = (1u32 << 30) + 4242;
    let mut escapee = std::process::Command::new("setpriv")
        .args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
            "sleep".into(),
            "60".into(),
        ])
        .spawn()
        .expect("setpriv (util-linux)");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let found = loop {
        let found = host::escaped_processes(None, "no-such-instance");
        if found.iter().any(|p| p.contains(&format!("pid {} ", escapee.id()))) || std::time::Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    escapee.kill().unwrap();
    escapee.wait().unwrap();
    assert!(found.iter().any(|p| p.contains(&format!("pid {} ", escapee.id()))), "{found:?}");
}
