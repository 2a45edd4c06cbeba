//! Shell sessions: after a session command, the shell's working directory
//! and exported environment go back to the host, without touching the
//! command's stdout or stderr and without any binary of the image but
//! `/bin/sh` itself.
//!
//! Design. For `["/bin/sh", "-c", CMD]` init runs `/bin/sh -c SCRIPT` with
//!
//! ```sh
//! { CMD
//! } 3>&- 4>&-
//! __warren_rc=$?
//! exec /proc/self/fd/4 report-state "$__warren_rc"
//! ```
//!
//! and two extra descriptors in the shell: fd 3, the write end of a pipe
//! whose read end init keeps, and fd 4, an `O_RDONLY` descriptor of the
//! warren-init executable itself (opened from the host's filesystem before
//! `pivot_root`). CMD runs with both closed, so neither it nor anything it
//! starts in the background sees them. Then the shell execs init's binary
//! through fd 4 in "report-state" mode (`argv[1]`): it inherits exactly the
//! shell's cwd and exported environment, writes `{cwd, env, rc}` as JSON to
//! fd 3 and exits with `rc`, so CMD's exit status is the exec's.
//!
//! The newline before `}` keeps a trailing comment in CMD from eating the
//! brace. If CMD calls `exit` (or `exec`), the shell never reaches the
//! report and the exec has no session state: that is accepted. CMD can also
//! write to the state pipe through the shell's saved copies of fd 3 and so
//! forge its own session's state; it only ever fools itself.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::FromRawFd;

use serde::{Deserialize, Serialize};
use warren_init::proto::SessionState;

/// `argv[1]` that selects report-state mode.
pub const REPORT_STATE_ARG: &str = "report-state";
/// Where the session shell (and then report-state mode) finds the pipe.
pub const STATE_FD: i32 = 3;
/// Where the session shell finds warren-init's executable.
pub const EXE_FD: i32 = 4;
/// Never exported as session state: the wrapper's own variable.
const RC_VAR: &str = "__warren_rc";
/// The shell the host must ask for; it is also what init runs.
pub const SHELL: &str = "/bin/sh";

/// What report-state mode sends back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportedState {
    pub cwd: String,
    pub env: BTreeMap<String, String>,
    pub rc: i32,
}

/// CMD of a session exec's argv, which must be `["/bin/sh", "-c", CMD]`.
pub fn shell_command(argv: &[String]) -> Option<&str> {
    match argv {
        [sh, c, cmd] if sh == SHELL && c == "-c" => Some(cmd),
        _ => None,
    }
}

/// The script the session shell runs around `cmd` (see the module doc).
pub fn wrap_command(cmd: &str) -> String {
    format!(
        "{{ {cmd}\n}} {STATE_FD}>&- {EXE_FD}>&-\n{RC_VAR}=$?\nexec /proc/self/fd/{EXE_FD} {REPORT_STATE_ARG} \"${RC_VAR}\"\n"
    )
}

/// Parses what report-state mode wrote; `None` for anything else.
pub fn parse_state(bytes: &[u8]) -> Option<SessionState> {
    let reported: ReportedState = serde_json::from_slice(bytes).ok()?;
    Some(SessionState { cwd: reported.cwd, env: reported.env })
}

/// The environment as a session sees it: UTF-8 variables only, without
/// the wrapper's own.
fn session_env(vars: impl IntoIterator<Item = (OsString, OsString)>) -> BTreeMap<String, String> {
    vars.into_iter()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k != RC_VAR)
        .collect()
}

/// Report-state mode: runs inside the sandbox as the session shell's
/// replacement, so it must not do anything but report and exit.
pub fn report_state_main(mut args: impl Iterator<Item = OsString>) -> ! {
    let rc = args.next().and_then(|a| a.into_string().ok()).and_then(|a| a.parse::<i32>().ok()).unwrap_or(1);
    let cwd = std::env::current_dir()
        .ok()
        .and_then(|p| p.into_os_string().into_string().ok())
        .or_else(|| std::env::var("PWD").ok())
        .unwrap_or_default();
    let state = ReportedState { cwd, env: session_env(std::env::vars_os()), rc };
    if let Ok(json) = serde_json::to_vec(&state) {
        // SAFETY: the session shell handed this process fd STATE_FD as the
        // write end of init's state pipe; nothing else here owns it.
        let mut pipe = unsafe { std::fs::File::from_raw_fd(STATE_FD) };
        let _ = pipe.write_all(&json);
    }
    std::process::exit(rc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bin_sh_dash_c_is_a_session_command() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(shell_command(&argv(&["/bin/sh", "-c", "cd /tmp"])), Some("cd /tmp"));
        assert_eq!(shell_command(&argv(&["sh", "-c", "x"])), None);
        assert_eq!(shell_command(&argv(&["/bin/sh", "-e", "x"])), None);
        assert_eq!(shell_command(&argv(&["/bin/sh", "-c"])), None);
    }

    #[test]
    fn wrapper_closes_the_extra_fds_around_cmd_and_keeps_its_status() {
        let script = wrap_command("echo hi # trailing comment");
        assert_eq!(
            script,
            "{ echo hi # trailing comment\n} 3>&- 4>&-\n__warren_rc=$?\nexec /proc/self/fd/4 report-state \"$__warren_rc\"\n"
        );
    }

    #[test]
    fn state_round_trips_and_drops_the_wrapper_variable() {
        let env = session_env([
            (OsString::from("FOO"), OsString::from("bar")),
            (OsString::from(RC_VAR), OsString::from("0")),
        ]);
        assert_eq!(env, BTreeMap::from([("FOO".to_string(), "bar".to_string())]));
        let json = serde_json::to_vec(&ReportedState { cwd: "/tmp".into(), env: env.clone(), rc: 3 }).unwrap();
        assert_eq!(parse_state(&json), Some(SessionState { cwd: "/tmp".into(), env }));
        assert_eq!(parse_state(b"{\"cwd\": 1}"), None);
        assert_eq!(parse_state(b""), None);
    }
}
