//! The compute proclet that works through an index range of a sealed input, and the
//! kernels (`for_all`, `map`, `filter`, `flat_map`, `reduce`, and the sink kernels that
//! stage their output in a target structure instead of replying with it) it runs.
//!
//! A worker's state is the input's handle, the job's argument and a *cursor*: the next
//! index to claim and the end of its range. The worker claims items in chunks (a few
//! milliseconds of work each, `Batch::chunk`), keeps the next chunk's fetch in flight
//! while it computes the current one, and returns to the coordinator after a time
//! budget, when asked to stop, when its proclet is about to move, or when its core is
//! contended. Every reply covers a contiguous run `start..end` of items with the
//! kernel's output for exactly those items, so the coordinator can account for every
//! index.
//!
//! The cursor sits behind a lock so that the coordinator can *steal* the upper half of
//! the unclaimed range (a concurrent read-only call: `run_ref`) while the worker runs:
//! a steal only lowers `end`, never below what the worker has claimed, so claimed
//! chunks stay contiguous and nothing is computed twice. Because its read-only calls
//! change the cursor, the worker is created with `mutating_reads`: a move holds them
//! and runs them at the destination (served at the source while the state streams, a
//! work call's progress was lost with the source's copy and the worker reported from
//! an older cursor than the coordinator had accounted).

use crate::sink::{Put, PutError, Shelf, Sink};
use granule_host::proc::{thread_cpu_time as thread_cpu, OwnSchedstat};
use granule_runtime::{should_yield, Proclet, Wire};
use granule_sharded::{Element, MapKey, MapValue, ShardError, ShardedMap, ShardedVec};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Work between two checks of whether to stop (moving, asked, contended, budget): how
/// long a stop waits for the running item boundary at most, about.
const CHECK_EVERY: Duration = Duration::from_micros(250);
/// Largest chunk, in items (bounds the memory of a chunk of tiny items).
const CHUNK_MAX: u64 = 1 << 16;

/// The next index a worker will claim and the end of its range.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub next: u64,
    pub end: u64,
}

impl Cursor {
    pub(crate) fn claim(&mut self, n: u64) -> Option<(u64, u64)> {
        if self.next >= self.end {
            return None;
        }
        let s = self.next;
        let e = self.end.min(s.saturating_add(n.max(1)));
        self.next = e;
        Some((s, e))
    }

    /// The upper half of what is unclaimed, if it holds at least `min` items and leaves
    /// at least `min`.
    pub(crate) fn steal(&mut self, min: u64) -> Option<(u64, u64)> {
        let rest = self.end.saturating_sub(self.next);
        if rest < 2 * min.max(1) {
            return None;
        }
        let mid = self.next + rest / 2;
        let stolen = (mid, self.end);
        self.end = mid;
        Some(stolen)
    }

    /// Everything unclaimed; leaves the cursor empty.
    pub(crate) fn take_rest(&mut self) -> Option<(u64, u64)> {
        let rest = (self.next < self.end).then_some((self.next, self.end));
        self.next = self.end;
        rest
    }
}

/// A worker proclet's state.
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "A: Serialize",
    deserialize = "A: serde::de::DeserializeOwned"
))]
pub(crate) struct Worker<T: Element, A> {
    input: ShardedVec<T>,
    pub(crate) arg: A,
    #[serde(with = "locked_cursor")]
    cursor: Mutex<Cursor>,
    /// Set by the coordinator (policy shrinking the job); the worker stops at its next
    /// chunk boundary and hands back its unclaimed range.
    #[serde(skip)]
    stop: AtomicBool,
    /// Where a vector sink's worker keeps its calls' output: its node's shelf.
    pub(crate) shelf: Option<Proclet<Shelf>>,
}

impl<T: Element, A> Worker<T, A> {
    pub(crate) fn new(
        input: ShardedVec<T>,
        arg: A,
        range: (u64, u64),
        shelf: Option<Proclet<Shelf>>,
    ) -> Self {
        Worker {
            input,
            arg,
            cursor: Mutex::new(Cursor {
                next: range.0,
                end: range.1,
            }),
            stop: AtomicBool::new(false),
            shelf,
        }
    }
}

/// The cursor travels as its value (a proclet moves only between calls, so no one holds
/// the lock then).
mod locked_cursor {
    use super::Cursor;
    use parking_lot::Mutex;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(c: &Mutex<Cursor>, s: S) -> Result<S::Ok, S::Error> {
        c.lock().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Mutex<Cursor>, D::Error> {
        Cursor::deserialize(d).map(Mutex::new)
    }
}

/// How a worker watches for a contended core.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub(crate) struct Watch {
    /// Length of the sliding window, microseconds.
    pub window_us: u64,
    /// The worker stops when its thread spent more than `1 - min_share` of the window
    /// waiting for its core (runnable, not running).
    pub min_share: f64,
}

/// One work call's request.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct WorkReq {
    /// The call's id, unique within the job: what a sink tags the call's output with,
    /// so that only the output of calls the coordinator accepted is committed.
    pub call: u64,
    /// A new range for a worker whose cursor is empty.
    pub assign: Option<(u64, u64)>,
    /// Return after about this long, microseconds.
    pub budget_us: u64,
    /// Work one fetched chunk should hold, microseconds.
    pub chunk_us: u64,
    pub watch: Option<Watch>,
}

/// Why a work call returned.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The cursor is empty.
    Finished,
    /// The time budget ran out; the worker has more.
    Budget,
    /// The runtime is moving the proclet (call again: the call follows it).
    Moving,
    /// The core is busy with other work; the unclaimed range is in `rest`.
    Contended,
    /// The coordinator asked it to stop; the unclaimed range is in `rest`.
    Asked,
}

/// Why a work call failed.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) enum WorkError {
    /// Nothing a retry fixes (reading the input failed, the target refused the output):
    /// the job fails with this.
    Failed(String),
    /// Its output could not be kept where it belongs (a shelf's node is gone): the call
    /// counts as lost and its range is computed again elsewhere.
    Lost(String),
}

impl From<String> for WorkError {
    fn from(why: String) -> Self {
        WorkError::Failed(why)
    }
}

/// One work call's reply: the kernel's output for items `start..end`, exactly.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct WorkReply<O> {
    pub start: u64,
    pub end: u64,
    pub out: O,
    pub stop: Stop,
    /// What the worker handed back (when it stopped for good).
    pub rest: Option<(u64, u64)>,
    /// Thread CPU seconds the call used, and its wall seconds (for the job's log).
    pub cpu_s: f64,
    pub wall_s: f64,
}

/// Judges whether the worker's core is busy with other work, from the kernel's account
/// of the worker thread (`/proc/thread-self/schedstat`): the share of the last window it
/// spent waiting to run, and its CPU time over the time it was not blocked on its own
/// fetches.
struct ShareMeter {
    schedstat: OwnSchedstat,
    /// (when, CPU ns, run-queue delay ns, ns blocked on our own fetches).
    samples: std::collections::VecDeque<(Instant, u64, u64, u64)>,
    last: Option<Instant>,
    /// Time blocked on our own fetches so far.
    waited: Duration,
    /// Consecutive readings below the threshold.
    low: u32,
    /// The last reading's two views of the share: (by run-queue delay, by CPU time).
    last_views: (f64, f64),
}

/// Readings (one per millisecond) in a row that must find the core contended: one
/// unlucky window must not shrink a job.
const LOW_READINGS: u32 = 2;

/// Shortest interval between two readings (a reading costs a couple of microseconds).
const SAMPLE_EVERY: Duration = Duration::from_millis(1);

impl ShareMeter {
    fn new() -> Self {
        let mut m = ShareMeter {
            schedstat: OwnSchedstat::open(),
            samples: std::collections::VecDeque::new(),
            last: None,
            waited: Duration::ZERO,
            low: 0,
            last_views: (1.0, 1.0),
        };
        if let Some((cpu, delay)) = m.read() {
            m.samples.push_back((Instant::now(), cpu, delay, 0));
        }
        m
    }

    /// CPU time and run-queue delay of the thread so far, nanoseconds.
    fn read(&mut self) -> Option<(u64, u64)> {
        let s = self.schedstat.read()?;
        Some((s.cpu_ns, s.runq_delay_ns))
    }

    /// Whether the core has been contended for [`LOW_READINGS`] readings in a row.
    fn contended(&mut self, wt: Watch) -> bool {
        match self.sample(Duration::from_micros(wt.window_us)) {
            Some(share) if share < wt.min_share => self.low += 1,
            Some(_) => self.low = 0,
            None => {}
        }
        self.low >= LOW_READINGS
    }

    /// Share of a core the thread had over the last `window` (`None` until a whole
    /// window has been seen, or between readings): the smaller of two views of it —
    /// 1 − the time it waited to run, and its CPU time over the time it was not blocked
    /// on its own fetches (the second also sees the node's group throttled by its CFS
    /// quota because others in the group used it).
    fn sample(&mut self, window: Duration) -> Option<f64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < SAMPLE_EVERY)
        {
            return None;
        }
        self.last = Some(now);
        let (cpu, delay) = self.read()?;
        let waited = self.waited.as_nanos() as u64;
        self.samples.push_back((now, cpu, delay, waited));
        while self.samples.len() > 2 && now.duration_since(self.samples[1].0) >= window {
            self.samples.pop_front();
        }
        let (t0, c0, d0, w0) = *self.samples.front()?;
        let wall = now.duration_since(t0);
        if wall < window {
            return None;
        }
        let wall_ns = wall.as_nanos() as f64;
        let by_delay = 1.0 - delay.saturating_sub(d0) as f64 / wall_ns;
        let running = (wall_ns - waited.saturating_sub(w0) as f64).max(1.0);
        let by_cpu = cpu.saturating_sub(c0) as f64 / running;
        self.last_views = (by_delay, by_cpu);
        Some(by_delay.min(by_cpu))
    }
}

/// The work loop every kernel shares: claim, fetch ahead, compute, check why to stop.
/// `each(arg, item, out)` folds one item into the output.
pub(crate) fn work_loop<T, A, O>(
    w: &Worker<T, A>,
    req: WorkReq,
    mut out: O,
    mut each: impl FnMut(&A, &T, &mut O),
) -> Result<WorkReply<O>, String>
where
    T: Element,
    A: Wire + Sync,
    O: Send,
{
    if let Some((s, e)) = req.assign {
        let mut c = w.cursor.lock();
        if c.next >= c.end {
            *c = Cursor { next: s, end: e };
        } else {
            return Err(format!(
                "internal: range {s}..{e} assigned to a worker that still has {}..{}",
                c.next, c.end
            ));
        }
    }
    let started = Instant::now();
    let cpu_started = thread_cpu();
    let budget = Duration::from_micros(req.budget_us.max(1));
    let start = w.cursor.lock().next;
    let fetch = |(s, e): (u64, u64)| {
        let f = w.input.read_range_async(s, e);
        granule_runtime::spawn(f).map(|h| ((s, e), h))
    };
    let unclaim = |s: u64| {
        let mut c = w.cursor.lock();
        // Steals only ever lower `end` to at least the claimed `next`, so giving back a
        // claimed chunk keeps the range contiguous.
        c.next = c.next.min(s);
    };
    let mut chunk: u64 = 16;
    let mut done_to = start;
    let mut meter = ShareMeter::new();
    let claimed = w.cursor.lock().claim(chunk);
    let mut current = match claimed {
        Some(r) => Some(fetch(r).ok_or("no node runtime to fetch with")?),
        None => None,
    };
    let mut check_every: usize = 1;
    let why_stop = |meter: &mut ShareMeter| {
        if should_yield() {
            Some(Stop::Moving)
        } else if w.stop.swap(false, Ordering::AcqRel) {
            Some(Stop::Asked)
        } else if req.watch.is_some_and(|wt| meter.contended(wt)) {
            let (by_delay, by_cpu) = meter.last_views;
            tracing::debug!(
                by_delay,
                by_cpu,
                "a batch worker stops: its core is contended (share by run-queue delay, by \
                 CPU time over time not fetching)"
            );
            Some(Stop::Contended)
        } else if started.elapsed() >= budget {
            Some(Stop::Budget)
        } else {
            None
        }
    };
    let stop = granule_runtime::cpu_bound(|| -> Result<Stop, String> {
        while let Some(((s, e), handle)) = current.take() {
            let waiting = Instant::now();
            let items: Result<Vec<T>, ShardError> = granule_runtime::block_on(handle)
                .unwrap_or_else(|e| Err(ShardError::Step(format!("fetch task failed: {e}"))));
            meter.waited += waiting.elapsed();
            let items = match items {
                Ok(v) if v.len() as u64 == e - s => v,
                Ok(v) => {
                    unclaim(s);
                    return Err(format!(
                        "the input returned {} items for {s}..{e} (was it changed after sealing?)",
                        v.len()
                    ));
                }
                Err(err) => {
                    unclaim(s);
                    return Err(format!("reading input items {s}..{e}: {err}"));
                }
            };
            // Keep the next chunk's fetch in flight while this one is computed.
            let next = w.cursor.lock().claim(chunk);
            current = match next {
                Some(r) => Some(fetch(r).ok_or("no node runtime to fetch with")?),
                None => None,
            };
            // Compute, checking every `check_every` items (about CHECK_EVERY of work)
            // whether to stop: a stop waits for an item boundary, not a chunk's end.
            let t = Instant::now();
            let mut why = None;
            let mut k = 0;
            for x in &items {
                each(&w.arg, x, &mut out);
                k += 1;
                if k % check_every == 0 || k == items.len() {
                    why = why_stop(&mut meter);
                    if why.is_some() {
                        break;
                    }
                }
            }
            done_to = s + k as u64;
            // Size the next chunks to about `chunk_us` of work, and the checks.
            let per_item = (t.elapsed().as_nanos() as u64 / (k as u64).max(1)).max(1);
            chunk = (req.chunk_us.max(1) * 1000 / per_item).clamp(1, CHUNK_MAX);
            check_every = ((CHECK_EVERY.as_nanos() as u64 / per_item) as usize).max(1);
            if let Some(why) = why {
                if let Some((_, h)) = current.take() {
                    h.abort();
                }
                // Give back the rest of this chunk and the one being fetched.
                unclaim(done_to);
                return Ok(why);
            }
        }
        Ok(Stop::Finished)
    })?;
    let rest = match stop {
        Stop::Contended | Stop::Asked => w.cursor.lock().take_rest(),
        _ => None,
    };

    Ok(WorkReply {
        start,
        end: done_to,
        out,
        stop,
        rest,
        cpu_s: thread_cpu().saturating_sub(cpu_started).as_secs_f64(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// Steal the upper half of a worker's unclaimed range (read-only call: runs beside the
/// worker's own call).
pub(crate) fn steal<T: Element, A>(w: &Worker<T, A>, min: u64) -> Option<(u64, u64)> {
    w.cursor.lock().steal(min)
}

/// Ask a worker to stop at its next chunk boundary.
pub(crate) fn ask_stop<T: Element, A>(w: &Worker<T, A>, _: ()) {
    w.stop.store(true, Ordering::Release);
}

// ---- kernels: each wraps the user's closure `f` (shipped as code, see `run_ref_with`) ----

pub(crate) fn for_all_kernel<T, A, F>(
    w: &Worker<T, A>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<()>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    F: Fn(&A, &T),
{
    Ok(work_loop(w, req, (), |a, x, _| f(a, x))?)
}

pub(crate) fn map_kernel<T, A, U, F>(
    w: &Worker<T, A>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Vec<U>>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    U: Send,
    F: Fn(&A, &T) -> U,
{
    Ok(work_loop(w, req, Vec::new(), |a, x, o| o.push(f(a, x)))?)
}

pub(crate) fn flat_map_kernel<T, A, U, F>(
    w: &Worker<T, A>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Vec<U>>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    U: Send,
    F: Fn(&A, &T) -> Vec<U>,
{
    Ok(work_loop(w, req, Vec::new(), |a, x, o| o.extend(f(a, x)))?)
}

pub(crate) fn filter_kernel<T, A, F>(
    w: &Worker<T, A>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Vec<T>>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    F: Fn(&A, &T) -> bool,
{
    Ok(work_loop(w, req, Vec::new(), |a, x, o| {
        if f(a, x) {
            o.push(x.clone())
        }
    })?)
}

/// `reduce`: the worker's argument is `(arg, init)`; each call folds its items into a
/// fresh copy of `init`.
pub(crate) fn reduce_kernel<T, A, Acc, F>(
    w: &Worker<T, (A, Acc)>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Acc>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    Acc: Wire + Clone + Sync,
    F: Fn(&A, &mut Acc, &T),
{
    let init = w.arg.1.clone();
    Ok(work_loop(w, req, init, |(a, _), x, acc| f(a, acc, x))?)
}

// ---- sink kernels: the output goes to a sink's stage from here; the reply says how
// much, and which call wrote it ----

/// `map_into` / `flat_map_into`: the worker's argument is `(arg, stage, job)`; `emit`
/// appends an item's outputs. The call's output is staged, tagged with the call, before
/// the reply: a reply the coordinator accepts means its output is in the stage.
fn sink_loop<T, A, U, S, E>(
    w: &Worker<T, (A, S::Stage, u64)>,
    req: WorkReq,
    emit: E,
) -> Result<WorkReply<Put>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    U: Send,
    S: Sink<U>,
    E: FnMut(&(A, S::Stage, u64), &T, &mut Vec<U>),
{
    let call = req.call;
    let r = work_loop(w, req, Vec::new(), emit)?;
    let items = r.out.len() as u64;
    let mut shelf = None;
    if r.end > r.start {
        let (_, stage, job) = &w.arg;
        let why = |e: String| format!("writing items {}..{} to the sink: {e}", r.start, r.end);
        shelf =
            S::put(stage, w.shelf.as_ref(), *job, (r.start, call), r.out).map_err(|e| match e {
                PutError::Lost(e) => WorkError::Lost(why(e)),
                PutError::Failed(e) => WorkError::Failed(why(e)),
            })?;
    }
    Ok(WorkReply {
        start: r.start,
        end: r.end,
        out: Put { call, items, shelf },
        stop: r.stop,
        rest: r.rest,
        cpu_s: r.cpu_s,
        wall_s: r.wall_s,
    })
}

pub(crate) fn map_into_kernel<T, A, U, S, F>(
    w: &Worker<T, (A, S::Stage, u64)>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Put>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    U: Send,
    S: Sink<U>,
    F: Fn(&A, &T) -> U,
{
    sink_loop::<T, A, U, S, _>(w, req, |(a, _, _), x, o| o.push(f(a, x)))
}

pub(crate) fn flat_map_into_kernel<T, A, U, S, F>(
    w: &Worker<T, (A, S::Stage, u64)>,
    req: WorkReq,
    f: &F,
) -> Result<WorkReply<Put>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    U: Send,
    S: Sink<U>,
    F: Fn(&A, &T) -> Vec<U>,
{
    sink_loop::<T, A, U, S, _>(w, req, |(a, _, _), x, o| o.extend(f(a, x)))
}

/// `reduce_by_key_into`: the worker's argument is `(arg, target, job)`, `fm` is the pair
/// (the user's `f`, `merge`). The call reduces its own items by key fully (in input
/// order), then stages one value per key.
pub(crate) fn reduce_by_key_kernel<T, A, K, V, F, M>(
    w: &Worker<T, (A, ShardedMap<K, V>, u64)>,
    req: WorkReq,
    fm: &(F, M),
) -> Result<WorkReply<Put>, WorkError>
where
    T: Element,
    A: Wire + Sync,
    K: MapKey,
    V: MapValue + Clone,
    F: Fn(&A, &T) -> Vec<(K, V)>,
    M: Fn(&mut V, V),
{
    let (f, merge) = fm;
    let call = req.call;
    let r = work_loop(w, req, BTreeMap::<K, V>::new(), |(a, _, _), x, acc| {
        for (k, v) in f(a, x) {
            match acc.entry(k) {
                Entry::Vacant(e) => {
                    e.insert(v);
                }
                Entry::Occupied(mut e) => merge(e.get_mut(), v),
            }
        }
    })?;
    let keys = r.out.len() as u64;
    if r.end > r.start {
        let (_, target, job) = &w.arg;
        let tag = (r.start, call);
        let staged = r.out.into_iter().map(|(k, v)| (*job, k, tag, v)).collect();
        target.stage(staged).map_err(|e| {
            format!(
                "staging items {}..{} in the target map: {e}",
                r.start, r.end
            )
        })?;
    }
    Ok(WorkReply {
        start: r.start,
        end: r.end,
        out: Put {
            call,
            items: keys,
            shelf: None,
        },
        stop: r.stop,
        rest: r.rest,
        cpu_s: r.cpu_s,
        wall_s: r.wall_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn claims_are_contiguous_and_steals_take_the_upper_half() {
        let mut c = Cursor { next: 0, end: 100 };
        assert_eq!(c.claim(10), Some((0, 10)));
        assert_eq!(c.steal(1), Some((55, 100)));
        assert_eq!(c.claim(100), Some((10, 55)));
        assert_eq!(c.claim(1), None);
        assert_eq!(c.steal(1), None);
    }

    #[test]
    fn steal_leaves_at_least_min() {
        let mut c = Cursor { next: 0, end: 7 };
        assert_eq!(c.steal(4), None);
        assert_eq!(c.steal(3), Some((3, 7)));
        assert_eq!(c.take_rest(), Some((0, 3)));
        assert_eq!(c.take_rest(), None);
    }

    proptest! {
        /// Any interleaving of claims, steals and hand-backs covers the range exactly
        /// once: claimed chunks, stolen ranges and the rest partition it.
        #[test]
        fn claims_steals_and_rest_partition_the_range(
            end in 0u64..5000,
            ops in proptest::collection::vec((0u8..3, 1u64..300), 0..60),
        ) {
            let mut c = Cursor { next: 0, end };
            let mut pieces: Vec<(u64, u64)> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => pieces.extend(c.claim(n)),
                    1 => pieces.extend(c.steal(n)),
                    _ => if n % 7 == 0 { pieces.extend(c.take_rest()) },
                }
            }
            pieces.extend(c.take_rest());
            pieces.sort();
            let mut at = 0;
            for (s, e) in pieces {
                prop_assert_eq!(s, at);
                prop_assert!(e > s);
                at = e;
            }
            prop_assert_eq!(at, end);
        }
    }
}
