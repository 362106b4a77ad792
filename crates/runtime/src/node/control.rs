//! The node's link to the controller: proclet ids handed out in blocks, and the
//! heartbeat loop that reports the node's use, carries its events, and keeps its view of
//! the membership current.

use super::NodeInner;
use crate::error::CallError;
use crate::usage::CpuMeter;
use granule_controller::ControllerError;
use granule_wire::{ProcletId, RemoteError, Usage};
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Proclet ids fetched from the controller at once.
const ID_BLOCK: u32 = 1024;

/// The ids this node may still hand out (a block from the controller).
#[derive(Default)]
pub(crate) struct IdBlocks {
    left: Mutex<Range<u64>>,
}

impl NodeInner {
    /// The next proclet id (a controller round trip once per block).
    pub(crate) async fn next_id(&self) -> Result<ProcletId, CallError> {
        if let Some(id) = self.ids.left.lock().next() {
            return Ok(ProcletId(id));
        }
        let block = self.controller.alloc_ids(ID_BLOCK).await?;
        let mut ids = self.ids.left.lock();
        if ids.is_empty() {
            *ids = block;
        }
        ids.next()
            .map(ProcletId)
            .ok_or_else(|| CallError::Internal("empty id block".into()))
    }
}

/// Report to the controller every `every` until the node stops; stop the node if the
/// controller declares it dead or is gone.
pub(super) async fn heartbeat_loop(node: Arc<NodeInner>, every: Duration) {
    let mut meter = CpuMeter::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if node.is_stopped() {
            return;
        }
        if granule_failpoints::hit("heartbeat.send").await.is_err() {
            continue;
        }
        let r = node.monitor.reading();
        let cores_busy = meter.sample();
        node.metrics
            .cores_busy
            .store(cores_busy.to_bits(), Ordering::Relaxed);
        let usage = Usage {
            cores_busy,
            // The monitor read these at most one memory interval ago.
            mem_used: r.rss,
            proclets: node.hosting.counts(),
            calls_served: node.hosting.calls_served.load(Ordering::Relaxed),
            mem_budget: node.monitor.budget(),
            proclet_bytes: r.proclet_bytes,
            cgroup_mem_limit: r.cgroup_limit,
            cgroup_mem_usage: r.cgroup_usage,
            cpu_throttled: r.cpu_throttled,
            runq_delay: r.runq_delay,
            mem_pressure: r.mem_pressure,
            cpu_pressure: r.cpu_pressure,
            moves_out: node.migration.moves_out.load(Ordering::Relaxed),
            top: node.hosting.top(16),
            groups: node.hosting.groups(),
        };
        match node
            .controller
            .heartbeat(node.id, usage, crate::telemetry::drain())
            .await
        {
            Ok(version) => {
                if node.peers.members_changed(version) {
                    if let Ok(list) = node.controller.list_nodes().await {
                        for down in node.peers.update_members(list, version) {
                            node.peers.on_node_down(node.id, down);
                        }
                    }
                }
            }
            Err(ControllerError::Remote(RemoteError::NodeDown(_))) => {
                node.lifecycle.mark_declared_dead();
                node.trigger_shutdown("the controller declared this node dead".into());
                return;
            }
            Err(e) => {
                node.trigger_shutdown(format!("lost the controller: {e}"));
                return;
            }
        }
    }
}
