//! The OpenAPI document served at `/v1/openapi.json`, generated from the
//! route table below. A test checks that every route here is served and
//! every served route is here, so the two cannot drift apart.

use serde_json::{Value, json};

/// `(method, path, who may call it, summary)`.
pub const ROUTES: &[(&str, &str, &str, &str)] = &[
    ("get", "/v1/openapi.json", "anyone", "This document"),
    ("get", "/v1/whoami", "any token", "The caller's user, team and role"),
    ("post", "/v1/jobs", "member, team lead, admin", "Submit a job (YAML, or JSON with Content-Type application/json)"),
    ("get", "/v1/jobs", "any token (own team)", "List jobs; filters: team, queue, state, user, limit"),
    ("get", "/v1/jobs/{id}", "any token (own team)", "One job with its tasks and their placement"),
    ("get", "/v1/jobs/{id}/why", "any token (own team)", "Why a job waits: every reason, its position, an estimated start"),
    ("get", "/v1/jobs/{id}/logs", "any token (own team)", "The end of each task's output"),
    ("post", "/v1/jobs/{id}/{action}", "cancel/suspend/resume: member, team lead, admin; hold/release: admin", "Act on a job"),
    ("get", "/v1/events", "any token (own team; admins all)", "Job and node events; filters: job, after, limit"),
    ("get", "/v1/audit", "admin", "Every change: who, what, when"),
    ("get", "/v1/nodes", "any token", "Nodes, their GPUs and what is in use"),
    ("post", "/v1/nodes/{name}/{action}", "admin", "drain, cordon or uncordon a node"),
    ("get", "/v1/pools", "any token", "Node pools and their GPUs"),
    ("get", "/v1/queues", "any token (own team)", "Queues with quotas and usage"),
    ("post", "/v1/queues", "admin; team lead for child queues of their team", "Create a queue"),
    ("patch", "/v1/queues/{name}", "admin; team lead of its team (not top-level quotas)", "Change weight, state, user limits or quotas"),
    ("delete", "/v1/queues/{name}", "admin", "Delete an empty queue"),
    ("get", "/v1/teams", "any token (own team)", "Teams"),
    ("post", "/v1/teams", "admin", "Create a team"),
    ("get", "/v1/users", "any token (own team)", "Users"),
    ("post", "/v1/users", "admin; team lead for their team", "Create a user"),
    ("post", "/v1/tokens", "admin; team lead for their team; anyone for themselves", "Create an API token (shown once)"),
    ("post", "/v1/agent/register", "join token", "A node agent joins and gets its node token"),
    ("post", "/v1/agent/heartbeat", "node token", "Inventory and task reports in, desired tasks out"),
];

pub fn document() -> Value {
    let mut paths = serde_json::Map::new();
    for (method, path, who, summary) in ROUTES {
        let params: Vec<Value> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|p| json!({"name": p, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[*method] = json!({
            "summary": summary,
            "description": format!("Allowed: {who}."),
            "parameters": params,
            "security": if who.contains("anyone") { json!([]) } else { json!([{"bearer": []}]) },
            "responses": {
                "200": {"description": "success"},
                "4XX": {"description": "bad input or not allowed", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            }
        });
    }
    json!({
        "openapi": "3.1.0",
        "info": {"title": "gpuflow", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["code", "message"], "properties": {
                "code": {"type": "string"}, "message": {"type": "string"},
                "fields": {"type": "array", "items": {"type": "object", "properties": {"field": {"type": "string"}, "message": {"type": "string"}}}}
            }}}
        }
    })
}
