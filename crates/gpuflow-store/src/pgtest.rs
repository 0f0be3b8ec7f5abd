//! A throwaway PostgreSQL server for tests and benchmarks, started from the
//! binaries the machine has installed (Debian's `postgresql` package). It
//! lives in a temporary directory, listens on a loopback port, trusts local
//! connections and is stopped and deleted when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct TempPostgres {
    dir: PathBuf,
    bin: PathBuf,
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
}

/// The directory with `initdb` and `pg_ctl`, if PostgreSQL is installed.
pub fn find_binaries() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|b| b.join("initdb").exists())
        .collect();
    found.sort();
    found.pop()
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Runs a PostgreSQL binary, as the `postgres` user when we are root
/// (PostgreSQL refuses to run as root).
fn pg_command(bin: &Path, name: &str) -> Command {
    let exe = bin.join(name);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } == 0 {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(exe);
        c
    } else {
        Command::new(exe)
    }
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

impl TempPostgres {
    /// Starts a server; `Ok(None)` when PostgreSQL is not installed.
    ///
    /// # Errors
    /// When it is installed but does not start; the message has its output.
    pub fn start() -> Result<Option<TempPostgres>, String> {
        TempPostgres::start_with(false)
    }

    /// As [`TempPostgres::start`], with `fsync` on or off (tests run it
    /// off; a benchmark of durable commits, on).
    ///
    /// # Errors
    /// As [`TempPostgres::start`].
    pub fn start_with(fsync: bool) -> Result<Option<TempPostgres>, String> {
        let Some(bin) = find_binaries() else {
            return Ok(None);
        };
        let dir = std::env::temp_dir().join(format!(
            "gpuflow-pg-{}-{}",
            std::process::id(),
            free_port().map_err(|e| e.to_string())?
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc_geteuid() } == 0 {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .map_err(|e| e.to_string())?;
            if !ok.success() {
                return Err("chown of the PostgreSQL data directory failed".into());
            }
        }
        let data = dir.join("data");
        let out = pg_command(&bin, "initdb")
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let port = free_port().map_err(|e| e.to_string())?;
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync={} -c max_connections=50",
            dir.display(),
            if fsync { "on" } else { "off" }
        );
        let out = pg_command(&bin, "pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-o", &opts, "-l"])
            .arg(dir.join("log"))
            .args(["-w", "-t", "60", "start"])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            return Err(format!(
                "pg_ctl start failed: {}{log}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(Some(TempPostgres {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            bin,
        }))
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        let _ = pg_command(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
