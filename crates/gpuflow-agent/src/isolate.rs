//! What a task may reach on its node beyond its cgroup (which holds its
//! limits and, on v1, its GPU devices: see `cgroup.rs`).
//!
//! When the agent is root, each task (and its readiness command) starts
//! in a mount namespace of its own, made in its launcher before it drops
//! to its user:
//! - `/tmp` and `/var/tmp` are its own (its directory's `tmp`, bound over
//!   them), and `/dev/shm` is its job's on this node (shared by the job's
//!   tasks here, as NCCL's shared-memory transport needs, never by another
//!   job's); a `/tmp` or `/var/tmp` that holds the agent's own work
//!   directory stays shared (the agent warns), since the task's paths
//!   would vanish under it;
//! - `/proc` is a fresh instance with `hidepid=invisible`: other users'
//!   processes (other teams', the agent's, the keepers') are not there;
//! - and, on every agent, root or not: `no_new_privs` and a seccomp filter
//!   that denies what a GPU job never needs (module loading, mounts,
//!   kexec, reboot, swap, clock setting, keyrings, BPF, attaching
//!   `ptrace` to another process, and creating user namespaces unless the
//!   node allows it); `clone3` answers ENOSYS so that the C library falls
//!   back to `clone`, whose flags the filter can read.
//!
//! It does not own: the GPUs' device nodes (cgroup), limits (cgroup), the
//! task's user (`user.rs`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The node's policy for its tasks, fixed when the agent starts.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Give each task its own mount namespace (needs root).
    pub namespaces: bool,
    /// `/tmp` and `/var/tmp` may be private (the agent's work directory
    /// is under neither).
    pub private_tmp: bool,
    pub private_var_tmp: bool,
    /// The compiled seccomp filters (deny with EPERM; clone3 with ENOSYS).
    pub filters: Option<Arc<[BpfProgram; 2]>>,
}

/// Whether `dir` is `top` or below it.
fn under(dir: &Path, top: &str) -> bool {
    dir.starts_with(top)
}

impl Policy {
    /// The policy for an agent whose work directory and tasks' directories
    /// are `dirs`: namespaces when root, the seccomp filter always
    /// (`user_namespaces`: tasks may create user namespaces).
    ///
    /// # Errors
    /// When the seccomp filter cannot be built for this architecture.
    pub fn new(dirs: &[&Path], root: bool, user_namespaces: bool) -> Result<Policy, String> {
        let dirs: Vec<PathBuf> = dirs
            .iter()
            .map(|d| d.canonicalize().unwrap_or_else(|_| d.to_path_buf()))
            .collect();
        let private_tmp = !dirs.iter().any(|d| under(d, "/tmp"));
        let private_var_tmp =
            !dirs.iter().any(|d| under(d, "/var/tmp")) && Path::new("/var/tmp").is_dir();
        if root && (!private_tmp || !private_var_tmp) {
            tracing::warn!(
                dirs = ?dirs,
                "the agent's work directory or its tasks' is under /tmp or /var/tmp: tasks share that one"
            );
        }
        Ok(Policy {
            namespaces: root,
            private_tmp,
            private_var_tmp,
            filters: Some(Arc::new(filters(user_namespaces)?)),
        })
    }
}

/// One task's isolation, prepared before its launcher forks (the launcher
/// allocates nothing after).
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The directories bound over `/tmp` (and `/var/tmp`), and `/dev/shm`.
    tmp: Option<CString>,
    var_tmp: bool,
    shm: Option<CString>,
    filters: Option<Arc<[BpfProgram; 2]>>,
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} holds a NUL byte", p.display()))
}

/// Makes (as the agent) the directories a task's namespace binds, owned by
/// its user `ids`: `task_dir/tmp`, and `shm` in its job's directory (the
/// task directory's parent, shared by the job's tasks on the node).
///
/// # Errors
/// When a directory cannot be made or given to the task's user.
pub fn prepare(
    policy: &Policy,
    task_dir: &Path,
    ids: Option<(u32, u32)>,
) -> Result<Prepared, String> {
    let mut p = Prepared {
        tmp: None,
        var_tmp: false,
        shm: None,
        filters: policy.filters.clone(),
    };
    if !policy.namespaces {
        return Ok(p);
    }
    let make = |d: &Path| -> Result<CString, String> {
        use std::os::unix::fs::PermissionsExt;
        let io = |e: std::io::Error| format!("{}: {e}", d.display());
        std::fs::create_dir_all(d).map_err(io)?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(d, Some(uid), Some(gid)).map_err(io)?;
        }
        cstr(d)
    };
    if policy.private_tmp {
        p.tmp = Some(make(&task_dir.join("tmp"))?);
        p.var_tmp = policy.private_var_tmp;
    }
    if Path::new("/dev/shm").is_dir() {
        let job_dir = task_dir.parent().unwrap_or(task_dir);
        p.shm = Some(make(&job_dir.join("shm"))?);
    }
    Ok(p)
}

/// In the task's launcher, as root, before it drops to its user: its own
/// mount namespace with private `/tmp`, `/var/tmp`, `/dev/shm` and a
/// `/proc` without other users' processes. Async-signal-safe.
///
/// # Errors
/// The failing system call's error (the task then does not start).
pub fn enter(p: &Prepared) -> std::io::Result<()> {
    if p.tmp.is_none() && p.shm.is_none() {
        return Ok(());
    }
    let fail = || Err(std::io::Error::last_os_error());
    // SAFETY: plain system calls on NUL-terminated strings prepared before the fork.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return fail();
        }
        // Nothing mounted here reaches the node's namespace.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            return fail();
        }
        let bind = |src: &CString, dst: &std::ffi::CStr| {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        if let Some(t) = &p.tmp {
            if bind(t, c"/tmp") != 0 {
                return fail();
            }
            if p.var_tmp && bind(t, c"/var/tmp") != 0 {
                return fail();
            }
        }
        if let Some(s) = &p.shm
            && bind(s, c"/dev/shm") != 0
        {
            return fail();
        }
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        let proc_with = |opts: &std::ffi::CStr| {
            libc::mount(
                c"proc".as_ptr(),
                c"/proc".as_ptr(),
                c"proc".as_ptr(),
                flags,
                opts.as_ptr().cast(),
            )
        };
        // `invisible` since Linux 5.8; `2` before.
        if proc_with(c"hidepid=invisible") != 0 && proc_with(c"hidepid=2") != 0 {
            return fail();
        }
    }
    Ok(())
}

/// In the task's launcher, last before exec (after it dropped to its
/// user): `no_new_privs` and the seccomp filters. Async-signal-safe.
///
/// # Errors
/// The failing system call's error.
pub fn confine(p: &Prepared) -> std::io::Result<()> {
    let Some(f) = &p.filters else {
        return Ok(());
    };
    for prog in f.iter() {
        seccompiler::apply_filter(prog).map_err(|e| match e {
            seccompiler::Error::Prctl(io) | seccompiler::Error::Seccomp(io) => io,
            _ => std::io::Error::from_raw_os_error(libc::EINVAL),
        })?;
    }
    Ok(())
}

fn arch() -> Result<TargetArch, String> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|e| format!("seccomp: {e}"))
}

/// The two filters: what a task is denied (EPERM), and `clone3` (ENOSYS).
fn filters(user_namespaces: bool) -> Result<[BpfProgram; 2], String> {
    let err = |e: seccompiler::BackendError| format!("seccomp: {e}");
    let always = || Vec::<SeccompRule>::new();
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in [
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_open_by_handle_at,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_adjtimex,
        libc::SYS_acct,
        libc::SYS_bpf,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_setns,
    ] {
        deny.insert(nr, always());
    }
    // ptrace: a task may trace its own children (PTRACE_TRACEME, as a
    // debugger that starts them does), never attach to another process.
    let op = |v: u64| {
        SeccompRule::new(vec![
            SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::Eq, v).map_err(err)?,
        ])
        .map_err(err)
    };
    deny.insert(
        libc::SYS_ptrace,
        vec![
            op(libc::PTRACE_ATTACH as u64)?,
            op(libc::PTRACE_SEIZE as u64)?,
        ],
    );
    if !user_namespaces {
        let newuser = libc::CLONE_NEWUSER as u64;
        let flag = |arg: u8| {
            SeccompRule::new(vec![
                SeccompCondition::new(
                    arg,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(newuser),
                    newuser,
                )
                .map_err(err)?,
            ])
            .map_err(err)
        };
        deny.insert(libc::SYS_unshare, vec![flag(0)?]);
        // clone's flags are its first argument on x86_64 and aarch64.
        deny.insert(libc::SYS_clone, vec![flag(0)?]);
    }
    let arch = arch()?;
    let deny = SeccompFilter::new(
        deny,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(err)?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, always())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(err)?;
    Ok([
        deny.try_into().map_err(err)?,
        clone3.try_into().map_err(err)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_build_for_this_architecture() {
        let [deny, clone3] = filters(false).unwrap();
        assert!(!deny.is_empty() && !clone3.is_empty());
        assert!(filters(true).unwrap()[0].len() < deny.len());
    }

    /// A forked child under the filters: user namespaces, module loading
    /// and attaching ptrace are refused; ordinary work is not.
    #[test]
    fn a_confined_process_cannot_make_a_user_namespace_or_load_a_module() {
        let p = Prepared {
            tmp: None,
            var_tmp: false,
            shm: None,
            filters: Some(Arc::new(filters(false).unwrap())),
        };
        // SAFETY: the child calls only async-signal-safe functions and _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                let code = (|| {
                    if confine(&p).is_err() {
                        return 10;
                    }
                    let errno = || std::io::Error::last_os_error().raw_os_error();
                    if libc::unshare(libc::CLONE_NEWUSER) == 0 || errno() != Some(libc::EPERM) {
                        return 11;
                    }
                    if libc::syscall(libc::SYS_finit_module, -1, c"".as_ptr(), 0) == 0
                        || errno() != Some(libc::EPERM)
                    {
                        return 12;
                    }
                    if libc::ptrace(libc::PTRACE_ATTACH, 1, 0, 0) == 0
                        || errno() != Some(libc::EPERM)
                    {
                        return 13;
                    }
                    if libc::syscall(libc::SYS_clone3, 0, 0) == 0 || errno() != Some(libc::ENOSYS) {
                        return 14;
                    }
                    // Not everything is refused: a plain fork works.
                    let c = libc::fork();
                    if c == 0 {
                        libc::_exit(0);
                    }
                    if c < 0 {
                        return 15;
                    }
                    libc::waitpid(c, std::ptr::null_mut(), 0);
                    0
                })();
                libc::_exit(code);
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "see the codes above");
    }
}
