//! A Warren cluster on this machine for the cluster suites: etcd on the
//! lab's bridge, node agents each in their own network namespace
//! (`warren_cluster::testing::Lab`), API servers on the host, all sharing
//! one cluster token and one etcd prefix per test process.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use tokio::time::{sleep, Instant};
use warren_api::ClusterStatus;
use warren_cluster::testing::Lab;
use warren_store_etcd::testing::EtcdCluster;

use crate::{from_json, Launch, TestServer};

pub const TOKEN: &str = "test-cluster-token-0123456789";
/// The header API servers present the token in (`warren_cluster::token::HEADER`).
pub const TOKEN_HEADER: &str = "warren-cluster-token";
/// How long the cluster may take to settle (a node registering, a
/// heartbeat reaching every API server), with room for a slow CI.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(30);

/// Writes the cluster token to `dir/cluster.token` (mode 0600) and
/// returns its path.
pub fn token_file(dir: &std::path::Path) -> String {
    let path = dir.join("cluster.token");
    std::fs::write(&path, format!("{TOKEN}\n")).expect("write the token");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod the token");
    path.to_string_lossy().into_owned()
}

/// The arguments every cluster role gets: etcd, this process's prefix, the token.
pub fn cluster_args(etcd: &EtcdCluster, token: &str) -> Vec<String> {
    let prefix = format!("/wt-{}", std::process::id());
    ["--etcd", &etcd.all_endpoints().join(","), "--etcd-prefix", &prefix, "--cluster-token-file", token]
        .map(str::to_string)
        .to_vec()
}

/// Node `n<i>` in the lab's namespace `i`, with `extra` arguments.
pub async fn start_node(lab: &Lab, i: usize, etcd: &EtcdCluster, token: &str, extra: &[&str]) -> TestServer {
    let mut extra_args = vec!["--role".into(), "node".into(), "--node-name".into(), format!("n{i}")];
    extra_args.extend(extra.iter().map(|a| a.to_string()));
    extra_args.extend(cluster_args(etcd, token));
    TestServer::start_launched(Launch {
        extra_args,
        prefix: lab.enter(i),
        listen: Some(format!("{}:0", lab.node_ip(i))),
        headers: vec![(TOKEN_HEADER.into(), TOKEN.into())],
        ..Launch::default()
    })
    .await
}

/// An API server on the host, with `extra` arguments (`--auth on`).
pub async fn start_api(etcd: &EtcdCluster, token: &str, extra: &[&str]) -> TestServer {
    let mut extra_args = vec!["--role".to_string(), "api".to_string()];
    extra_args.extend(extra.iter().map(|a| a.to_string()));
    extra_args.extend(cluster_args(etcd, token));
    TestServer::start_launched(Launch { extra_args, no_image: true, ..Launch::default() }).await
}

/// `GET /v1/cluster` as the server's own client.
pub async fn status(api: &TestServer) -> ClusterStatus {
    let (code, body) = api.call(Method::GET, "/v1/cluster", None).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    from_json(body)
}

/// Waits (at most [`SETTLE_WITHIN`]) until `check` holds for the cluster
/// status an API server reports.
pub async fn wait_status(api: &TestServer, what: &str, check: impl Fn(&ClusterStatus) -> bool) -> ClusterStatus {
    let deadline = Instant::now() + SETTLE_WITHIN;
    loop {
        let now = status(api).await;
        if check(&now) {
            return now;
        }
        assert!(Instant::now() < deadline, "{what}: not within {SETTLE_WITHIN:?}; status {now:?}");
        sleep(Duration::from_millis(200)).await;
    }
}
