//! Text tables of a cluster's resource use, as the controller reports it (`ListNodes`):
//! what `granule status` prints and what every benchmark prints at its end.

use granule_wire::{NodeInfo, NodeState, Role};

/// Human-readable bytes (binary units).
pub fn bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn render(rows: Vec<Vec<String>>) -> String {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// One row per node: liveness, CPU (busy, throttling, run-queue delay), memory (used
/// against the tighter of budget and cgroup limit; proclets' share), pressure, moves.
pub fn node_table(nodes: &[NodeInfo]) -> String {
    let mut rows = vec![[
        "NODE",
        "ROLE",
        "STATE",
        "ADDRESS",
        "PID",
        "CPU busy/spec",
        "THROTTLED",
        "RUNQ",
        "MEMORY used/limit",
        "IN PROCLETS",
        "PROCLETS c/m/h",
        "PRESSURE",
        "MOVED OUT",
        "CALLS",
        "SEEN",
    ]
    .map(String::from)
    .to_vec()];
    for n in nodes {
        let u = &n.usage;
        let (used, limit) = n.memory();
        let limit_src = if u.cgroup_mem_limit > 0 && u.cgroup_mem_limit <= limit {
            " (cgroup)"
        } else {
            ""
        };
        let pressure = pressure_label(u);
        rows.push(vec![
            n.id.to_string(),
            role_name(n.role),
            match n.state {
                NodeState::Alive => "alive".into(),
                NodeState::Dead => "DEAD".into(),
                NodeState::Left => "left".into(),
            },
            n.addr.clone(),
            n.pid.to_string(),
            format!("{:.2}/{}", u.cores_busy, n.spec.cores),
            format!("{:.0}%", u.cpu_throttled * 100.0),
            format!("{:.2}", u.runq_delay),
            format!("{}/{}{limit_src}", bytes(used), bytes(limit)),
            bytes(u.proclet_bytes),
            format!("{}/{}/{}", u.proclets[0], u.proclets[1], u.proclets[2]),
            pressure.into(),
            u.moves_out.to_string(),
            u.calls_served.to_string(),
            format!("{} ms ago", n.last_seen_ms),
        ]);
    }
    render(rows)
}

/// The largest proclets of every node (each node reports up to 16).
pub fn proclet_table(nodes: &[NodeInfo]) -> String {
    let mut rows = vec![["NODE", "PROCLET", "KIND", "MEMORY", "CORES", "PINNED"]
        .map(String::from)
        .to_vec()];
    for n in nodes.iter().filter(|n| n.state == NodeState::Alive) {
        for p in &n.usage.top {
            rows.push(vec![
                n.id.to_string(),
                p.id.to_string(),
                p.kind.to_string(),
                bytes(p.mem_bytes),
                format!("{:.2}", p.cores),
                if p.pinned { "yes" } else { "-" }.into(),
            ]);
        }
    }
    if rows.len() == 1 {
        return "no proclets\n".into();
    }
    render(rows)
}

/// Which pressure a node reports: `mem`, `cpu`, `mem+cpu` or `-`.
pub fn pressure_label(u: &granule_wire::Usage) -> &'static str {
    match (u.mem_pressure, u.cpu_pressure) {
        (true, true) => "mem+cpu",
        (true, false) => "mem",
        (false, true) => "cpu",
        (false, false) => "-",
    }
}

/// A role as the tables print it (`driver`, `node`, ...).
pub fn role_name(role: Role) -> String {
    match role {
        Role::Driver => "driver".into(),
        Role::Node => "node".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::{Kind, NodeId, NodeSpec, ProcletId, ProcletUsage, Usage};

    #[test]
    fn tables_show_limits_pressure_and_proclets() {
        let n = NodeInfo {
            id: NodeId(3),
            role: Role::Node,
            addr: "127.0.0.1:5000".into(),
            pid: 42,
            spec: NodeSpec {
                cores: 1.0,
                mem_bytes: 1 << 30,
            },
            usage: Usage {
                mem_used: 100 << 20,
                cgroup_mem_usage: 900 << 20,
                cgroup_mem_limit: 1 << 30,
                mem_budget: 1 << 30,
                mem_pressure: true,
                moves_out: 4,
                top: vec![ProcletUsage {
                    id: ProcletId(9),
                    kind: Kind::Memory,
                    mem_bytes: 8 << 20,
                    cores: 0.25,
                    pinned: true,
                }],
                ..Default::default()
            },
            state: NodeState::Alive,
            last_seen_ms: 7,
            cgroups: None,
            metrics_addr: None,
        };
        let t = node_table(std::slice::from_ref(&n));
        assert!(t.contains("900.0 MiB/1.0 GiB (cgroup)"), "{t}");
        assert!(t.contains("mem"), "{t}");
        let p = proclet_table(&[n]);
        assert!(
            p.contains("p9") && p.contains("8.0 MiB") && p.contains("yes"),
            "{p}"
        );
        assert_eq!(bytes(512), "512 B");
    }
}
