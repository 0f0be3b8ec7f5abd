//! Each task's keeper: a small process between the agent and the task that
//! outlives the agent. It does two things the agent cannot promise while it
//! is down, frozen or cut off:
//!
//! 1. **Fencing.** The agent writes its node lease to one lease file after
//!    every heartbeat the server answered: when to signal and when to kill.
//!    Every keeper reads it every 100 ms; once the kill time passes it kills
//!    its task whole, so a node that cannot renew its lease has stopped its
//!    work before the server's lease expires and the work is placed
//!    elsewhere. A SIGSTOPped or crashed agent cannot keep its tasks
//!    running past the lease.
//!
//!    "Whole" means every process the task started, also those that left
//!    its process group (`setsid`, a double fork: `ray start`, `jupyter`):
//!    through the task's cgroup (v2's `cgroup.kill`; on v1 each process of
//!    `cgroup.procs`, frozen first by the freezer so none forks meanwhile),
//!    and, as a second line that needs no cgroup, as the task's child
//!    subreaper: whatever the task's tree orphans becomes the keeper's
//!    child, and the keeper kills its children until none is left. The
//!    same happens when the task ends by itself: none of its processes
//!    outlives it.
//! 2. **The true exit status.** It waits for the task and writes how it
//!    ended to an exit record the task cannot reach, so an agent that
//!    restarts learns how a task it did not start (or that ended while it
//!    was down) ended.
//!
//! The keeper is the process group leader (the task is its child, in the
//! same group); it ignores the stop signals the agent sends the group and
//! dies with SIGKILL like the rest of it. It is forked from the task's
//! launcher before exec, so it runs only async-signal-safe code on memory
//! prepared before the fork.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Milliseconds on the boot clock (counts suspend, never jumps).
pub fn boot_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into `ts`; CLOCK_BOOTTIME always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The lease record: `TERM KILL TERM KILL\n`, two 20-digit boot-clock
/// times in milliseconds (0: no deadline), written twice in one write, so
/// that a read torn between an old and a new record is recognised (its
/// halves differ) and skipped.
const LEASE_LEN: usize = 84;

fn lease_record(term_ms: u64, kill_ms: u64) -> [u8; LEASE_LEN] {
    let text = format!("{term_ms:020} {kill_ms:020} {term_ms:020} {kill_ms:020}\n");
    let mut out = [0u8; LEASE_LEN];
    out.copy_from_slice(text.as_bytes());
    out
}

/// The node's lease as the agent keeps it: one file, rewritten in place (the
/// keepers hold it open, so it is never replaced).
pub struct Lease {
    file: File,
}

impl Lease {
    /// Opens (or creates, with no deadline) the lease file in `dir`. An
    /// existing file keeps its deadline: keepers left by a previous agent
    /// go on counting from the last renewal.
    ///
    /// # Errors
    /// When the file cannot be opened or created.
    pub fn open(dir: &Path) -> std::io::Result<Lease> {
        let path = dir.join("lease");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        if file.metadata()?.len() != LEASE_LEN as u64 {
            file.set_len(0)?;
            file.write_all_at(&lease_record(0, 0), 0)?;
        }
        Ok(Lease { file })
    }

    /// Renews the lease: tasks are signalled at `term_ms` and killed at
    /// `kill_ms` on the boot clock unless it is renewed again.
    pub fn renew(&self, term_ms: u64, kill_ms: u64) {
        if let Err(e) = self.file.write_all_at(&lease_record(term_ms, kill_ms), 0) {
            tracing::warn!(error = %e, "cannot renew the lease file");
        }
    }

    pub fn file(&self) -> &File {
        &self.file
    }
}

/// How a task ended, as its keeper recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Exited by itself with this code.
    Exited(i32),
    /// Killed by this signal.
    Signalled(i32),
    /// Killed by its keeper: the node's lease ran out.
    Fenced,
}

/// Reads an exit record; `None` when there is none (the task still runs,
/// or its keeper was killed before it could write one).
pub fn read_exit(path: &Path) -> Option<Ended> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut words = text.split_whitespace();
    let kind = words.next()?;
    let n = words.next().and_then(|w| w.parse::<i32>().ok());
    match (kind, n) {
        ("x", Some(c)) => Some(Ended::Exited(c)),
        ("s", Some(s)) => Some(Ended::Signalled(s)),
        ("f", _) => Some(Ended::Fenced),
        _ => None,
    }
}

/// Creates the exit record file, empty, for the keeper to fill.
///
/// # Errors
/// When it cannot be created.
pub fn create_exit(path: &Path) -> std::io::Result<File> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.flush()?;
    Ok(f)
}

/// Parses a 20-digit decimal field; `None` on anything else.
fn digits(b: &[u8]) -> Option<u64> {
    let mut v: u64 = 0;
    for &c in b {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
    }
    Some(v)
}

/// The lease deadlines in a record, if it is whole.
fn parse_lease(buf: &[u8; LEASE_LEN]) -> Option<(u64, u64)> {
    let half = LEASE_LEN / 2;
    if buf[..half - 1] != buf[half..LEASE_LEN - 1] || buf[20] != b' ' || buf[half - 1] != b' ' {
        return None;
    }
    Some((digits(&buf[0..20])?, digits(&buf[21..41])?))
}

/// Where the keeper reaches every process of its task, prepared before the
/// fork (the keeper allocates nothing).
#[derive(Debug)]
pub struct Reach {
    /// v2's `cgroup.kill` of the task's group, open for writing.
    pub cgroup_kill: Option<File>,
    /// v1: the task group's `cgroup.procs` in one hierarchy.
    pub procs: Option<std::ffi::CString>,
    /// v1: the task group's `freezer.state`.
    pub freezer: Option<std::ffi::CString>,
}

impl Reach {
    /// No cgroup: the keeper reaches the task's tree as its subreaper only.
    pub fn none() -> Reach {
        Reach {
            cgroup_kill: None,
            procs: None,
            freezer: None,
        }
    }
}

/// Calls `f` with each pid listed in the file at `path` (one number a
/// line or a space apart: `cgroup.procs`, `/proc/thread-self/children`);
/// returns how many. Async-signal-safe: open, read and close on a stack
/// buffer.
///
/// # Safety
/// `path` must point to a NUL-terminated string.
unsafe fn each_pid(path: *const libc::c_char, mut f: impl FnMut(libc::pid_t)) -> usize {
    // SAFETY: plain system calls on a stack buffer.
    unsafe {
        let fd = libc::open(path, libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return 0;
        }
        let mut buf = [0u8; 4096];
        let (mut n, mut cur, mut in_number) = (0usize, 0 as libc::pid_t, false);
        loop {
            let r = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            if r <= 0 {
                break;
            }
            for &c in &buf[..r as usize] {
                if c.is_ascii_digit() {
                    cur = cur
                        .saturating_mul(10)
                        .saturating_add((c - b'0') as libc::pid_t);
                    in_number = true;
                } else if in_number {
                    f(cur);
                    n += 1;
                    (cur, in_number) = (0, false);
                }
            }
        }
        if in_number {
            f(cur);
            n += 1;
        }
        libc::close(fd);
        n
    }
}

/// Writes `value` to the file at `path`; async-signal-safe.
///
/// # Safety
/// `path` must point to a NUL-terminated string.
unsafe fn write_path(path: *const libc::c_char, value: &[u8]) {
    // SAFETY: plain system calls.
    unsafe {
        let fd = libc::open(path, libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
        }
    }
}

fn pause_ms(ms: i64) {
    let pause = libc::timespec {
        tv_sec: 0,
        tv_nsec: ms * 1_000_000,
    };
    // SAFETY: nanosleep reads `pause` only.
    unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
}

/// Sends `sig` to every process of the task the keeper can reach: its
/// process group (the keeper ignores the stop signals), its cgroup, and
/// the keeper's children (the task and what its tree orphaned).
///
/// # Safety
/// Only in the keeper; async-signal-safe.
unsafe fn signal_all(reach: &Reach, sig: i32) {
    // SAFETY: kill(2) and the helpers above, on prepared paths.
    unsafe {
        libc::kill(0, sig);
        // Once each: what is in the group had it already.
        let group = libc::getpgid(0);
        let outside = |pid: libc::pid_t| {
            if libc::getpgid(pid) != group {
                libc::kill(pid, sig);
            }
        };
        if let Some(p) = &reach.procs {
            each_pid(p.as_ptr(), outside);
        }
        each_pid(c"/proc/thread-self/children".as_ptr(), outside);
    }
}

/// Kills every process of the task: its cgroup (v2 `cgroup.kill`; v1
/// frozen, each process killed, thawed, until it is empty), then the
/// keeper's children until none is left (each killed child's own children
/// become the keeper's, and are killed in the next round). Reaps what it
/// kills; the task's exit status is lost, so call it once the task is
/// reaped or when the fence decides how it ended.
///
/// # Safety
/// Only in the keeper; async-signal-safe.
pub unsafe fn kill_all(reach: &Reach) {
    // SAFETY: system calls and the helpers above on prepared paths.
    unsafe {
        if let Some(f) = &reach.cgroup_kill {
            use std::os::fd::AsRawFd;
            libc::write(f.as_raw_fd(), b"1".as_ptr().cast(), 1);
        }
        if let Some(procs) = &reach.procs {
            for _ in 0..200 {
                if let Some(f) = &reach.freezer {
                    write_path(f.as_ptr(), b"FROZEN");
                }
                let n = each_pid(procs.as_ptr(), |pid| {
                    libc::kill(pid, libc::SIGKILL);
                });
                // Frozen processes die once thawed.
                if let Some(f) = &reach.freezer {
                    write_path(f.as_ptr(), b"THAWED");
                }
                while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {}
                if n == 0 {
                    break;
                }
                pause_ms(5);
            }
        }
        for _ in 0..200 {
            let n = each_pid(c"/proc/thread-self/children".as_ptr(), |pid| {
                libc::kill(pid, libc::SIGKILL);
            });
            while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {}
            if n == 0 {
                break;
            }
            pause_ms(5);
        }
    }
}

/// Writes `kind code\n` to the exit record without allocating.
///
/// # Safety
/// `fd` must be a file descriptor open for writing.
unsafe fn write_exit(fd: libc::c_int, kind: u8, code: i32) {
    let mut buf = [0u8; 16];
    buf[0] = kind;
    buf[1] = b' ';
    let mut n = code.unsigned_abs();
    let mut digits = [0u8; 10];
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut at = 2;
    if code < 0 {
        buf[at] = b'-';
        at += 1;
    }
    for i in (0..len).rev() {
        buf[at] = digits[i];
        at += 1;
    }
    buf[at] = b'\n';
    at += 1;
    // SAFETY: `buf` holds `at` initialised bytes; the caller vouches for `fd`.
    unsafe {
        libc::pwrite(fd, buf.as_ptr().cast(), at, 0);
        libc::fsync(fd);
    }
}

/// The keeper's loop: waits for `task`, enforces the lease, records how the
/// task ended, and exits with the task's status. Never returns.
///
/// # Safety
/// Call only in a freshly forked child (the keeper), with `task` its child,
/// `lease` and `exit` open descriptors, `reach` the task's cgroup files,
/// after making the keeper a child subreaper (before it forked the task).
/// Uses only async-signal-safe calls.
pub unsafe fn keep(
    task: libc::pid_t,
    lease: libc::c_int,
    exit: libc::c_int,
    stop_signal: i32,
    reach: &Reach,
) -> ! {
    // SAFETY (whole body): async-signal-safe libc calls on stack memory.
    unsafe {
        // The agent's stop signal is for the task; the keeper stays to see it end.
        for sig in [
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGPIPE,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        // Hold nothing of the agent's but the two files: above all not the
        // pipe its launcher waits on, which must close when the task execs.
        let kill_fd = reach
            .cgroup_kill
            .as_ref()
            .map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
        for fd in 3..4096 {
            if fd != lease && fd != exit && fd != kill_fd {
                libc::close(fd);
            }
        }
        // Once the lease has run out far enough to signal the task, however
        // it ends is the fence's doing (it may exit 0 after saving a
        // checkpoint): the record says fenced.
        let mut fenced = false;
        let mut last = (0u64, 0u64);
        loop {
            // Reap the task and whatever its tree orphaned to the keeper.
            let mut ended = None;
            loop {
                let mut status = 0;
                let r = libc::waitpid(-1, &mut status, libc::WNOHANG);
                if r == task {
                    ended = Some(status);
                } else if r <= 0 {
                    if r < 0
                        && ended.is_none()
                        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
                    {
                        libc::_exit(127);
                    }
                    break;
                }
            }
            if let Some(status) = ended {
                // None of its processes outlives the task.
                kill_all(reach);
                if fenced {
                    write_exit(exit, b'f', 0);
                    libc::_exit(128 + stop_signal);
                }
                if libc::WIFEXITED(status) {
                    let code = libc::WEXITSTATUS(status);
                    write_exit(exit, b'x', code);
                    libc::_exit(code);
                }
                if libc::WIFSIGNALED(status) {
                    let sig = libc::WTERMSIG(status);
                    write_exit(exit, b's', sig);
                    libc::_exit(128 + sig);
                }
            }
            let mut buf = [0u8; LEASE_LEN];
            if libc::pread(lease, buf.as_mut_ptr().cast(), LEASE_LEN, 0) == LEASE_LEN as isize
                && let Some(l) = parse_lease(&buf)
            {
                last = l;
            }
            let (term_ms, kill_ms) = last;
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts);
            let now = ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000;
            if kill_ms != 0 && now >= kill_ms {
                write_exit(exit, b'f', 0);
                // Everything the task started, wherever it went...
                kill_all(reach);
                // ...then the group, the keeper with it.
                libc::kill(0, libc::SIGKILL);
            }
            if term_ms != 0 && now >= term_ms && !fenced {
                fenced = true;
                signal_all(reach, stop_signal);
            }
            pause_ms(100);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_records_round_trip_and_torn_ones_are_refused() {
        let r = lease_record(123, 4_567_890);
        assert_eq!(parse_lease(&r), Some((123, 4_567_890)));
        let mut torn = r;
        torn[5] = b'9';
        assert_eq!(parse_lease(&torn), None);
        assert_eq!(parse_lease(&lease_record(0, 0)), Some((0, 0)));
    }

    #[test]
    fn exit_records_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("exit");
        let f = create_exit(&p).unwrap();
        assert_eq!(read_exit(&p), None);
        use std::os::fd::AsRawFd;
        // SAFETY: `f` is open for writing.
        unsafe { write_exit(f.as_raw_fd(), b'x', 42) };
        assert_eq!(read_exit(&p), Some(Ended::Exited(42)));
        unsafe { write_exit(f.as_raw_fd(), b's', 9) };
        assert_eq!(read_exit(&p), Some(Ended::Signalled(9)));
        unsafe { write_exit(f.as_raw_fd(), b'f', 0) };
        assert_eq!(read_exit(&p), Some(Ended::Fenced));
    }
}
