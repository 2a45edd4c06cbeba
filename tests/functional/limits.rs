//! Resource limits hold: memory (OOM kills the command, not the sandbox),
//! processes (a fork bomb stays inside), disk (the writable layer fills up,
//! the host's disk does not), and network (none, or loopback only).

use std::fs;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use warren_api::{ErrorCode, ExecRequest, ExecStatus, SandboxState};
use warren_tests::*;

const MIB: u64 = 1 << 20;

#[tokio::test]
async fn memory_hog_is_oom_killed_and_the_sandbox_stays_usable() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"memory_mib": 64}))).await;
    // tail keeps everything after the last newline, and /dev/zero has none.
    let r = server.sh(&sb.id, "head -c 400m /dev/zero | tail").await;
    assert_eq!(r.status, ExecStatus::Oom, "{r:?}");
    assert_eq!(server.sh_ok(&sb.id, "echo alive").await, "alive\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    server.finish().await;
}

#[tokio::test]
async fn fork_bomb_is_contained_by_the_pids_limit() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"pids": 64}))).await;
    let pids_dir = Path::new(leaks::CGROUP_ROOT).join("pids").join(&server.instance).join(&sb.id);
    assert_eq!(fs::read_to_string(pids_dir.join("pids.max")).unwrap().trim(), "64");
    // busybox ash rejects `:` as a function name; the bomb is the same.
    let bomb = ExecRequest { timeout_secs: Some(5.0), ..ExecRequest::shell("bomb() { bomb | bomb & }; bomb") };
    let r = server.exec_wait(&sb.id, &bomb).await;
    assert!(matches!(r.status, ExecStatus::TimedOut | ExecStatus::Ok), "{r:?}");
    let events = fs::read_to_string(pids_dir.join("pids.events")).unwrap();
    let hits: u64 = events.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(hits > 0, "the bomb ran into pids.max: {events}");

    // The deadline killed the tree: the sandbox answers again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sandbox_pids(&server.instance, &sb.id).len() > 4 {
        assert!(tokio::time::Instant::now() < deadline, "the bomb's processes outlived its deadline");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.sh_ok(&sb.id, "echo alive").await, "alive\n");
    let host = std::process::Command::new("/bin/true").status().expect("the host can still fork");
    assert!(host.success());
    server.finish().await;
}

/// Free bytes of the filesystem holding `path`.
fn free_bytes(path: &Path) -> u64 {
    let st = rustix::fs::statvfs(path).expect("statvfs");
    st.f_bavail * st.f_frsize
}

#[tokio::test]
async fn disk_limit_stops_writes_without_touching_host_disk() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"disk_mib": 32}))).await;
    let host_free_before = free_bytes(&server.data_dir());
    let r = server.sh(&sb.id, "dd if=/dev/zero of=/big bs=1M count=200").await;
    assert_ne!(r.exit_code, Some(0), "{r:?}");
    assert!(stderr(&r).contains("No space left"), "dd reports a full disk: {}", stderr(&r));
    let written: u64 = server.sh_ok(&sb.id, "wc -c < /big").await.trim().parse().unwrap();
    assert!(written <= 32 * MIB, "the writable layer holds at most its limit, got {written}");
    let host_free_after = free_bytes(&server.data_dir());
    // Other work on the host may write meanwhile; 200 MiB through to the
    // host would still show.
    assert!(
        host_free_after + 100 * MIB > host_free_before,
        "host free space fell from {host_free_before} to {host_free_after}"
    );
    let usage = server.get(&sb.id).await.usage.expect("a running sandbox reports usage");
    assert!(usage.disk_bytes <= 32 * MIB, "{usage:?}");
    // An upload refused midway leaves its body unread: the refusal closes
    // the connection, so the client's next request never lands on it.
    for _ in 0..3 {
        let rb = server
            .request(reqwest::Method::PUT, &format!("/v1/sandboxes/{}/files", sb.id))
            .query(&[("path", "/upload.bin")])
            .body(chunked_body(&pattern(8 * MIB as usize)));
        let resp = api::send(rb).await;
        assert_eq!(resp.headers().get("connection").and_then(|v| v.to_str().ok()), Some("close"));
        let (status, body) = api::json_response(resp).await;
        assert_api_error(status, &body, ErrorCode::NoSpace, None);
        assert_eq!(server.sh_ok(&sb.id, "echo next").await, "next\n");
    }
    server.sh_ok(&sb.id, "rm /big && echo x > /after").await;
    server.finish().await;
}

/// The flags of `iface` in `ip link` output: `1: lo: <LOOPBACK,UP> ...`.
fn link_flags<'a>(ip_link: &'a str, iface: &str) -> Vec<&'a str> {
    let line = ip_link
        .lines()
        .find(|l| l.split(": ").nth(1) == Some(iface))
        .unwrap_or_else(|| panic!("no {iface} in:\n{ip_link}"));
    let flags = line.split_once('<').and_then(|(_, rest)| rest.split_once('>')).map_or("", |(f, _)| f);
    flags.split(',').collect()
}

#[tokio::test]
async fn network_none_has_only_a_down_loopback() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let dev = server.sh_ok(&sb.id, "cat /proc/net/dev").await;
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, vec!["lo"], "{dev}");
    let link = server.sh_ok(&sb.id, "ip link").await;
    assert!(!link_flags(&link, "lo").contains(&"UP"), "lo is down:\n{link}");
    let r = server.sh(&sb.id, "echo x | nc -w 1 127.0.0.1 9").await;
    assert_ne!(r.exit_code, Some(0), "nothing is reachable, not even loopback: {r:?}");
    server.finish().await;
}

#[tokio::test]
async fn network_loopback_has_lo_up_and_working() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"network": "loopback"}))).await;
    let link = server.sh_ok(&sb.id, "ip link").await;
    let names: Vec<&str> = link.lines().filter(|l| !l.starts_with(' ')).filter_map(|l| l.split(": ").nth(1)).collect();
    assert_eq!(names, vec!["lo"], "{link}");
    assert!(link_flags(&link, "lo").contains(&"UP"), "lo is up:\n{link}");
    // The client retries until the listener is up; the bound only stops a
    // broken loop. The listener hands the connection to `cat`, which reads
    // to its end: a plain `nc -l` quits at EOF on its own stdin, which can
    // come before the client's bytes.
    let script = "nc -l -p 8123 -e sh -c 'cat > /tmp/got' & listener=$!; i=0; \
        until echo over-lo | nc 127.0.0.1 8123; do i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done; \
        wait $listener; cat /tmp/got";
    let served = server.sh_ok(&sb.id, script).await;
    assert_eq!(served, "over-lo\n");
    server.finish().await;
}

/// While a sandbox's processes hold every pid of its limit, init cannot
/// start a thread for a new connection. The node's liveness probe must not
/// take that for a dead init (the sandbox stays running), and a new exec
/// gets an answer naming the cause instead of a dropped connection.
#[tokio::test]
async fn a_sandbox_with_its_pids_exhausted_is_busy_not_dead() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"pids": 16}))).await;
    let pids_dir = Path::new(leaks::CGROUP_ROOT).join("pids").join(&server.instance).join(&sb.id);
    let current = || -> u64 { fs::read_to_string(pids_dir.join("pids.current")).unwrap().trim().parse().unwrap() };
    let idle = current();
    // The holder's connection thread in init and its shell take two pids;
    // its sleeps take the rest. A busybox shell exits at its first failed
    // fork, so the count must be exact rather than "until it fails".
    let sleeps = 16 - idle - 2;
    let script = format!("i=0; while [ $i -lt {sleeps} ]; do sleep 60 & i=$((i+1)); done; wait");
    let holder =
        server.exec_open(&sb.id, &ExecRequest { timeout_secs: Some(8.0), ..ExecRequest::shell(&script) }).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while current() < 16 {
        assert!(tokio::time::Instant::now() < deadline, "the pids limit never filled up ({} of 16)", current());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Several liveness probes (one every 2 s) land while the limit is full.
    let (status, body) = server.try_exec_wait(&sb.id, &json!({"argv": ["echo", "hi"]})).await;
    assert_api_error(status, &body, ErrorCode::LimitReached, Some("pids"));
    assert!(body.to_string().contains("pids limit"), "the answer names the cause: {body}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    let held = holder.collect().await;
    assert_eq!(end_result(&held).status, ExecStatus::TimedOut);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sandbox_pids(&server.instance, &sb.id).len() > 4 {
        assert!(tokio::time::Instant::now() < deadline, "the holder's processes outlived its deadline");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.sh_ok(&sb.id, "echo alive").await, "alive\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    server.finish().await;
}

/// The node agent is protected from its sandboxes: all of them together are
/// capped below the host's memory and pid space, and the OOM killer picks
/// any sandbox command (then any sandbox's PID 1) before the agent.
#[tokio::test]
async fn the_node_agent_keeps_a_reserve_and_is_the_oom_killers_last_choice() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({}))).await;
    let read = |path: String| fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")).trim().to_string();
    let number = |path: String| read(path.clone()).parse::<u64>().unwrap_or_else(|e| panic!("{path}: {e}"));

    let mem_total = read("/proc/meminfo".into())
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().trim_end_matches("kB").trim().to_string()))
        .expect("MemTotal")
        .parse::<u64>()
        .expect("MemTotal in kB")
        * 1024;
    let instance_memory = number(format!("/sys/fs/cgroup/memory/{}/memory.limit_in_bytes", server.instance));
    assert!(instance_memory < mem_total, "sandboxes together may use {instance_memory} of {mem_total} bytes");
    assert!(instance_memory > mem_total / 2, "the reserve is a small part: {instance_memory} of {mem_total}");
    let pid_max = number("/proc/sys/kernel/pid_max".into());
    let instance_pids = number(format!("/sys/fs/cgroup/pids/{}/pids.max", server.instance));
    assert!(instance_pids < pid_max, "sandboxes together may use {instance_pids} of {pid_max} pids");

    let agent = server.server_pid().expect("the server runs");
    let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox's PID 1");
    let score = |pid: String| read(format!("/proc/{pid}/oom_score_adj")).parse::<i32>().expect("oom_score_adj");
    let (agent_score, pid1_score) = (score(agent.to_string()), score(pid1.to_string()));
    let command_score: i32 =
        server.sh_ok(&sb.id, "cat /proc/self/oom_score_adj").await.trim().parse().expect("a number");
    if has_cap_sys_resource() {
        assert!(
            agent_score < pid1_score && pid1_score < command_score,
            "OOM order must be command ({command_score}) > PID 1 ({pid1_score}) > agent ({agent_score})"
        );
    } else {
        eprintln!(
            "WARNING: this root lacks CAP_SYS_RESOURCE, so no OOM score can be lowered: checking only that the \
             agent ({agent_score}) is not above PID 1 ({pid1_score}) nor PID 1 above a command ({command_score})"
        );
        assert!(agent_score <= pid1_score && pid1_score <= command_score);
    }
    server.finish().await;
}

/// CAP_SYS_RESOURCE (bit 24) in this process's effective set.
fn has_cap_sys_resource() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 24) != 0)
}
