//! Links the `warren-init` binary statically (static-pie) with glibc, on
//! the ordinary gnu target, without touching how anything else is built.
//!
//! Why this way: `-C target-feature=+crt-static` cannot be scoped to one
//! binary (RUSTFLAGS would reach every crate, and proc-macros cannot be
//! built with it), and the musl target is not available. A plain
//! `-static-pie` link argument is not enough either: rustc still asks for
//! `-Bdynamic -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc`, which pulls the
//! shared libraries back in. So for the bins of this package only, a
//! directory of linker scripts named like those shared libraries is put
//! first on the search path; each script just names the static archive
//! (`libgcc_s.so` -> `libgcc_eh.a`, `libc.so` -> `libc.a`, ...). Tests,
//! the library half and every other crate link as usual.

use std::error::Error;
use std::path::PathBuf;
use std::process::Command;

/// (library rustc asks for, static archive that replaces it).
const STATIC_REPLACEMENTS: &[(&str, &str)] = &[
    ("gcc_s", "libgcc_eh.a"),
    ("util", "libutil.a"),
    ("rt", "librt.a"),
    ("pthread", "libpthread.a"),
    ("m", "libm.a"),
    ("dl", "libdl.a"),
    ("c", "libc.a"),
];

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CC");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS")?;
    let target_env = std::env::var("CARGO_CFG_TARGET_ENV")?;
    if target_os != "linux" || target_env != "gnu" {
        return Ok(());
    }
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = PathBuf::from(std::env::var("OUT_DIR")?).join("static-libs");
    std::fs::create_dir_all(&dir)?;
    for (library, archive) in STATIC_REPLACEMENTS {
        let path = archive_path(&compiler, archive)?;
        std::fs::write(dir.join(format!("lib{library}.so")), format!("INPUT({path})\n"))?;
    }
    println!("cargo:rustc-link-arg-bins=-static-pie");
    println!("cargo:rustc-link-arg-bins=-L{}", dir.display());
    Ok(())
}

/// Where the C toolchain keeps `archive`; an error when it has none (the
/// static glibc comes with `libc6-dev`).
fn archive_path(compiler: &str, archive: &str) -> Result<String, Box<dyn Error>> {
    let out = Command::new(compiler).arg(format!("-print-file-name={archive}")).output()?;
    let path = String::from_utf8(out.stdout)?.trim().to_string();
    // The compiler echoes the bare name back when it finds nothing.
    if !out.status.success() || !path.starts_with('/') {
        return Err(
            format!("{compiler} cannot find {archive}: warren-init links statically (install libc6-dev)").into()
        );
    }
    Ok(path)
}
