//! The proclet side of a router: the mapping proclet's state ([`MapState`]) and
//! [`Router`], the client handle that caches the map, catches up with it and routes
//! calls to targets with the retry rules of [`crate::outcome`].
//!
//! A `Router` is cheap to clone (clones share one cached [`Replica`]) and serializes as
//! its mapping proclet's handle alone, so a copy sent to another node starts with an
//! empty cache and catches up on first use.

use crate::log::{ChangeLog, Replica};
use crate::outcome::{Answer, Outcome, Retry, RetryPolicy, Step, Unrun};
use granule_runtime::{CallError, Footprint, Proclet, ProcletState, Wire};
use parking_lot::RwLock;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a routed call can fail with, besides its own errors.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// A call to a target or to the mapping proclet failed (it may have run).
    #[error(transparent)]
    Call(#[from] CallError),
    /// The map has no range for the key (a map that was reset or destroyed).
    #[error("no range holds this key")]
    Unmapped,
    /// The key's target kept turning the call away.
    #[error("could not route key {0} in time")]
    Stuck(String),
}

/// How routing sees a failed call: a proclet destroyed before the call reached it
/// refuses before running anything (a target merged away and freed), so the call is
/// provably unrun; any other failure may have run it.
pub fn outcome_of(e: &CallError) -> Outcome {
    match e {
        CallError::ProcletGone(_) => Outcome::NotRun,
        _ => Outcome::Failed,
    }
}

/// What a mapping proclet's state must give the router: its change log. A user may keep
/// more beside it (a sharded structure's sealed flag).
pub trait MapState<K, T>: ProcletState {
    fn log(&self) -> &ChangeLog<K, T>;
}

impl<K, T> MapState<K, T> for ChangeLog<K, T>
where
    K: Ord + Clone + Wire + Sync,
    T: Clone + Wire + Sync,
{
    fn log(&self) -> &ChangeLog<K, T> {
        self
    }
}

impl<K: Ord + Clone, T: Clone> Footprint for ChangeLog<K, T> {
    fn footprint(&self) -> u64 {
        // Targets (proclet handles) and keys: a few dozen bytes each.
        (std::mem::size_of::<Self>() + 96 * (self.kept() + self.table().len())) as u64
    }
}

/// A client of a key-range map: the mapping proclet and a cached copy of its table.
pub struct Router<M, K, T> {
    map: Proclet<M>,
    cache: Arc<RwLock<Replica<K, T>>>,
    /// Set while a catch-up prompted by a target's newer version is under way, so a burst
    /// of replies carrying it causes one.
    refreshing: Arc<AtomicBool>,
}

impl<M, K, T> Clone for Router<M, K, T> {
    fn clone(&self) -> Self {
        Router {
            map: self.map.clone(),
            cache: self.cache.clone(),
            refreshing: self.refreshing.clone(),
        }
    }
}

impl<M, K, T> fmt::Debug for Router<M, K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router").field("map", &self.map).finish()
    }
}

impl<M, K, T> Serialize for Router<M, K, T> {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        self.map.serialize(ser)
    }
}

impl<'de, M, K: Ord, T> Deserialize<'de> for Router<M, K, T> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        Proclet::<M>::deserialize(de).map(|map| Router {
            map,
            cache: Default::default(),
            refreshing: Default::default(),
        })
    }
}

/// Resets the refreshing flag however the catch-up ends (a dropped future included).
struct Refreshing<'a>(&'a AtomicBool);

impl Drop for Refreshing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Sleep without holding a node's worker: inside a closure on a node, the worker is
/// handed to another thread meanwhile (as every Granule wait does).
pub fn pause(d: Duration) {
    if d.is_zero() {
        return;
    }
    if granule_runtime::here().is_some() {
        // The timer is made inside the future: only there is the node's runtime entered.
        granule_runtime::block_on(async move { tokio::time::sleep(d).await });
    } else {
        std::thread::sleep(d);
    }
}

impl<M, K, T> Router<M, K, T>
where
    M: MapState<K, T>,
    K: Ord + Clone + Wire + Sync,
    T: Clone + Wire + Sync,
{
    /// A client of the map in `map`, with an empty cache.
    pub fn new(map: Proclet<M>) -> Self {
        Router {
            map,
            cache: Default::default(),
            refreshing: Default::default(),
        }
    }

    /// The mapping proclet.
    pub fn map(&self) -> &Proclet<M> {
        &self.map
    }

    /// The version of the cached copy.
    pub fn cached_version(&self) -> u64 {
        self.cache.read().version()
    }

    /// Read the cached copy as it is (no catch-up).
    pub fn cached<R>(&self, f: impl FnOnce(&Replica<K, T>) -> R) -> R {
        f(&self.cache.read())
    }

    /// Bring the cached copy up to date.
    pub fn refresh(&self) -> Result<(), CallError> {
        let from = self.cached_version();
        let update = self
            .map
            .run_ref(from, |m: &M, from: u64| m.log().since(from))?;
        self.cache.write().catch_up(from, update);
        Ok(())
    }

    /// [`Router::refresh`] as a future.
    pub async fn refresh_async(&self) -> Result<(), CallError> {
        let from = self.cached_version();
        let update = self
            .map
            .run_ref_async(from, |m: &M, from: u64| m.log().since(from))
            .await?;
        self.cache.write().catch_up(from, update);
        Ok(())
    }

    /// Catch up if a target said the map is at `version`, newer than the cached copy;
    /// one catch-up at a time per cache (the others skip it).
    pub async fn catch_up_to(&self, version: u64) -> Result<(), CallError> {
        if version <= self.cached_version() || self.refreshing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let _reset = Refreshing(&self.refreshing);
        self.refresh_async().await
    }

    /// Every range in key order, as of a fresh copy of the map.
    pub fn ranges(&self) -> Result<Vec<(Option<K>, T)>, CallError> {
        self.refresh()?;
        Ok(self.cache.read().table().to_vec())
    }

    /// [`Router::ranges`] as a future.
    pub async fn ranges_async(&self) -> Result<Vec<(Option<K>, T)>, CallError> {
        self.refresh_async().await?;
        Ok(self.cache.read().table().to_vec())
    }

    fn cached_lookup(&self, key: &K) -> Option<(Option<K>, T)> {
        self.cache
            .read()
            .table()
            .lookup(key)
            .map(|(lo, t)| (lo.clone(), t.clone()))
    }

    /// The range holding `key` (its start and target) per the cached copy, caught up
    /// first if the copy has none.
    pub fn lookup(&self, key: &K) -> Result<(Option<K>, T), RouteError> {
        if let Some(found) = self.cached_lookup(key) {
            return Ok(found);
        }
        self.refresh()?;
        self.cached_lookup(key).ok_or(RouteError::Unmapped)
    }

    /// [`Router::lookup`] as a future.
    pub async fn lookup_async(&self, key: &K) -> Result<(Option<K>, T), RouteError> {
        if let Some(found) = self.cached_lookup(key) {
            return Ok(found);
        }
        self.refresh_async().await?;
        self.cached_lookup(key).ok_or(RouteError::Unmapped)
    }

    /// Call the target holding `key` until one serves the call: `call(target, arg)` sends
    /// it and returns the target's [`Answer`]. A call is sent again only when it provably
    /// did not run; `finish(target)` runs when a target stayed busy past the policy's
    /// patience (its change abandoned by a client that died). Returns the result and the
    /// target that served it.
    pub fn route<A, R, E, C, F>(
        &self,
        key: &K,
        arg: A,
        policy: RetryPolicy,
        call: C,
        mut finish: F,
    ) -> Result<(R, T), E>
    where
        K: fmt::Debug,
        A: Clone,
        E: From<RouteError>,
        C: Fn(&T, A) -> Result<Answer<R, A, T>, CallError>,
        F: FnMut(&T) -> Result<(), E>,
    {
        let mut retry = Retry::new(policy, Instant::now());
        let mut target = self.lookup(key)?.1;
        let mut arg = arg;
        loop {
            // Kept for the one answer that does not hand the argument back: the target
            // was destroyed before the call reached it.
            let backup = arg.clone();
            let unrun = match call(&target, arg) {
                Ok(answer) => match answer.into_result() {
                    Ok(r) => return Ok((r, target)),
                    Err(u) => u,
                },
                Err(e) => unrun_by_error(e, backup)?,
            };
            arg = unrun.arg;
            if let Some(to) = unrun.moved_to {
                target = to;
            }
            match retry.step(unrun.outcome, Instant::now()) {
                Step::Again { catch_up, wait } => {
                    pause(wait);
                    if catch_up {
                        self.refresh().map_err(RouteError::from)?;
                        target = self.lookup(key)?.1;
                    }
                }
                Step::Finish { wait } => {
                    finish(&target)?;
                    pause(wait);
                    self.refresh().map_err(RouteError::from)?;
                    target = self.lookup(key)?.1;
                }
                Step::Return | Step::GiveUp => {
                    return Err(RouteError::Stuck(format!("{key:?}")).into())
                }
            }
        }
    }

    /// [`Router::route`] as a future: `call` and `finish` return futures.
    pub async fn route_async<A, R, E, C, CF, F, FF>(
        &self,
        key: &K,
        arg: A,
        policy: RetryPolicy,
        call: C,
        mut finish: F,
    ) -> Result<(R, T), E>
    where
        K: fmt::Debug,
        A: Clone,
        E: From<RouteError>,
        C: Fn(&T, A) -> CF,
        CF: Future<Output = Result<Answer<R, A, T>, CallError>>,
        F: FnMut(&T) -> FF,
        FF: Future<Output = Result<(), E>>,
    {
        let mut retry = Retry::new(policy, Instant::now());
        let mut target = self.lookup_async(key).await?.1;
        let mut arg = arg;
        loop {
            let backup = arg.clone();
            let unrun = match call(&target, arg).await {
                Ok(answer) => match answer.into_result() {
                    Ok(r) => return Ok((r, target)),
                    Err(u) => u,
                },
                Err(e) => unrun_by_error(e, backup)?,
            };
            arg = unrun.arg;
            if let Some(to) = unrun.moved_to {
                target = to;
            }
            match retry.step(unrun.outcome, Instant::now()) {
                Step::Again { catch_up, wait } => {
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                    if catch_up {
                        self.refresh_async().await.map_err(RouteError::from)?;
                        target = self.lookup_async(key).await?.1;
                    }
                }
                Step::Finish { wait } => {
                    finish(&target).await?;
                    tokio::time::sleep(wait).await;
                    self.refresh_async().await.map_err(RouteError::from)?;
                    target = self.lookup_async(key).await?.1;
                }
                Step::Return | Step::GiveUp => {
                    return Err(RouteError::Stuck(format!("{key:?}")).into())
                }
            }
        }
    }
}

/// A failed call as an unrun answer, if it provably did not run; else the error.
fn unrun_by_error<A, T>(e: CallError, arg: A) -> Result<Unrun<A, T>, RouteError> {
    match outcome_of(&e) {
        Outcome::NotRun => Ok(Unrun {
            outcome: Outcome::NotRun,
            arg,
            moved_to: None,
        }),
        _ => Err(RouteError::Call(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_destroyed_target_proves_a_failed_call_unrun() {
        let gone = CallError::ProcletGone(granule_runtime::ProcletId(7));
        assert_eq!(outcome_of(&gone), Outcome::NotRun);
        let u = unrun_by_error::<u8, u8>(gone, 5).expect("unrun");
        assert_eq!((u.outcome, u.arg, u.moved_to), (Outcome::NotRun, 5, None));
        assert_eq!(outcome_of(&CallError::NoCluster), Outcome::Failed);
        assert!(matches!(
            unrun_by_error::<u8, u8>(CallError::NoCluster, 5),
            Err(RouteError::Call(CallError::NoCluster))
        ));
    }
}
