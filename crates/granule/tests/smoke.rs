use granule::{Cluster, Kind, Proclet};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Default, Debug)]
struct Counter {
    n: u64,
}

#[test]
fn smoke() {
    let cluster = Cluster::builder().nodes("cpu=1,mem=256MiB;cpu=1,mem=256MiB").unwrap().start().unwrap();
    let workers = cluster.worker_nodes().unwrap();
    eprintln!("driver {} workers {:?}", cluster.node_id(), workers);
    let c = Proclet::create(Kind::Memory, 10u64, |s: u64| Counter { n: s }).unwrap();
    eprintln!("created on {}", c.location().unwrap());
    let v = c.run(5u64, |c: &mut Counter, x: u64| { c.n += x; c.n }).unwrap();
    assert_eq!(v, 15);
    let local = Proclet::builder(Kind::Memory).on(cluster.node_id()).create(1u64, |s: u64| Counter { n: s }).unwrap();
    assert_eq!(local.run(1u64, |c: &mut Counter, x: u64| { c.n += x; c.n }).unwrap(), 2);
    let t = std::time::Instant::now();
    for _ in 0..1000 { c.run(1u64, |c: &mut Counter, x: u64| { c.n += x; c.n }).unwrap(); }
    eprintln!("1000 remote sync calls: {:?}", t.elapsed());
    c.destroy().unwrap();
    assert!(matches!(c.run(1u64, |c: &mut Counter, x: u64| { c.n += x; c.n }), Err(granule::CallError::ProcletGone(_))));
}
