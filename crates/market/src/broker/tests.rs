//! The broker's unit tests: placement, the queue, leases, reputation, restarts.

use super::*;

const SLAB: u64 = 1 << 20;

fn cfg() -> BrokerConfig {
    BrokerConfig {
        slab_bytes: SLAB,
        default_lease_ms: 60_000,
        report_interval_ms: 1000,
        producer_timeout_ms: 5000,
        spot_price: 4.0,
        price_period_ms: 10_000,
        price_step: 0.1,
        refit_period_ms: 10_000,
        ar_order: 2,
        prediction_horizon_ms: 10_000,
        max_queue: 100,
    }
}

fn st(free: u32, leased: u32) -> ProducerState {
    ProducerState {
        free_slabs: free,
        leased_slabs: leased,
        cpu_idle_cores: 1.0,
        bandwidth_bps: 1 << 30,
        ..ProducerState::default()
    }
}

fn req(slabs: u32, min: u32, wait_ms: u64) -> Request {
    Request {
        consumer: "c".into(),
        slabs,
        min_slabs: min,
        lease_ms: 0,
        budget: 10.0,
        weights: None,
        mode: EvictionMode::NoEviction,
        wait_ms,
    }
}

/// A producer reporting a steady availability for `secs` seconds (so its predictor is
/// fit and its margin learned).
fn steady(b: &mut Broker, name: &str, free: u32, secs: u64) -> ProducerId {
    let id = b.producer_hello(0, name, "h", SLAB, st(free, 0), vec![]);
    for s in 1..=secs {
        b.producer_report(s * 1000, id, st(free, 0), &[])
            .expect("known");
    }
    id
}

/// Open every placement (as the server would on the producer's answer).
fn open_all(b: &mut Broker, now: u64, ps: &[Placement]) -> Vec<LeaseGrant> {
    ps.iter()
        .filter_map(|p| b.opened(now, p.lease, "h:1".into(), "s".into()))
        .collect()
}

#[test]
fn places_on_the_cheapest_producer_first() {
    let mut b = Broker::new(cfg(), 1000);
    let small = steady(&mut b, "small", 10, 60);
    let big = steady(&mut b, "big", 40, 60);
    let out = b.request(60_000, req(5, 5, 0));
    assert_eq!(out.placements.len(), 1);
    assert_eq!(
        out.placements[0].producer, big,
        "more free slabs costs less"
    );
    assert!(
        out.placements[0].lease > 1000,
        "lease ids start above the base"
    );
    assert_eq!(out.placements[0].bytes, 5 * SLAB);
    // A revocation on `big` makes `small` the better choice.
    let g = open_all(&mut b, 60_000, &out.placements);
    b.revoking(60_000, big, g[0].lease, 0).expect("its lease");
    let out = b.request(60_000, req(5, 5, 0));
    assert_eq!(out.placements[0].producer, small);
}

#[test]
fn partial_allocation_at_or_above_min_and_queue_for_the_rest() {
    let mut b = Broker::new(cfg(), 0);
    steady(&mut b, "a", 10, 60);
    steady(&mut b, "b", 6, 60);
    // 16 free, 30 wanted, at least 12: 16 placed, 14 queued.
    let out = b.request(60_000, req(30, 12, 5000));
    let placed: u32 = out.placements.iter().map(|p| p.slabs).sum();
    assert_eq!(placed, 16);
    assert!(out.placements.iter().all(|p| p.ticket.is_none()));
    assert_eq!(out.pending.map(|p| p.1), Some(14));
    // Below min: nothing placed, the whole request waits.
    let mut b = Broker::new(cfg(), 0);
    steady(&mut b, "a", 10, 60);
    let out = b.request(60_000, req(30, 20, 5000));
    assert!(out.placements.is_empty());
    assert_eq!(out.pending.map(|p| p.1), Some(30));
    // Below min and no waiting: nothing at all.
    let out = b.request(60_000, req(30, 20, 0));
    assert!(out.placements.is_empty() && out.pending.is_none());
}

#[test]
fn below_price_gets_nothing() {
    let mut b = Broker::new(cfg(), 0);
    steady(&mut b, "a", 10, 60);
    assert_eq!(b.price(), 1.0, "a quarter of spot");
    let mut r = req(1, 1, 5000);
    r.budget = 0.5;
    assert!(matches!(
        b.validate(&r),
        Err(BrokerError::BelowPrice { .. })
    ));
    let out = b.request(60_000, r);
    assert!(out.placements.is_empty() && out.pending.is_none());
    assert!(matches!(
        b.validate(&req(0, 0, 0)),
        Err(BrokerError::Invalid(_))
    ));
}

#[test]
fn unreported_leases_count_against_free_slabs() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 60);
    assert_eq!(b.placeable(a, 60_000), 10);
    let out = b.request(60_000, req(4, 4, 0));
    assert_eq!(b.placeable(a, 60_000), 6, "tentative");
    open_all(&mut b, 60_000, &out.placements);
    assert_eq!(b.placeable(a, 60_000), 6, "opened, not reported yet");
    // The producer's report now counts the lease: free 6, leased 4.
    b.producer_report(61_000, a, st(6, 4), &[]).expect("known");
    assert_eq!(b.placeable(a, 60_000), 6);
}

#[test]
fn falling_availability_limits_placement() {
    let mut b = Broker::new(cfg(), 0);
    let flat = steady(&mut b, "flat", 50, 120);
    // Availability falling by a slab a second: over a 10 s lease it loses ~10.
    let fall = b.producer_hello(0, "fall", "h", SLAB, st(200, 0), vec![]);
    for s in 1..=120u64 {
        b.producer_report(s * 1000, fall, st(200 - s as u32, 0), &[])
            .expect("known");
        if s % 10 == 0 {
            b.tick(s * 1000);
        }
    }
    assert_eq!(b.placeable(flat, 10_000), 50);
    let p = b.placeable(fall, 10_000);
    assert!(
        (60..=70).contains(&p),
        "predicted ~70 left at the lease's end, got {p}"
    );
}

#[test]
fn fifo_queue_serves_in_order_and_times_out() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 0, 60);
    let t1 = b
        .request(60_000, req(5, 5, 10_000))
        .pending
        .expect("queued")
        .0;
    let t2 = b
        .request(60_500, req(5, 5, 3000))
        .pending
        .expect("queued")
        .0;
    assert_eq!(b.view(60_500).queued_requests, 2);
    // Five slabs free up: the first request gets them.
    b.producer_report(61_000, a, st(5, 0), &[]).expect("known");
    let acts = b.tick(61_000);
    let opens: Vec<&Placement> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Open(p) => Some(p),
            _ => None,
        })
        .collect();
    assert_eq!(opens.len(), 1);
    assert_eq!(opens[0].ticket, Some(t1));
    let g = b.opened(61_000, opens[0].lease, "h:1".into(), "s".into());
    assert!(g.is_some());
    let (grants, pending) = b.collect(t1).expect("ticket");
    assert_eq!(grants.len(), 1);
    assert_eq!(pending, None, "done");
    assert!(matches!(b.collect(t1), Err(BrokerError::UnknownTicket(_))));
    // The second waits, then times out.
    assert_eq!(b.collect(t2).expect("ticket").1, Some((t2, 5)));
    b.tick(63_600);
    assert_eq!(b.collect(t2).expect("ticket"), (vec![], None));
    assert_eq!(b.view(63_600).queued_requests, 0);
}

#[test]
fn failed_open_puts_a_queued_request_back() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 0, 60);
    let t = b
        .request(60_000, req(3, 3, 10_000))
        .pending
        .expect("queued")
        .0;
    b.producer_report(61_000, a, st(3, 0), &[]).expect("known");
    let acts = b.tick(61_000);
    let Some(Action::Open(p)) = acts.iter().find(|a| matches!(a, Action::Open(_))) else {
        panic!("no open: {acts:?}");
    };
    assert_eq!(b.collect(t).expect("ticket").1, Some((t, 3)), "outstanding");
    b.open_failed(61_000, p.lease);
    assert_eq!(b.view(61_000).queued_requests, 1);
    assert_eq!(b.lease_count(), 0);
    let acts = b.tick(61_100);
    assert!(acts.iter().any(|a| matches!(a, Action::Open(_))));
}

#[test]
fn leases_expire_and_renew_at_the_current_price() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 60);
    let out = b.request(60_000, req(2, 2, 0));
    let g = open_all(&mut b, 60_000, &out.placements);
    assert_eq!(g[0].expires_unix_ms, 120_000);
    assert_eq!(g[0].price, 1.0);
    // Lots of demand with high budgets and little supply: the price rises.
    b.tick(60_000);
    for s in 1..=4u64 {
        let now = 60_000 + s * 10_000;
        for _ in 0..50 {
            let mut r = req(1, 1, 0);
            r.budget = 3.9;
            b.request(now - 1000, r);
        }
        b.producer_report(now, a, st(8, 2), &[]).expect("known");
        b.tick(now);
    }
    let price = b.price();
    assert!(price > 1.0, "{price}");
    let lease = g[0].lease;
    assert!(matches!(
        b.renew(100_000, 999_999, 0),
        Err(BrokerError::UnknownLease(_))
    ));
    // Extended from its end, at the new price.
    let (exp, p) = b.renew(100_000, lease, 5000).expect("live");
    assert_eq!((exp, p), (125_000, price));
    assert!(b
        .view(100_000)
        .leases
        .iter()
        .any(|l| l.lease == lease && l.price == price));
    b.producer_report(124_000, a, st(8, 2), &[]).expect("known");
    assert!(!b
        .tick(124_000)
        .contains(&Action::Close { producer: a, lease }));
    let acts = b.tick(125_000);
    assert!(acts.contains(&Action::Close { producer: a, lease }));
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::Notify { lease: l, .. } if *l == lease)));
    assert!(matches!(
        b.renew(125_001, lease, 1),
        Err(BrokerError::UnknownLease(_))
    ));
}

#[test]
fn release_closes_and_keeps_reputation() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 60);
    let out = b.request(60_000, req(2, 2, 0));
    let g = open_all(&mut b, 60_000, &out.placements);
    assert_eq!(
        b.release(60_000, g[0].lease),
        Ok(Action::Close {
            producer: a,
            lease: g[0].lease
        })
    );
    assert_eq!(b.reputation(a), Some(1.0));
    assert!(b.release(60_000, g[0].lease).is_err());
}

#[test]
fn early_revocations_lower_reputation() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 40, 60);
    let other = steady(&mut b, "other", 40, 60);
    assert_eq!(b.reputation(a), Some(1.0));
    let mut leases = vec![];
    for _ in 0..4 {
        let mut r = req(2, 2, 0);
        r.weights = Some(PlacementWeights {
            free_slabs: 0.0,
            reputation: 0.0,
            ..PlacementWeights::default()
        });
        let out = b.request(60_000, r);
        leases.extend(open_all(&mut b, 60_000, &out.placements));
    }
    let on_a: Vec<_> = leases.iter().filter(|g| g.producer == a).collect();
    assert!(on_a.len() >= 2, "{leases:?}");
    // One ended as agreed, one revoked: (1 + 1) / (1 + 1 + 1).
    b.release(60_000, on_a[0].lease).expect("live");
    let acts = b
        .revoking(60_000, a, on_a[1].lease, 500)
        .expect("its lease");
    assert!(matches!(&acts[0], Action::Notify { grace_ms: 500, .. }));
    assert!((b.reputation(a).unwrap_or(0.0) - 2.0 / 3.0).abs() < 1e-9);
    assert_eq!(b.reputation(other), Some(1.0));
    // A lease that is not its own.
    if let Some(g) = leases.iter().find(|g| g.producer == other) {
        assert!(matches!(
            b.revoking(60_000, a, g.lease, 0),
            Err(BrokerError::NotYours { .. })
        ));
    }
    assert!(b
        .view(60_000)
        .producers
        .iter()
        .any(|p| p.producer == a && p.reputation < 1.0));
}

#[test]
fn rebuilds_from_held_leases_after_a_restart() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 5);
    let out = b.request(5000, req(4, 4, 0));
    let g = open_all(&mut b, 5000, &out.placements);
    // The broker restarts: a new one, ids above a higher base.
    let mut b2 = Broker::new(cfg(), 1 << 40);
    let held = vec![HeldLease {
        lease: g[0].lease,
        consumer: "c".into(),
        slabs: 4,
        store_addr: "h:1".into(),
        expires_unix_ms: g[0].expires_unix_ms,
        price: g[0].price,
        mode: EvictionMode::NoEviction,
        proof: holder_proof(&g[0].secret),
    }];
    let a2 = b2.producer_hello(6000, "a", "h", SLAB, st(6, 4), held);
    // The restarted broker knows the holder again from the producer's report.
    assert!(b2
        .check_holder(g[0].lease, &holder_proof(&g[0].secret))
        .is_ok());
    assert!(matches!(
        b2.check_holder(g[0].lease, &holder_proof("guess")),
        Err(BrokerError::NotHolder(_))
    ));
    let view = b2.view(6000);
    assert_eq!(view.leases.len(), 1);
    assert_eq!(view.leases[0].lease, g[0].lease);
    assert_eq!(b2.store_addr(g[0].lease), Some("h:1"));
    // The existing lease keeps working: renew, and it counts against placement.
    assert!(b2.renew(6000, g[0].lease, 1000).is_ok());
    assert_eq!(
        b2.placeable(a2, 1000),
        5,
        "6 free, 4 leased of 10, less a tenth before a fit"
    );
    let out = b2.request(6000, req(1, 1, 0));
    assert!(out.placements[0].lease > 1 << 40);
    // Same name, same id; a re-hello without the lease drops it and tells the consumer.
    assert_eq!(
        b2.producer_hello(7000, "a", "h", SLAB, st(10, 0), vec![]),
        a2
    );
    let acts = b2.tick(7000);
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::Notify { lease, .. } if *lease == g[0].lease)));
    let _ = a;
}

#[test]
fn silent_producers_lose_their_leases() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 60);
    let out = b.request(60_000, req(2, 2, 0));
    open_all(&mut b, 60_000, &out.placements);
    assert!(b.tick(64_000).is_empty());
    let acts = b.tick(65_000);
    assert!(acts.iter().any(|x| matches!(x, Action::Notify { .. })));
    assert_eq!(b.placeable(a, 1000), 0);
    assert!(!b.view(65_000).producers[0].connected);
    assert!(b.reputation(a).unwrap_or(1.0) < 1.0);
    // It comes back under the same name.
    assert_eq!(
        b.producer_hello(66_000, "a", "h", SLAB, st(10, 0), vec![]),
        a
    );
    assert!(b.view(66_000).producers[0].connected);
}

#[test]
fn producer_gone_notifies_consumers() {
    let mut b = Broker::new(cfg(), 0);
    let a = steady(&mut b, "a", 10, 60);
    let out = b.request(60_000, req(2, 2, 0));
    let g = open_all(&mut b, 60_000, &out.placements);
    let acts = b.producer_gone(60_000, a);
    assert_eq!(acts.len(), 1);
    assert!(
        matches!(&acts[0], Action::Notify { lease, consumer, .. } if *lease == g[0].lease && consumer == "c")
    );
    assert!(b.producer_gone(60_000, 999).is_empty());
    assert!(matches!(
        b.producer_report(60_000, 999, st(1, 0), &[]),
        Err(BrokerError::UnknownProducer(999))
    ));
}

#[test]
fn config_from_market_converts_units() {
    let m = granule_config::Market::default();
    let c = BrokerConfig::from_market(&m);
    assert_eq!(c.slab_bytes, m.slab);
    assert_eq!(c.default_lease_ms, m.lease_time.as_millis() as u64);
    // Per GiB-hour → per slab-hour (64 MiB slabs: a sixteenth).
    assert!((c.spot_price - m.spot_price * m.slab as f64 / (1u64 << 30) as f64).abs() < 1e-15);
    assert_eq!(c.ar_order, m.ar_order as usize);
}

/// A fixed price that records the bids the broker hands it.
struct Recorder {
    price: f64,
    bids: std::sync::Arc<std::sync::Mutex<Vec<(f64, u64)>>>,
}

impl Pricing for Recorder {
    fn price(&self) -> f64 {
        self.price
    }
    fn observe(&mut self, _now_ms: u64, _demand: u64, _leased: u64, _supply: u64) {}
    fn bid(&mut self, _now_ms: u64, budget: f64, slabs: u64) {
        self.bids
            .lock()
            .expect("not poisoned")
            .push((budget, slabs));
    }
    fn update(&mut self, _now_ms: u64) -> f64 {
        self.price
    }
}

#[test]
fn each_consumer_bids_once_per_period_however_often_it_asks() {
    let bids = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let rec = Recorder {
        price: 1.0,
        bids: bids.clone(),
    };
    let mut b = Broker::with_pricing(cfg(), 0, Box::new(rec));
    let a = steady(&mut b, "a", 10, 60);
    b.tick(60_000);
    let ask = |name: &str, slabs: u32, min: u32, budget: f64, wait_ms: u64| Request {
        consumer: name.into(),
        budget,
        ..req(slabs, min, wait_ms)
    };
    // Holds 2 slabs; asks nothing more.
    let out = b.request(60_000, ask("rich", 2, 2, 10.0, 0));
    open_all(&mut b, 60_000, &out.placements);
    // Priced out, retrying twenty times.
    for i in 0..20 {
        assert!(b
            .request(60_000 + i * 100, ask("poor", 3, 1, 0.5, 5000))
            .placements
            .is_empty());
    }
    // Waits in the queue for 20 (only 8 are free).
    let out = b.request(61_000, ask("queued", 20, 20, 5.0, 60_000));
    assert_eq!(out.pending.map(|p| p.1), Some(20));
    for now in [65_000, 70_000] {
        b.producer_report(now, a, st(8, 2), &[]).expect("known");
    }
    b.tick(70_000);
    assert_eq!(
        *bids.lock().expect("not poisoned"),
        vec![(0.5, 3), (5.0, 20), (10.0, 2)],
        "one bid per consumer, in name order"
    );
    // Three periods after it last asked, the priced-out consumer no longer counts; the
    // holder and the one still queued do.
    for now in (75_000..=100_000).step_by(5000) {
        b.producer_report(now, a, st(8, 2), &[]).expect("known");
        if now % 10_000 == 0 {
            bids.lock().expect("not poisoned").clear();
            b.tick(now);
        }
    }
    assert_eq!(
        *bids.lock().expect("not poisoned"),
        vec![(5.0, 20), (10.0, 2)]
    );
}

#[test]
fn consumers_retrying_while_priced_out_do_not_drag_the_price_down() {
    // 100 consumers want one slab each, budgets evenly over 0..2, supply plenty: revenue
    // q × 100 (1 - q/2) peaks at q = 1. Those priced out ask five times per period;
    // counted per request, their bids would outweigh the holders' and hold the price low.
    let mut c = cfg();
    c.spot_price = 1.6;
    c.producer_timeout_ms = u64::MAX / 4;
    c.default_lease_ms = 3_600_000;
    let mut b = Broker::new(c, 0);
    steady(&mut b, "big", 1000, 60);
    b.tick(60_000);
    assert!((b.price() - 0.4).abs() < 1e-12);
    let budgets: Vec<f64> = (0..100).map(|i| 2.0 * (i as f64 + 0.5) / 100.0).collect();
    let mut held: Vec<Option<LeaseId>> = vec![None; 100];
    for period in 1..=80u64 {
        let start = 60_000 + (period - 1) * 10_000;
        // A holder whose budget the price passed lets its lease go.
        for (i, h) in held.iter_mut().enumerate() {
            if let Some(lease) = *h {
                if budgets[i] < b.price() {
                    b.release(start, lease).expect("held");
                    *h = None;
                }
            }
        }
        for retry in 0..5 {
            for (i, h) in held.iter_mut().enumerate() {
                if h.is_some() {
                    continue;
                }
                let r = Request {
                    consumer: format!("c{i}"),
                    budget: budgets[i],
                    ..req(1, 1, 0)
                };
                let out = b.request(start + 1 + retry * 1000, r);
                if let Some(g) = open_all(&mut b, start, &out.placements).first() {
                    *h = Some(g.lease);
                }
            }
        }
        b.tick(start + 10_000);
    }
    assert!((b.price() - 1.0).abs() < 0.15, "{}", b.price());
}
