//! Dashboard panels end to end: a peer publishes a panel over the controller's wire
//! protocol, `/api/panels` and `/api/cluster` show it, and it disappears when it is not
//! refreshed in time or when its publisher's connection closes; an oversize panel is
//! refused with a message naming the bound.

use granule_controller::panels::PANEL_MAX_ROWS;
use granule_controller::{ControllerClient, ControllerConfig, ControllerError, ControllerHandle};
use granule_wire::{Panel, PanelTable};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A bare HTTP/1.1 GET; the body as JSON.
fn get_json(addr: std::net::SocketAddr, path: &str) -> serde_json::Value {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the dashboard");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{path}: {out}");
    let body = out.split_once("\r\n\r\n").expect("a body").1;
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

fn panel(ttl_ms: u64, rows: usize) -> Panel {
    Panel {
        name: "fs".into(),
        title: "granule fs at /mnt/g".into(),
        ttl_ms,
        facts: vec![("replicas missing".into(), "0".into())],
        tables: vec![PanelTable {
            title: "stores".into(),
            columns: vec!["store".into(), "used".into()],
            rows: (0..rows)
                .map(|i| vec![format!("own-n{i}"), "1.50 GiB".into()])
                .collect(),
        }],
    }
}

fn titles(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .expect("a list of panels")
        .iter()
        .map(|p| p["title"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Poll `/api/panels` until `done` holds of it, or fail after `limit`.
fn wait_for(
    addr: std::net::SocketAddr,
    limit: Duration,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = get_json(addr, "/api/panels");
        if done(&v) {
            return v;
        }
        assert!(start.elapsed() < limit, "{what}: still {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_published_panel_shows_in_the_api_and_expires() {
    let mut ctl = ControllerHandle::start("127.0.0.1:0", ControllerConfig::default())
        .expect("start a controller");
    let web = ctl.dashboard_addr().expect("a dashboard");
    let addr = ctl.addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let client = rt
        .block_on(ControllerClient::connect_tool(&addr, "panel test"))
        .expect("connect");

    // Published: in /api/panels and in /api/cluster, with its table.
    rt.block_on(client.publish_panel(panel(400, 2)))
        .expect("publish");
    let v = get_json(web, "/api/panels");
    assert_eq!(titles(&v), vec!["granule fs at /mnt/g"]);
    assert_eq!(v[0]["name"], "fs");
    assert_eq!(v[0]["tables"][0]["rows"][1][0], "own-n1");
    assert_eq!(v[0]["facts"][0][0], "replicas missing");
    let cluster = get_json(web, "/api/cluster");
    assert_eq!(cluster["panels"][0]["title"], "granule fs at /mnt/g");

    // Not refreshed: gone after its time to live.
    let published = Instant::now();
    wait_for(web, Duration::from_secs(5), "an expired panel", |v| {
        titles(v).is_empty()
    });
    assert!(
        published.elapsed() >= Duration::from_millis(350),
        "gone too early"
    );
    assert_eq!(
        get_json(web, "/api/cluster")["panels"],
        serde_json::json!([])
    );

    // Oversize: refused, saying why, and not shown.
    let e = rt
        .block_on(client.publish_panel(panel(400, PANEL_MAX_ROWS + 1)))
        .unwrap_err();
    match e {
        ControllerError::Refused(m) => assert!(
            m.contains(
                "panel 'fs' refused: the number of rows of table 'stores' is 257 (at most 256)"
            ),
            "{m}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(titles(&get_json(web, "/api/panels")).is_empty());

    // A publisher whose connection closes takes its panel with it, long before the
    // panel's time to live.
    rt.block_on(client.publish_panel(panel(60_000, 1)))
        .expect("publish");
    assert_eq!(titles(&get_json(web, "/api/panels")).len(), 1);
    client.connection().close("test over");
    drop(client);
    wait_for(
        web,
        Duration::from_secs(5),
        "a closed publisher's panel",
        |v| titles(v).is_empty(),
    );
    ctl.shutdown();
}
