//! `#[derive(granule::Footprint)]` through the facade: user types as elements, keys and
//! values of sharded structures, whose shards then count their bytes exactly.

use granule::sharded::{ShardedMap, ShardedVec};
use granule::{Cluster, Footprint};
use serde::{Deserialize, Serialize};
use std::time::Duration;

mod common;
use common::bounded;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Footprint)]
struct Doc {
    id: u64,
    words: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Footprint)]
enum Key {
    Id(u64),
    Name(String),
}

fn doc(id: u64) -> Doc {
    Doc {
        id,
        words: (0..id % 5).map(|i| format!("word{i}")).collect(),
    }
}

#[test]
fn derived_types_live_in_sharded_structures_and_are_counted() {
    bounded(Duration::from_secs(60), || {
        let cluster = Cluster::builder()
            .nodes("cpu=1,mem=1GiB")
            .expect("node specs")
            .start()
            .expect("cluster starts");
        let docs: Vec<Doc> = (0..200).map(doc).collect();

        let v: ShardedVec<Doc> = ShardedVec::new().expect("vec");
        v.extend(docs.clone()).expect("extend");
        let back = v.read_range(0, 200).expect("read");
        assert_eq!(back, docs);
        // A vector's shards hold exactly their elements' footprints. Compared with the
        // copies read back, decoded like the shard's own: `format!` leaves spare
        // capacity in the originals' strings, which a footprint rightly counts.
        let held: u64 = v.sharder().shard_sizes().expect("sizes").iter().sum();
        assert_eq!(held, back.iter().map(Footprint::footprint).sum::<u64>());
        assert!(held < docs.iter().map(Footprint::footprint).sum::<u64>());

        let m: ShardedMap<Key, Doc> = ShardedMap::new().expect("map");
        for d in &docs {
            let k = if d.id % 2 == 0 {
                Key::Id(d.id)
            } else {
                Key::Name(format!("doc{}", d.id))
            };
            m.insert(k, d.clone()).expect("insert");
        }
        assert_eq!(m.get(&Key::Name("doc7".into())).expect("get"), Some(doc(7)));
        assert_eq!(m.len().expect("len"), 200);
        let held: u64 = m.sharder().shard_sizes().expect("sizes").iter().sum();
        assert!(held >= docs.iter().map(Footprint::footprint).sum::<u64>());

        v.destroy().expect("destroy");
        m.destroy().expect("destroy");
        cluster.shutdown();
    });
}
