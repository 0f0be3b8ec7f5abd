//! Where tasks' own directories (their working directory, `$HOME` and
//! logs) live, so that a task reaches them by absolute path.
//!
//! A root agent runs tasks as their teams' users. Their directories are
//! theirs (`0700`), but every directory above must be searchable by them
//! too: `ls "$PWD"`, Python's `http.server` and pip's cache under `$HOME`
//! open absolute paths. The agent's own state (records, tokens, lease)
//! stays private whatever the layout: its files are `0600` and its
//! `state/` directory `0700`.
//!
//! - Not root: tasks run as the agent's user, in the work directory.
//! - Root, with every directory above the work directory searchable by
//!   others: in the work directory, which becomes `0711` (search, no
//!   listing).
//! - Root, with one that is not (`/root` is `0700`, as are temporary
//!   directories): under [`FALLBACK`], in a directory named after the node
//!   and the work directory, the same one each time the agent starts (its
//!   check that a task never runs twice looks there).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where a root agent puts tasks' directories when its work directory is
/// out of their users' reach.
pub const FALLBACK: &str = "/var/lib/gpuflow/tasks";

/// The first directory above `dir` (itself excluded) that others may not
/// search, with its mode.
fn closed_ancestor(dir: &Path) -> Option<(PathBuf, u32)> {
    dir.ancestors().skip(1).find_map(|a| {
        let mode = std::fs::metadata(a).ok()?.permissions().mode();
        (mode & 0o001 == 0).then(|| (a.to_path_buf(), mode & 0o7777))
    })
}

/// This work directory's own name for its tasks' directory elsewhere:
/// drawn at random the first time and kept in it, so that a new
/// installation on the same path (its work directory removed and made
/// again) never finds an old one's tasks and takes them for its own.
fn install_id(dir: &Path) -> Result<String, String> {
    let file = dir.join("tasks-id");
    if let Ok(id) = std::fs::read_to_string(&file) {
        let id = id.trim();
        if id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()) {
            return Ok(id.to_string());
        }
    }
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&file, &id).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    Ok(id)
}

/// Chooses, creates and opens up the directory under which tasks'
/// directories go, for an agent on `work_dir` (which exists) named `node`;
/// `root`: the agent runs as root, so tasks run as other users.
///
/// # Errors
/// When it cannot be created or made searchable, or a directory above it
/// is not searchable by others.
pub fn choose(work_dir: &Path, node: &str, root: bool) -> Result<PathBuf, String> {
    if !root {
        return Ok(work_dir.to_path_buf());
    }
    let dir = work_dir
        .canonicalize()
        .map_err(|e| format!("cannot resolve {}: {e}", work_dir.display()))?;
    let open = |d: &Path, mode: u32| {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("cannot set the mode of {}: {e}", d.display()))
    };
    let Some((closed, mode)) = closed_ancestor(&dir) else {
        open(&dir, 0o711)?;
        return Ok(dir);
    };
    let fallback = Path::new(FALLBACK);
    let tasks = fallback.join(format!("{node}-{}", install_id(&dir)?));
    std::fs::create_dir_all(&tasks)
        .map_err(|e| format!("cannot create {}: {e}", tasks.display()))?;
    // `/var/lib/gpuflow` and below: ours, made by `create_dir_all` under
    // the agent's umask (`0077`).
    let ours = fallback.parent().unwrap_or(fallback);
    for d in tasks.ancestors().take_while(|d| d.starts_with(ours)) {
        open(d, 0o711)?;
    }
    if let Some((c, m)) = closed_ancestor(&tasks) {
        return Err(format!(
            "tasks cannot reach their directories: neither {} ({} is mode {mode:04o}) nor {} ({} is mode {m:04o}) is searchable by their users; make one of them searchable (chmod o+x) or pick a --work-dir whose parents are",
            dir.display(),
            closed.display(),
            tasks.display(),
            c.display(),
        ));
    }
    tracing::info!(
        tasks = %tasks.display(),
        closed = %closed.display(),
        "the work directory is out of the tasks' users' reach (a directory above it is not searchable by others): tasks' directories go here"
    );
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_ancestor_is_found_and_an_open_path_has_none() {
        let top = tempfile::tempdir().unwrap();
        let inner = top.path().join("a/b");
        std::fs::create_dir_all(&inner).unwrap();
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(top.path().join("a"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        assert_eq!(
            closed_ancestor(&inner),
            Some((top.path().to_path_buf(), 0o700))
        );
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        // Above the temporary directory: `/tmp` (1777) and `/`.
        assert_eq!(closed_ancestor(&inner), None);
    }

    #[test]
    fn an_unprivileged_agent_keeps_tasks_in_its_work_directory() {
        let top = tempfile::tempdir().unwrap();
        assert_eq!(choose(top.path(), "n1", false).unwrap(), top.path());
    }

    #[test]
    fn the_fallback_name_is_kept_and_a_new_work_directory_gets_a_new_one() {
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("agent");
        std::fs::create_dir(&dir).unwrap();
        let first = install_id(&dir).unwrap();
        assert_eq!(install_id(&dir).unwrap(), first, "kept across starts");
        // The work directory removed and made again: a new installation.
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir(&dir).unwrap();
        assert_ne!(install_id(&dir).unwrap(), first);
    }
}
