//! Compute proclets over an index range: the building block for batch computing.
//!
//! A [`RangeJob`] runs `f(&arg, i)` for every `i` in a range, in order, on compute
//! proclets (one per piece of the range) that the controller places on nodes with idle
//! cores. Each piece is an ordinary proclet whose state is its argument and the next index
//! to do; its worker is a long call that works through the items and checks
//! [`should_yield`](crate::should_yield) at every item boundary.
//!
//! When the runtime moves a piece (the pressure policy shedding CPU, or an explicit
//! move), the worker stops at the next item boundary and returns the results it has: they
//! are kept by the job. The piece's remaining range, its only state, then moves, which
//! is cheap (no stack, no results travel), and the job's driver calls the worker again:
//! the call follows the piece to its new node, where the remainder continues. No item is
//! computed twice or skipped: the next index advances only with a completed item, under
//! the piece's lock.

use crate::context;
use crate::error::CallError;
use crate::proclet::{Proclet, ProcletState, Wire};
use granule_wire::{Kind, NodeId, ProcletId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

/// State of one piece: the job's argument and what is left of its range.
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "A: Serialize",
    deserialize = "A: serde::de::DeserializeOwned"
))]
pub struct RangePiece<A, T, F> {
    arg: A,
    next: u64,
    end: u64,
    #[serde(skip)]
    _f: PhantomData<fn() -> (T, F)>,
}

/// What one worker call returns: the results of items `start..start + results.len()`,
/// and whether the piece's range is finished.
#[derive(Serialize, Deserialize)]
struct Batch<T> {
    start: u64,
    results: Vec<T>,
    done: bool,
}

/// The worker: items until the range ends or the runtime asks it to yield.
fn work<A, T, F>(p: &mut RangePiece<A, T, F>, _: ()) -> Batch<T>
where
    F: Fn(&A, u64) -> T,
{
    let f: F = crate::shipping::conjure::<F>();
    let start = p.next;
    let mut results = Vec::new();
    while p.next < p.end {
        results.push(f(&p.arg, p.next));
        p.next += 1;
        if crate::accounting::should_yield() {
            break;
        }
    }
    Batch {
        start,
        results,
        done: p.next >= p.end,
    }
}

struct Progress<T> {
    /// Per piece: results so far, in order.
    results: Vec<Vec<T>>,
    /// Times a worker stopped early because its piece was moving.
    yields: u64,
}

/// A running range computation; see the module doc.
pub struct RangeJob<T> {
    pieces: Vec<ProcletId>,
    progress: Arc<Mutex<Progress<T>>>,
    driver: Option<tokio::task::JoinHandle<Result<(), CallError>>>,
}

impl<T: Wire + Send + 'static> RangeJob<T> {
    /// Start computing `f(&arg, i)` for every `i` in `range`, in `pieces` compute proclets
    /// (contiguous, near-equal parts of the range; at least one). `f` must capture
    /// nothing, like every closure shipped to a proclet.
    pub fn start<A, F>(range: Range<u64>, pieces: usize, arg: A, f: F) -> Result<Self, CallError>
    where
        A: ProcletState + Clone + Wire,
        F: Fn(&A, u64) -> T + Send + Sync + 'static,
    {
        Self::start_on(&[], range, pieces, arg, f)
    }

    /// [`RangeJob::start`], with the pieces created on the given nodes (round robin)
    /// instead of where the controller places them; empty `nodes`: the controller places.
    pub fn start_on<A, F>(
        nodes: &[NodeId],
        range: Range<u64>,
        pieces: usize,
        arg: A,
        f: F,
    ) -> Result<Self, CallError>
    where
        A: ProcletState + Clone + Wire,
        F: Fn(&A, u64) -> T + Send + Sync + 'static,
    {
        const {
            assert!(
                std::mem::size_of::<F>() == 0,
                "the closure of a RangeJob must capture nothing: pass what it needs in `arg`"
            )
        };
        let _ = f;
        let node = context::current_node().ok_or(CallError::NoCluster)?;
        let n = pieces.max(1) as u64;
        let len = range.end.saturating_sub(range.start);
        let mut handles: Vec<Proclet<RangePiece<A, T, F>>> = Vec::new();
        for k in 0..n {
            let lo = range.start + len * k / n;
            let hi = range.start + len * (k + 1) / n;
            let mut b = Proclet::builder(Kind::Compute);
            if !nodes.is_empty() {
                b = b.on(nodes[k as usize % nodes.len()]);
            }
            let p = b.create((arg.clone(), lo, hi), |(arg, next, end): (A, u64, u64)| {
                RangePiece {
                    arg,
                    next,
                    end,
                    _f: PhantomData,
                }
            })?;
            handles.push(p);
        }
        let progress = Arc::new(Mutex::new(Progress {
            results: (0..handles.len()).map(|_| Vec::new()).collect(),
            yields: 0,
        }));
        let pieces = handles.iter().map(|h| h.id()).collect();
        let prog = progress.clone();
        let driver = node.handle.spawn(async move {
            let runs = handles.into_iter().enumerate().map(|(i, h)| {
                let prog = prog.clone();
                async move {
                    loop {
                        let b: Batch<T> = h.run_async((), work::<A, T, F>).await?;
                        let mut p = prog.lock();
                        p.results[i].extend(b.results);
                        if b.done {
                            return Ok::<(), CallError>(());
                        }
                        p.yields += 1;
                    }
                }
            });
            let mut out = Ok(());
            for r in futures::future::join_all(runs).await {
                if let Err(e) = r {
                    out = Err(e);
                }
            }
            out
        });
        Ok(RangeJob {
            pieces,
            progress,
            driver: Some(driver),
        })
    }

    /// The compute proclets working on the job (to inspect or move them).
    pub fn proclets(&self) -> &[ProcletId] {
        &self.pieces
    }

    /// Items finished so far.
    pub fn done_items(&self) -> u64 {
        self.progress
            .lock()
            .results
            .iter()
            .map(|r| r.len() as u64)
            .sum()
    }

    /// How many times a worker stopped at an item boundary because its piece moved.
    pub fn yields(&self) -> u64 {
        self.progress.lock().yields
    }

    /// Wait for the job; the results in index order.
    pub fn join(mut self) -> Result<Vec<T>, CallError> {
        let driver = self
            .driver
            .take()
            .ok_or_else(|| CallError::Internal("job already joined".into()))?;
        let outcome = context::block_on_public(driver)
            .map_err(|e| CallError::Internal(format!("the job's driver failed: {e}")))?;
        outcome?;
        let mut p = self.progress.lock();
        Ok(std::mem::take(&mut p.results)
            .into_iter()
            .flatten()
            .collect())
    }
}
