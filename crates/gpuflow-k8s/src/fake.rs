//! An in-process Kubernetes API server for tests and benchmarks.
//!
//! It speaks the wire protocol of every call gpuflow makes, so the real
//! kube-rs client path runs against it:
//! - list with `limit` and `continue`, and watch from a `resourceVersion`
//!   with bookmarks; a watch from a version older than the last compaction
//!   gets the `410 Gone` error event a real server sends;
//! - get, create (with `generateName`), replace with optimistic concurrency
//!   (`409 Conflict` on a stale `resourceVersion`; a test can make the next
//!   replace lose such a race), JSON merge patch of an
//!   object or of its `status` (with the same `409` when the patch names a
//!   `resourceVersion` that is not the object's), and delete with a grace period (a bound pod
//!   is marked terminating and removed once its grace has passed, as its
//!   kubelet would);
//! - the pods' `binding` subresource (`409` for a pod already bound), after
//!   which the pod runs.
//!
//! It knows the resources gpuflow uses (nodes, pods, events, leases,
//! pod disruption budgets, namespaces, batch Jobs and `GpuQueue`s) and answers `404`
//! for any other; selectors, strategic merge and server-side apply are
//! refused with `400` or `415`, not ignored. Every request is logged, and
//! every binding with its outcome, for tests to check.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// A resource the fake serves: its path, kind and scope.
struct Resource {
    /// `v1` for the core group, else `group/version`.
    api_version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
}

const RESOURCES: &[Resource] = &[
    Resource {
        api_version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
    },
    Resource {
        api_version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
    },
    Resource {
        api_version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
    },
    Resource {
        api_version: "v1",
        plural: "namespaces",
        kind: "Namespace",
        namespaced: false,
    },
    Resource {
        api_version: "coordination.k8s.io/v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
    },
    Resource {
        api_version: "policy/v1",
        plural: "poddisruptionbudgets",
        kind: "PodDisruptionBudget",
        namespaced: true,
    },
    Resource {
        api_version: "batch/v1",
        plural: "jobs",
        kind: "Job",
        namespaced: true,
    },
    Resource {
        api_version: "gpuflow.io/v1alpha1",
        plural: "gpuqueues",
        kind: "GpuQueue",
        namespaced: false,
    },
];

/// An object's key: resource index, namespace ("" for cluster-scoped), name.
type Key = (usize, String, String);

/// One change, as a watch sends it.
#[derive(Clone)]
struct Change {
    rv: u64,
    resource: usize,
    namespace: String,
    kind: &'static str,
    object: Value,
}

/// A binding request and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindRecord {
    pub pod: String,
    pub node: String,
    /// The HTTP status answered: 201; 409 for a pod already bound; 503 for
    /// a binding stalled and then cut off.
    pub status: u16,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    changes: Vec<Change>,
    /// Watches from a version before this one get `410 Gone`.
    compacted: u64,
    /// Terminating pods and when their grace ends.
    terminating: BTreeMap<Key, Instant>,
    requests: Vec<String>,
    binds: Vec<BindRecord>,
    /// Bindings past this many wait until it is lifted (a scheduler that
    /// stops in the middle of a gang).
    stall_binds_after: Option<usize>,
    /// The next replace of this kind finds the object written by someone
    /// else since it was read.
    race_next_replace: Option<&'static str>,
    /// Resources (plural) every request for is refused with `403`, as RBAC
    /// would refuse a service account without the rule.
    forbidden: std::collections::BTreeSet<String>,
    uid: u64,
}

/// The fake server's state, shared by its handlers and the test that runs it.
#[derive(Clone)]
pub struct FakeApi {
    store: Arc<Mutex<Store>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for FakeApi {
    fn default() -> Self {
        FakeApi {
            store: Arc::default(),
            changed: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    (code, axum::Json(body)).into_response()
}

/// JSON merge patch (RFC 7386).
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// A parsed request path.
struct Target {
    resource: usize,
    namespace: String,
    name: Option<String>,
    sub: Option<String>,
}

fn parse(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api_version, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("v1".to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, r, rest @ ..] => (
            ns.to_string(),
            std::iter::once(r).chain(rest).copied().collect::<Vec<_>>(),
        ),
        r => (String::new(), r.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return None,
    };
    let resource = RESOURCES
        .iter()
        .position(|r| r.api_version == api_version && r.plural == plural)?;
    if RESOURCES[resource].namespaced == namespace.is_empty() && name.is_some() {
        return None;
    }
    Some(Target {
        resource,
        namespace,
        name,
        sub,
    })
}

fn query(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .map(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .map(|(k, v)| (k.to_string(), percent_decode(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let h = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match h.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Store {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, key: &Key, object: Value) {
        let rv = self.rv;
        self.changes.push(Change {
            rv,
            resource: key.0,
            namespace: key.1.clone(),
            kind: "MODIFIED",
            object,
        });
    }

    fn put(&mut self, key: Key, mut object: Value, kind: &'static str) -> Value {
        let rv = self.bump();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key.clone(), object.clone());
        self.record(&key, object.clone());
        self.changes.last_mut().expect("just recorded").kind = kind;
        object
    }

    fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut object = self.objects.remove(key)?;
        self.terminating.remove(key);
        let rv = self.bump();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record(key, object.clone());
        self.changes.last_mut().expect("just recorded").kind = "DELETED";
        Some(object)
    }
}

impl FakeApi {
    /// Serves on `127.0.0.1` at a free port; returns its address. The
    /// server and its kubelet (which removes terminating pods when their
    /// grace ends) run until the runtime stops.
    pub async fn serve(&self) -> std::io::Result<std::net::SocketAddr> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = Router::new().fallback(handle).with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                me.kubelet();
            }
        });
        Ok(addr)
    }

    fn changed(&self, rv: u64) {
        self.changed.send_replace(rv);
    }

    /// Lets go of the store and wakes the watches up to its newest version.
    fn publish(&self, s: std::sync::MutexGuard<'_, Store>) {
        let rv = s.rv;
        drop(s);
        self.changed(rv);
    }

    fn kubelet(&self) {
        let mut s = self.store.lock().expect("fake store");
        let now = Instant::now();
        let due: Vec<Key> = s
            .terminating
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &due {
            s.remove(k);
        }
        if !due.is_empty() {
            self.publish(s);
        }
    }

    /// Creates or replaces an object, as a user or controller would.
    /// `object` must carry `apiVersion`, `kind` and `metadata.name`.
    pub fn apply(&self, object: Value) {
        let api_version = object["apiVersion"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        let resource = RESOURCES
            .iter()
            .position(|r| r.api_version == api_version && r.kind == kind)
            .unwrap_or_else(|| panic!("the fake does not serve {api_version} {kind}"));
        let name = object["metadata"]["name"]
            .as_str()
            .expect("a name")
            .to_string();
        let namespace = if RESOURCES[resource].namespaced {
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        let mut s = self.store.lock().expect("fake store");
        let key = (resource, namespace, name);
        let mut object = object;
        let existed = s.objects.get(&key).cloned();
        let kind = if let Some(old) = existed {
            object["metadata"]["uid"] = old["metadata"]["uid"].clone();
            object["metadata"]["creationTimestamp"] = old["metadata"]["creationTimestamp"].clone();
            "MODIFIED"
        } else {
            s.uid += 1;
            object["metadata"]["uid"] = json!(format!("uid-{}", s.uid));
            if object["metadata"]["creationTimestamp"].is_null() {
                object["metadata"]["creationTimestamp"] = json!(now_rfc3339());
            }
            "ADDED"
        };
        if RESOURCES[resource].namespaced {
            object["metadata"]["namespace"] = json!(key.1);
        }
        s.put(key, object, kind);
        self.publish(s);
    }

    /// Removes an object at once (a node that leaves, a pod whose kubelet
    /// reports it gone).
    pub fn remove(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> bool {
        let Some(resource) = RESOURCES
            .iter()
            .position(|r| r.api_version == api_version && r.kind == kind)
        else {
            return false;
        };
        let mut s = self.store.lock().expect("fake store");
        let gone = s
            .remove(&(resource, namespace.to_string(), name.to_string()))
            .is_some();
        self.publish(s);
        gone
    }

    /// An object as stored now.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let resource = RESOURCES
            .iter()
            .position(|r| r.api_version == api_version && r.kind == kind)?;
        let s = self.store.lock().expect("fake store");
        s.objects
            .get(&(resource, namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Every object of one kind, in key order.
    pub fn list(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let Some(resource) = RESOURCES
            .iter()
            .position(|r| r.api_version == api_version && r.kind == kind)
        else {
            return Vec::new();
        };
        let s = self.store.lock().expect("fake store");
        s.objects
            .iter()
            .filter(|(k, _)| k.0 == resource)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Forgets the change history: every watch resuming from an older
    /// version gets `410 Gone` and must list again.
    /// Open watches end with that error too, as when a server restarts.
    pub fn compact(&self) {
        let mut s = self.store.lock().expect("fake store");
        s.rv += 1;
        s.compacted = s.rv;
        s.changes.clear();
        self.publish(s);
    }

    /// Every binding requested so far, in order.
    pub fn binds(&self) -> Vec<BindRecord> {
        self.store.lock().expect("fake store").binds.clone()
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.store.lock().expect("fake store").requests.clone()
    }

    /// Holds every binding after the next `n` until [`FakeApi::release_binds`].
    pub fn stall_binds_after(&self, n: usize) {
        let mut s = self.store.lock().expect("fake store");
        s.stall_binds_after = Some(s.binds.iter().filter(|b| b.status == 201).count() + n);
    }

    /// Refuses (`403 Forbidden`) every request for `plural` until
    /// [`FakeApi::allow`].
    pub fn forbid(&self, plural: &str) {
        self.store
            .lock()
            .expect("fake store")
            .forbidden
            .insert(plural.to_string());
    }

    pub fn allow(&self, plural: &str) {
        self.store
            .lock()
            .expect("fake store")
            .forbidden
            .remove(plural);
    }

    /// Makes the next replace of an object of `kind` lose a race: another
    /// writer changes the object between the client's read and its write,
    /// so the write carries a stale `resourceVersion` and gets `409`.
    pub fn race_next_replace(&self, kind: &'static str) {
        self.store.lock().expect("fake store").race_next_replace = Some(kind);
    }

    /// Ends the stall: bindings held so far fail (`503`, never applied), as
    /// requests of a scheduler that died; later ones go through.
    pub fn release_binds(&self) {
        let mut s = self.store.lock().expect("fake store");
        s.stall_binds_after = None;
        self.publish(s);
    }
}

impl FakeApi {
    /// The watch lines after version `sent` (moved to the newest), with a
    /// bookmark; `None` when `sent` is older than the last compaction.
    fn watch_lines(
        &self,
        t: &Target,
        r: &Resource,
        sent: &mut u64,
        bookmarks: bool,
    ) -> Option<String> {
        let s = self.store.lock().expect("fake store");
        if *sent < s.compacted {
            return None;
        }
        let mut lines = String::new();
        for c in s.changes.iter().filter(|c| c.rv > *sent) {
            if c.resource == t.resource && (t.namespace.is_empty() || c.namespace == t.namespace) {
                lines.push_str(&json!({"type": c.kind, "object": c.object}).to_string());
                lines.push('\n');
            }
        }
        if bookmarks && s.rv > *sent {
            let b = json!({"type": "BOOKMARK", "object": {
                "kind": r.kind, "apiVersion": r.api_version,
                "metadata": {"resourceVersion": s.rv.to_string()}}});
            lines.push_str(&b.to_string());
            lines.push('\n');
        }
        *sent = (*sent).max(s.rv);
        Some(lines)
    }
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

async fn handle(
    State(api): State<FakeApi>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    api.store
        .lock()
        .expect("fake store")
        .requests
        .push(format!("{method} {uri}"));
    let Some(t) = parse(uri.path()) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the fake serves no {}", uri.path()),
        );
    };
    let plural = RESOURCES[t.resource].plural;
    if api
        .store
        .lock()
        .expect("fake store")
        .forbidden
        .contains(plural)
    {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "{plural} is forbidden: User \"system:serviceaccount:gpuflow-system:gpuflow-scheduler\" cannot {method} resource \"{plural}\""
            ),
        );
    }
    let q = query(&uri);
    for unsupported in [
        "labelSelector",
        "fieldSelector",
        "resourceVersionMatch",
        "dryRun",
    ] {
        if q.get(unsupported).is_some_and(|v| !v.is_empty()) {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("the fake API server does not implement {unsupported}"),
            );
        }
    }
    let body: Option<Value> = if body.is_empty() {
        None
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => Some(v),
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", format!("body: {e}")),
        }
    };
    match (method, t.name.clone(), t.sub.as_deref()) {
        (Method::GET, None, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            watch(api, t, &q).await
        }
        (Method::GET, None, None) => list(&api, &t, &q),
        (Method::GET, Some(name), None) => {
            let s = api.store.lock().expect("fake store");
            match s
                .objects
                .get(&(t.resource, t.namespace.clone(), name.clone()))
            {
                Some(o) => axum::Json(o.clone()).into_response(),
                None => not_found(&t, &name),
            }
        }
        (Method::POST, None, None) => create(&api, &t, body),
        (Method::PUT, Some(name), None) => replace(&api, &t, &name, body),
        (Method::PATCH, Some(name), sub @ (None | Some("status"))) => {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if ct != "application/merge-patch+json" {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    format!("the fake applies JSON merge patches only, not {ct}"),
                );
            }
            patch(&api, &t, &name, sub.is_some(), body.unwrap_or(Value::Null))
        }
        (Method::POST, Some(name), Some("binding")) if RESOURCES[t.resource].plural == "pods" => {
            bind(&api, &t, &name, body).await
        }
        (Method::DELETE, Some(name), None) => delete(&api, &t, &name, body),
        (m, _, sub) => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!(
                "the fake does not implement {m} on {}{}",
                uri.path(),
                sub.map(|_| "").unwrap_or("")
            ),
        ),
    }
}

fn not_found(t: &Target, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", RESOURCES[t.resource].plural),
    )
}

fn list(api: &FakeApi, t: &Target, q: &BTreeMap<String, String>) -> Response {
    let s = api.store.lock().expect("fake store");
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let after = q.get("continue").filter(|c| !c.is_empty()).cloned();
    let mut items: Vec<(String, Value)> = Vec::new();
    let mut cont = None;
    for ((r, ns, name), o) in &s.objects {
        if *r != t.resource || (!t.namespace.is_empty() && *ns != t.namespace) {
            continue;
        }
        let token = format!("{ns}/{name}");
        if after.as_ref().is_some_and(|a| token.as_str() <= a.as_str()) {
            continue;
        }
        if items.len() == limit {
            // More follow: the next page starts after the last one sent.
            cont = items.last().map(|(t, _)| t.clone());
            break;
        }
        items.push((token, o.clone()));
    }
    let r = &RESOURCES[t.resource];
    axum::Json(json!({
        "apiVersion": r.api_version,
        "kind": format!("{}List", r.kind),
        "metadata": { "resourceVersion": s.rv.to_string(), "continue": cont },
        "items": items.into_iter().map(|(_, o)| o).collect::<Vec<_>>(),
    }))
    .into_response()
}

async fn watch(api: FakeApi, t: Target, q: &BTreeMap<String, String>) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(290u64)
        .min(290);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let deadline = Instant::now() + Duration::from_secs(timeout);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let mut changed = api.changed.subscribe();
    tokio::spawn(async move {
        let mut sent = from;
        let r = &RESOURCES[t.resource];
        loop {
            let lines = api.watch_lines(&t, r, &mut sent, bookmarks);
            let Some(lines) = lines else {
                let gone = json!({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": format!("too old resource version: {sent}"),
                    "reason": "Expired", "code": 410}});
                let _ = tx.send(Ok(Bytes::from(format!("{gone}\n")))).await;
                return;
            };
            if !lines.is_empty() && tx.send(Ok(Bytes::from(lines))).await.is_err() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            match tokio::time::timeout(left, changed.changed()).await {
                Ok(Ok(())) => {}
                _ => return,
            }
        }
    });
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .expect("a watch response")
}

fn create(api: &FakeApi, t: &Target, body: Option<Value>) -> Response {
    let Some(mut object) = body else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "create needs a body".into(),
        );
    };
    let mut s = api.store.lock().expect("fake store");
    let name = match (
        object["metadata"]["name"].as_str(),
        object["metadata"]["generateName"].as_str(),
    ) {
        (Some(n), _) if !n.is_empty() => n.to_string(),
        (_, Some(g)) => {
            s.uid += 1;
            format!("{g}{:05x}", s.uid)
        }
        _ => {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name is required".into(),
            );
        }
    };
    let key = (t.resource, t.namespace.clone(), name.clone());
    if s.objects.contains_key(&key) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", RESOURCES[t.resource].plural),
        );
    }
    s.uid += 1;
    object["metadata"]["name"] = json!(name);
    object["metadata"]["uid"] = json!(format!("uid-{}", s.uid));
    object["metadata"]["creationTimestamp"] = json!(now_rfc3339());
    if !t.namespace.is_empty() {
        object["metadata"]["namespace"] = json!(t.namespace);
    }
    let r = &RESOURCES[t.resource];
    object["apiVersion"] = json!(r.api_version);
    object["kind"] = json!(r.kind);
    let out = s.put(key, object, "ADDED");
    api.publish(s);
    (StatusCode::CREATED, axum::Json(out)).into_response()
}

/// `409 Conflict` for a write against a version that is not the object's.
fn conflict(t: &Target, name: &str) -> Response {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            RESOURCES[t.resource].plural
        ),
    )
}

fn replace(api: &FakeApi, t: &Target, name: &str, body: Option<Value>) -> Response {
    let Some(mut object) = body else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "replace needs a body".into(),
        );
    };
    let mut s = api.store.lock().expect("fake store");
    let key = (t.resource, t.namespace.clone(), name.to_string());
    let Some(mut old) = s.objects.get(&key).cloned() else {
        return not_found(t, name);
    };
    if s.race_next_replace == Some(RESOURCES[t.resource].kind) {
        s.race_next_replace = None;
        old = s.put(key.clone(), old, "MODIFIED");
    }
    let want = object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default();
    let have = old["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default();
    if !want.is_empty() && want != have {
        return conflict(t, name);
    }
    object["metadata"]["uid"] = old["metadata"]["uid"].clone();
    object["metadata"]["creationTimestamp"] = old["metadata"]["creationTimestamp"].clone();
    let out = s.put(key, object, "MODIFIED");
    api.publish(s);
    axum::Json(out).into_response()
}

fn patch(api: &FakeApi, t: &Target, name: &str, status_only: bool, body: Value) -> Response {
    let mut s = api.store.lock().expect("fake store");
    let key = (t.resource, t.namespace.clone(), name.to_string());
    let Some(mut object) = s.objects.get(&key).cloned() else {
        return not_found(t, name);
    };
    // A patch that names a resourceVersion applies only to that version.
    if let Some(want) = body["metadata"]["resourceVersion"].as_str()
        && object["metadata"]["resourceVersion"].as_str() != Some(want)
    {
        return conflict(t, name);
    }
    if status_only {
        // The status subresource changes the status only.
        let mut st = object.get("status").cloned().unwrap_or(json!({}));
        merge(&mut st, &body["status"]);
        object["status"] = st;
    } else {
        let keep_status = object.get("status").cloned();
        merge(&mut object, &body);
        if let Some(st) = keep_status {
            object["status"] = st;
        }
    }
    let out = s.put(key, object, "MODIFIED");
    api.publish(s);
    axum::Json(out).into_response()
}

async fn bind(api: &FakeApi, t: &Target, name: &str, body: Option<Value>) -> Response {
    let node = body
        .as_ref()
        .and_then(|b| b["target"]["name"].as_str())
        .unwrap_or_default()
        .to_string();
    if node.is_empty() {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "target.name is required".into(),
        );
    }
    // A stalled binding waits here, as a request in flight when its client
    // dies, and never reaches the store: once released it fails.
    let mut stalled = false;
    loop {
        let now_stalled = {
            let s = api.store.lock().expect("fake store");
            s.stall_binds_after
                .is_some_and(|n| s.binds.iter().filter(|b| b.status == 201).count() >= n)
        };
        if !now_stalled {
            break;
        }
        stalled = true;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if stalled {
        let pod = format!("{}/{name}", t.namespace);
        api.store
            .lock()
            .expect("fake store")
            .binds
            .push(BindRecord {
                pod,
                node,
                status: 503,
            });
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the binding was cut off".into(),
        );
    }
    let mut s = api.store.lock().expect("fake store");
    let key = (t.resource, t.namespace.clone(), name.to_string());
    let Some(mut pod) = s.objects.get(&key).cloned() else {
        return not_found(t, name);
    };
    let pod_name = format!("{}/{name}", t.namespace);
    if let Some(on) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
        let message = format!("pod {name} is already assigned to node \"{on}\"");
        s.binds.push(BindRecord {
            pod: pod_name,
            node,
            status: 409,
        });
        return status(StatusCode::CONFLICT, "Conflict", message);
    }
    pod["spec"]["nodeName"] = json!(node);
    // Its kubelet starts it.
    pod["status"]["phase"] = json!("Running");
    let conditions = pod["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut conditions: Vec<Value> = conditions
        .into_iter()
        .filter(|c| c["type"] != "PodScheduled")
        .collect();
    conditions.push(json!({"type": "PodScheduled", "status": "True"}));
    pod["status"]["conditions"] = json!(conditions);
    s.binds.push(BindRecord {
        pod: pod_name,
        node,
        status: 201,
    });
    s.put(key, pod, "MODIFIED");
    api.publish(s);
    (
        StatusCode::CREATED,
        axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})),
    )
        .into_response()
}

fn delete(api: &FakeApi, t: &Target, name: &str, body: Option<Value>) -> Response {
    let grace = body.as_ref().and_then(|b| b["gracePeriodSeconds"].as_u64());
    let mut s = api.store.lock().expect("fake store");
    let key = (t.resource, t.namespace.clone(), name.to_string());
    let Some(mut object) = s.objects.get(&key).cloned() else {
        return not_found(t, name);
    };
    let is_pod = RESOURCES[t.resource].plural == "pods";
    let bound = object["spec"]["nodeName"]
        .as_str()
        .is_some_and(|n| !n.is_empty());
    let grace = grace
        .or_else(|| object["spec"]["terminationGracePeriodSeconds"].as_u64())
        .unwrap_or(30);
    let out = if is_pod && bound && grace > 0 {
        // Its kubelet signals it (SIGTERM) and removes it when it stops or
        // its grace ends.
        if object["metadata"]["deletionTimestamp"].is_null() {
            object["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            object["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            s.terminating
                .insert(key.clone(), Instant::now() + Duration::from_secs(grace));
            s.put(key, object, "MODIFIED")
        } else {
            object
        }
    } else {
        s.remove(&key).expect("present")
    };
    api.publish(s);
    axum::Json(out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_into_resources() {
        let t = parse("/api/v1/namespaces/ml/pods/p-0/binding").expect("binding");
        assert_eq!(RESOURCES[t.resource].kind, "Pod");
        assert_eq!(
            (t.namespace.as_str(), t.name.as_deref(), t.sub.as_deref()),
            ("ml", Some("p-0"), Some("binding"))
        );
        let t = parse("/api/v1/pods").expect("all pods");
        assert!(t.namespace.is_empty() && t.name.is_none());
        let t =
            parse("/apis/coordination.k8s.io/v1/namespaces/gpuflow/leases/gpuflow").expect("lease");
        assert_eq!(RESOURCES[t.resource].kind, "Lease");
        let t = parse("/apis/gpuflow.io/v1alpha1/gpuqueues/team-a").expect("queue");
        assert_eq!(t.name.as_deref(), Some("team-a"));
        assert!(
            parse("/api/v1/secrets").is_none(),
            "an unknown resource is not served"
        );
        assert!(parse("/apis/apps/v1/deployments").is_none());
    }

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut v = json!({"a": {"b": 1, "c": 2}, "d": [1, 2]});
        merge(&mut v, &json!({"a": {"b": null, "e": 3}, "d": [3]}));
        assert_eq!(v, json!({"a": {"c": 2, "e": 3}, "d": [3]}));
    }

    #[test]
    fn percent_decoding_reads_query_values() {
        assert_eq!(percent_decode("a%2Fb+c"), "a/b c");
        assert_eq!(percent_decode("100%"), "100%");
    }
}
