//! The way into a job's web interface: a notebook gets a port by default
//! and the server proxies HTTP and WebSocket to it at
//! `/v1/jobs/{id}/proxy/{port}/`, for its team and admins only, without
//! passing the caller's token on; a browser gets in with a cookie scoped to
//! the job's proxy path. The task is a small Python server (HTTP, and a
//! WebSocket that echoes one message) on `gpuflow up` with emulated GPUs.
//! Skipped, with the reason printed, without python3.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(60);

/// Serves on `$PORT`: a WebSocket upgrade echoes one text message back as
/// `echo:<it>`; any other request is answered with what the task saw.
const SERVER: &str = r#"
import base64, hashlib, os, socket, threading
base = os.environ["GPUFLOW_BASE_URL"]
def recvn(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def handle(c):
    data = b""
    while b"\r\n\r\n" not in data:
        d = c.recv(4096)
        if not d:
            return
        data += d
    lines = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
    path = lines[0].split()[1]
    h = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    if h.get("upgrade", "").lower() == "websocket":
        key = h["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        acc = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
        c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                   "Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n" % acc).encode())
        hdr = recvn(c, 2)
        mask = recvn(c, 4)
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(recvn(c, hdr[1] & 0x7f)))
        out = b"echo:" + payload
        c.sendall(bytes([0x81, len(out)]) + out)
    else:
        body = ("path=%s base=%s auth=%s cookie=%s" % (path, base,
                h.get("authorization", "-"), h.get("cookie", "-"))).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(os.environ["PORT"])))
s.listen(16)
print("serving", os.environ["PORT"], flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"#;

fn http() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .max_redirects(0)
        .build()
        .into()
}

/// `(status, body)` of a GET with the given headers.
fn get(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut r = http().get(url);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let mut resp = r.call().unwrap();
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

#[test]
fn a_notebooks_port_is_proxied_to_its_team_only_over_http_and_websocket() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let (alpha, beta) = api.alpha_and_beta(&admin);
    let yaml = format!(
        "name: nb\nqueue: alpha-q\nkind: notebook\nmax_runtime_s: 600\ntasks:\n  - name: main\n    command: [python3, -c, {SERVER:?}]\n    resources: {{cpu: 0.1, memory_mib: 128}}\n"
    );
    let (s, v) = api.submit_yaml(&alpha, &yaml);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();

    // The job shows its port and the path it is proxied at once it runs
    // and serves.
    let port = poll("the notebook serves", LONG, || {
        let j = api.job(id, &alpha);
        let p = &j["tasks"][0]["ports"][0];
        let log = api.get(&format!("/v1/jobs/{id}/logs"), &alpha);
        (p["name"] == "http" && log["tasks"]["main/0"].as_str()?.contains("serving"))
            .then(|| p["port"].as_u64().unwrap())
    });
    let path = format!("/v1/jobs/{id}/proxy/{port}/");
    assert_eq!(api.job(id, &alpha)["tasks"][0]["ports"][0]["url"], path);
    let url = format!("{}{path}", api.url);

    // Its team reaches it with its path and query as sent; the task sees
    // its base path and not the caller's token.
    let auth = format!("Bearer {alpha}");
    let (s, body) = get(&format!("{url}lab?x=1"), &[("Authorization", &auth)]);
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        body,
        format!("path={path}lab?x=1 base={path} auth=- cookie=-")
    );
    // Without the trailing slash: redirected under it.
    let (s, _) = get(url.trim_end_matches('/'), &[("Authorization", &auth)]);
    assert_eq!(s, 308);

    // Another team's member, no token, a port the job did not declare.
    let (s, body) = get(&url, &[("Authorization", &format!("Bearer {beta}"))]);
    assert_eq!(s, 404, "{body}");
    assert!(!body.contains("path="), "{body}");
    let (s, _) = get(&url, &[]);
    assert_eq!(s, 401);
    let (s, body) = get(
        &format!("{}/v1/jobs/{id}/proxy/22/", api.url),
        &[("Authorization", &auth)],
    );
    assert_eq!(s, 404, "{body}");
    assert!(
        body.contains(&format!("its ports: {port} (http)")),
        "{body}"
    );
    // The admin sees every job.
    let (s, _) = get(&url, &[("Authorization", &format!("Bearer {admin}"))]);
    assert_eq!(s, 200);

    // A browser: a cookie for this job's proxy path only, which the task
    // never sees (its own cookies pass).
    let resp = http()
        .post(&format!("{}/v1/jobs/{id}/proxy-session", api.url))
        .header("Authorization", &auth)
        .send_empty()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 204);
    let cookie = resp
        .headers()
        .get("set-cookie")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        cookie.contains(&format!("Path=/v1/jobs/{id}/proxy/")) && cookie.contains("HttpOnly"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap();
    let (s, body) = get(&url, &[("Cookie", &format!("theme=dark; {pair}"))]);
    assert_eq!(s, 200, "{body}");
    assert!(body.ends_with("auth=- cookie=theme=dark"), "{body}");
    // The cookie is not a token for the rest of the API.
    let (s, _) = get(&format!("{}/v1/jobs/{id}", api.url), &[("Cookie", pair)]);
    assert_eq!(s, 401);
    // Another team cannot get a cookie for it.
    let s = http()
        .post(&format!("{}/v1/jobs/{id}/proxy-session", api.url))
        .header("Authorization", &format!("Bearer {beta}"))
        .send_empty()
        .unwrap()
        .status()
        .as_u16();
    assert_eq!(s, 404);

    // A WebSocket through the proxy.
    let ws_url = format!("{}{path}ws", api.url.replace("http://", "ws://"));
    let mut req =
        tungstenite::client::IntoClientRequest::into_client_request(ws_url.as_str()).unwrap();
    req.headers_mut()
        .insert("Authorization", auth.parse().unwrap());
    let host = api.url.trim_start_matches("http://").to_string();
    let stream = std::net::TcpStream::connect(&host).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (mut ws, resp) = tungstenite::client(req, stream).unwrap();
    assert_eq!(resp.status().as_u16(), 101);
    ws.send(tungstenite::Message::text("hi")).unwrap();
    let m = ws.read().unwrap();
    assert_eq!(m.into_text().unwrap().as_str(), "echo:hi");

    // `job get` prints the address.
    let out = Command::new(BIN)
        .args(["job", "get", &id.to_string()])
        .env("GPUFLOW_SERVER", &api.url)
        .env("GPUFLOW_TOKEN", &alpha)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("{}{path}", api.url)), "{text}");

    // Once it ends, there is nothing to proxy to.
    let (s, v) = api.post_json(
        &format!("/v1/jobs/{id}/cancel"),
        &alpha,
        &serde_json::json!({}),
    );
    assert!(s == 200 || s == 202, "{v}");
    poll("the proxy closes", LONG, || {
        let (s, _) = get(&url, &[("Authorization", &auth)]);
        (s == 404).then_some(())
    });
}
