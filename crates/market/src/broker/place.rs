//! Placement: the cost of putting a request's slabs on each candidate producer (a
//! weighted sum of normalized terms, lower is better) and the greedy assignment that
//! takes slabs from the cheapest candidates first.

use granule_wire::market::{PlacementWeights, ProducerId};

/// A producer as placement sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub producer: ProducerId,
    /// Slabs this request may take from it (free now and predicted to stay available
    /// over the lease).
    pub placeable: u32,
    /// Slabs free now.
    pub free: u32,
    /// Predicted lowest availability over the lease (free + leased), slabs.
    pub predicted: f64,
    /// Availability now (free + leased), slabs.
    pub capacity: f64,
    pub bandwidth_bps: u64,
    pub cpu_idle_cores: f64,
    /// Round-trip time to it, ms (0 when unknown).
    pub latency_ms: f64,
    /// In 0..=1.
    pub reputation: f64,
}

/// The largest value of each term among the candidates (terms are scaled by them).
#[derive(Clone, Copy, Debug, Default)]
struct Maxes {
    free: f64,
    bandwidth: f64,
    cpu: f64,
    latency: f64,
}

/// `1 - x / max` in 0..=1 (0 when nobody has any).
fn lack(x: f64, max: f64) -> f64 {
    if max <= 0.0 {
        0.0
    } else {
        (1.0 - x / max).clamp(0.0, 1.0)
    }
}

fn cost_with(c: &Candidate, m: &Maxes, w: &PlacementWeights) -> f64 {
    // Each term is in 0..=1, 0 the best: few free slabs, an availability predicted to
    // fall, little bandwidth, little idle CPU, a long round trip, early revocations.
    let drop = if c.capacity > 0.0 {
        (1.0 - c.predicted / c.capacity).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let latency = if m.latency > 0.0 {
        (c.latency_ms / m.latency).clamp(0.0, 1.0)
    } else {
        0.0
    };
    w.free_slabs * lack(c.free as f64, m.free)
        + w.availability * drop
        + w.bandwidth * lack(c.bandwidth_bps as f64, m.bandwidth)
        + w.cpu * lack(c.cpu_idle_cores, m.cpu)
        + w.latency * latency
        + w.reputation * (1.0 - c.reputation.clamp(0.0, 1.0))
}

/// Each candidate's cost (same order as given).
pub fn costs(cands: &[Candidate], w: &PlacementWeights) -> Vec<f64> {
    let mut m = Maxes::default();
    for c in cands {
        m.free = m.free.max(c.free as f64);
        m.bandwidth = m.bandwidth.max(c.bandwidth_bps as f64);
        m.cpu = m.cpu.max(c.cpu_idle_cores);
        m.latency = m.latency.max(c.latency_ms);
    }
    cands.iter().map(|c| cost_with(c, &m, w)).collect()
}

/// Sort candidates by cost, cheapest first (ties: lower producer id), dropping those
/// with nothing placeable.
pub fn rank(mut cands: Vec<Candidate>, w: &PlacementWeights) -> Vec<Candidate> {
    cands.retain(|c| c.placeable > 0);
    let cost = costs(&cands, w);
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| {
        cost[a]
            .total_cmp(&cost[b])
            .then(cands[a].producer.cmp(&cands[b].producer))
    });
    order.into_iter().map(|i| cands[i].clone()).collect()
}

/// Take slabs from the ranked candidates, best first, until `want` are found; nothing
/// when fewer than `min` can be found.
pub fn greedy(ranked: &[Candidate], want: u32, min: u32) -> Vec<(ProducerId, u32)> {
    let mut left = want;
    let mut out = Vec::new();
    for c in ranked {
        if left == 0 {
            break;
        }
        let take = c.placeable.min(left);
        if take > 0 {
            out.push((c.producer, take));
            left -= take;
        }
    }
    if want - left < min.max(1) {
        return Vec::new();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: ProducerId, free: u32, rep: f64) -> Candidate {
        Candidate {
            producer: id,
            placeable: free,
            free,
            predicted: free as f64,
            capacity: free as f64,
            bandwidth_bps: 1 << 30,
            cpu_idle_cores: 1.0,
            latency_ms: 0.0,
            reputation: rep,
        }
    }

    #[test]
    fn cheaper_candidates_come_first() {
        let w = PlacementWeights::default();
        // Same free slabs, the one with a worse reputation ranks last; the one with
        // most free slabs first.
        let ranked = rank(
            vec![cand(1, 10, 0.5), cand(2, 10, 1.0), cand(3, 20, 1.0)],
            &w,
        );
        let ids: Vec<_> = ranked.iter().map(|c| c.producer).collect();
        assert_eq!(ids, vec![3, 2, 1]);
    }

    #[test]
    fn predicted_drop_costs() {
        let w = PlacementWeights::default();
        let mut falling = cand(1, 10, 1.0);
        falling.predicted = 5.0;
        let ranked = rank(vec![falling, cand(2, 10, 1.0)], &w);
        assert_eq!(ranked[0].producer, 2);
        let c = costs(&ranked, &w);
        assert!((c[1] - c[0] - w.availability * 0.5).abs() < 1e-9);
    }

    #[test]
    fn weights_change_the_order() {
        let mut fast = cand(1, 5, 1.0);
        fast.latency_ms = 0.1;
        let mut slow = cand(2, 10, 1.0);
        slow.latency_ms = 10.0;
        let by_latency = PlacementWeights {
            free_slabs: 0.0,
            latency: 1.0,
            ..PlacementWeights::default()
        };
        assert_eq!(
            rank(vec![fast.clone(), slow.clone()], &by_latency)[0].producer,
            1
        );
        assert_eq!(
            rank(vec![fast, slow], &PlacementWeights::default())[0].producer,
            2
        );
    }

    #[test]
    fn greedy_fills_from_the_best_and_allows_partial() {
        let ranked = vec![cand(1, 4, 1.0), cand(2, 3, 1.0)];
        assert_eq!(greedy(&ranked, 5, 5), vec![(1, 4), (2, 1)]);
        // Only 7 exist: partial is fine at min 6, nothing at min 8.
        assert_eq!(greedy(&ranked, 10, 6), vec![(1, 4), (2, 3)]);
        assert!(greedy(&ranked, 10, 8).is_empty());
        assert!(rank(vec![cand(5, 0, 1.0)], &PlacementWeights::default()).is_empty());
    }
}
