//! `warren image ...`: import, pull, push, compose, inspect, remove, gc and
//! statistics. Transfers the server runs show a spinner with the elapsed
//! time; an upload the CLI streams itself shows bytes and rate.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Subcommand, ValueEnum};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use warren_api::*;

use crate::client::Client;
use crate::print;

#[derive(Subcommand)]
pub enum ImageCmd {
    /// List images: name, format, layers, size.
    Ls,
    /// Lazy-loading statistics: per cached layer, and the blob store's
    /// counters; or, with `--sandbox`, what one sandbox's reads cost.
    Stats {
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Import a root filesystem directory (or an OCI layout / docker save
    /// tarball) on the server's machine.
    ImportDir {
        name: String,
        dir: PathBuf,
        /// `dir` (layer directories), `erofs` (lazily loaded EROFS layers),
        /// `oci_layout` or `docker_save` (`dir` is then the tarball).
        #[arg(long, default_value = "dir")]
        format: String,
        /// Role of the imported layers (layered formats; default base).
        #[arg(long, value_enum)]
        role: Option<RoleArg>,
    },
    /// Import a tar stream (a file, or `-` for stdin).
    ImportTar { name: String, tar: String },
    /// Pull an image from an OCI registry (run by the server).
    Pull {
        /// `registry/repository:tag` or `registry/repository@sha256:...`.
        reference: String,
        /// Local name (default: the repository's last path segment).
        #[arg(long)]
        name: Option<String>,
        /// Plain HTTP to a registry not on loopback.
        #[arg(long)]
        insecure: bool,
        /// Role of the pulled layers (default base; a Warren-pushed image keeps its own).
        #[arg(long, value_enum)]
        role: Option<RoleArg>,
        #[command(flatten)]
        login: LoginArgs,
    },
    /// Push a layered image to an OCI registry (its EROFS layers, as a Warren artifact).
    Push {
        name: String,
        reference: String,
        #[arg(long)]
        insecure: bool,
        #[command(flatten)]
        login: LoginArgs,
    },
    /// Make image NAME from existing layers, bottom first. Each entry is
    /// `IMAGE` (all its layers), `IMAGE/ROLE` (its layers of that role) or
    /// `LAYER@VERSION`. Copies no data.
    Compose {
        name: String,
        #[arg(required = true)]
        entries: Vec<String>,
    },
    /// Show an image's layers: role, digest, size, chunks.
    Inspect { name: String },
    /// Remove images (refused while sandboxes use them).
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Delete layers, chunks and cached layer files no image references.
    Gc,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum RoleArg {
    Base,
    Workspace,
    Toolkit,
}

impl From<RoleArg> for ImageLayerRole {
    fn from(r: RoleArg) -> Self {
        match r {
            RoleArg::Base => ImageLayerRole::Base,
            RoleArg::Workspace => ImageLayerRole::Workspace,
            RoleArg::Toolkit => ImageLayerRole::Toolkit,
        }
    }
}

/// A spinner with the elapsed time while the server works; hidden with
/// `--json` (and by indicatif when stderr is not a terminal).
fn spinner(json: bool, message: String) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner().with_message(message);
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bytes/rate bar over an upload of `total` bytes (a spinner when the
/// size is unknown).
fn transfer_bar(json: bool, total: Option<u64>) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let (bar, template) = match total {
        Some(len) => (
            ProgressBar::new(len),
            "{bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta} [{elapsed}]",
        ),
        None => (ProgressBar::new_spinner(), "{spinner} {binary_bytes} {binary_bytes_per_sec} [{elapsed}]"),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// The tar stream to upload, counted into `bar` as it is read.
async fn counted_body(local: &str, json: bool) -> Result<(reqwest::Body, ProgressBar)> {
    if local == "-" {
        let bar = transfer_bar(json, None);
        let counter = bar.clone();
        let stream = tokio_util::io::ReaderStream::new(tokio::io::stdin()).inspect(move |chunk| {
            if let Ok(bytes) = chunk {
                counter.inc(bytes.len() as u64);
            }
        });
        return Ok((reqwest::Body::wrap_stream(stream), bar));
    }
    let file = tokio::fs::File::open(local).await.with_context(|| format!("cannot open {local}"))?;
    let len = file.metadata().await.ok().map(|m| m.len());
    let bar = transfer_bar(json, len);
    let counter = bar.clone();
    let stream = tokio_util::io::ReaderStream::new(file).inspect(move |chunk| {
        if let Ok(bytes) = chunk {
            counter.inc(bytes.len() as u64);
        }
    });
    Ok((reqwest::Body::wrap_stream(stream), bar))
}

fn compose_entry(entry: &str) -> Result<ComposeLayer> {
    if entry.contains('@') {
        return Ok(ComposeLayer::Layer { layer: entry.to_string() });
    }
    let Some((image, role)) = entry.split_once('/') else {
        return Ok(ComposeLayer::Image { image: entry.to_string(), role: None });
    };
    let role = match role {
        "base" => ImageLayerRole::Base,
        "workspace" => ImageLayerRole::Workspace,
        "toolkit" => ImageLayerRole::Toolkit,
        "diff" => ImageLayerRole::Diff,
        "other" => ImageLayerRole::Other,
        other => bail!("`{entry}`: unknown role `{other}` (base, workspace, toolkit, diff, other)"),
    };
    Ok(ComposeLayer::Image { image: image.to_string(), role: Some(role) })
}

fn role_name(role: Option<ImageLayerRole>) -> String {
    role.and_then(|r| serde_json::to_value(r).ok()).and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

fn detail_text(d: &ImageDetail) -> String {
    let mut lines = vec![format!("{}  ({:?}, {} layers, bottom first)", d.name, d.storage, d.layers.len())];
    for l in &d.layers {
        match (&l.digest, l.size_bytes, l.chunk_count) {
            (Some(digest), Some(size), Some(chunks)) => lines.push(format!(
                "  {:<10} {}  {}  {} bytes  {} chunks",
                role_name(l.role),
                l.id,
                &digest[..digest.len().min(19)],
                size,
                chunks
            )),
            _ => lines.push(format!("  {}", l.id)),
        }
    }
    if let Some(c) = &d.config {
        let words = |w: &[String]| serde_json::to_string(w).unwrap_or_default();
        lines.push("config:".to_owned());
        lines.extend(c.env.iter().map(|e| format!("  env         {e}")));
        if !c.entrypoint.is_empty() {
            lines.push(format!("  entrypoint  {}", words(&c.entrypoint)));
        }
        if !c.cmd.is_empty() {
            lines.push(format!("  cmd         {}", words(&c.cmd)));
        }
        lines.extend(c.working_dir.iter().map(|w| format!("  workdir     {w}")));
        lines.extend(c.user.iter().map(|u| format!("  user        {u} (not applied)")));
    }
    lines.join("\n")
}

pub async fn run(client: &Client, json: bool, cmd: &ImageCmd) -> Result<()> {
    match cmd {
        ImageCmd::Ls => print(json, &client.images().await?, |l| {
            l.images.iter().map(|i| format!("{}  {} layer(s)", i.name, i.layers.len())).collect::<Vec<_>>().join("\n")
        }),
        ImageCmd::Stats { sandbox: None } => print(json, &client.image_stats().await?, stats_text),
        ImageCmd::Stats { sandbox: Some(id) } => print(json, &client.sandbox_image_stats(id).await?, |s| {
            format!(
                "{}: {} bytes accessed, {} bytes fetched in {} chunks, {} cache hits ({} fill events)",
                s.sandbox_id, s.bytes_accessed, s.bytes_fetched, s.chunks_fetched, s.cache_hits, s.fill_events
            )
        }),
        ImageCmd::ImportDir { name, dir, format, role } => {
            let dir = std::fs::canonicalize(dir).with_context(|| format!("no such path {}", dir.display()))?;
            let bar = spinner(json, format!("importing {}", dir.display()));
            let info = client.import_dir(name, &dir.to_string_lossy(), format, role.map(Into::into)).await;
            bar.finish_and_clear();
            print(json, &info?, |i| format!("imported {} ({} layers)", i.name, i.layers.len()))
        }
        ImageCmd::ImportTar { name, tar } => {
            let (body, bar) = counted_body(tar, json).await?;
            let info = client.import_tar(name, body).await;
            bar.finish_and_clear();
            print(json, &info?, |i| format!("imported {}", i.name))
        }
        ImageCmd::Pull { reference, name, insecure, role, login } => {
            let req = PullImageRequest {
                reference: reference.clone(),
                name: name.clone(),
                insecure: *insecure,
                role: role.map(Into::into),
                auth: login.auth(reference)?,
            };
            let bar = spinner(json, format!("pulling {reference}"));
            let info = client.pull_image(&req).await;
            bar.finish_and_clear();
            print(json, &info?, |i| format!("pulled {} as {} ({} layers)", reference, i.name, i.layers.len()))
        }
        ImageCmd::Push { name, reference, insecure, login } => {
            let req =
                PushImageRequest { reference: reference.clone(), insecure: *insecure, auth: login.auth(reference)? };
            let bar = spinner(json, format!("pushing {name} to {reference}"));
            let pushed = client.push_image(name, &req).await;
            bar.finish_and_clear();
            print(json, &pushed?, |p| format!("pushed {} as {} ({} layer bytes)", p.name, p.reference, p.layer_bytes))
        }
        ImageCmd::Compose { name, entries } => {
            let layers = entries.iter().map(|e| compose_entry(e)).collect::<Result<Vec<_>>>()?;
            let info = client.compose_image(&ComposeImageRequest { name: name.clone(), layers }).await?;
            print(json, &info, |i| format!("composed {}: {}", i.name, i.layers.join(" ")))
        }
        ImageCmd::Inspect { name } => print(json, &client.inspect_image(name).await?, detail_text),
        ImageCmd::Rm { names } => {
            for name in names {
                client.remove_image(name).await?;
                print(json, &serde_json::json!({ "removed": name }), |_| format!("removed {name}"));
            }
        }
        ImageCmd::Gc => print(json, &client.gc_images().await?, |r| {
            format!(
                "removed {} layers, {} chunks, {} cached layer files; {} bytes freed",
                r.layers_removed, r.chunks_removed, r.cached_layers_removed, r.bytes_freed
            )
        }),
    }
    Ok(())
}

/// Registry credentials of a pull or push, sent to the server with the
/// request: `--username` with the password on stdin, else the entry for
/// the registry host in `--docker-config` (default
/// `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`), else none.
#[derive(clap::Args, Debug, Clone)]
pub struct LoginArgs {
    /// Registry username; the password is read from stdin (one line).
    #[arg(long, requires = "password_stdin")]
    username: Option<String>,
    /// Read the registry password from stdin.
    #[arg(long, requires = "username")]
    password_stdin: bool,
    /// A Docker-style config.json to take the registry's credentials from.
    #[arg(long, conflicts_with = "username")]
    docker_config: Option<PathBuf>,
}

impl LoginArgs {
    fn auth(&self, reference: &str) -> Result<Option<RegistryAuth>> {
        if let Some(username) = &self.username {
            let mut password = String::new();
            std::io::stdin().read_line(&mut password).context("reading the password from stdin")?;
            let password = password.trim_end_matches(['\n', '\r']).to_owned();
            return Ok(Some(RegistryAuth { username: username.clone(), password }));
        }
        let default_config = || {
            let dir = std::env::var_os("DOCKER_CONFIG")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker")))?;
            Some(dir.join("config.json"))
        };
        let Some(path) = self.docker_config.clone().or_else(default_config) else { return Ok(None) };
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            // Only a file named on the command line must exist.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.docker_config.is_none() => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let host = warren_image::registry::registry_host(reference)?;
        let found = warren_image::docker_config::credentials_for(&bytes, &host)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(found.map(|c| RegistryAuth { username: c.username, password: c.password }))
    }
}

fn stats_text(st: &ImageStats) -> String {
    let mut lines: Vec<String> = st
        .layers
        .iter()
        .map(|l| {
            format!(
                "{}  {} of {} bytes local, {} fetched, {} leases; trace: {} units, {} replayed ({} bytes), {} refused, stored {}x; completion: {} units ({} bytes), {} refused{}",
                &l.digest[..l.digest.len().min(19)],
                l.present_bytes,
                l.size_bytes,
                l.bytes_fetched,
                l.leases,
                l.traced_units,
                l.trace_units_replayed,
                l.trace_bytes_replayed,
                l.failed_trace_units,
                l.traces_published,
                l.completion_units,
                l.completion_bytes,
                l.failed_completion_units,
                if l.completion_running > 0 { ", running" } else { "" }
            )
        })
        .collect();
    lines.push(format!(
        "store: {} chunks and {} pieces in {} ranged GETs fetched ({} bytes), {} uploaded, {} deduplicated",
        st.store.chunks_fetched,
        st.store.pieces_fetched,
        st.store.range_requests,
        st.store.bytes_fetched,
        st.store.chunks_uploaded,
        st.store.chunks_deduplicated
    ));
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compose_entries_name_images_roles_or_layers() {
        assert_eq!(compose_entry("py").unwrap(), ComposeLayer::Image { image: "py".into(), role: None });
        assert_eq!(
            compose_entry("py/workspace").unwrap(),
            ComposeLayer::Image { image: "py".into(), role: Some(ImageLayerRole::Workspace) }
        );
        assert_eq!(compose_entry("py.layer0@17").unwrap(), ComposeLayer::Layer { layer: "py.layer0@17".into() });
        assert!(compose_entry("py/bogus").is_err());
    }
}
