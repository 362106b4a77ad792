//! The migration engine on real multi-process clusters: moves during storms of calls from
//! several nodes, nested calls into moving proclets, large and non-byte states, pinning,
//! range jobs that split at item boundaries, accounting, shedding under a memory budget.

mod common;

use common::{bounded, checksum, cluster};
use granule::{CallError, Footprint, Kind, NodeId, Proclet, RangeJob};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

/// Every call appends its token: the log shows each call ran exactly once.
#[derive(Serialize, Deserialize, Default)]
struct Log {
    tokens: Vec<(u32, u32)>,
}

fn location(p: &Proclet<Log>) -> NodeId {
    p.location().unwrap()
}

#[test]
fn storm_of_calls_from_several_nodes_while_the_proclet_keeps_moving() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=512MiB");
        let log = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create((), |()| Log::default())
            .unwrap();
        const PER_CLIENT: u32 = 400;
        // Clients on every worker node and on the driver, calling concurrently.
        #[derive(Serialize, Deserialize)]
        struct Client;
        let clients: Vec<Proclet<Client>> = nodes
            .iter()
            .map(|n| {
                Proclet::builder(Kind::Compute)
                    .on(*n)
                    .create((), |()| Client)
                    .unwrap()
            })
            .collect();
        let mut running = Vec::new();
        for (i, c) in clients.iter().enumerate() {
            let (c, log) = (c.clone(), log.clone());
            running.push(std::thread::spawn(move || {
                c.run_ref(
                    (log, i as u32 + 1),
                    |_: &Client, (log, id): (Proclet<Log>, u32)| {
                        let mut errors = Vec::new();
                        for s in 0..PER_CLIENT {
                            if let Err(e) =
                                log.run((id, s), |l: &mut Log, t: (u32, u32)| l.tokens.push(t))
                            {
                                errors.push(e.to_string());
                            }
                        }
                        errors
                    },
                )
            }));
        }
        let driver_log = log.clone();
        let driver_calls = std::thread::spawn(move || {
            let mut errors = Vec::new();
            for s in 0..PER_CLIENT {
                if let Err(e) =
                    driver_log.run((99, s), |l: &mut Log, t: (u32, u32)| l.tokens.push(t))
                {
                    errors.push(e.to_string());
                }
            }
            errors
        });
        // Move it around while the calls go on.
        let mut moves = 0;
        let start = Instant::now();
        while !driver_calls.is_finished() || running.iter().any(|r| !r.is_finished()) || moves < 6 {
            let to = nodes[(moves + 1) % nodes.len()];
            let stats = cluster.move_proclet(log.id(), to).unwrap();
            assert!(stats.micros > 0);
            moves += 1;
            assert_eq!(location(&log), to);
            std::thread::sleep(Duration::from_millis(3));
            assert!(start.elapsed() < Duration::from_secs(60));
        }
        let mut all_errors: Vec<String> = driver_calls.join().unwrap();
        for r in running {
            all_errors.extend(r.join().unwrap().unwrap());
        }
        assert!(all_errors.is_empty(), "callers saw errors: {all_errors:?}");
        let tokens = log.run_ref((), |l: &Log, ()| l.tokens.clone()).unwrap();
        let clients_n = clients.len() as u32 + 1;
        assert_eq!(
            tokens.len() as u32,
            clients_n * PER_CLIENT,
            "lost or duplicated calls"
        );
        let mut seen: HashMap<u32, Vec<u32>> = HashMap::new();
        for (id, s) in tokens {
            seen.entry(id).or_default().push(s);
        }
        for (id, seqs) in seen {
            // Each client's calls ran exactly once and in its order.
            assert_eq!(seqs, (0..PER_CLIENT).collect::<Vec<_>>(), "client {id}");
        }
        assert!(moves >= 6);
    });
}

#[derive(Serialize, Deserialize, Default)]
struct Counter {
    n: u64,
}

#[test]
fn a_closure_calling_a_moving_proclet_while_its_own_proclet_moves() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(3, "cpu=1,mem=512MiB");
        let inner = Proclet::builder(Kind::Memory)
            .on(nodes[1])
            .create((), |()| Counter::default())
            .unwrap();
        let outer = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create((), |()| Counter::default())
            .unwrap();
        // Each outer call makes 20 nested calls into `inner`.
        let (o, i) = (outer.clone(), inner.clone());
        let caller = std::thread::spawn(move || {
            let mut total = 0;
            for _ in 0..60 {
                total += o
                    .run(i.clone(), |c: &mut Counter, inner: Proclet<Counter>| {
                        let mut last = 0;
                        for _ in 0..20 {
                            last = inner
                                .run((), |x: &mut Counter, ()| {
                                    x.n += 1;
                                    x.n
                                })
                                .expect("nested call");
                        }
                        c.n += 1;
                        last
                    })
                    .map(|_| 1)
                    .unwrap_or(0);
            }
            total
        });
        let mut k = 0;
        while !caller.is_finished() {
            cluster
                .move_proclet(inner.id(), nodes[(k + 2) % 3])
                .unwrap();
            cluster.move_proclet(outer.id(), nodes[k % 3]).unwrap();
            k += 1;
        }
        assert_eq!(caller.join().unwrap(), 60, "every outer call succeeded");
        assert!(k >= 2, "moves happened during the calls");
        assert_eq!(outer.run_ref((), |c: &Counter, ()| c.n).unwrap(), 60);
        assert_eq!(inner.run_ref((), |c: &Counter, ()| c.n).unwrap(), 1200);
    });
}

#[test]
fn large_byte_and_structured_states_move_intact() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=1GiB");
        let bytes = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(16usize << 20, |n: usize| {
                (0..n)
                    .map(|i| (i * 7 + i / 4096) as u8)
                    .collect::<Vec<u8>>()
            })
            .unwrap();
        let before = bytes.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap();
        // A structured state, several chunks long, encoded while it streams.
        let table = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(200_000u64, |n: u64| {
                (0..n)
                    .map(|i| (i, format!("value-{i}")))
                    .collect::<HashMap<u64, String>>()
            })
            .unwrap();
        for round in 0..3 {
            let to = nodes[(round + 1) % 2];
            let s = cluster.move_proclet(bytes.id(), to).unwrap();
            assert_eq!(s.bytes, 16 << 20);
            let t = cluster.move_proclet(table.id(), to).unwrap();
            assert!(t.bytes > 2 << 20, "encoded table: {} bytes", t.bytes);
            assert_eq!(bytes.location().unwrap(), to);
            assert_eq!(
                bytes.run_ref((), |v: &Vec<u8>, ()| checksum(v)).unwrap(),
                before
            );
            let ok = table
                .run_ref((), |m: &HashMap<u64, String>, ()| {
                    m.len() == 200_000 && (0..200_000u64).all(|i| m[&i] == format!("value-{i}"))
                })
                .unwrap();
            assert!(ok, "table intact after move {round}");
        }
    });
}

/// A name whose `Deserialize` borrows its text from the input: a state of these decodes
/// only from one contiguous buffer, whatever chunks it travelled in.
#[derive(serde::Serialize, PartialEq, Debug, Clone)]
struct Name(String);

impl<'de> serde::Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s: &'de str = serde::Deserialize::deserialize(d)?;
        Ok(Name(s.to_string()))
    }
}

#[test]
fn a_state_that_borrows_while_decoding_moves_intact() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=1GiB");
        let names = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .create(100_000u32, |n: u32| {
                (0..n)
                    .map(|i| Name(format!("name-{i}")))
                    .collect::<Vec<Name>>()
            })
            .unwrap();
        for round in 0..2 {
            let to = nodes[(round + 1) % 2];
            let s = cluster.move_proclet(names.id(), to).unwrap();
            assert!(s.bytes > 1 << 20, "several chunks: {} bytes", s.bytes);
            let ok = names
                .run_ref((), |v: &Vec<Name>, ()| {
                    v.len() == 100_000
                        && v.iter()
                            .enumerate()
                            .all(|(i, n)| n.0 == format!("name-{i}"))
                })
                .unwrap();
            assert!(ok, "intact after move {round}");
        }
    });
}

#[test]
fn pinned_proclets_do_not_move() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        let p = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .pinned()
            .create((), |()| Counter::default())
            .unwrap();
        match cluster.move_proclet(p.id(), nodes[1]) {
            Err(CallError::Refused(m)) => assert!(m.contains("pinned"), "{m}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(p.location().unwrap(), nodes[0]);
        assert_eq!(
            p.run((), |c: &mut Counter, ()| {
                c.n += 1;
                c.n
            })
            .unwrap(),
            1
        );
    });
}

#[test]
fn range_job_splits_at_an_item_boundary_when_its_piece_moves() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(2, "cpu=1,mem=256MiB");
        // ~2 ms per item, 1000 items: 2 s of work in one piece.
        let job = RangeJob::start(0..1000, 1, 2000u64, |spin_us: &u64, i: u64| {
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(*spin_us) {
                std::hint::black_box(i);
            }
            i * i
        })
        .unwrap();
        let piece = job.proclets()[0];
        let mut homes = Vec::new();
        // Let it start, then move it twice while it runs.
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(300));
            let from = cluster.locate(piece).unwrap();
            let to = if from == nodes[0] { nodes[1] } else { nodes[0] };
            let done_before = job.done_items();
            cluster.move_proclet(piece, to).unwrap();
            homes.push(to);
            assert!(done_before < 1000, "the move happened mid-job");
        }
        let yields = job.yields();
        let results = job.join().unwrap();
        assert_eq!(results, (0..1000u64).map(|i| i * i).collect::<Vec<_>>());
        assert!(
            yields >= 2,
            "the worker stopped at item boundaries: {yields}"
        );
    });
}

#[derive(Serialize, Deserialize)]
struct Blob {
    data: Vec<u8>,
}

impl Footprint for Blob {
    fn footprint(&self) -> u64 {
        self.data.footprint()
    }
}

#[test]
fn accounting_reports_footprints_and_cpu_per_proclet() {
    bounded(LIMIT, || {
        let (cluster, nodes) = cluster(1, "cpu=1,mem=512MiB");
        let blob = Proclet::builder(Kind::Memory)
            .on(nodes[0])
            .footprint()
            .create(8usize << 20, |n: usize| Blob { data: vec![1; n] })
            .unwrap();
        let busy = Proclet::builder(Kind::Compute)
            .on(nodes[0])
            .create((), |()| Counter::default())
            .unwrap();
        let b2 = busy.clone();
        let spinner = std::thread::spawn(move || {
            b2.run((), |_c: &mut Counter, ()| {
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(1500) {
                    std::hint::black_box(0u64);
                }
            })
        });
        std::thread::sleep(Duration::from_millis(1200));
        let info = cluster
            .nodes()
            .unwrap()
            .into_iter()
            .find(|n| n.id == nodes[0])
            .unwrap();
        let u = &info.usage;
        let b = u
            .top
            .iter()
            .find(|p| p.id == blob.id())
            .expect("blob listed");
        assert!(
            b.mem_bytes >= 8 << 20 && b.mem_bytes < (8 << 20) + 4096,
            "{b:?}"
        );
        let s = u
            .top
            .iter()
            .find(|p| p.id == busy.id())
            .expect("spinner listed");
        // It uses what the machine gives its node (a whole core when idle, less when
        // another process competes for the CPU): the accounting charges most of the
        // node's CPU to it, whatever that is.
        assert!(
            s.cores > 0.02 && s.cores >= 0.3 * u.cores_busy,
            "a spinning proclet is charged most of its node's CPU ({} cores busy): {s:?}",
            u.cores_busy
        );
        assert!(u.proclet_bytes >= 8 << 20);
        assert_eq!(u.mem_budget, 512 << 20);
        spinner.join().unwrap().unwrap();
    });
}

#[test]
fn a_node_over_its_memory_budget_sheds_proclets_to_nodes_with_room() {
    bounded(LIMIT, || {
        // Node 0 has a 176 MiB budget; 32 MiB must stay free. Filling it with 10 × 16 MiB
        // puts it under pressure: it moves proclets to the big nodes until it is not
        // (at least two moves: one still leaves less than 32 MiB free).
        let c = granule::Cluster::builder()
            .nodes("cpu=1,mem=176MiB;cpu=1,mem=2GiB;cpu=1,mem=2GiB")
            .unwrap()
            .start()
            .unwrap();
        // Nodes register in any order: find the small one by its spec.
        let small = c
            .nodes()
            .unwrap()
            .into_iter()
            .find(|n| n.spec.mem_bytes == 176 << 20)
            .unwrap()
            .id;
        let mut blobs = Vec::new();
        for i in 0..10u8 {
            let p = Proclet::builder(Kind::Memory)
                .on(small)
                .create((16usize << 20, i), |(n, i): (usize, u8)| vec![i; n])
                .unwrap();
            blobs.push(p);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = c.nodes().unwrap();
            let s = info.iter().find(|n| n.id == small).unwrap();
            let moved = s.usage.moves_out;
            if moved >= 2 && !s.usage.mem_pressure {
                break;
            }
            assert!(Instant::now() < deadline, "node never shed: {:?}", s.usage);
            std::thread::sleep(Duration::from_millis(100));
        }
        // Nothing lost: every blob answers with its content, wherever it is.
        let mut away = 0;
        for (i, p) in blobs.iter().enumerate() {
            let ok = p
                .run_ref(i as u8, |v: &Vec<u8>, i: u8| {
                    v.len() == 16 << 20 && v.iter().all(|b| *b == i)
                })
                .unwrap();
            assert!(ok);
            if p.location().unwrap() != small {
                away += 1;
            }
        }
        assert!(away >= 2, "{away} blobs moved away");
    });
}

#[test]
fn placement_refuses_with_no_capacity_only_when_no_node_has_room() {
    bounded(LIMIT, || {
        let (_c, _nodes) = cluster(2, "cpu=1,mem=128MiB");
        // Fits somewhere: placed.
        let ok = Proclet::builder(Kind::Memory)
            .mem_hint(16 << 20)
            .create((), |()| Counter::default());
        assert!(ok.is_ok());
        // Fits nowhere: a typed error, nothing created.
        match Proclet::builder(Kind::Memory)
            .mem_hint(1 << 30)
            .create((), |()| Counter::default())
        {
            Err(CallError::NoCapacity(m)) => assert!(m.contains("room"), "{m}"),
            other => panic!("expected NoCapacity, got {:?}", other.map(|p| p.id())),
        }
    });
}
