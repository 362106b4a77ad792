//! Multi-process tests of hybrid proclets: a sharded structure's memory proclets made
//! hybrid, code offloaded next to their data, parts split off a hybrid shard staying
//! hybrid, and back to memory proclets.

use granule::sharded::{Bounds, ShardedMap, ShardedVec};
use granule::{Cluster, Kind};
use std::time::{Duration, Instant};

mod common;
use common::bounded;

/// Proclets of each kind the nodes host, as their heartbeats report, once the counts
/// have settled to what `want` accepts (heartbeats come every 100 ms).
fn kinds_until(cluster: &Cluster, want: impl Fn([u32; 3]) -> bool) -> [u32; 3] {
    let t = Instant::now();
    loop {
        let mut k = [0u32; 3];
        for n in cluster.nodes().expect("nodes") {
            for (into, count) in k.iter_mut().zip(n.usage.proclets) {
                *into += count;
            }
        }
        if want(k) || t.elapsed() > Duration::from_secs(5) {
            return k;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn hybridize_offload_split_and_dehybridize() {
    bounded(Duration::from_secs(120), || {
        let (cluster, _) = common::cluster(2, "cpu=1,mem=1GiB");
        let (h, m) = (Kind::Hybrid.index(), Kind::Memory.index());
        let v: ShardedVec<u64> =
            ShardedVec::with_bounds(Bounds::new(4 << 10, 16 << 10).expect("bounds")).expect("vec");
        v.extend((0..20_000).collect()).expect("extend");
        v.seal().expect("seal");
        let shards = v.sharder().shards().expect("shards").len() as u32;
        assert!(shards >= 4, "only {shards} shards");
        v.hybridize().expect("hybridize");
        // Every shard is now hybrid; the mapping proclet stays a memory proclet.
        let after = kinds_until(&cluster, |k| k[h] == shards && k[m] == 1);
        assert_eq!((after[h], after[m]), (shards, 1), "{after:?}");

        // Offloaded code runs where each shard lives; only the sums travel.
        let sums = v
            .offload(3u64, |mul: &u64, start: u64, items: &[u64]| {
                let here = granule::here().map(|n| n.0).unwrap_or(0);
                (start, items.iter().map(|x| x * mul).sum::<u64>(), here)
            })
            .expect("offload");
        assert_eq!(sums.len() as u32, shards);
        assert!(sums.windows(2).all(|w| w[0].0 < w[1].0), "in index order");
        assert_eq!(
            sums.iter().map(|s| s.1).sum::<u64>(),
            3 * (0..20_000u64).sum::<u64>()
        );
        for (_, shard) in v.sharder().shards().expect("shards") {
            let node = shard.location().expect("location");
            assert!(
                sums.iter().any(|s| s.2 == node.0),
                "no result computed on {node}"
            );
        }

        // Parts split off a hybrid shard are hybrid too.
        v.unseal().expect("unseal");
        v.extend((20_000..40_000).collect()).expect("extend");
        let grown = v.sharder().shards().expect("shards").len() as u32;
        assert!(grown > shards, "no split: {grown} shards");
        let k = kinds_until(&cluster, |k| k[h] == grown);
        assert_eq!(k[h], grown, "split-off parts are not hybrid: {k:?}");

        v.dehybridize().expect("dehybridize");
        let k = kinds_until(&cluster, |k| k[h] == 0 && k[m] == grown + 1);
        assert_eq!((k[h], k[m]), (0, grown + 1), "{k:?}");
        v.destroy().expect("destroy");

        // A map too: offload a count per key range.
        let map: ShardedMap<u64, u64> =
            ShardedMap::with_bounds(Bounds::new(4 << 10, 16 << 10).expect("bounds")).expect("map");
        for i in 0..3000u64 {
            map.insert(i, i % 7).expect("insert");
        }
        map.hybridize().expect("hybridize");
        let counts = map
            .offload(
                (),
                |_: &(), entries: &std::collections::BTreeMap<u64, u64>| {
                    entries.values().filter(|v| **v == 0).count() as u64
                },
            )
            .expect("offload");
        assert_eq!(
            counts.iter().sum::<u64>(),
            (0..3000u64).filter(|i| i % 7 == 0).count() as u64
        );
        map.dehybridize().expect("dehybridize");
        map.destroy().expect("destroy");
        cluster.shutdown();
    });
}
