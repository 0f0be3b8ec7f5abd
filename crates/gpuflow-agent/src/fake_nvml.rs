//! Builds the fake `libnvidia-ml.so.1` (C source in `fake-nvml/`) for tests on
//! machines without a GPU. It implements the NVML calls the agent makes and
//! reports GPUs described by `FAKE_NVML_*` environment variables (see the C file).

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = include_str!("../fake-nvml/fake_nvml.c");

/// Compiles the library into `dir`. `Ok(None)` when no C compiler is installed.
///
/// # Errors
/// When the compiler is there but fails; the message has its output.
pub fn build(dir: &Path) -> Result<Option<PathBuf>, String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if Command::new(&cc).arg("--version").output().is_err() {
        return Ok(None);
    }
    let src = dir.join("fake_nvml.c");
    let lib = dir.join("libnvidia-ml.so.1");
    std::fs::write(&src, SOURCE).map_err(|e| e.to_string())?;
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{cc} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(Some(lib))
}
