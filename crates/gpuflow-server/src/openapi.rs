//! The OpenAPI document served at `/v1/openapi.json`. `aide` builds it from
//! the routes themselves (`http::doc`): each handler's body, query
//! parameters, token and reply types, and the summary and callers written
//! beside the route. [`finish`] adds what is the same for every route: the
//! path parameters' patterns, the rate limit's reply and the security scheme.

use serde_json::{Value, json};

/// The generator of the document's schemas: JSON Schema 2020-12, as
/// OpenAPI 3.1 uses, each named type once under `components/schemas`.
pub(crate) fn schema_generator() -> schemars::SchemaGenerator {
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    settings.meta_schema = None;
    settings.into_generator()
}

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
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

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// The document `aide` built, finished.
///
/// # Panics
/// If the document does not serialise: at start-up, whatever the requests.
pub fn finish(api: &aide::openapi::OpenApi) -> Value {
    let mut doc = serde_json::to_value(api).expect("the OpenAPI document serialises");
    let paths = doc["paths"]
        .as_object_mut()
        .map(std::mem::take)
        .unwrap_or_default();
    let mut done = serde_json::Map::new();
    for (path, mut item) in paths {
        for method in METHODS {
            let Some(op) = item.get_mut(method) else {
                continue;
            };
            finish_operation(&path, op);
        }
        done.insert(path, item);
    }
    doc["paths"] = Value::Object(done);
    doc["openapi"] = json!("3.1.0");
    doc["info"] = json!({"title": "gpuflow", "version": env!("CARGO_PKG_VERSION")});
    doc["components"]["securitySchemes"] = json!({"bearer": {"type": "http", "scheme": "bearer"}});
    if doc["components"]["schemas"].is_null() {
        doc["components"]["schemas"] = json!({});
    }
    doc
}

/// Path parameters' schemas, 429 on every route, a plain success where the
/// reply has no type.
fn finish_operation(path: &str, op: &mut Value) {
    let mut params: Vec<Value> = path
        .split('/')
        .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(|p| path_param(path, p))
        .collect();
    if let Some(given) = op.get("parameters").and_then(Value::as_array) {
        params.extend(given.iter().filter(|p| p["in"] != "path").cloned());
    }
    op["parameters"] = Value::Array(params);
    let secured = op
        .get("security")
        .and_then(Value::as_array)
        .is_some_and(|s| !s.is_empty());
    if !secured {
        op["security"] = json!([]);
    }
    let responses = op["responses"]
        .as_object_mut()
        .map(std::mem::take)
        .unwrap_or_default();
    let mut out = serde_json::Map::new();
    for (status, mut r) in responses {
        if status.starts_with('2') && r["description"].as_str().is_none_or(str::is_empty) {
            r["description"] = json!("success");
        }
        out.insert(status, r);
    }
    if !out.keys().any(|s| s.starts_with('2')) {
        out.insert("200".into(), json!({"description": "success"}));
    }
    let err = |what: &str| json!({"description": what, "content": {"application/json": {"schema": schema_ref("ApiError")}}});
    // Any caller past its rate (per token, or per address without one).
    out.insert("429".into(), err("too many requests: slow down and retry"));
    op["responses"] = Value::Object(out);
}
