//! The controller's dashboard, end to end in a real browser: headless Chromium loads the
//! page from a running cluster, and the page (its JavaScript polling `/api/cluster`)
//! must show the cluster's nodes, then a migration once one is triggered.
//!
//! Needs Debian's `chromium` (installed by `.ci/run`). Without it the test fails and
//! says so; `GRANULE_SKIP_BROWSER_TEST=1` skips it on a machine that cannot have one.

mod common;

use common::{bounded, cluster};
use granule::{Kind, Proclet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

fn chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(String::from)
}

/// The page's DOM after its scripts ran for a while (virtual time, so the 500 ms polls
/// happen without waiting for them in real time).
fn dom(browser: &str, url: &str) -> String {
    let profile = tempfile::tempdir().expect("a profile directory");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=3000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// GET a path from the dashboard's server (plain HTTP/1.0, read to the end).
use common::http_get as get;

#[test]
fn dashboard_shows_nodes_and_a_triggered_migration_in_headless_chromium() {
    if std::env::var("GRANULE_SKIP_BROWSER_TEST").is_ok_and(|v| v == "1") {
        eprintln!("skipped: GRANULE_SKIP_BROWSER_TEST=1");
        return;
    }
    let browser = chromium().expect(
        "no headless browser: install Debian's `chromium` package (`.ci/run` does), or set \
         GRANULE_SKIP_BROWSER_TEST=1 to skip this test",
    );
    bounded(LIMIT, move || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=512MiB");
        let url = cluster
            .dashboard_url()
            .expect("the embedded controller serves a dashboard");

        // The page lists every node of the cluster (driver included).
        let page = dom(&browser, &url);
        assert!(
            page.contains("data-loaded=\"1\""),
            "the page never loaded its data: {page}"
        );
        for n in cluster.nodes().unwrap() {
            assert!(
                page.contains(&format!("data-node=\"{}\"", n.id)),
                "node {} missing from the page",
                n.id
            );
        }

        // Trigger a migration; the page shows it once the source's next heartbeat
        // (100 ms) has brought the event to the controller.
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create((), |()| vec![7u8; 64 << 10])
            .unwrap();
        cluster.move_proclet(p.id(), nodes[1]).unwrap();
        let subject = p.id().to_string();
        let t0 = Instant::now();
        loop {
            let api = get(&url, "/api/cluster?after=0");
            if api.contains("\"migration\"") && api.contains(&format!("\"{subject}\"")) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the controller never heard of the migration: {api}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let page = dom(&browser, &url);
        let row = page
            .split("<tr ")
            .find(|r| r.contains("data-kind=\"migration\"") && r.contains(&subject))
            .unwrap_or_else(|| panic!("no migration row for {subject} on the page: {page}"));
        assert!(
            row.contains(&format!("{} → {}", nodes[0], nodes[1])),
            "the row does not say where it moved: {row}"
        );
        // And the timeline has a dot for it.
        assert!(
            page.contains("<circle class=\"k-migration\""),
            "no dot on the timeline"
        );
        p.destroy().unwrap();
        cluster.shutdown();
    });
}

#[test]
fn dashboard_api_and_metrics_answer_and_unknown_paths_get_a_404() {
    bounded(LIMIT, || {
        let (cluster, _nodes) = cluster(1, "cpu=1,mem=256MiB");
        let url = cluster.dashboard_url().unwrap();
        let api = get(&url, "/api/cluster");
        assert!(
            api.starts_with("HTTP/1.0 200") || api.starts_with("HTTP/1.1 200"),
            "{api}"
        );
        assert!(
            api.contains("\"nodes\"") && api.contains("\"node_joined\""),
            "{api}"
        );
        let metrics = get(&url, "/metrics");
        assert!(
            metrics.contains("granule_controller_nodes{state=\"alive\"} 2"),
            "{metrics}"
        );
        let missing = get(&url, "/nope");
        assert!(
            missing.contains(" 404 ") && missing.contains("/api/cluster"),
            "{missing}"
        );
        cluster.shutdown();
    });
}
