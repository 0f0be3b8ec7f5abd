//! Running tasks as process trees. Each task is the leader of its own process
//! group, so a stop reaches everything it started: the stop signal goes to
//! the group, and after the grace period SIGKILL does. Output goes to a log
//! file per task; the task may write a Unix time to the file named by
//! `GPUFLOW_CHECKPOINT_FILE` to report a checkpoint.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuflow_api::{DesiredTask, TaskPhase, TaskReport};

/// `(job, attempt, group, index)`.
pub type Key = (u64, u32, u16, u32);

pub fn key(t: &DesiredTask) -> Key {
    (t.job, t.attempt, t.group, t.index)
}

/// Log bytes sent with each report.
const LOG_TAIL: u64 = 16 * 1024;

pub struct Task {
    pub key: Key,
    child: Option<Child>,
    pgid: i32,
    pub phase: TaskPhase,
    pub exit_code: Option<i32>,
    /// Set once told to stop: when to kill.
    kill_at: Option<Instant>,
    killed: bool,
    pub log: PathBuf,
    checkpoint: PathBuf,
    pub message: String,
    /// Log size the server has acknowledged; the tail is sent only when the
    /// log has grown since, to keep heartbeats small.
    pub acked_log_len: u64,
}

pub fn signal_number(name: &str) -> i32 {
    match name {
        "SIGINT" => libc::SIGINT,
        "SIGUSR1" => libc::SIGUSR1,
        "SIGUSR2" => libc::SIGUSR2,
        "SIGHUP" => libc::SIGHUP,
        "SIGQUIT" => libc::SIGQUIT,
        _ => libc::SIGTERM,
    }
}

impl Task {
    /// Starts a task; a task that cannot start is returned in phase
    /// `FailedToStart` with the reason.
    pub fn start(t: &DesiredTask, dir: &Path) -> Task {
        let (job, attempt, group, index) = key(t);
        let task_dir = dir.join(format!("job-{job}")).join(format!("a{attempt}-g{group}-i{index}"));
        let log = task_dir.join("output.log");
        let checkpoint = task_dir.join("checkpoint");
        let mut task = Task {
            key: key(t),
            child: None,
            pgid: 0,
            phase: TaskPhase::Running,
            exit_code: None,
            kill_at: None,
            killed: false,
            log: log.clone(),
            checkpoint: checkpoint.clone(),
            message: String::new(),
            acked_log_len: 0,
        };
        let result = (|| -> std::io::Result<Child> {
            std::fs::create_dir_all(&task_dir)?;
            let out = File::create(&log)?;
            let err = out.try_clone()?;
            let mut cmd = Command::new(&t.command[0]);
            cmd.args(&t.command[1..])
                .envs(&t.env)
                .env("GPUFLOW_CHECKPOINT_FILE", &checkpoint)
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .process_group(0);
            cmd.current_dir(t.working_dir.as_deref().map_or(task_dir.as_path(), Path::new));
            cmd.spawn()
        })();
        match result {
            Ok(child) => {
                task.pgid = child.id() as i32;
                task.child = Some(child);
                tracing::info!(job, attempt, group, index, pid = task.pgid, "task started");
            }
            Err(e) => {
                task.phase = TaskPhase::FailedToStart;
                task.message = format!("cannot start {:?}: {e}", t.command[0]);
                tracing::warn!(job, attempt, group, index, error = %e, "task failed to start");
            }
        }
        task
    }

    pub fn running(&self) -> bool {
        self.phase == TaskPhase::Running
    }

    /// Sends the stop signal to the group once and arms the kill. Returns
    /// whether it did (false when already stopping or ended).
    pub fn stop(&mut self, signal: &str, grace: Duration) -> bool {
        if !self.running() || self.kill_at.is_some() {
            return false;
        }
        self.kill_at = Some(Instant::now() + grace);
        self.signal(signal_number(signal));
        true
    }

    fn signal(&self, sig: i32) {
        if self.pgid > 0 {
            // SAFETY: kill(2) with a negative pid signals that process group;
            // it has no memory-safety preconditions.
            unsafe {
                libc::kill(-self.pgid, sig);
            }
        }
    }

    /// Reaps an exit and enforces the kill time.
    pub fn poll(&mut self) {
        let Some(child) = self.child.as_mut() else { return };
        if self.phase == TaskPhase::Running {
            if let Ok(Some(status)) = child.try_wait() {
                let stopped = self.kill_at.is_some();
                self.phase = if stopped { TaskPhase::Stopped } else { TaskPhase::Exited };
                self.exit_code = status.code().or_else(|| status.signal().map(|s| 128 + s));
                // The leader is gone; make sure the rest of its tree is too.
                self.signal(libc::SIGKILL);
                tracing::info!(job = self.key.0, code = ?self.exit_code, "task ended");
            } else if let Some(k) = self.kill_at
                && Instant::now() >= k
                && !self.killed
            {
                self.killed = true;
                self.signal(libc::SIGKILL);
            }
        }
    }

    /// Kills the tree now (agent shutdown).
    pub fn kill(&mut self) {
        if self.running() {
            self.signal(libc::SIGKILL);
            if let Some(c) = self.child.as_mut() {
                let _ = c.wait();
            }
            self.phase = TaskPhase::Stopped;
        }
    }

    /// The current log size.
    pub fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log).map_or(0, |m| m.len())
    }

    /// The task's report; the log tail only when the log grew since the
    /// server last acknowledged it.
    pub fn report(&self) -> TaskReport {
        let (job, attempt, group, index) = self.key;
        let log_tail = if self.log_len() != self.acked_log_len { tail(&self.log) } else { String::new() };
        TaskReport {
            job,
            attempt,
            group,
            index,
            phase: self.phase,
            exit_code: self.exit_code,
            checkpoint_at: std::fs::read_to_string(&self.checkpoint)
                .ok()
                .and_then(|s| s.trim().parse().ok()),
            log_tail,
            message: self.message.clone(),
        }
    }
}

fn tail(path: &Path) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}
