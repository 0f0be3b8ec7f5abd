//! MIG capability devices. A process opens a MIG instance through its
//! GPU's `/dev/nvidiaN` and two capability device nodes,
//! `/dev/nvidia-caps/nvidia-capM`: its GPU instance's `access` and its
//! compute instance's. Their major is the driver's `nvidia-caps` (in
//! `/proc/devices`); their minors are listed in
//! `/proc/driver/nvidia-caps/mig-minors`, one capability a line:
//!
//! ```text
//! config 1
//! monitor 2
//! gpu0/gi1/access 12
//! gpu0/gi1/ci0/access 13
//! ```
//!
//! where `gpuN` is the GPU's device minor. Since every instance of a GPU
//! shares its `/dev/nvidiaN`, these nodes are what keeps a task on its
//! own instance: a task may open its instances' capabilities and nothing
//! else of the `nvidia-caps` major (not another instance's, nor `config`
//! or `monitor`). The cgroup (`cgroup.rs`, `devbpf.rs`) enforces it.

use std::collections::BTreeMap;
use std::path::Path;

/// Where a MIG instance sits: its GPU's device minor, its GPU instance and
/// compute instance ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigId {
    pub gpu_minor: u32,
    pub gi: u32,
    pub ci: u32,
}

/// The driver's capability devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The `nvidia-caps` major.
    pub major: u32,
    /// Each capability's minor, by name (`gpu0/gi1/access`).
    minors: BTreeMap<String, u32>,
}

/// What a task may open of the `nvidia-caps` major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapsRule {
    pub major: u32,
    /// Its instances' capability minors.
    pub allowed: Vec<u32>,
    /// Every minor the driver lists (a v1 deny list names each).
    pub listed: Vec<u32>,
}

impl Caps {
    /// The driver's tables under `proc` (normally `/proc`): `None` where the
    /// driver has no `nvidia-caps` device (no MIG support, no driver).
    ///
    /// # Errors
    /// When the driver has the device but its minors cannot be read.
    pub fn read(proc: &Path) -> Result<Option<Caps>, String> {
        let Ok(devices) = std::fs::read_to_string(proc.join("devices")) else {
            return Ok(None);
        };
        let table = proc.join("driver/nvidia-caps/mig-minors");
        let minors = match std::fs::read_to_string(&table) {
            Ok(t) => t,
            Err(_) if Caps::major(&devices).is_none() => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", table.display())),
        };
        Caps::parse(&devices, &minors)
    }

    /// The tables' text: `/proc/devices` and `mig-minors`.
    ///
    /// # Errors
    /// On a `mig-minors` line that is not a name and a number.
    pub fn parse(devices: &str, mig_minors: &str) -> Result<Option<Caps>, String> {
        let Some(major) = Caps::major(devices) else {
            return Ok(None);
        };
        let mut minors = BTreeMap::new();
        for line in mig_minors.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let parsed = line
                .split_once(char::is_whitespace)
                .and_then(|(name, m)| Some((name, m.trim().parse::<u32>().ok()?)));
            let Some((name, minor)) = parsed else {
                return Err(format!("mig-minors: {line:?} is not a name and a minor"));
            };
            minors.insert(name.to_string(), minor);
        }
        Ok(Some(Caps { major, minors }))
    }

    /// The `nvidia-caps` character major in `/proc/devices`.
    fn major(devices: &str) -> Option<u32> {
        let chars = devices.split("Block devices:").next().unwrap_or(devices);
        chars.lines().find_map(|l| {
            let (n, name) = l.trim().split_once(char::is_whitespace)?;
            (name.trim() == "nvidia-caps").then(|| n.parse().ok())?
        })
    }

    /// The rule for a task holding the instances `ids`. An instance the
    /// table does not list gets no capability (and so cannot be opened:
    /// the agent warns).
    pub fn rule(&self, ids: &[MigId]) -> CapsRule {
        let mut allowed = Vec::new();
        for id in ids {
            let gi = format!("gpu{}/gi{}/access", id.gpu_minor, id.gi);
            let ci = format!("gpu{}/gi{}/ci{}/access", id.gpu_minor, id.gi, id.ci);
            for name in [gi, ci] {
                match self.minors.get(&name) {
                    Some(&m) => allowed.push(m),
                    None => tracing::warn!(
                        capability = %name,
                        "the driver lists no such MIG capability: the task cannot open its instance"
                    ),
                }
            }
        }
        allowed.sort_unstable();
        allowed.dedup();
        let mut listed: Vec<u32> = self.minors.values().copied().collect();
        listed.sort_unstable();
        listed.dedup();
        CapsRule {
            major: self.major,
            allowed,
            listed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICES: &str =
        "Character devices:\n  1 mem\n195 nvidia\n508 nvidia-caps\n\nBlock devices:\n  7 loop\n";
    const MINORS: &str = "config 1\nmonitor 2\ngpu0/gi1/access 3\ngpu0/gi1/ci0/access 4\ngpu0/gi2/access 5\ngpu0/gi2/ci0/access 6\ngpu1/gi1/access 7\ngpu1/gi1/ci0/access 8\n";

    #[test]
    fn a_task_gets_its_instances_capabilities_only() {
        let caps = Caps::parse(DEVICES, MINORS).unwrap().unwrap();
        assert_eq!(caps.major, 508);
        let r = caps.rule(&[MigId {
            gpu_minor: 0,
            gi: 2,
            ci: 0,
        }]);
        assert_eq!(r.allowed, [5, 6]);
        assert_eq!(r.listed, [1, 2, 3, 4, 5, 6, 7, 8]);
        // No instance: nothing of the major.
        assert!(caps.rule(&[]).allowed.is_empty());
        // An instance the driver does not list: nothing either.
        let gone = MigId {
            gpu_minor: 3,
            gi: 9,
            ci: 0,
        };
        assert!(caps.rule(&[gone]).allowed.is_empty());
    }

    #[test]
    fn a_driver_without_capabilities_has_none_and_a_bad_table_is_an_error() {
        assert_eq!(
            Caps::parse("Character devices:\n195 nvidia\n", MINORS),
            Ok(None)
        );
        // A block device of that name is not it.
        assert_eq!(
            Caps::parse("Character devices:\n\nBlock devices:\n9 nvidia-caps\n", ""),
            Ok(None)
        );
        assert!(Caps::parse(DEVICES, "gpu0/gi1/access x\n").is_err());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Caps::read(dir.path()), Ok(None));
        std::fs::write(dir.path().join("devices"), DEVICES).unwrap();
        assert!(
            Caps::read(dir.path()).is_err(),
            "the major without its table"
        );
        std::fs::create_dir_all(dir.path().join("driver/nvidia-caps")).unwrap();
        std::fs::write(dir.path().join("driver/nvidia-caps/mig-minors"), MINORS).unwrap();
        assert_eq!(Caps::read(dir.path()).unwrap().unwrap().major, 508);
    }
}
