//! Multi-process tests of the sharded structures: real node processes on 127.0.0.1, shards
//! splitting, merging and migrating under concurrent use.

use granule::sharded::{Bounds, ShardedMap, ShardedVec};
use granule::{Cluster, Kind, NodeId, Proclet};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

mod common;
use common::bounded;

/// Two or three nodes with room for the structures; no shedding (the tests move shards
/// themselves).
fn cluster(n: usize) -> (Cluster, Vec<NodeId>) {
    common::cluster(n, "cpu=1,mem=1GiB")
}

fn value(k: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (k as usize * 31 + i) as u8).collect()
}

/// min / median / max and a coarse histogram of shard sizes, for the test log.
fn distribution(sizes: &[u64], bucket: u64) -> String {
    let mut v = sizes.to_vec();
    v.sort_unstable();
    let mut hist = std::collections::BTreeMap::new();
    for s in &v {
        *hist.entry(s / bucket * bucket).or_insert(0u32) += 1;
    }
    format!(
        "{} shards, min {} B, median {} B, max {} B; by {bucket} B: {:?}",
        v.len(),
        v.first().copied().unwrap_or(0),
        v.get(v.len() / 2).copied().unwrap_or(0),
        v.last().copied().unwrap_or(0),
        hist
    )
}

/// Shard sizes within [lower, upper + one element] (a lone shard may be smaller).
fn check_bounds(sizes: &[u64], b: Bounds, elem: u64, phase: &str) {
    if sizes.len() == 1 {
        assert!(
            sizes[0] <= b.upper + elem,
            "{phase}: lone shard {} B",
            sizes[0]
        );
        return;
    }
    for (i, s) in sizes.iter().enumerate() {
        assert!(
            *s >= b.lower && *s <= b.upper + elem,
            "{phase}: shard {i} holds {s} B, outside [{}, {}]; {}",
            b.lower,
            b.upper + elem,
            distribution(sizes, 1024)
        );
    }
}

#[test]
fn map_grows_to_1000_shards_and_shrinks_back_within_bounds() {
    bounded(Duration::from_secs(600), || {
        let (cluster, _nodes) = cluster(2);
        let b = Bounds::new(2 << 10, 8 << 10).expect("bounds");
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(b).expect("map");
        // Entry: 8 B key + a 64 B vector (24 + 64) + 16 B of tree: 112 B.
        let elem = 112;
        let n: u64 = std::env::var("GRANULE_TEST_SHARD_ENTRIES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000 * (8 << 10) / elem / 2);
        let t = Instant::now();
        // Four client threads, keys interleaved and scrambled so every shard is hit.
        let key = |i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 8;
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let m = map.clone();
                let ctx = granule::thread_context();
                s.spawn(move || {
                    ctx.enter();
                    for i in (t..n).step_by(4) {
                        let k = key(i);
                        assert_eq!(m.insert(k, value(k, 64)).expect("insert"), None);
                    }
                });
            }
        });
        let sizes = map.sharder().shard_sizes().expect("sizes");
        eprintln!(
            "grown: {n} entries in {:.1?}; {}",
            t.elapsed(),
            distribution(&sizes, 1024)
        );
        // 1000 shards' worth of data: as many full shards (the upper bound), which fill
        // ~500–1000 shards between half and all of it.
        assert!(
            sizes.len() as u64 >= n * elem / b.upper,
            "only {} shards",
            sizes.len()
        );
        check_bounds(&sizes, b, elem, "grown");
        assert_eq!(map.len().expect("len"), n);
        // Every key once, in order, with its value.
        let all = map.range(None, None, usize::MAX).expect("scan");
        assert_eq!(all.len() as u64, n);
        assert!(all.windows(2).all(|w| w[0].0 < w[1].0));
        for (k, v) in all.iter().step_by(97) {
            assert_eq!(v, &value(*k, 64));
        }
        // Shrink back to empty.
        let t = Instant::now();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let m = map.clone();
                let ctx = granule::thread_context();
                s.spawn(move || {
                    ctx.enter();
                    for i in (t..n).step_by(4) {
                        let k = key(i);
                        assert_eq!(m.remove(&k).expect("remove"), Some(value(k, 64)));
                        if i % 5000 == 0 {
                            let sizes = m.sharder().shard_sizes().expect("sizes");
                            eprintln!("shrinking: {}", distribution(&sizes, 1024));
                        }
                    }
                });
            }
        });
        let sizes = map.sharder().shard_sizes().expect("sizes");
        eprintln!(
            "emptied in {:.1?}: {}",
            t.elapsed(),
            distribution(&sizes, 1024)
        );
        assert_eq!(map.len().expect("len"), 0);
        assert!(
            sizes.len() <= 2,
            "{} shards left for an empty map",
            sizes.len()
        );
        map.destroy().expect("destroy");
        cluster.shutdown();
    });
}

#[test]
fn clients_on_several_nodes_lose_and_duplicate_nothing_while_shards_split_merge_and_move() {
    bounded(Duration::from_secs(300), || {
        let (cluster, nodes) = cluster(3);
        let b = Bounds::new(6 << 10, 16 << 10).expect("bounds");
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(b).expect("map");
        let per_client = 3000u64;
        // Clients: compute proclets on two nodes and the driver, each inserting its own
        // keys; meanwhile the driver moves shards around.
        let clients: Vec<Proclet<()>> = nodes[..2]
            .iter()
            .map(|n| {
                Proclet::builder(Kind::Compute)
                    .on(*n)
                    .create((), |()| ())
                    .expect("client")
            })
            .collect();
        let futures: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(c, p)| {
                p.run_async(
                    (map.clone(), c as u64, per_client),
                    |_: &mut (), (m, c, n): (ShardedMap<u64, Vec<u8>>, u64, u64)| {
                        for i in 0..n {
                            let k = i * 4 + c;
                            m.insert(k, value(k, 100)).expect("insert from a node");
                        }
                        n
                    },
                )
            })
            .collect();
        let driver_inserts = std::thread::spawn({
            let m = map.clone();
            let ctx = granule::thread_context();
            move || {
                ctx.enter();
                for i in 0..per_client {
                    let k = i * 4 + 3;
                    m.insert(k, value(k, 100)).expect("insert from the driver");
                }
            }
        });
        // The driver moves shards from node to node while the clients insert.
        let mut moved = 0;
        for round in 0..30 {
            std::thread::sleep(Duration::from_millis(50));
            let Ok(shards) = map.sharder().shards() else {
                continue;
            };
            if let Some((_, s)) = shards.get(round % shards.len().max(1)) {
                if cluster
                    .move_proclet(s.id(), nodes[round % nodes.len()])
                    .is_ok()
                {
                    moved += 1;
                }
            }
        }
        for f in futures {
            assert_eq!(granule::block_on(f).expect("client ran"), per_client);
        }
        driver_inserts.join().expect("driver inserts");
        let all = map.range(None, None, usize::MAX).expect("scan");
        let keys: BTreeSet<u64> = all.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys.len(), all.len(), "a key was seen twice");
        let expected: BTreeSet<u64> = (0..per_client)
            .flat_map(|i| [i * 4, i * 4 + 1, i * 4 + 3])
            .collect();
        assert_eq!(keys, expected, "keys lost or invented");
        for (k, v) in &all {
            assert_eq!(v, &value(*k, 100), "value of {k}");
        }
        let sizes = map.sharder().shard_sizes().expect("sizes");
        eprintln!("{moved} shard moves; {}", distribution(&sizes, 1024));
        check_bounds(&sizes, b, 150, "after concurrent inserts");

        // Then the node clients remove all their keys, two thirds of every shard (shards
        // fall under the lower bound and merge), while the driver keeps moving shards.
        let removals: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(c, p)| {
                p.run_async(
                    (map.clone(), c as u64, per_client),
                    |_: &mut (), (m, c, n): (ShardedMap<u64, Vec<u8>>, u64, u64)| {
                        let mut removed = 0u64;
                        for i in 0..n {
                            let k = i * 4 + c;
                            if m.remove(&k).expect("remove from a node").is_some() {
                                removed += 1;
                            }
                        }
                        removed
                    },
                )
            })
            .collect();
        let shards_before = map.sharder().shards().expect("shards").len();
        for round in 0..20 {
            std::thread::sleep(Duration::from_millis(50));
            let Ok(shards) = map.sharder().shards() else {
                continue;
            };
            if let Some((_, s)) = shards.get(round % shards.len().max(1)) {
                if cluster
                    .move_proclet(s.id(), nodes[round % nodes.len()])
                    .is_ok()
                {
                    moved += 1;
                }
            }
        }
        for f in removals {
            assert_eq!(granule::block_on(f).expect("client ran"), per_client);
        }
        let all = map.range(None, None, usize::MAX).expect("scan");
        let keys: BTreeSet<u64> = all.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys.len(), all.len(), "a key was seen twice");
        let expected: BTreeSet<u64> = (0..per_client).map(|i| i * 4 + 3).collect();
        assert_eq!(keys, expected, "keys lost or invented after removals");
        for (k, v) in &all {
            assert_eq!(v, &value(*k, 100), "value of {k}");
        }
        let sizes = map.sharder().shard_sizes().expect("sizes");
        eprintln!(
            "after removals: {shards_before} → {} shards, {moved} moves in all; {}",
            sizes.len(),
            distribution(&sizes, 1024)
        );
        assert!(sizes.len() < shards_before, "no shard merged");
        check_bounds(&sizes, b, 150, "after concurrent removals");
        map.destroy().expect("destroy");
        cluster.shutdown();
    });
}

#[test]
fn sealed_vector_iterates_exactly_while_its_shards_migrate() {
    bounded(Duration::from_secs(300), || {
        let (cluster, nodes) = cluster(2);
        let b = Bounds::new(8 << 10, 32 << 10).expect("bounds");
        let v: ShardedVec<Vec<u8>> = ShardedVec::with_bounds(b).expect("vec");
        let n = 20_000u64;
        // Pushes one by one and in batches.
        for i in 0..1000u64 {
            assert_eq!(v.push(value(i, 100)).expect("push"), i);
        }
        let mut i = 1000u64;
        while i < n {
            let batch: Vec<Vec<u8>> = (i..(i + 500).min(n)).map(|k| value(k, 100)).collect();
            let len = batch.len() as u64;
            assert_eq!(v.extend(batch).expect("extend"), i);
            i += len;
        }
        assert_eq!(v.len().expect("len"), n);
        assert_eq!(v.get(12_345).expect("get"), Some(value(12_345, 100)));
        assert_eq!(v.get(n).expect("get past the end"), None);
        assert_eq!(v.set(77, value(7, 100)).expect("set"), value(77, 100));
        assert_eq!(v.get(77).expect("get"), Some(value(7, 100)));
        v.set(77, value(77, 100)).expect("set back");
        let sizes = v.sharder().shard_sizes().expect("sizes");
        eprintln!("{}", distribution(&sizes, 4096));
        check_bounds(&sizes, b, 150, "after pushes");
        assert!(matches!(
            v.iter(64, 4),
            Err(granule::sharded::ShardError::NotSealed)
        ));
        v.seal().expect("seal");
        assert!(matches!(
            v.push(value(0, 1)),
            Err(granule::sharded::ShardError::Sealed)
        ));
        // Iterate while the driver moves shards between the nodes.
        let it = v.iter(128, 4).expect("iter");
        let reader = std::thread::spawn(move || {
            let mut count = 0u64;
            for (i, x) in it.enumerate() {
                let x = x.expect("element");
                assert_eq!(x, value(i as u64, 100), "element {i}");
                count += 1;
            }
            count
        });
        let shards = v.sharder().shards().expect("shards");
        let mut moved = 0;
        for (k, (_, s)) in shards.iter().enumerate().take(40) {
            if cluster.move_proclet(s.id(), nodes[k % nodes.len()]).is_ok() {
                moved += 1;
            }
        }
        assert_eq!(reader.join().expect("reader"), n);
        eprintln!("{moved} shards moved during the iteration");
        assert!(moved > 0);
        v.unseal().expect("unseal");
        assert_eq!(v.push(value(n, 100)).expect("push after unseal"), n);
        v.destroy().expect("destroy");
        cluster.shutdown();
    });
}

#[test]
fn batching_pusher_lands_every_element_once() {
    bounded(Duration::from_secs(300), || {
        let (cluster, _nodes) = cluster(2);
        // Small bounds, so batches in flight meet splits of the tail.
        let b = Bounds::new(16 << 10, 64 << 10).expect("bounds");
        let v: ShardedVec<Vec<u8>> = ShardedVec::with_bounds(b).expect("vec");
        let n = 20_000u64;
        let mut p = v.pusher(8 << 10, 4).expect("pusher");
        // Each element carries its index, so the check below can tell them apart.
        let elem = |k: u64| [k.to_le_bytes().to_vec(), value(k, 92)].concat();
        for i in 0..n {
            p.push(elem(i)).expect("push");
        }
        assert_eq!(p.flush().expect("flush"), n);
        drop(p);
        assert_eq!(v.len().expect("len"), n);
        // Every element exactly once (batches may land in either order).
        let all = v.read_range(0, n).expect("read");
        let mut firsts: Vec<u64> = all
            .iter()
            .map(|x| {
                let k = u64::from_le_bytes(x[..8].try_into().expect("8 bytes"));
                assert_eq!(x, &elem(k), "element {k} damaged");
                k
            })
            .collect();
        firsts.sort_unstable();
        assert!(
            firsts.iter().copied().eq(0..n),
            "lost or duplicated elements"
        );
        let sizes = v.sharder().shard_sizes().expect("sizes");
        check_bounds(&sizes, b, 150, "after batched pushes");
        v.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A sharded set of u64 (the crate documentation's example).
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct SetShard {
    keys: BTreeSet<u64>,
}

impl granule::sharded::Shard for SetShard {
    type Key = u64;
    fn split(&mut self) -> Option<(u64, Self)> {
        let mid = *self.keys.iter().nth(self.keys.len() / 2)?;
        if mid == *self.keys.iter().next()? {
            return None;
        }
        Some((
            mid,
            SetShard {
                keys: self.keys.split_off(&mid),
            },
        ))
    }
    fn merge(&mut self, mut right: Self) {
        self.keys.append(&mut right.keys)
    }
    fn footprint(&self) -> u64 {
        48 * self.keys.len() as u64
    }
}

#[test]
fn a_split_its_client_abandoned_is_finished_by_the_next_writer() {
    use granule::sharded::{AutoSharder, Hint};
    bounded(Duration::from_secs(120), || {
        let (cluster, _nodes) = cluster(2);
        let s: AutoSharder<SetShard> =
            AutoSharder::new(Bounds::new(1 << 10, 4 << 10).expect("bounds")).expect("set");
        // 200 keys with no resizing: one shard of ~9.6 KB, over the 4 KiB bound.
        for k in 0..200u64 {
            s.route(&k, Hint::Same, k, |s: &mut SetShard, k: u64| {
                s.keys.insert(k)
            })
            .expect("insert");
        }
        let (_, shard) = s.shards().expect("shards").remove(0);
        // A client begins a split and dies: the upper half is pending in the shard.
        assert!(s.begin_split(&shard).expect("begin"));
        // Reads of the split-off keys are served at once (from pending)...
        let t = Instant::now();
        assert!(s
            .route_ref(&150, 150u64, |s: &SetShard, k: u64| s.keys.contains(&k))
            .expect("read"));
        assert!(
            t.elapsed() < Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
        // ...a write to them waits, then finishes the split itself.
        let t = Instant::now();
        assert!(s
            .route(&199, Hint::Grow, 1_000u64, |s: &mut SetShard, k: u64| s
                .keys
                .insert(k))
            .expect("write"));
        eprintln!("the write waited {:?} and finished the split", t.elapsed());
        assert!(s.shards().expect("shards").len() >= 2);
        // Every key exactly once.
        let all: Vec<Vec<u64>> = s
            .map_shards((), |s: &SetShard, ()| s.keys.iter().copied().collect())
            .expect("keys");
        let flat: Vec<u64> = all.into_iter().flatten().collect();
        let expected: Vec<u64> = (0..200).chain([1_000]).collect();
        assert_eq!(flat, expected);
        s.destroy().expect("destroy");
        cluster.shutdown();
    });
}
