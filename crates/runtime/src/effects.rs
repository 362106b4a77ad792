//! What a closure on a replicated proclet does outside its own state — calls to other
//! proclets, creating and destroying proclets, failpoints it hits, questions to the
//! runtime (where a proclet is, what kind, which node this is, which nodes there are) —
//! recorded on the primary and replayed on its backups, so that none of it happens twice
//! (RIFL-style, as Nu §4.5 describes).
//!
//! While a primary runs a replicated call, its thread carries a *recording* scope: each
//! effect takes the next step number, runs for real with the scope suspended (what the
//! runtime does inside it is not the closure's effect), and its outcome is kept, encoded.
//! A call made as an effect carries an id derived from the replicated call's id and the
//! step, so a retry of the whole call after a failover makes its nested calls under the
//! same ids, and a replicated callee answers them from its record instead of running
//! them again.
//!
//! While a backup re-runs the call, its thread carries a *replaying* scope: each effect
//! returns the outcome the primary recorded at its step, decoded, and does nothing else.
//! The outcomes travel with the call (`Msg::Apply`). For a proclet's first call with
//! effects they were not known when the call was sent (it is sent before it runs on the
//! primary); they follow (`Msg::Effects`) and the backup waits for them at the call's
//! first effect. A backup promoted while it waits is the primary now: it performs the
//! rest of the call's effects itself. An effect that does not match the record (another
//! kind, or one more than the primary made) means the closure is not deterministic: it
//! fails on the backup and the call's result digest is marked as differing.

use crate::error::CallError;
use crate::proclet::Wire;
use bytes::Bytes;
use granule_failpoints::{Fired, Hook, HookDecision};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// How long a backup waits for the effects of a call sent before they were known. The
/// primary sends them right after its run; a primary that died meanwhile is replaced
/// within the failure timeout, and the promoted backup stops waiting at once. A backup
/// that gives up drops its copy and is sent the whole state again.
const LATE_EFFECTS_WAIT: Duration = Duration::from_secs(10);

/// What an effect was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum What {
    /// A call to a proclet (`run`, `run_ref`, `push` and their async forms).
    Call,
    Create,
    Destroy,
    /// `Proclet::location`.
    Locate,
    /// `context::here`.
    Here,
    /// `context::hosted_kind`.
    HostedKind,
    /// `context::cluster_nodes`.
    Nodes,
    /// A failpoint hit (its outcome is whether it fired).
    Failpoint,
}

/// One recorded effect: what it was and its outcome, the value encoded.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Effect {
    what: What,
    outcome: Outcome,
}

/// The effects of one call, in step order.
pub(crate) type Effects = Vec<Effect>;

/// Encode a call's effects for `Msg::Apply` / `Msg::Effects`.
pub(crate) fn encode(effects: &Effects) -> Vec<u8> {
    // A Vec of plain data always encodes.
    postcard::to_allocvec(effects).unwrap_or_default()
}

/// Decode what [`encode`] made.
pub(crate) fn decode(bytes: &[u8]) -> Result<Effects, granule_wire::RemoteError> {
    postcard::from_bytes(bytes).map_err(|e| {
        granule_wire::RemoteError::Protocol(format!("undecodable effects of a call: {e}"))
    })
}

/// The id of the call a replicated call `call` makes at step `step`: the same for a
/// retry of that call, never an id a node hands out (those leave the top bit clear).
fn derived_call_id(call: u64, step: usize) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (call, step as u64).hash(&mut h);
    h.finish() | (1 << 63)
}

/// An effect's outcome, its value encoded.
type Outcome = Result<Vec<u8>, CallError>;

/// A primary's record of the effects of the call it runs.
pub(crate) struct Recorder {
    call: u64,
    /// Each step's effect, and its outcome once it completed.
    steps: Mutex<Vec<(What, Option<Outcome>)>>,
}

impl Recorder {
    pub(crate) fn new(call: u64) -> Arc<Recorder> {
        Arc::new(Recorder {
            call,
            steps: Mutex::new(Vec::new()),
        })
    }

    fn reserve(&self, what: What) -> usize {
        let mut s = self.steps.lock();
        s.push((what, None));
        s.len() - 1
    }

    fn fill(&self, step: usize, outcome: Outcome) {
        if let Some(s) = self.steps.lock().get_mut(step) {
            s.1 = Some(outcome);
        }
    }

    /// The effects recorded (after the closure returned). A future the closure made and
    /// did not wait for has no outcome yet: its backups' copy of it fails, unobserved,
    /// as the closure did not look at it either.
    pub(crate) fn finish(&self) -> Effects {
        std::mem::take(&mut *self.steps.lock())
            .into_iter()
            .map(|(what, outcome)| Effect {
                what,
                outcome: outcome.unwrap_or_else(|| {
                    Err(CallError::Internal(
                        "not finished when the closure on the primary returned".into(),
                    ))
                }),
            })
            .collect()
    }
}

/// What a backup waiting for a call's effects hears.
#[derive(Clone, Debug, Default)]
pub(crate) enum Late {
    #[default]
    Nothing,
    /// The effects of call `seq`.
    Effects { seq: u64, effects: Arc<Effects> },
    /// This copy is the primary now.
    Promoted,
}

/// A backup's replay of one call's effects.
pub(crate) struct Replayer {
    call: u64,
    seq: u64,
    effects: Mutex<Option<Arc<Effects>>>,
    late: tokio::sync::watch::Receiver<Late>,
    next: AtomicUsize,
    /// Promoted while replaying: the rest of the effects happen here, for real.
    live: AtomicBool,
    /// An effect did not match the record: the closure is not deterministic.
    mismatched: AtomicBool,
    /// The effects never came: the copy is no longer consistent.
    abandoned: AtomicBool,
}

impl Replayer {
    pub(crate) fn new(
        call: u64,
        seq: u64,
        effects: Option<Arc<Effects>>,
        late: tokio::sync::watch::Receiver<Late>,
    ) -> Arc<Replayer> {
        Arc::new(Replayer {
            call,
            seq,
            effects: Mutex::new(effects),
            late,
            next: AtomicUsize::new(0),
            live: AtomicBool::new(false),
            mismatched: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
        })
    }

    /// Whether an effect differed from the primary's record.
    pub(crate) fn mismatched(&self) -> bool {
        self.mismatched.load(Ordering::Relaxed)
    }

    /// Whether the effects never came (the copy must be dropped and sent again).
    pub(crate) fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Whether the call had effects (the proclet's later calls are sent with theirs).
    pub(crate) fn used(&self) -> bool {
        self.next.load(Ordering::Relaxed) > 0
    }

    /// The recorded outcome of the next step, if it is a `what`: waits for effects that
    /// follow the call. `Err(None)`: promoted meanwhile, perform it.
    fn take(&self, what: What) -> Result<Outcome, Option<CallError>> {
        let step = self.next.fetch_add(1, Ordering::Relaxed);
        if self.live.load(Ordering::Relaxed) {
            return Err(None);
        }
        // Taken out first: the lock must not be held while waiting below.
        let known = self.effects.lock().clone();
        let effects = match known {
            Some(e) => e,
            None => match self.wait_late() {
                Some(e) => e,
                None if self.live.load(Ordering::Relaxed) => return Err(None),
                None => {
                    self.abandoned.store(true, Ordering::Relaxed);
                    return Err(Some(CallError::Internal(
                        "a backup re-running a call never received what the call did on the \
                         primary"
                            .into(),
                    )));
                }
            },
        };
        match effects.get(step) {
            Some(e) if e.what == what => Ok(e.outcome.clone()),
            other => {
                self.mismatched.store(true, Ordering::Relaxed);
                let found = other.map_or("nothing".to_string(), |e| format!("{:?}", e.what));
                tracing::error!(call = self.call, seq = self.seq, step, ?what, %found,
                    "a backup re-running a call made another effect than the primary did: \
                     the closure is not deterministic (see docs/guide/replication.md)");
                Err(Some(CallError::Internal(format!(
                    "replaying step {step} of a replicated call: the primary made {found} here, \
                     this copy {what:?}"
                ))))
            }
        }
    }

    /// Wait for the effects of this call to follow it; `None` if they did not come in
    /// time or this copy was promoted meanwhile (then `live` is set).
    fn wait_late(&self) -> Option<Arc<Effects>> {
        let seq = self.seq;
        let mut rx = self.late.clone();
        let wait = async move {
            let r = rx
                .wait_for(|l| {
                    matches!(l, Late::Promoted)
                        || matches!(l, Late::Effects { seq: s, .. } if *s == seq)
                })
                .await;
            r.map(|l| l.clone()).ok()
        };
        let got = crate::context::block_on(
            wait,
            Some(Instant::now() + LATE_EFFECTS_WAIT),
            Duration::ZERO,
        );
        match got.flatten() {
            Some(Late::Effects { effects, .. }) => {
                *self.effects.lock() = Some(effects.clone());
                Some(effects)
            }
            Some(Late::Promoted) => {
                self.live.store(true, Ordering::Relaxed);
                None
            }
            _ => None,
        }
    }
}

/// The scope a closure on a replicated proclet runs in.
#[derive(Clone)]
pub(crate) enum Scope {
    Record(Arc<Recorder>),
    Replay(Arc<Replayer>),
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
    /// Whether `SCOPE` holds one (read without borrowing it).
    static IN_SCOPE: Cell<bool> = const { Cell::new(false) };
    /// The id the call being made as an effect must carry (0: none given).
    static PRESET_CALL: Cell<u64> = const { Cell::new(0) };
}

#[inline]
fn current() -> Option<Scope> {
    // Every call and failpoint hit asks: outside a replicated proclet's closure (nearly
    // always) one flag read answers.
    if !IN_SCOPE.with(|f| f.get()) {
        return None;
    }
    SCOPE.with(|s| s.borrow().clone())
}

/// Put `scope` on this thread, returning what was there.
fn swap(scope: Option<Scope>) -> Option<Scope> {
    IN_SCOPE.with(|f| f.set(scope.is_some()));
    SCOPE.with(|s| std::mem::replace(&mut *s.borrow_mut(), scope))
}

/// The process's failpoint hook: failpoints hit under a scope are effects.
struct FailpointHook;
static FAILPOINT_HOOK: FailpointHook = FailpointHook;

/// A scope entered on this thread; dropping it puts back the one before.
pub(crate) struct Entered(Option<Scope>);

/// Run the closure that follows under `scope` until the guard drops.
pub(crate) fn enter(scope: Scope) -> Entered {
    granule_failpoints::set_hook(&FAILPOINT_HOOK);
    Entered(swap(Some(scope)))
}

/// Leave this thread's scope while an effect runs for real.
fn suspend() -> Entered {
    Entered(swap(None))
}

impl Drop for Entered {
    fn drop(&mut self) {
        swap(self.0.take());
    }
}

/// The call id a call made now must carry (0: make one). Read by the call paths when a
/// call starts.
pub(crate) fn preset_call_id() -> u64 {
    PRESET_CALL.with(|p| p.get())
}

/// [`preset_call_id`], or `make()` when none is given.
pub(crate) fn preset_call_id_or(make: impl FnOnce() -> u64) -> u64 {
    match preset_call_id() {
        0 => make(),
        id => id,
    }
}

struct Preset(u64);
fn preset(call: u64) -> Preset {
    Preset(PRESET_CALL.with(|p| p.replace(call)))
}
impl Drop for Preset {
    fn drop(&mut self) {
        PRESET_CALL.with(|p| p.set(self.0));
    }
}

fn encode_outcome<R: Serialize>(r: &Result<R, CallError>) -> Outcome {
    match r {
        Ok(v) => postcard::to_allocvec(v)
            .map_err(|e| CallError::Decode(format!("cannot record a call's result: {e}"))),
        Err(e) => Err(e.clone()),
    }
}

fn decode_outcome<R: Wire>(o: Outcome) -> Result<R, CallError> {
    let bytes = Bytes::from(o?);
    crate::proclet::decode_reply(&bytes)
}

/// Run effect `what` of the calling code: outside a replicated proclet's closure just
/// `run()`; on its primary `run()` recorded; on its backup the recorded outcome.
#[inline]
pub(crate) fn sync_effect<R: Wire>(
    what: What,
    run: impl FnOnce() -> Result<R, CallError>,
) -> Result<R, CallError> {
    let Some(scope) = current() else {
        return run();
    };
    match scope {
        Scope::Record(rec) => {
            let step = rec.reserve(what);
            let r = {
                let _out = suspend();
                let _id = preset(derived_call_id(rec.call, step));
                run()
            };
            rec.fill(step, encode_outcome(&r));
            r
        }
        Scope::Replay(rep) => match rep.take(what) {
            Ok(outcome) => decode_outcome(outcome),
            Err(Some(e)) => Err(e),
            Err(None) => {
                let step = rep.next.load(Ordering::Relaxed) - 1;
                let _out = suspend();
                let _id = preset(derived_call_id(rep.call, step));
                run()
            }
        },
    }
}

type Boxed<R> = Pin<Box<dyn Future<Output = Result<R, CallError>> + Send>>;

/// [`sync_effect`] for an effect that is a future: `make` is called now (it must do its
/// synchronous part at once), the outcome is recorded when the future completes.
pub(crate) fn async_effect<R, F>(
    what: What,
    make: impl FnOnce() -> F,
) -> futures::future::Either<F, Boxed<R>>
where
    R: Wire,
    F: Future<Output = Result<R, CallError>> + Send + 'static,
{
    use futures::future::Either;
    let Some(scope) = current() else {
        return Either::Left(make());
    };
    let (call, step, rec) = match scope {
        Scope::Record(rec) => (rec.call, rec.reserve(what), Some(rec)),
        Scope::Replay(rep) => match rep.take(what) {
            Ok(outcome) => {
                let r = decode_outcome(outcome);
                return Either::Right(Box::pin(async move { r }));
            }
            Err(Some(e)) => return Either::Right(Box::pin(async move { Err(e) })),
            Err(None) => (rep.call, rep.next.load(Ordering::Relaxed) - 1, None),
        },
    };
    let fut = {
        let _out = suspend();
        let _id = preset(derived_call_id(call, step));
        Unscoped(Box::pin(make()))
    };
    Either::Right(Box::pin(async move {
        let r = fut.await;
        if let Some(rec) = rec {
            rec.fill(step, encode_outcome(&r));
        }
        r
    }))
}

/// A future polled with this thread's scope suspended: it is the runtime's work of one
/// effect (its own failpoints and questions are not the closure's).
struct Unscoped<F>(Pin<Box<F>>);

impl<F: Future> Future for Unscoped<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _out = suspend();
        self.0.as_mut().poll(cx)
    }
}

impl Hook for FailpointHook {
    fn before(&self, name: &'static str) -> HookDecision {
        match current() {
            Some(scope) => scope.before(name),
            None => HookDecision::Pass,
        }
    }

    fn after(&self, token: u64, name: &'static str, outcome: &Result<(), Fired>) {
        if let Some(scope) = current() {
            scope.after(token, name, outcome);
        }
    }
}

impl Scope {
    fn before(&self, name: &'static str) -> HookDecision {
        match self {
            Scope::Record(rec) => HookDecision::Take(rec.reserve(What::Failpoint) as u64),
            Scope::Replay(rep) => match rep.take(What::Failpoint) {
                Ok(Ok(bytes)) => match postcard::from_bytes::<(String, bool)>(&bytes) {
                    Ok((recorded, fired)) if recorded == name => {
                        HookDecision::Answer(if fired { Err(Fired(name)) } else { Ok(()) })
                    }
                    _ => {
                        rep.mismatched.store(true, Ordering::Relaxed);
                        HookDecision::Answer(Err(Fired(name)))
                    }
                },
                Ok(Err(_)) | Err(Some(_)) => HookDecision::Answer(Err(Fired(name))),
                // Promoted while waiting: this copy takes the step itself.
                Err(None) => HookDecision::Take(u64::MAX),
            },
        }
    }

    fn after(&self, token: u64, name: &'static str, outcome: &Result<(), Fired>) {
        if let Scope::Record(rec) = self {
            let bytes =
                postcard::to_allocvec(&(name.to_string(), outcome.is_err())).unwrap_or_default();
            rec.fill(token as usize, Ok(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replayer(effects: Effects) -> Arc<Replayer> {
        let (_tx, rx) = tokio::sync::watch::channel(Late::Nothing);
        Replayer::new(7, 1, Some(Arc::new(effects)), rx)
    }

    #[test]
    fn a_recorded_call_is_replayed_without_running_and_an_unrecorded_one_is_a_mismatch() {
        let rec = Recorder::new(7);
        let ran = Cell::new(0);
        let r: Result<u64, CallError> = {
            let _s = enter(Scope::Record(rec.clone()));
            sync_effect(What::Call, || {
                ran.set(ran.get() + 1);
                // The effect itself runs outside the scope, under a derived id.
                assert!(current().is_none());
                assert_eq!(preset_call_id(), derived_call_id(7, 0));
                Ok(41)
            })
        };
        assert_eq!(r, Ok(41));
        let effects = rec.finish();
        assert_eq!(effects.len(), 1);

        let rep = replayer(effects);
        let _s = enter(Scope::Replay(rep.clone()));
        let again: Result<u64, CallError> = sync_effect(What::Call, || {
            ran.set(ran.get() + 1);
            Ok(0)
        });
        assert_eq!(again, Ok(41));
        assert_eq!(ran.get(), 1, "the backup must not run the effect");
        assert!(!rep.mismatched());
        // One more effect than the primary made.
        let extra: Result<u64, CallError> = sync_effect(What::Create, || Ok(0));
        assert!(extra.is_err());
        assert!(rep.mismatched());
    }

    #[test]
    fn failpoint_outcomes_are_recorded_and_replayed() {
        let rec = Recorder::new(9);
        {
            let _s = enter(Scope::Record(rec.clone()));
            assert_eq!(granule_failpoints::hit_blocking("user.in_closure"), Ok(()));
        }
        let mut effects = rec.finish();
        assert_eq!(effects[0].what, What::Failpoint);
        // As if it had fired on the primary: the backup answers "fired" without arming.
        effects[0].outcome =
            Ok(postcard::to_allocvec(&("user.in_closure".to_string(), true)).unwrap());
        let rep = replayer(effects);
        let _s = enter(Scope::Replay(rep.clone()));
        assert_eq!(
            granule_failpoints::hit_blocking("user.in_closure"),
            Err(Fired("user.in_closure"))
        );
        assert!(!rep.mismatched());
    }

    #[test]
    fn derived_ids_are_stable_and_never_collide_with_node_ids() {
        assert_eq!(derived_call_id(5, 2), derived_call_id(5, 2));
        assert_ne!(derived_call_id(5, 2), derived_call_id(5, 3));
        assert_ne!(derived_call_id(5, 2), derived_call_id(6, 2));
        assert!(derived_call_id(5, 2) >> 63 == 1);
    }
}
