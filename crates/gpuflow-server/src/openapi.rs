//! The OpenAPI document served at `/v1/openapi.json`, generated from the
//! route table below, the API's types (bodies, by schemars) and each
//! handler's struct of query parameters (`http::query_params`). A test checks that every route here is served and
//! every served route is here, so the two cannot drift apart.

use serde_json::{Value, json};

/// One route: method, path, who may call it, summary, and the schema names of
/// its request body and its success reply (see [`schemas`]).
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub who: &'static str,
    pub summary: &'static str,
    pub request: Option<&'static str>,
    pub response: Option<&'static str>,
}

const fn r(
    method: &'static str,
    path: &'static str,
    who: &'static str,
    summary: &'static str,
    request: Option<&'static str>,
    response: Option<&'static str>,
) -> Route {
    Route {
        method,
        path,
        who,
        summary,
        request,
        response,
    }
}

pub const ROUTES: &[Route] = &[
    r(
        "get",
        "/v1/openapi.json",
        "anyone",
        "This document",
        None,
        None,
    ),
    r(
        "get",
        "/v1/whoami",
        "any token",
        "The caller's user, team and role",
        None,
        Some("WhoAmI"),
    ),
    r(
        "get",
        "/v1/auth/providers",
        "anyone",
        "The identity providers users sign in through (OpenID Connect): issuer, public client id, scopes",
        None,
        Some("OidcProvider[]"),
    ),
    r(
        "post",
        "/v1/auth/sessions",
        "anyone with an ID token of a configured identity provider",
        "Sign in: the provider's ID token (and refresh token) becomes a session token, listed and revoked as tokens are; the user's groups are read again from the provider as it goes on",
        Some("SessionRequest"),
        Some("TokenCreated"),
    ),
    r(
        "post",
        "/v1/auth/code",
        "anyone back from a configured identity provider",
        "The dashboard's sign-in (authorization code flow with PKCE): the server exchanges the code at the provider, once, checks the ID token and its nonce, and answers a session token",
        Some("CodeRequest"),
        Some("TokenCreated"),
    ),
    r(
        "post",
        "/v1/jobs",
        "member, team lead, admin",
        "Submit a job (YAML, or JSON with Content-Type application/json); ?test_only=true answers where it would start or why it would wait, storing nothing; a job no node could ever hold is refused",
        Some("JobSpec"),
        Some("Submitted"),
    ),
    r(
        "get",
        "/v1/jobs",
        "any token (own team)",
        "List jobs, newest first; filters: team, queue, state, user, project; pages of at most 1000 (limit), the next page with before=<last id>",
        None,
        Some("Job[]"),
    ),
    r(
        "get",
        "/v1/jobs/{id}",
        "any token (own team)",
        "One job with its tasks and their placement",
        None,
        Some("Job"),
    ),
    r(
        "get",
        "/v1/jobs/{id}/why",
        "any token (own team)",
        "Why a job waits: every reason, its position, an estimated start",
        None,
        Some("Why"),
    ),
    r(
        "get",
        "/v1/jobs/{id}/logs",
        "any token (own team)",
        "Each task's stdout and stderr by attempt and name/index: all of it up to the job log limit, then each stream's last 16 KiB",
        None,
        None,
    ),
    r(
        "get",
        "/v1/jobs/{id}/exec",
        "its team's members and leads; admins",
        "WebSocket: runs `command` (a JSON array) beside a running task (`task=GROUP/INDEX`), on a terminal with `tty=true` (`rows`, `cols`); binary messages carry input and, after a channel byte (1 stdout, 2 stderr), output; text messages carry SessionControl. Audited",
        None,
        None,
    ),
    r(
        "get",
        "/v1/jobs/{id}/attach",
        "its team's members and leads; admins",
        "WebSocket: a running task's output as it is written (binary messages as for exec). Audited",
        None,
        None,
    ),
    r(
        "post",
        "/v1/jobs/{id}/proxy-session",
        "any token (own team)",
        "A cookie (HttpOnly, for this job's proxy path only, read by nothing else) that lets a browser through the job's proxy",
        None,
        None,
    ),
    r(
        "get",
        "/v1/jobs/{id}/proxy/{port}/{path}",
        "any token or the proxy-session cookie (own team)",
        "HTTP and WebSocket (any method) proxied to a port a running task of the job declared (`ports:`; a notebook's `http`), path and query unchanged; the caller's token is not passed on",
        None,
        None,
    ),
    r(
        "post",
        "/v1/jobs/{id}/{action}",
        "cancel/suspend/resume: member, team lead, admin; hold/release: admin",
        "Act on a job: cancel, suspend, resume, hold or release",
        None,
        Some("Job"),
    ),
    r(
        "get",
        "/v1/events",
        "any token (own team; admins all)",
        "Job and node events; filters: job, after, limit, since, until, newest",
        None,
        Some("Event[]"),
    ),
    r(
        "get",
        "/v1/audit",
        "admin",
        "Every change: who, what, when",
        None,
        Some("AuditEntry[]"),
    ),
    r(
        "get",
        "/v1/nodes",
        "any token",
        "Nodes, their GPUs and what is in use",
        None,
        Some("NodeView[]"),
    ),
    r(
        "post",
        "/v1/reservations",
        "admin",
        "A window on named nodes (or a count of a GPU model's) for teams and users (their jobs ask for it with `reservation`), or for maintenance (no job runs); jobs of others run there before it only if they end before it starts",
        Some("ReservationSpec"),
        Some("Reservation"),
    ),
    r(
        "get",
        "/v1/reservations",
        "any token",
        "Every reservation",
        None,
        Some("Reservation[]"),
    ),
    r(
        "delete",
        "/v1/reservations/{name}",
        "admin",
        "Delete a reservation; its waiting jobs are told it is gone",
        None,
        None,
    ),
    r(
        "post",
        "/v1/webhooks",
        "any token (team leads and admins for a whole team)",
        "A webhook: the caller's jobs (or a team's) POST their state changes to a URL, signed with HMAC-SHA256 (X-Gpuflow-Signature); the secret is shown once",
        Some("WebhookSpec"),
        Some("WebhookView"),
    ),
    r(
        "get",
        "/v1/webhooks",
        "any token",
        "The webhooks the caller made or may manage",
        None,
        Some("WebhookView[]"),
    ),
    r(
        "delete",
        "/v1/webhooks/{id}",
        "its maker, the team lead, admins",
        "Delete a webhook; what it had queued is not sent",
        None,
        None,
    ),
    r(
        "get",
        "/v1/webhooks/{id}/deliveries",
        "its maker, the team lead, admins",
        "Its last 100 delivery attempts: event, job, attempt, HTTP status, outcome",
        None,
        Some("Delivery[]"),
    ),
    r(
        "get",
        "/v1/nodes/{name}",
        "any token",
        "One node: its GPUs (MIG layout, health, holders), CPU and memory allocated, its jobs",
        None,
        Some("NodeView"),
    ),
    r(
        "post",
        "/v1/nodes/{name}/{action}",
        "admin",
        "drain, cordon, uncordon, replace (release its name for a new machine; its work is requeued) or clear (forget its GPUs' health marks) a node",
        None,
        Some("NodeView"),
    ),
    r(
        "get",
        "/v1/reports/usage",
        "any token (own team; admins all)",
        "GPU-hours held and used, efficiency and cost from the jobs' ledger, by team, project, user, queue, model, cost_centre or job, per hour, day, month or all",
        None,
        Some("UsageReport"),
    ),
    r(
        "put",
        "/v1/clusters/{cluster}/workloads",
        "admin (a cluster's scheduler)",
        "Report every workload another scheduler (gpuflow on Kubernetes) runs or keeps waiting now; they are accounted and shown as jobs, and those the last report had and this one does not have finished",
        Some("WorkloadReport"),
        Some("WorkloadReportResult"),
    ),
    r(
        "get",
        "/v1/reports/low-utilization",
        "any token (own team; admins all)",
        "Jobs holding GPUs below a sampled utilisation for a while, by GPU-hours held",
        None,
        Some("LowUse[]"),
    ),
    r(
        "get",
        "/v1/reports/jobs",
        "any token (own team; admins all)",
        "Waits (p50, p95), outcomes, preemptions and the GPU-hours they lost, of the jobs submitted in a range, by queue or kind",
        None,
        Some("JobsRow[]"),
    ),
    r(
        "get",
        "/v1/reports/advice",
        "any token (own team; admins all)",
        "Jobs whose measured GPU memory and utilisation would fit a cheaper GPU model or a MIG slice, with the saving per month at the configured prices",
        None,
        Some("Advice[]"),
    ),
    r(
        "get",
        "/v1/services",
        "any token (own team)",
        "Inference services with their replicas, readiness and endpoints",
        None,
        Some("ServiceView[]"),
    ),
    r(
        "post",
        "/v1/services",
        "the queue's team (not viewers); admins",
        "Create an inference service: replicas of one task, each its own job",
        Some("ServiceSpec"),
        Some("ServiceView"),
    ),
    r(
        "get",
        "/v1/services/{name}",
        "any token (own team)",
        "A service: its replicas, which are ready, its endpoints",
        None,
        Some("ServiceView"),
    ),
    r(
        "patch",
        "/v1/services/{name}",
        "its team (not viewers); admins",
        "Scale a service (within its bounds) or roll out a new task",
        Some("ServicePatch"),
        Some("ServiceView"),
    ),
    r(
        "delete",
        "/v1/services/{name}",
        "its team (not viewers); admins",
        "Delete a service and cancel its replicas",
        None,
        None,
    ),
    r(
        "post",
        "/v1/jobs/batch",
        "members and team leads of the queues' teams; admins",
        "Submit many jobs in one transaction: all stored, with consecutive ids, or none (the first wrong one named by its place)",
        Some("BatchSubmit"),
        Some("BatchSubmitted"),
    ),
    r(
        "post",
        "/v1/arrays/{id}/cancel",
        "the job's team (not viewers); admins",
        "Cancel every unfinished element of an array in one change",
        None,
        Some("ArrayCancelled"),
    ),
    r(
        "get",
        "/v1/reports/workload",
        "admin",
        "The recorded workload of a range (jobs that held GPUs, how long, on which model), the nodes and each team's quotas: what `gpuflow sim whatif` replays",
        None,
        Some("RecordedWorkload"),
    ),
    r(
        "get",
        "/v1/prices",
        "any token",
        "The prices of a GPU-hour per model",
        None,
        Some("Prices"),
    ),
    r(
        "put",
        "/v1/prices",
        "admin",
        "Set the prices of a GPU-hour per model (`*`: the others)",
        Some("Prices"),
        Some("Prices"),
    ),
    r(
        "get",
        "/v1/pools",
        "any token",
        "Node pools and their GPUs",
        None,
        None,
    ),
    r(
        "get",
        "/v1/idle-waiting",
        "any token",
        "GPUs free after the last cycle that waiting work could hold, quota aside, and their GPU-hours since the server started",
        None,
        None,
    ),
    r(
        "get",
        "/v1/queues",
        "any token (own team)",
        "Queues with quotas and usage",
        None,
        Some("QueueView[]"),
    ),
    r(
        "post",
        "/v1/queues",
        "admin; team lead for child queues of their team",
        "Create a queue",
        Some("QueueSpec"),
        Some("QueueSpec"),
    ),
    r(
        "patch",
        "/v1/queues/{name}",
        "admin; team lead of its team (not top-level quotas)",
        "Change weight, state, user limits or quotas",
        Some("QueuePatch"),
        Some("QueueSpec"),
    ),
    r(
        "delete",
        "/v1/queues/{name}",
        "admin",
        "Delete an empty queue",
        None,
        None,
    ),
    r(
        "get",
        "/v1/teams",
        "any token (own team)",
        "Teams",
        None,
        Some("Team[]"),
    ),
    r(
        "post",
        "/v1/teams",
        "admin",
        "Create a team",
        Some("Team"),
        Some("Team"),
    ),
    r(
        "get",
        "/v1/projects",
        "any token (own team)",
        "Projects (what jobs are accounted to) with what is left of their budgets",
        None,
        Some("ProjectView[]"),
    ),
    r(
        "post",
        "/v1/projects",
        "admin; team lead for their team (a budget: admin)",
        "Create a project",
        Some("Project"),
        Some("Project"),
    ),
    r(
        "patch",
        "/v1/projects/{name}",
        "admin",
        "Change a project's cost centre or budget (`null` removes it)",
        Some("ProjectPatch"),
        Some("ProjectView"),
    ),
    r(
        "get",
        "/v1/users",
        "any token (own team)",
        "Users",
        None,
        Some("User[]"),
    ),
    r(
        "post",
        "/v1/users",
        "admin; team lead for their team",
        "Create a user",
        Some("User"),
        Some("User"),
    ),
    r(
        "post",
        "/v1/users/{name}/disable",
        "admin; team lead for their team's members and viewers",
        "Disable a user: all their tokens are refused at once",
        None,
        Some("User"),
    ),
    r(
        "post",
        "/v1/users/{name}/signout",
        "the user; admin; team lead for their team's members and viewers",
        "Refuse every sign-in of the user through an identity provider made until now",
        None,
        Some("User"),
    ),
    r(
        "post",
        "/v1/users/{name}/enable",
        "admin; team lead for their team's members and viewers",
        "Enable a disabled user again",
        None,
        Some("User"),
    ),
    r(
        "patch",
        "/v1/teams/{name}",
        "admin",
        "Change who a team's tasks run as (run_as; empty for the agents' default)",
        Some("TeamPatch"),
        Some("Team"),
    ),
    r(
        "post",
        "/v1/tokens",
        "admin; team lead for their team; anyone for themselves",
        "Create an API token (shown once), optionally expiring; at most 20 live tokens per user",
        Some("TokenRequest"),
        Some("TokenCreated"),
    ),
    r(
        "get",
        "/v1/tokens",
        "admin: all; team lead: their team's; anyone: their own",
        "List live tokens (ids, never the tokens)",
        None,
        Some("TokenView[]"),
    ),
    r(
        "delete",
        "/v1/tokens/{id}",
        "admin: all; team lead: their team's; anyone: their own",
        "Revoke a token",
        None,
        None,
    ),
    r(
        "post",
        "/v1/agent/register",
        "join token",
        "A node agent joins and gets its node token",
        Some("Register"),
        Some("Registered"),
    ),
    r(
        "post",
        "/v1/agent/heartbeat",
        "node token",
        "Inventory and task reports in, desired tasks out",
        Some("Heartbeat"),
        Some("Desired"),
    ),
    r(
        "get",
        "/v1/agent/exec/{session}",
        "node token (the session's node)",
        "WebSocket: the agent's side of a session the server named in a heartbeat reply",
        None,
        None,
    ),
];

/// JSON Schemas (2020-12, as OpenAPI 3.1 uses) of every body, by name.
pub fn schemas() -> serde_json::Map<String, Value> {
    use gpuflow_api as api;
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    settings.meta_schema = None;
    let mut g = settings.into_generator();
    macro_rules! add {
        ($($t:ty),*) => { $( g.subschema_for::<$t>(); )* };
    }
    add!(
        api::JobSpec,
        api::WorkloadReport,
        api::WorkloadReportResult,
        api::Submitted,
        api::TestOnly,
        api::Job,
        api::Why,
        api::Event,
        api::AuditEntry,
        api::NodeView,
        api::QueueView,
        api::QueueSpec,
        api::QueuePatch,
        api::Team,
        api::TeamPatch,
        api::Project,
        api::ProjectView,
        api::ProjectPatch,
        api::User,
        api::TokenRequest,
        api::TokenCreated,
        api::TokenView,
        api::WhoAmI,
        api::OidcProvider,
        api::SessionRequest,
        api::CodeRequest,
        api::Register,
        api::Registered,
        api::Heartbeat,
        api::Desired,
        api::UsageReport,
        api::LowUse,
        api::JobsRow,
        api::Advice,
        api::RecordedWorkload,
        api::ArrayCancelled,
        api::BatchSubmit,
        api::BatchSubmitted,
        api::ServiceSpec,
        api::ServicePatch,
        api::ServiceView,
        api::ReservationSpec,
        api::Reservation,
        api::WebhookSpec,
        api::WebhookView,
        api::Delivery,
        api::Prices,
        api::ApiError
    );
    g.take_definitions(true)
}

fn schema_ref(name: &str) -> Value {
    match name.strip_suffix("[]") {
        Some(n) => json!({"type": "array", "items": {"$ref": format!("#/components/schemas/{n}")}}),
        None => json!({"$ref": format!("#/components/schemas/{name}")}),
    }
}

/// The pattern every name (team, user, queue, project, node) matches.
pub const NAME_PATTERN: &str = "^[a-z0-9][a-z0-9._-]{0,62}$";

/// The schema of a path parameter of `path`.
fn path_param(path: &str, name: &str) -> Value {
    let schema = match (name, path) {
        ("id", p) if p.starts_with("/v1/jobs/") || p.starts_with("/v1/arrays/") => {
            json!({"type": "integer", "minimum": 1})
        }
        ("id", _) => json!({"type": "string", "pattern": "^[0-9a-f]{16}$"}),
        ("port", _) => json!({"type": "integer", "minimum": 1, "maximum": 65535}),
        ("path" | "session", _) => json!({"type": "string"}),
        ("action", p) if p.starts_with("/v1/jobs/") => {
            json!({"type": "string", "enum": ["cancel", "suspend", "resume", "hold", "release"]})
        }
        ("action", _) => {
            json!({"type": "string", "enum": ["drain", "cordon", "uncordon", "replace", "clear"]})
        }
        _ => json!({"type": "string", "pattern": NAME_PATTERN}),
    };
    json!({"name": name, "in": "path", "required": true, "schema": schema})
}

/// The status of a route's success.
fn success(method: &str, path: &str) -> &'static str {
    match method {
        "delete" => "204",
        "post"
            if [
                "/v1/jobs",
                "/v1/queues",
                "/v1/teams",
                "/v1/projects",
                "/v1/users",
                "/v1/tokens",
                "/v1/services",
                "/v1/jobs/batch",
            ]
            .contains(&path) =>
        {
            "201"
        }
        _ => "200",
    }
}

pub fn document() -> Value {
    let mut paths = serde_json::Map::new();
    for route in ROUTES {
        let mut params: Vec<Value> = route
            .path
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|p| path_param(route.path, p))
            .collect();
        params.extend(crate::http::query_params(route.method, route.path));
        if (route.method, route.path) == ("post", "/v1/jobs") {
            params.push(json!({
                "name": "Idempotency-Key", "in": "header", "required": false,
                "description": "A retry with the same key (same user) returns the job already stored, with 200",
                "schema": {"type": "string", "minLength": 1, "maxLength": 128}
            }));
        }
        let ok = match route.response {
            Some(t) => {
                json!({"description": "success", "content": {"application/json": {"schema": schema_ref(t)}}})
            }
            None => json!({"description": "success"}),
        };
        let err = |what: &str| json!({"description": what, "content": {"application/json": {"schema": schema_ref("ApiError")}}});
        let mut responses = serde_json::Map::new();
        responses.insert(success(route.method, route.path).into(), ok);
        if (route.method, route.path) == ("post", "/v1/jobs") {
            responses.insert(
                "200".into(),
                json!({"description": "a retried submission (same Idempotency-Key): the stored job; or the TestOnly answer", "content": {"application/json": {"schema": {"oneOf": [schema_ref("Submitted"), schema_ref("TestOnly")]}}}}),
            );
        }
        if route.who != "anyone" {
            responses.insert("400".into(), err("bad input: the message says what to fix"));
            responses.insert("401".into(), err("no token, or not a valid one"));
            responses.insert("403".into(), err("the caller's role does not allow it"));
            responses.insert("404".into(), err("no such thing (or another team's)"));
            responses.insert("409".into(), err("conflicts with the current state"));
            responses.insert("413".into(), err("the body is too large"));
        }
        // Any caller past its rate (per token, or per address without one).
        responses.insert("429".into(), err("too many requests: slow down and retry"));
        let mut op = json!({
            "summary": route.summary,
            "description": format!("Allowed: {}.", route.who),
            "parameters": params,
            "security": if route.who == "anyone" { json!([]) } else { json!([{"bearer": []}]) },
            "responses": responses,
        });
        if let Some(t) = route.request {
            let mut content = json!({"application/json": {"schema": schema_ref(t)}});
            if t == "JobSpec" {
                content["application/yaml"] = json!({"schema": schema_ref(t)});
            }
            op["requestBody"] = json!({"required": true, "content": content});
        }
        let entry = paths
            .entry(route.path.to_string())
            .or_insert_with(|| json!({}));
        entry[route.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {"title": "gpuflow", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas(),
        }
    })
}
