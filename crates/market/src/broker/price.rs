//! Pricing: the [`Pricing`] trait the broker moves its price through, the default
//! [`RevenueSearch`] (start at a quarter of the spot reference price; each period move to
//! whichever of p, p(1-Δ), p(1+Δ) would have earned producers most against the demand
//! observed) and [`FixedPrice`] (a constant, for baselines and tests).
//!
//! Demand is observed through budgets: at the end of each period the broker bids once per
//! consumer, `slabs` at up to `budget` per slab-hour, for what that consumer holds or still
//! wants (see the broker's module doc: per consumer, not per request, so a consumer that
//! retries while priced out does not count once per retry), so the demand at any candidate
//! price q is the slabs bid at q or more. Supply is what could be leased: the slabs under
//! lease at the period's end plus what was still placeable. Both are exponentially
//! decayed sums over recent periods, so one quiet period does not swing the price.
//! Estimated revenue at q is `q × min(demand(q), supply)`.

/// How the broker sets its price per slab-hour.
pub trait Pricing: Send {
    /// The current price per slab-hour.
    fn price(&self) -> f64;
    /// The period's totals: slabs requested at the current price or above, slabs under
    /// lease at the period's end, and slabs still placeable then.
    fn observe(&mut self, now_ms: u64, demand_slabs: u64, leased_slabs: u64, supply_slabs: u64);
    /// One consumer's standing demand, once per period before `update` (see the module
    /// doc), whether or not its budget meets the price. Default: ignored.
    fn bid(&mut self, _now_ms: u64, _budget: f64, _slabs: u64) {}
    /// End of a period: move the price; returns the new one.
    fn update(&mut self, now_ms: u64) -> f64;
}

/// A constant price.
#[derive(Clone, Debug)]
pub struct FixedPrice(pub f64);

impl Pricing for FixedPrice {
    fn price(&self) -> f64 {
        self.0
    }
    fn observe(&mut self, _now_ms: u64, _demand: u64, _leased: u64, _supply: u64) {}
    fn update(&mut self, _now_ms: u64) -> f64 {
        self.0
    }
}

/// Weight a period's observations keep per period after it.
const DECAY: f64 = 0.6;
/// Bids kept at most (the oldest, lightest go first).
const MAX_BIDS: usize = 50_000;

/// The default pricing (see the module doc).
#[derive(Clone, Debug)]
pub struct RevenueSearch {
    price: f64,
    step: f64,
    min: f64,
    max: f64,
    /// (budget, weight in slabs), decayed.
    book: Vec<(f64, f64)>,
    /// This period's bids.
    fresh: Vec<(f64, f64)>,
    /// Decayed supply, in slabs.
    supply: f64,
    /// This period's observation, if any: (demand at price, leased, placeable).
    period: Option<(u64, u64, u64)>,
}

impl RevenueSearch {
    /// Start at a quarter of `spot` and move by `step` (a fraction of the price); the
    /// price stays within spot/1000 ..= spot × 100.
    pub fn new(spot: f64, step: f64) -> RevenueSearch {
        let spot = if spot.is_finite() && spot > 0.0 {
            spot
        } else {
            1.0
        };
        RevenueSearch {
            price: spot / 4.0,
            step: step.clamp(1e-4, 0.9),
            min: spot / 1000.0,
            max: spot * 100.0,
            book: Vec::new(),
            fresh: Vec::new(),
            supply: 0.0,
            period: None,
        }
    }

    /// Estimated revenue per period at price `q` against the decayed demand and supply.
    pub fn revenue_at(&self, q: f64) -> f64 {
        let demand: f64 = self.book.iter().filter(|b| b.0 >= q).map(|b| b.1).sum();
        q * demand.min(self.supply)
    }
}

impl Pricing for RevenueSearch {
    fn price(&self) -> f64 {
        self.price
    }

    fn observe(&mut self, _now_ms: u64, demand: u64, leased: u64, supply: u64) {
        let p = self.period.get_or_insert((0, 0, 0));
        p.0 += demand;
        p.1 += leased;
        p.2 += supply;
    }

    fn bid(&mut self, _now_ms: u64, budget: f64, slabs: u64) {
        if budget.is_finite() && slabs > 0 {
            self.fresh.push((budget, slabs as f64));
        }
    }

    fn update(&mut self, _now_ms: u64) -> f64 {
        let (demand, leased, placeable) = self.period.take().unwrap_or((0, 0, 0));
        for b in &mut self.book {
            b.1 *= DECAY;
        }
        self.book.retain(|b| b.1 > 1e-3);
        self.book.append(&mut self.fresh);
        if self.book.len() > MAX_BIDS {
            let cut = self.book.len() - MAX_BIDS;
            self.book.drain(..cut);
        }
        self.supply = self.supply * DECAY + (leased + placeable) as f64;
        let up = (self.price * (1.0 + self.step)).min(self.max);
        let down = (self.price * (1.0 - self.step)).max(self.min);
        if self.book.is_empty() {
            // No budgets seen: all that is known is whether demand at the price
            // exceeded what could be leased.
            if demand > leased + placeable {
                self.price = up;
            } else if demand == 0 {
                self.price = down;
            }
            return self.price;
        }
        let here = self.revenue_at(self.price);
        let (r_up, r_down) = (self.revenue_at(up), self.revenue_at(down));
        // Stay unless a neighbour is strictly better (ties keep the price steady).
        let eps = 1e-9 * here.abs().max(1e-12);
        if r_up > here + eps && r_up >= r_down {
            self.price = up;
        } else if r_down > here + eps {
            self.price = down;
        }
        self.price
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One period of `n` one-slab bids with budgets evenly over 0..2 (a linear demand
    /// curve: demand(q) = n (1 - q/2)).
    fn feed(p: &mut RevenueSearch, n: usize, supply: u64) {
        for i in 0..n {
            p.bid(0, 2.0 * (i as f64 + 0.5) / n as f64, 1);
        }
        let price = p.price();
        let demand = (0..n)
            .filter(|&i| 2.0 * (i as f64 + 0.5) / n as f64 >= price)
            .count() as u64;
        let leased = demand.min(supply);
        p.observe(0, demand, leased, supply - leased);
        p.update(0);
    }

    #[test]
    fn starts_at_a_quarter_of_spot() {
        assert_eq!(RevenueSearch::new(2.0, 0.05).price(), 0.5);
    }

    #[test]
    fn climbs_to_the_revenue_maximizing_price_of_a_linear_curve() {
        // Unconstrained supply: q n (1 - q/2) peaks at q = 1.
        let mut p = RevenueSearch::new(1.0, 0.05);
        let mut seen = vec![];
        for _ in 0..200 {
            feed(&mut p, 1000, 1_000_000);
            seen.push(p.price());
        }
        assert!(seen[5] > seen[0], "moves up first: {:?}", &seen[..10]);
        assert!(
            (p.price() - 1.0).abs() < 0.1,
            "settles near 1: {}",
            p.price()
        );
    }

    #[test]
    fn scarce_supply_pushes_the_price_up_to_clear() {
        // 100 slabs for 1000 bids: revenue q min(1000 (1 - q/2), 100) peaks where demand
        // meets supply, q = 1.8.
        let mut p = RevenueSearch::new(1.0, 0.05);
        for _ in 0..300 {
            feed(&mut p, 1000, 100);
        }
        assert!((p.price() - 1.8).abs() < 0.15, "{}", p.price());
    }

    #[test]
    fn without_bids_excess_demand_raises_and_no_demand_lowers() {
        let mut p = RevenueSearch::new(4.0, 0.1);
        p.observe(0, 50, 10, 0);
        assert!((p.update(0) - 1.1).abs() < 1e-9);
        p.observe(0, 0, 0, 10);
        assert!((p.update(0) - 0.99).abs() < 1e-9);
    }

    #[test]
    fn fixed_price_never_moves() {
        let mut p = FixedPrice(3.0);
        p.bid(0, 100.0, 10);
        p.observe(0, 100, 0, 0);
        assert_eq!(p.update(0), 3.0);
    }
}
