//! Queries over tables spread on real node processes (127.0.0.1), run pulled, pushed and
//! by the cost rule: every mode gives the reference executor's result (which the DuckDB
//! test checks against DuckDB), and pushed code that panics, times out or exceeds its
//! memory budget leaves the data nodes serving and the tables intact.

use granule_pushdown::dist::{load_spread, DistError, Executor, Tables};
use granule_pushdown::rule::{Choice, Figures, Mode};
use granule_pushdown::{queries, row_groups, run_local, OpError, RowGroup, Table, TableName};
use granule_runtime::{CallError, Cluster, PushOpts};
use granule_sharded::{Bounds, ShardError};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Run `f` on its own thread and fail instead of hanging past `limit`.
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => panic!("test body ended without a result"),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("test exceeded {limit:?}: probable hang or deadlock")
        }
    }
}

/// Table `t` at `scale`, generated from `seed` in row groups of 2048 rows.
fn generated(t: TableName, scale: f64, seed: u64) -> Table {
    let g = row_groups(t, scale, seed, 2048).expect("generator");
    Table {
        schema: g.schema().clone(),
        groups: g.collect(),
    }
}

fn local_tables(seed: u64) -> BTreeMap<TableName, Table> {
    TableName::ALL
        .into_iter()
        .map(|t| (t, generated(t, 0.005, seed)))
        .collect()
}

/// Load every table into the cluster, in shards small enough that each table has
/// several, spread over both data nodes.
fn load(cluster: &Cluster, local: &BTreeMap<TableName, Table>) -> Tables {
    let nodes = cluster.worker_nodes().expect("nodes");
    let bounds = Bounds::new(64 << 10, 256 << 10).expect("bounds");
    load_spread(cluster, local, bounds, &nodes).expect("load")
}

fn cluster() -> Cluster {
    Cluster::builder()
        .nodes("cpu=1,mem=1GiB;cpu=1,mem=1GiB")
        .expect("specs")
        .shed(false)
        .start()
        .expect("cluster")
}

#[test]
fn every_query_gives_the_reference_result_pulled_pushed_and_by_the_rule() {
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let local = local_tables(7);
        let tables = load(&c, &local);
        let exec = Executor::new();
        for q in queries::all().expect("queries") {
            let want = run_local(&q, &local).expect("reference");
            // The rule twice: first it calibrates, then it plans from what it measured.
            for choice in [
                Choice::Force(Mode::Pull),
                Choice::Force(Mode::Push),
                Choice::Auto,
                Choice::Auto,
            ] {
                let (got, explain) = exec.run(&q, &tables, choice).expect("run");
                assert_eq!(got, want, "{} ({choice:?}) differs", q.name);
                // The word count went through a real shuffle into partitions.
                if q.name == "wordcount" {
                    let sh = explain.shuffle.as_ref().expect("a word count shuffles");
                    assert!(
                        sh.pairs >= want.rows.len() as u64 && sh.partitions >= 1,
                        "{sh:?}"
                    );
                } else {
                    assert!(explain.shuffle.is_none());
                }
                match choice {
                    Choice::Force(m) => assert!(explain.all(m), "{explain}"),
                    Choice::Auto => {
                        let text = explain.to_string();
                        assert!(
                            text.contains("all pull") && text.contains("all push"),
                            "{text}"
                        );
                    }
                }
            }
            let f = exec
                .figures(&format!("{} scan ({})", q.name, q.table.name()))
                .expect("figures");
            assert!(f.push_rate.is_some() && f.pull_rate.is_some(), "{f:?}");
            assert!(exec.network().is_some_and(|b| b > 0.0));
        }
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

#[test]
fn pushed_code_that_panics_times_out_or_overspends_leaves_the_table_serving() {
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let local = local_tables(11);
        let tables = load(&c, &local);
        let exec = Executor::new();
        let q6 = queries::q6().expect("q6");
        let q14 = queries::q14().expect("q14");
        let want6 = run_local(&q6, &local).expect("reference");
        let want14 = run_local(&q14, &local).expect("reference");
        let li = &tables[&TableName::Lineitem];
        let rows = li.vec().len().expect("len");

        // A panic in pushed code comes back as an error naming it.
        let r = li.vec().offload_pushed(
            PushOpts::default(),
            (),
            |_: &(), _start: u64, _items: &[RowGroup]| -> u64 { panic!("pushed boom") },
        );
        match r {
            Err(ShardError::Call(CallError::RemotePanic { message, .. })) => {
                assert!(message.contains("pushed boom"), "{message}")
            }
            other => panic!("expected the panic back, got {:?}", other.map(|v| v.len())),
        }
        assert_eq!(
            exec.run(&q6, &tables, Choice::Force(Mode::Push))
                .expect("q6")
                .0,
            want6
        );

        // A call past its timeout fails at once; the node carries on.
        let t = Instant::now();
        let r = li.vec().offload_pushed(
            PushOpts::default().with_timeout(Duration::from_millis(100)),
            (),
            |_: &(), _start: u64, items: &[RowGroup]| -> usize {
                std::thread::sleep(Duration::from_millis(1500));
                items.len()
            },
        );
        assert!(
            matches!(r, Err(ShardError::Call(CallError::Timeout(..)))),
            "expected a timeout, got {:?}",
            r.map(|v| v.len())
        );
        assert!(
            t.elapsed() < Duration::from_millis(1200),
            "the timeout waited for the call"
        );
        assert_eq!(
            exec.run(&q6, &tables, Choice::Force(Mode::Push))
                .expect("q6")
                .0,
            want6
        );

        // A join table over the pushed call's budget is refused, not built (nor shipped:
        // the caller checks the budget first).
        let mut tight = Executor::new();
        tight.push = PushOpts::default().with_memory(4 << 10);
        match tight.run(&q14, &tables, Choice::Force(Mode::Push)) {
            Err(e @ DistError::PushBudget { .. }) => {
                assert!(e.to_string().contains("budget"), "{e}")
            }
            Err(e) => panic!("expected the budget refusal, got {e}"),
            Ok(_) => panic!("a join table of the whole part table fit in 4 KiB"),
        }
        assert_eq!(
            exec.run(&q14, &tables, Choice::Force(Mode::Push))
                .expect("q14")
                .0,
            want14
        );
        assert_eq!(li.vec().len().expect("len"), rows);
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

/// Every operator the queries above leave out, pulled, pushed and by the rule: min, max,
/// avg and count without groups, and a group-by on a hashed (not dictionary) key.
#[test]
fn every_aggregate_and_a_hashed_group_by_agree_pulled_pushed_and_by_the_rule() {
    use granule_pushdown::{schema, Agg, CmpOp, Expr, Finalize, Output, Pred, Query, Stage};
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let local = local_tables(13);
        let tables = load(&c, &local);
        let li = schema(TableName::Lineitem);
        let col = |n: &str| li.col(n).expect("column");
        let aggs = || {
            vec![
                Agg::Min(Expr::Col(col("l_extendedprice"))),
                Agg::Max(Expr::Col(col("l_extendedprice"))),
                Agg::Avg(Expr::Col(col("l_quantity"))),
                Agg::Count,
                Agg::Sum(Expr::Col(col("l_tax"))),
            ]
        };
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let queries = [
            Query {
                name: "aggregates".into(),
                columns: names(&["min_price", "max_price", "avg_qty", "count", "sum_tax"]),
                build: None,
                table: TableName::Lineitem,
                stage: Stage {
                    filter: Pred::Cmp(col("l_discount"), CmpOp::Lt, 4),
                    probe: None,
                    output: Output::Aggregate(aggs()),
                },
                finalize: Finalize::Table { key_dicts: vec![] },
            },
            Query {
                name: "by_supplier".into(),
                columns: names(&[
                    "supp",
                    "min_price",
                    "max_price",
                    "avg_qty",
                    "count",
                    "sum_tax",
                ]),
                build: None,
                table: TableName::Lineitem,
                stage: Stage {
                    filter: Pred::Cmp(col("l_quantity"), CmpOp::Lt, 30),
                    probe: None,
                    output: Output::GroupBy {
                        keys: vec![Expr::Col(col("l_suppkey"))],
                        aggs: aggs(),
                    },
                },
                finalize: Finalize::Table {
                    key_dicts: vec![None],
                },
            },
        ];
        let exec = Executor::new();
        for q in &queries {
            let want = run_local(q, &local).expect("reference");
            assert!(!want.rows.is_empty());
            for choice in [
                Choice::Force(Mode::Pull),
                Choice::Force(Mode::Push),
                Choice::Auto,
            ] {
                let (got, _) = exec.run(q, &tables, choice).expect("run");
                assert_eq!(got, want, "{} ({choice:?}) differs", q.name);
            }
        }
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

/// Issue 33, 6: where a push is refused, the rule pulls. Over a pushed call's budget the
/// join's probe runs pulled (forced pull works, so the rule must too), checked before
/// anything is shipped; the caller's own build has a budget as well, and a join that fits
/// neither way is a clear error.
#[test]
fn over_a_pushed_calls_budget_the_rule_pulls_and_the_callers_build_has_a_budget_too() {
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let local = local_tables(17);
        let tables = load(&c, &local);
        let q14 = queries::q14().expect("q14");
        let want = run_local(&q14, &local).expect("reference");
        let scan = |e: &granule_pushdown::explain::Explain| {
            e.ops.last().map(|o| o.plan.counts()).expect("a scan")
        };

        // Pushed calls of 4 KiB cannot hold the part table's join table: the rule runs
        // the probe pulled instead of failing (as forced pull does).
        let mut tight = Executor::new();
        tight.push = PushOpts::default().with_memory(4 << 10);
        let pulled = tight
            .run(&q14, &tables, Choice::Force(Mode::Pull))
            .expect("forced pull");
        assert_eq!(pulled.0, want);
        for round in 0..2 {
            let (got, explain) = match tight.run(&q14, &tables, Choice::Auto) {
                Ok(r) => r,
                Err(e) => panic!("round {round}: the rule failed where pulling works: {e}"),
            };
            assert_eq!(got, want, "round {round}");
            let (pushed, pulled) = scan(&explain);
            assert!(pushed == 0 && pulled > 0, "round {round}: {explain}");
        }

        // The caller's build memory: too small for the join table, forced pull is
        // refused with a clear error; the rule pushes the probe where the pushed calls'
        // budget holds it.
        let mut small_caller = Executor::new();
        small_caller.caller_build_memory = 4 << 10;
        match small_caller.run(&q14, &tables, Choice::Force(Mode::Pull)) {
            Err(e @ DistError::CallerBudget { push: None, .. }) => {
                let text = e.to_string();
                assert!(text.contains("pushdown.caller_build_memory"), "{text}");
            }
            Err(e) => panic!("expected the caller's build memory refusal, got {e}"),
            Ok(_) => panic!("the caller built a join table past its build memory"),
        }
        let (got, explain) = small_caller
            .run(&q14, &tables, Choice::Auto)
            .expect("the rule pushes what the caller cannot hold");
        assert_eq!(got, want);
        let (pushed, pulled) = scan(&explain);
        assert!(pulled == 0 && pushed > 0, "{explain}");

        // Neither fits: a clear error naming both budgets, before anything is shipped.
        let mut neither = Executor::new();
        neither.caller_build_memory = 4 << 10;
        neither.push = PushOpts::default().with_memory(4 << 10);
        match neither.run(&q14, &tables, Choice::Auto) {
            Err(e @ DistError::CallerBudget { push: Some(_), .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("pushdown.caller_build_memory")
                        && text.contains("pushdown.call_memory"),
                    "{text}"
                );
            }
            Err(e) => panic!("expected both budgets' refusal, got {e}"),
            Ok(_) => panic!("a join table fit in 4 KiB"),
        }
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

/// Issue 33, 7: a pushed call that timed out keeps its pool's only thread until its
/// closure returns; the rule must see that pool busy and pull rather than queue behind
/// it (and an idle pool must not look busy).
#[test]
fn a_pool_held_by_a_timed_out_call_is_pulled_around() {
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let local = local_tables(19);
        let tables = load(&c, &local);
        let q6 = queries::q6().expect("q6");
        let want = run_local(&q6, &local).expect("reference");
        let li = &tables[&TableName::Lineitem];
        let mut exec = Executor::new();
        exec.push = PushOpts::default().with_timeout(Duration::from_millis(500));
        // Figures under which pushing Q6 wins clearly, as measured on an idle cluster.
        let key = "q6 scan (lineitem)";
        let seeded = Figures {
            push_rate: Some(20e9),
            pull_rate: Some(0.2e9),
            selectivity: Some(1e-6),
            ..Figures::default()
        };
        exec.set_figures(key, seeded.clone());
        let (got, explain) = exec.run(&q6, &tables, Choice::Auto).expect("idle");
        assert_eq!(got, want);
        assert_eq!(
            explain.summary(),
            "push",
            "an idle pool looked busy: {explain}"
        );
        exec.set_figures(key, seeded);

        // Every node's only pool thread is taken by a call that times out after 100 ms
        // and keeps running for 3 s.
        let held = Instant::now();
        let r = li.vec().offload_pushed(
            PushOpts::default().with_timeout(Duration::from_millis(100)),
            (),
            |_: &(), _start: u64, items: &[RowGroup]| -> usize {
                std::thread::sleep(Duration::from_millis(3000));
                items.len()
            },
        );
        assert!(
            matches!(r, Err(ShardError::Call(CallError::Timeout(..)))),
            "expected a timeout, got {:?}",
            r.map(|v| v.len())
        );
        let t = Instant::now();
        let (got, explain) = match exec.run(&q6, &tables, Choice::Auto) {
            Ok(r) => r,
            Err(e) => panic!("the rule pushed into the busy pools: {e}"),
        };
        let took = t.elapsed();
        assert_eq!(got, want);
        assert_eq!(explain.summary(), "pull", "{explain}");
        assert!(explain.to_string().contains("busy"), "{explain}");
        assert!(
            took < Duration::from_millis(1500),
            "the query waited {took:?} for the busy pools"
        );
        // Let the held threads go before the cluster stops.
        std::thread::sleep(Duration::from_millis(3100).saturating_sub(held.elapsed()));
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

/// Issue 33, 8: column numbers are checked against the schema before a query runs, a
/// pulled read's error says it was pulled, each table's shards start on a different
/// node, and pushed code's `reserve` is where the README says.
#[test]
fn bad_columns_are_named_pulled_errors_say_pulled_and_tables_start_on_different_nodes() {
    use granule_pushdown::{CmpOp, Finalize, Output, Pred, Query, Stage};
    bounded(Duration::from_secs(600), || {
        // Outside a pushed call, `granule::pushdown::reserve` holds nothing and succeeds.
        let r = granule_pushdown::reserve(1 << 20).expect("no budget outside a pushed call");
        assert_eq!(r.bytes(), 1 << 20);

        let c = cluster();
        let local = local_tables(23);
        let tables = load(&c, &local);
        let nodes = c.worker_nodes().expect("nodes");

        // Each table's first shard one node further than the last table's.
        let first: Vec<_> = tables
            .values()
            .map(|t| {
                let parts = t.vec().parts().expect("parts");
                parts[0].location().expect("location")
            })
            .collect();
        for (i, at) in first.iter().enumerate() {
            assert_eq!(
                *at,
                nodes[i % nodes.len()],
                "first shards of the tables (in order): {first:?}"
            );
        }

        // A stage reading column 99 of lineitem (16 columns).
        let q = Query {
            name: "bad".into(),
            columns: vec!["count".into()],
            build: None,
            table: TableName::Lineitem,
            stage: Stage {
                filter: Pred::Cmp(99, CmpOp::Lt, 4),
                probe: None,
                output: Output::Aggregate(vec![granule_pushdown::Agg::Count]),
            },
            finalize: Finalize::Table { key_dicts: vec![] },
        };
        let width = local[&TableName::Lineitem].schema.cols.len();
        let exec = Executor::new();
        for choice in [
            Choice::Force(Mode::Pull),
            Choice::Force(Mode::Push),
            Choice::Auto,
        ] {
            match exec.run(&q, &tables, choice) {
                Err(DistError::Op(OpError::NoColumnIn {
                    col: 99,
                    table,
                    width: w,
                })) => {
                    assert_eq!((table.as_str(), w), ("lineitem", width));
                }
                Err(e) => panic!("{choice:?}: expected the bad column named, got {e}"),
                Ok(_) => panic!("{choice:?}: column 99 of lineitem was read"),
            }
        }
        match run_local(&q, &local) {
            Err(OpError::NoColumnIn { col: 99, .. }) => {}
            other => panic!("the reference executor: {other:?}"),
        }
        // A pulled read that fails on the data node says it was pulled.
        let li = &tables[&TableName::Lineitem];
        match li.stream(&[99], 4) {
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("pulled") && !text.contains("pushed"),
                    "{text}"
                );
            }
            Ok(_) => panic!("column 99 was pulled"),
        }
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}

/// A first run is planned with assumed figures (the default intensity, no node seen yet),
/// which can be several times off. That guess is not the model's error: the corrections
/// learned from the run compare its times with an estimate from what it measured, so
/// they stay near 1 instead of starting at the guess's error (a word count's first pull
/// taught a pulled-part correction of 6.6, which kept the rule pushing for eight runs
/// where pulling took half the time).
#[test]
fn a_first_runs_assumed_figures_do_not_become_the_models_corrections() {
    bounded(Duration::from_secs(600), || {
        let c = cluster();
        let docs = generated(TableName::Docs, 0.05, 23);
        let local = BTreeMap::from([(TableName::Docs, docs)]);
        let tables = load(&c, &local);
        let q = queries::all()
            .expect("queries")
            .into_iter()
            .find(|q| q.name == "wordcount")
            .expect("the word count");
        let want = run_local(&q, &local).expect("reference");
        let key = "wordcount scan (docs)";
        let exec = Executor::new();
        for mode in [Mode::Pull, Mode::Push] {
            let (got, explain) = exec.run(&q, &tables, Choice::Force(mode)).expect("run");
            assert_eq!(got, want);
            let f = exec.figures(key).expect("figures");
            let fix = match mode {
                Mode::Pull => f.pull_fix,
                Mode::Push => f.push_fix,
            };
            let fix = fix.unwrap_or_else(|| panic!("no {mode:?} correction learned: {explain}"));
            assert!(
                (0.5..2.0).contains(&fix),
                "the first {mode:?} run's correction is {fix:.2}: {f:?}\n{explain}"
            );
        }
        for (_, t) in tables {
            t.destroy().expect("destroy");
        }
        c.shutdown();
    });
}
