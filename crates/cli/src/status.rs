//! `granule status`: the nodes of a running cluster as a table (like `kubectl get`), their
//! largest proclets, and the cluster's most recent events. Also the event formatting
//! `granule top` shares.

use anyhow::Context;
use granule_controller::ControllerClient;
use granule_wire::ClusterEvent;

/// How many recent events `status` prints.
const RECENT_EVENTS: usize = 10;

pub fn run(controller: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (nodes, events, market) = rt
        .block_on(async {
            let c = ControllerClient::connect_tool(controller, "granule status").await?;
            let nodes = c.list_nodes().await?;
            let events = recent_events(&c, RECENT_EVENTS).await?;
            let market = crate::market::market_view(controller, "granule status").await;
            Ok::<_, granule_controller::ControllerError>((nodes, events, market))
        })
        .with_context(|| format!("asking the controller at {controller}"))?;
    print!("{}", granule_report::usage::node_table(&nodes));
    println!();
    print!("{}", granule_report::usage::proclet_table(&nodes));
    println!();
    println!("recent events (newest last, times UTC):");
    if events.is_empty() {
        println!("  (none yet)");
    }
    for e in &events {
        println!("  {}", format_event(e));
    }
    if let Some(v) = market {
        println!();
        for l in crate::market::market_lines(&v) {
            println!("{l}");
        }
    }
    Ok(())
}

/// The controller's `n` most recent events, oldest first. The controller answers
/// "everything after a sequence number" (it keeps its last 2000), so the newest are the
/// tail of the whole log.
pub async fn recent_events(
    c: &ControllerClient,
    n: usize,
) -> Result<Vec<ClusterEvent>, granule_controller::ControllerError> {
    let mut all = c.events(0, u32::MAX).await?;
    let skip = all.len().saturating_sub(n);
    Ok(all.split_off(skip))
}

/// `HH:MM:SS.mmm` (UTC) of a UNIX time in milliseconds; no time-zone database needed.
pub fn clock(at_ms: u64) -> String {
    let ms = at_ms % 1000;
    let s = (at_ms / 1000) % 86_400;
    format!("{:02}:{:02}:{:02}.{ms:03}", s / 3600, (s / 60) % 60, s % 60)
}

/// One event on one line: when, what, where, how much, why.
pub fn format_event(e: &ClusterEvent) -> String {
    let mut line = format!(
        "{} #{:<5} {:<16} {:<24} {}",
        clock(e.at_ms),
        e.seq,
        e.kind.as_str(),
        e.subject,
        e.node
    );
    if let Some(to) = e.to {
        line.push_str(&format!(" → {to}"));
    }
    if e.bytes > 0 {
        line.push_str(&format!(" {}", bytes(e.bytes)));
    }
    if e.micros > 0 {
        line.push_str(&format!(" in {:.2} ms", e.micros as f64 / 1e3));
    }
    if !e.detail.is_empty() {
        line.push_str(&format!(" ({})", e.detail));
    }
    line
}

/// A byte count in the unit that keeps it short.
pub fn bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let f = b as f64;
    if f >= KIB * KIB * KIB {
        format!("{:.1} GiB", f / (KIB * KIB * KIB))
    } else if f >= KIB * KIB {
        format!("{:.1} MiB", f / (KIB * KIB))
    } else if f >= KIB {
        format!("{:.1} KiB", f / KIB)
    } else {
        format!("{b} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::{EventKind, NodeId};

    #[test]
    fn events_read_as_one_line() {
        let mut e = ClusterEvent::now(EventKind::Migration, NodeId(1), "p12");
        e.at_ms = 3_723_004; // 01:02:03.004
        e.seq = 7;
        e.to = Some(NodeId(2));
        e.bytes = 3 << 20;
        e.micros = 1500;
        e.detail = "memory pressure".into();
        let line = format_event(&e);
        assert!(line.starts_with("01:02:03.004 #7"), "{line}");
        for part in [
            "migration",
            "p12",
            "→",
            "3.0 MiB",
            "1.50 ms",
            "(memory pressure)",
        ] {
            assert!(line.contains(part), "{part} missing: {line}");
        }
        assert_eq!(bytes(512), "512 B");
    }
}
