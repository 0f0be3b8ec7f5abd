//! Trace loaders, simulators and reports that drive gpuflow-core.
//!
//! The simulators run the core's own placement pipeline, so what they measure
//! is what production does. This crate reads files and writes reports; it
//! installs no logger and draws no progress bars (callers pass a `tick`).

#![forbid(unsafe_code)]

pub mod bench;
pub mod dynamic;
pub mod dynreport;
mod error;
pub mod fragmentation;
pub mod import;
pub mod openb;
pub mod realistic;
pub mod report;
pub mod whatif;
pub mod workload;

pub use error::SimError;
