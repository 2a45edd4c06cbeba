//! Compiles the eBPF egress programs with clang; the object is embedded
//! into the crate with `include_bytes!`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "bpf/egress.bpf.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("egress.bpf.o");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let status = Command::new(&clang)
        .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror", "-I/usr/include/x86_64-linux-gnu", "-c", src, "-o"])
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{clang} failed on {src} ({s}); the headers come from Debian's libbpf-dev and linux-libc-dev"),
        Err(e) => panic!("cannot run {clang} ({e}): install clang (scripts/setup-host.sh does)"),
    }
}
