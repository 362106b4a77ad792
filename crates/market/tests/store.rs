//! A producer store against real Redis tools and a real Redis client library: `redis-cli`
//! (with and without the lease's secret), `redis-benchmark`, and the `redis` crate (SET EX,
//! TTL, MGET, pipelining). The tools come from Debian's redis-tools; without them the
//! tests fail, unless GRANULE_SKIP_REDIS is set (then they say why and skip).

use granule_market::store::{EvictionMode, Store, StoreConfig};
use std::process::Command;

const SECRET: &str = "integration-lease-secret";

fn start() -> Store {
    Store::start(
        "127.0.0.1:0",
        StoreConfig::new(16 << 20, SECRET, EvictionMode::Lru),
    )
    .expect("start a store")
}

/// Whether `tool` can be run; if not, fail unless GRANULE_SKIP_REDIS is set.
fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var_os("GRANULE_SKIP_REDIS").is_some(),
            "{tool} is missing: install Debian's redis-tools (or set GRANULE_SKIP_REDIS to skip)"
        );
        println!("skipped: {tool} is missing and GRANULE_SKIP_REDIS is set");
    }
    ok
}

fn cli(store: &Store, secret: Option<&str>, args: &[&str]) -> (String, String) {
    let mut c = Command::new("redis-cli");
    c.args(["-h", "127.0.0.1", "-p", &store.addr().port().to_string()]);
    if let Some(s) = secret {
        c.args(["-a", s, "--no-auth-warning"]);
    }
    let out = c.args(args).output().expect("run redis-cli");
    (
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn redis_cli_with_and_without_the_secret() {
    if !have("redis-cli") {
        return;
    }
    let store = start();
    assert_eq!(
        cli(&store, Some(SECRET), &["SET", "greeting", "hello"]).0,
        "OK"
    );
    assert_eq!(cli(&store, Some(SECRET), &["GET", "greeting"]).0, "hello");
    assert_eq!(cli(&store, Some(SECRET), &["PING"]).0, "PONG");
    assert_eq!(cli(&store, Some(SECRET), &["DBSIZE"]).0, "1");
    let info = cli(&store, Some(SECRET), &["INFO"]).0;
    assert!(
        info.contains("used_memory:") && info.contains("maxmemory:16777216"),
        "{info}"
    );
    // Without the secret, or with a wrong one: nothing.
    let (out, _) = cli(&store, None, &["GET", "greeting"]);
    assert!(out.contains("NOAUTH"), "{out}");
    assert!(!out.contains("hello"));
    let (out, err) = cli(&store, Some("wrong"), &["GET", "greeting"]);
    assert!(!out.contains("hello"), "{out}");
    assert!(
        format!("{out}{err}").contains("WRONGPASS") || out.contains("NOAUTH"),
        "{out} / {err}"
    );
    assert!(store.stats().auth_failures >= 1);
    // An unknown command gets a clear error.
    let (out, _) = cli(&store, Some(SECRET), &["KEYS", "*"]);
    assert!(out.contains("unknown command 'KEYS'"), "{out}");
}

#[test]
fn redis_benchmark_runs_unmodified() {
    if !have("redis-benchmark") {
        return;
    }
    let store = start();
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &store.addr().port().to_string()])
        .args(["-q", "-n", "2000", "-t", "get,set", "-a", SECRET])
        .output()
        .expect("run redis-benchmark");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for op in ["SET", "GET"] {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("{op}:")))
            .unwrap_or_else(|| panic!("no {op} line in: {text}"));
        assert!(line.contains("requests per second"), "{line}");
    }
    let st = store.stats();
    assert!(st.commands >= 4000, "{st:?}");
    assert_eq!(st.protocol_errors, 0);
    assert_eq!(st.auth_failures, 0);
}

#[tokio::test]
async fn redis_crate_set_ex_ttl_mget_and_pipelining() {
    let store = start();
    let url = format!("redis://:{SECRET}@{}/0", store.addr());
    let client = redis::Client::open(url).expect("client");
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect and AUTH");
    let _: () = redis::cmd("SET")
        .arg("session")
        .arg("abc")
        .arg("EX")
        .arg(60)
        .query_async(&mut con)
        .await
        .unwrap();
    let ttl: i64 = redis::cmd("TTL")
        .arg("session")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!((59..=60).contains(&ttl), "{ttl}");
    let _: () = redis::cmd("MSET")
        .arg("a")
        .arg("1")
        .arg("b")
        .arg("2")
        .query_async(&mut con)
        .await
        .unwrap();
    let got: Vec<Option<String>> = redis::cmd("MGET")
        .arg("a")
        .arg("missing")
        .arg("b")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(got, vec![Some("1".into()), None, Some("2".into())]);
    // A pipeline of 200 commands in one write; replies come back in order.
    let mut pipe = redis::pipe();
    for i in 0..100 {
        pipe.cmd("SET").arg(format!("p{i}")).arg(i).ignore();
        pipe.cmd("GET").arg(format!("p{i}"));
    }
    let vals: Vec<i64> = pipe.query_async(&mut con).await.unwrap();
    assert_eq!(vals, (0..100).collect::<Vec<i64>>());
    let n: i64 = redis::cmd("DBSIZE").query_async(&mut con).await.unwrap();
    assert_eq!(n, 103);
    // Without the secret the library's first command fails.
    let bad = redis::Client::open(format!("redis://{}/0", store.addr())).unwrap();
    let mut bad_con = bad.get_multiplexed_async_connection().await;
    if let Ok(c) = bad_con.as_mut() {
        let r: redis::RedisResult<Option<String>> = redis::cmd("GET").arg("a").query_async(c).await;
        let e = r.expect_err("GET without AUTH must fail");
        assert!(e.to_string().contains("NOAUTH"), "{e}");
    }
}
