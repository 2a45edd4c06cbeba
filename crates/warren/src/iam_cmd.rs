//! `warren project ...`, `warren key ...`, and IAM's start in `warren serve`
//! (`--auth`, the bootstrap admin key).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Subcommand;
use warren_api::{CreateKeyRequest, CreateProjectRequest, ProjectInfo, Quota, ROOT_PROJECT};
use warren_iam::{Caller, Iam};
use warren_store::StateStore;

use crate::client::Client;
use crate::print;

/// `warren serve --auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthMode {
    /// Every v1 request needs `Authorization: Bearer <key>`.
    On,
    /// A request without a key acts as the root project (local use only).
    Off,
}

/// The file the bootstrap admin key (root project) is written to.
pub const ADMIN_KEY_FILE: &str = "admin.key";

/// IAM for the embedded server. With auth on, the first start makes a key
/// of the root project, writes it to `<data-dir>/admin.key` (0600) and
/// prints it once; with auth off it says loudly that anyone may do anything.
pub fn serve_auth(
    mode: AuthMode,
    data_dir: &Path,
    store: Arc<dyn StateStore>,
    listen: &str,
) -> Result<warren_control::Auth> {
    let iam = Iam::open(store).context("cannot open IAM (projects and keys) in the state store")?;
    match mode {
        AuthMode::Off => tracing::warn!(
            "AUTH IS OFF: anyone who can reach {listen} acts as the root project and can do anything; \
             for anything but local use run `warren serve --auth on`"
        ),
        AuthMode::On => {
            let path = data_dir.join(ADMIN_KEY_FILE);
            if !path.exists() {
                let made = iam
                    .create_key(&Caller::root(), ROOT_PROJECT, &CreateKeyRequest { name: Some("admin".into()) })
                    .context("cannot make the bootstrap admin key")?;
                write_secret(&path, &made.secret)?;
                println!("warren: admin API key of the root project (shown once; also in {}):", path.display());
                println!("{}", made.secret);
            }
            tracing::info!("auth is on: every request needs an API key (admin key in {})", path.display());
        }
    }
    Ok(warren_control::Auth { iam, required: mode == AuthMode::On })
}

/// IAM for a cluster's API server, on the etcd every API server shares.
/// With auth on, the first API server of the cluster to start makes the
/// root project's admin key (claimed in etcd, so exactly one does) and
/// writes it to its `<data-dir>/admin.key`; the others find it claimed.
pub async fn cluster_auth(
    mode: AuthMode,
    data_dir: &Path,
    store: Arc<warren_store_etcd::EtcdStore>,
    listen: &str,
) -> Result<warren_control::Auth> {
    let required = mode == AuthMode::On;
    let (dir, etcd) = (data_dir.to_path_buf(), store.clone());
    let (auth, made) = tokio::task::spawn_blocking(move || {
        let auth = warren_cluster::iam::open(etcd.clone(), required)?;
        if !required {
            return Ok::<_, warren_cluster::ClusterError>((auth, None));
        }
        let path = dir.join(ADMIN_KEY_FILE);
        let made = warren_cluster::iam::bootstrap_admin_key(&auth.iam, &etcd, |secret| {
            write_secret(&path, secret).map_err(|e| std::io::Error::other(format!("{e:#}")))
        })?;
        if made == (warren_cluster::iam::AdminKey::MadeElsewhere { discarded: true }) {
            // Another API server won the race: the key written here is revoked.
            let _ = std::fs::remove_file(&path);
        }
        Ok((auth, Some((made, path))))
    })
    .await?
    .context("cannot open IAM (projects and keys) in etcd")?;
    match made {
        None => tracing::warn!(
            "AUTH IS OFF: anyone who can reach {listen} acts as the root project of the whole cluster and can do \
             anything; for anything but local use run `warren serve --role api --auth on`"
        ),
        Some((warren_cluster::iam::AdminKey::Made { secret }, path)) => {
            println!("warren: admin API key of the cluster's root project (shown once; also in {}):", path.display());
            println!("{secret}");
        }
        Some((warren_cluster::iam::AdminKey::MadeElsewhere { .. }, _)) => tracing::info!(
            "auth is on: every request needs an API key (the cluster's admin key is in the admin.key of the API \
             server that started first)"
        ),
    }
    Ok(auth)
}

/// Writes `secret` to a new file only its owner can read.
fn write_secret(path: &Path, secret: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(format!("{secret}\n").as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[derive(Subcommand)]
pub enum ProjectCmd {
    /// Make a child project with quota out of its parent's.
    Create {
        name: String,
        /// Default: the project of the key in WARREN_API_KEY.
        #[arg(long)]
        parent: Option<String>,
        /// Live sandboxes at once.
        #[arg(long)]
        sandboxes: Option<u64>,
        #[arg(long)]
        cpus: Option<f64>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        creates_per_sec: Option<u32>,
    },
    /// The key's project and every project below it.
    Ls,
    /// A project's quota and current use.
    Get { id: String },
}

#[derive(Subcommand)]
pub enum KeyCmd {
    /// Make an API key of a project; prints its secret (shown only once).
    Create {
        /// Default: the key's own project.
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        name: Option<String>,
    },
    /// Revoke keys.
    Rm { ids: Vec<String> },
}

fn project_line(p: &ProjectInfo) -> String {
    let quota = |q: &Quota| {
        let part = |name: &str, v: Option<String>| v.map(|v| format!("{name}={v}"));
        let parts: Vec<String> = [
            part("sandboxes", q.sandboxes.map(|v| v.to_string())),
            part("cpus", q.cpus.map(|v| v.to_string())),
            part("memory_mib", q.memory_mib.map(|v| v.to_string())),
            part("creates_per_sec", q.creates_per_sec.map(|v| v.to_string())),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() {
            "unlimited".to_string()
        } else {
            parts.join(",")
        }
    };
    format!(
        "{}\t{}\t{}\tquota {}\tusing sandboxes={},cpus={},memory_mib={}",
        p.id,
        p.name,
        p.parent.as_deref().unwrap_or("-"),
        quota(&p.quota),
        p.usage.sandboxes,
        p.usage.cpus,
        p.usage.memory_mib
    )
}

pub async fn run_project(client: &Client, json: bool, cmd: &ProjectCmd) -> Result<()> {
    match cmd {
        ProjectCmd::Create { name, parent, sandboxes, cpus, memory_mib, creates_per_sec } => {
            let req = CreateProjectRequest {
                name: name.clone(),
                parent: parent.clone(),
                quota: Quota {
                    sandboxes: *sandboxes,
                    cpus: *cpus,
                    memory_mib: *memory_mib,
                    creates_per_sec: *creates_per_sec,
                },
            };
            print(json, &client.create_project(&req).await?, |p| p.id.clone())
        }
        ProjectCmd::Ls => print(json, &client.projects().await?, |l| {
            l.projects.iter().map(project_line).collect::<Vec<_>>().join("\n")
        }),
        ProjectCmd::Get { id } => {
            print(json, &client.project(id).await?, |p| serde_json::to_string_pretty(p).unwrap_or_default())
        }
    }
    Ok(())
}

pub async fn run_key(client: &Client, json: bool, cmd: &KeyCmd) -> Result<()> {
    match cmd {
        KeyCmd::Create { project, name } => {
            let project = match project {
                Some(p) => p.clone(),
                // The key's own project is the first one it lists (its path is the shortest).
                None => client
                    .projects()
                    .await?
                    .projects
                    .into_iter()
                    .min_by_key(|p| p.path.len())
                    .map(|p| p.id)
                    .unwrap_or_else(|| ROOT_PROJECT.to_string()),
            };
            let made = client.create_key(&project, &CreateKeyRequest { name: name.clone() }).await?;
            print(json, &made, |k| k.secret.clone())
        }
        KeyCmd::Rm { ids } => {
            for id in ids {
                print(json, &client.delete_key(id).await?, |k| format!("revoked {} ({})", k.id, k.project))
            }
        }
    }
    Ok(())
}
