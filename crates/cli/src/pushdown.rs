//! `granule pushdown`: run one of the pushdown queries on the embedded local cluster —
//! generated tables on two data nodes, the query pulled, pushed or by the cost rule — and
//! print its result and what the executor chose and why (`explain`).

use anyhow::{bail, Context};
use clap::Args;
use granule::pushdown::dist::{load_spread, Executor};
use granule::pushdown::rule::Choice;
use granule::pushdown::{queries, row_groups, run_local, TableName, Value};
use granule::sharded::Bounds;
use granule::{Cluster, NodeSpec};

#[derive(Args)]
pub struct PushdownArgs {
    /// The query: q6, q1, q14, q12 or wordcount.
    #[arg(long, default_value = "q6")]
    query: String,
    /// TPC-H scale factor of the generated tables (0.1: 600,000 lineitem rows).
    #[arg(long, default_value_t = 0.1)]
    sf: f64,
    /// How to run it: auto (the cost rule), pull or push.
    #[arg(long, default_value = "auto")]
    mode: String,
    /// CPU cap of the data nodes' pushed work, in cores (pushdown.cpu_cap; 0 = none).
    #[arg(long, default_value_t = 0.0)]
    cap: f64,
    /// Runs of the query (the rule learns from each; the last one's explain is printed).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

pub fn run(a: PushdownArgs) -> anyhow::Result<()> {
    let choice: Choice = a.mode.parse().map_err(anyhow::Error::msg)?;
    if !(a.sf > 0.0 && a.sf <= 10.0) {
        bail!("--sf {}: give a scale factor in (0, 10]", a.sf);
    }
    if !(0.0..=64.0).contains(&a.cap) {
        bail!("--cap {}: give a share of cores between 0 and 64", a.cap);
    }
    let q = queries::all()?
        .into_iter()
        .find(|q| q.name == a.query)
        .with_context(|| {
            format!(
                "--query {}: not a query (q6, q1, q14, q12, wordcount)",
                a.query
            )
        })?;
    let mut tables = Vec::new();
    for t in TableName::ALL {
        let g = row_groups(t, a.sf, 42, granule::pushdown::DEFAULT_ROWS_PER_GROUP)?;
        let schema = g.schema().clone();
        tables.push((
            t,
            granule::pushdown::Table {
                schema,
                groups: g.collect(),
            },
        ));
    }
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=4GiB;cpu=1,mem=4GiB")?
        .driver(NodeSpec {
            cores: 1.0,
            mem_bytes: 256 << 20,
        })
        .set("pushdown.cpu_cap", &a.cap.to_string())?
        .shed(false)
        .start()
        .context("starting the embedded cluster")?;
    let out = (|| {
        let data = cluster.worker_nodes()?;
        // The driver is the caller: the data lives on the data nodes, spread evenly.
        let local = tables.into_iter().collect();
        let dist = load_spread(&cluster, &local, Bounds::new(16 << 20, 64 << 20)?, &data)?;
        let mut exec = Executor::configured(cluster.config());
        exec.shared_cores =
            Some(std::thread::available_parallelism().map_or(1, |n| n.get()) as f64);
        let want = run_local(&q, &local)?;
        let mut last = None;
        for _ in 0..a.runs.max(1) {
            let (got, explain) = exec.run(&q, &dist, choice)?;
            if got != want {
                bail!(
                    "{}: the distributed result differs from the in-process one",
                    q.name
                );
            }
            last = Some((got, explain));
        }
        for (_, t) in dist {
            t.destroy()?;
        }
        Ok(last)
    })();
    cluster.shutdown();
    let Some((result, explain)) = out? else {
        return Ok(());
    };
    println!("{}", result.columns.join("\t"));
    let shown = 20;
    for row in result.rows.iter().take(shown) {
        let cells: Vec<String> = row
            .iter()
            .map(|v| match v {
                Value::Null => "NULL".to_string(),
                Value::Int(i) => i.to_string(),
                Value::Str(s) => s.clone(),
            })
            .collect();
        println!("{}", cells.join("\t"));
    }
    if result.rows.len() > shown {
        println!("... {} rows in all", result.rows.len());
    }
    println!();
    print!("{explain}");
    Ok(())
}
