//! The node's side of fault injection, for tests: the transport's fault filter (every
//! connection of the node goes through it) and the orders a driver sends to arm
//! failpoints and set filter rules. Off unless the configuration's `faults.enabled` is
//! on: a production node refuses every order.

use granule_transport::{FaultFilter, FaultRules};
use granule_wire::{Msg, NodeId, RemoteError};
use std::sync::Arc;

/// The node's fault filter and whether it takes orders.
pub(crate) struct NodeFaults {
    enabled: bool,
    filter: Arc<FaultFilter>,
}

impl NodeFaults {
    /// Arm the failpoints the configuration names (only with `faults.enabled`).
    pub(crate) fn new(cfg: &granule_config::Faults) -> Result<NodeFaults, String> {
        if !cfg.failpoints.trim().is_empty() {
            if !cfg.enabled {
                return Err(format!(
                    "faults.failpoints is set ('{}') but faults.enabled is off: fault \
                     injection is for tests; turn it on to use failpoints",
                    cfg.failpoints
                ));
            }
            granule_failpoints::set_list(&cfg.failpoints)
                .map_err(|e| format!("faults.failpoints: {e}"))?;
        }
        Ok(NodeFaults {
            enabled: cfg.enabled,
            filter: Arc::new(FaultFilter::new()),
        })
    }

    /// The filter the node's connections go through.
    pub(crate) fn filter(&self) -> Arc<FaultFilter> {
        self.filter.clone()
    }

    /// The node's id, once registered (partitions name nodes).
    pub(crate) fn set_local(&self, node: NodeId) {
        self.filter.set_local(node);
    }

    /// Carry out a `Faults` order; with `report`, the node's fault report.
    pub(crate) fn apply(&self, msg: &Msg) -> Result<Option<String>, RemoteError> {
        let Msg::Faults {
            failpoints,
            filter,
            report,
        } = msg
        else {
            return Err(RemoteError::Protocol("not a fault order".into()));
        };
        if !self.enabled {
            return Err(RemoteError::Unauthorized(
                "fault injection is off on this node (faults.enabled)".into(),
            ));
        }
        if let Some(list) = failpoints {
            granule_failpoints::check_list(list)
                .map_err(|e| RemoteError::Refused(e.to_string()))?;
            granule_failpoints::clear_all();
            granule_failpoints::set_list(list).map_err(|e| RemoteError::Refused(e.to_string()))?;
        }
        if let Some(rules) = filter {
            if rules.trim().is_empty() {
                self.filter.clear();
            } else {
                let rules: FaultRules = serde_json::from_str(rules)
                    .map_err(|e| RemoteError::Decode(format!("fault rules: {e}")))?;
                self.filter
                    .set_rules(rules)
                    .map_err(|e| RemoteError::Refused(e.to_string()))?;
            }
        }
        Ok(report.then(|| self.report()))
    }

    /// What the filter and the failpoints did, for a failing test to print.
    pub(crate) fn report(&self) -> String {
        let mut out = self.filter.report();
        let fired = granule_failpoints::trace();
        if !fired.is_empty() {
            out.push_str("\nfailpoints:\n");
            for t in fired {
                out.push_str(&format!(
                    "  {:>10.3} ms  {} hit {}: {}\n",
                    t.at.as_secs_f64() * 1e3,
                    t.name,
                    t.hit,
                    t.action
                ));
            }
        }
        out
    }
}
