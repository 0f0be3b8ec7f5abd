//! The README's quick start, pasted into a shell as a new user would:
//! every line of its first two `sh` blocks, in order, with `set -e`, on a
//! fresh `gpuflow up` the block itself starts (the `cargo build` line is
//! the one left out: the test runs the binary cargo built for it).

mod common;

use std::process::Command;

use common::*;

/// The `sh` block that follows the first line starting with `marker`.
fn block_after(readme: &str, marker: &str) -> String {
    let from = readme
        .find(marker)
        .unwrap_or_else(|| panic!("the README has no {marker:?}"));
    let rest = &readme[from..];
    let start = rest.find("```sh\n").expect("an sh block") + "```sh\n".len();
    let end = rest[start..].find("```").expect("the block's end");
    rest[start..start + end].to_string()
}

#[test]
fn the_readme_quick_start_works_pasted_line_by_line() {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"),
    )
    .unwrap();
    let quick = block_after(&readme, "## Run the platform");
    let tenants = block_after(&readme, "Tenants:");
    assert!(quick.contains("gpuflow up"), "{quick}");
    let pasted: String = format!("{quick}{tenants}")
        .lines()
        .map(|l| {
            if l.starts_with("cargo ") {
                format!(": left out by the test: {l}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let bin_dir = std::path::Path::new(BIN).parent().unwrap();
    // A fresh machine's shell: this checkout's binary on the PATH, and the
    // platform on a port and data directory of its own.
    let script = format!(
        "set -euo pipefail\n\
         trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n\
         {pasted}\n\
         echo QUICK-START-DONE\n"
    );
    let out = Command::new("timeout")
        .args(["180", "bash", "-c", &script])
        .current_dir(dir.path())
        .env(
            "PATH",
            format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap()),
        )
        .env("HOME", dir.path())
        .env("GPUFLOW_LISTEN", format!("127.0.0.1:{port}"))
        .env("GPUFLOW_SERVER", format!("http://127.0.0.1:{port}"))
        .env("GPUFLOW_DATA", dir.path().join("data"))
        .env_remove("GPUFLOW_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(dir.path().join("gpuflow-up.log")).unwrap_or_default();
    assert!(
        out.status.success() && stdout.contains("QUICK-START-DONE"),
        "the quick start stopped ({:?}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- gpuflow-up.log\n{log}",
        out.status
    );
    // What a new user reads on the way.
    assert!(stdout.contains("job 1 submitted"), "{stdout}");
    assert!(stdout.contains("array 2 submitted: 100 jobs"), "{stdout}");
    // The hello job, the --wrap one and ana's.
    let singles = stdout
        .lines()
        .filter(|l| l.starts_with("job ") && l.contains(" submitted ("))
        .count();
    assert_eq!(singles, 3, "{stdout}");
    assert!(log.contains("gpuflow is up at"), "{log}");
}
