//! What became of a routed call, and what the caller does next.
//!
//! A target answers every routed call with an [`Answer`]: it ran the call (*served*), or
//! it did not and says why. The one rule that keeps calls from running twice: a call is
//! sent again only when the answer proves it did not run ([`Outcome::may_resend`]).
//! Whatever else goes wrong is returned to the caller ([`Outcome::Failed`]).
//!
//! [`Retry`] turns a stream of outcomes into steps: catch up with the map and call again
//! (at once the first time, since the map usually already has the news; with a doubling
//! wait after that), follow a target's redirect, finish a change whose author seems to
//! have died, or give up. It reads no clock itself: callers pass the time in, so it is
//! tested without sleeping.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What a target answers a routed call: the result, or the argument back, unrun.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer<R, A, T> {
    /// The call ran: its result.
    Served(R),
    /// The key is not this target's (the caller's copy of the map is behind): nothing ran.
    Stale(A),
    /// The target is between two steps of a change of its range (a split): nothing ran.
    Busy(A),
    /// The target no longer serves the key (merged away: *retired*; its context gave the
    /// key away: *unrun*): nothing ran.
    NotRun(A),
    /// The target was merged into that one: nothing ran; call there.
    Moved(A, T),
}

/// An answer whose call did not run: why, the argument back, and where to call next if
/// the target said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unrun<A, T> {
    pub outcome: Outcome,
    pub arg: A,
    pub moved_to: Option<T>,
}

impl<R, A, T> Answer<R, A, T> {
    /// The result if the call ran, else why it did not and its argument.
    pub fn into_result(self) -> Result<R, Unrun<A, T>> {
        let outcome = self.outcome();
        let (arg, moved_to) = match self {
            Answer::Served(r) => return Ok(r),
            Answer::Stale(a) | Answer::Busy(a) | Answer::NotRun(a) => (a, None),
            Answer::Moved(a, t) => (a, Some(t)),
        };
        Err(Unrun {
            outcome,
            arg,
            moved_to,
        })
    }

    /// How routing sees this answer.
    pub fn outcome(&self) -> Outcome {
        match self {
            Answer::Served(_) => Outcome::Served,
            Answer::Stale(_) => Outcome::Stale,
            Answer::Busy(_) => Outcome::Busy,
            Answer::NotRun(_) => Outcome::NotRun,
            Answer::Moved(..) => Outcome::Moved,
        }
    }
}

/// A routed call's outcome, as routing sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It ran: hand the result to the caller.
    Served,
    /// Not run; the caller's map is behind: catch up and call again.
    Stale,
    /// Not run; the target is mid-change: wait, catch up and call again.
    Busy,
    /// Provably not run (retired, turned away unrun, or the target was destroyed before
    /// the call reached it): catch up and send again.
    NotRun,
    /// Not run; the target named its successor: call that one.
    Moved,
    /// Failed, and it may have run: return the error, never send again.
    Failed,
}

impl Outcome {
    /// Whether the call provably did not run, so sending it again cannot run it twice.
    pub fn may_resend(self) -> bool {
        !matches!(self, Outcome::Served | Outcome::Failed)
    }
}

/// How long and how fast a routed call retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Give up after this long without being served.
    pub patience: Duration,
    /// A target busy this long is presumed abandoned mid-change by a client that died:
    /// the caller finishes the change itself ([`Step::Finish`]).
    pub busy_patience: Duration,
    /// The first wait before calling again once calling at once did not help; it doubles
    /// on every further miss, up to `max_wait`.
    pub min_wait: Duration,
    /// The longest wait between two calls.
    pub max_wait: Duration,
}

impl RetryPolicy {
    /// 30 s in all, 200 ms for a busy target, waits from 50 µs doubling to 5 ms.
    pub const DEFAULT: RetryPolicy = RetryPolicy {
        patience: Duration::from_secs(30),
        busy_patience: Duration::from_millis(200),
        min_wait: Duration::from_micros(50),
        max_wait: Duration::from_millis(5),
    };
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::DEFAULT
    }
}

/// What the caller does after an outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Served or failed: hand the result or the error to the caller.
    Return,
    /// Wait `wait`, then (if `catch_up`) bring the map up to date and look the key up
    /// again, and call.
    Again { catch_up: bool, wait: Duration },
    /// The target stayed busy past [`RetryPolicy::busy_patience`]: finish its change,
    /// wait `wait`, catch up and call again.
    Finish { wait: Duration },
    /// Patience ran out.
    GiveUp,
}

/// The retry state of one routed call.
#[derive(Clone, Debug)]
pub struct Retry {
    policy: RetryPolicy,
    started: Instant,
    /// Since when the target has been answering busy (reset once the change is finished).
    busy_since: Option<Instant>,
    /// Misses in a row that were not redirects.
    misses: u32,
    wait: Duration,
}

impl Retry {
    /// A call starting at `now`.
    pub fn new(policy: RetryPolicy, now: Instant) -> Retry {
        Retry {
            policy,
            started: now,
            busy_since: None,
            misses: 0,
            wait: policy.min_wait,
        }
    }

    /// The next wait: none for the first stale or unrun answer (the map has the news by
    /// then: a change is recorded before a target turns calls away for it), then doubling.
    fn backoff(&mut self) -> Duration {
        self.misses += 1;
        if self.misses == 1 {
            return Duration::ZERO;
        }
        let w = self.wait;
        self.wait = (self.wait * 2).min(self.policy.max_wait);
        w
    }

    /// What to do after `outcome`, at `now`.
    pub fn step(&mut self, outcome: Outcome, now: Instant) -> Step {
        if !outcome.may_resend() {
            return Step::Return;
        }
        if now.duration_since(self.started) > self.policy.patience {
            return Step::GiveUp;
        }
        match outcome {
            Outcome::Served | Outcome::Failed => Step::Return,
            Outcome::Moved => Step::Again {
                catch_up: false,
                wait: Duration::ZERO,
            },
            Outcome::Stale | Outcome::NotRun => Step::Again {
                catch_up: true,
                wait: self.backoff(),
            },
            Outcome::Busy => {
                // A split takes a moment: a busy target is always waited for.
                self.misses = self.misses.max(1);
                let wait = self.backoff();
                let since = *self.busy_since.get_or_insert(now);
                if now.duration_since(since) > self.policy.busy_patience {
                    self.busy_since = None;
                    Step::Finish { wait }
                } else {
                    Step::Again {
                        catch_up: true,
                        wait,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: RetryPolicy = RetryPolicy {
        patience: Duration::from_secs(1),
        busy_patience: Duration::from_millis(100),
        min_wait: Duration::from_micros(50),
        max_wait: Duration::from_micros(400),
    };

    fn again(wait_us: u64) -> Step {
        Step::Again {
            catch_up: true,
            wait: Duration::from_micros(wait_us),
        }
    }

    #[test]
    fn only_provably_unrun_calls_are_sent_again() {
        let t0 = Instant::now();
        for o in [Outcome::Served, Outcome::Failed] {
            assert!(!o.may_resend());
            assert_eq!(Retry::new(P, t0).step(o, t0), Step::Return);
        }
        for o in [
            Outcome::Stale,
            Outcome::Busy,
            Outcome::NotRun,
            Outcome::Moved,
        ] {
            assert!(o.may_resend());
            assert_ne!(Retry::new(P, t0).step(o, t0), Step::Return);
        }
        let a: Answer<u8, u8, u8> = Answer::Moved(1, 2);
        assert_eq!(a.outcome(), Outcome::Moved);
        assert_eq!(
            a.into_result(),
            Err(Unrun {
                outcome: Outcome::Moved,
                arg: 1,
                moved_to: Some(2)
            })
        );
        assert_eq!(Answer::<u8, u8, u8>::Served(7).into_result(), Ok(7));
        assert_eq!(
            Answer::<u8, u8, u8>::Busy(3)
                .into_result()
                .map_err(|u| (u.outcome, u.arg)),
            Err((Outcome::Busy, 3))
        );
        assert_eq!(Answer::<u8, u8, u8>::NotRun(1).outcome(), Outcome::NotRun);
    }

    #[test]
    fn the_first_miss_retries_at_once_then_waits_double_up_to_the_cap() {
        let t0 = Instant::now();
        let mut r = Retry::new(P, t0);
        assert_eq!(r.step(Outcome::Stale, t0), again(0));
        assert_eq!(r.step(Outcome::NotRun, t0), again(50));
        assert_eq!(r.step(Outcome::Stale, t0), again(100));
        assert_eq!(r.step(Outcome::Stale, t0), again(200));
        assert_eq!(r.step(Outcome::Stale, t0), again(400));
        assert_eq!(r.step(Outcome::Stale, t0), again(400));
    }

    #[test]
    fn redirects_are_followed_at_once_without_the_map() {
        let t0 = Instant::now();
        let mut r = Retry::new(P, t0);
        for _ in 0..3 {
            assert_eq!(
                r.step(Outcome::Moved, t0),
                Step::Again {
                    catch_up: false,
                    wait: Duration::ZERO
                }
            );
        }
        // Redirects did not count as misses.
        assert_eq!(r.step(Outcome::Stale, t0), again(0));
    }

    #[test]
    fn a_busy_target_is_waited_for_then_its_change_finished() {
        let t0 = Instant::now();
        let mut r = Retry::new(P, t0);
        assert_eq!(r.step(Outcome::Busy, t0), again(50));
        let t1 = t0 + Duration::from_millis(50);
        assert_eq!(r.step(Outcome::Busy, t1), again(100));
        let t2 = t0 + Duration::from_millis(101);
        assert_eq!(
            r.step(Outcome::Busy, t2),
            Step::Finish {
                wait: Duration::from_micros(200)
            }
        );
        // The patience starts over after finishing.
        assert_eq!(r.step(Outcome::Busy, t2), again(400));
    }

    #[test]
    fn patience_runs_out() {
        let t0 = Instant::now();
        let mut r = Retry::new(P, t0);
        let late = t0 + Duration::from_millis(1001);
        for o in [
            Outcome::Stale,
            Outcome::Busy,
            Outcome::NotRun,
            Outcome::Moved,
        ] {
            assert_eq!(r.step(o, late), Step::GiveUp);
        }
        // A result still counts when it comes late.
        assert_eq!(r.step(Outcome::Served, late), Step::Return);
    }
}
