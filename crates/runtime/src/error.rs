//! Typed errors of the proclet API and of starting a cluster.

use granule_config::ConfigError;
use granule_controller::ControllerError;
use granule_wire::{NodeId, ProcletId, RemoteError};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use thiserror::Error;

/// Why a proclet call (or creation, or destroy) failed. Serializable, so a closure can
/// return the outcome of a nested call to its own caller.
///
/// Calls are at-most-once: an error never means the closure ran twice, and the runtime
/// only retries a call when the remote side proved it did not run it (a stale location).
/// After [`CallError::NodeUnreachable`] or [`CallError::Timeout`] the closure may or may
/// not have run.
#[derive(Debug, Error, Clone, PartialEq, Serialize, Deserialize)]
pub enum CallError {
    /// The proclet was destroyed (or never existed).
    #[error("proclet {0} is gone (destroyed or never created)")]
    ProcletGone(ProcletId),
    /// The proclet's node died or cannot be reached; its state is lost.
    #[error("node {node} is unreachable: {reason}")]
    NodeUnreachable { node: NodeId, reason: String },
    /// No answer within the call's timeout (a handle's, or a pushed call's
    /// `PushOpts::timeout`). A pushed call that had not started when it passed never runs.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The peer runs a different executable, so code cannot be shipped to it.
    #[error("{0}")]
    BinaryMismatch(String),
    /// An argument, state or return value could not be decoded (or encoded).
    #[error("decode failure: {0}")]
    Decode(String),
    /// The closure panicked. The proclet stays alive with its state as the closure left
    /// it at the panic, and the node keeps serving (a pushed call's pool thread too).
    #[error("closure on proclet {proclet} panicked: {message}")]
    RemotePanic { proclet: ProcletId, message: String },
    /// The call would re-enter a proclet that its own call chain already holds in a way
    /// that can never be granted (an exclusive call inside a call on the same proclet):
    /// it would deadlock, so it fails at once instead. The closure did not run.
    #[error("call re-enters proclet {0}, which its own call chain holds; it would deadlock")]
    Reentrant(ProcletId),
    /// Shipped code failed a safety check on the receiving node and was not run.
    #[error("shipped code refused: {0}")]
    CodeRefused(String),
    /// The controller could not be reached or refused the request.
    #[error(transparent)]
    Controller(ControllerError),
    /// There is no Granule runtime in this process (no `Cluster` was started, or it shut
    /// down).
    #[error("no Granule cluster in this process: start one with granule::Cluster::start() first")]
    NoCluster,
    /// No node has room for the new proclet (every node is out of memory budget or under
    /// memory pressure), or a node's pushdown queue is full (`pushdown.queue`). Nothing
    /// was created, nothing ran.
    #[error("no capacity: {0}")]
    NoCapacity(String),
    /// The request was refused (bad node named, no node to place on, a pinned proclet
    /// asked to move, a pushed call whose memory budget exceeds `pushdown.memory`, ...).
    #[error("refused: {0}")]
    Refused(String),
    /// Something that should not happen; the message says what.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<ControllerError> for CallError {
    fn from(e: ControllerError) -> CallError {
        match e {
            ControllerError::Remote(RemoteError::NoCapacity(m)) => CallError::NoCapacity(m),
            other => CallError::Controller(other),
        }
    }
}

impl CallError {
    pub(crate) fn from_remote(e: RemoteError, proclet: ProcletId) -> CallError {
        match e {
            RemoteError::Gone => CallError::ProcletGone(proclet),
            RemoteError::NodeDown(node) => CallError::NodeUnreachable {
                node,
                reason: "the controller declared it dead".into(),
            },
            RemoteError::Panic(message) => CallError::RemotePanic { proclet, message },
            RemoteError::Decode(m) => CallError::Decode(m),
            RemoteError::CodeMismatch(m) => CallError::CodeRefused(m),
            RemoteError::Reentrant(p) => CallError::Reentrant(p),
            RemoteError::Unauthorized(m) if m.contains("binary") => CallError::BinaryMismatch(m),
            RemoteError::Unauthorized(m) | RemoteError::Refused(m) => CallError::Refused(m),
            RemoteError::NoCapacity(m) => CallError::NoCapacity(m),
            RemoteError::NotHere { .. } => {
                CallError::Internal("proclet location kept changing; gave up".into())
            }
            RemoteError::Protocol(m) | RemoteError::Internal(m) => CallError::Internal(m),
            RemoteError::TimedOut { after_ms } => {
                CallError::Timeout(Duration::from_millis(after_ms))
            }
        }
    }
}

/// Why a cluster (or a node) could not start.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// A setting, node spec or other configuration the cluster cannot start with; the
    /// text says which and why (a [`ConfigError`] converts into this, so `?` works on
    /// `granule_config` calls in a function returning `ClusterError`).
    #[error("bad configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Controller(#[from] ControllerError),
    #[error("cannot start node processes: {0}")]
    Spawn(String),
    #[error("{0}")]
    Startup(String),
    #[error("{0}")]
    Io(String),
}

// The variant keeps the text rather than the typed error: it also carries node specs
// and fleet refusals that are not `ConfigError`s, and callers already match on it.
impl From<ConfigError> for ClusterError {
    fn from(e: ConfigError) -> ClusterError {
        ClusterError::Config(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_config::Config;

    /// A program's `main` returning `ClusterError` applies its settings with `?`.
    fn configure(key: &str, value: &str) -> Result<Config, ClusterError> {
        let mut c = Config::default();
        c.set(key, value)?;
        Ok(c)
    }

    #[test]
    fn config_errors_convert_for_question_mark() {
        assert!(configure("cluster.failure_timeout", "3s").is_ok());
        match configure("cluster.failure_timeout", "soon") {
            Err(ClusterError::Config(m)) => {
                assert!(m.contains("cluster.failure_timeout"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        match configure("cluster.no_such_setting", "1") {
            Err(e @ ClusterError::Config(_)) => {
                let m = e.to_string();
                assert!(m.starts_with("bad configuration: unknown setting"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }
}
