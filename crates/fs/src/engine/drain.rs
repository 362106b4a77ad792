//! Stores leaving: a store lost (its copies dropped, stripes re-replicated from what
//! remains) or drained (every stripe moved to the next store in its order before the
//! store retires, within a revoked lease's grace when there is one).

use super::Engine;
use crate::meta::{Ino, Node, Stripe};
use crate::placement::{stripe_key, StoreId};
use crate::stores::{Store, StoreState};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// What moving one stripe off a leaving store came to.
enum Move {
    Moved,
    /// The leaving copy was dropped; another copy remains.
    Dropped,
    Lost,
    Raced,
    Stuck,
}

impl Engine {
    /// A store stopped answering: its copies are dropped from the metadata, and stripes
    /// left with fewer copies than wanted get new ones from what remains.
    pub fn store_lost(self: &Arc<Self>, id: StoreId) {
        let Some(s) = self.stores.get(id) else { return };
        if s.state() == StoreState::Gone {
            return;
        }
        s.set_state(StoreState::Gone);
        tracing::warn!(store = %s.name, "store lost: its stripes are re-replicated where copies remain");
        let me = self.clone();
        self.rt
            .spawn(async move { me.evacuate(id, false, None).await });
    }

    /// Move every stripe off store `id` (drain): each goes to the next store in its
    /// order; the store is then retired. Returns stripes moved and stripes lost. With a
    /// `deadline` (a revoked lease's grace), stripes with no other copy go first, and the
    /// drain widens when its pace would miss the deadline.
    pub async fn drain(
        self: &Arc<Self>,
        id: StoreId,
        deadline: Option<Instant>,
    ) -> Result<(u64, u64), String> {
        let s = self
            .stores
            .get(id)
            .ok_or_else(|| format!("no store {id}"))?;
        // One drain per store: a second request (a refused lease renewal after the
        // revocation, an operator's `granule fs drain`) finds it draining already.
        match s.begin_drain() {
            Ok(()) => {}
            Err(StoreState::Gone) => return Err(format!("store {} is already gone", s.name)),
            Err(_) => return Err(format!("store {} is already draining", s.name)),
        }
        self.evacuate_drained(&s, deadline).await
    }

    /// [`Engine::drain`] started now (the store takes no new stripes from this moment),
    /// finished on the mount's runtime.
    pub fn start_drain(self: &Arc<Self>, id: StoreId) -> Result<(), String> {
        let s = self
            .stores
            .get(id)
            .ok_or_else(|| format!("no store {id}"))?;
        s.begin_drain()
            .map_err(|st| format!("store {} is {st:?}, not active", s.name))?;
        let e = self.clone();
        self.rt
            .spawn(async move { e.evacuate_drained(&s, None).await });
        Ok(())
    }

    async fn evacuate_drained(
        self: &Arc<Self>,
        s: &Arc<Store>,
        deadline: Option<Instant>,
    ) -> Result<(u64, u64), String> {
        let id = s.id;
        tracing::info!(store = %s.name, "draining");
        let (moved, mut lost) = self.evacuate(id, true, deadline).await;
        s.set_state(StoreState::Gone);
        let (left, sole) = {
            let ns = self.ns.lock();
            (ns.stripes_on(id).len(), ns.sole_copies_on(id))
        };
        if left > 0 {
            tracing::error!(
                store = %s.name,
                "{left} stripes could not move off the store (no room elsewhere): the {sole} with no other copy are lost when it goes"
            );
            lost += sole as u64;
        }
        tracing::info!(store = %s.name, moved, lost, "drained");
        Ok((moved, lost))
    }

    async fn evacuate(
        self: &Arc<Self>,
        id: StoreId,
        readable: bool,
        deadline: Option<Instant>,
    ) -> (u64, u64) {
        let Some(src) = self.stores.get(id) else {
            return (0, 0);
        };
        let (mut moved, mut lost) = (0u64, 0u64);
        let started = Instant::now();
        let mut late = false;
        loop {
            // Stripes with no other copy first (see `stripes_on`).
            let todo = self.ns.lock().stripes_on(id);
            if todo.is_empty() {
                break;
            }
            self.n.draining.store(todo.len() as u64, Ordering::Relaxed);
            let mut progress = false;
            let mut at = 0;
            while at < todo.len() {
                // Four stripes at a time leaves room for the mount's own I/O; sixteen when
                // that pace would not empty the store before its deadline.
                let width = match deadline {
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() && !late {
                            late = true;
                            tracing::warn!(
                                store = %src.name,
                                "{} stripes are still on the store after its grace ended: those with no other copy are lost if it goes now",
                                todo.len() - at
                            );
                        }
                        let done = moved + lost;
                        let pace = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
                        let need = (todo.len() - at) as f64;
                        if done == 0 || need > pace * left.as_secs_f64() * 0.8 {
                            16
                        } else {
                            4
                        }
                    }
                    None => 4,
                };
                let chunk = &todo[at..(at + width).min(todo.len())];
                at += chunk.len();
                let jobs = chunk
                    .iter()
                    .map(|&(ino, idx, version)| self.move_one(&src, ino, idx, version, readable));
                for r in futures::future::join_all(jobs).await {
                    match r {
                        Move::Moved | Move::Dropped => {
                            moved += 1;
                            progress = true;
                        }
                        Move::Lost => {
                            lost += 1;
                            progress = true;
                        }
                        Move::Raced => progress = true,
                        Move::Stuck => {}
                    }
                }
            }
            if !progress {
                tracing::error!(store = %src.name, "stripes cannot move off the store (no room elsewhere)");
                break;
            }
        }
        self.n.draining.store(0, Ordering::Relaxed);
        self.n.moved.fetch_add(moved, Ordering::Relaxed);
        (moved, lost)
    }

    async fn move_one(
        self: &Arc<Self>,
        src: &Arc<Store>,
        ino: Ino,
        idx: u64,
        version: u64,
        readable: bool,
    ) -> Move {
        let (meta, layout, name) = {
            let ns = self.ns.lock();
            let Ok(i) = ns.get(ino) else {
                return Move::Raced;
            };
            match &i.node {
                Node::File { stripes, layout } => match stripes.get(&idx) {
                    Some(s) if s.version == version && s.copies.contains(&src.id) => {
                        (s.clone(), *layout, i.name.clone())
                    }
                    _ => return Move::Raced,
                },
                _ => return Move::Raced,
            }
        };
        let others: Vec<StoreId> = meta
            .copies
            .iter()
            .copied()
            .filter(|&c| c != src.id)
            .collect();
        let want_new = others.len() < self.settings.replicas;
        // The bytes: from the leaving store while it still answers, else from a copy.
        let mut data = None;
        if readable {
            match src.get(version).await {
                Ok(Some(d)) => data = Some(d),
                Ok(None) => {}
                // Not answering just now: try again later rather than give the copy up.
                Err(_) if others.is_empty() => return Move::Stuck,
                Err(_) => {}
            }
        }
        if data.is_none() && want_new {
            let m = Stripe {
                copies: others.clone(),
                ..meta.clone()
            };
            if !others.is_empty() {
                data = self
                    .fetch_from_stores(idx, &m, layout, ino, &name)
                    .await
                    .ok();
            }
        }
        let mut new_copy = None;
        if want_new {
            if let Some(d) = &data {
                let mut exclude = meta.copies.clone();
                exclude.push(src.id);
                let targets = self.place(
                    &self.layout(layout),
                    stripe_key(ino, idx),
                    d.len(),
                    1,
                    &exclude,
                );
                if let Some(t) = targets.first() {
                    match t.put(version, d).await {
                        Ok(()) => new_copy = Some(t.clone()),
                        Err(e) => {
                            t.unreserve(t.stored_size(d.len()));
                            tracing::warn!(store = %t.name, "moving a stripe: {e}");
                        }
                    }
                }
            }
            // No store to take it: with a copy elsewhere the stripe lives on with one
            // copy fewer (status counts it under "replicas missing"); with none, it stays
            // on the leaving store while that still answers.
            if new_copy.is_none() && others.is_empty() && readable && data.is_some() {
                return Move::Stuck;
            }
        }
        let stored = meta.stored as usize;
        // Switch the metadata over, unless the stripe changed meanwhile.
        let switched = {
            let mut ns = self.ns.lock();
            match ns.get_mut(ino).map(|i| &mut i.node) {
                Ok(Node::File { stripes, .. }) => match stripes.get_mut(&idx) {
                    Some(s) if s.version == version => {
                        s.copies.retain(|&c| c != src.id);
                        if let Some(t) = &new_copy {
                            s.copies.push(t.id);
                        }
                        true
                    }
                    _ => false,
                },
                _ => false,
            }
        };
        if !switched {
            if let Some(t) = new_copy {
                let _ = t.delete(version, t.stored_size(stored)).await;
            }
            return Move::Raced;
        }
        let _ = src.delete(version, src.stored_size(stored)).await;
        if new_copy.is_none() && others.is_empty() {
            self.n.lost_stripes.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                store = %src.name,
                "stripe {idx} of file {name:?} (inode {ino}) was only on a store that is gone: it is lost; reads of it fail with EIO"
            );
            return Move::Lost;
        }
        if new_copy.is_none() {
            return Move::Dropped;
        }
        Move::Moved
    }
}
