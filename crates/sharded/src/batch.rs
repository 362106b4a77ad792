//! Batching mode's write side, shared by every structure: a [`Pusher`] buffers items on
//! the client and hands full buffers to a thread of its own, which sends them to their
//! shards in large messages, several batches in flight at once
//! ([`AutoSharder::route_many_async`]); a third thread splits the shards they grew.
//!
//! Why splits run on a thread of their own: the flushing thread only ever waits on its
//! futures, so a split (synchronous calls, and waits of a split's length) never delays
//! the batches in flight. (It was first done to avoid a deadlock: a local call's future
//! used to hold the proclet's lock from its grant until it was polled again; the runtime
//! now runs a granted local call without waiting for its owner to poll.)

use crate::sharder::{AutoSharder, Hint, Shard};
use crate::ShardError;
use granule_runtime::{Footprint, Wire};
use parking_lot::Mutex;
use std::sync::Arc;
use tokio::sync::{mpsc, Notify};

/// Shared between a [`Pusher`] and its flushing thread.
#[derive(Default)]
struct FlushState {
    /// Batches handed over / applied.
    sent: u64,
    applied: u64,
    /// Items applied.
    items: u64,
    /// Shards handed to the resizing thread / checked by it.
    resizes_queued: u64,
    resizes_done: u64,
    /// The first failure; later batches are dropped with it.
    error: Option<String>,
}

/// The state and a wake-up for those waiting on it. Every wait goes through
/// [`granule_runtime::block_on`], never a plain blocking call: a pusher used inside a
/// closure on a node must hand the node's worker over while it waits, or calls to shards
/// on that node (its own batches among them) could not be served.
#[derive(Default)]
struct Shared {
    state: Mutex<FlushState>,
    changed: Notify,
}

impl Shared {
    /// Wait until every batch handed over is applied and the shards it grew are split
    /// (or a batch failed).
    fn wait_applied(&self) {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.state.lock();
                let settled = st.applied >= st.sent && st.resizes_done >= st.resizes_queued;
                if settled || st.error.is_some() {
                    return;
                }
            }
            granule_runtime::block_on(notified);
        }
    }
}

/// Writes buffered on the client and sent in batches of about `batch_bytes`, up to
/// `in_flight` batches at once, by a flushing thread of the pusher's own.
///
/// [`Pusher::flush`] waits until everything pushed so far is applied; dropping the
/// pusher flushes too (an error then is only logged, so flush before dropping when it
/// matters). Batches in flight together may be applied in either order; with
/// `in_flight` 1 they are applied in push order.
pub struct Pusher<I: Wire + Footprint> {
    buf: Vec<I>,
    buf_bytes: u64,
    batch_bytes: u64,
    tx: Option<mpsc::Sender<Vec<I>>>,
    shared: Arc<Shared>,
    flusher: Option<std::thread::JoinHandle<()>>,
}

impl<I: Wire + Clone + Footprint> Pusher<I> {
    /// A pusher into `sharder`'s structure: each item goes to the shard whose range
    /// holds `key_of(item)`, where `apply(&mut shard, items)` takes it in.
    pub fn start<S, K, F>(
        sharder: AutoSharder<S>,
        batch_bytes: u64,
        in_flight: usize,
        key_of: K,
        apply: F,
    ) -> Result<Pusher<I>, ShardError>
    where
        S: Shard,
        K: Fn(&I) -> S::Key + Copy + Send + Sync + 'static,
        F: Fn(&mut S, Vec<I>) + Copy + Send + Sync + 'static,
    {
        let in_flight = in_flight.max(1);
        let (tx, rx) = mpsc::channel::<Vec<I>>(in_flight);
        let shared: Arc<Shared> = Default::default();
        // The flusher acts through the caller's cluster.
        let ctx = granule_runtime::thread_context();
        let st = shared.clone();
        let flusher = std::thread::Builder::new()
            .name("granule-flush".into())
            .spawn(move || {
                ctx.enter();
                // It waits on replies while its producer fills the next batch: spinning
                // would take the CPU from the producer where they share one.
                granule_runtime::set_spin(false);
                flush_batches(&sharder, rx, in_flight, st, key_of, apply);
            })
            .map_err(|e| ShardError::Stuck(format!("cannot start the flushing thread: {e}")))?;
        Ok(Pusher {
            buf: Vec::new(),
            buf_bytes: 0,
            batch_bytes: batch_bytes.max(1),
            tx: Some(tx),
            shared,
            flusher: Some(flusher),
        })
    }
}

impl<I: Wire + Footprint> Pusher<I> {
    /// Buffer `item`; a full buffer is handed to the flushing thread (waiting while
    /// `in_flight` batches are already out). Fails if an earlier batch failed.
    pub fn push(&mut self, item: I) -> Result<(), ShardError> {
        self.buf_bytes += item.footprint();
        self.buf.push(item);
        if self.buf_bytes >= self.batch_bytes {
            self.send()?;
        }
        Ok(())
    }

    fn send(&mut self) -> Result<(), ShardError> {
        if let Some(e) = &self.shared.state.lock().error {
            return Err(ShardError::Step(e.clone()));
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.buf);
        self.buf_bytes = 0;
        self.hand_over(batch)
    }

    /// Give a batch to the flushing thread, waiting while `in_flight` are out.
    fn hand_over(&mut self, batch: Vec<I>) -> Result<(), ShardError> {
        let gone = || ShardError::Step("the flushing thread stopped".into());
        let tx = self.tx.as_ref().ok_or_else(gone)?;
        self.shared.state.lock().sent += 1;
        if granule_runtime::block_on(tx.send(batch)).is_err() {
            self.shared.state.lock().sent -= 1;
            return Err(gone());
        }
        Ok(())
    }

    /// Send what is buffered and wait until every batch so far is applied; returns the
    /// number of items applied since the pusher was made.
    pub fn flush(&mut self) -> Result<u64, ShardError> {
        self.send()?;
        self.shared.wait_applied();
        let st = self.shared.state.lock();
        match &st.error {
            Some(e) => Err(ShardError::Step(e.clone())),
            None => Ok(st.items),
        }
    }
}

impl<I: Wire + Footprint> Drop for Pusher<I> {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("a pusher was dropped with items not applied: {e}");
        }
        self.tx = None;
        if let Some(h) = self.flusher.take() {
            let _ = h.join();
        }
    }
}

/// What the flushing thread waits for.
enum Event<B, R> {
    Batch(B),
    Done(R),
}

/// The flushing thread: up to `in_flight` batches out at once.
fn flush_batches<S, I, K, F>(
    sharder: &AutoSharder<S>,
    mut rx: mpsc::Receiver<Vec<I>>,
    in_flight: usize,
    shared: Arc<Shared>,
    key_of: K,
    apply: F,
) where
    S: Shard,
    I: Wire + Clone,
    K: Fn(&I) -> S::Key + Copy + Send + Sync + 'static,
    F: Fn(&mut S, Vec<I>) + Copy + Send + Sync + 'static,
{
    use futures::stream::{FuturesUnordered, StreamExt};
    let (resize_tx, resize_rx) = std::sync::mpsc::channel::<Grown<S>>();
    let shared_for_flusher = shared.clone();
    let resizer = {
        let ctx = granule_runtime::thread_context();
        let sharder = sharder.clone();
        std::thread::Builder::new()
            .name("granule-resize".into())
            .spawn(move || {
                ctx.enter();
                granule_runtime::set_spin(false);
                resize_grown(&sharder, resize_rx, shared)
            })
    };
    let shared = &*shared_for_flusher;
    let send = |batch: Vec<I>| {
        let sharder = sharder.clone();
        async move {
            let n = batch.len() as u64;
            (n, sharder.route_many_async(batch, key_of, apply).await)
        }
    };
    let mut inflight = FuturesUnordered::new();
    let mut open = true;
    while open || !inflight.is_empty() {
        // Whichever comes first: a new batch (while there is room) or a batch applied.
        let event = granule_runtime::block_on(async {
            tokio::select! {
                b = rx.recv(), if open && inflight.len() < in_flight => Event::Batch(b),
                Some(done) = inflight.next(), if !inflight.is_empty() => Event::Done(done),
            }
        });
        let (n, r) = match event {
            Event::Batch(Some(b)) => {
                inflight.push(send(b));
                continue;
            }
            Event::Batch(None) => {
                open = false;
                continue;
            }
            Event::Done(d) => d,
        };
        match r {
            Ok(written) => {
                let mut st = shared.state.lock();
                st.applied += 1;
                st.items += n;
                let over: Vec<_> = written
                    .into_iter()
                    .filter(|(_, _, fp)| *fp > sharder.bounds().upper)
                    .collect();
                st.resizes_queued += over.len() as u64;
                for g in over {
                    if resize_tx.send(g).is_err() {
                        // No resizing thread: the shards stay large, nothing is lost.
                        st.resizes_done += 1;
                    }
                }
            }
            Err(e) => {
                let mut st = shared.state.lock();
                st.applied += 1;
                st.error.get_or_insert_with(|| e.to_string());
            }
        }
        shared.changed.notify_waiters();
    }
    drop(resize_tx);
    if let Ok(h) = resizer {
        let _ = h.join();
    }
}

/// A shard a batch grew past the upper bound: its key, handle and footprint.
type Grown<S> = (
    <S as Shard>::Key,
    granule_runtime::Proclet<crate::sharder::Cell<S>>,
    u64,
);

/// How long the resizing thread keeps trying to split a shard whose split failed (a
/// call refused under load, no node with room for the new shard for a moment) before
/// the flush waiting on it goes on with the shard over its bound: the items are applied
/// by then, only the shard's size is wrong. The shard stays owed a split: later writes
/// through the structure's handle try it again, and so does this thread after the next
/// batch that grows a shard.
const SETTLE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The resizing thread: split every shard reported grown (once per shard however many
/// reports are waiting), and try again every split that failed before the reports count
/// as done: a split that failed on the last batch's shard would otherwise never be
/// tried again (no later batch lands there), and the flush would return with the shard
/// over its bound.
fn resize_grown<S: Shard>(
    sharder: &AutoSharder<S>,
    rx: std::sync::mpsc::Receiver<Grown<S>>,
    shared: Arc<Shared>,
) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        jobs.extend(rx.try_iter());
        let n = jobs.len() as u64;
        let mut seen = std::collections::HashSet::new();
        for (key, shard, fp) in jobs {
            if seen.insert(shard.id()) {
                sharder.resize_after(&key, Hint::Grow, &shard, fp);
            }
        }
        if let Err(e) = sharder.settle(SETTLE_PATIENCE) {
            tracing::warn!("a pusher's batches left shards over their bound: {e}");
        }
        shared.state.lock().resizes_done += n;
        shared.changed.notify_waiters();
    }
}
