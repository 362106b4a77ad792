//! The commands a store answers, with Redis's replies: what [`Inner::run`] does with one
//! parsed command of one connection, under the store's lock.
//!
//! What it owns: authentication (`AUTH`, `HELLO … AUTH`), the protocol a connection
//! speaks (RESP2, or RESP3 after `HELLO 3`: the replies differ in their nulls and maps),
//! transactions (`MULTI` queues commands on the connection, `EXEC` runs them together
//! under the lock, `DISCARD` drops them; a queued command Redis would refuse at once
//! (unknown, wrong arity) makes `EXEC` answer `-EXECABORT`), and each command's
//! arguments, options and errors, worded as Redis words them so clients that match on
//! them behave. It must not touch sockets: replies go into the connection's buffer.

use super::keyspace::{SetCond, SetOutcome, SetTtl};
use super::{
    array, bulk, err, int, is, ok, parse_i64, printable, wrong_args, After, Cmd, Conn,
    EvictionMode, Inner, Shared, NOAUTH, NOT_INT, OOM, SYNTAX,
};
use std::sync::atomic::Ordering;

/// The commands a store answers and their arity as Redis counts it (the name included;
/// negative: at least that many). A command not here, or with another count, is refused
/// before it runs, and inside `MULTI` it aborts the transaction.
const COMMANDS: &[(&str, i32)] = &[
    ("AUTH", -2),
    ("QUIT", -1),
    ("PING", -1),
    ("ECHO", 2),
    ("GET", 2),
    ("SET", -3),
    ("DEL", -2),
    ("UNLINK", -2),
    ("EXISTS", -2),
    ("MGET", -2),
    ("MSET", -3),
    ("EXPIRE", -3),
    ("PEXPIRE", -3),
    ("TTL", 2),
    ("PTTL", 2),
    ("PERSIST", 2),
    ("DBSIZE", 1),
    ("FLUSHDB", -1),
    ("FLUSHALL", -1),
    ("SELECT", 2),
    ("INFO", -1),
    ("COMMAND", -1),
    ("CONFIG", -2),
    ("CLIENT", -2),
    ("HELLO", -1),
    ("MULTI", 1),
    ("EXEC", 1),
    ("DISCARD", 1),
];

/// The version the store answers as (`INFO`, `HELLO`): the Redis whose commands it follows.
const REDIS_VERSION: &str = "7.0.0";

const WRONGPASS: &[u8] = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n";
const HELLO_NOAUTH: &[u8] = b"-NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time\r\n";
const EXECABORT: &[u8] = b"-EXECABORT Transaction discarded because of previous errors.\r\n";

/// Commands queued by `MULTI`: their arguments copied out of the read buffer (which moves
/// on), as one byte vector and ranges of it.
#[derive(Default)]
pub(super) struct Queued {
    bytes: Vec<u8>,
    args: Vec<(usize, usize)>,
    /// Each command's arguments: a range of `args`.
    cmds: Vec<(usize, usize)>,
    /// A queued command was refused: `EXEC` aborts.
    failed: bool,
}

impl Queued {
    /// Bytes it holds (counted with the connection's buffers).
    pub(super) fn footprint(&self) -> usize {
        self.bytes.capacity()
            + (self.args.capacity() + self.cmds.capacity()) * std::mem::size_of::<(usize, usize)>()
    }
}

/// How many arguments `name` takes, if the store knows it.
fn arity(name: &[u8]) -> Option<i32> {
    COMMANDS
        .iter()
        .find(|(n, _)| is(name, n.as_bytes()))
        .map(|&(_, a)| a)
}

/// Whether a command of `argc` arguments fits `arity`.
fn arity_ok(arity: i32, argc: usize) -> bool {
    if arity >= 0 {
        argc == arity as usize
    } else {
        argc >= arity.unsigned_abs() as usize
    }
}

/// A null: `$-1` in RESP2, `_` in RESP3 (whose clients do not read `$-1`).
fn nil(out: &mut Vec<u8>, resp3: bool) {
    out.extend_from_slice(if resp3 { b"_\r\n" } else { b"$-1\r\n" });
}

/// The header of a map of `n` pairs: `%n` in RESP3, a flat array of `2n` in RESP2.
fn map(out: &mut Vec<u8>, n: usize, resp3: bool) {
    if resp3 {
        out.push(b'%');
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.extend_from_slice(b"\r\n");
    } else {
        array(out, 2 * n);
    }
}

/// Redis's reply to a command it does not know.
fn unknown_command(out: &mut Vec<u8>, cmd: &Cmd<'_>) {
    let mut args = String::new();
    for i in 1..cmd.len() {
        if args.len() >= 128 {
            break;
        }
        args.push('\'');
        args.push_str(&printable(cmd.arg(i)));
        args.push_str("' ");
    }
    err(
        out,
        &format!(
            "unknown command '{}', with args beginning with: {args}",
            printable(cmd.arg(0))
        ),
    );
}

fn unknown_subcommand(out: &mut Vec<u8>, sub: &[u8], command: &str) {
    err(
        out,
        &format!(
            "unknown subcommand '{}'. Try {command} HELP.",
            printable(sub)
        ),
    );
}

/// Unix time now, milliseconds.
fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Whether `s` matches the glob `pattern` (`*`, `?`, `[abc]`, `[a-z]`, `[^a]`, `\x`),
/// ignoring ASCII case: how Redis matches `CONFIG GET` patterns.
pub(super) fn glob(pattern: &[u8], s: &[u8]) -> bool {
    let eq = |a: u8, b: u8| a.eq_ignore_ascii_case(&b);
    let (mut p, mut i) = (0, 0);
    // Where to resume after the last `*`: (pattern position after it, string position).
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                star = Some((p + 1, i));
                p += 1;
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => {
                let mut q = p + 1;
                let negate = pattern.get(q) == Some(&b'^');
                if negate {
                    q += 1;
                }
                let mut hit = false;
                while q < pattern.len() && pattern[q] != b']' {
                    if pattern[q] == b'\\' && q + 1 < pattern.len() {
                        q += 1;
                        hit |= eq(pattern[q], s[i]);
                    } else if q + 2 < pattern.len() && pattern[q + 1] == b'-' {
                        let (lo, hi) = (
                            pattern[q].to_ascii_lowercase(),
                            pattern[q + 2].to_ascii_lowercase(),
                        );
                        let (lo, hi) = (lo.min(hi), lo.max(hi));
                        hit |= (lo..=hi).contains(&s[i].to_ascii_lowercase());
                        q += 2;
                    } else {
                        hit |= eq(pattern[q], s[i]);
                    }
                    q += 1;
                }
                (hit != negate).then_some(q + 1)
            }
            Some(b'\\') if p + 1 < pattern.len() => eq(pattern[p + 1], s[i]).then_some(p + 2),
            Some(&c) => eq(c, s[i]).then_some(p + 1),
            None => None,
        };
        match (step, star) {
            (Some(next), _) => {
                p = next;
                i += 1;
            }
            (None, Some((sp, si))) => {
                // Let the last `*` take one more byte and try again.
                p = sp;
                i = si + 1;
                star = Some((sp, si + 1));
            }
            (None, None) => return false,
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

impl Inner {
    /// Run one command of `conn`, appending its reply to `out`.
    pub(super) fn run(
        &mut self,
        shared: &Shared,
        cmd: &Cmd<'_>,
        out: &mut Vec<u8>,
        conn: &mut Conn,
    ) -> After {
        let name = cmd.arg(0);
        self.commands += 1;
        // The hot pair first, once authenticated and outside a transaction.
        if conn.authed && conn.multi.is_none() && self.bucket.allows() {
            if is(name, b"GET") {
                self.get(cmd, out, conn.resp3);
                return After::Continue;
            }
            if is(name, b"SET") {
                self.set(cmd, out, conn.resp3);
                return After::Continue;
            }
        }
        if is(name, b"QUIT") {
            ok(out);
            return After::Close;
        }
        if !conn.authed {
            if is(name, b"AUTH") {
                self.auth(shared, cmd, out, conn);
            } else if is(name, b"HELLO") {
                self.hello(shared, cmd, out, conn);
            } else {
                out.extend_from_slice(NOAUTH);
            }
            return After::Continue;
        }
        if !self.bucket.allows() {
            self.rate_limited += 1;
            if let Some(q) = &mut conn.multi {
                // A transaction missing a command must not run.
                q.failed = true;
            }
            err(
                out,
                &format!(
                    "rate limit exceeded for this lease ({} bytes/s)",
                    self.bucket.rate
                ),
            );
            return After::Continue;
        }
        if conn.multi.is_some() {
            self.queue(shared, cmd, out, conn);
            return After::Continue;
        }
        self.dispatch(shared, cmd, out, conn);
        After::Continue
    }

    /// Inside `MULTI`: `EXEC`, `DISCARD`, or queue the command.
    fn queue(&mut self, shared: &Shared, cmd: &Cmd<'_>, out: &mut Vec<u8>, conn: &mut Conn) {
        let name = cmd.arg(0);
        if is(name, b"EXEC") {
            return self.exec(shared, out, conn);
        }
        let Some(q) = conn.multi.as_mut() else {
            return;
        };
        if is(name, b"DISCARD") {
            conn.multi = None;
            return ok(out);
        }
        if is(name, b"MULTI") {
            return err(out, "MULTI calls can not be nested");
        }
        let Some(a) = arity(name) else {
            q.failed = true;
            return unknown_command(out, cmd);
        };
        if !arity_ok(a, cmd.len()) {
            q.failed = true;
            return wrong_args(out, &String::from_utf8_lossy(name).to_lowercase());
        }
        let size: usize = (0..cmd.len()).map(|i| cmd.arg(i).len()).sum();
        if (q.bytes.len() + size) as u64 > self.ks.capacity() {
            // The queue is the connection's memory, counted against the lease: it cannot
            // outgrow it.
            q.failed = true;
            return err(out, "transaction larger than this store's lease");
        }
        let first = q.args.len();
        for i in 0..cmd.len() {
            let start = q.bytes.len();
            q.bytes.extend_from_slice(cmd.arg(i));
            q.args.push((start, q.bytes.len()));
        }
        q.cmds.push((first, q.args.len()));
        out.extend_from_slice(b"+QUEUED\r\n");
    }

    /// Run a transaction's commands, one after the other under the lock (nothing else
    /// runs in between), their replies in one array.
    fn exec(&mut self, shared: &Shared, out: &mut Vec<u8>, conn: &mut Conn) {
        let Some(q) = conn.multi.take() else {
            return err(out, "EXEC without MULTI");
        };
        if q.failed {
            return out.extend_from_slice(EXECABORT);
        }
        array(out, q.cmds.len());
        for &(a, b) in &q.cmds {
            let cmd = Cmd {
                buf: &q.bytes,
                args: &q.args[a..b],
            };
            self.dispatch(shared, &cmd, out, conn);
        }
    }

    /// Run one command outside `MULTI` (or from `EXEC`).
    fn dispatch(&mut self, shared: &Shared, cmd: &Cmd<'_>, out: &mut Vec<u8>, conn: &mut Conn) {
        let name = cmd.arg(0);
        let now = self.now_ms;
        let resp3 = conn.resp3;
        match arity(name) {
            None => return unknown_command(out, cmd),
            Some(a) if !arity_ok(a, cmd.len()) => {
                return wrong_args(out, &String::from_utf8_lossy(name).to_lowercase());
            }
            Some(_) => {}
        }
        match () {
            _ if is(name, b"GET") => self.get(cmd, out, resp3),
            _ if is(name, b"SET") => self.set(cmd, out, resp3),
            _ if is(name, b"PING") => match cmd.len() {
                1 => out.extend_from_slice(b"+PONG\r\n"),
                2 => bulk(out, cmd.arg(1)),
                _ => wrong_args(out, "ping"),
            },
            _ if is(name, b"ECHO") => bulk(out, cmd.arg(1)),
            _ if is(name, b"DEL") || is(name, b"UNLINK") => {
                let n = (1..cmd.len())
                    .filter(|&i| self.ks.del(cmd.arg(i), now))
                    .count();
                int(out, n as i64);
            }
            _ if is(name, b"EXISTS") => {
                let n = (1..cmd.len())
                    .filter(|&i| self.ks.exists(cmd.arg(i), now))
                    .count();
                int(out, n as i64);
            }
            _ if is(name, b"MGET") => {
                array(out, cmd.len() - 1);
                for i in 1..cmd.len() {
                    self.answer_value(cmd.arg(i), now, out, resp3);
                }
            }
            _ if is(name, b"MSET") => self.mset(cmd, out),
            _ if is(name, b"EXPIRE") => self.expire(cmd, out, 1000, "expire"),
            _ if is(name, b"PEXPIRE") => self.expire(cmd, out, 1, "pexpire"),
            _ if is(name, b"TTL") || is(name, b"PTTL") => {
                let r = match self.ks.ttl_ms(cmd.arg(1), now) {
                    None => -2,
                    Some(None) => -1,
                    // Rounded to the nearest second, as Redis does.
                    Some(Some(ms)) if is(name, b"TTL") => ms.saturating_add(500) as i64 / 1000,
                    Some(Some(ms)) => ms as i64,
                };
                int(out, r);
            }
            _ if is(name, b"PERSIST") => int(out, i64::from(self.ks.persist(cmd.arg(1), now))),
            _ if is(name, b"DBSIZE") => int(out, self.ks.len() as i64),
            _ if is(name, b"FLUSHDB") || is(name, b"FLUSHALL") => {
                if cmd.len() > 2
                    || (cmd.len() == 2 && !is(cmd.arg(1), b"ASYNC") && !is(cmd.arg(1), b"SYNC"))
                {
                    out.extend_from_slice(SYNTAX);
                } else {
                    self.ks.clear();
                    self.release_memory();
                    ok(out);
                }
            }
            _ if is(name, b"SELECT") => match parse_i64(cmd.arg(1)) {
                Some(0) => ok(out),
                Some(_) => err(out, "DB index is out of range"),
                None => out.extend_from_slice(NOT_INT),
            },
            _ if is(name, b"INFO") => {
                let text = self.info(shared, cmd);
                bulk(out, text.as_bytes());
            }
            _ if is(name, b"COMMAND") => {
                // Enough for clients to start: they ask for the count or the docs and go
                // on without the table when it is empty.
                if cmd.len() >= 2 && is(cmd.arg(1), b"COUNT") {
                    int(out, COMMANDS.len() as i64);
                } else {
                    array(out, 0);
                }
            }
            _ if is(name, b"CONFIG") => self.config(shared, cmd, out, resp3),
            _ if is(name, b"CLIENT") => client(cmd, out, conn),
            _ if is(name, b"AUTH") => self.auth(shared, cmd, out, conn),
            _ if is(name, b"HELLO") => self.hello(shared, cmd, out, conn),
            _ if is(name, b"MULTI") => {
                conn.multi = Some(Queued::default());
                ok(out);
            }
            _ if is(name, b"EXEC") => err(out, "EXEC without MULTI"),
            _ if is(name, b"DISCARD") => err(out, "DISCARD without MULTI"),
            _ => unknown_command(out, cmd),
        }
    }

    /// Whether `pass` (for `user`, `default` if none) is the lease's secret; on success
    /// the connection is authenticated.
    fn check_auth(
        &mut self,
        shared: &Shared,
        user: Option<&[u8]>,
        pass: &[u8],
        conn: &mut Conn,
    ) -> bool {
        // Digest equality is constant-time (blake3::Hash's PartialEq), so the time
        // taken says nothing about how much of the secret matched.
        let good = blake3::hash(pass) == shared.secret && user.is_none_or(|u| is(u, b"DEFAULT"));
        if good {
            conn.authed = true;
        } else {
            self.auth_failures += 1;
        }
        good
    }

    fn auth(&mut self, shared: &Shared, cmd: &Cmd<'_>, out: &mut Vec<u8>, conn: &mut Conn) {
        let (user, pass) = match cmd.len() {
            2 => (None, cmd.arg(1)),
            3 => (Some(cmd.arg(1)), cmd.arg(2)),
            _ => return out.extend_from_slice(SYNTAX),
        };
        if self.check_auth(shared, user, pass, conn) {
            ok(out);
        } else {
            out.extend_from_slice(WRONGPASS);
        }
    }

    /// `HELLO [protover [AUTH user pass] [SETNAME name]]`: authenticate and choose RESP2
    /// or RESP3 in one command (what redis-py 8 sends first), as Redis answers it.
    fn hello(&mut self, shared: &Shared, cmd: &Cmd<'_>, out: &mut Vec<u8>, conn: &mut Conn) {
        let mut resp3 = conn.resp3;
        let mut auth = None;
        let mut setname = None;
        if cmd.len() >= 2 {
            match parse_i64(cmd.arg(1)) {
                None => return err(out, "Protocol version is not an integer or out of range"),
                Some(2) => resp3 = false,
                Some(3) => resp3 = true,
                Some(_) => {
                    return out.extend_from_slice(b"-NOPROTO unsupported protocol version\r\n")
                }
            }
            let mut i = 2;
            while i < cmd.len() {
                let more = cmd.len() - i - 1;
                if is(cmd.arg(i), b"AUTH") && more >= 2 {
                    auth = Some((cmd.arg(i + 1), cmd.arg(i + 2)));
                    i += 3;
                } else if is(cmd.arg(i), b"SETNAME") && more >= 1 {
                    setname = Some(cmd.arg(i + 1));
                    i += 2;
                } else {
                    return err(
                        out,
                        &format!("Syntax error in HELLO option '{}'", printable(cmd.arg(i))),
                    );
                }
            }
        }
        if let Some((user, pass)) = auth {
            if !self.check_auth(shared, Some(user), pass, conn) {
                return out.extend_from_slice(WRONGPASS);
            }
        }
        if !conn.authed {
            return out.extend_from_slice(HELLO_NOAUTH);
        }
        if let Some(name) = setname {
            if let Err(e) = set_name(conn, name) {
                return err(out, e);
            }
        }
        conn.resp3 = resp3;
        map(out, 7, resp3);
        for (k, v) in [("server", "redis"), ("version", REDIS_VERSION)] {
            bulk(out, k.as_bytes());
            bulk(out, v.as_bytes());
        }
        bulk(out, b"proto");
        int(out, if resp3 { 3 } else { 2 });
        bulk(out, b"id");
        int(out, conn.id as i64);
        for (k, v) in [("mode", "standalone"), ("role", "master")] {
            bulk(out, k.as_bytes());
            bulk(out, v.as_bytes());
        }
        bulk(out, b"modules");
        array(out, 0);
    }

    pub(super) fn get(&mut self, cmd: &Cmd<'_>, out: &mut Vec<u8>, resp3: bool) {
        if cmd.len() != 2 {
            return wrong_args(out, "get");
        }
        self.answer_value(cmd.arg(1), self.now_ms, out, resp3);
    }

    /// A key's value as GET and MGET answer it (a bulk, or nil when absent), counted as a
    /// hit or a miss.
    fn answer_value(&mut self, key: &[u8], now: u64, out: &mut Vec<u8>, resp3: bool) {
        match self.ks.get(key, now) {
            Some(v) => {
                bulk(out, v);
                self.hits += 1;
            }
            None => {
                nil(out, resp3);
                self.misses += 1;
            }
        }
    }

    pub(super) fn set(&mut self, cmd: &Cmd<'_>, out: &mut Vec<u8>, resp3: bool) {
        if cmd.len() < 3 {
            return wrong_args(out, "set");
        }
        let now = self.now_ms;
        let mut cond = SetCond::Always;
        let mut ttl = SetTtl::Clear;
        // EXAT/PXAT at or before now: the key is written and gone at once (Redis deletes it).
        let mut expired = false;
        let mut i = 3;
        while i < cmd.len() {
            let opt = cmd.arg(i);
            let unit = if is(opt, b"EX") || is(opt, b"EXAT") {
                Some(1000)
            } else if is(opt, b"PX") || is(opt, b"PXAT") {
                Some(1)
            } else {
                None
            };
            if let Some(unit) = unit {
                if ttl != SetTtl::Clear || expired || i + 1 >= cmd.len() {
                    return out.extend_from_slice(SYNTAX);
                }
                let Some(t) = parse_i64(cmd.arg(i + 1)) else {
                    return out.extend_from_slice(NOT_INT);
                };
                let absolute = opt.len() == 4;
                let unix_now = unix_ms();
                // As Redis: positive, and within i64 once in milliseconds from the Unix epoch.
                let Some(at_unix) = t.checked_mul(unit).filter(|_| t > 0).and_then(|ms| {
                    if absolute {
                        Some(ms)
                    } else {
                        ms.checked_add(unix_now)
                    }
                }) else {
                    return err(out, "invalid expire time in 'set' command");
                };
                if at_unix <= unix_now {
                    expired = true;
                } else {
                    ttl = SetTtl::At(now.saturating_add((at_unix - unix_now) as u64));
                }
                i += 2;
                continue;
            }
            if is(opt, b"NX") && cond == SetCond::Always {
                cond = SetCond::Nx;
            } else if is(opt, b"XX") && cond == SetCond::Always {
                cond = SetCond::Xx;
            } else if is(opt, b"KEEPTTL") && ttl == SetTtl::Clear && !expired {
                ttl = SetTtl::Keep;
            } else {
                return out.extend_from_slice(SYNTAX);
            }
            i += 1;
        }
        if expired {
            let exists = self.ks.exists(cmd.arg(1), now);
            if (cond == SetCond::Nx && exists) || (cond == SetCond::Xx && !exists) {
                return nil(out, resp3);
            }
            self.ks.del(cmd.arg(1), now);
            return ok(out);
        }
        match self.ks.set(cmd.arg(1), cmd.arg(2), cond, ttl, now) {
            SetOutcome::Written => ok(out),
            SetOutcome::NotWritten => nil(out, resp3),
            SetOutcome::NoRoom => {
                self.rejected_writes += 1;
                out.extend_from_slice(OOM);
            }
        }
    }

    /// `EXPIRE`/`PEXPIRE key time [NX|XX|GT|LT]` (`unit`: milliseconds per unit of time).
    fn expire(&mut self, cmd: &Cmd<'_>, out: &mut Vec<u8>, unit: i64, name: &str) {
        let now = self.now_ms;
        let Some(t) = parse_i64(cmd.arg(2)) else {
            return out.extend_from_slice(NOT_INT);
        };
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for i in 3..cmd.len() {
            let o = cmd.arg(i);
            match () {
                _ if is(o, b"NX") => nx = true,
                _ if is(o, b"XX") => xx = true,
                _ if is(o, b"GT") => gt = true,
                _ if is(o, b"LT") => lt = true,
                _ => return err(out, &format!("Unsupported option {}", printable(o))),
            }
        }
        if nx && (xx || gt || lt) {
            return err(
                out,
                "NX and XX, GT or LT options at the same time are not compatible",
            );
        }
        if gt && lt {
            return err(out, "GT and LT options at the same time are not compatible");
        }
        let unix_now = unix_ms();
        // As Redis: the time in milliseconds from the Unix epoch must fit an i64.
        let Some(at_unix) = t.checked_mul(unit).and_then(|ms| ms.checked_add(unix_now)) else {
            return err(out, &format!("invalid expire time in '{name}' command"));
        };
        let key = cmd.arg(1);
        let Some(current) = self.ks.ttl_ms(key, now) else {
            return int(out, 0);
        };
        // The key's expiry now, from the Unix epoch (none: later than any).
        let cur = current.map(|ms| unix_now.saturating_add(ms as i64));
        let allowed = match cur {
            None => !xx && !gt,
            Some(c) => !nx && (!gt || at_unix > c) && (!lt || at_unix < c),
        };
        if !allowed {
            return int(out, 0);
        }
        let at = if at_unix <= unix_now {
            now
        } else {
            now.saturating_add((at_unix - unix_now) as u64)
        };
        int(out, i64::from(self.ks.expire(key, at, now)));
    }

    fn mset(&mut self, cmd: &Cmd<'_>, out: &mut Vec<u8>) {
        if cmd.len() < 3 || cmd.len().is_multiple_of(2) {
            return wrong_args(out, "mset");
        }
        let now = self.now_ms;
        // All or nothing in a no-eviction store: check the growth of the whole command
        // first (a key given twice counts twice: a conservative bound).
        let growth: u64 = (1..cmd.len())
            .step_by(2)
            .map(|i| self.ks.growth(cmd.arg(i), cmd.arg(i + 1).len()))
            .sum();
        if !self.ks.fits(growth) {
            self.rejected_writes += 1;
            return out.extend_from_slice(OOM);
        }
        let mut refused = false;
        for i in (1..cmd.len()).step_by(2) {
            let r = self.ks.set(
                cmd.arg(i),
                cmd.arg(i + 1),
                SetCond::Always,
                SetTtl::Clear,
                now,
            );
            refused |= r == SetOutcome::NoRoom;
        }
        if refused {
            // Only an entry larger than the whole store gets here.
            self.rejected_writes += 1;
            out.extend_from_slice(OOM);
        } else {
            ok(out);
        }
    }

    /// `CONFIG GET pattern [pattern ...]` over the few parameters a store has.
    fn config(&mut self, shared: &Shared, cmd: &Cmd<'_>, out: &mut Vec<u8>, resp3: bool) {
        let sub = cmd.arg(1);
        if !is(sub, b"GET") {
            if is(sub, b"SET") || is(sub, b"RESETSTAT") || is(sub, b"REWRITE") {
                return err(
                    out,
                    "this store's settings come from its lease: CONFIG GET only",
                );
            }
            return unknown_subcommand(out, sub, "CONFIG");
        }
        if cmd.len() < 3 {
            return wrong_args(out, "config|get");
        }
        let policy = match self.ks.mode() {
            EvictionMode::Lru => "allkeys-lru",
            EvictionMode::NoEviction => "noeviction",
        };
        let cap = self.ks.capacity().to_string();
        let maxc = shared.max_connections.to_string();
        let known: [(&str, &str); 6] = [
            ("maxmemory", &cap),
            ("maxmemory-policy", policy),
            ("maxclients", &maxc),
            ("databases", "1"),
            ("save", ""),
            ("appendonly", "no"),
        ];
        let hits: Vec<_> = known
            .iter()
            .filter(|(k, _)| (2..cmd.len()).any(|i| glob(cmd.arg(i), k.as_bytes())))
            .collect();
        map(out, hits.len(), resp3);
        for (k, v) in hits {
            bulk(out, k.as_bytes());
            bulk(out, v.as_bytes());
        }
    }

    /// `INFO [section ...]`: the store's sections (all of them without an argument, or
    /// with `all`, `default`, `everything`; an unknown section gives nothing).
    fn info(&self, shared: &Shared, cmd: &Cmd<'_>) -> String {
        use std::fmt::Write;
        let want = |section: &str| {
            cmd.len() == 1
                || (1..cmd.len()).any(|i| {
                    let a = cmd.arg(i);
                    is(a, b"ALL")
                        || is(a, b"DEFAULT")
                        || is(a, b"EVERYTHING")
                        || is(a, section.as_bytes())
                })
        };
        let ks = &self.ks;
        let mut sections: Vec<String> = Vec::new();
        if want("SERVER") {
            sections.push(format!(
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ngranule_store:{ver}\r\nredis_mode:standalone\r\n\
                 process_id:{pid}\r\ntcp_port:{port}\r\nuptime_in_seconds:{up}\r\nlease_consumer:{consumer}\r\n",
                ver = env!("CARGO_PKG_VERSION"),
                pid = std::process::id(),
                port = shared.port,
                up = shared.epoch.elapsed().as_secs(),
                consumer = printable(shared.consumer.as_bytes()),
            ));
        }
        if want("CLIENTS") {
            sections.push(format!(
                "# Clients\r\nconnected_clients:{conns}\r\nunauthenticated_clients:{strangers}\r\nmaxclients:{maxc}\r\n",
                conns = shared.connections.load(Ordering::Relaxed),
                strangers = shared.unauthed.lock().len(),
                maxc = shared.max_connections,
            ));
        }
        if want("MEMORY") {
            let policy = match ks.mode() {
                EvictionMode::Lru => "allkeys-lru",
                EvictionMode::NoEviction => "noeviction",
            };
            sections.push(format!(
                "# Memory\r\nused_memory:{used}\r\nused_memory_dataset:{data}\r\nmem_clients_normal:{bufs}\r\n\
                 maxmemory:{cap}\r\nmaxmemory_policy:{policy}\r\nmemory_releases:{rel}\r\n",
                used = ks.used() + ks.buffers(),
                data = ks.used(),
                bufs = ks.buffers(),
                cap = ks.capacity(),
                rel = self.memory_releases,
            ));
        }
        if want("STATS") {
            sections.push(format!(
                "# Stats\r\ntotal_connections_received:{total}\r\ntotal_commands_processed:{cmds}\r\n\
                 keyspace_hits:{hits}\r\nkeyspace_misses:{misses}\r\nevicted_keys:{ek}\r\nevicted_bytes:{eb}\r\n\
                 expired_keys:{xk}\r\nrejected_writes:{rw}\r\nrate_limited:{rl}\r\nrate_limit_bps:{rate}\r\n\
                 auth_failures:{af}\r\nprotocol_errors:{pe}\r\n",
                total = self.connections_total,
                cmds = self.commands,
                hits = self.hits,
                misses = self.misses,
                ek = ks.evicted_keys,
                eb = ks.evicted_bytes,
                xk = ks.expired_keys,
                rw = self.rejected_writes,
                rl = self.rate_limited,
                rate = self.bucket.rate,
                af = self.auth_failures,
                pe = self.protocol_errors,
            ));
        }
        if want("KEYSPACE") {
            let mut s = String::from("# Keyspace\r\n");
            if !ks.is_empty() {
                let _ = write!(
                    s,
                    "db0:keys={},expires={},avg_ttl=0\r\n",
                    ks.len(),
                    ks.volatile()
                );
            }
            sections.push(s);
        }
        // Sections apart by an empty line, as Redis writes them.
        sections.join("\r\n")
    }
}

/// Why a client name is refused (Redis's rule: printable ASCII without blanks).
fn set_name(conn: &mut Conn, name: &[u8]) -> Result<(), &'static str> {
    if name.iter().any(|&c| !(b'!'..=b'~').contains(&c)) {
        return Err("Client names cannot contain spaces, newlines or special characters.");
    }
    conn.name = (!name.is_empty()).then(|| name.into());
    Ok(())
}

/// `CLIENT SETNAME | GETNAME | ID | SETINFO`.
fn client(cmd: &Cmd<'_>, out: &mut Vec<u8>, conn: &mut Conn) {
    let sub = cmd.arg(1);
    match () {
        _ if is(sub, b"SETNAME") => {
            if cmd.len() != 3 {
                return wrong_args(out, "client|setname");
            }
            match set_name(conn, cmd.arg(2)) {
                Ok(()) => ok(out),
                Err(e) => err(out, e),
            }
        }
        _ if is(sub, b"GETNAME") => {
            if cmd.len() != 2 {
                return wrong_args(out, "client|getname");
            }
            match &conn.name {
                Some(n) => bulk(out, n),
                None => nil(out, conn.resp3),
            }
        }
        _ if is(sub, b"ID") => {
            if cmd.len() != 2 {
                return wrong_args(out, "client|id");
            }
            int(out, conn.id as i64);
        }
        _ if is(sub, b"SETINFO") => {
            if cmd.len() != 4 {
                return wrong_args(out, "client|setinfo");
            }
            let attr = cmd.arg(2);
            if is(attr, b"LIB-NAME") || is(attr, b"LIB-VER") {
                ok(out);
            } else {
                err(out, &format!("Unrecognized option '{}'", printable(attr)));
            }
        }
        _ => unknown_subcommand(out, sub, "CLIENT"),
    }
}

#[cfg(test)]
mod tests {
    use super::glob;

    #[test]
    fn glob_matches_as_redis_does() {
        for (p, s, m) in [
            ("maxmemory*", "maxmemory-policy", true),
            ("maxmemory*", "maxmemory", true),
            ("max*policy", "maxmemory-policy", true),
            ("max*policy", "maxmemory", false),
            ("*", "save", true),
            ("SAVE", "save", true),
            ("sav?", "save", true),
            ("sav?", "sav", false),
            ("[sa]ave", "save", true),
            ("[^s]ave", "save", false),
            ("[a-t]ave", "save", true),
            ("s\\ave", "save", true),
            ("*e*y", "maxmemory", true),
            ("", "", true),
            ("", "a", false),
            ("a**", "a", true),
        ] {
            assert_eq!(glob(p.as_bytes(), s.as_bytes()), m, "{p} ~ {s}");
        }
    }
}
