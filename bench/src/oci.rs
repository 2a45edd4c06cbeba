//! OCI bundles for runc and crun: `runc spec`'s default config with the
//! shared rootfs, a non-terminal process and the benchmark's argv.

use std::fs;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::cmd;
use crate::error::{BenchError, Result};

/// Makes `bundle/config.json` from `runc spec`, running `args` in `rootfs`.
pub fn make_bundle(bundle: &Path, rootfs: &Path, args: &[&str]) -> Result<()> {
    fs::create_dir_all(bundle).map_err(|e| BenchError::io("mkdir", bundle, e))?;
    let config_path = bundle.join("config.json");
    // `runc spec` refuses to overwrite; a re-run starts from a fresh default.
    let _ = fs::remove_file(&config_path);
    cmd::run(Command::new("runc").arg("spec").arg("--bundle").arg(bundle))?;
    let text = fs::read_to_string(&config_path).map_err(|e| BenchError::io("read", &config_path, e))?;
    let mut config: Value = serde_json::from_str(&text).map_err(|e| BenchError::parse("runc spec output", e))?;
    edit_config(&mut config, rootfs, args)?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| BenchError::parse("bundle config", e))?;
    fs::write(&config_path, text).map_err(|e| BenchError::io("write", &config_path, e))
}

/// Points the config at `rootfs` (read-only, shared by every container),
/// sets the argv and turns the terminal off so no console socket is needed.
pub fn edit_config(config: &mut Value, rootfs: &Path, args: &[&str]) -> Result<()> {
    let bad = |what: &str| BenchError::parse("runc spec output", format!("no `{what}` object"));
    let root = config.get_mut("root").and_then(Value::as_object_mut).ok_or_else(|| bad("root"))?;
    root.insert("path".into(), Value::String(rootfs.to_string_lossy().into_owned()));
    root.insert("readonly".into(), Value::Bool(true));
    let process = config.get_mut("process").and_then(Value::as_object_mut).ok_or_else(|| bad("process"))?;
    process.insert("terminal".into(), Value::Bool(false));
    process.insert("args".into(), Value::Array(args.iter().map(|a| Value::String((*a).into())).collect()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_gets_rootfs_argv_and_no_terminal() {
        let mut c: Value = serde_json::from_str(
            r#"{"ociVersion":"1.0.2-dev","process":{"terminal":true,"args":["sh"],"cwd":"/"},
                "root":{"path":"rootfs","readonly":true},"hostname":"runc"}"#,
        )
        .unwrap();
        edit_config(&mut c, Path::new("/srv/rootfs"), &["sleep", "1d"]).unwrap();
        assert_eq!(c["root"]["path"], "/srv/rootfs");
        assert_eq!(c["root"]["readonly"], true);
        assert_eq!(c["process"]["terminal"], false);
        assert_eq!(c["process"]["args"], serde_json::json!(["sleep", "1d"]));
        assert_eq!(c["process"]["cwd"], "/");
    }

    #[test]
    fn a_config_without_process_is_rejected() {
        let mut c = serde_json::json!({"root": {"path": "rootfs"}});
        assert!(edit_config(&mut c, Path::new("/r"), &["true"]).is_err());
    }

    #[test]
    fn runc_spec_makes_a_usable_bundle() {
        let tmp = tempfile::tempdir().unwrap();
        make_bundle(&tmp.path().join("b"), Path::new("/srv/rootfs"), &["true"]).unwrap();
        let c: Value = serde_json::from_str(&fs::read_to_string(tmp.path().join("b/config.json")).unwrap()).unwrap();
        assert_eq!(c["process"]["args"], serde_json::json!(["true"]));
        assert_eq!(c["root"]["path"], "/srv/rootfs");
    }
}
