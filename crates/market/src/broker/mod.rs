//! The broker's logic, free of I/O: producers and their availability predictors,
//! placement, the FIFO queue, leases, reputation and pricing. The server
//! ([`crate::server`]) feeds it messages and the clock (`now_ms`, milliseconds since the
//! Unix epoch, always passed in) and carries out the [`Action`]s it returns.
//!
//! Definitions the rest relies on:
//! - A producer's **availability** is `free_slabs + leased_slabs` of its last report (the
//!   slabs it has harvested); its predictor ([`predict::Predictor`]) models that series.
//! - A producer's **free slabs** are the reported `free_slabs` minus the slabs of its
//!   leases the report did not count yet: tentative leases (placed, store not opened) and
//!   leases opened since that report. A report counts every lease opened before it.
//! - A request may take from a producer at most its free slabs and at most the predicted
//!   lowest availability over the lease (capped at the prediction horizon, less the
//!   predictor's safety margin) minus the slabs already leased there: that keeps early
//!   revocations rare.
//! - **Reputation** is `(ok + 1) / (ok + 1 + lost)`: `ok` counts leases that ended as
//!   agreed (expired or released), `lost` leases revoked early or lost with the producer
//!   (a shrunk LRU lease counts the fraction of its bytes evicted).
//! - The **queue** is FIFO with backfill: each tick serves queued requests in arrival
//!   order, and a later one may take what an earlier one cannot use (it needs more than
//!   is free). A request's remainder after a partial placement waits with a minimum of
//!   one slab; a request placed not at all waits whole, with its own minimum.
//! - The **demand** the pricing sees is counted per consumer, not per request: at the end
//!   of each price period every consumer bids once, at the budget of its latest request,
//!   for the slabs it holds (leases live or being opened), the slabs its queued requests
//!   still wait for, and what its latest request got neither at once nor in the queue
//!   (priced out, or no room and no wait) while that request is recent
//!   ([`BID_KEEP_PERIODS`] price periods). A consumer that retries while priced out thus
//!   weighs as much as one that holds its leases and renews, however often it retries.

pub mod place;
pub mod predict;
pub mod price;

pub use place::Candidate;
pub use predict::{ArFit, Predictor};
pub use price::{FixedPrice, Pricing, RevenueSearch};

use granule_wire::market::{
    EvictionMode, HeldLease, LeaseGrant, LeaseId, LeaseView, MarketView, PlacementWeights,
    ProducerId, ProducerState, ProducerView,
};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Prices kept for the views.
const PRICE_HISTORY: usize = 2048;
/// How long a finished ticket waits to be collected before it is forgotten.
const TICKET_KEEP_MS: u64 = 600_000;
/// Price periods an unmet request keeps counting as demand (see the module doc): a
/// consumer still wanting memory asks again well within it.
pub const BID_KEEP_PERIODS: u64 = 3;

/// What [`Broker::collect`] returns: the grants made since, and what the request still
/// waits for (ticket, slabs), if anything.
pub type Collected = (Vec<LeaseGrant>, Option<(u64, u32)>);

/// The broker's settings (see [`BrokerConfig::from_market`]).
#[derive(Clone, Debug)]
pub struct BrokerConfig {
    pub slab_bytes: u64,
    pub default_lease_ms: u64,
    pub report_interval_ms: u64,
    /// A producer silent this long is treated as gone (its leases lost).
    pub producer_timeout_ms: u64,
    /// Reference price per slab-hour (e.g. from a spot instance's $/GiB-hour).
    pub spot_price: f64,
    /// How often the price moves.
    pub price_period_ms: u64,
    /// Δp as a fraction of the current price.
    pub price_step: f64,
    pub refit_period_ms: u64,
    /// p of ARIMA(p,1,0).
    pub ar_order: usize,
    pub prediction_horizon_ms: u64,
    pub max_queue: usize,
}

impl BrokerConfig {
    /// From the `[market]` configuration (the spot price there is per GiB-hour; here it is
    /// per slab-hour).
    pub fn from_market(m: &granule_config::Market) -> BrokerConfig {
        let ms = |d: std::time::Duration| d.as_millis().min(u64::MAX as u128) as u64;
        BrokerConfig {
            slab_bytes: m.slab,
            default_lease_ms: ms(m.lease_time),
            report_interval_ms: ms(m.report_interval),
            producer_timeout_ms: ms(m.producer_timeout),
            spot_price: m.spot_price * m.slab as f64 / (1u64 << 30) as f64,
            price_period_ms: ms(m.price_period),
            price_step: m.price_step,
            refit_period_ms: ms(m.refit_period),
            ar_order: m.ar_order as usize,
            prediction_horizon_ms: ms(m.prediction_horizon),
            max_queue: m.max_queue as usize,
        }
    }
}

/// What a consumer asks for.
#[derive(Clone, Debug)]
pub struct Request {
    pub consumer: String,
    pub slabs: u32,
    pub min_slabs: u32,
    /// 0: the default lease time.
    pub lease_ms: u64,
    /// The most it pays per slab-hour.
    pub budget: f64,
    pub weights: Option<PlacementWeights>,
    pub mode: EvictionMode,
    /// How long what cannot be placed now may wait in the queue (0: not at all).
    pub wait_ms: u64,
}

/// A tentative lease: the server asks the producer to open a store, then calls
/// [`Broker::opened`] (or [`Broker::open_failed`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub lease: LeaseId,
    pub producer: ProducerId,
    pub consumer: String,
    pub slabs: u32,
    pub bytes: u64,
    pub price: f64,
    pub expires_unix_ms: u64,
    pub mode: EvictionMode,
    /// Some when it serves a queued request.
    pub ticket: Option<u64>,
}

/// What [`Broker::request`] placed at once, and the ticket of what waits.
#[derive(Clone, Debug, Default)]
pub struct RequestOutcome {
    pub placements: Vec<Placement>,
    /// (ticket, slabs still wanted).
    pub pending: Option<(u64, u32)>,
}

/// What the server must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Open(Placement),
    Close {
        producer: ProducerId,
        lease: LeaseId,
    },
    Extend {
        producer: ProducerId,
        lease: LeaseId,
        expires_unix_ms: u64,
        price: f64,
    },
    Notify {
        consumer: String,
        lease: LeaseId,
        grace_ms: u64,
        reason: String,
    },
}

/// Why the broker refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum BrokerError {
    #[error("no lease {0}")]
    UnknownLease(LeaseId),
    #[error("no producer {0}")]
    UnknownProducer(ProducerId),
    #[error("no queued request with ticket {0}")]
    UnknownTicket(u64),
    #[error("lease {lease} is not producer {producer}'s")]
    NotYours {
        lease: LeaseId,
        producer: ProducerId,
    },
    #[error("the sender does not hold lease {0} (its proof does not match the lease's secret)")]
    NotHolder(LeaseId),
    #[error("budget {budget} is below the current price {price} per slab-hour")]
    BelowPrice { budget: f64, price: f64 },
    #[error("{0}")]
    Invalid(String),
}

struct Producer {
    id: ProducerId,
    name: String,
    host: String,
    slab_bytes: u64,
    state: ProducerState,
    connected: bool,
    last_seen_ms: u64,
    predictor: Predictor,
    ok: f64,
    lost: f64,
    latency_ms: f64,
}

impl Producer {
    fn reputation(&self) -> f64 {
        (self.ok + 1.0) / (self.ok + 1.0 + self.lost)
    }
    fn availability(&self) -> f64 {
        self.state.free_slabs as f64 + self.state.leased_slabs as f64
    }
}

struct Lease {
    producer: ProducerId,
    consumer: String,
    slabs: u32,
    bytes: u64,
    price: f64,
    expires: u64,
    mode: EvictionMode,
    ticket: Option<u64>,
    /// The store is open.
    live: bool,
    /// A producer report counted it.
    reflected: bool,
    store_addr: String,
    /// What a renewal or release must show: the hash of the lease's secret (see
    /// [`holder_proof`]), known once the store is open.
    proof: Option<String>,
}

/// What the holder of a lease shows the broker to renew or release it: the hex BLAKE3
/// hash of the lease's secret. Only the consumer the grant went to knows the secret; the
/// broker keeps the hash, not the secret.
pub fn holder_proof(secret: &str) -> String {
    blake3::hash(secret.as_bytes()).to_hex().to_string()
}

/// A request waiting in (or served from) the queue.
struct Ticket {
    consumer: String,
    /// Slabs still to place.
    remaining: u32,
    /// Slabs placed, store not yet opened.
    outstanding: u32,
    min_slabs: u32,
    lease_ms: u64,
    budget: f64,
    weights: Option<PlacementWeights>,
    mode: EvictionMode,
    deadline_ms: u64,
    in_queue: bool,
    grants: Vec<LeaseGrant>,
    /// When it stopped waiting (filled or timed out) with nothing outstanding.
    done_ms: Option<u64>,
}

/// A consumer's latest request, for the demand the pricing sees (see the module doc).
struct ConsumerBid {
    budget: f64,
    /// Slabs it got neither at once nor in the queue.
    unmet: u64,
    at_ms: u64,
}

/// The broker (see the module doc).
pub struct Broker {
    cfg: BrokerConfig,
    pricing: Box<dyn Pricing>,
    producers: BTreeMap<ProducerId, Producer>,
    by_name: HashMap<String, ProducerId>,
    leases: BTreeMap<LeaseId, Lease>,
    tickets: HashMap<u64, Ticket>,
    queue: VecDeque<u64>,
    next_lease: LeaseId,
    next_producer: ProducerId,
    next_ticket: u64,
    prices: VecDeque<(u64, f64)>,
    last_price_ms: Option<u64>,
    last_refit_ms: Option<u64>,
    /// This price period: slabs requested at the price or above.
    period_demand: u64,
    /// Each consumer's latest request (budget, unmet slabs).
    bids: HashMap<String, ConsumerBid>,
    /// Notifications found outside `tick` (leases a re-registering producer no longer
    /// holds), handed out by the next `tick`.
    notices: Vec<Action>,
}

impl Broker {
    /// `lease_base`: lease ids start above it (the server passes its start time << 20 so
    /// ids stay unique across broker restarts).
    pub fn new(cfg: BrokerConfig, lease_base: u64) -> Broker {
        let pricing = Box::new(RevenueSearch::new(cfg.spot_price, cfg.price_step));
        Broker::with_pricing(cfg, lease_base, pricing)
    }

    pub fn with_pricing(cfg: BrokerConfig, lease_base: u64, pricing: Box<dyn Pricing>) -> Broker {
        Broker {
            cfg,
            pricing,
            producers: BTreeMap::new(),
            by_name: HashMap::new(),
            leases: BTreeMap::new(),
            tickets: HashMap::new(),
            queue: VecDeque::new(),
            next_lease: lease_base.saturating_add(1),
            next_producer: 1,
            next_ticket: 1,
            prices: VecDeque::new(),
            last_price_ms: None,
            last_refit_ms: None,
            period_demand: 0,
            bids: HashMap::new(),
            notices: Vec::new(),
        }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.cfg
    }

    /// Register or re-register (same name → same id). `held` rebuilds leases after a
    /// broker restart; leases the broker had on this producer that it no longer holds are
    /// dropped (their consumers are notified at the next `tick`).
    pub fn producer_hello(
        &mut self,
        now_ms: u64,
        name: &str,
        host: &str,
        slab_bytes: u64,
        state: ProducerState,
        held: Vec<HeldLease>,
    ) -> ProducerId {
        let id = match self.by_name.get(name) {
            Some(&id) => id,
            None => {
                let id = self.next_producer;
                self.next_producer += 1;
                self.by_name.insert(name.to_string(), id);
                id
            }
        };
        let cfg = &self.cfg;
        let p = self.producers.entry(id).or_insert_with(|| Producer {
            id,
            name: name.to_string(),
            host: String::new(),
            slab_bytes: 0,
            state: ProducerState::default(),
            connected: true,
            last_seen_ms: now_ms,
            predictor: Predictor::new(
                cfg.ar_order,
                cfg.report_interval_ms,
                cfg.prediction_horizon_ms,
            ),
            ok: 0.0,
            lost: 0.0,
            latency_ms: 0.0,
        });
        p.host = host.to_string();
        p.slab_bytes = if slab_bytes > 0 {
            slab_bytes
        } else {
            cfg.slab_bytes
        };
        p.state = state;
        p.connected = true;
        p.last_seen_ms = now_ms;
        let avail = p.availability();
        p.predictor.observe(now_ms, avail);
        let slab = p.slab_bytes;

        // Leases it no longer serves are gone; live ones it lists are rebuilt.
        let held_ids: std::collections::HashSet<LeaseId> = held.iter().map(|h| h.lease).collect();
        let stale: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(lid, l)| l.producer == id && l.live && !held_ids.contains(lid))
            .map(|(lid, _)| *lid)
            .collect();
        for lid in stale {
            if let Some(l) = self.leases.remove(&lid) {
                if let Some(p) = self.producers.get_mut(&id) {
                    p.lost += 1.0;
                }
                self.notices.push(Action::Notify {
                    consumer: l.consumer,
                    lease: lid,
                    grace_ms: 0,
                    reason: "the producer restarted without this lease's store".into(),
                });
            }
        }
        for h in held {
            self.next_lease = self.next_lease.max(h.lease.saturating_add(1));
            let l = self.leases.entry(h.lease).or_insert_with(|| Lease {
                producer: id,
                consumer: h.consumer.clone(),
                slabs: h.slabs,
                bytes: h.slabs as u64 * slab,
                price: h.price,
                expires: h.expires_unix_ms,
                mode: h.mode,
                ticket: None,
                live: true,
                reflected: true,
                store_addr: h.store_addr.clone(),
                proof: None,
            });
            l.producer = id;
            l.consumer = h.consumer;
            l.slabs = h.slabs;
            l.bytes = h.slabs as u64 * slab;
            l.expires = h.expires_unix_ms;
            l.price = h.price;
            l.mode = h.mode;
            l.live = true;
            l.reflected = true;
            l.store_addr = h.store_addr;
            l.proof = Some(h.proof);
        }
        id
    }

    /// A periodic report: the new state, and bytes the producer's LRU stores evicted
    /// because it took memory back (a fraction of a lost lease each, for reputation).
    pub fn producer_report(
        &mut self,
        now_ms: u64,
        producer: ProducerId,
        state: ProducerState,
        shrunk: &[(LeaseId, u64)],
    ) -> Result<(), BrokerError> {
        let p = self
            .producers
            .get_mut(&producer)
            .ok_or(BrokerError::UnknownProducer(producer))?;
        p.state = state;
        p.connected = true;
        p.last_seen_ms = now_ms;
        let avail = p.availability();
        p.predictor.observe(now_ms, avail);
        if p.predictor.fit().is_none() {
            p.predictor.refit();
        }
        for &(lid, bytes) in shrunk {
            if let Some(l) = self.leases.get(&lid) {
                if l.producer == producer && l.bytes > 0 {
                    p.lost += (bytes as f64 / l.bytes as f64).min(1.0);
                }
            }
        }
        for l in self.leases.values_mut() {
            if l.producer == producer && l.live {
                l.reflected = true;
            }
        }
        Ok(())
    }

    /// Feed a producer's measured round-trip time (the latency term of placement).
    pub fn set_latency(&mut self, producer: ProducerId, latency_ms: f64) {
        if let Some(p) = self.producers.get_mut(&producer) {
            p.latency_ms = latency_ms.max(0.0);
        }
    }

    /// The producer's connection closed: its leases are lost; returns Notify actions for
    /// their consumers.
    pub fn producer_gone(&mut self, _now_ms: u64, producer: ProducerId) -> Vec<Action> {
        let Some(p) = self.producers.get_mut(&producer) else {
            return Vec::new();
        };
        p.connected = false;
        let lost: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.producer == producer)
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::new();
        for lid in lost {
            if let Some(l) = self.leases.remove(&lid) {
                if l.live {
                    p.lost += 1.0;
                    out.push(Action::Notify {
                        consumer: l.consumer,
                        lease: lid,
                        grace_ms: 0,
                        reason: format!("producer {} left", p.name),
                    });
                } else if let Some(t) = l.ticket {
                    Self::unplace(&mut self.tickets, &mut self.queue, _now_ms, t, l.slabs);
                }
            }
        }
        out
    }

    /// The producer revokes a lease early (needs memory back): reputation falls; returns
    /// the consumer's Notify.
    pub fn revoking(
        &mut self,
        _now_ms: u64,
        producer: ProducerId,
        lease: LeaseId,
        grace_ms: u64,
    ) -> Result<Vec<Action>, BrokerError> {
        let p = self
            .producers
            .get_mut(&producer)
            .ok_or(BrokerError::UnknownProducer(producer))?;
        match self.leases.get(&lease) {
            None => return Err(BrokerError::UnknownLease(lease)),
            Some(l) if l.producer != producer => {
                return Err(BrokerError::NotYours { lease, producer })
            }
            Some(_) => {}
        }
        let Some(l) = self.leases.remove(&lease) else {
            return Err(BrokerError::UnknownLease(lease));
        };
        p.lost += 1.0;
        Ok(vec![Action::Notify {
            consumer: l.consumer,
            lease,
            grace_ms,
            reason: format!("producer {} needs its memory back", p.name),
        }])
    }

    /// Why a request would get nothing, if it is malformed or priced out.
    pub fn validate(&self, req: &Request) -> Result<(), BrokerError> {
        if req.slabs == 0 {
            return Err(BrokerError::Invalid(
                "a request needs at least one slab".into(),
            ));
        }
        if req.min_slabs > req.slabs {
            return Err(BrokerError::Invalid(format!(
                "min_slabs {} is more than slabs {}",
                req.min_slabs, req.slabs
            )));
        }
        let price = self.pricing.price();
        // A NaN budget is below every price.
        if !matches!(
            req.budget.partial_cmp(&price),
            Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal)
        ) {
            return Err(BrokerError::BelowPrice {
                budget: req.budget,
                price,
            });
        }
        Ok(())
    }

    /// Place a request now as far as possible (at least `min_slabs`, else nothing) and
    /// queue the rest when it may wait. Malformed or priced-out requests get an empty
    /// outcome ([`Broker::validate`] says why).
    pub fn request(&mut self, now_ms: u64, req: Request) -> RequestOutcome {
        match self.validate(&req) {
            Ok(()) => {}
            Err(BrokerError::BelowPrice { .. }) => {
                self.note_bid(now_ms, &req.consumer, req.budget, req.slabs as u64);
                return RequestOutcome::default();
            }
            Err(_) => return RequestOutcome::default(),
        }
        self.period_demand += req.slabs as u64;
        let lease_ms = if req.lease_ms == 0 {
            self.cfg.default_lease_ms
        } else {
            req.lease_ms
        };
        let min = req.min_slabs.max(1);
        let weights = req.weights.unwrap_or_default();
        let plan = place::greedy(&self.ranked(lease_ms, &weights), req.slabs, min);
        let placed: u32 = plan.iter().map(|x| x.1).sum();
        let price = self.pricing.price();
        let placements: Vec<Placement> = plan
            .into_iter()
            .map(|(p, n)| self.place(now_ms, p, &req.consumer, n, lease_ms, price, req.mode, None))
            .collect();
        let rest = req.slabs - placed;
        let queued_min = if placed > 0 { 1 } else { min };
        let queues = rest > 0 && req.wait_ms > 0 && self.queue.len() < self.cfg.max_queue;
        // What neither placement nor the queue holds is unmet demand.
        let unmet = if queues { 0 } else { rest as u64 };
        self.note_bid(now_ms, &req.consumer, req.budget, unmet);
        let pending = if queues {
            let t = self.next_ticket;
            self.next_ticket += 1;
            self.tickets.insert(
                t,
                Ticket {
                    consumer: req.consumer,
                    remaining: rest,
                    outstanding: 0,
                    min_slabs: queued_min.min(rest),
                    lease_ms,
                    budget: req.budget,
                    weights: req.weights,
                    mode: req.mode,
                    deadline_ms: now_ms.saturating_add(req.wait_ms),
                    in_queue: true,
                    grants: Vec::new(),
                    done_ms: None,
                },
            );
            self.queue.push_back(t);
            Some((t, rest))
        } else {
            None
        };
        RequestOutcome {
            placements,
            pending,
        }
    }

    /// Remember a consumer's latest request for the demand the pricing sees.
    fn note_bid(&mut self, now_ms: u64, consumer: &str, budget: f64, unmet: u64) {
        let bid = ConsumerBid {
            budget,
            unmet,
            at_ms: now_ms,
        };
        match self.bids.get_mut(consumer) {
            Some(b) => *b = bid,
            None => {
                self.bids.insert(consumer.to_string(), bid);
            }
        }
    }

    /// End of a price period: every consumer bids once for its standing demand (see the
    /// module doc); consumers that hold nothing and asked nothing recently are forgotten.
    /// Returns the slabs under lease (live or being opened).
    fn standing_bids(&mut self, now_ms: u64) -> u64 {
        let keep = self.cfg.price_period_ms.saturating_mul(BID_KEEP_PERIODS);
        let recent = |b: &ConsumerBid| now_ms < b.at_ms.saturating_add(keep);
        // (slabs wanted, the highest price it holds a lease at); ordered, so the pricing
        // sees the same bids in the same order every run.
        let mut want: BTreeMap<&str, (u64, f64)> = BTreeMap::new();
        let mut leased = 0u64;
        for l in self.leases.values() {
            leased += l.slabs as u64;
            let w = want.entry(l.consumer.as_str()).or_insert((0, 0.0));
            w.0 += l.slabs as u64;
            w.1 = w.1.max(l.price);
        }
        for t in self.queue.iter().filter_map(|id| self.tickets.get(id)) {
            want.entry(t.consumer.as_str()).or_insert((0, 0.0)).0 += t.remaining as u64;
        }
        for (name, b) in self.bids.iter().filter(|(_, b)| recent(b)) {
            want.entry(name.as_str()).or_insert((0, 0.0)).0 += b.unmet;
        }
        for (name, (slabs, held_price)) in want {
            // A holder the broker has no request from (its leases were rebuilt after a
            // restart) pays at least its lease's price.
            let budget = self.bids.get(name).map_or(held_price, |b| b.budget);
            if slabs > 0 {
                self.pricing.bid(now_ms, budget, slabs);
            }
        }
        let holders: std::collections::HashSet<&str> =
            self.leases.values().map(|l| l.consumer.as_str()).collect();
        self.bids
            .retain(|name, b| recent(b) || holders.contains(name.as_str()));
        leased
    }

    /// Producers a lease of `lease_ms` could go on, cheapest first.
    fn ranked(&self, lease_ms: u64, w: &PlacementWeights) -> Vec<Candidate> {
        let held = self.commitments();
        let cands = self
            .producers
            .values()
            .filter(|p| p.connected)
            .map(|p| self.candidate(p, lease_ms, held.get(&p.id).copied().unwrap_or_default()))
            .collect();
        place::rank(cands, w)
    }

    /// Per producer: slabs of its leases (tentative and live) and of those its last
    /// report did not count, in one pass over the leases (placement needs them for every
    /// producer on every request; a pass per producer was quadratic at scale).
    fn commitments(&self) -> HashMap<ProducerId, (u64, u64)> {
        let mut held: HashMap<ProducerId, (u64, u64)> = HashMap::new();
        for l in self.leases.values() {
            let h = held.entry(l.producer).or_default();
            h.0 += l.slabs as u64;
            if !l.reflected {
                h.1 += l.slabs as u64;
            }
        }
        held
    }

    /// `(committed, unreflected)`: the producer's entry of [`Broker::commitments`].
    fn candidate(
        &self,
        p: &Producer,
        lease_ms: u64,
        (committed, unreflected): (u64, u64),
    ) -> Candidate {
        let free = (p.state.free_slabs as u64).saturating_sub(unreflected);
        let committed = committed.max(p.state.leased_slabs as u64 + unreflected);
        let predicted = p.predictor.predicted_min(lease_ms);
        let room = (predicted.floor() - committed as f64).max(0.0) as u64;
        Candidate {
            producer: p.id,
            placeable: free.min(room).min(u32::MAX as u64) as u32,
            free: free.min(u32::MAX as u64) as u32,
            predicted,
            capacity: p.availability(),
            bandwidth_bps: p.state.bandwidth_bps,
            cpu_idle_cores: p.state.cpu_idle_cores,
            latency_ms: p.latency_ms,
            reputation: p.reputation(),
        }
    }

    /// Slabs a lease of `lease_ms` could get on `producer` now (0 for an unknown or
    /// disconnected one).
    pub fn placeable(&self, producer: ProducerId, lease_ms: u64) -> u32 {
        match self.producers.get(&producer) {
            Some(p) if p.connected => {
                let held = self.commitments();
                let h = held.get(&producer).copied().unwrap_or_default();
                self.candidate(p, lease_ms, h).placeable
            }
            _ => 0,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        now_ms: u64,
        producer: ProducerId,
        consumer: &str,
        slabs: u32,
        lease_ms: u64,
        price: f64,
        mode: EvictionMode,
        ticket: Option<u64>,
    ) -> Placement {
        let id = self.next_lease;
        self.next_lease += 1;
        let slab = self
            .producers
            .get(&producer)
            .map_or(self.cfg.slab_bytes, |p| p.slab_bytes);
        let expires = now_ms.saturating_add(lease_ms);
        self.leases.insert(
            id,
            Lease {
                producer,
                consumer: consumer.to_string(),
                slabs,
                bytes: slabs as u64 * slab,
                price,
                expires,
                mode,
                ticket,
                live: false,
                reflected: false,
                store_addr: String::new(),
                proof: None,
            },
        );
        Placement {
            lease: id,
            producer,
            consumer: consumer.to_string(),
            slabs,
            bytes: slabs as u64 * slab,
            price,
            expires_unix_ms: expires,
            mode,
            ticket,
        }
    }

    /// The producer opened the store: the lease is live; returns the consumer's grant
    /// (also kept for [`Broker::collect`] when it serves a queued request). None for a
    /// lease that is unknown (lost meanwhile) or already open.
    pub fn opened(
        &mut self,
        _now_ms: u64,
        lease: LeaseId,
        store_addr: String,
        secret: String,
    ) -> Option<LeaseGrant> {
        let l = self.leases.get_mut(&lease)?;
        if l.live {
            return None;
        }
        l.live = true;
        l.reflected = false;
        l.store_addr = store_addr.clone();
        l.proof = Some(holder_proof(&secret));
        let p = self.producers.get(&l.producer)?;
        let grant = LeaseGrant {
            lease,
            producer: l.producer,
            producer_name: p.name.clone(),
            store_addr,
            secret,
            slabs: l.slabs,
            slab_bytes: p.slab_bytes,
            expires_unix_ms: l.expires,
            price: l.price,
            mode: l.mode,
        };
        if let Some(t) = l.ticket.and_then(|t| self.tickets.get_mut(&t)) {
            t.outstanding = t.outstanding.saturating_sub(l.slabs);
            t.grants.push(grant.clone());
        }
        Some(grant)
    }

    /// Opening failed: its slabs go back (for a queued request, they wait again).
    pub fn open_failed(&mut self, now_ms: u64, lease: LeaseId) {
        let Some(l) = self.leases.get(&lease) else {
            return;
        };
        if l.live {
            return;
        }
        if let Some(l) = self.leases.remove(&lease) {
            if let Some(t) = l.ticket {
                Self::unplace(&mut self.tickets, &mut self.queue, now_ms, t, l.slabs);
            }
        }
    }

    /// A queued request's tentative placement fell through: it wants those slabs again
    /// (back at the queue's head if it had left it and may still wait).
    fn unplace(
        tickets: &mut HashMap<u64, Ticket>,
        queue: &mut VecDeque<u64>,
        now_ms: u64,
        ticket: u64,
        slabs: u32,
    ) {
        if let Some(t) = tickets.get_mut(&ticket) {
            t.outstanding = t.outstanding.saturating_sub(slabs);
            t.remaining += slabs;
            if !t.in_queue && now_ms < t.deadline_ms {
                t.in_queue = true;
                t.done_ms = None;
                queue.push_front(ticket);
            }
        }
    }

    /// Grants made since for a queued request, and what it still waits for (None once
    /// done or timed out; the ticket is forgotten then).
    pub fn collect(&mut self, ticket: u64) -> Result<Collected, BrokerError> {
        let t = self
            .tickets
            .get_mut(&ticket)
            .ok_or(BrokerError::UnknownTicket(ticket))?;
        let grants = std::mem::take(&mut t.grants);
        let waiting = t.in_queue || t.outstanding > 0;
        if waiting {
            let wanted = if t.in_queue { t.remaining } else { 0 } + t.outstanding;
            Ok((grants, Some((ticket, wanted))))
        } else {
            self.tickets.remove(&ticket);
            Ok((grants, None))
        }
    }

    /// Extend a live lease by `lease_ms` (0: the default lease time) from its current end
    /// (or from now, if that passed), at the current price; returns (expires, price).
    pub fn renew(
        &mut self,
        now_ms: u64,
        lease: LeaseId,
        lease_ms: u64,
    ) -> Result<(u64, f64), BrokerError> {
        let price = self.pricing.price();
        let add = if lease_ms == 0 {
            self.cfg.default_lease_ms
        } else {
            lease_ms
        };
        let l = self
            .leases
            .get_mut(&lease)
            .ok_or(BrokerError::UnknownLease(lease))?;
        if !l.live {
            return Err(BrokerError::Invalid(format!(
                "lease {lease}'s store is not open yet"
            )));
        }
        l.expires = l.expires.max(now_ms).saturating_add(add);
        l.price = price;
        Ok((l.expires, price))
    }

    /// Whether `proof` shows its sender holds `lease` (see [`holder_proof`]). A renewal
    /// or release from anyone else is refused: lease ids are not secret.
    pub fn check_holder(&self, lease: LeaseId, proof: &str) -> Result<(), BrokerError> {
        let l = self
            .leases
            .get(&lease)
            .ok_or(BrokerError::UnknownLease(lease))?;
        match &l.proof {
            Some(p) if p == proof => Ok(()),
            Some(_) => Err(BrokerError::NotHolder(lease)),
            None => Err(BrokerError::Invalid(format!(
                "lease {lease}'s store is not open yet"
            ))),
        }
    }

    /// End a lease; returns the Close for its producer.
    pub fn release(&mut self, _now_ms: u64, lease: LeaseId) -> Result<Action, BrokerError> {
        let l = self
            .leases
            .remove(&lease)
            .ok_or(BrokerError::UnknownLease(lease))?;
        if let Some(p) = self.producers.get_mut(&l.producer) {
            p.ok += 1.0;
        }
        Ok(Action::Close {
            producer: l.producer,
            lease,
        })
    }

    /// Expire leases (Close + Notify), time out silent producers and queued requests,
    /// move the price, refit predictors, place queued requests (Open).
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        let mut out = std::mem::take(&mut self.notices);

        // Leases past their end.
        let ended: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.live && l.expires <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for lid in ended {
            if let Some(l) = self.leases.remove(&lid) {
                if let Some(p) = self.producers.get_mut(&l.producer) {
                    p.ok += 1.0;
                }
                out.push(Action::Close {
                    producer: l.producer,
                    lease: lid,
                });
                out.push(Action::Notify {
                    consumer: l.consumer,
                    lease: lid,
                    grace_ms: 0,
                    reason: "lease expired".into(),
                });
            }
        }

        // Producers silent too long.
        let silent: Vec<ProducerId> = self
            .producers
            .values()
            .filter(|p| {
                p.connected && now_ms >= p.last_seen_ms.saturating_add(self.cfg.producer_timeout_ms)
            })
            .map(|p| p.id)
            .collect();
        for id in silent {
            out.extend(self.producer_gone(now_ms, id));
        }

        // Queued requests past their wait; finished tickets nobody collected.
        let tickets = &mut self.tickets;
        self.queue.retain(|id| match tickets.get_mut(id) {
            Some(t) if t.deadline_ms <= now_ms => {
                t.in_queue = false;
                false
            }
            Some(_) => true,
            None => false,
        });
        for t in self.tickets.values_mut() {
            if !t.in_queue && t.outstanding == 0 && t.done_ms.is_none() {
                t.done_ms = Some(now_ms);
            }
        }
        self.tickets.retain(|_, t| {
            t.done_ms
                .is_none_or(|d| now_ms < d.saturating_add(TICKET_KEEP_MS))
        });

        // The price.
        match self.last_price_ms {
            None => {
                self.last_price_ms = Some(now_ms);
                self.prices.push_back((now_ms, self.pricing.price()));
            }
            Some(t) if now_ms >= t.saturating_add(self.cfg.price_period_ms) => {
                self.last_price_ms = Some(now_ms);
                let leased = self.standing_bids(now_ms);
                let held = self.commitments();
                let supply: u64 = self
                    .producers
                    .values()
                    .filter(|p| p.connected)
                    .map(|p| {
                        let h = held.get(&p.id).copied().unwrap_or_default();
                        self.candidate(p, self.cfg.default_lease_ms, h).placeable as u64
                    })
                    .sum();
                self.pricing
                    .observe(now_ms, self.period_demand, leased, supply);
                let price = self.pricing.update(now_ms);
                self.period_demand = 0;
                self.prices.push_back((now_ms, price));
                if self.prices.len() > PRICE_HISTORY {
                    self.prices.pop_front();
                }
            }
            Some(_) => {}
        }

        // Predictors.
        match self.last_refit_ms {
            Some(t) if now_ms < t.saturating_add(self.cfg.refit_period_ms) => {}
            _ => {
                self.last_refit_ms = Some(now_ms);
                for p in self.producers.values_mut() {
                    p.predictor.refit();
                }
            }
        }

        // The queue, in arrival order (a later request may use what an earlier cannot).
        let price = self.pricing.price();
        let order: Vec<u64> = self.queue.iter().copied().collect();
        for tid in order {
            let Some(t) = self.tickets.get(&tid) else {
                continue;
            };
            if t.budget < price || t.remaining == 0 {
                continue;
            }
            let weights = t.weights.unwrap_or_default();
            let ranked = self.ranked(t.lease_ms, &weights);
            if ranked.is_empty() {
                break;
            }
            let plan = place::greedy(&ranked, t.remaining, t.min_slabs);
            if plan.is_empty() {
                continue;
            }
            let (consumer, lease_ms, mode) = (t.consumer.clone(), t.lease_ms, t.mode);
            let mut placed = 0;
            for (p, n) in plan {
                placed += n;
                let pl = self.place(now_ms, p, &consumer, n, lease_ms, price, mode, Some(tid));
                out.push(Action::Open(pl));
            }
            if let Some(t) = self.tickets.get_mut(&tid) {
                t.remaining -= placed;
                t.outstanding += placed;
                t.min_slabs = 1;
                if t.remaining == 0 {
                    t.in_queue = false;
                }
            }
        }
        let tickets = &self.tickets;
        self.queue
            .retain(|id| tickets.get(id).is_some_and(|t| t.in_queue));
        out
    }

    /// The current price per slab-hour.
    pub fn price(&self) -> f64 {
        self.pricing.price()
    }

    /// The market, for status views.
    pub fn view(&self, _now_ms: u64) -> MarketView {
        let producers = self
            .producers
            .values()
            .map(|p| ProducerView {
                producer: p.id,
                name: p.name.clone(),
                addr: p.host.clone(),
                connected: p.connected,
                state: p.state.clone(),
                predicted_free_slabs: p.predictor.predicted_min(self.cfg.prediction_horizon_ms),
                reputation: p.reputation(),
            })
            .collect();
        let leases = self
            .leases
            .iter()
            .filter(|(_, l)| l.live)
            .map(|(id, l)| LeaseView {
                lease: *id,
                consumer: l.consumer.clone(),
                producer: l.producer,
                producer_name: self
                    .producers
                    .get(&l.producer)
                    .map(|p| p.name.clone())
                    .unwrap_or_default(),
                slabs: l.slabs,
                expires_unix_ms: l.expires,
                price: l.price,
                mode: l.mode,
            })
            .collect();
        let queued: Vec<&Ticket> = self
            .queue
            .iter()
            .filter_map(|id| self.tickets.get(id))
            .collect();
        MarketView {
            producers,
            leases,
            prices: self.prices.iter().copied().collect(),
            price: self.pricing.price(),
            queued_requests: queued.len() as u32,
            queued_slabs: queued.iter().map(|t| t.remaining).sum(),
        }
    }

    /// Mean absolute error of the ARIMA predictor and of the last-value predictor over all
    /// producers, at the prediction horizon, in slabs ((0, 0) before any was scored).
    pub fn predictor_errors(&self) -> (f64, f64) {
        let (mut a, mut l, mut n) = (0.0, 0.0, 0u64);
        for p in self.producers.values() {
            let (pa, pl, pn) = p.predictor.errors();
            a += pa;
            l += pl;
            n += pn;
        }
        if n == 0 {
            (0.0, 0.0)
        } else {
            (a / n as f64, l / n as f64)
        }
    }

    /// A producer's reputation (None: unknown).
    pub fn reputation(&self, producer: ProducerId) -> Option<f64> {
        self.producers.get(&producer).map(|p| p.reputation())
    }

    /// Leases known (tentative and live).
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// Where a live lease's store is (for a consumer that lost its grant).
    pub fn store_addr(&self, lease: LeaseId) -> Option<&str> {
        self.leases
            .get(&lease)
            .filter(|l| l.live)
            .map(|l| l.store_addr.as_str())
    }
}

#[cfg(test)]
mod tests;
