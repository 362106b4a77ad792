//! CPU pressure on a real cgroup quota: a range job saturating a node whose cgroup allows
//! half a core gets the node throttled; the node's monitor sees it and moves the job's
//! compute proclet to a node with idle cores, where it continues from the item it stopped
//! at. Passes with a printed note when cgroup v1 is not usable (no quota to throttle).

mod common;

use common::bounded;
use granule::{Cluster, RangeJob};
use std::time::{Duration, Instant};

#[test]
fn a_throttled_node_sheds_its_cpu_hungry_proclet_to_a_node_with_idle_cores() {
    if common::cgroups_usable().is_none() {
        return;
    }
    bounded(Duration::from_secs(120), || {
        // The small node gets 0.5 core of quota; the big one 1.5 (one thread can never
        // exceed its quota there).
        let cluster = Cluster::builder()
            .nodes("cpu=0.5,mem=256MiB;cpu=1.5,mem=256MiB")
            .unwrap()
            .start()
            .unwrap();
        assert!(
            cluster.cgroups_active(),
            "cgroups are usable, so the cluster uses them"
        );
        // Nodes register in any order: tell them apart by their specs.
        let info = cluster.nodes().unwrap();
        let by_cores = |c: f64| info.iter().find(|n| n.spec.cores == c).unwrap().id;
        let (small, big) = (by_cores(0.5), by_cores(1.5));
        // 1500 items of 2 ms: 3 s of CPU, 6 s at half a core.
        let job = RangeJob::start_on(&[small], 0..1500, 1, 2000u64, |us: &u64, i: u64| {
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(*us) {
                std::hint::black_box(i);
            }
            i * 3
        })
        .unwrap();
        let piece = job.proclets()[0];
        assert_eq!(cluster.locate(piece).unwrap(), small);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut saw_throttling = false;
        while cluster.locate(piece).unwrap() == small {
            let info = cluster.nodes().unwrap();
            let s = info.iter().find(|n| n.id == small).unwrap();
            saw_throttling |= s.usage.cpu_throttled > 0.0;
            assert!(
                Instant::now() < deadline,
                "the throttled node never shed its job: {:?}",
                s.usage
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(cluster.locate(piece).unwrap(), big);
        let results = job.join().unwrap();
        assert_eq!(results, (0..1500u64).map(|i| i * 3).collect::<Vec<_>>());
        let info = cluster.nodes().unwrap();
        let s = info.iter().find(|n| n.id == small).unwrap();
        assert!(s.usage.moves_out >= 1);
        eprintln!("throttling seen in heartbeats before the move: {saw_throttling}");
    });
}
