use granule::{Cluster, Kind, Proclet};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Default, Debug)]
struct Counter {
    n: u64,
}

#[test]
fn smoke() {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=256MiB;cpu=1,mem=256MiB")
        .unwrap()
        .failure_timeout(std::time::Duration::from_secs(10))
        .start()
        .unwrap();
    let workers = cluster.worker_nodes().unwrap();
    eprintln!("driver {} workers {:?}", cluster.node_id(), workers);
    let c = Proclet::create(Kind::Memory, 10u64, |s: u64| Counter { n: s }).unwrap();
    eprintln!("created on {}", c.location().unwrap());
    let v = c
        .run(5u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .unwrap();
    assert_eq!(v, 15);
    let local = Proclet::builder(Kind::Memory)
        .on(cluster.node_id())
        .create(1u64, |s: u64| Counter { n: s })
        .unwrap();
    assert_eq!(
        local
            .run(1u64, |c: &mut Counter, x: u64| {
                c.n += x;
                c.n
            })
            .unwrap(),
        2
    );
    let t = std::time::Instant::now();
    for _ in 0..1000 {
        c.run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .unwrap();
    }
    eprintln!("1000 remote sync calls: {:?}", t.elapsed());
    c.destroy().unwrap();
    assert!(matches!(
        c.run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        }),
        Err(granule::CallError::ProcletGone(_))
    ));
}

#[test]
fn perf_probe() {
    let cluster = Cluster::builder()
        .nodes("cpu=1,mem=256MiB")
        .unwrap()
        // A probe of speed, not of failure detection: a node starved for a second on a
        // loaded machine (the whole suite running) is not declared dead here.
        .failure_timeout(std::time::Duration::from_secs(10))
        .start()
        .unwrap();
    // Bounded: a call that waits a minute is a failure with a log line saying who held
    // the proclet (under CPU pressure the driver may move `local` away meanwhile).
    let patience = std::time::Duration::from_secs(60);
    let c = Proclet::create(Kind::Memory, 10u64, |s: u64| Counter { n: s })
        .unwrap()
        .with_timeout(patience);
    let local = Proclet::builder(Kind::Memory)
        .on(cluster.node_id())
        .create(1u64, |s: u64| Counter { n: s })
        .unwrap()
        .with_timeout(patience);
    for _ in 0..1000 {
        c.run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .unwrap();
    }
    let n = 20000;
    let t = std::time::Instant::now();
    for _ in 0..n {
        c.run(1u64, |c: &mut Counter, x: u64| {
            c.n += x;
            c.n
        })
        .unwrap();
    }
    eprintln!("remote sync: {:?}/call", t.elapsed() / n);
    let t = std::time::Instant::now();
    for _ in 0..1_000_000 {
        local
            .run(1u64, |c: &mut Counter, x: u64| {
                c.n += x;
                c.n
            })
            .unwrap();
    }
    eprintln!("local sync: {:?}/call", t.elapsed() / 1_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = std::time::Instant::now();
    let total = 200_000;
    rt.block_on(async {
        use futures::StreamExt;
        let s = futures::stream::iter(0..total)
            .map(|_| {
                c.run_async(1u64, |c: &mut Counter, x: u64| {
                    c.n += x;
                    c.n
                })
            })
            .buffer_unordered(256);
        s.for_each(|r| {
            r.unwrap();
            async {}
        })
        .await;
    });
    eprintln!(
        "remote pipelined: {:.0} calls/s",
        total as f64 / t.elapsed().as_secs_f64()
    );
}
