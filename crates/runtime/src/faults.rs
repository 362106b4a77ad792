//! Fault injection from the driver, for tests: set the transport filter's rules (drop,
//! delay, reorder, cut, partition) and arm failpoints on any node of the cluster, and
//! read back what they did. Nodes take these orders only when their configuration has
//! `faults.enabled` ([`ClusterBuilder::faults`](crate::ClusterBuilder::faults)).
//!
//! ```no_run
//! use granule_runtime::{faults::{FaultRules, Partition}, Cluster};
//! let cluster = Cluster::builder().faults(true).start()?;
//! let nodes = cluster.worker_nodes()?;
//! // The first node cannot reach the second (both directions), until healed.
//! cluster.faults().everywhere(&FaultRules::seeded(7).partition(Partition::nodes([
//!     vec![nodes[0]],
//!     vec![nodes[1]],
//! ])))?;
//! // A move's destination crashes when the third chunk of the state arrives.
//! cluster.faults().failpoints(nodes[1], "stream.chunk_received=2*off->crash")?;
//! cluster.faults().clear()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// Failpoints for closures of your own: `hit_blocking("user.in_closure")` (armed like
/// any failpoint). On a replicated proclet the primary takes the step and its backups
/// replay the outcome.
pub use granule_failpoints::{hit, hit_blocking, Fired};
pub use granule_transport::{
    Direction, Endpoint, FaultAction, FaultRule, FaultRules, Frames, Partition,
};

use crate::cluster::Cluster;
use crate::error::CallError;
use granule_wire::{Frame, Msg, NodeId, NodeState};

/// The fault-injection controls of a cluster (see the module doc).
pub struct Faults<'a> {
    pub(crate) cluster: &'a Cluster,
}

impl Faults<'_> {
    /// Replace the transport filter's rules on `node` (the driver's own id works too).
    pub fn filter(&self, node: NodeId, rules: &FaultRules) -> Result<(), CallError> {
        let json = serde_json::to_string(rules)
            .map_err(|e| CallError::Internal(format!("cannot encode fault rules: {e}")))?;
        self.order(node, None, Some(json), false).map(|_| ())
    }

    /// Replace the filter's rules on every alive node and on the driver.
    pub fn everywhere(&self, rules: &FaultRules) -> Result<(), CallError> {
        for n in self.all()? {
            self.filter(n, rules)?;
        }
        Ok(())
    }

    /// Replace every armed failpoint on `node` with `list` (`name=spec;...`; `""`
    /// disarms all; names and specs: the `granule-failpoints` crate).
    pub fn failpoints(&self, node: NodeId, list: &str) -> Result<(), CallError> {
        self.order(node, Some(list.to_string()), None, false)
            .map(|_| ())
    }

    /// Clear every filter rule and disarm every failpoint, on every alive node and on
    /// the driver.
    pub fn clear(&self) -> Result<(), CallError> {
        for n in self.all()? {
            self.order(n, Some(String::new()), Some(String::new()), false)?;
        }
        Ok(())
    }

    /// What the filter and the failpoints of `node` did: its seed, rules, and one line
    /// per action (print it when a test fails).
    pub fn report(&self, node: NodeId) -> Result<String, CallError> {
        self.order(node, None, None, true)
    }

    /// The alive nodes and the driver.
    fn all(&self) -> Result<Vec<NodeId>, CallError> {
        let mut v: Vec<NodeId> = self
            .cluster
            .nodes()?
            .into_iter()
            .filter(|n| n.state == NodeState::Alive)
            .map(|n| n.id)
            .collect();
        let me = self.cluster.node_id();
        if !v.contains(&me) {
            v.push(me);
        }
        Ok(v)
    }

    fn order(
        &self,
        node: NodeId,
        failpoints: Option<String>,
        filter: Option<String>,
        report: bool,
    ) -> Result<String, CallError> {
        let me = self.cluster.inner()?;
        let msg = Msg::Faults {
            failpoints,
            filter,
            report,
        };
        if node == me.id {
            return me
                .faults
                .apply(&msg)
                .map(Option::unwrap_or_default)
                .map_err(|e| CallError::Refused(e.to_string()));
        }
        let n = me.clone();
        me.block(
            async move {
                let addr = n.addr_of(node).await?;
                let conn = n.peers.connect(node, &addr).await?;
                match conn.request(&msg, &[]).await {
                    Ok(Frame {
                        msg: Msg::Done,
                        tail,
                        ..
                    }) => Ok(String::from_utf8_lossy(&tail).into_owned()),
                    Ok(Frame {
                        msg: Msg::Error(e), ..
                    }) => Err(CallError::Refused(format!("{node}: {e}"))),
                    Ok(f) => Err(CallError::Internal(format!(
                        "unexpected answer {} to a fault order",
                        f.msg.name()
                    ))),
                    Err(e) => Err(n.peers.transport_error(node, e)),
                }
            },
            None,
        )
        .ok_or_else(|| CallError::Internal("interrupted".into()))?
    }
}
