//! The simulator's one error type.

use std::path::PathBuf;

/// What went wrong loading a trace or writing a report.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {message}")]
    Parse {
        path: PathBuf,
        line: u64,
        message: String,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid cluster in {path}: {source}")]
    Cluster {
        path: PathBuf,
        #[source]
        source: gpuflow_core::CoreError,
    },
    #[error("unknown pod list {name:?}: expected one of {known}")]
    UnknownTrace { name: String, known: String },
    #[error("unknown policy {name:?}: expected one of {known}")]
    UnknownPolicy { name: String, known: String },
    #[error("{0}")]
    Invalid(String),
}
