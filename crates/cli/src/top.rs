//! `granule top`: a live view of a running cluster — every node with CPU and memory bars,
//! proclets per kind, and the most recent cluster events — redrawn in place on a
//! terminal, printed as plain successive snapshots otherwise (pipes, logs, tests).
//!
//! It is a tool connection (no binary check, hosts nothing), like `granule status`, and
//! only reads: `ListNodes` and `Events` from the controller.

use crate::status::{bytes, format_event};
use anyhow::Context;
use granule_controller::ControllerClient;
use granule_wire::{ClusterEvent, Kind, NodeInfo, NodeState};
use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

/// Events kept on screen.
const EVENTS_SHOWN: usize = 12;
/// Width of the CPU and memory bars, in cells.
const BAR: usize = 20;

pub struct Options {
    pub controller: String,
    pub interval: Duration,
    /// Stop after this many refreshes (`None`: until interrupted).
    pub iterations: Option<u64>,
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let addr = opts.controller.clone();
    let client = rt
        .block_on(ControllerClient::connect_tool(&addr, "granule top"))
        .with_context(|| format!("asking the controller at {addr}"))?;
    let term = console::Term::stdout();
    let live = term.is_term();
    let mut events: VecDeque<ClusterEvent> = VecDeque::new();
    let mut last_seq = 0u64;
    let mut shown = 0u64;
    loop {
        let t = Instant::now();
        let market = rt.block_on(crate::market::market_view(&addr, "granule top"));
        let (nodes, fresh) = rt
            .block_on(async {
                let nodes = client.list_nodes().await?;
                // The first time, only the tail of the controller's log matters.
                let fresh = if last_seq == 0 {
                    crate::status::recent_events(&client, EVENTS_SHOWN).await?
                } else {
                    client.events(last_seq, 1000).await?
                };
                Ok::<_, granule_controller::ControllerError>((nodes, fresh))
            })
            .with_context(|| format!("the controller at {addr} stopped answering"))?;
        for e in fresh {
            last_seq = last_seq.max(e.seq);
            events.push_back(e);
        }
        while events.len() > EVENTS_SHOWN {
            events.pop_front();
        }
        let width = if live {
            term.size().1 as usize
        } else {
            usize::MAX
        };
        let mut lines = frame(&addr, opts.interval, &nodes, &events);
        if let Some(v) = &market {
            lines.push(String::new());
            lines.extend(crate::market::market_lines(v));
        }
        if live {
            // Redraw in place: home, overwrite each line, wipe what the last frame left.
            term.move_cursor_to(0, 0)?;
            for l in &lines {
                term.clear_line()?;
                term.write_line(&truncate(l, width))?;
            }
            term.clear_to_end_of_screen()?;
        } else {
            let mut out = std::io::stdout().lock();
            for l in &lines {
                writeln!(out, "{l}")?;
            }
            writeln!(out)?;
            out.flush()?;
        }
        shown += 1;
        if opts.iterations.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        std::thread::sleep(opts.interval.saturating_sub(t.elapsed()));
    }
}

/// One screen: header, a row per node, proclet totals, recent events.
fn frame(
    addr: &str,
    interval: Duration,
    nodes: &[NodeInfo],
    events: &VecDeque<ClusterEvent>,
) -> Vec<String> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let alive = nodes.iter().filter(|n| n.state == NodeState::Alive).count();
    let mut lines = vec![
        format!(
            "granule top — controller {addr} — {} UTC — every {interval:?} (Ctrl-C quits)",
            &crate::status::clock(now_ms)[..8]
        ),
        format!("{alive} of {} nodes alive", nodes.len()),
        String::new(),
        format!(
            "{:<5} {:<6} {:<5} {:<w$} {:>11}  {:<w$} {:>19}  {:>14}  {:<8}",
            "NODE",
            "ROLE",
            "STATE",
            "CPU",
            "busy/cores",
            "MEMORY",
            "used/limit",
            "PROCLETS c/m/h",
            "PRESSURE",
            w = BAR + 2
        ),
    ];
    let mut per_kind = [0u64; 3];
    for n in nodes {
        let u = &n.usage;
        let (used, limit) = n.memory();
        for (total, k) in per_kind.iter_mut().zip(u.proclets) {
            *total += u64::from(k);
        }
        let pressure = granule_report::usage::pressure_label(u);
        lines.push(format!(
            "{:<5} {:<6} {:<5} {} {:>11}  {} {:>19}  {:>14}  {:<8}",
            n.id.to_string(),
            granule_report::usage::role_name(n.role),
            match n.state {
                NodeState::Alive => "alive",
                NodeState::Dead => "DEAD",
                NodeState::Left => "left",
            },
            bar(u.cores_busy / n.spec.cores.max(1e-9)),
            format!("{:.2}/{}", u.cores_busy, n.spec.cores),
            bar(used as f64 / limit.max(1) as f64),
            format!("{}/{}", bytes(used), bytes(limit)),
            format!(
                "{}/{}/{}",
                u.proclets[Kind::Compute.index()],
                u.proclets[Kind::Memory.index()],
                u.proclets[Kind::Hybrid.index()]
            ),
            pressure,
        ));
    }
    lines.push(String::new());
    lines.push(format!(
        "proclets: {} compute, {} memory, {} hybrid ({} in all)",
        per_kind[Kind::Compute.index()],
        per_kind[Kind::Memory.index()],
        per_kind[Kind::Hybrid.index()],
        per_kind.iter().sum::<u64>()
    ));
    lines.push(String::new());
    lines.push("recent events (newest last, times UTC):".to_string());
    if events.is_empty() {
        lines.push("  (none yet)".to_string());
    }
    lines.extend(events.iter().map(|e| format!("  {}", format_event(e))));
    lines
}

/// `[#####.....]` filled to `fraction` (clamped to 0..=1; over 1 shows a `+`).
fn bar(fraction: f64) -> String {
    let f = if fraction.is_finite() { fraction } else { 0.0 };
    let filled = ((f.clamp(0.0, 1.0) * BAR as f64).round() as usize).min(BAR);
    let mut s = String::with_capacity(BAR + 2);
    s.push('[');
    s.extend(std::iter::repeat_n('#', filled));
    s.extend(std::iter::repeat_n('.', BAR - filled));
    s.push(if f > 1.0 { '+' } else { ']' });
    s
}

/// Cut a line to the terminal's width (by characters: the bars and arrows are one cell).
fn truncate(line: &str, width: usize) -> String {
    line.chars().take(width.max(1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_fill_and_clamp() {
        assert_eq!(bar(0.0), format!("[{}]", ".".repeat(BAR)));
        assert_eq!(
            bar(0.5),
            format!("[{}{}]", "#".repeat(BAR / 2), ".".repeat(BAR / 2))
        );
        assert_eq!(bar(3.0), format!("[{}+", "#".repeat(BAR)));
        assert_eq!(bar(f64::NAN), bar(0.0));
        assert_eq!(truncate("abcdef", 3), "abc");
    }
}
