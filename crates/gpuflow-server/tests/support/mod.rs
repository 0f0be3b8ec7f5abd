//! The in-process harness of the API tests: a server opened on a temporary
//! data directory (SQLite, or a PostgreSQL URL), its router driven with
//! `oneshot` requests.

#![allow(dead_code)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use gpuflow_server::{Config, Shared};
use gpuflow_store::pgtest::TempPostgres;
use gpuflow_store::{EventQuery, Table};
use serde_json::Value;
use tower::ServiceExt;

pub(crate) struct H {
    pub shared: Arc<Shared>,
    pub router: axum::Router,
    pub admin: String,
    pub join: String,
    pub dir: tempfile::TempDir,
}

pub(crate) async fn harness(store: Option<String>) -> H {
    harness_on(store, |_| {}).await
}

/// A harness on SQLite with changed settings.
pub(crate) async fn harness_with(f: impl FnOnce(&mut Config)) -> H {
    harness_on(None, f).await
}

pub(crate) async fn harness_on(store: Option<String>, f: impl FnOnce(&mut Config)) -> H {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    cfg.store_url = store;
    f(&mut cfg);
    let opened = gpuflow_server::open(cfg).await.unwrap();
    H {
        router: gpuflow_server::http::router(opened.shared.clone()),
        shared: opened.shared,
        admin: opened.new_admin_token.unwrap(),
        join: opened.join_token.unwrap(),
        dir,
    }
}

impl H {
    pub(crate) async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        ct: &str,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", ct);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let resp = self
            .router
            .clone()
            .oneshot(req.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    pub(crate) async fn json(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Value,
    ) -> (u16, Value) {
        self.call(
            method,
            path,
            Some(token),
            "application/json",
            body.to_string().into_bytes(),
        )
        .await
    }

    pub(crate) async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.call("GET", path, Some(token), "application/json", vec![])
            .await
    }

    pub(crate) async fn submit(&self, token: &str, queue: &str) -> (u16, Value) {
        let spec = format!(
            "name: j\nqueue: {queue}\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '1']\n"
        );
        self.call(
            "POST",
            "/v1/jobs",
            Some(token),
            "application/yaml",
            spec.into_bytes(),
        )
        .await
    }

    /// A YAML spec submitted by the admin: the reply.
    pub(crate) async fn post_spec(&self, spec: String) -> (u16, Value) {
        self.call(
            "POST",
            "/v1/jobs",
            Some(&self.admin),
            "application/yaml",
            spec.into_bytes(),
        )
        .await
    }

    /// A job from a YAML spec, submitted by the admin; its id.
    pub(crate) async fn submit_spec(&self, spec: String) -> u64 {
        let (s, v) = self.post_spec(spec).await;
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    }

    /// A new pending job of a queue, submitted by the admin.
    pub(crate) async fn job(&self, queue: &str) -> u64 {
        let (s, v) = self.submit(&self.admin, queue).await;
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    }

    pub(crate) async fn stored_jobs(&self) -> usize {
        self.shared.store.load(Table::Jobs).await.unwrap().len()
    }

    pub(crate) async fn stored_events(&self) -> usize {
        self.shared
            .store
            .events(&EventQuery {
                limit: 10_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .len()
    }
}

pub(crate) async fn with_postgres(f: impl AsyncFnOnce(Option<String>)) {
    match TempPostgres::start() {
        Ok(Some(pg)) => f(Some(pg.url.clone())).await,
        Ok(None) => eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)"),
        Err(e) => panic!("{e}"),
    }
}
