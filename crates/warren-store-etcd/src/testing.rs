//! Real etcd members for tests: Debian's `etcd-server` binary on loopback,
//! each with its own data directory in one temp dir, on ports the kernel
//! picked free. Dropping the cluster kills and reaps every member and
//! removes the directory.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the binary is looked for unless `WARREN_ETCD_BIN` names one.
const DEFAULT_BIN: &str = "etcd";
/// A member that is not healthy by then will not become so; the bound only
/// keeps a broken setup from hanging the suite.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// Starts retried when a member exits at once, e.g. because another test
/// took one of its ports between our probe and its bind.
const START_ATTEMPTS: u32 = 3;

#[derive(Debug)]
struct Member {
    name: String,
    client_url: String,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster of one or more members.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `size` members and waits until every one reports healthy
    /// (which for a cluster means a leader is elected). Panics, with the
    /// install hint, when etcd is not installed: a test that needs etcd must
    /// never pass without it.
    pub fn start(size: usize) -> Self {
        Self::start_on(size, std::net::IpAddr::from([127, 0, 0, 1]))
    }

    /// Like [`EtcdCluster::start`], listening on `ip` (an address of this
    /// host other than loopback, for clients in other network namespaces).
    pub fn start_on(size: usize, ip: std::net::IpAddr) -> Self {
        assert!(size > 0, "an etcd cluster needs at least one member");
        let bin = etcd_binary();
        let mut last_failure = String::new();
        for _ in 0..START_ATTEMPTS {
            match Self::try_start(&bin, size, ip) {
                Ok(cluster) => return cluster,
                Err(failure) => last_failure = failure,
            }
        }
        panic!("etcd cluster of {size} did not start: {last_failure}");
    }

    fn try_start(bin: &Path, size: usize, ip: std::net::IpAddr) -> Result<Self, String> {
        let dir = tempfile::Builder::new().prefix("warren-etcd-").tempdir().map_err(|e| e.to_string())?;
        let ports = free_ports(ip, 2 * size).map_err(|e| format!("no free ports on {ip}: {e}"))?;
        let names: Vec<String> = (0..size).map(|i| format!("m{i}")).collect();
        let url = |port: u16| format!("http://{}", std::net::SocketAddr::new(ip, port));
        let peer_urls: Vec<String> = (0..size).map(|i| url(ports[2 * i + 1])).collect();
        let initial_cluster: Vec<String> = names.iter().zip(&peer_urls).map(|(n, u)| format!("{n}={u}")).collect();
        let token = dir.path().file_name().map_or_else(|| "warren".into(), |n| n.to_string_lossy().into_owned());
        let mut cluster = EtcdCluster { members: Vec::new(), dir };
        for i in 0..size {
            let client_url = url(ports[2 * i]);
            let data_dir = cluster.dir.path().join(&names[i]);
            let log = cluster.dir.path().join(format!("{}.log", names[i]));
            let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
            let child = Command::new(bin)
                .args(["--name", &names[i]])
                .arg("--data-dir")
                .arg(&data_dir)
                .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_urls[i], "--initial-advertise-peer-urls", &peer_urls[i]])
                .args(["--initial-cluster", &initial_cluster.join(",")])
                .args(["--initial-cluster-state", "new", "--initial-cluster-token", &token])
                .args(["--logger", "zap", "--log-level", "warn"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log_file)
                .spawn()
                .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
            cluster.members.push(Member { name: names[i].clone(), client_url, data_dir, log, child: Some(child) });
        }
        cluster.wait_healthy()?;
        Ok(cluster)
    }

    fn wait_healthy(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + READY_WITHIN;
        for member in &mut self.members {
            loop {
                if let Some(child) = member.child.as_mut() {
                    if let Ok(Some(status)) = child.try_wait() {
                        member.child = None;
                        return Err(format!("member {} exited ({status}): {}", member.name, tail(&member.log)));
                    }
                }
                if healthy(&member.client_url) {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("member {} not healthy: {}", member.name, tail(&member.log)));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Client URLs of the members still running.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().filter(|m| m.child.is_some()).map(|m| m.client_url.clone()).collect()
    }

    /// Client URLs of all members, killed ones included.
    pub fn all_endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    pub fn pid(&self, member: usize) -> Option<u32> {
        self.members[member].child.as_ref().map(Child::id)
    }

    pub fn data_dir(&self, member: usize) -> &Path {
        &self.members[member].data_dir
    }

    /// SIGKILLs one member by its PID and reaps it: a crash, not a shutdown.
    pub fn kill(&mut self, member: usize) {
        if let Some(mut child) = self.members[member].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// `WARREN_ETCD_BIN`, else `etcd` on `PATH`; panics with the install hint.
pub fn etcd_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("WARREN_ETCD_BIN") {
        return PathBuf::from(bin);
    }
    let found = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|dir| dir.join(DEFAULT_BIN)).find(|p| p.is_file()));
    match found {
        Some(bin) => bin,
        None => panic!(
            "etcd is not installed: these tests need a real etcd. Install Debian's etcd-server \
             (`apt-get install etcd-server`, done by scripts/setup-host.sh) or set WARREN_ETCD_BIN"
        ),
    }
}

/// Ports the kernel reports free: all are held until every one is picked so
/// the same port is not handed out twice.
fn free_ports(ip: std::net::IpAddr, n: usize) -> std::io::Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind((ip, 0))).collect::<Result<_, _>>()?;
    listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

/// etcd's `/health` on the client URL: true once the member has a leader
/// and answers a quorum read.
fn healthy(client_url: &str) -> bool {
    let Some(addr) = client_url.strip_prefix("http://") else { return false };
    let Ok(mut conn) = TcpStream::connect(addr) else { return false };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    if conn.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = conn.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let start = text.len().saturating_sub(2000);
    text.get(start..).unwrap_or(&text).to_owned()
}
