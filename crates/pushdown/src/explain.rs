//! What the executor chose for each operator of a query, the figures behind the choice,
//! and what the other choices were estimated to cost: the record [`crate::dist::Executor::run`]
//! returns and `granule pushdown explain` prints.

use crate::rule::{Choice, Mode, NodeView, Plan};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// One operator (a stage over one table).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpExplain {
    /// Its name, e.g. `q14 scan (lineitem)`.
    pub operator: String,
    /// Shards (or parts of shards) pushed and pulled by the plan.
    pub shards_pushed: usize,
    /// See `shards_pushed`.
    pub shards_pulled: usize,
    /// Whether a row group was first pushed and another pulled to measure.
    pub calibrated: bool,
    /// Pushed shards (or parts) a node refused (a join table over a pushed call's
    /// budget, a full queue, a timeout) and the caller pulled instead.
    #[serde(default)]
    pub fell_back: usize,
    /// Bytes of columns the operator read.
    pub bytes_in: u64,
    /// The rule's plan: modes, estimates, the figures it used.
    pub plan: Plan,
    /// The data nodes as the rule saw them.
    pub nodes: Vec<(u64, NodeView)>,
    /// How long the planned part took.
    pub planned_part: Duration,
    /// How long the operator took, calibration included.
    pub took: Duration,
}

/// A word count's map-shuffle: the map side's (word, count) pairs went into partitions
/// keyed by word (from the data nodes for pushed shards, from the caller for pulled
/// ones), and the reduce summed each partition's.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShuffleExplain {
    /// Pairs the partitions received (pre-aggregated per shard or pulled part).
    pub pairs: u64,
    /// Partitions they landed in.
    pub partitions: usize,
    /// How long the reduce took.
    pub reduce: Duration,
}

/// A query's record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Explain {
    /// The query's name.
    pub query: String,
    /// How it was asked to choose.
    pub choice: Choice,
    /// Its operators, in the order they ran.
    pub ops: Vec<OpExplain>,
    /// A word count's shuffle, when the query has one.
    pub shuffle: Option<ShuffleExplain>,
    /// Its run time.
    pub total: Duration,
}

impl Explain {
    /// Whether every shard of every operator ran `mode`.
    pub fn all(&self, mode: Mode) -> bool {
        self.ops
            .iter()
            .all(|o| o.plan.modes.iter().all(|m| *m == mode))
    }

    /// The plan's choice in one word per operator: `push`, `pull` or `mixed`.
    pub fn summary(&self) -> String {
        self.ops
            .iter()
            .map(|o| match (o.shards_pushed, o.shards_pulled) {
                (_, 0) => "push",
                (0, _) => "pull",
                _ => "mixed",
            })
            .collect::<Vec<_>>()
            .join("+")
    }
}

fn gbps(bytes_per_s: Option<f64>) -> String {
    bytes_per_s.map_or("-".into(), |b| format!("{:.2} GB/s", b / 1e9))
}

/// The mark of a figure the rule assumed rather than measured.
fn assumed(yes: bool) -> &'static str {
    if yes {
        " (assumed, not measured yet)"
    } else {
        ""
    }
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

impl fmt::Display for Explain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let choice = match self.choice {
            Choice::Auto => "the cost rule".to_string(),
            Choice::Force(m) => format!("forced {m}"),
        };
        writeln!(
            f,
            "query {}: {} ({:.1} ms)",
            self.query,
            choice,
            self.total.as_secs_f64() * 1e3
        )?;
        for o in &self.ops {
            let p = &o.plan;
            let u = &p.used;
            let a = &p.assumed;
            writeln!(
                f,
                "  {}: {} shard(s) pushed, {} pulled{}{}; read {:.1} MiB in {}",
                o.operator,
                o.shards_pushed,
                o.shards_pulled,
                if o.calibrated {
                    " (after calibrating on one pushed and one pulled row group)"
                } else {
                    ""
                },
                if o.fell_back > 0 {
                    format!(
                        "; {} pushed part(s) refused by their node and pulled instead",
                        o.fell_back
                    )
                } else {
                    String::new()
                },
                o.bytes_in as f64 / (1 << 20) as f64,
                ms(o.took.as_secs_f64()),
            )?;
            writeln!(
                f,
                "    figures: intensity at the data {} per core{}, at the caller {} per core{}; \
                 selectivity {:.2e}{}; network {}{}; pushed calls ran {}",
                gbps(u.push_rate),
                assumed(a.push_rate),
                gbps(u.pull_rate),
                assumed(a.pull_rate),
                u.selectivity.unwrap_or(0.0),
                assumed(a.selectivity),
                gbps(u.bandwidth),
                assumed(a.bandwidth),
                u.push_stretch
                    .map_or("(not measured yet)".to_string(), |s| {
                        format!("{s:.2}x their CPU time")
                    }),
            )?;
            let fix = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("x{x:.2}"));
            writeln!(
                f,
                "    measured / modelled time of past runs: pushed part {}, pulled part {}",
                fix(u.push_fix),
                fix(u.pull_fix),
            )?;
            for (node, v) in &o.nodes {
                writeln!(
                    f,
                    "    node n{node}: cap {}, free {:.2} cores, {} pool thread(s): {:.2} cores for pushed work",
                    v.cap.map_or("none".into(), |c| {
                        format!("{c:.2} cores (a {:.0} ms quota per {:.0} ms)", c * v.period * 1e3, v.period * 1e3)
                    }),
                    v.free,
                    v.threads,
                    v.cores()
                )?;
                if v.running > 0 || v.queued > 0 {
                    writeln!(
                        f,
                        "      its pool was busy with others' calls: {} running (the youngest for {}), {} queued; pushed work there waits about {}",
                        v.running,
                        ms(v.busy_for),
                        v.queued,
                        ms(v.wait()),
                    )?;
                }
            }
            for (name, e) in [
                ("chosen", &p.chosen),
                ("all pull", &p.all_pull),
                ("all push", &p.all_push),
            ] {
                writeln!(
                    f,
                    "    {name:>8}: est. {} (caller compute {}, network {}, busiest node {}, shared cores {})",
                    ms(e.total()),
                    ms(e.caller_compute),
                    ms(e.network),
                    ms(e.busiest_node),
                    ms(e.shared),
                )?;
            }
        }
        if let Some(s) = &self.shuffle {
            writeln!(
                f,
                "  shuffle: {} (word, count) pairs into {} partition(s) by word; reduced at the caller in {}",
                s.pairs,
                s.partitions,
                ms(s.reduce.as_secs_f64()),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::{self, Caller, Figures, ShardWork};
    use std::collections::BTreeMap;

    fn explain(f: &Figures) -> String {
        let shards = vec![ShardWork {
            node: 1,
            bytes_in: 1 << 20,
            groups: 2,
            only: None,
        }];
        let caller = Caller {
            cores: 1.0,
            call_cost: 1e-4,
            push_arg_bytes: 0,
            shared_cores: None,
        };
        let plan = rule::plan(&shards, &BTreeMap::new(), &caller, f, Choice::Auto);
        Explain {
            query: "q6".into(),
            choice: Choice::Auto,
            ops: vec![OpExplain {
                operator: "q6 scan (lineitem)".into(),
                shards_pushed: plan.counts().0,
                shards_pulled: plan.counts().1,
                calibrated: false,
                fell_back: 0,
                bytes_in: 1 << 20,
                plan,
                nodes: vec![],
                planned_part: Duration::ZERO,
                took: Duration::ZERO,
            }],
            shuffle: None,
            total: Duration::ZERO,
        }
        .to_string()
    }

    #[test]
    fn figures_not_measured_yet_are_printed_as_assumed() {
        // Pulled once, never pushed: the data side's intensity is the caller's, assumed.
        let f = Figures {
            pull_rate: Some(2e9),
            selectivity: Some(1e-3),
            bandwidth: Some(3e9),
            ..Figures::default()
        };
        let text = explain(&f);
        let line = text
            .lines()
            .find(|l| l.contains("figures:"))
            .expect("a figures line");
        assert!(
            line.contains("at the data 2.00 GB/s per core (assumed, not measured yet), at the caller 2.00 GB/s per core;"),
            "{line}"
        );
        assert_eq!(line.matches("assumed").count(), 1, "{line}");
        // Everything measured: nothing marked.
        let f = Figures {
            push_rate: Some(5e9),
            ..f
        };
        assert!(!explain(&f).contains("assumed"), "{}", explain(&f));
    }
}
