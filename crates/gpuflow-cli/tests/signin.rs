//! Sign-in through a real OpenID Connect provider on loopback (Debian's
//! glewlwyd, set up here through its admin API): `gpuflow login` by the
//! device flow, sessions whose user's groups are read again from the
//! provider (a group change changes the role, a removed group loses it, a
//! provider that no longer renews ends the session), sessions revoked,
//! key rotation at the provider, and ID tokens for another client or
//! signed with a key the provider no longer publishes, refused.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const SCHEMA: &str = "/usr/share/dbconfig-common/data/glewlwyd/install/sqlite3";

/// Why the provider cannot run here, if it cannot.
fn missing() -> Option<String> {
    for tool in ["glewlwyd", "sqlite3"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("{tool} is not installed (.ci/run installs it)"));
        }
    }
    (!Path::new(SCHEMA).exists()).then(|| format!("{SCHEMA} is missing"))
}

/// glewlwyd on a loopback port with a database of its own, its admin
/// signed in.
struct Idp {
    _proc: Proc,
    base: String,
    http: ureq::Agent,
    admin: String,
}

/// An answer: status, JSON body (or null) and the session cookie set.
type Answer = (u16, Value, Option<String>);

impl Idp {
    fn start(dir: &Path) -> Idp {
        let db = dir.join("idp.db");
        let status = Command::new("sqlite3")
            .arg(&db)
            .stdin(std::fs::File::open(SCHEMA).unwrap())
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "the provider's schema does not load");
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let conf = dir.join("glewlwyd.conf");
        std::fs::write(
            &conf,
            format!(
                "port={port}\nexternal_url=\"{base}\"\nlogin_url=\"login.html\"\napi_prefix=\"api\"\n\
                 log_mode=\"file\"\nlog_level=\"INFO\"\nlog_file=\"{}\"\ncookie_secure=0\n\
                 session_expiration=86400\nsession_key=\"GLEWLWYD2_SESSION_ID\"\n\
                 admin_session_authentication=\"cookie\"\nprofile_session_authentication=\"cookie\"\n\
                 allow_multiple_user_per_session=true\nlogin_api_enabled=true\n\
                 admin_scope=\"g_admin\"\nprofile_scope=\"g_profile\"\n\
                 user_module_path=\"/usr/lib/glewlwyd/user\"\nclient_module_path=\"/usr/lib/glewlwyd/client\"\n\
                 user_auth_scheme_module_path=\"/usr/lib/glewlwyd/scheme\"\nplugin_module_path=\"/usr/lib/glewlwyd/plugin\"\n\
                 hash_algorithm=\"SHA512\"\ndatabase = {{ type = \"sqlite3\"\n path = \"{}\" }}\n",
                dir.join("glewlwyd.log").display(),
                db.display()
            ),
        )
        .unwrap();
        let proc = Proc(
            Command::new("glewlwyd")
                .arg(format!("--config-file={}", conf.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let http: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut idp = Idp {
            _proc: proc,
            base,
            http,
            admin: String::new(),
        };
        idp.admin = poll("the provider answers", Duration::from_secs(30), || {
            idp.sign_in("admin", "password")
        });
        idp
    }

    fn call(&self, method: &str, path: &str, cookie: Option<&str>, body: Option<Value>) -> Answer {
        let url = format!("{}/api{path}", self.base);
        let with = |r: ureq::RequestBuilder<ureq::typestate::WithBody>| match cookie {
            Some(c) => r.header("Cookie", c),
            None => r,
        };
        let without = |r: ureq::RequestBuilder<ureq::typestate::WithoutBody>| match cookie {
            Some(c) => r.header("Cookie", c),
            None => r,
        };
        let resp = match (method, body) {
            ("GET", _) => without(self.http.get(&url)).call(),
            ("DELETE", _) => without(self.http.delete(&url)).call(),
            ("PUT", b) => with(self.http.put(&url)).send_json(b.unwrap_or(json!({}))),
            (_, b) => with(self.http.post(&url)).send_json(b.unwrap_or(json!({}))),
        };
        let Ok(mut resp) = resp else {
            return (0, Value::Null, None);
        };
        let set = resp
            .headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(str::to_string);
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::Null),
            set,
        )
    }

    /// The session cookie of `user`, signed in with `password`.
    fn sign_in(&self, user: &str, password: &str) -> Option<String> {
        let (s, _, cookie) = self.call(
            "POST",
            "/auth/",
            None,
            Some(json!({"username": user, "password": password})),
        );
        (s == 200).then_some(cookie).flatten()
    }

    fn admin(&self, method: &str, path: &str, body: Value) -> Value {
        let (s, v, _) = self.call(method, path, Some(&self.admin), Some(body));
        assert_eq!(s, 200, "{method} {path}: {v}");
        v
    }

    /// The OIDC plugin signing with `key` (its ID tokens living `ttl` s).
    fn plugin(&self, key: &rcgen::KeyPair, ttl: u64, method: &str) {
        let body = json!({
            "module": "oidc", "name": "oidc", "display_name": "OIDC", "enabled": true,
            "parameters": {
                "iss": self.issuer(), "jwt-type": "ecdsa", "jwt-key-size": "256",
                "key": key.serialize_pem(), "cert": key.public_key_pem(),
                "access-token-duration": ttl, "refresh-token-duration": 86400, "code-duration": 600,
                "refresh-token-rolling": true, "allow-non-oidc": false,
                "auth-type-code-enabled": true, "auth-type-token-enabled": false,
                "auth-type-id-token-enabled": true, "auth-type-password-enabled": false,
                "auth-type-client-enabled": false, "auth-type-refresh-enabled": true,
                "auth-type-device-enabled": true, "pkce-allowed": true,
                "claims": [
                    {"name": "groups", "user-property": "groups", "type": "string",
                     "mandatory": true, "on-demand": false, "scope": []},
                    {"name": "preferred_username", "user-property": "username", "type": "string",
                     "mandatory": true, "on-demand": false, "scope": []}
                ]
            }
        });
        if method == "POST" {
            self.admin("POST", "/mod/plugin/", body);
        } else {
            self.admin("PUT", "/mod/plugin/oidc", body);
            self.admin("PUT", "/mod/plugin/oidc/reset", json!({}));
        }
    }

    fn issuer(&self) -> String {
        format!("{}/api/oidc", self.base)
    }

    /// Users, with groups, and the two public clients (they send browsers
    /// back to `redirects`).
    fn setup(&self, key: &rcgen::KeyPair, redirects: &[String]) {
        // The user store keeps a `groups` list.
        let (_, mut m, _) = self.call("GET", "/mod/user/database", Some(&self.admin), None);
        m["parameters"]["data-format"]["groups"] = json!({"multiple": true, "read": true,
            "write": true, "profile-read": true, "profile-write": false});
        self.admin("PUT", "/mod/user/database", m);
        self.admin("PUT", "/mod/user/database/reset", json!({}));
        self.plugin(key, 3600, "POST");
        for client in ["gpuflow", "other"] {
            self.admin(
                "POST",
                "/client/",
                json!({"client_id": client, "client_name": client, "confidential": false,
                    "authorization_type": ["code", "device_authorization", "refresh_token"],
                    "redirect_uri": redirects, "scope": ["openid"], "enabled": true}),
            );
        }
        self.admin(
            "POST",
            "/user/",
            json!({"username": "ann", "name": "Ann", "password": "ann-password", "email": "",
                "enabled": true, "scope": ["openid"], "groups": ["ml-team"]}),
        );
    }

    fn set_user(&self, fields: Value) {
        let mut u = json!({"name": "Ann", "email": "", "enabled": true, "scope": ["openid"]});
        for (k, v) in fields.as_object().unwrap() {
            u[k] = v.clone();
        }
        self.admin("PUT", "/user/ann", u);
    }

    /// What ann does in a browser: signs in, grants the client, enters
    /// the code.
    fn approve(&self, client: &str, user_code: &str) {
        let cookie = self.sign_in("ann", "ann-password").expect("ann signs in");
        let (s, v, _) = self.call(
            "PUT",
            &format!("/auth/grant/{client}"),
            Some(&cookie),
            Some(json!({"scope": "openid"})),
        );
        assert_eq!(s, 200, "grant: {v}");
        let (s, _, _) = self.call(
            "GET",
            &format!("/oidc/device?code={user_code}&g_continue"),
            Some(&cookie),
            None,
        );
        assert_eq!(s, 302, "the code is accepted");
    }

    /// Ann ends all her sign-ins for `client` at the provider (her
    /// profile's refresh tokens, each disabled).
    fn revoke_all(&self, client: &str) {
        let cookie = self.sign_in("ann", "ann-password").expect("ann signs in");
        let (s, list, _) = self.call("GET", "/oidc/token?limit=100", Some(&cookie), None);
        assert_eq!(s, 200, "{list}");
        for t in list.as_array().unwrap() {
            if t["client_id"] == client && t["enabled"] == true {
                let hash: String =
                    form_urlencoded::byte_serialize(t["token_hash"].as_str().unwrap().as_bytes())
                        .collect();
                let (s, v, _) = self.call(
                    "DELETE",
                    &format!("/oidc/token/{hash}"),
                    Some(&cookie),
                    None,
                );
                assert_eq!(s, 200, "{v}");
            }
        }
    }

    /// Where the provider sends ann's browser back from `auth_url` (an
    /// authorization request), signed in and the client granted.
    fn authorize(&self, auth_url: &str) -> String {
        let cookie = self.sign_in("ann", "ann-password").expect("ann signs in");
        let resp = self
            .http
            .get(format!("{auth_url}&g_continue"))
            .header("Cookie", &cookie)
            .call()
            .unwrap();
        resp.headers()
            .get("location")
            .expect("a redirect")
            .to_str()
            .unwrap()
            .to_string()
    }

    /// The authorization code flow with PKCE as a browser of ann's would
    /// go through it (signed in, the client granted): the code sent back.
    fn code(&self, challenge: &str, nonce: &str, redirect: &str) -> String {
        let cookie = self.sign_in("ann", "ann-password").expect("ann signs in");
        let q: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs([
                ("response_type", "code"),
                ("client_id", "gpuflow"),
                ("redirect_uri", redirect),
                ("scope", "openid"),
                ("state", "s"),
                ("nonce", nonce),
                ("code_challenge", challenge),
                ("code_challenge_method", "S256"),
            ])
            .finish();
        let resp = self
            .http
            .get(format!("{}/api/oidc/auth?{q}&g_continue", self.base))
            .header("Cookie", &cookie)
            .call()
            .unwrap();
        let to = resp.headers().get("location").unwrap().to_str().unwrap();
        to.split("code=")
            .nth(1)
            .expect("a code")
            .split('&')
            .next()
            .unwrap()
            .to_string()
    }

    /// A whole device flow for `client`, approved by ann: the token answer.
    fn device_tokens(&self, client: &str) -> Value {
        let form = |url: &str, f: &[(&str, &str)]| -> Value {
            let mut r = self.http.post(url).send_form(f.iter().copied()).unwrap();
            r.body_mut().read_json().unwrap()
        };
        let d = form(
            &format!("{}/device_authorization/", self.issuer()),
            &[("client_id", client), ("scope", "openid")],
        );
        self.approve(client, d["user_code"].as_str().unwrap());
        form(
            &format!("{}/token", self.issuer()),
            &[
                ("grant_type", "urn:ietf:params:oauth:grant-type:device_code"),
                ("client_id", client),
                ("device_code", d["device_code"].as_str().unwrap()),
            ],
        )
    }
}

/// `gpuflow` with the config file `cfg` and no other credentials.
fn gpuflow(cfg: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("GPUFLOW_CONFIG", cfg)
        .env_remove("GPUFLOW_TOKEN")
        .env_remove("GPUFLOW_SERVER")
        .env_remove("GPUFLOW_CONTEXT")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `gpuflow login` against `url`, ann entering the code it prints.
fn login(idp: &Idp, cfg: &Path, url: &str) -> String {
    let mut child = Command::new(BIN)
        .args(["login", "--server", url])
        .env("GPUFLOW_CONFIG", cfg)
        .env_remove("GPUFLOW_TOKEN")
        .env_remove("GPUFLOW_SERVER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    let code = loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "login said: {said}");
        said.push_str(&line);
        if let Some(c) = line.split("enter the code ").nth(1) {
            break c.trim().to_string();
        }
    };
    idp.approve("gpuflow", &code);
    let out = child.wait_with_output().unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    assert!(out.status.success(), "login failed: {said}{rest}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn session(api: &Api, id_token: &str, refresh: Option<&str>) -> (u16, Value) {
    api.post_json(
        "/v1/auth/sessions",
        "",
        &json!({"id_token": id_token, "refresh_token": refresh}),
    )
}

/// glewlwyd set up with ann and the clients, and `gpuflow up` trusting it
/// (its sessions read the groups again every `recheck_s`), with team ml.
struct Platform {
    idp: Idp,
    _up: Proc,
    api: Api,
    admin: String,
    redirect: String,
    /// The loopback port `gpuflow login --browser` may come back to.
    callback: u16,
}

fn platform(dir: &Path, recheck_s: u64) -> Platform {
    let idp = Idp::start(dir);
    let key = rcgen::KeyPair::generate().unwrap();
    let port = free_port();
    let redirect = format!("http://127.0.0.1:{port}/ui/");
    let callback = free_port();
    idp.setup(
        &key,
        &[
            redirect.clone(),
            format!("http://127.0.0.1:{callback}/callback"),
        ],
    );
    let oidc = dir.join("oidc.yaml");
    std::fs::write(
        &oidc,
        format!(
            "providers:\n- name: corp\n  issuer: {}\n  client_id: gpuflow\n  recheck_s: {recheck_s}\n  rules:\n  - {{group: ml-team, team: ml, role: member}}\n  - {{group: ml-leads, team: ml, role: team-lead}}\n",
            idp.issuer()
        ),
    )
    .unwrap();
    let (up, api, admin) = up_with(
        &dir.join("data"),
        port,
        &[
            "--emulate",
            "1xemu-gpu",
            "--oidc-config",
            oidc.to_str().unwrap(),
        ],
        &[],
    );
    let (s, v) = api.post_json("/v1/teams", &admin, &json!({"name": "ml"}));
    assert_eq!(s, 201, "{v}");
    Platform {
        idp,
        _up: up,
        api,
        admin,
        redirect,
        callback,
    }
}

#[test]
fn a_user_signs_in_through_the_organisations_provider_and_its_groups_decide() {
    if let Some(why) = missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Platform {
        idp,
        _up,
        api,
        admin,
        redirect,
        callback,
    } = platform(dir.path(), 1);
    let cfg: PathBuf = dir.path().join("config");

    // `gpuflow login`: the device flow; the user is made from the claims.
    let out = login(&idp, &cfg, &api.url);
    assert!(
        out.contains("user:        ann") && out.contains("role:        member"),
        "{out}"
    );
    assert!(
        out.contains("signed in:   through corp (OpenID Connect), subject"),
        "{out}"
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        text.contains("token: gfs_") && text.contains("provider: corp"),
        "{text}"
    );
    assert!(
        !text.contains("eyJ"),
        "the provider's tokens stay with the server: {text}"
    );
    let whoami = |want: i32| {
        let (code, out, err) = gpuflow(&cfg, &["whoami"]);
        assert_eq!(code, Some(want), "{out}{err}");
        format!("{out}{err}")
    };
    assert!(whoami(0).contains("the sign-in through corp kept in context"));
    // Its session is listed as a token of the user's.
    let tokens = api.get("/v1/tokens", &admin);
    assert!(
        tokens
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["user"] == "ann" && t["provider"] == "corp"),
        "{tokens}"
    );

    // The groups are read again from the provider as the session goes on:
    // a new group, a new role; no group, no role; back again.
    idp.set_user(json!({"groups": ["ml-leads"]}));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(whoami(0).contains("role:        team-lead"));
    idp.set_user(json!({"groups": []}));
    std::thread::sleep(Duration::from_millis(1500));
    let said = whoami(1);
    assert!(said.contains("none of your groups"), "{said}");
    idp.set_user(json!({"groups": ["ml-team"]}));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(whoami(0).contains("role:        member"));
    let audit = api.get("/v1/audit", &admin).to_string();
    assert!(
        audit.contains("user.signin") && audit.contains("user.role"),
        "{audit}"
    );
    // Every line of ann's names her subject at the provider.
    let lines = api.get("/v1/audit", &admin);
    let ann: Vec<&Value> = lines
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["actor"] == "ann")
        .collect();
    assert!(
        !ann.is_empty()
            && ann.iter().all(|a| a["subject"]
                .as_str()
                .is_some_and(|s| s.starts_with("corp:"))),
        "{lines}"
    );

    // `gpuflow login --browser`: the code flow with PKCE, back to the
    // CLI's listener on loopback; here the test plays ann's browser.
    let mut child = Command::new(BIN)
        .args([
            "login",
            "--browser",
            "--callback-port",
            &callback.to_string(),
        ])
        .args(["--server", &api.url])
        .env("GPUFLOW_CONFIG", dir.path().join("config-browser"))
        .env_remove("DISPLAY")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("GPUFLOW_TOKEN")
        .env_remove("GPUFLOW_SERVER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let auth_url = loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "login --browser said nothing"
        );
        if let Some(u) = line.split("open in your browser: ").nth(1) {
            break u.trim().to_string();
        }
    };
    let back = idp.authorize(&auth_url);
    assert!(
        back.starts_with(&format!("http://127.0.0.1:{callback}/callback?")),
        "{back}"
    );
    let (s, _) = Api::new(&back).call("GET", "", "", None);
    assert_eq!(s, 200);
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("user:        ann"),
        "{text}"
    );

    // An admin ends ann's sessions: refused at once, said by whom.
    let (code, _, err) = gpuflow(
        &cfg,
        &[
            "user", "signout", "ann", "--server", &api.url, "--token", &admin,
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let said = whoami(1);
    assert!(said.contains("revoked by admin"), "{said}");

    // A provider that no longer renews the sign-in ends the session: ann
    // signs out everywhere at the provider.
    login(&idp, &cfg, &api.url);
    assert!(whoami(0).contains("role:        member"));
    idp.revoke_all("gpuflow");
    std::thread::sleep(Duration::from_millis(1500));
    let said = whoami(1);
    assert!(said.contains("revoked by provider corp"), "{said}");

    // An ID token for another client is refused.
    let other = idp.device_tokens("other");
    let (s, v) = session(&api, other["id_token"].as_str().unwrap(), None);
    assert_eq!((s, v["code"].as_str()), (401, Some("oidc_audience")), "{v}");

    // Key rotation at the provider: new tokens are signed with a key the
    // server has not seen, which it fetches; a token signed with the old
    // key, no longer published, is refused.
    let before = idp.device_tokens("gpuflow");
    let old_id = before["id_token"].as_str().unwrap().to_string();
    let (s, v) = session(&api, &old_id, None);
    assert_eq!(s, 201, "{v}");
    let rotated = rcgen::KeyPair::generate().unwrap();
    idp.plugin(&rotated, 3600, "PUT");
    // The server fetches keys at most every 10 s.
    std::thread::sleep(Duration::from_secs(10));
    let after = idp.device_tokens("gpuflow");
    let (s, v) = session(&api, after["id_token"].as_str().unwrap(), None);
    assert_eq!(s, 201, "a token of the new key: {v}");
    let (s, v) = session(&api, &old_id, None);
    assert_eq!((s, v["code"].as_str()), (401, Some("oidc_key")), "{v}");

    // The dashboard's flow, by API: a code with its PKCE verifier and the
    // nonce the ID token must carry; a code is taken once.
    use base64::Engine as _;
    use sha2::Digest as _;
    let verifier = "a-verifier-of-forty-three-characters-or-more-0123";
    let challenge = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(sha2::Sha256::digest(verifier.as_bytes()));
    let exchange = |code: &str, nonce: &str| {
        api.post_json(
            "/v1/auth/code",
            "",
            &json!({"provider": "corp", "code": code, "code_verifier": verifier,
                "redirect_uri": redirect, "nonce": nonce}),
        )
    };
    let code = idp.code(&challenge, "n-1", &redirect);
    let (s, v) = exchange(&code, "n-1");
    assert_eq!(s, 201, "{v}");
    assert!(v["token"].as_str().unwrap().starts_with("gfs_"), "{v}");
    let (s, v) = exchange(&code, "n-1");
    assert_eq!((s, v["code"].as_str()), (401, Some("code_replayed")), "{v}");
    // An ID token from another sign-in (its nonce is not this one's).
    let code = idp.code(&challenge, "n-2", &redirect);
    let (s, v) = exchange(&code, "n-3");
    assert_eq!((s, v["code"].as_str()), (401, Some("oidc_nonce")), "{v}");
    // A code the provider did not give.
    let (s, v) = exchange("made-up", "n-1");
    assert_eq!((s, v["code"].as_str()), (401, Some("code_refused")), "{v}");

    // Garbage and a token altered after signing: refused.
    let (s, v) = session(&api, "not-a-jwt", None);
    assert_eq!(
        (s, v["code"].as_str()),
        (401, Some("oidc_malformed")),
        "{v}"
    );
    let good = after["id_token"].as_str().unwrap();
    // Its signature swapped for another token's.
    let mut parts: Vec<String> = good.split('.').map(str::to_string).collect();
    parts[2] = before["id_token"]
        .as_str()
        .unwrap()
        .split('.')
        .nth(2)
        .unwrap()
        .to_string();
    let (s, v) = session(&api, &parts.join("."), None);
    assert_eq!(
        (s, v["code"].as_str()),
        (401, Some("oidc_signature")),
        "{v}"
    );
}

fn which(name: &str) -> Option<String> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !p.is_empty()).then_some(p)
}

/// The dashboard signs in through the provider in headless Chromium: the
/// authorization code flow with PKCE, the code exchanged by the server.
#[test]
fn the_dashboard_signs_in_through_the_provider() {
    if let Some(why) = missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let (Some(chrome), Some(driver)) = (which("chromium"), which("chromedriver")) else {
        eprintln!("skipped: chromium and chromedriver are not installed");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let Platform {
        idp,
        _up,
        api,
        admin,
        redirect,
        ..
    } = platform(dir.path(), 300);
    let dport = free_port();
    let _driver = Proc(
        Command::new(driver)
            .arg(format!("--port={dport}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    poll("chromedriver listens", Duration::from_secs(30), || {
        std::net::TcpStream::connect(("127.0.0.1", dport)).ok()
    });
    let profile = dir.path().join("chromium");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        use fantoccini::{ClientBuilder, Locator};
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({"binary": chrome, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", format!("--user-data-dir={}", profile.display())]}),
        );
        let b = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{dport}"))
            .await
            .expect("chromedriver starts a Chromium session");
        // Ann signs in at the provider in this browser and grants the
        // client, as its login page would have her do.
        b.goto(&format!("{}/api/oidc/jwks", idp.base))
            .await
            .unwrap();
        let done = b
            .execute_async(
                "const cb = arguments[arguments.length - 1];
                 (async () => {
                   const j = { 'Content-Type': 'application/json' };
                   const a = await fetch('/api/auth/', { method: 'POST', headers: j,
                     body: JSON.stringify({ username: 'ann', password: 'ann-password' }) });
                   const g = await fetch('/api/auth/grant/gpuflow', { method: 'PUT', headers: j,
                     body: JSON.stringify({ scope: 'openid' }) });
                   cb([a.status, g.status]);
                 })();",
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(done, json!([200, 200]));
        // The dashboard offers the provider; its button goes there.
        b.goto(&redirect).await.unwrap();
        let button = b
            .wait()
            .at_most(Duration::from_secs(30))
            .for_element(Locator::Css("button[data-provider=corp]"))
            .await
            .unwrap();
        button.click().await.unwrap();
        // The provider's login page would now continue the sign-in (its
        // page is not served here): its callback, continued.
        let end = std::time::Instant::now() + Duration::from_secs(30);
        let at_login = loop {
            let u = b.current_url().await.unwrap().to_string();
            if u.contains("login.html") {
                break u;
            }
            assert!(
                std::time::Instant::now() < end,
                "never at the provider: {u}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let callback = url_param(&at_login, "callback_url").expect("a callback");
        b.goto(&format!("{callback}&g_continue")).await.unwrap();
        // Back at the dashboard: signed in as ann, the code gone from the
        // address bar.
        let end = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(e) = b.find(Locator::Css("#who")).await
                && e.text().await.unwrap_or_default().contains("ann")
            {
                break;
            }
            assert!(
                std::time::Instant::now() < end,
                "never signed in: {}",
                b.current_url().await.unwrap()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let now = b.current_url().await.unwrap().to_string();
        assert!(!now.contains("code="), "{now}");
        b.close().await.unwrap();
    });
    let audit = api.get("/v1/audit", &admin).to_string();
    assert!(
        audit.contains("session.create") && audit.contains("corp subject"),
        "{audit}"
    );
}

/// A query parameter of `url`, decoded.
fn url_param(url: &str, name: &str) -> Option<String> {
    let q = url.split_once('?')?.1;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}
