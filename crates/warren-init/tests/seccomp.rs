//! The seccomp profile inside a real sandbox: every deny rule of
//! `warren_guard::seccomp` is probed (one call per rule, flag and ioctl
//! command, generated from the profile's data), must fail with the rule's
//! errno and must show up as a security event over the control protocol;
//! calls off the allowlist are refused and recorded too; ordinary work
//! must keep running. Run as root; needs gcc and a static
//! glibc (libc6-dev) to build the prober.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use warren_guard::seccomp::{probes, syscall_number, Probe, DENY_RULES, REFUSED_UNLISTED};
use warren_init::proto::{SecurityEvent, SecurityEventKind};

/// `prober [-n COUNT] NR [ARG...]` makes system call NR with up to six
/// integer arguments (`buf`: a pointer to a zeroed 4 KiB buffer) COUNT
/// times and prints `<return value> <errno>` of the last call.
/// `prober thread` creates and joins a thread; `prober i386 NR` makes call
/// NR of the 32-bit ABI (`int 0x80`).
const PROBER_C: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

static char buf[4096];

static void *nothing(void *arg) { return arg; }

int main(int argc, char **argv) {
    int i = 1;
    long count = 1;
    if (argc > 2 && strcmp(argv[1], "-n") == 0) {
        count = strtol(argv[2], 0, 0);
        i = 3;
    }
    if (i < argc && strcmp(argv[i], "thread") == 0) {
        pthread_t t;
        int rc = pthread_create(&t, 0, nothing, 0);
        if (rc == 0) rc = pthread_join(t, 0);
        printf("%d %d\n", rc, rc);
        return 0;
    }
    if (i + 1 < argc && strcmp(argv[i], "i386") == 0) {
        long ret, nr = strtol(argv[i + 1], 0, 0);
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(nr) : "memory");
        printf("%ld 0\n", ret);
        return 0;
    }
    if (i >= argc) {
        fprintf(stderr, "usage: prober [-n COUNT] NR [ARG...]\n");
        return 2;
    }
    long nr = strtoll(argv[i++], 0, 0);
    unsigned long a[6] = {0};
    for (int k = 0; k < 6 && i < argc; k++, i++)
        a[k] = strcmp(argv[i], "buf") == 0 ? (unsigned long)buf : strtoull(argv[i], 0, 0);
    pid_t me = getpid();
    long ret = 0;
    int err = 0;
    for (long c = 0; c < count; c++) {
        errno = 0;
        ret = syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
        err = ret == -1 ? errno : 0;
        /* A clone that went through: the child leaves quietly. */
        if (getpid() != me) _exit(0);
    }
    printf("%ld %d\n", ret, err);
    return 0;
}
"#;

/// Builds the prober once per test run (static: it runs in a rootfs with
/// no libraries).
fn prober() -> &'static Path {
    static PROBER: OnceLock<PathBuf> = OnceLock::new();
    PROBER.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let source = dir.join(format!("seccomp-prober-{}.c", std::process::id()));
        let binary = dir.join(format!("seccomp-prober-{}", std::process::id()));
        std::fs::write(&source, PROBER_C).unwrap();
        let out = Command::new("gcc")
            .args(["-static", "-O1", "-pthread", "-o"])
            .arg(&binary)
            .arg(&source)
            .output()
            .expect("gcc must be installed");
        std::fs::remove_file(&source).unwrap();
        assert!(out.status.success(), "gcc: {}", String::from_utf8_lossy(&out.stderr));
        let stable = dir.join("seccomp-prober");
        std::fs::rename(&binary, &stable).unwrap();
        stable
    })
}

fn start_with_prober() -> Sandbox {
    let prober = prober();
    start_sandbox_adding(|root| {
        std::fs::copy(prober, root.join("bin/prober")).unwrap();
    })
}

/// What one prober run printed.
#[derive(Debug, PartialEq, Eq)]
struct Probed {
    pid: i32,
    ret: i64,
    errno: i32,
}

impl Sandbox {
    fn probe(&self, args: &[String]) -> Probed {
        let mut argv = vec!["prober".to_string()];
        argv.extend_from_slice(args);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let out = self.run(&argv);
        assert_eq!(
            out.exited.exit_code,
            Some(0),
            "{argv:?}: {:?} {}",
            out.exited,
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = out.stdout();
        let (ret, errno) = stdout.trim().split_once(' ').unwrap_or_else(|| panic!("{argv:?} printed {stdout:?}"));
        Probed { pid: out.pid, ret: ret.parse().unwrap(), errno: errno.parse().unwrap() }
    }

    fn probe_call(&self, nr: i64, args: &[u64]) -> Probed {
        let mut argv = vec![nr.to_string()];
        argv.extend(args.iter().map(|a| format!("{a:#x}")));
        self.probe(&argv)
    }

    /// The events recorded since `cursor`, moving it past them.
    fn new_events(&self, cursor: &mut u64) -> Vec<SecurityEvent> {
        let (events, dropped, next_seq) = self.events(*cursor);
        assert_eq!(dropped, 0, "no event may be lost here");
        *cursor = next_seq - 1;
        events
    }
}

fn nr(name: &str) -> i64 {
    syscall_number(name).unwrap()
}

/// Checks one probe's outcome; returns what went wrong, if anything.
fn check_probe(probe: &Probe, probed: &Probed, events: &[SecurityEvent]) -> Option<String> {
    let label = format!("{} {}", probe.syscall, probe.detail);
    if (probed.ret, probed.errno) != (-1, probe.errno) {
        return Some(format!(
            "{label}: returned {} errno {}, expected errno {}",
            probed.ret, probed.errno, probe.errno
        ));
    }
    if !probe.recorded {
        return (!events.is_empty()).then(|| format!("{label}: recorded although it must not be: {events:?}"));
    }
    match events {
        [event]
            if event.pid == probed.pid
                && event.comm == "prober"
                && event.kind == SecurityEventKind::Seccomp
                && event.syscall == probe.syscall
                && event.detail == probe.detail =>
        {
            None
        }
        other => Some(format!("{label}: expected one event from pid {}, got {other:?}", probed.pid)),
    }
}

#[test]
fn every_deny_rule_is_refused_with_its_errno_and_recorded() {
    let sb = start_with_prober();
    let probes = probes(DENY_RULES).unwrap();
    let mut cursor = 0;
    let mut failures = Vec::new();
    for probe in &probes {
        let probed = sb.probe_call(probe.number, &probe.args);
        let events = sb.new_events(&mut cursor);
        failures.extend(check_probe(probe, &probed, &events));
    }
    assert!(failures.is_empty(), "{} of {} probes failed:\n{}", failures.len(), probes.len(), failures.join("\n"));
    // Every probe that is recorded left exactly one event, numbered in order.
    let recorded = probes.iter().filter(|p| p.recorded).count() as u64;
    assert_eq!(sb.events(0).2, recorded + 1);
}

#[test]
fn every_sandbox_process_and_pid1_run_under_the_filter() {
    let sb = start_sandbox();
    // Mode 2 is "filter"; one filter, inherited from PID 1.
    let mine = sb.run(&["grep", "^Seccomp", "/proc/self/status"]).stdout();
    assert_eq!(mine, "Seccomp:\t2\nSeccomp_filters:\t1\n");
    let pid1 = sb.run(&["grep", "^Seccomp", "/proc/1/status"]).stdout();
    assert_eq!(pid1, "Seccomp:\t2\nSeccomp_filters:\t1\n");
}

#[test]
fn ordinary_work_still_runs() {
    let sb = start_with_prober();
    let out = sb.run(&["sh", "-c", "echo one | cat; ls / | grep -c '^bin$'; sh -c 'echo nested'; (exit 3); echo $?"]);
    assert_eq!(out.stdout(), "one\n1\nnested\n3\n", "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.exited.exit_code, Some(0));

    // fork: clone with SIGCHLD and no namespace flag gives a child pid.
    let forked = sb.probe_call(nr("clone"), &[libc::SIGCHLD as u64]);
    assert!(forked.ret > 0 && forked.errno == 0, "{forked:?}");
    // Threads: glibc's clone3 gets ENOSYS, its fallback to clone works.
    let thread = sb.probe(&["thread".into()]);
    assert_eq!((thread.ret, thread.errno), (0, 0));
    assert_eq!(sb.probe_call(nr("unshare"), &[libc::CLONE_FILES as u64]).errno, 0);
    assert_eq!(sb.probe_call(nr("personality"), &[0xffff_ffff]).errno, 0, "querying the persona is allowed");
    // Terminal and common file ioctls on stdin (a pipe).
    assert_eq!(sb.probe_call(nr("ioctl"), &[0, libc::TCGETS]).errno, libc::ENOTTY);
    let fionread = sb.run(&["prober", &nr("ioctl").to_string(), "0", &libc::FIONREAD.to_string(), "buf"]);
    assert_eq!(fionread.stdout(), "0 0\n");
    assert_eq!(sb.events(0).0, vec![], "nothing ordinary is recorded");
}

#[test]
fn unshare_is_refused_while_fork_works() {
    let sb = start_sandbox();
    let out = sb.run(&["sh", "-c", "unshare -m true; echo rc=$?; (echo forked); sh -c 'echo exec'"]);
    assert_eq!(out.stdout(), "rc=1\nforked\nexec\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"), "{out:?}");
    let (events, _, _) = sb.events(0);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].syscall.as_str(), events[0].detail.as_str()), ("unshare", "CLONE_NEWNS"));
    assert_eq!(events[0].comm, "unshare");
    assert!(events[0].pid > 1, "a pid inside the sandbox: {:?}", events[0]);
}

#[test]
fn ficlone_between_real_files_is_refused_even_with_high_bits_set() {
    let sb = start_with_prober();
    let ioctl = nr("ioctl");
    // FICLONE(dest = fd 4, src = fd 3) on the rootfs's own filesystem.
    for command in ["0x40049409", "0xdeadbeef40049409"] {
        let script = format!("echo data > /tmp/a; : > /tmp/b; prober {ioctl} 4 {command} 3 3</tmp/a 4>>/tmp/b");
        assert_eq!(sb.run(&["sh", "-c", &script]).stdout(), format!("-1 {}\n", libc::EPERM), "{command}");
    }
    let (events, _, _) = sb.events(0);
    let details: Vec<&str> = events.iter().map(|e| e.detail.as_str()).collect();
    assert_eq!(details, vec!["FICLONE (0x40049409)"; 2]);
}

#[test]
fn x32_calls_are_refused_and_other_abis_are_killed() {
    let sb = start_with_prober();
    let x32_mount = 0x4000_0000 + nr("mount");
    let probed = sb.probe_call(x32_mount, &[]);
    assert_eq!((probed.ret, probed.errno), (-1, libc::EPERM));
    let (events, _, _) = sb.events(0);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].syscall.as_str(), events[0].detail.as_str()), ("mount", "x32 ABI"));

    // getpid of the i386 ABI, from a 64-bit process.
    let out = sb.run(&["prober", "i386", "20"]);
    assert_eq!(out.exited.signal, Some(libc::SIGSYS), "{out:?}");
}

#[test]
fn a_flood_of_denials_keeps_the_latest_and_counts_what_was_lost() {
    let sb = start_with_prober();
    let out = sb.run(&["prober", "-n", "1100", &nr("acct").to_string(), "0"]);
    assert_eq!(out.stdout(), format!("-1 {}\n", libc::EPERM));
    let (events, dropped, next_seq) = sb.events(0);
    assert_eq!((events.len(), dropped, next_seq), (1024, 76, 1101));
    assert_eq!(events.first().map(|e| e.seq), Some(77));
    assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1 && w[1].time_ms >= w[0].time_ms));
    let (newer, dropped, _) = sb.events(next_seq - 1);
    assert_eq!((newer.len(), dropped), (0, 0), "nothing after the last one seen");
}

#[test]
fn calls_off_the_allowlist_are_refused_and_recorded() {
    let sb = start_with_prober();
    let mut cursor = 0;
    // A real call no rule names and the allowlist leaves out: EPERM.
    // Numbers no kernel assigned when the profile was written (the gap
    // before 424, past the newest call, far out): ENOSYS, so a libc that
    // probes a newer call falls back.
    let vhangup = nr("vhangup");
    assert!(REFUSED_UNLISTED.iter().any(|(name, _)| *name == "vhangup"));
    for (number, syscall, errno) in [
        (vhangup, "vhangup".to_string(), libc::EPERM),
        (400, "#400".to_string(), libc::ENOSYS),
        (470, "#470".to_string(), libc::ENOSYS),
        (1000, "#1000".to_string(), libc::ENOSYS),
    ] {
        let probed = sb.probe_call(number, &[]);
        assert_eq!((probed.ret, probed.errno), (-1, errno), "{syscall}");
        let events = sb.new_events(&mut cursor);
        assert_eq!(events.len(), 1, "{syscall}: {events:?}");
        let event = &events[0];
        assert_eq!(event.kind, SecurityEventKind::Seccomp);
        assert_eq!((event.pid, event.comm.as_str()), (probed.pid, "prober"));
        assert_eq!(event.syscall, syscall);
        assert_eq!(event.detail, format!("syscall {number} not allowed"));
    }
    // Still a working sandbox afterwards.
    assert_eq!(sb.run(&["sh", "-c", "echo ok"]).stdout(), "ok\n");
}
