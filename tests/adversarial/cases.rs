//! The case tables. Every case is what an agent could type into its
//! sandbox, and the outcome that means "stopped, and seen where the
//! platform can see it". Addresses: only the sandbox's own loopback, the
//! host's own addresses, TEST-NET-2/3 (198.51.100.0/24, 203.0.113.0/24) and
//! 2001:db8::/32, and only from sandboxes without egress (`none` or
//! `loopback`): no packet can leave the host.

use serde_json::json;
use warren_api::ExecStatus;
use warren_guard::seccomp::{probes, syscall_number, DENY_RULES};

use crate::suite::{Case, Expect, Outcome, Placement, Via};

fn nr(name: &str) -> i64 {
    syscall_number(name).unwrap_or_else(|| panic!("no x86_64 number for {name}"))
}

fn expect() -> Expect {
    Expect::default()
}

/// Lines of `stdout` that start with `prefix`.
fn lines_with<'a>(o: &'a Outcome, prefix: &'a str) -> impl Iterator<Item = &'a str> {
    o.stdout.lines().filter(move |l| l.starts_with(prefix))
}

/// Every `open N` line of the probe's `connect` says 0, and no TCP attempt
/// or datagram went through.
fn nothing_reachable(o: &Outcome) -> Result<(), String> {
    let opened: Vec<&str> = lines_with(o, "open ").filter(|l| *l != "open 0").collect();
    let through: Vec<&str> = o.stdout.lines().filter(|l| l.starts_with("tcp:") && l.ends_with(" OK")).collect();
    let answered: Vec<&str> = lines_with(o, "answered ").filter(|l| *l != "answered 0").collect();
    if o.stdout.lines().filter(|l| l.starts_with("open ") || l.starts_with("answered ")).count() == 0 {
        return Err(format!("the probe printed no result: {:?} / {:?}", o.stdout, o.stderr));
    }
    match (opened.is_empty() && through.is_empty(), answered.is_empty()) {
        (true, true) => Ok(()),
        _ => Err(format!("reachable from the sandbox: {opened:?} {through:?} {answered:?}")),
    }
}

/// A mask from a `/proc/self/status` line such as `CapEff:\t00000000a80425fb`.
fn cap_mask(o: &Outcome, key: &str) -> Option<u64> {
    o.stdout.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// The cases that share the suite's victim sandbox: they must not break it.
pub fn shared() -> Vec<Case> {
    let probe = "{probe}";
    let mut cases = vec![
        // ---- DSec incidents -----------------------------------------------------
        Case::new(
            "dsec_forged_control_messages",
            format!(
                r#"targets="$(find / -xdev -type s 2>/dev/null) $(awk 'NR>1 && $8 != "" {{print $8}}' /proc/net/unix) @warren @warren-init @ctl.sock @/run/warren"
for t in $targets; do echo "target $t"; {probe} forge "$t"; done
for fd in /proc/self/fd/*; do echo "own fd $fd -> $(readlink $fd)"; done
ls /proc/1/fd >/dev/null 2>&1 && echo PID1-FDS-READABLE || echo pid1-fds-hidden
for fd in 3 4 5 6; do {probe} forge /proc/1/fd/$fd; done
test -e /tmp/forged && echo FORGED || echo not-forged"#
            ),
            expect().has("not-forged").has("pid1-fds-hidden").lacks("answered 1").lacks("answered 2").lacks("answered 3"),
        ),
        Case::new(
            "dsec_platform_logs_and_data_are_not_inside",
            r#"find / -xdev \( -name '*.log' -o -name 'server.url' -o -name '*.redb' -o -name 'ctl.sock' -o -name 'handle.json' -o -iname '*warren*' \) 2>/dev/null | grep -v '^/tmp/\.probe$'
find / -xdev -type f 2>/dev/null | grep -v '^/tmp/\.probe$' | xargs grep -l -e '{instance}' -e '{datadir}' -e 'warren_node' -e 'warren_backend' 2>/dev/null
ls -A /var/log 2>/dev/null
dmesg >/dev/null 2>&1 && echo DMESG-READABLE
echo searched"#,
            expect().has("searched").lacks("DMESG-READABLE").seccomp("syslog").check(|o| {
                let found: Vec<&str> = o.stdout.lines().filter(|l| *l != "searched").collect();
                if found.is_empty() {
                    Ok(())
                } else {
                    Err(format!("platform files or text found inside: {found:?}"))
                }
            }),
        ),
        Case::new(
            "dsec_port_scan_for_mirrors",
            format!(
                "for ip in 127.0.0.1 {{hostips}} 198.51.100.1 198.51.100.80 203.0.113.5; do \
                 {probe} connect $ip 21 22 53 80 443 873 3128 3142 5000 8080 8081 9000 {{port}}; done
                 {probe} connect ::1 80 443 3128 {{port}}
                 {probe} connect 2001:db8::1 80 443 3128
                 nc -w 1 198.51.100.1 80 </dev/null && echo NC-CONNECTED
                 wget -q -T 2 -O /dev/null http://198.51.100.1:3128/ 2>/dev/null && echo WGET-OK
                 echo scanned"
            ),
            expect().has("scanned").lacks("NC-CONNECTED").lacks("WGET-OK").check(nothing_reachable),
        )
        .timeout(120.0),
        // As the agent typed it. Every /proc/<pid>/pagemap reads as 256 GiB
        // of zeros, so this never finishes by itself: the exec deadline
        // ends it, and the host must not notice.
        Case::new(
            "dsec_grep_r_over_proc",
            "grep -rl '{pattern}' /proc 2>/dev/null",
            expect().check(|o| {
                no_proc_hits(o)?;
                match o.status() {
                    Some(ExecStatus::Ok | ExecStatus::TimedOut) => Ok(()),
                    other => Err(format!("grep -r /proc ended {other:?}")),
                }
            }),
        )
        .timeout(20.0),
        // The same search over every /proc file but the page maps and
        // memory images, so it completes: no host secret anywhere.
        Case::new(
            "dsec_grep_over_proc_finds_no_host_secret",
            "find /proc -type f ! -name pagemap ! -name mem ! -name kcore ! -name clear_refs 2>/dev/null | \
             xargs grep -l '{pattern}' 2>/dev/null; echo grep-done",
            expect().has("grep-done").status(ExecStatus::Ok).check(no_proc_hits),
        )
        .timeout(170.0),
        // Not logs, but host layout: the overlay's options must not name
        // the host's data directory or the sandbox's run directory.
        Case::new(
            "platform_paths_not_disclosed_in_mountinfo",
            "cat /proc/self/mountinfo /proc/1/mountinfo 2>/dev/null",
            expect().has(" / / ").lacks("{datadir}").lacks("/run/sb-"),
        ),
        Case::new(
            "dsec_kernel_memory_files_read_nothing",
            r#"for f in /proc/kpagecgroup /proc/kpageflags /proc/kpagecount /proc/kcore /proc/kmsg /proc/timer_list /proc/keys /proc/sched_debug /proc/sysrq-trigger /sys/kernel/debug/kprobes/list /sys/firmware/dmi/tables/DMI /dev/mem /dev/kmem /dev/port; do
  echo "$f $(head -c 64 $f 2>/dev/null | wc -c)"; done"#,
            expect().check(|o| {
                let leaking: Vec<&str> = o.stdout.lines().filter(|l| !l.ends_with(" 0")).collect();
                match (o.stdout.lines().count(), leaking.is_empty()) {
                    (14, true) => Ok(()),
                    _ => Err(format!("kernel memory or log files gave bytes: {leaking:?} (all: {:?})", o.stdout)),
                }
            }),
        ),
        Case::new(
            "dsec_sysrq_and_proc_sys_writes",
            r#"echo h > /proc/sysrq-trigger 2>/dev/null && echo SYSRQ-WRITTEN
for f in kernel/sysrq kernel/panic kernel/panic_on_oops vm/overcommit_memory kernel/core_pattern kernel/modprobe kernel/hostname net/ipv4/ip_forward vm/drop_caches fs/file-max; do
  v=$(cat /proc/sys/$f 2>/dev/null); echo "$v" > /proc/sys/$f 2>/dev/null && echo "WROTE $f"; done
sysctl -w kernel.panic=0 >/dev/null 2>&1 && echo WROTE-SYSCTL
echo done"#,
            expect().has("done").lacks("SYSRQ-WRITTEN").lacks("WROTE"),
        ),
        // sysfs files are mostly root's 0644, and a microVM's sandbox is
        // the guest kernel's root: only the read-only mount refuses these
        // there (a container's are the host's root's, out of its reach).
        Case::new(
            "sysfs_writes",
            r#"for f in /sys/kernel/uevent_helper /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/ksm/run /sys/power/state /sys/kernel/profiling; do
  if [ -e $f ]; then echo "exists $f"; v=$(cat $f 2>/dev/null); echo "$v" > $f 2>/dev/null && echo "WROTE $f"; fi; done
for f in $(ls /sys/module/*/parameters/* 2>/dev/null | head -20) $(ls /sys/block/*/queue/read_ahead_kb 2>/dev/null); do
  echo "exists $f"; v=$(cat $f 2>/dev/null); echo "$v" > $f 2>/dev/null && echo "WROTE $f"; done
touch /sys/warren-planted 2>/dev/null && echo WROTE-NEW-FILE
echo done"#,
            expect().has("done").has("exists /sys/kernel/mm/transparent_hugepage/enabled").lacks("WROTE"),
        ),
        Case::new(
            "dsec_kernel_log_read_and_injection",
            r#"dmesg 2>/dev/null | head -c 100 | wc -c
if [ -c /dev/kmsg ]; then echo '<0>warren-forged-kernel-message' > /dev/kmsg 2>/dev/null && echo KMSG-WRITTEN; fi
[ -c /dev/kmsg ] && head -c 100 /dev/kmsg 2>/dev/null | wc -c
logger -p kern.emerg warren-forged-kernel-message 2>/dev/null
echo done"#,
            expect().has("done").lacks("KMSG-WRITTEN").seccomp("syslog"),
        ),
        Case::new(
            "dsec_module_loading",
            format!(
                r#"printf '\177ELF\002\001\001' > /tmp/evil.ko
insmod /tmp/evil.ko 2>/dev/null && echo INSMOD-OK
modprobe -q dummy 2>/dev/null && echo MODPROBE-OK
rmmod -f dummy 2>/dev/null && echo RMMOD-OK
{probe} sys {init} 0 0 buf
{probe} sys {finit} 0 buf 0
{probe} sys {delete} buf 0
echo done"#,
                init = nr("init_module"),
                finit = nr("finit_module"),
                delete = nr("delete_module")
            ),
            expect()
                .has("done")
                .lacks("INSMOD-OK")
                .lacks("MODPROBE-OK")
                .lacks("RMMOD-OK")
                .has(format!("sys{} -1 EPERM", nr("init_module")))
                .has(format!("sys{} -1 EPERM", nr("finit_module")))
                .has(format!("sys{} -1 EPERM", nr("delete_module")))
                .seccomp("init_module")
                .seccomp("finit_module")
                .seccomp("delete_module"),
        ),
        Case::new(
            "dsec_reboot_kexec_and_clock",
            format!(
                r#"reboot -f 2>/dev/null; poweroff -f 2>/dev/null
{probe} sys {kexec} 0 0 0 0
date -s "@$(date +%s)" 2>&1 | grep -q "can't set date" || echo CLOCK-SET
hwclock -s 2>/dev/null && echo HWCLOCK-SET
swapoff -a 2>/dev/null; echo done"#,
                kexec = nr("kexec_load")
            ),
            expect().has("done").lacks("CLOCK-SET").lacks("HWCLOCK-SET").seccomp("reboot").seccomp("kexec_load").check(
                |o| match o.seccomp("clock_settime") || o.seccomp("settimeofday") {
                    true => Ok(()),
                    false => Err("setting the clock raised no seccomp event".into()),
                },
            ),
        ),
        Case::new(
            "dsec_commands_for_another_machine",
            r#"ip link set lo down 2>/dev/null && echo LINK-CHANGED
ifconfig lo 10.9.9.9 2>/dev/null && echo ADDR-CHANGED
route add default gw 198.51.100.1 2>/dev/null && echo ROUTE-ADDED
mknod /tmp/sda b 8 0 2>/dev/null && head -c 1 /tmp/sda >/dev/null 2>&1 && echo BLOCK-DEVICE-READ
fsfreeze --freeze / 2>/dev/null && echo FROZEN
fstrim / 2>/dev/null && echo TRIMMED
blockdev --setro /dev/sda 2>/dev/null && echo BLOCKDEV
echo done"#,
            expect()
                .has("done")
                .lacks("BLOCK-DEVICE-READ")
                .lacks("FROZEN")
                .lacks("TRIMMED")
                .lacks("BLOCKDEV")
                .seccomp("ioctl"),
        ),
        // ---- escape classes ---------------------------------------------------
        Case::new(
            "cve_2019_5736_proc_self_exe_overwrite",
            r#"{probe} write /proc/self/exe
{probe} write /proc/1/exe
for p in /proc/[0-9]*; do {probe} write $p/exe 2>/dev/null | grep -q '^write 5 ' && echo "WROTE $p/exe"; done
cat /proc/1/exe 2>/dev/null | wc -c
echo done"#,
            expect().has("done").lacks("write 5 OK").lacks("WROTE").check(|o| {
                // Reading init's binary would hand the agent a host file.
                match o.stdout.lines().rev().nth(1) {
                    Some("0") => Ok(()),
                    other => Err(format!("/proc/1/exe is readable: {other:?} bytes")),
                }
            }),
        ),
        Case::new(
            "cve_2024_21626_leaked_fds",
            r#"ls /proc/self/fd
for p in /proc/[0-9]*; do for f in $p/fd/* $p/cwd $p/root; do l=$(readlink $f 2>/dev/null) && echo "$f -> $l"; done; done
echo done"#,
            expect().has("done").lacks("{datadir}").lacks("ctl.sock").lacks("/tmp/warren-test").lacks("{sentinel}").check(
                |o| {
                    let own: Vec<&str> = o.stdout.lines().take_while(|l| !l.starts_with('/')).collect();
                    let want = ["0", "1", "2", "3"];
                    match own.iter().all(|fd| want.contains(fd)) {
                        true => Ok(()),
                        false => Err(format!("a command holds descriptors beyond stdio: {own:?}")),
                    }
                },
            ),
        ),
        Case::new(
            "cve_2022_0492_cgroup_release_agent",
            r#"ls -A /sys/fs/cgroup 2>/dev/null | head -3
mkdir -p /tmp/cg
mount -t cgroup -o rdma cgroup /tmp/cg 2>/dev/null && echo MOUNTED
mount -t cgroup -o memory cgroup /tmp/cg 2>/dev/null && echo MOUNTED
unshare -Urm sh -c 'mount -t cgroup -o rdma cgroup /tmp/cg && echo MOUNTED' 2>/dev/null
find / -xdev -name release_agent 2>/dev/null | while read f; do echo "found $f"; echo /tmp/x > $f 2>/dev/null && echo "WROTE $f"; done
find /sys -name release_agent 2>/dev/null | while read f; do echo /tmp/x > $f 2>/dev/null && echo "WROTE $f"; done
echo done"#,
            expect().has("done").lacks("MOUNTED").lacks("WROTE").seccomp("mount").seccomp("unshare"),
        ),
        Case::new(
            "shocker_open_by_handle",
            format!(
                "{probe} sys {n2h} -100 0 buf buf 0\n{probe} sys {obh} 3 buf 0\necho done",
                n2h = nr("name_to_handle_at"),
                obh = nr("open_by_handle_at")
            ),
            expect()
                .has(format!("sys{} -1 EPERM", nr("name_to_handle_at")))
                .has(format!("sys{} -1 EPERM", nr("open_by_handle_at")))
                .seccomp("name_to_handle_at")
                .seccomp("open_by_handle_at"),
        ),
        Case::new(
            "io_uring_setup",
            format!("{probe} sys {} 8 buf", nr("io_uring_setup")),
            expect().has(format!("sys{} -1 EPERM", nr("io_uring_setup"))).seccomp("io_uring_setup"),
        ),
        Case::new(
            "keyctl_and_keyrings",
            format!(
                "{probe} sys {keyctl} 0 -3 1\n{probe} sys {add} buf buf buf 0 -4\n{probe} sys {req} buf buf 0 0\n\
                 head -c 64 /proc/keys 2>/dev/null | wc -c",
                keyctl = nr("keyctl"),
                add = nr("add_key"),
                req = nr("request_key")
            ),
            expect()
                .has(format!("sys{} -1 EPERM", nr("keyctl")))
                .has(format!("sys{} -1 EPERM", nr("add_key")))
                .seccomp("keyctl")
                .seccomp("add_key")
                .seccomp("request_key"),
        ),
        Case::new(
            "perf_event_open",
            format!("{probe} sys {} buf 0 -1 -1 0", nr("perf_event_open")),
            expect().has(format!("sys{} -1 EPERM", nr("perf_event_open"))).seccomp("perf_event_open"),
        ),
        Case::new(
            "bpf_program_load",
            format!("{probe} sys {bpf} 0 buf 72\n{probe} sys {bpf} 5 buf 128\nls -A /sys/fs/bpf 2>/dev/null", bpf = nr("bpf")),
            expect().has(format!("sys{} -1 EPERM", nr("bpf"))).seccomp("bpf"),
        ),
        Case::new(
            "userfaultfd",
            format!("{probe} sys {} 0\nls /dev/userfaultfd 2>/dev/null || echo no-uffd-node", nr("userfaultfd")),
            expect().has(format!("sys{} -1 EPERM", nr("userfaultfd"))).has("no-uffd-node").seccomp("userfaultfd"),
        ),
        Case::new(
            "ptrace_and_memory_of_warren_init",
            format!(
                r#"{probe} sys {ptrace} 16 1 0 0
{probe} sys {ptrace} 0x4206 1 0 0
{probe} sys {vmr} 1 buf 1 buf 1 0
{probe} sys {getfd} 3 4 0
cat /proc/1/environ 2>/dev/null | wc -c
cat /proc/1/maps 2>/dev/null | wc -c
head -c 16 /proc/1/mem 2>/dev/null | wc -c
kill -9 1; kill -STOP 1; kill -SEGV 1
sleep 0.2; echo survived"#,
                ptrace = nr("ptrace"),
                vmr = nr("process_vm_readv"),
                getfd = nr("pidfd_getfd")
            ),
            expect()
                .has(format!("sys{} -1 EPERM", nr("ptrace")))
                .has(format!("sys{} -1 EPERM", nr("process_vm_readv")))
                .has("survived")
                .seccomp("ptrace")
                .seccomp("process_vm_readv")
                .check(|o| {
                    let counts: Vec<&str> = o.stdout.lines().filter(|l| l.chars().all(|c| c.is_ascii_digit())).collect();
                    match counts.iter().all(|c| *c == "0") && counts.len() == 3 {
                        true => Ok(()),
                        false => Err(format!("init's environ/maps/mem gave bytes: {counts:?}")),
                    }
                }),
        ),
        Case::new(
            "raw_and_packet_sockets",
            format!("{probe} socket 2 3 1\n{probe} socket 10 3 58\n{probe} socket 17 3 768\n{probe} socket 17 2 768\nping -c 1 -W 1 127.0.0.1 >/dev/null 2>&1 && echo PING-OK\necho done"),
            expect().has("done").lacks("PING-OK").check(|o| {
                let refused = lines_with(o, "socket -1 EPERM").count();
                match refused {
                    4 => Ok(()),
                    n => Err(format!("{n} of 4 raw/packet sockets refused: {:?}", o.stdout)),
                }
            }),
        ),
        Case::new(
            "dns_to_a_foreign_resolver",
            format!(
                r#"nslookup example.com 198.51.100.53 2>&1 | grep -E '^(Name|Address [0-9])' 
echo 'nameserver 203.0.113.53' > /etc/resolv.conf
nslookup example.com 2>&1 | grep -E '^(Name|Address [0-9])'
wget -q -T 2 -O /dev/null http://example.com/ 2>/dev/null && echo WGET-OK
{probe} udp 198.51.100.53 53
echo done"#
            ),
            expect().has("done").lacks("Name:").lacks("WGET-OK").check(nothing_reachable),
        )
        .timeout(120.0),
        Case::new(
            "hostile_cwd_proc_self_fd",
            "pwd -P; cat etc/hostname ../../../../etc/hostname 2>/dev/null; ls -a | head -5; echo done",
            expect().check(cwd_stays_inside),
        )
        .via(Via::ExecCwd("/proc/self/fd/3")),
        Case::new(
            "hostile_cwd_proc_1_cwd",
            "pwd -P; cat etc/hostname ../../../../etc/hostname 2>/dev/null; ls -a | head -5; echo done",
            expect().check(cwd_stays_inside),
        )
        .via(Via::ExecCwd("/proc/1/cwd")),
        Case::new(
            "hostile_cwd_proc_1_root_dotdot",
            "pwd -P; cat etc/hostname ../../../../etc/hostname 2>/dev/null; ls -a | head -5; echo done",
            expect().check(cwd_stays_inside),
        )
        .via(Via::ExecCwd("/proc/1/root/../../../..")),
        Case::new(
            "hostile_cwd_dotdot",
            "pwd -P; cat etc/hostname ../../../../etc/hostname 2>/dev/null; ls -a | head -5; echo done",
            expect().check(cwd_stays_inside),
        )
        .via(Via::ExecCwd("/../../../../../..")),
        Case::new(
            "cve_2018_15664_file_api_symlink_race",
            r#"mkdir -p /work/real; echo inside > /work/real/answers.txt
while :; do
  rm -rf /work/race; ln -s {sentinel} /work/race
  rm -f /work/race; ln -s ../../../../../../../..{sentinel} /work/race
  rm -f /work/race; ln -s / /work/race
  rm -f /work/race; ln -s /work/real /work/race
done"#,
            expect(),
        )
        .via(Via::FileRace)
        .timeout(300.0),
        Case::new(
            "namespace_and_root_changes",
            format!(
                r#"unshare -U -r id 2>/dev/null && echo USERNS
unshare -n true 2>/dev/null && echo NETNS
nsenter -t 1 -m true 2>/dev/null && echo SETNS
mkdir -p /tmp/jail; chroot /tmp/jail /bin/true 2>/dev/null; echo chroot=$?
{probe} sys {pivot} buf buf
exec 3</proc/self/ns/net; {probe} sys {setns} 3 0
echo done"#,
                pivot = nr("pivot_root"),
                setns = nr("setns")
            ),
            expect().has("done").lacks("USERNS").lacks("NETNS").lacks("SETNS").seccomp("unshare").seccomp("setns").seccomp("chroot").seccomp("pivot_root"),
        ),
        Case::new(
            "filesystem_changing_ioctls_on_own_files",
            r#"echo data > /work/ioctl-a; echo data > /work/ioctl-b
{probe} ioctl /work/ioctl-a 0x40049409
{probe} ioctl /work/ioctl-a 0x40086602
{probe} ioctl /work/ioctl-a 0x401c5820
{probe} ioctl /work/ioctl-a 0xc0045877
{probe} ioctl /work/ioctl-a 0x8004587d
{probe} ioctl /work/ioctl-a 0xc028660f
{probe} ioctl /work/ioctl-a 0x5412
echo done"#,
            expect().has("done").seccomp("ioctl").check(|o| match lines_with(o, "ioctl -1 EPERM").count() {
                7 => Ok(()),
                n => Err(format!("{n} of 7 filesystem-changing ioctls refused: {:?}", o.stdout)),
            }),
        ),
        Case::new(
            "capabilities_and_no_new_privs",
            "grep -E '^(CapEff|CapPrm|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status",
            expect().has("NoNewPrivs:\t1").check(|o| {
                // SYS_ADMIN 21, SYS_PTRACE 19, SYS_MODULE 16, DAC_READ_SEARCH 2,
                // LINUX_IMMUTABLE 9, NET_RAW 13, SYS_RAWIO 17, SYS_TIME 25, SYSLOG 34, BPF 39, PERFMON 38.
                let forbidden: u64 = [21, 19, 16, 2, 9, 13, 17, 25, 34, 39, 38].iter().map(|b| 1u64 << b).sum();
                for key in ["CapEff:", "CapPrm:", "CapBnd:"] {
                    match cap_mask(o, key) {
                        Some(m) if m & forbidden == 0 => {}
                        other => return Err(format!("{key} holds a forbidden capability: {other:x?}")),
                    }
                }
                Ok(())
            }),
        ),
        Case::new(
            "devices_beyond_the_safe_set",
            r#"ls /dev
mknod /tmp/mem c 1 1 2>/dev/null && head -c 1 /tmp/mem >/dev/null 2>&1 && echo MEM-READ
for d in /dev/mem /dev/kmem /dev/port /dev/sda /dev/vda /dev/nvme0 /dev/loop0 /dev/loop-control /dev/kvm /dev/fuse /dev/net/tun /dev/userfaultfd /dev/kmsg /dev/dri; do [ -e $d ] && echo "PRESENT $d"; done
echo done"#,
            expect().has("done").lacks("MEM-READ").lacks("PRESENT"),
        ),
        Case::new(
            "open_files_default_cap",
            "{probe} nofile; ulimit -n; ulimit -n 1048576 2>/dev/null && echo RAISED; echo done",
            expect().has("done").lacks("RAISED").has("EMFILE").check(|o| {
                let opened: Option<u64> =
                    lines_with(o, "opened ").next().and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
                match opened {
                    Some(n) if n < u64::from(warren_api::DEFAULT_OPEN_FILES) => Ok(()),
                    other => Err(format!("opened {other:?} files; the default cap is {}", warren_api::DEFAULT_OPEN_FILES)),
                }
            }),
        ),
    ];
    for case in &mut cases {
        case.script = case.script.replace("{hostips}", &host_ips());
    }
    cases
}

fn no_proc_hits(o: &Outcome) -> Result<(), String> {
    let hits: Vec<&str> = o.stdout.lines().filter(|l| l.starts_with('/')).collect();
    match hits.is_empty() {
        true => Ok(()),
        false => Err(format!("the host secret is readable inside at {hits:?}")),
    }
}

/// The host's own addresses: a sandbox must not reach the host either.
fn host_ips() -> String {
    let out = std::process::Command::new("hostname").arg("-I").output();
    out.map(|o| {
        String::from_utf8_lossy(&o.stdout).split_whitespace().filter(|a| !a.contains(':')).collect::<Vec<_>>().join(" ")
    })
    .unwrap_or_default()
}

/// A hostile working directory is refused or resolves inside the sandbox.
fn cwd_stays_inside(o: &Outcome) -> Result<(), String> {
    if let Some((status, body)) = &o.rejected {
        return match status.is_client_error() {
            true => Ok(()),
            false => Err(format!("the hostile cwd was answered with {status} {body}")),
        };
    }
    let Some(r) = &o.result else { return Err("no result".into()) };
    if r.exit_code != Some(0) {
        // Refused by init (no such directory): stopped.
        return Ok(());
    }
    let pwd = o.stdout.lines().next().unwrap_or("");
    let outside = pwd.contains("warren-test") || pwd.contains("/data") || o.stdout.contains("sentinel");
    match outside {
        false => Ok(()),
        true => Err(format!("the cwd reached outside the sandbox: {:?}", o.stdout)),
    }
}

/// The smallest guest the microVM backend boots (MiB).
const MICROVM_MIN_MEMORY_MIB: u64 = 128;

/// [`own`] as a microVM suite runs it: a case asking for less memory than
/// the smallest guest gets the suite's guest, and two cases are left to
/// other suites. `udp_and_ipv6_egress`: a guest's refused egress is dropped
/// on the host (QEMU's user-mode network in the sandbox's namespace, under
/// the same egress programs), not refused with `EPERM` by the guest's
/// kernel, which is what the case checks; `tests/functional/network.rs`
/// holds VMs to their policy. `dos_memory_bomb_in_a_pipeline`: its check
/// is a 64 MiB memory cgroup's peak, while a guest's limit is its RAM with
/// its kernel in it; the parity suite runs the same pipeline against a
/// microVM and wants `oom`.
pub fn own_for_microvm() -> Vec<Case> {
    own()
        .into_iter()
        .filter(|case| !["udp_and_ipv6_egress", "dos_memory_bomb_in_a_pipeline"].contains(&case.name.as_str()))
        .map(|mut case| {
            if let Placement::Own(fields) = &mut case.placement {
                if fields["memory_mib"].as_u64().is_some_and(|m| m < MICROVM_MIN_MEMORY_MIB) {
                    if let Some(fields) = fields.as_object_mut() {
                        fields.remove("memory_mib");
                    }
                }
            }
            case
        })
        .collect()
}

/// The cases that need a sandbox of their own: they break it or need
/// other limits.
pub fn own() -> Vec<Case> {
    let probe = "{probe}";
    vec![
        // UDP and IPv6 around a TCP rule, from an `allowlist` sandbox whose
        // IPv6 default route works: every refusal is the egress policy's
        // EPERM, not a missing route. (Documentation prefixes only.)
        Case::new(
            "udp_and_ipv6_egress",
            format!(
                "ip -6 route show default\n{probe} udp 2001:db8::53 53\n{probe} udp 203.0.113.9 443\n\
                 {probe} connect 2001:db8::53 80 443\n{probe} connect 2001:db8::80 53\n\
                 {probe} connect 203.0.113.9 80\necho done"
            ),
            expect().has("done").has("default via").check(|o| {
                nothing_reachable(o)?;
                let attempts: Vec<&str> =
                    o.stdout.lines().filter(|l| l.starts_with("sendto ") || l.starts_with("tcp:")).collect();
                match attempts.len() == 6 && attempts.iter().all(|l| l.ends_with(" EPERM")) {
                    true => Ok(()),
                    false => Err(format!("want 6 policy refusals (EPERM): {attempts:?}")),
                }
            }),
        )
        .own(json!({"network": "allowlist", "network_policy": {"rules": [
            {"cidr": "2001:db8::53/128", "ports": [53], "protocol": "tcp"},
            {"cidr": "203.0.113.9/32", "ports": [443], "protocol": "tcp"},
        ]}}))
        .timeout(60.0),
        Case::new(
            "dsec_overwriting_bin_sh_and_bin_bash",
            r#"printf '#!/bin/busybox sh\necho ran >> /tmp/hijacked\nexec /bin/busybox sh "$@"\n' > /tmp/impostor
chmod 755 /tmp/impostor
rm -f /bin/sh /bin/bash; cp /tmp/impostor /bin/sh && cp /tmp/impostor /bin/bash && echo planted"#,
            expect().has("planted"),
        )
        .own(json!({}))
        .via(Via::ShellImpostor),
        Case::new(
            "dsec_yes_flood_stays_bounded",
            "yes",
            expect().status(ExecStatus::TimedOut).check(|o| {
                let out = o.result.as_ref().and_then(|r| r.output.as_ref()).ok_or("no output")?;
                let cap = warren_api::DEFAULT_OUTPUT_CAP_BYTES;
                let kept = out.stdout.text.len() as u64;
                if kept > cap || out.stdout.dropped_bytes == 0 || out.stdout.total_bytes < 8 * cap {
                    return Err(format!(
                        "capture not bounded: kept {kept}, dropped {}, total {} (cap {cap})",
                        out.stdout.dropped_bytes, out.stdout.total_bytes
                    ));
                }
                Ok(())
            }),
        )
        .own(json!({}))
        .timeout(8.0),
        Case::new(
            "dsec_stderr_flood_stays_bounded",
            "yes warren-flood >&2",
            expect().status(ExecStatus::TimedOut).check(|o| {
                let out = o.result.as_ref().and_then(|r| r.output.as_ref()).ok_or("no output")?;
                match out.stderr.text.len() as u64 <= 64 * 1024 && out.stderr.dropped_bytes > 0 {
                    true => Ok(()),
                    false => Err(format!(
                        "stderr capture: kept {}, dropped {}",
                        out.stderr.text.len(),
                        out.stderr.dropped_bytes
                    )),
                }
            }),
        )
        .own(json!({}))
        .cap(64 * 1024)
        .timeout(6.0),
        Case::new(
            "dos_fork_bomb",
            "bomb() { bomb | bomb & }; bomb; sleep 5; echo after-bomb",
            expect().limit("pids").check(|o| match o.sandbox.state {
                warren_api::SandboxState::Running => Ok(()),
                s => Err(format!(
                    "the fork bomb ended its sandbox ({s:?}, {:?}: {:?}): the pids cap should hold it",
                    o.sandbox.end_reason, o.sandbox.end_message
                )),
            }),
        )
        .own(json!({"pids": 64}))
        .timeout(15.0),
        Case::new(
            "dos_memory_bomb_in_a_pipeline",
            "head -c 400m /dev/zero | tail > /dev/null; echo pipeline-exit=$?",
            expect().has("pipeline-exit=").limit("memory_mib").check(|o| {
                let peak = o.result.as_ref().map_or(0, |r| r.peak_memory_bytes);
                match peak <= 72 << 20 {
                    true => Ok(()),
                    false => Err(format!("peak memory {peak} bytes over a 64 MiB limit")),
                }
            }),
        )
        .own(json!({"memory_mib": 64}))
        .timeout(60.0),
        Case::new(
            "dos_memory_bomb_ends_as_oom",
            "exec tail /dev/zero",
            expect().status(ExecStatus::Oom).limit("memory_mib"),
        )
        .own(json!({"memory_mib": 64}))
        .timeout(60.0),
        Case::new(
            "dos_disk_fill",
            "dd if=/dev/zero of=/work/fill bs=1M count=200 2>&1 | tail -2; df -k /work | tail -1; echo done",
            expect().has(" 100% ").has("done").limit("disk_mib").check(|o| {
                let used = o.sandbox.usage.as_ref().map_or(0, |u| u.disk_bytes);
                match used <= 17 << 20 {
                    true => Ok(()),
                    false => Err(format!("the writable layer holds {used} bytes over its 16 MiB")),
                }
            }),
        )
        .own(json!({"disk_mib": 16}))
        .timeout(60.0),
        Case::new(
            "dos_inode_flood_explicit_cap",
            "i=0; while touch /work/f$i 2>/dev/null; do i=$((i+1)); [ $i -ge 5000 ] && break; done; echo made=$i",
            expect().limit("inodes").check(|o| made_below(o, 300 + 32)),
        )
        .own(json!({"inodes": 300}))
        .timeout(120.0),
        Case::new(
            "dos_inode_flood_default_cap",
            "i=0; while mkdir /work/d$i 2>/dev/null; do i=$((i+1)); [ $i -ge 20000 ] && break; done; echo made=$i",
            expect().limit("inodes").check(|o| made_below(o, warren_api::default_inodes(2) + 32)),
        )
        .own(json!({"disk_mib": 2}))
        .timeout(120.0),
        Case::new(
            "open_files_explicit_cap",
            "{probe} nofile; ulimit -Hn; ulimit -n 4096 2>/dev/null && echo RAISED; echo done",
            expect().has("EMFILE").lacks("RAISED").check(|o| {
                let opened: Option<u64> =
                    lines_with(o, "opened ").next().and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
                match opened {
                    Some(n) if n < 128 && n > 100 => Ok(()),
                    other => Err(format!("opened {other:?} files under a cap of 128")),
                }
            }),
        )
        .own(json!({"open_files": 128})),
        Case::new(
            "cve_2025_31133_masked_path_symlink_swap",
            r#"echo original > /tmp/target
rm -f /dev/null && ln -s /tmp/target /dev/null && echo swapped-null
rm -f /dev/zero && ln -s /proc/sysrq-trigger /dev/zero && echo swapped-zero
umount /proc/kpagecgroup 2>/dev/null && echo UNMOUNTED
mount --bind /tmp/target /proc/kpageflags 2>/dev/null && echo BOUND
rm -f /proc/kpagecgroup 2>/dev/null; [ -e /proc/kpagecgroup ] || echo REMOVED"#,
            expect()
                .has("--then--\noriginal\n0\nthen-done")
                .lacks("swapped-null")
                .lacks("swapped-zero")
                .lacks("UNMOUNTED")
                .lacks("BOUND")
                .lacks("REMOVED")
                .seccomp("umount2")
                .seccomp("mount"),
        )
        .own(json!({}))
        .then("cat /tmp/target; head -c 1 /proc/kpagecgroup 2>/dev/null | wc -c; echo then-done"),
        Case::new(
            "layer_files_written_inside_stay_unchanged_on_the_host",
            r#"echo appended >> /bin/busybox && echo copied-up
echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd
rm -rf /usr/bin /sbin && echo removed-inside
echo done"#,
            expect().has("done"),
        )
        .own(json!({})),
        Case::new(
            "loopback_network_reaches_only_itself",
            format!(
                r#"nc -l -p 8099 -e /bin/true >/dev/null 2>&1 &
sleep 0.5
{probe} connect 127.0.0.1 8099 {{port}} 80
{probe} connect {{hostips}} 8099 {{port}} 22 80
{probe} udp 198.51.100.53 53
{probe} connect 2001:db8::1 443
nslookup example.com 198.51.100.53 2>&1 | grep -E '^Name' 
kill %1 2>/dev/null; echo done"#
            ),
            expect().has("done").has("tcp:127.0.0.1:8099 0 OK").lacks("Name:").check(|o| {
                let through: Vec<&str> =
                    o.stdout.lines().filter(|l| l.ends_with(" OK") && !l.starts_with("tcp:127.0.0.1:8099 ")).collect();
                match through.is_empty() {
                    true => Ok(()),
                    false => Err(format!("reachable from a loopback sandbox: {through:?}")),
                }
            }),
        )
        .own(json!({"network": "loopback"}))
        .timeout(60.0),
    ]
    .into_iter()
    .map(|mut c| {
        c.script = c.script.replace("{hostips}", &host_ips());
        let _ = probe;
        c
    })
    .collect()
}

fn made_below(o: &Outcome, bound: u64) -> Result<(), String> {
    let made: Option<u64> = lines_with(o, "made=").next().and_then(|l| l.trim_start_matches("made=").parse().ok());
    match made {
        Some(n) if n > 0 && n < bound => Ok(()),
        other => Err(format!("made {other:?} inodes; the cap is below {bound}")),
    }
}

/// One case per seccomp deny rule, generated from the profile itself: each
/// of the rule's probes (one per flag and ioctl command) must fail with the
/// rule's errno, and every recorded one must show up as an event naming
/// the call and what made it a refusal.
pub fn seccomp_rules() -> Vec<Case> {
    let all = probes(DENY_RULES).expect("the profile's probes");
    let mut cases = Vec::new();
    for rule in DENY_RULES {
        let mine: Vec<_> = all.iter().filter(|p| p.syscall == rule.syscall).collect();
        let mut script = String::new();
        for p in &mine {
            let args: Vec<String> = p.args.iter().map(|a| a.to_string()).collect();
            script.push_str(&format!("{{probe}} sys {} {}\n", p.number, args.join(" ")));
        }
        let errno = match mine.first().map(|p| p.errno) {
            Some(libc::ENOSYS) => "ENOSYS",
            _ => "EPERM",
        };
        let line = format!("sys{} -1 {errno}", mine.first().map_or(0, |p| p.number));
        let expect = Expect {
            seccomp_detail: mine
                .iter()
                .filter(|p| p.recorded)
                .map(|p| (p.syscall.to_string(), p.detail.clone()))
                .collect(),
            line_count: Some((line, mine.len())),
            ..Expect::default()
        };
        cases.push(Case::new(format!("seccomp_rule_{}", rule.syscall), script, expect));
    }
    cases.push(off_the_allowlist());
    cases
}

/// Calls no deny rule names are refused too: real ones the allowlist
/// leaves out (`EPERM`) and numbers the kernel's table did not have when
/// the profile was written (`ENOSYS`), each recorded.
fn off_the_allowlist() -> Case {
    let number = |name: &str| syscall_number(name).expect("a known call");
    let calls = [
        (number("vhangup"), "vhangup".to_string(), "EPERM"),
        (number("modify_ldt"), "modify_ldt".to_string(), "EPERM"),
        (number("fanotify_init"), "fanotify_init".to_string(), "EPERM"),
        (400, "#400".to_string(), "ENOSYS"),
        (470, "#470".to_string(), "ENOSYS"),
        (1000, "#1000".to_string(), "ENOSYS"),
    ];
    let mut script = String::new();
    let mut expect = Expect::default();
    for (nr, syscall, errno) in calls {
        script.push_str(&format!("{{probe}} sys {nr} 0 0 0\n"));
        expect = expect.has(format!("sys{nr} -1 {errno}"));
        expect.seccomp_detail.push((syscall, format!("syscall {nr} not allowed")));
    }
    Case::new("seccomp_calls_off_the_allowlist", script, expect)
}
