//! The error body every 4xx and 5xx carries: `{code, message}`, plus the
//! fields at fault when a spec fails validation.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// An API error: the HTTP status, a stable machine code and a sentence that
/// says what was wrong and how to fix it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error, JsonSchema)]
#[error("{message}")]
pub struct ApiError {
    #[serde(skip, default = "internal")]
    pub status: u16,
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<FieldError>,
}

fn internal() -> u16 {
    500
}

impl ApiError {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
            fields: Vec::new(),
        }
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(400, code, message)
    }

    pub fn not_found(what: impl Into<String>) -> ApiError {
        ApiError::new(404, "not_found", what)
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(403, "forbidden", message)
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(409, "conflict", message)
    }

    /// A spec with wrong values: one line per field.
    pub fn invalid(fields: Vec<FieldError>) -> ApiError {
        let message = fields
            .iter()
            .map(|f| format!("{}: {}", f.field, f.message))
            .collect::<Vec<_>>()
            .join("; ");
        ApiError {
            status: 400,
            code: "invalid_spec".into(),
            message,
            fields,
        }
    }
}
