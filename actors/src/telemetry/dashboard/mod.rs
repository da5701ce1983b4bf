//! The live dashboard every daemon serves at `/` (with `telemetry.metrics_listen`): what a controller
//! keeps of each job ([`history`]), the page and its live fragment ([`page`]), pushed to open pages over
//! server-sent events by [`super::endpoint`].

pub mod history;
pub mod page;

pub use history::JobHistory;
pub use page::JobSnapshot;
