//! Calls to one shard at a time of a *sealed* structure, on the I/O path or pushed onto
//! the shard node's pushdown pool: what an executor that decides per shard (compute
//! pushdown's cost rule) needs, where [`crate::AutoSharder::offload`] runs the same code
//! on every shard.
//!
//! Sealed, a structure's shards neither split nor merge, so a handle stays valid for as
//! long as the structure stays sealed (a shard may still migrate: calls follow it).

use crate::sharder::Cell;
use crate::{Shard, ShardError};
use granule_runtime::{NodeId, Proclet, PushOpts, Wire};
use std::future::Future;

/// One shard of a sealed structure.
pub struct SealedShard<S: Shard> {
    proclet: Proclet<Cell<S>>,
}

impl<S: Shard> Clone for SealedShard<S> {
    fn clone(&self) -> Self {
        SealedShard {
            proclet: self.proclet.clone(),
        }
    }
}

impl<S: Shard> SealedShard<S> {
    pub(crate) fn new(proclet: Proclet<Cell<S>>) -> SealedShard<S> {
        SealedShard { proclet }
    }

    /// The shard's proclet.
    pub fn proclet(&self) -> &Proclet<Cell<S>> {
        &self.proclet
    }

    /// The node holding the shard now.
    pub fn location(&self) -> Result<NodeId, ShardError> {
        Ok(self.proclet.location()?)
    }

    /// Run `f(&shard, arg)` as an ordinary shared call (on the thread that receives it;
    /// for short reads such as fetching a block).
    pub fn read<A, R, F>(&self, arg: A, f: F) -> Result<R, ShardError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        Ok(self
            .proclet
            .run_ref(arg, move |c: &Cell<S>, a: A| f(c.data(), a))?)
    }

    /// [`SealedShard::read`] as a future.
    pub fn read_async<A, R, F>(
        &self,
        arg: A,
        f: F,
    ) -> impl Future<Output = Result<R, ShardError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        // The wrapper captures only `f`, itself zero-sized, so it travels as code.
        let call = self
            .proclet
            .run_ref_async(arg, move |c: &Cell<S>, a: A| f(c.data(), a));
        async move { Ok(call.await?) }
    }

    /// Run `f(&shard, arg)` as a pushed call on the shard node's pushdown pool (see
    /// `Proclet::push`: bounded, CPU-capped, with a memory budget and a timeout).
    pub fn push<A, R, F>(&self, opts: PushOpts, arg: A, f: F) -> Result<R, ShardError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        Ok(self
            .proclet
            .push(opts, arg, move |c: &Cell<S>, a: A| f(c.data(), a))?)
    }

    /// [`SealedShard::push`] as a future (dropping it cancels the call if it has not
    /// started).
    pub fn push_async<A, R, F>(
        &self,
        opts: PushOpts,
        arg: A,
        f: F,
    ) -> impl Future<Output = Result<R, ShardError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let call = self
            .proclet
            .push_async(opts, arg, move |c: &Cell<S>, a: A| f(c.data(), a));
        async move { Ok(call.await?) }
    }
}
