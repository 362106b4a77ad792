//! Named failpoints: places in Granule's code where a test makes a step fail, wait, or
//! crash the whole process, on purpose and at exactly that step — so failure tests do not
//! depend on killing a process inside a timing window.
//!
//! A failpoint is a name from [`CATALOGUE`] placed in the code with [`hit`] (async code)
//! or [`hit_blocking`] (threads). Unarmed, a hit costs one relaxed atomic load. Armed
//! with a *spec*, each hit takes the next step of the spec:
//!
//! | action | effect at the hit |
//! |---|---|
//! | `off` | nothing |
//! | `error` | the step fails: [`hit`] returns [`Fired`] and the caller fails the step as if its I/O had failed |
//! | `delay(D)` | wait `D` (e.g. `delay(50ms)`), then go on |
//! | `pause` | wait until the failpoint is re-armed or cleared ([`set`], [`clear`]) |
//! | `crash` | the process kills itself with SIGKILL: no clean-up, as a machine failure |
//!
//! A spec is a sequence of `[N*]action` terms joined by `->`; a term with a count applies
//! to that many hits, the last one to every later hit. `2*off->crash`: the first two hits
//! pass, the third crashes. `1*error`: only the first hit fails.
//!
//! Failpoints are per process. A node is armed from its configuration
//! (`faults.failpoints`, at start) or by its driver at run time (the runtime's fault
//! orders, accepted only when `faults.enabled` is on). Every action taken is recorded in
//! a bounded trace ([`trace`]) that a failing test can print.
//!
//! This crate owns the catalogue, the specs and their evaluation; it knows nothing of
//! nodes or connections.
#![forbid(unsafe_code)]

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Every failpoint in Granule, with where it sits. Arming a name not listed here is an
/// error (a typo must not silently test nothing).
pub const CATALOGUE: &[(&str, &str)] = &[
    (
        "node.start",
        "a node process (not a driver) starting, before it registers: error fails its start-up (it exits with status 3)",
    ),
    (
        "migrate.before_lock",
        "source of a move: before it takes the proclet's lock (calls still run)",
    ),
    (
        "migrate.locked",
        "source of a move: the proclet's lock is held (writes are held), before streaming",
    ),
    (
        "stream.chunk_sent",
        "sender of a state stream (the source of a move): after each chunk is handed to the connection",
    ),
    (
        "migrate.streamed",
        "source of a move: the destination confirmed the install, before the source lets held calls go there",
    ),
    (
        "migrate.before_controller",
        "source of a move: held calls released to the destination, before the controller is told",
    ),
    (
        "stream.chunk_received",
        "receiver of a state stream (the destination of a move, or a new backup copy): each arriving chunk, before it is kept (error or crash: it runs on the connection's reader)",
    ),
    (
        "migrate.before_install",
        "destination of a move: the whole state arrived and was decoded, before it is installed",
    ),
    (
        "migrate.installed",
        "destination of a move: installed, before it confirms to the source (error: the copy is dropped again and the move refused)",
    ),
    (
        "call.before_run",
        "a node serving a remote call: the proclet's lock is held, before the closure runs",
    ),
    (
        "call.before_reply",
        "a node serving a remote call: the closure ran, before the answer is sent",
    ),
    (
        "replicate.before_reply",
        "the primary of a replicated proclet: a mutating call ran here and every backup applied it, before the answer is sent (crash: the caller asks the new primary, which answers from its record)",
    ),
    (
        "replicate.after_send",
        "the primary of a replicated proclet: a mutating call was sent to one backup, before it goes to the next (crash with two backups: one has the call and one does not)",
    ),
    (
        "replicate.before_apply",
        "a backup of a replicated proclet: a call arrived from the primary, before it runs here (crash: the primary holds the call until the controller drops this backup)",
    ),
    (
        "replicate.move.streamed",
        "the primary of a replicated proclet moving to a node with no copy: the state was streamed there, before the controller is asked to make it the primary (crash: a backup takes over; the copy sent is never used)",
    ),
    (
        "replicate.move.handed_over",
        "the primary of a replicated proclet moving: the controller made the destination the primary, before this node lets go of its copy (crash: the new primary goes on, at one copy fewer until it restores them)",
    ),
    (
        "sharded.merge.before_record",
        "left shard of a sharded structure's merge: the right shard's data taken, before the map records the merge (error: the map keeps naming the merged-away shard)",
    ),
    (
        "fs.read.in_place",
        "the file-system mount: a stripe read in place from an own store's shared memory, before the read is answered (delay: the reader holds the stripe while a rewrite may delete it)",
    ),
    (
        "fs.metacopy.made",
        "the file-system mount: a new metadata copy was made on an own node, before it is sent the namespace and recorded (delay or pause: a clean stop meets a copy being made; error does nothing more)",
    ),
    (
        "sharded.split.before_begin",
        "client splitting a sharded structure's shard that a write grew past its upper bound: before the split's first step (error: this split fails, the shard stays as it is)",
    ),
    (
        "sharded.split.before_thaw",
        "client finishing a sharded structure's split: the parent dropped its copy of the split-off part, before the new shard thaws (error: the new shard stays frozen)",
    ),
    (
        "user.in_closure",
        "for closures that want a failpoint of their own (a replicated proclet's closure in the tests): hit where the closure hits it; on a replicated proclet the primary takes it and its backups replay the outcome",
    ),
    (
        "heartbeat.send",
        "a node: before each heartbeat to the controller (error: skip this heartbeat)",
    ),
];

/// One term of a spec.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Off,
    Error,
    Delay(Duration),
    Pause,
    Crash,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Off => write!(f, "off"),
            Action::Error => write!(f, "error"),
            Action::Delay(d) => write!(f, "delay({}us)", d.as_micros()),
            Action::Pause => write!(f, "pause"),
            Action::Crash => write!(f, "crash"),
        }
    }
}

/// A parsed spec: actions with their counts (`None`: for ever).
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    terms: Vec<(Option<u64>, Action)>,
}

/// Why a failpoint could not be armed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("unknown failpoint '{0}' (known: {1})")]
    Unknown(String, String),
    #[error("failpoint {name}: bad spec '{spec}': {why} (e.g. off, error, delay(50ms), pause, crash, 2*off->crash)")]
    Bad {
        name: String,
        spec: String,
        why: String,
    },
}

/// A hit that fired `error`: the step must fail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("failpoint {0} fired")]
pub struct Fired(pub &'static str);

fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let at = s.find(|c: char| !c.is_ascii_digit())?;
    let n: u64 = s[..at].parse().ok()?;
    match &s[at..] {
        "us" => Some(Duration::from_micros(n)),
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        _ => None,
    }
}

impl Spec {
    /// Parse `[N*]action(->[N*]action)*`.
    pub fn parse(name: &str, spec: &str) -> Result<Spec, SpecError> {
        let bad = |why: String| SpecError::Bad {
            name: name.into(),
            spec: spec.into(),
            why,
        };
        let mut terms = Vec::new();
        for term in spec.split("->").map(str::trim) {
            let (count, action) = match term.split_once('*') {
                Some((n, a)) => (
                    Some(
                        n.trim()
                            .parse::<u64>()
                            .map_err(|_| bad(format!("'{n}' is not a count")))?,
                    ),
                    a.trim(),
                ),
                None => (None, term),
            };
            let action = match action {
                "off" => Action::Off,
                "error" => Action::Error,
                "pause" => Action::Pause,
                "crash" => Action::Crash,
                a if a.starts_with("delay(") && a.ends_with(')') => Action::Delay(
                    parse_duration(&a[6..a.len() - 1])
                        .ok_or_else(|| bad(format!("'{a}': use delay(10ms), delay(500us)")))?,
                ),
                other => return Err(bad(format!("unknown action '{other}'"))),
            };
            terms.push((count, action));
        }
        if terms.is_empty() {
            return Err(bad("empty".into()));
        }
        Ok(Spec { terms })
    }

    /// The action for the hit numbered `n` (0-based).
    fn action_at(&self, mut n: u64) -> &Action {
        for (count, action) in &self.terms {
            match count {
                Some(c) if n >= *c => n -= c,
                _ => return action,
            }
        }
        // Every term had a count and all are used up: off from now on.
        &Action::Off
    }
}

/// An armed failpoint: its spec and how often it was hit since it was armed.
struct Armed {
    spec: Spec,
    hits: u64,
    /// Bumped whenever the failpoint is re-armed or cleared (wakes paused hits).
    generation: u64,
}

struct Registry {
    armed: Mutex<HashMap<&'static str, Armed>>,
    changed: tokio::sync::Notify,
    changed_sync: parking_lot::Condvar,
    changed_lock: Mutex<u64>,
    trace: Mutex<VecDeque<TraceEntry>>,
    started: Instant,
}

/// How many failpoints are armed (the fast "nothing to do" check).
static ARMED: AtomicUsize = AtomicUsize::new(0);

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Registry {
        armed: Mutex::new(HashMap::new()),
        changed: tokio::sync::Notify::new(),
        changed_sync: parking_lot::Condvar::new(),
        changed_lock: Mutex::new(0),
        trace: Mutex::new(VecDeque::new()),
        started: Instant::now(),
    })
}

/// One action a failpoint took.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEntry {
    /// Time since the first use of failpoints in this process.
    pub at: Duration,
    pub name: &'static str,
    /// The hit's number since the failpoint was armed (0-based).
    pub hit: u64,
    pub action: Action,
}

/// The trace keeps this many entries (the oldest go).
const TRACE_LEN: usize = 4096;

fn catalogued(name: &str) -> Result<&'static str, SpecError> {
    CATALOGUE
        .iter()
        .find(|(n, _)| *n == name.trim())
        .map(|(n, _)| *n)
        .ok_or_else(|| {
            SpecError::Unknown(
                name.into(),
                CATALOGUE
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })
}

/// Check a list of `name=spec` pairs separated by `;` without arming anything.
pub fn check_list(list: &str) -> Result<Vec<(&'static str, Spec)>, SpecError> {
    let mut out = Vec::new();
    for pair in list.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, spec) = pair.split_once('=').ok_or_else(|| SpecError::Bad {
            name: pair.into(),
            spec: String::new(),
            why: "expected name=spec".into(),
        })?;
        let name = catalogued(name)?;
        out.push((name, Spec::parse(name, spec.trim())?));
    }
    Ok(out)
}

/// Arm a list of `name=spec` pairs separated by `;` (all or nothing).
pub fn set_list(list: &str) -> Result<(), SpecError> {
    for (name, spec) in check_list(list)? {
        arm(name, spec);
    }
    Ok(())
}

/// Arm failpoint `name` with `spec` (replacing what it had; its hit count restarts).
pub fn set(name: &str, spec: &str) -> Result<(), SpecError> {
    let name = catalogued(name)?;
    let spec = Spec::parse(name, spec)?;
    arm(name, spec);
    Ok(())
}

fn arm(name: &'static str, spec: Spec) {
    let r = registry();
    {
        let mut armed = r.armed.lock();
        let generation = armed.get(name).map_or(0, |a| a.generation + 1);
        if armed
            .insert(
                name,
                Armed {
                    spec,
                    hits: 0,
                    generation,
                },
            )
            .is_none()
        {
            ARMED.fetch_add(1, Ordering::Release);
        }
    }
    wake_paused();
}

/// Disarm failpoint `name` (paused hits go on).
pub fn clear(name: &str) {
    let r = registry();
    if r.armed.lock().remove(name.trim()).is_some() {
        ARMED.fetch_sub(1, Ordering::Release);
    }
    wake_paused();
}

/// Disarm every failpoint.
pub fn clear_all() {
    let r = registry();
    let n = {
        let mut armed = r.armed.lock();
        let n = armed.len();
        armed.clear();
        n
    };
    ARMED.fetch_sub(n, Ordering::Release);
    wake_paused();
}

fn wake_paused() {
    let r = registry();
    r.changed.notify_waiters();
    *r.changed_lock.lock() += 1;
    r.changed_sync.notify_all();
}

/// The actions taken so far (oldest first), for a failing test to print.
pub fn trace() -> Vec<TraceEntry> {
    registry().trace.lock().iter().cloned().collect()
}

/// What a hit must do: the action and the generation to wait out for `pause`.
fn take(name: &'static str) -> Option<(Action, u64)> {
    let r = registry();
    let (action, hit, generation) = {
        let mut armed = r.armed.lock();
        let a = armed.get_mut(name)?;
        let hit = a.hits;
        a.hits += 1;
        (a.spec.action_at(hit).clone(), hit, a.generation)
    };
    if action == Action::Off {
        return None;
    }
    {
        let mut t = r.trace.lock();
        if t.len() == TRACE_LEN {
            t.pop_front();
        }
        t.push_back(TraceEntry {
            at: r.started.elapsed(),
            name,
            hit,
            action: action.clone(),
        });
    }
    tracing::info!("failpoint {name} hit {hit}: {action}");
    Some((action, generation))
}

fn still_paused(name: &'static str, generation: u64) -> bool {
    registry()
        .armed
        .lock()
        .get(name)
        .is_some_and(|a| a.generation == generation)
}

fn crash(name: &'static str) -> ! {
    eprintln!("failpoint {name}: crashing this process (SIGKILL) on purpose");
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    // SIGKILL cannot be caught; this is never reached, but the type says so.
    std::process::abort()
}

/// What a [`Hook`] decides for a hit.
pub enum HookDecision {
    /// Take the hit's step as usual; the hook is not told of it.
    Pass,
    /// Answer the hit with this outcome; the registry is not consulted (a replay).
    Answer(Result<(), Fired>),
    /// Take the hit's step as usual, then tell the hook its outcome with this token.
    Take(u64),
}

/// Something that sees every failpoint hit of the process before it is taken: the
/// runtime records the outcomes of the hits a replicated proclet's closure makes on its
/// primary and answers the same hits from that record on its backups, so a backup never
/// takes a step again (it passes every other hit).
pub trait Hook: Send + Sync {
    /// A hit of `name`, before its step is taken.
    fn before(&self, name: &'static str) -> HookDecision;
    /// The outcome of a hit [`Hook::before`] asked to hear of.
    fn after(&self, token: u64, name: &'static str, outcome: &Result<(), Fired>);
}

static HOOK: OnceLock<&'static dyn Hook> = OnceLock::new();

/// Install the process's hook (once; later calls change nothing).
pub fn set_hook(hook: &'static dyn Hook) {
    let _ = HOOK.set(hook);
}

/// Take failpoint `name`'s next step, in async code.
pub async fn hit(name: &'static str) -> Result<(), Fired> {
    let Some(hook) = HOOK.get() else {
        return take_async(name).await;
    };
    match hook.before(name) {
        HookDecision::Pass => take_async(name).await,
        HookDecision::Answer(outcome) => outcome,
        HookDecision::Take(token) => {
            let outcome = take_async(name).await;
            hook.after(token, name, &outcome);
            outcome
        }
    }
}

/// Take failpoint `name`'s next step, blocking the calling thread (for code that runs on
/// threads of its own, not in async tasks).
pub fn hit_blocking(name: &'static str) -> Result<(), Fired> {
    let Some(hook) = HOOK.get() else {
        return take_blocking(name);
    };
    match hook.before(name) {
        HookDecision::Pass => take_blocking(name),
        HookDecision::Answer(outcome) => outcome,
        HookDecision::Take(token) => {
            let outcome = take_blocking(name);
            hook.after(token, name, &outcome);
            outcome
        }
    }
}

async fn take_async(name: &'static str) -> Result<(), Fired> {
    if ARMED.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    let Some((action, generation)) = take(name) else {
        return Ok(());
    };
    match action {
        Action::Off => Ok(()),
        Action::Error => Err(Fired(name)),
        Action::Delay(d) => {
            tokio::time::sleep(d).await;
            Ok(())
        }
        Action::Pause => {
            let r = registry();
            loop {
                let changed = r.changed.notified();
                if !still_paused(name, generation) {
                    return Ok(());
                }
                changed.await;
            }
        }
        Action::Crash => crash(name),
    }
}

fn take_blocking(name: &'static str) -> Result<(), Fired> {
    if ARMED.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    let Some((action, generation)) = take(name) else {
        return Ok(());
    };
    match action {
        Action::Off => Ok(()),
        Action::Error => Err(Fired(name)),
        Action::Delay(d) => {
            std::thread::sleep(d);
            Ok(())
        }
        Action::Pause => {
            let r = registry();
            let mut g = r.changed_lock.lock();
            while still_paused(name, generation) {
                r.changed_sync.wait_for(&mut g, Duration::from_millis(50));
            }
            Ok(())
        }
        Action::Crash => crash(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The registry is per process: these tests share it, so each uses its own names.

    #[test]
    fn specs_parse_and_sequence() {
        let s = Spec::parse("x", "2*off->1*error->delay(5ms)").unwrap();
        assert_eq!(s.action_at(0), &Action::Off);
        assert_eq!(s.action_at(1), &Action::Off);
        assert_eq!(s.action_at(2), &Action::Error);
        assert_eq!(s.action_at(3), &Action::Delay(Duration::from_millis(5)));
        assert_eq!(s.action_at(99), &Action::Delay(Duration::from_millis(5)));
        let once = Spec::parse("x", "1*crash").unwrap();
        assert_eq!(once.action_at(0), &Action::Crash);
        assert_eq!(once.action_at(1), &Action::Off);
        for bad in ["", "boom", "x*error", "delay(soon)", "2*"] {
            assert!(Spec::parse("x", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unknown_names_are_refused() {
        let e = set("migrate.befor_lock", "error").unwrap_err();
        assert!(e.to_string().contains("unknown failpoint"), "{e}");
        assert!(check_list("migrate.locked=error;call.before_run=2*off->crash").is_ok());
        assert!(check_list("migrate.locked").is_err());
    }

    #[tokio::test]
    async fn errors_fire_as_armed_and_are_traced() {
        assert_eq!(hit("call.before_reply").await, Ok(()));
        set("call.before_reply", "1*off->1*error").unwrap();
        assert_eq!(hit("call.before_reply").await, Ok(()));
        assert_eq!(
            hit("call.before_reply").await,
            Err(Fired("call.before_reply"))
        );
        assert_eq!(hit("call.before_reply").await, Ok(()));
        assert!(trace()
            .iter()
            .any(|t| t.name == "call.before_reply" && t.hit == 1 && t.action == Action::Error));
        clear("call.before_reply");
    }

    #[tokio::test]
    async fn a_paused_hit_waits_until_cleared() {
        set("migrate.installed", "pause").unwrap();
        let h = tokio::spawn(async { hit("migrate.installed").await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!h.is_finished(), "paused");
        clear("migrate.installed");
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), h)
                .await
                .unwrap()
                .unwrap(),
            Ok(())
        );
    }

    #[test]
    fn a_paused_thread_waits_until_rearmed() {
        set("stream.chunk_received", "pause").unwrap();
        let h = std::thread::spawn(|| hit_blocking("stream.chunk_received"));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!h.is_finished(), "paused");
        set("stream.chunk_received", "off").unwrap();
        assert_eq!(h.join().unwrap(), Ok(()));
        clear("stream.chunk_received");
    }

    #[test]
    fn crash_kills_the_process() {
        // In a child process: the test harness must survive.
        if std::env::var_os("GRANULE_FAILPOINT_CRASH_CHILD").is_some() {
            set("heartbeat.send", "crash").unwrap();
            let _ = hit_blocking("heartbeat.send");
            unreachable!("crash returned");
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "tests::crash_kills_the_process", "--nocapture"])
            .env("GRANULE_FAILPOINT_CRASH_CHILD", "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(9), "{out:?}");
    }
}
