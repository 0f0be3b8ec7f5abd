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
