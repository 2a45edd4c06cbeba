//! `warren cluster ...`: what a cluster's API server sees of its nodes
//! (see docs/cluster.md).

use anyhow::Result;
use clap::Subcommand;
use warren_api::ClusterStatus;

use crate::client::Client;
use crate::print;

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// The live nodes, their load and images, and the running sandboxes by
    /// backend, node and label (`GET /v1/cluster` of an API server).
    Status,
}

pub async fn run(client: &Client, json: bool, cmd: &ClusterCmd) -> Result<i32> {
    match cmd {
        ClusterCmd::Status => {
            print(json, &client.cluster_status().await?, lines);
            Ok(0)
        }
    }
}

fn lines(status: &ClusterStatus) -> String {
    let mut out = vec![format!(
        "{} nodes, {} sandboxes running, {} given up with lost nodes",
        status.nodes.len(),
        status.running,
        status.lost
    )];
    for node in &status.nodes {
        let backends: Vec<&str> = node.backends.iter().map(|b| b.as_str()).collect();
        out.push(format!(
            "  {:<16} {:<28} {:>4} running  {:>4}/{} sandboxes  {:>7} MiB committed  backends {}  images {}",
            node.name,
            node.url,
            status.running_by_node.get(&node.name).copied().unwrap_or(0),
            node.books.sandboxes_live,
            node.books.sandboxes_max,
            node.books.memory_mib_committed,
            backends.join(","),
            node.images.join(",")
        ));
    }
    for (backend, n) in &status.running_by_backend {
        out.push(format!("  backend {backend}: {n} running"));
    }
    for (label, n) in &status.running_by_label {
        out.push(format!("  label {label}: {n} running"));
    }
    for (project, n) in &status.live_by_project {
        out.push(format!("  project {project}: {n} live"));
    }
    out.join("\n")
}
