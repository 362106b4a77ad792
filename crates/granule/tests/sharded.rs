//! Multi-process tests of the sharded structures: real node processes on 127.0.0.1, shards
//! splitting, merging and migrating under concurrent use.

use granule::sharded::{Bounds, ShardedMap, ShardedPartitions, ShardedQueue, ShardedVec};
use granule::{Cluster, Kind, NodeId, Proclet};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

mod common;
use common::bounded;

/// Two or three nodes with room for the structures; no shedding (the tests move shards
/// themselves). These tests run seven clusters at once on two vCPUs and do not test failure
/// detection: a 5 s failure timeout keeps a heartbeat starved for a second from ending
/// one of them.
fn cluster(n: usize) -> (Cluster, Vec<NodeId>) {
    cluster_with_faults(n, false)
}

/// [`cluster`], taking fault orders (`Cluster::faults`) if `faults`.
fn cluster_with_faults(n: usize, faults: bool) -> (Cluster, Vec<NodeId>) {
    let specs = vec!["cpu=1,mem=1GiB"; n].join(";");
    let c = Cluster::builder()
        .nodes(&specs)
        .expect("node specs")
        .shed(false)
        .faults(faults)
        .failure_timeout(Duration::from_secs(5))
        .start()
        .expect("cluster starts");
    let workers = c.worker_nodes().expect("nodes");
    assert_eq!(workers.len(), n);
    (c, workers)
}

/// A stateless compute proclet on `node`, whose closures act as a client there.
fn client_on(node: NodeId) -> Proclet<()> {
    Proclet::builder(Kind::Compute)
        .on(node)
        .create((), |()| ())
        .expect("client proclet")
}

/// Run a call on a thread of its own, so several node clients run at once (a call's
/// future starts only when polled).
fn in_background<T: Send + 'static>(
    call: impl std::future::Future<Output = T> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let ctx = granule::thread_context();
    std::thread::spawn(move || {
        ctx.enter();
        granule::block_on(call)
    })
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
        // A handle with a cache of its own (as one decoded on another node has), brought
        // up to date now and left alone until the map's log has been compacted past it.
        let stale: ShardedMap<u64, Vec<u8>> =
            serde_json::from_str(&serde_json::to_string(&map).expect("encode")).expect("decode");
        assert_eq!(stale.get(&1).expect("get"), None);
        let stale_version = stale.sharder().cached_version();
        assert!(stale_version >= 1);
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
        // Every split and merge was a change of the map, but its log kept only the last
        // ones (about one per shard plus 64, at most twice that).
        let (version, kept) = map.sharder().log_extent().expect("log");
        eprintln!("map version {version}, log holds the last {kept} changes");
        assert!(version > 1000, "only {version} changes of the map");
        assert!(
            kept <= 2 * (sizes.len() + 64),
            "the log holds {kept} changes for {} shards",
            sizes.len()
        );
        assert!(
            version - kept > stale_version,
            "the log was not compacted past the stale handle"
        );
        // The stale handle catches up from a snapshot: the same shards as the map's own
        // handle, and it routes right both ways.
        stale.sharder().refresh().expect("refresh");
        assert_eq!(stale.sharder().cached_version(), version);
        let ids = |m: &ShardedMap<u64, Vec<u8>>| -> Vec<_> {
            m.sharder()
                .shards()
                .expect("shards")
                .into_iter()
                .map(|(lo, s)| (lo, s.id()))
                .collect()
        };
        assert_eq!(ids(&stale), ids(&map));
        assert_eq!(stale.insert(7, value(7, 64)).expect("insert"), None);
        assert_eq!(map.get(&7).expect("get"), Some(value(7, 64)));
        assert_eq!(map.remove(&7).expect("remove"), Some(value(7, 64)));
        assert_eq!(stale.get(&7).expect("get"), None);
        map.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A structure's shards spread over the nodes with room (the controller places each new
/// shard, a split's new half included, as any new proclet: the least loaded of the
/// roomiest nodes), instead of piling up on the node of the shard they split from: one
/// node's loss must not take the whole structure.
#[test]
fn a_structures_shards_spread_over_the_nodes() {
    bounded(Duration::from_secs(120), || {
        let (cluster, nodes) = cluster(3);
        let b = Bounds::new(2 << 10, 8 << 10).expect("bounds");
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(b).expect("map");
        // ~30 full shards' worth (112 B an entry, see the test above).
        for k in 0..(30 * (8 << 10) / 112) {
            map.insert(k, value(k, 64)).expect("insert");
        }
        let shards = map.sharder().shards().expect("shards");
        assert!(shards.len() >= 12, "only {} shards", shards.len());
        let mut per_node = std::collections::BTreeMap::<NodeId, usize>::new();
        for (_, shard) in &shards {
            *per_node
                .entry(cluster.locate(shard.id()).expect("locate"))
                .or_default() += 1;
        }
        eprintln!("{} shards per node: {per_node:?}", shards.len());
        assert_eq!(
            per_node.len(),
            nodes.len(),
            "every node should hold some shards: {per_node:?}"
        );
        let most = per_node.values().copied().max().unwrap_or(0);
        assert!(
            most * 2 <= shards.len(),
            "one node holds {most} of {} shards: {per_node:?}",
            shards.len()
        );
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
        let clients: Vec<Proclet<()>> = nodes[..2].iter().map(|n| client_on(*n)).collect();
        let futures: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(c, p)| {
                in_background(p.run_async(
                    (map.clone(), c as u64, per_client),
                    |_: &mut (), (m, c, n): (ShardedMap<u64, Vec<u8>>, u64, u64)| {
                        for i in 0..n {
                            let k = i * 4 + c;
                            m.insert(k, value(k, 100)).expect("insert from a node");
                        }
                        n
                    },
                ))
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
            assert_eq!(
                f.join().expect("client thread").expect("client ran"),
                per_client
            );
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
                in_background(p.run_async(
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
                ))
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
            assert_eq!(
                f.join().expect("client thread").expect("client ran"),
                per_client
            );
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
        // The batching path recovers the same way: a second split begins and is
        // abandoned, and a batch for keys on both sides of it still lands.
        for k in 200..400u64 {
            s.route(&k, Hint::Same, k, |s: &mut SetShard, k: u64| {
                s.keys.insert(k)
            })
            .expect("insert");
        }
        let (_, last) = s.shards().expect("shards").pop().expect("a shard");
        assert!(s.begin_split(&last).expect("begin a second split"));
        let t = Instant::now();
        let batch: Vec<u64> = vec![1_001, 1_002, 2_000];
        let written = granule::block_on(s.route_many_async(
            batch,
            |k: &u64| *k,
            |s: &mut SetShard, ks: Vec<u64>| s.keys.extend(ks),
        ))
        .expect("batch");
        assert!(!written.is_empty());
        eprintln!("the batch waited {:?} and finished the split", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // Every key exactly once.
        let all: Vec<Vec<u64>> = s
            .map_shards((), |s: &SetShard, ()| s.keys.iter().copied().collect())
            .expect("keys");
        let flat: Vec<u64> = all.into_iter().flatten().collect();
        let expected: Vec<u64> = (0..400).chain([1_000, 1_001, 1_002, 2_000]).collect();
        assert_eq!(flat, expected);
        s.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A merge the map never recorded (its left shard cut off from the mapping proclet: here
/// the `sharded.merge.before_record` failpoint) leaves the map naming a shard that only
/// forwards, to the shard it went into. Removing keys from the top down merges that shard
/// on into its own left neighbour and frees it: the forward leads nowhere. The next
/// client that meets the merged-away shard finishes its merge, so every key stays
/// reachable and the drained map merges down.
#[test]
fn a_merge_the_map_never_recorded_is_finished_by_the_next_client() {
    bounded(Duration::from_secs(120), || {
        let (cluster, mut everyone) = cluster_with_faults(2, true);
        everyone.push(cluster.node_id());
        let map: ShardedMap<u64, Vec<u8>> =
            ShardedMap::with_bounds(Bounds::new(4 << 10, 8 << 10).expect("bounds")).expect("map");
        const KEYS: u64 = 300;
        for k in 0..KEYS {
            map.insert(k, value(k, 200)).expect("insert");
        }
        let before = map.sharder().shards().expect("shards").len();
        assert!(before >= 6, "only {before} shards");
        // The first merge on each process records nothing.
        for n in &everyone {
            cluster
                .faults()
                .failpoints(*n, "sharded.merge.before_record=1*error")
                .expect("arm");
        }
        let t = Instant::now();
        for k in (0..KEYS).rev() {
            assert_eq!(
                map.remove(&k).expect("remove"),
                Some(value(k, 200)),
                "key {k}"
            );
        }
        eprintln!("{KEYS} removes from the top down took {:?}", t.elapsed());
        let fired = everyone
            .iter()
            .map(|n| cluster.faults().report(*n).expect("report"))
            .filter(|r| r.contains("sharded.merge.before_record") && r.contains("error"))
            .count();
        assert!(fired >= 1, "no merge record was made to fail");
        cluster.faults().clear().expect("clear");
        assert_eq!(map.len().expect("len"), 0);
        // Every key is reachable again, and the drained map merged down.
        for k in 0..KEYS {
            map.insert(k, value(k, 10)).expect("insert again");
        }
        for k in 0..KEYS {
            assert_eq!(map.get(&k).expect("get"), Some(value(k, 10)), "key {k}");
        }
        assert_eq!(map.len().expect("len"), KEYS);
        map.sharder().destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// Put `p` on `node` (if it is not there already) and check that it is there.
fn place<S>(cluster: &Cluster, p: &Proclet<S>, node: NodeId)
where
    S: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    if p.location().expect("location") != node {
        cluster.move_proclet(p.id(), node).expect("move");
    }
    assert_eq!(p.location().expect("location"), node);
}

/// A merge whose left shard never hears the right shard's answer to the hand-over (the
/// `call.before_reply` failpoint on the right shard's node: the closure ran, its answer is
/// lost, as with a connection cut right after it) must lose nothing: the right shard
/// keeps its data until the merge is known to be complete, and the next client that
/// meets it finishes or undoes the merge. The map has two shards: the first (the merge's
/// left shard, and the mapping proclet) on one node, the second alone on the other, so
/// the hand-over is the first call that node serves once the failpoint is armed, just
/// before the remove that takes the first shard under its lower bound.
#[test]
fn a_merge_whose_hand_over_answer_is_lost_loses_no_data() {
    const FP: &str = "call.before_reply";
    bounded(Duration::from_secs(240), || {
        let (cluster, workers) = cluster_with_faults(2, true);
        let (left_node, right_node) = (workers[0], workers[1]);
        let b = Bounds::new(2 << 10, 8 << 10).expect("bounds");
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(b).expect("map");
        // Insert until the one shard splits in two (halves of about 4 KiB).
        let mut n = 0u64;
        while map.sharder().shards().expect("shards").len() < 2 {
            assert!(n < 1_000, "the shard never split");
            map.insert(n, value(n, 200)).expect("insert");
            n += 1;
        }
        let shards = map.sharder().shards().expect("shards");
        assert_eq!(shards.len(), 2, "{:?}", map.sharder().describe());
        let (first, (second_lo, second)) = (shards[0].1.clone(), shards[1].clone());
        let second_lo = second_lo.expect("the second shard starts at a key");
        place(&cluster, map.sharder().map_proclet(), left_node);
        place(&cluster, &first, left_node);
        place(&cluster, &second, right_node);
        // Remove the first shard's keys from the bottom while it stays within its
        // bounds; the next remove takes it under the lower bound and merges the pair.
        let mut live: BTreeSet<u64> = (0..n).collect();
        let mut next = 0u64;
        let entry = {
            let before = map.sharder().shard_sizes().expect("sizes")[0];
            assert_eq!(map.remove(&next).expect("remove"), Some(value(next, 200)));
            live.remove(&next);
            next += 1;
            before - map.sharder().shard_sizes().expect("sizes")[0]
        };
        loop {
            let sizes = map.sharder().shard_sizes().expect("sizes");
            assert_eq!(sizes.len(), 2, "merged too early: {sizes:?}");
            assert!(
                next < second_lo,
                "the first shard ran out of keys: {sizes:?}"
            );
            if sizes[0] < b.lower + entry {
                break;
            }
            assert_eq!(map.remove(&next).expect("remove"), Some(value(next, 200)));
            live.remove(&next);
            next += 1;
        }
        // The hand-over is the next call the right shard's node serves: its answer is
        // lost.
        cluster
            .faults()
            .failpoints(right_node, &format!("{FP}=1*error"))
            .expect("arm");
        assert_eq!(map.remove(&next).expect("remove"), Some(value(next, 200)));
        live.remove(&next);
        assert_eq!(
            errors_fired(&cluster, right_node, FP),
            1,
            "the hand-over's answer was not lost"
        );
        cluster.faults().clear().expect("clear");
        eprintln!(
            "after the lost answer:\n  {}",
            map.sharder().describe().expect("describe").join("\n  ")
        );
        // Every key is there with its value; none is stuck.
        for k in &live {
            assert_eq!(map.get(k).expect("get"), Some(value(*k, 200)), "key {k}");
        }
        // Writes to both ranges work and are read back.
        for k in [next + 1, second_lo, second_lo + 1, n - 1, n + 10] {
            map.insert(k, value(k, 50))
                .expect("write after the lost answer");
            live.insert(k);
        }
        // The merge the first shard failed is tried again (its client owes it).
        map.sharder()
            .settle(Duration::from_secs(10))
            .expect("the failed merge is done");
        let described = map.sharder().describe().expect("describe").join("\n  ");
        eprintln!("settled:\n  {described}");
        assert_eq!(
            map.sharder().shards().expect("shards").len(),
            1,
            "the pair did not merge:\n  {described}"
        );
        assert!(
            !described.contains("=Some"),
            "a step left undone:\n  {described}"
        );
        for k in &live {
            let want = if [next + 1, second_lo, second_lo + 1, n - 1, n + 10].contains(k) {
                value(*k, 50)
            } else {
                value(*k, 200)
            };
            assert_eq!(map.get(k).expect("get"), Some(want), "key {k}");
        }
        assert_eq!(map.len().expect("len"), live.len() as u64);
        map.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// The same for the empty first shard handing its range to its right neighbour
/// (`drop_empty_first`, what a queue does with its drained head): the neighbour's
/// answer to "take my range" is lost. The range must stay served, and the drop must be
/// finished by the next try (a queue's consumer tries until the head is gone).
#[test]
fn a_dropped_first_shard_whose_hand_over_answer_is_lost_is_finished() {
    use granule::sharded::{AutoSharder, Hint};
    const FP: &str = "call.before_reply";
    bounded(Duration::from_secs(240), || {
        let (cluster, workers) = cluster_with_faults(2, true);
        let (left_node, right_node) = (workers[0], workers[1]);
        let s: AutoSharder<SetShard> =
            AutoSharder::new(Bounds::new(1 << 10, 4 << 10).expect("bounds")).expect("set");
        // 120 keys (~5.8 KB) with no resizing, then one split: halves of 60 keys.
        for k in 0..120u64 {
            s.route(&k, Hint::Same, k, |s: &mut SetShard, k: u64| {
                s.keys.insert(k)
            })
            .expect("insert");
        }
        let (_, only) = s.shards().expect("shards").remove(0);
        s.split(&only).expect("split");
        let shards = s.shards().expect("shards");
        assert_eq!(shards.len(), 2, "{:?}", s.describe());
        let (first, (second_lo, second)) = (shards[0].1.clone(), shards[1].clone());
        let second_lo = second_lo.expect("the second shard starts at a key");
        place(&cluster, s.map_proclet(), left_node);
        place(&cluster, &first, left_node);
        place(&cluster, &second, right_node);
        // Empty the first shard.
        for k in 0..second_lo {
            assert!(s
                .route(&k, Hint::Same, k, |s: &mut SetShard, k: u64| s
                    .keys
                    .remove(&k))
                .expect("remove"));
        }
        // The drop checks the second shard for a split in progress (a call its node
        // serves), then the first shard asks it to take its range: that answer is lost.
        cluster
            .faults()
            .failpoints(right_node, &format!("{FP}=1*off->1*error"))
            .expect("arm");
        let r = s.drop_empty_first();
        assert_eq!(
            errors_fired(&cluster, right_node, FP),
            1,
            "the answer was not lost ({r:?})"
        );
        cluster.faults().clear().expect("clear");
        eprintln!(
            "the drop answered {r:?}; then:\n  {}",
            s.describe().expect("describe").join("\n  ")
        );
        // Every key is there; none is stuck.
        for k in second_lo..120 {
            assert!(
                s.route_ref(&k, k, |s: &SetShard, k: u64| s.keys.contains(&k))
                    .expect("read"),
                "key {k}"
            );
        }
        // The drop is finished by the next try: one shard is left.
        let dropped = s.drop_empty_first().expect("drop again");
        let described = s.describe().expect("describe").join("\n  ");
        assert!(dropped, "the first shard stayed:\n  {described}");
        assert_eq!(s.shards().expect("shards").len(), 1, "{described}");
        assert!(
            !described.contains("=Some"),
            "a step left undone:\n  {described}"
        );
        // Writes to the dropped shard's range land in its successor.
        assert!(s
            .route(&5, Hint::Same, 5u64, |s: &mut SetShard, k: u64| s
                .keys
                .insert(k))
            .expect("write to the dropped range"));
        let all: Vec<u64> = s
            .map_shards((), |s: &SetShard, ()| {
                s.keys.iter().copied().collect::<Vec<_>>()
            })
            .expect("keys")
            .into_iter()
            .flatten()
            .collect();
        let expected: Vec<u64> = std::iter::once(5).chain(second_lo..120).collect();
        assert_eq!(all, expected);
        s.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A split whose client failed after the parent dropped its copy of the split-off part
/// but before the new shard thawed (the `sharded.split.before_thaw` failpoint, on the
/// node where the split's client runs) leaves the new shard frozen; its parent, with
/// no split pending any more, may then merge away and be freed. The next writer to the
/// frozen shard thaws it: its part has no other holder.
#[test]
fn a_frozen_shard_whose_parent_merged_away_is_thawed_by_the_next_writer() {
    bounded(Duration::from_secs(120), || {
        let (cluster, workers) = cluster_with_faults(2, true);
        let map: ShardedMap<u64, Vec<u8>> =
            ShardedMap::with_bounds(Bounds::new(4 << 10, 8 << 10).expect("bounds")).expect("map");
        for k in 0..100u64 {
            map.insert(k, value(k, 200)).expect("insert");
        }
        let before = map.sharder().shards().expect("shards").len();
        assert!(before >= 3, "only {before} shards");
        // The split's client runs on a node of this test's own cluster, where the
        // failpoint is armed: failpoints are per process, and this test process runs
        // other tests' splits meanwhile.
        let node = workers[0];
        let client = client_on(node);
        cluster
            .faults()
            .failpoints(node, "sharded.split.before_thaw=1*error")
            .expect("arm");
        // Grow the last shard until it splits: that split's new shard stays frozen.
        let next = client
            .run(
                (map.clone(), before),
                |_: &mut (), (map, before): (ShardedMap<u64, Vec<u8>>, usize)| {
                    let mut next = 100u64;
                    while map.sharder().shards().expect("shards").len() == before {
                        assert!(next < 1_000, "the last shard never split");
                        map.insert(next, value(next, 200)).expect("insert");
                        next += 1;
                    }
                    next
                },
            )
            .expect("inserts from the node");
        let shards = map.sharder().shards().expect("shards");
        let described = map.sharder().describe().expect("describe").join("\n");
        assert!(described.contains("frozen_by=Some"), "{described}");
        let (parent_lo, parent) = shards[shards.len() - 2].clone();
        let child_lo = shards[shards.len() - 1]
            .0
            .expect("the new shard starts at a key");
        // Empty the parent: it merges into its left neighbour and is freed.
        for k in parent_lo.expect("not the first shard")..child_lo {
            map.remove(&k).expect("remove");
        }
        let described = map.sharder().describe().expect("describe").join("\n");
        assert!(
            !described.contains(&format!("{} ", parent.id())),
            "the parent did not merge away:\n{described}"
        );
        // A write to the frozen shard's range thaws it (after the busy patience).
        let t = Instant::now();
        map.insert(next, value(next, 200))
            .expect("write to the frozen shard");
        eprintln!("the write waited {:?} and thawed the shard", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        for k in (0..parent_lo.unwrap()).chain(child_lo..=next) {
            assert_eq!(map.get(&k).expect("get"), Some(value(k, 200)), "key {k}");
        }
        map.sharder().destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// How often failpoint `name` fired `error` on `node` (its report has a line per action).
fn errors_fired(cluster: &Cluster, node: NodeId, name: &str) -> usize {
    let report = cluster.faults().report(node).expect("report");
    report
        .lines()
        .filter(|l| l.contains(name) && l.trim_end().ends_with(": error"))
        .count()
}

/// A split that fails (the `sharded.split.before_begin` failpoint) leaves its shard over
/// the upper bound, where maybe nothing will write again: the client that failed tries
/// it again. A batching pusher does so before its flush returns, though the shard's only
/// batch was its last; a plain write does so for a shard it failed to split earlier,
/// though the write goes to another shard. The writes run on a node of this test's own
/// cluster, where the failpoint is armed: failpoints are per process, and this test
/// process runs other tests' splits meanwhile.
#[test]
fn a_split_that_failed_is_tried_again_by_the_flush_and_by_later_writes() {
    use granule::sharded::Footprint;
    const FP: &str = "sharded.split.before_begin";
    bounded(Duration::from_secs(120), || {
        let (cluster, workers) = cluster_with_faults(2, true);
        let node = workers[0];
        let client = client_on(node);

        // The pusher: one batch of ~80 KiB (sent by the flush), so the one shard goes
        // over its 64 KiB bound with the last batch, and the first split of it fails.
        let b = Bounds::new(16 << 10, 64 << 10).expect("bounds");
        let v: ShardedVec<Vec<u8>> = ShardedVec::with_bounds(b).expect("vec");
        cluster
            .faults()
            .failpoints(node, &format!("{FP}=1*error"))
            .expect("arm");
        let n = client
            .run(v.clone(), |_: &mut (), v: ShardedVec<Vec<u8>>| {
                let mut p = v.pusher(1 << 20, 1).expect("pusher");
                let (mut n, mut bytes) = (0u64, 0u64);
                while bytes < 80 << 10 {
                    let x = value(n, 100);
                    bytes += x.footprint();
                    p.push(x).expect("push");
                    n += 1;
                }
                assert_eq!(p.flush().expect("flush"), n);
                n
            })
            .expect("pushes from the node");
        assert_eq!(
            errors_fired(&cluster, node, FP),
            1,
            "the split did not fail"
        );
        let sizes = v.sharder().shard_sizes().expect("sizes");
        assert!(sizes.len() >= 2, "the shard was not split: {sizes:?}");
        check_bounds(&sizes, b, 150, "after a pusher's failed split");
        assert_eq!(v.len().expect("len"), n);
        let all = v.read_range(0, n).expect("read");
        assert!(all.iter().cloned().eq((0..n).map(|k| value(k, 100))));
        v.destroy().expect("destroy");

        // Plain writes: a map of a few shards; its first shard grows past the bound and
        // its split fails; a later write to the last shard splits it. (The lower bound
        // is a quarter of the upper one: a split halves a shard by keys, not bytes.)
        let mb = Bounds::new(2 << 10, 8 << 10).expect("bounds");
        let map: ShardedMap<u64, Vec<u8>> = ShardedMap::with_bounds(mb).expect("map");
        for k in 0..60u64 {
            map.insert(k * 1_000, value(k, 200)).expect("insert");
        }
        let shards = map.sharder().shards().expect("shards");
        assert!(shards.len() >= 2, "only {} shard", shards.len());
        let second = shards[1].0.expect("the second shard starts at a key");
        cluster
            .faults()
            .failpoints(node, &format!("{FP}=1*error"))
            .expect("arm again");
        let over = client
            .run(
                (map.clone(), second),
                |_: &mut (), (map, second): (ShardedMap<u64, Vec<u8>>, u64)| {
                    // Keys between the first shard's: until one grows it past its bound
                    // and its split fails (a split that works keeps it within).
                    let mut k = 1;
                    let over = loop {
                        assert!(k < second, "the first shard never went over its bound");
                        map.insert(k, value(k, 200)).expect("insert");
                        k += 1;
                        let first = map.sharder().shard_sizes().expect("sizes")[0];
                        if first > 8 << 10 {
                            break first;
                        }
                    };
                    // Past the first retry's wait (1 ms), a write through the same
                    // client (the one that knows of the failure) to another shard tries
                    // the split again.
                    std::thread::sleep(Duration::from_millis(5));
                    map.insert(u64::MAX, value(0, 10))
                        .expect("a write elsewhere");
                    over
                },
            )
            .expect("inserts from the node");
        assert_eq!(
            errors_fired(&cluster, node, FP),
            2,
            "the split did not fail"
        );
        eprintln!("the first shard held {over} B after its split failed");
        let sizes = map.sharder().shard_sizes().expect("sizes");
        check_bounds(&sizes, mb, 250, "after a write's failed split");
        // Stricter than the check's slack of an entry: it went over by less than one.
        assert!(
            sizes.iter().all(|s| *s <= mb.upper),
            "a shard stayed over its bound: {sizes:?}"
        );
        map.sharder().destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A shard a write grew past its upper bound while another client's split of it was
/// under way (here begun and abandoned) is split again once that split is finished:
/// both its own part and the split-off one may still be over the bound.
#[test]
fn a_shard_over_its_bound_after_another_clients_split_is_split_again() {
    use granule::sharded::{AutoSharder, Hint};
    bounded(Duration::from_secs(120), || {
        let (cluster, _nodes) = cluster(2);
        let b = Bounds::new(1 << 10, 4 << 10).expect("bounds");
        let s: AutoSharder<SetShard> = AutoSharder::new(b).expect("set");
        // 400 even keys with no resizing: one shard of ~19 KB, over four times the bound.
        for k in (0..800u64).step_by(2) {
            s.route(&k, Hint::Same, k, |s: &mut SetShard, k: u64| {
                s.keys.insert(k)
            })
            .expect("insert");
        }
        let (_, shard) = s.shards().expect("shards").remove(0);
        // Another client begins a split (halves of ~9.6 KB) and is gone.
        assert!(s.begin_split(&shard).expect("begin"));
        // A write to the shard's own half finds it over the bound: it waits for that
        // split, finishes it, and splits both halves on.
        assert!(s
            .route(&1, Hint::Grow, 1u64, |s: &mut SetShard, k: u64| s
                .keys
                .insert(k))
            .expect("write"));
        let sizes = s.shard_sizes().expect("sizes");
        check_bounds(&sizes, b, 48, "after the abandoned split");
        let flat: Vec<u64> = s
            .map_shards((), |s: &SetShard, ()| {
                s.keys.iter().copied().collect::<Vec<_>>()
            })
            .expect("keys")
            .into_iter()
            .flatten()
            .collect();
        let mut expected: Vec<u64> = (0..800).step_by(2).chain([1]).collect();
        expected.sort_unstable();
        assert_eq!(flat, expected);
        s.destroy().expect("destroy");
        cluster.shutdown();
    });
}

/// A queue message: (producer, its sequence number, payload). Producer `u64::MAX` is the
/// end marker.
type Msg = (u64, u64, Vec<u8>);
const END: u64 = u64::MAX;

/// Sets the flag when dropped: a mover thread stops even when the test body panics
/// (a scope would otherwise wait for it forever).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The driver moves a shard of `shards` to another node every 40 ms until `stop`.
fn keep_moving<F>(
    cluster: &granule::Cluster,
    nodes: &[NodeId],
    stop: &std::sync::atomic::AtomicBool,
    shards: F,
) -> usize
where
    F: Fn() -> Option<Vec<granule::ProcletId>>,
{
    let mut moved = 0;
    let mut round = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(40));
        round += 1;
        let Some(ids) = shards() else { continue };
        if let Some(id) = ids.get(round % ids.len().max(1)) {
            if cluster
                .move_proclet(*id, nodes[round % nodes.len()])
                .is_ok()
            {
                moved += 1;
            }
        }
    }
    moved
}

#[test]
fn queue_producers_and_consumers_on_several_nodes_take_every_element_once_in_order() {
    use std::sync::atomic::{AtomicBool, Ordering};
    bounded(Duration::from_secs(300), || {
        let (cluster, nodes) = cluster(3);
        // Small shards: the tail splits every ~100 elements, the head is dropped as often.
        let b = Bounds::new(4 << 10, 16 << 10).expect("bounds");
        let q: ShardedQueue<Msg> = ShardedQueue::with_bounds(b).expect("queue");
        let per_producer = 3000u64;
        // Consumers: on nodes 1 and 2 (one pops one at a time, one takes up to 16 per
        // call) and in the driver; each stops at the end marker.
        let consumers: Vec<Proclet<()>> = vec![client_on(nodes[1]), client_on(nodes[2])];
        let taken: Vec<_> = consumers
            .iter()
            .enumerate()
            .map(|(c, p)| {
                in_background(p.run_async(
                    (q.clone(), c),
                    |_: &mut (), (q, c): (ShardedQueue<Msg>, usize)| {
                        let mut got: Vec<(u64, u64)> = Vec::new();
                        loop {
                            let batch = if c == 0 {
                                vec![q.pop().expect("pop on a node")]
                            } else {
                                let b = q.try_pop(16).expect("try_pop on a node");
                                if b.is_empty() {
                                    std::thread::sleep(Duration::from_micros(200));
                                }
                                b
                            };
                            // Every element precedes the end markers; a batch that took
                            // more than one marker gives the others back.
                            let ends = batch.iter().filter(|m| m.0 == END).count();
                            for _ in 1..ends.max(1) {
                                q.push((END, 0, Vec::new()))
                                    .expect("give back an end marker");
                            }
                            for (p, i, payload) in batch {
                                if p == END {
                                    return got;
                                }
                                assert_eq!(
                                    payload,
                                    value(p * 1_000_000 + i, 100),
                                    "payload of {p}/{i}"
                                );
                                got.push((p, i));
                            }
                        }
                    },
                ))
            })
            .collect();
        // Producers: on nodes 0 and 1 (one pushes one by one, one through a batching
        // pusher with one batch in flight, which keeps order) and in the driver
        // (`extend` by 50).
        let producers: Vec<Proclet<()>> = vec![client_on(nodes[0]), client_on(nodes[1])];
        let pushed: Vec<_> = producers
            .iter()
            .enumerate()
            .map(|(p, pr)| {
                in_background(pr.run_async(
                    (q.clone(), p as u64, per_producer),
                    |_: &mut (), (q, p, n): (ShardedQueue<Msg>, u64, u64)| {
                        let msg = |i: u64| (p, i, value(p * 1_000_000 + i, 100));
                        if p == 0 {
                            for i in 0..n {
                                q.push(msg(i)).expect("push on a node");
                            }
                        } else {
                            let mut pusher = q.pusher(2 << 10, 1).expect("pusher");
                            for i in 0..n {
                                pusher.push(msg(i)).expect("batched push on a node");
                            }
                            assert_eq!(pusher.flush().expect("flush"), n);
                        }
                        n
                    },
                ))
            })
            .collect();
        let stop = AtomicBool::new(false);
        let (moved, driver_got) = std::thread::scope(|s| {
            let (ctx, q1) = (granule::thread_context(), q.clone());
            let driver_producer = s.spawn(move || {
                ctx.enter();
                let mut i = 0;
                while i < per_producer {
                    let batch: Vec<Msg> = (i..(i + 50).min(per_producer))
                        .map(|i| (2, i, value(2 * 1_000_000 + i, 100)))
                        .collect();
                    i += batch.len() as u64;
                    q1.extend(batch).expect("extend from the driver");
                }
            });
            let (ctx, q2) = (granule::thread_context(), q.clone());
            let driver_consumer = s.spawn(move || {
                ctx.enter();
                let mut got: Vec<(u64, u64)> = Vec::new();
                loop {
                    let Some((p, i, _)) = q2.pop_timeout(Duration::from_secs(60)).expect("pop")
                    else {
                        panic!(
                            "the driver's consumer waited 60 s, after {} elements",
                            got.len()
                        );
                    };
                    if p == END {
                        return got;
                    }
                    got.push((p, i));
                }
            });
            let (ctx, q3, cluster, nodes, stop) = (
                granule::thread_context(),
                q.clone(),
                &cluster,
                &nodes,
                &stop,
            );
            let _stop_mover = StopOnDrop(stop);
            let mover = s.spawn(move || {
                ctx.enter();
                keep_moving(cluster, nodes, stop, || {
                    q3.sharder()
                        .shards()
                        .ok()
                        .map(|v| v.iter().map(|(_, p)| p.id()).collect())
                })
            });
            for f in pushed {
                assert_eq!(
                    f.join().expect("producer thread").expect("producer ran"),
                    per_producer
                );
            }
            driver_producer.join().expect("driver producer");
            eprintln!("producers done");
            // Everything is in: one end marker per consumer, behind every element.
            for _ in 0..3 {
                q.push((END, 0, Vec::new())).expect("end marker");
            }
            let driver_got = driver_consumer.join().expect("driver consumer");
            stop.store(true, Ordering::Relaxed);
            (mover.join().expect("mover"), driver_got)
        });
        let mut all: Vec<Vec<(u64, u64)>> = taken
            .into_iter()
            .map(|f| f.join().expect("consumer thread").expect("consumer ran"))
            .collect();
        all.push(driver_got);
        // Each consumer saw each producer's elements in push order.
        for (c, got) in all.iter().enumerate() {
            for p in 0..3 {
                let seq: Vec<u64> = got
                    .iter()
                    .filter(|(q, _)| *q == p)
                    .map(|(_, i)| *i)
                    .collect();
                assert!(
                    seq.windows(2).all(|w| w[0] < w[1]),
                    "consumer {c} saw producer {p} out of order"
                );
            }
        }
        let counts: Vec<usize> = all.iter().map(|g| g.len()).collect();
        let mut every: Vec<(u64, u64)> = all.into_iter().flatten().collect();
        every.sort_unstable();
        let expected: Vec<(u64, u64)> = (0..3)
            .flat_map(|p| (0..per_producer).map(move |i| (p, i)))
            .collect();
        assert_eq!(every.len(), expected.len(), "elements lost or taken twice");
        assert_eq!(every, expected, "elements lost or taken twice");
        assert_eq!(q.len().expect("len"), 0);
        let shards = q.sharder().shards().expect("shards").len();
        eprintln!("consumers took {counts:?}; {moved} shard moves; {shards} shard(s) left");
        assert!(
            shards <= 2,
            "drained head shards were not dropped: {shards} left"
        );
        q.destroy().expect("destroy");
        cluster.shutdown();
    });
}

#[test]
fn partitions_split_evenly_and_hold_every_pair_once_while_shards_move() {
    use std::sync::atomic::{AtomicBool, Ordering};
    bounded(Duration::from_secs(60), || {
        let (cluster, nodes) = cluster(3);
        let b = Bounds::new(4 << 10, 16 << 10).expect("bounds");
        let parts: ShardedPartitions<u64, Vec<u8>> =
            ShardedPartitions::with_bounds(b).expect("partitions");
        // 600 keys, each 10 times: 6000 pairs of ~100 B; two node clients (one pair per
        // call, and a batching pusher) and the driver.
        let keys = 600u64;
        let pair = |i: u64| {
            let k = i.wrapping_mul(7919) % keys;
            (k, value(i, 64))
        };
        let clients: Vec<Proclet<()>> = nodes[..2].iter().map(|n| client_on(*n)).collect();
        let stop = AtomicBool::new(false);
        let moved = std::thread::scope(|s| {
            let (ctx, cluster, nodes, stop, parts) =
                (granule::thread_context(), &cluster, &nodes, &stop, &parts);
            let _stop_mover = StopOnDrop(stop);
            let mover = s.spawn(move || {
                ctx.enter();
                keep_moving(cluster, nodes, stop, || {
                    parts
                        .sharder()
                        .shards()
                        .ok()
                        .map(|v| v.iter().map(|(_, p)| p.id()).collect())
                })
            });
            let futs: Vec<_> = clients
                .iter()
                .enumerate()
                .map(|(c, p)| {
                    in_background(p.run_async(
                        (parts.clone(), c as u64),
                        |_: &mut (), (ps, c): (ShardedPartitions<u64, Vec<u8>>, u64)| {
                            let pair = |i: u64| (i.wrapping_mul(7919) % 600, value(i, 64));
                            let mine = (0..6000u64).filter(|i| i % 3 == c);
                            if c == 0 {
                                for i in mine {
                                    let (k, v) = pair(i);
                                    ps.insert(k, v).expect("insert on a node");
                                }
                            } else {
                                let mut pusher = ps.pusher(4 << 10, 4).expect("pusher");
                                for i in mine {
                                    pusher.push(pair(i)).expect("batched insert on a node");
                                }
                                pusher.flush().expect("flush");
                            }
                        },
                    ))
                })
                .collect();
            for i in (0..6000u64).filter(|i| i % 3 == 2) {
                let (k, v) = pair(i);
                parts.insert(k, v).expect("insert from the driver");
            }
            for f in futs {
                f.join().expect("client thread").expect("client ran");
            }
            stop.store(true, Ordering::Relaxed);
            mover.join().expect("mover")
        });
        assert_eq!(parts.len().expect("len"), 6000);
        assert!(matches!(
            parts.partitions(),
            Err(granule::sharded::ShardError::NotSealed)
        ));
        parts.seal().expect("seal");
        let ps = parts.partitions().expect("partitions");
        let mut seen: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut sizes = Vec::new();
        for p in &ps {
            let pairs = p.pairs().expect("pairs");
            let (lo, hi) = p.range();
            for (k, _) in &pairs {
                assert!(
                    lo.is_none_or(|l| k >= l) && hi.is_none_or(|h| k < h),
                    "key {k} outside its partition"
                );
            }
            sizes.push(
                pairs
                    .iter()
                    .map(|(_, v)| 8 + 24 + v.len() as u64)
                    .sum::<u64>(),
            );
            seen.extend(pairs);
        }
        eprintln!(
            "{} partitions, {moved} shard moves; {}",
            ps.len(),
            distribution(&sizes, 1024)
        );
        assert!(ps.len() >= 8, "too few splits: {}", ps.len());
        check_bounds(&sizes, b, 96, "partitions");
        seen.sort_unstable();
        let mut expected: Vec<(u64, Vec<u8>)> = (0..6000).map(pair).collect();
        expected.sort_unstable();
        assert_eq!(seen.len(), expected.len(), "pairs lost or duplicated");
        assert!(seen == expected, "pairs lost, duplicated or damaged");
        assert_eq!(parts.get_all(&17).expect("get_all").len(), 10);
        // Unsealed, take out nine keys of every ten: partitions merge, nothing else goes.
        parts.unseal().expect("unseal");
        let before = ps.len();
        for k in (0..keys).filter(|k| k % 10 != 0) {
            assert_eq!(
                parts.remove_all(&k).expect("remove_all").len(),
                10,
                "key {k}"
            );
        }
        assert_eq!(parts.len().expect("len"), 600);
        let after = parts.sharder().shards().expect("shards").len();
        eprintln!("after removals: {before} → {after} partitions");
        assert!(after < before, "no partition merged");
        let sizes = parts.sharder().shard_sizes().expect("sizes");
        check_bounds(&sizes, b, 96, "partitions after removals");
        parts.destroy().expect("destroy");
        cluster.shutdown();
    });
}
