//! The mount's panel on the controller's dashboard: the figures of `granule fs status`
//! (space per class and store, stripes draining, replicas missing, stripes lost) as a
//! generic dashboard panel, published about every second through the mount's own cluster
//! (`Cluster::panel_publisher`), so it shows wherever that cluster's controller serves
//! its dashboard, embedded or external. The controller knows nothing of the file
//! system: it keeps the panel while it is refreshed and drops it soon after the mount
//! ends. Only what the status module reports; no I/O of its own besides publishing.

use crate::engine::Engine;
use crate::status::{self, Status};
use granule_wire::{Panel, PanelTable};
use std::fmt::Display;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How often the panel is published.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// How long the controller keeps it without a refresh (a hung mount's panel goes then).
pub const PANEL_TTL: Duration = Duration::from_secs(5);
/// Longest wait for one publication.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);
/// Stores listed at most; the rest are summed up in one last row (the controller takes
/// at most 256 rows per table).
pub const MAX_STORE_ROWS: usize = 200;
/// Longest text put in one cell (the controller takes at most 256 bytes).
const MAX_TEXT: usize = 200;

/// `1.50 GiB`, `512.0 MiB`, `0 B`.
fn size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    match i {
        0 => format!("{b} B"),
        3.. => format!("{v:.2} {}", UNITS[i]),
        _ => format!("{v:.1} {}", UNITS[i]),
    }
}

fn percent(used: u64, capacity: u64) -> String {
    if capacity == 0 {
        return String::new();
    }
    format!("{:.0} %", used as f64 * 100.0 / capacity as f64)
}

/// At most [`MAX_TEXT`] bytes of `s` (cut at a character boundary, marked with `…`).
fn clip(s: &str) -> String {
    if s.len() <= MAX_TEXT {
        return s.to_string();
    }
    let mut end = MAX_TEXT - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The mount's status as a dashboard panel.
pub fn panel(s: &Status) -> Panel {
    let facts = vec![
        ("stripes draining", s.draining_stripes.to_string()),
        ("replicas missing", s.replicas_missing.to_string()),
        ("stripes lost", s.stripes_lost.to_string()),
        ("verification failures", s.verification_failures.to_string()),
        ("stripe", format!("{} KiB", s.stripe >> 10)),
        ("copies per stripe", s.replicas.to_string()),
        ("files and directories", s.inodes.to_string()),
        ("read", size(s.bytes_read)),
        ("written", size(s.bytes_written)),
        ("metadata copy", clip(&s.metadata_copy)),
        ("mount", format!("pid {}, up {:.0} s", s.pid, s.uptime_s)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let classes = PanelTable {
        title: "space per class".into(),
        columns: ["class", "weight", "stores", "used", "capacity", "use"]
            .map(String::from)
            .to_vec(),
        rows: s
            .classes
            .iter()
            .map(|c| {
                vec![
                    clip(&c.name),
                    format!("{:.2}", c.weight),
                    c.stores.to_string(),
                    size(c.used),
                    size(c.capacity),
                    percent(c.used, c.capacity),
                ]
            })
            .collect(),
    };
    let mut rows: Vec<Vec<String>> = s
        .stores
        .iter()
        .take(MAX_STORE_ROWS)
        .map(|st| {
            vec![
                clip(&st.name),
                clip(&st.class),
                format!("{:?}", st.state).to_lowercase(),
                st.stripes.to_string(),
                size(st.used),
                size(st.capacity),
                st.errors.to_string(),
                st.tampered.to_string(),
            ]
        })
        .collect();
    if s.stores.len() > MAX_STORE_ROWS {
        let rest = &s.stores[MAX_STORE_ROWS..];
        rows.push(vec![
            format!("… {} more stores", rest.len()),
            String::new(),
            String::new(),
            rest.iter().map(|st| st.stripes).sum::<u64>().to_string(),
            size(rest.iter().map(|st| st.used).sum()),
            size(rest.iter().map(|st| st.capacity).sum()),
            rest.iter().map(|st| st.errors).sum::<u64>().to_string(),
            rest.iter().map(|st| st.tampered).sum::<u64>().to_string(),
        ]);
    }
    let stores = PanelTable {
        title: "space per store".into(),
        columns: [
            "store", "class", "state", "stripes", "used", "capacity", "errors", "tampered",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    };
    Panel {
        name: "fs".into(),
        title: clip(&format!("file system {}", s.dir)),
        ttl_ms: PANEL_TTL.as_millis() as u64,
        facts,
        tables: vec![classes, stores],
    }
}

/// Publish the panel of `status()` every `period` with `publish` (e.g.
/// `cluster.panel_publisher()`), until the task is dropped. A failure is logged once
/// (until a publication succeeds again); the mount does not depend on its panel.
pub async fn publish_every<S, P, F, E>(status: S, publish: P, period: Duration)
where
    S: Fn() -> Status,
    P: Fn(Panel) -> F,
    F: Future<Output = Result<(), E>>,
    E: Display,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let outcome = match tokio::time::timeout(PUBLISH_TIMEOUT, publish(panel(&status()))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {PUBLISH_TIMEOUT:?}")),
        };
        match outcome {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!("cannot show the mount on the dashboard: {e}");
            }
            Err(e) => tracing::debug!("cannot show the mount on the dashboard: {e}"),
        }
    }
}

/// Publish the mount's panel every [`PUBLISH_EVERY`] (what `mount` spawns on its
/// runtime): `engine` and `dir` as for the status door, `publish` from
/// `cluster.panel_publisher()`.
pub async fn publish_loop<P, F, E>(engine: Arc<Engine>, dir: PathBuf, publish: P)
where
    P: Fn(Panel) -> F,
    F: Future<Output = Result<(), E>>,
    E: Display,
{
    publish_every(
        move || status::status(&engine, &dir),
        publish,
        PUBLISH_EVERY,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stores::StoreState;
    use parking_lot::Mutex;

    /// A status of `stores` own stores (store 1 draining, store 2 with a tampered copy).
    /// Built from JSON so fields the status gains later take their defaults.
    fn sample(stores: usize) -> Status {
        let state = |s: StoreState| serde_json::to_value(s).unwrap();
        let stores: Vec<serde_json::Value> = (0..stores)
            .map(|i| {
                serde_json::json!({
                    "id": i, "class": "own", "name": format!("own-{i}"),
                    "state": state(if i == 1 { StoreState::Draining } else { StoreState::Active }),
                    "lease": null, "capacity": 1u64 << 30, "used": 3u64 << 28,
                    "stripes": 768, "errors": 0, "tampered": u64::from(i == 2),
                })
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "dir": "/mnt/g", "pid": 42, "uptime_s": 61.0, "stripe": 1u64 << 20, "replicas": 2,
            "classes": [
                {"name": "own", "weight": 1.0, "stores": 2, "capacity": 2u64 << 30, "used": 3u64 << 29},
                {"name": "victim", "weight": 0.5, "stores": 0, "capacity": 0, "used": 0},
            ],
            "stores": stores,
            "draining_stripes": 17, "replicas_missing": 3, "stripes_lost": 1, "inodes": 9,
            "reads": 1, "writes": 2, "bytes_read": 5u64 << 20, "bytes_written": 0,
            "cache_hits": 0, "verification_failures": 1, "stripes_moved": 4,
            "metadata_copy": "on n2",
        }))
        .expect("a status")
    }

    fn fact<'a>(p: &'a Panel, k: &str) -> &'a str {
        p.facts
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no fact {k}: {:?}", p.facts))
    }

    #[test]
    fn the_panel_shows_space_per_class_and_store_and_the_repair_figures() {
        let p = panel(&sample(3));
        assert_eq!(p.name, "fs");
        assert_eq!(p.title, "file system /mnt/g");
        assert_eq!(p.ttl_ms, 5000);
        assert_eq!(fact(&p, "stripes draining"), "17");
        assert_eq!(fact(&p, "replicas missing"), "3");
        assert_eq!(fact(&p, "stripes lost"), "1");
        assert_eq!(fact(&p, "read"), "5.0 MiB");
        assert_eq!(fact(&p, "metadata copy"), "on n2");
        let classes = &p.tables[0];
        assert_eq!(
            classes.rows[0],
            ["own", "1.00", "2", "1.50 GiB", "2.00 GiB", "75 %"]
        );
        assert_eq!(classes.rows[1][5], "", "no capacity, no percentage");
        let stores = &p.tables[1];
        assert_eq!(stores.rows.len(), 3);
        assert_eq!(
            stores.rows[1],
            [
                "own-1",
                "own",
                "draining",
                "768",
                "768.0 MiB",
                "1.00 GiB",
                "0",
                "0"
            ]
        );
        assert_eq!(stores.rows[2][7], "1");
        for t in &p.tables {
            assert!(t.rows.iter().all(|r| r.len() == t.columns.len()));
        }
    }

    #[test]
    fn many_stores_are_summed_up_in_one_row_and_long_names_are_cut() {
        let mut s = sample(MAX_STORE_ROWS + 5);
        s.dir = format!("/{}", "é".repeat(300));
        let p = panel(&s);
        let stores = &p.tables[1];
        assert_eq!(stores.rows.len(), MAX_STORE_ROWS + 1);
        let last = stores.rows.last().unwrap();
        assert_eq!(last[0], "… 5 more stores");
        assert_eq!(last[3], (5 * 768).to_string());
        assert!(p.title.len() <= MAX_TEXT && p.title.ends_with('…'));
        assert_eq!(size(0), "0 B");
        assert_eq!(size(1536), "1.5 KiB");
    }

    #[test]
    fn the_loop_keeps_publishing_and_survives_failures() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let seen: Arc<Mutex<Vec<Panel>>> = Arc::default();
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (seen2, calls2) = (seen.clone(), calls.clone());
        let publish = move |p: Panel| {
            let (seen, calls) = (seen2.clone(), calls2.clone());
            async move {
                // The second publication fails: the loop goes on.
                if calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 1 {
                    return Err("controller unreachable");
                }
                seen.lock().push(p);
                Ok(())
            }
        };
        rt.block_on(async {
            let _ = tokio::time::timeout(
                Duration::from_millis(300),
                publish_every(|| sample(2), publish, Duration::from_millis(20)),
            )
            .await;
        });
        assert!(calls.load(std::sync::atomic::Ordering::Relaxed) >= 4);
        let seen = seen.lock();
        assert!(seen.len() >= 3, "{}", seen.len());
        assert!(seen.iter().all(|p| p.title == "file system /mnt/g"));
    }

    /// Through a real (driver-only) cluster: the panel reaches the embedded controller
    /// over the driver's connection and shows in `/api/panels`; once the cluster is gone
    /// the publisher says so instead of hanging.
    #[test]
    fn the_panel_shows_on_the_clusters_dashboard() {
        use std::io::{Read, Write};
        let cluster = granule_runtime::Cluster::builder()
            .node_specs(Vec::new())
            .with(|c| c.cluster.dashboard = Some("127.0.0.1:0".into()))
            .start()
            .expect("a driver-only cluster");
        let web = cluster.dashboard_url().expect("a dashboard");
        let web = web
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let publish = cluster.panel_publisher();
        let task = rt.spawn(publish_every(
            || sample(2),
            publish.clone(),
            Duration::from_millis(50),
        ));
        let get = |path: &str| {
            let mut s = std::net::TcpStream::connect(&web).expect("connect");
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let out = get("/api/panels");
            if out.contains("\"title\":\"file system /mnt/g\"") {
                assert!(out.contains("\"from\":\"n1\""), "{out}");
                assert!(out.contains("\"replicas missing\",\"3\""), "{out}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no panel: {out}");
            std::thread::sleep(Duration::from_millis(20));
        }
        task.abort();
        cluster.shutdown();
        let e = rt.block_on(publish(panel(&sample(1)))).unwrap_err();
        assert!(matches!(e, granule_runtime::CallError::NoCluster), "{e}");
    }
}
