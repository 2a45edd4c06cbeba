//! A microVM restored from a snapshot of a booted guest is a clone: its
//! hostname, its random state and its wall clock are the snapshot's. The
//! node's `Identify` request gives it its own (see
//! [`warren_init::proto::Request::Identify`]).
//!
//! PID 1 runs under the sandbox's seccomp profile, which refuses
//! `sethostname`, `clock_settime` and nothing less privileged does these
//! jobs. So one thread is started *before* the filter is installed (as the
//! seccomp supervisor is) and does them on request: the filter never
//! applies to it, and it does nothing but these three calls with what the
//! node sent.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

/// `_IOW('R', 0x03, int[2])`: add bytes to the input pool and credit them.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// Bounds what one request may ask of the thread.
const MAX_ENTROPY_BYTES: usize = 512;
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
const STACK_BYTES: usize = 64 * 1024;

struct Job {
    hostname: String,
    entropy: Vec<u8>,
    unix_time_ns: u64,
    answer: SyncSender<Result<(), String>>,
}

static JOBS: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();

/// Starts the unfiltered identity thread; call before the seccomp filter.
pub fn start() -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new().name("identity".into()).stack_size(STACK_BYTES).spawn(move || serve(rx))?;
    let _ = JOBS.set(Mutex::new(tx));
    Ok(())
}

/// Applies the identity; `Err` says why not (also outside a microVM).
pub fn identify(hostname: String, entropy: Vec<u8>, unix_time_ns: u64) -> Result<(), String> {
    if hostname.is_empty() || hostname.len() > 64 || !hostname.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(format!("bad hostname `{hostname}`"));
    }
    if entropy.len() < 16 || entropy.len() > MAX_ENTROPY_BYTES {
        return Err(format!("entropy must be 16 to {MAX_ENTROPY_BYTES} bytes"));
    }
    let jobs = JOBS.get().ok_or("identify is for a microVM's init")?;
    let (answer, answered) = mpsc::sync_channel(1);
    let job = Job { hostname, entropy, unix_time_ns, answer };
    jobs.lock().unwrap_or_else(PoisonError::into_inner).send(job).map_err(|_| "the identity thread is gone")?;
    answered.recv_timeout(ANSWER_TIMEOUT).map_err(|_| "the identity thread did not answer".to_string())?
}

fn serve(jobs: Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        let result = apply(&job);
        let _ = job.answer.send(result);
    }
}

fn apply(job: &Job) -> Result<(), String> {
    rustix::system::sethostname(job.hostname.as_bytes()).map_err(|e| format!("sethostname: {e}"))?;
    reseed(&job.entropy)?;
    let ts = libc::timespec {
        tv_sec: (job.unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (job.unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec on the stack for the call's duration.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(format!("clock_settime: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Mixes `entropy` into the input pool, credited in full (the node read it
/// from its own kernel's CRNG), then forces the CRNG to rekey from the pool:
/// crediting alone would leave the old key (the snapshot's) in use until
/// the next scheduled reseed, up to a minute away.
fn reseed(entropy: &[u8]) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let urandom =
        std::fs::OpenOptions::new().write(true).open("/dev/urandom").map_err(|e| format!("open /dev/urandom: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len().next_multiple_of(4));
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(8 + entropy.len().next_multiple_of(4), 0);
    // SAFETY: `info` holds a complete rand_pool_info whose buf_size matches
    // the bytes after its header; the kernel only reads it.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } != 0 {
        return Err(format!("RNDADDENTROPY: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(format!("RNDRESEEDCRNG: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}
