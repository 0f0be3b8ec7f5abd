//! Who a task runs as. An agent running as root never runs a task as root:
//! each task runs as the user its team names (`run_as`), or else under a
//! uid of its team's own (`--task-uid-base` plus the team's number, so no
//! two teams' tasks share a user and can read each other's processes), or,
//! with the base set to 0, as the agent's `--run-as` user (`nobody` by
//! default); always with that user's group and no other groups. An agent
//! that is not root runs tasks as itself and refuses a team's `run_as` it
//! cannot honour.

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A resolved system user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// Why a task cannot run as the user asked for.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RunAsError {
    #[error("user {0:?} does not exist on this node")]
    Unknown(String),
    #[error("refusing to run a task as {0:?}: it is uid 0 (root)")]
    Root(String),
    #[error("tasks of this team run as {0:?}, which needs an agent running as root")]
    NotRoot(String),
    #[error(
        "team number {0} is past the installation's uid block of 10,000 teams: give the team a run_as user"
    )]
    Block(u32),
}

/// The agent's effective uid.
pub fn agent_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Looks a user up in the system's user database.
///
/// # Errors
/// When no such user exists.
pub fn lookup(name: &str) -> Result<RunAs, RunAsError> {
    let c = CString::new(name).map_err(|_| RunAsError::Unknown(name.into()))?;
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; getpwnam_r writes only
    // into `pwd` and `buf` and sets `out` to `&pwd` or null.
    let rc =
        unsafe { libc::getpwnam_r(c.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(RunAsError::Unknown(name.into()));
    }
    Ok(RunAs {
        name: name.into(),
        uid: pwd.pw_uid,
        gid: pwd.pw_gid,
    })
}

/// The name of a uid, if it has one.
pub fn lookup_uid(uid: u32) -> Option<String> {
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: as in `lookup`.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points at a NUL-terminated string in `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

/// Where a task's user comes from.
#[derive(Clone, Copy, Debug)]
pub struct TaskUser<'a> {
    /// The team's named system user, if it has one.
    pub run_as: Option<&'a str>,
    /// The team's number: without `run_as`, the task runs as
    /// `uid_base + team_uid` (a uid of the team's own, no passwd entry).
    pub team_uid: Option<u32>,
    /// `--task-uid-base`; 0: tasks of teams without `run_as` run as `default`.
    pub uid_base: u32,
    /// `--run-as`.
    pub default: &'a str,
}

/// The user a task runs as: `None` means "as the agent itself" (an agent
/// that is not root).
///
/// # Errors
/// As [`resolve`].
pub fn resolve_task(u: TaskUser<'_>) -> Result<Option<RunAs>, RunAsError> {
    if u.run_as.is_none()
        && u.uid_base > 0
        && agent_uid() == 0
        && let Some(n) = u.team_uid
    {
        if n >= gpuflow_api::UID_BLOCK {
            return Err(RunAsError::Block(n));
        }
        let uid = u.uid_base.saturating_add(n);
        return Ok(Some(RunAs {
            name: format!("gpuflow-team-{n}"),
            uid,
            gid: uid,
        }));
    }
    resolve(u.run_as, u.default)
}

/// The user a task runs as: `None` means "as the agent itself" (an agent
/// that is not root).
///
/// # Errors
/// An unknown user, uid 0, or a team user an unprivileged agent cannot take.
pub fn resolve(team_user: Option<&str>, agent_default: &str) -> Result<Option<RunAs>, RunAsError> {
    if agent_uid() != 0 {
        return match team_user {
            Some(u) => Err(RunAsError::NotRoot(u.into())),
            None => Ok(None),
        };
    }
    let name = team_user.unwrap_or(agent_default);
    let u = lookup(name)?;
    if u.uid == 0 {
        return Err(RunAsError::Root(name.into()));
    }
    Ok(Some(u))
}

/// Whether `u` can reach `dir` by its absolute path (search permission on
/// every ancestor), judged by owner, primary group and others' bits.
pub fn can_reach(u: &RunAs, dir: &Path) -> bool {
    dir.ancestors().all(|d| match std::fs::metadata(d) {
        Ok(m) => {
            let mode = m.mode();
            if m.uid() == u.uid {
                mode & 0o100 != 0
            } else if m.gid() == u.gid {
                mode & 0o010 != 0
            } else {
                mode & 0o001 != 0
            }
        }
        Err(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_team_without_run_as_gets_a_uid_of_its_own() {
        let u = |run_as, team_uid, uid_base| {
            resolve_task(TaskUser {
                run_as,
                team_uid,
                uid_base,
                default: "nobody",
            })
        };
        if agent_uid() != 0 {
            println!("skipped: the privilege checks need the test to run as root");
            assert_eq!(u(None, Some(3), 1000).unwrap(), None);
            return;
        }
        let a = u(None, Some(3), 1_600_000_000).unwrap().unwrap();
        let b = u(None, Some(4), 1_600_000_000).unwrap().unwrap();
        assert_eq!((a.uid, a.gid), (1_600_000_003, 1_600_000_003));
        assert_ne!(a.uid, b.uid);
        // A named user wins; a base of 0 falls back to --run-as.
        assert_eq!(
            u(Some("daemon"), Some(3), 1_600_000_000)
                .unwrap()
                .unwrap()
                .name,
            "daemon"
        );
        assert_eq!(u(None, Some(3), 0).unwrap().unwrap().name, "nobody");
    }

    #[test]
    fn root_and_unknown_users_are_refused() {
        if agent_uid() != 0 {
            println!("skipped: the privilege checks need the test to run as root");
            assert_eq!(
                resolve(Some("x"), "nobody"),
                Err(RunAsError::NotRoot("x".into()))
            );
            return;
        }
        assert_eq!(
            resolve(Some("root"), "nobody"),
            Err(RunAsError::Root("root".into()))
        );
        assert_eq!(
            resolve(Some("no-such-user-here"), "nobody"),
            Err(RunAsError::Unknown("no-such-user-here".into()))
        );
        let n = resolve(None, "nobody").unwrap().unwrap();
        assert_ne!(n.uid, 0);
    }
}

/// Where agents on a node record which installation holds each uid block
/// (cleared at boot, as claims last only while agents run).
pub const UID_CLAIMS: &str = "/run/gpuflow";

/// A node-wide claim of a uid block by one installation, held while the
/// agent runs: the lock file `DIR/uid-block-B` holds the installation's id
/// and a shared lock of each of its live agents.
#[derive(Debug)]
pub struct UidClaim {
    _file: std::fs::File,
}

/// The first uid of an installation's block: `base` + `block` ×
/// [`gpuflow_api::UID_BLOCK`].
///
/// # Errors
/// When it would pass the largest uid.
pub fn block_base(base: u32, block: u32) -> Result<u32, String> {
    block
        .checked_mul(gpuflow_api::UID_BLOCK)
        .and_then(|o| base.checked_add(o))
        .filter(|b| b.checked_add(gpuflow_api::UID_BLOCK).is_some())
        .ok_or_else(|| {
            format!("--task-uid-base {base} leaves no room for uid block {block}: lower it")
        })
}

/// Claims `block` for `installation` on this node, in `dir`.
///
/// # Errors
/// When a live agent of another installation holds the block (their teams
/// would share uids), or the claim file cannot be made.
pub fn claim_uid_block(
    dir: &std::path::Path,
    block: u32,
    installation: &str,
) -> Result<UidClaim, String> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    let io = |e: std::io::Error| format!("{}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = dir.join(format!("uid-block-{block}"));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    let fd = f.as_raw_fd();
    let lock = |op: libc::c_int| {
        // SAFETY: flock on a descriptor we own (open while `f` lives).
        unsafe { libc::flock(fd, op) == 0 }
    };
    // Read and write the holder under an exclusive lock; a shared lock of a
    // live agent of another installation keeps it from being taken.
    if !lock(libc::LOCK_EX | libc::LOCK_NB) {
        // Agents hold it shared: read who.
        let mut holder = String::new();
        f.read_to_string(&mut holder).map_err(io)?;
        let holder = holder.trim().to_string();
        if holder == installation {
            lock(libc::LOCK_SH);
            return Ok(UidClaim { _file: f });
        }
        if holder.is_empty() {
            // Another agent is claiming it right now: wait for it, then
            // look again.
            lock(libc::LOCK_EX);
            lock(libc::LOCK_UN);
            drop(f);
            return claim_uid_block(dir, block, installation);
        }
        return Err(format!(
            "uid block {block} is held on this node by a live agent of another gpuflow installation ({holder}, {}): its teams would share uids with this one's; give this agent another --task-uid-base",
            path.display()
        ));
    }
    let mut holder = String::new();
    f.read_to_string(&mut holder).map_err(io)?;
    if holder.trim() != installation {
        // Free (no live holder): take it.
        f.set_len(0).map_err(io)?;
        f.rewind().map_err(io)?;
        writeln!(f, "{installation}").map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    lock(libc::LOCK_SH);
    Ok(UidClaim { _file: f })
}

#[cfg(test)]
mod claim_tests {
    use super::*;

    #[test]
    fn a_uid_block_is_shared_by_one_installations_agents_only() {
        let dir = tempfile::tempdir().unwrap();
        let a1 = claim_uid_block(dir.path(), 7, "gfi_a").unwrap();
        let a2 = claim_uid_block(dir.path(), 7, "gfi_a").unwrap();
        let e = claim_uid_block(dir.path(), 7, "gfi_b").unwrap_err();
        assert!(e.contains("another gpuflow installation (gfi_a"), "{e}");
        // Another block is free.
        let _b = claim_uid_block(dir.path(), 8, "gfi_b").unwrap();
        // Once installation a's agents are gone, b may take block 7.
        drop((a1, a2));
        let _b7 = claim_uid_block(dir.path(), 7, "gfi_b").unwrap();
        assert!(claim_uid_block(dir.path(), 7, "gfi_a").is_err());
    }

    #[test]
    fn block_bases_stay_below_the_largest_uid() {
        assert_eq!(block_base(1_600_000_000, 3), Ok(1_600_030_000));
        assert!(block_base(1_600_000_000, gpuflow_api::UID_BLOCKS - 1).is_ok());
        assert!(block_base(4_294_960_000, 1).is_err());
    }
}
