//! Prometheus metrics against a workload's own counts: scraping the nodes' `/metrics`
//! while calls and migrations run must show the migrations counted exactly, the calls
//! served equal to the calls made, and a call rate within 5 % of the rate the workload
//! measured itself.

mod common;

use common::{bounded, cluster};
use granule::sharded::{Bounds, ShardedMap};
use granule::{Cluster, Kind, NodeId, Proclet};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

/// GET that must succeed.
fn get(addr: &str, path: &str) -> String {
    let body = common::http_get(addr, path);
    assert!(
        body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200"),
        "{body}"
    );
    body
}

/// Sum of the samples of `name` whose labels contain every `filters` pair.
fn sum(text: &str, name: &str, filters: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = match series.split_once('{') {
                Some((m, rest)) => (m, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let ok = filters
                .iter()
                .all(|(k, v)| labels.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            ok.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

fn metrics_addr(cluster: &Cluster, node: NodeId) -> String {
    cluster
        .nodes()
        .unwrap()
        .into_iter()
        .find(|n| n.id == node)
        .and_then(|n| n.metrics_addr)
        .expect("every node registers a metrics address")
}

/// All node processes' metrics, concatenated.
fn scrape_all(cluster: &Cluster, nodes: &[NodeId]) -> String {
    nodes
        .iter()
        .map(|n| get(&metrics_addr(cluster, *n), "/metrics"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn scraped_counters_equal_the_workloads_own_counts_and_rates() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=512MiB");
        let target = nodes[0];
        let label = target.to_string();
        let p = Proclet::builder(Kind::Memory)
            .on(target)
            .create((), |()| 0u64)
            .unwrap();
        let addr = metrics_addr(&cluster, target);
        let served = |text: &str| sum(text, "granule_calls_served_total", &[("node", &label)]);

        // Calls: a counted stretch of calls from the driver, with scrapes around it.
        let before = served(&get(&addr, "/metrics"));
        let t0 = Instant::now();
        let mut made = 0u64;
        while t0.elapsed() < Duration::from_millis(1500) {
            p.run(1u64, |n: &mut u64, x: u64| *n += x).unwrap();
            made += 1;
        }
        let own_rate = made as f64 / t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let after = served(&get(&addr, "/metrics"));
        let scrape_secs = t1.duration_since(t0).as_secs_f64();
        assert_eq!(
            after - before,
            made as f64,
            "calls served by {target} per /metrics ≠ calls made"
        );
        let scraped_rate = (after - before) / scrape_secs;
        assert!(
            (scraped_rate / own_rate - 1.0).abs() <= 0.05,
            "scraped rate {scraped_rate:.0}/s vs the workload's {own_rate:.0}/s"
        );
        assert_eq!(p.run_ref((), |n: &u64, ()| *n).unwrap(), made);
        // Every one of those remote calls is in the node's latency histogram.
        let text = get(&addr, "/metrics");
        let timed = sum(
            &text,
            "granule_call_duration_seconds_count",
            &[("node", &label)],
        );
        assert!(
            timed >= made as f64,
            "{timed} timed calls < {made} calls made"
        );

        // Migrations: K moves back and forth, counted exactly on the source nodes.
        let text = scrape_all(&cluster, &nodes);
        let fin0 = sum(
            &text,
            "granule_migrations_total",
            &[("outcome", "finished")],
        );
        let bytes0 = sum(&text, "granule_migration_bytes_total", &[]);
        const K: usize = 6;
        let mut moved_bytes = 0u64;
        for k in 0..K {
            let to = nodes[(k + 1) % 2];
            moved_bytes += cluster.move_proclet(p.id(), to).unwrap().bytes;
        }
        let text = scrape_all(&cluster, &nodes);
        let fin = sum(
            &text,
            "granule_migrations_total",
            &[("outcome", "finished")],
        ) - fin0;
        let started = sum(&text, "granule_migrations_total", &[("outcome", "started")]);
        assert_eq!(fin, K as f64, "finished migrations in /metrics");
        assert!(started >= fin + fin0, "started {started} < finished {fin}");
        assert_eq!(
            sum(&text, "granule_migration_bytes_total", &[]) - bytes0,
            moved_bytes as f64
        );
        assert_eq!(
            sum(&text, "granule_migration_duration_seconds_count", &[]),
            fin + fin0
        );
        // Gauges: the proclet is on nodes[0] after an even number of moves.
        assert_eq!(
            sum(
                &text,
                "granule_node_proclets",
                &[("node", &label), ("kind", "memory")]
            ),
            1.0
        );

        // The controller heard of every move (events travel with heartbeats).
        let url = cluster.dashboard_url().unwrap();
        let dash = url.trim_start_matches("http://").trim_end_matches('/');
        let subject = format!("\"subject\":\"{}\"", p.id());
        let t = Instant::now();
        loop {
            let api = get(dash, "/api/events?after=0&limit=2000");
            let moves = api
                .split("{\"seq\"")
                .filter(|e| e.contains("\"kind\":\"migration\"") && e.contains(&subject))
                .count();
            if moves == K {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{moves} of {K} moves in {api}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        p.destroy().unwrap();
        cluster.shutdown();
    });
}

#[test]
fn splits_are_counted_and_the_structure_is_summed_per_node_on_the_dashboard_api() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=512MiB");
        let mut all = nodes.clone();
        all.push(cluster.node_id());
        let splits = |c: &Cluster| {
            sum(
                &scrape_all(c, &all),
                "granule_splits_total",
                &[("component", "sharded")],
            )
        };
        let before = splits(&cluster);
        let b = Bounds::new(2 << 10, 8 << 10).unwrap();
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(b).unwrap();
        for i in 0..600u64 {
            map.insert(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 8, vec![1u8; 64])
                .unwrap();
        }
        let shards = map.sharder().shards().unwrap().len();
        assert!(shards >= 4, "the map should have split: {shards} shards");
        assert_eq!(
            splits(&cluster) - before,
            (shards - 1) as f64,
            "splits in /metrics ≠ shards − 1 (no merges happen while only inserting)"
        );
        // The controller sums the nodes' per-structure reports (sent every heartbeat).
        let label = map.sharder().label();
        let url = cluster.dashboard_url().unwrap();
        let dash = url.trim_start_matches("http://").trim_end_matches('/');
        let t = Instant::now();
        loop {
            let api = get(dash, "/api/cluster");
            let json = &api[api.find("\r\n\r\n").unwrap() + 4..];
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            let row = v["structures"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["group"] == label.as_str())
                .cloned();
            if let Some(row) = row {
                if row["proclets"] == shards as u64 {
                    assert!(row["bytes"].as_u64().unwrap() > 600 * 64);
                    break;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{label} with {shards} shards not in {json}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        map.destroy().unwrap();
        cluster.shutdown();
    });
}

#[test]
fn prometheus_text_parsing() {
    let t = "# TYPE x counter\nx{node=\"n1\",kind=\"a\"} 3\nx{node=\"n2\",kind=\"a\"} 4\ny 1\n";
    assert_eq!(sum(t, "x", &[]), 7.0);
    assert_eq!(sum(t, "x", &[("node", "n2")]), 4.0);
    assert_eq!(sum(t, "y", &[]), 1.0);
    assert_eq!(sum(t, "x", &[("node", "n3")]), 0.0);
}
