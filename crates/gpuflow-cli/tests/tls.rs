//! TLS on the listener: a server with a (self-signed) certificate, an agent
//! and the CLI that trust it, and clients that do not.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

#[test]
fn https_server_with_agent_and_cli() {
    let dir = tempfile::tempdir().unwrap();
    let cert =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let port = free_port();
    let _server = Proc(
        Command::new(BIN)
            .args([
                "server",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(dir.path().join("data"))
            .args(["--heartbeat", "1", "--cycle-ms", "200", "--tls-cert"])
            .arg(&cert_path)
            .arg("--tls-key")
            .arg(&key_path)
            .env("GPUFLOW_JOIN_TOKEN", JOIN)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("https://127.0.0.1:{port}");
    let cli = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .args(["--server", &url, "--ca-cert"])
            .arg(&cert_path)
            .env("GPUFLOW_TOKEN", admin_token(dir.path()))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    poll("the https server answers", Duration::from_secs(30), || {
        std::fs::metadata(dir.path().join("data/admin.token")).ok()?;
        (cli(&["node", "ls"]).0 == Some(0)).then_some(())
    });
    let _agent = Proc(
        Command::new(BIN)
            .args([
                "agent",
                "--server",
                &url,
                "--node",
                "n1",
                "--emulate",
                "1",
                "--ca-cert",
            ])
            .arg(&cert_path)
            .arg("--work-dir")
            .arg(dir.path().join("work"))
            .env("GPUFLOW_JOIN_TOKEN", JOIN)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let job = dir.path().join("job.yaml");
    std::fs::write(&job, "name: over-tls\nqueue: default\ntasks:\n  - name: main\n    command: [echo, secure]\n    resources: {gpu: {count: 1}}\n").unwrap();
    let (code, out, err) = cli(&["job", "submit", "-f", job.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}{err}");
    poll("the job succeeds over TLS", Duration::from_secs(60), || {
        let (_, out, _) = cli(&["job", "ls", "--state", "succeeded"]);
        out.contains("over-tls").then_some(())
    });
    // A client that does not trust the certificate is refused, and plain HTTP gets nothing.
    let out = Command::new(BIN)
        .args(["node", "ls", "--server", &url, "--token", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "the request failed");
    let plain = Api::new(&format!("http://127.0.0.1:{port}"));
    assert_ne!(plain.call("GET", "/v1/openapi.json", "", None).0, 200);
}
