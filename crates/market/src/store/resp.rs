//! The stores' request decoder: RESP2 commands (multibulk arrays of bulk strings, as every
//! client library, `redis-cli` and `redis-benchmark` send them) and inline commands (what
//! a person types over `nc`), parsed in place from a connection's read buffer.
//!
//! Why our own decoder rather than a RESP crate: the store must refuse a bulk length or an
//! argument count past its bounds *from the header*, before buffering what the header
//! claims; the crates we looked at (`redis-protocol`) decode whole frames and ask for more
//! input until a frame is complete, so the bounds need the headers parsed here anyway, and
//! parsing requests is no more than that. Arguments come back as byte ranges into the
//! buffer: no allocation per command (the range vector is the connection's, reused).
//! The `resp_decode` fuzz target covers this module.

use std::fmt;

/// The bounds a decoder enforces (each from the store's configuration).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest bulk string accepted.
    pub max_bulk: usize,
    /// Most arguments in one command.
    pub max_args: usize,
    /// Longest inline command line.
    pub max_inline: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bulk: 16 << 20,
            max_args: 1 << 20,
            max_inline: 64 << 10,
        }
    }
}

/// Why input is not a command. After one, the connection cannot find the next command's
/// start: the store replies `-ERR Protocol error: <this>` and closes that connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// `*` followed by something that is not a count.
    BadMultibulkLength,
    /// `$` followed by something that is not a length.
    BadBulkLength,
    /// An array element that is not a bulk string.
    ExpectedBulk(u8),
    /// A bulk string or a header line not ended by CRLF.
    MissingCrlf,
    /// A header line longer than any count could be.
    HeaderTooLong,
    /// An inline line past `max_inline`.
    InlineTooLong(usize),
    /// More arguments than `max_args`.
    TooManyArgs { count: u64, max: usize },
    /// A bulk string longer than `max_bulk`.
    BulkTooLong { len: u64, max: usize },
    /// An inline command with an unbalanced quote.
    UnbalancedQuotes,
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::BadMultibulkLength => write!(f, "invalid multibulk length"),
            ProtocolError::BadBulkLength => write!(f, "invalid bulk length"),
            ProtocolError::ExpectedBulk(b) => {
                write!(f, "expected '$', got '{}'", char::from(*b).escape_default())
            }
            ProtocolError::MissingCrlf => write!(f, "expected CRLF"),
            ProtocolError::HeaderTooLong => write!(f, "too big count string"),
            ProtocolError::InlineTooLong(max) => {
                write!(f, "too big inline request (over {max} bytes)")
            }
            ProtocolError::TooManyArgs { count, max } => write!(
                f,
                "too many arguments ({count}; this store accepts at most {max})"
            ),
            ProtocolError::BulkTooLong { len, max } => write!(
                f,
                "bulk length {len} over this store's limit of {max} bytes"
            ),
            ProtocolError::UnbalancedQuotes => write!(f, "unbalanced quotes in request"),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// The longest header line (`*N` or `$N`) accepted: 20 digits of a u64 and a sign.
const MAX_HEADER: usize = 24;

/// Parse one command from the start of `buf` (the stateless form of [`Parser::parse`],
/// which re-examines a partial command from its start on every call).
pub fn parse(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<(usize, usize)>,
) -> Result<Option<usize>, ProtocolError> {
    Parser::default().parse(buf, limits, args)
}

/// A connection's decoder: [`Parser::parse`] resumes a partial command where the last
/// call stopped, so a command arriving in many reads (a million-argument `MGET` over a
/// slow link) is examined once, not once per read.
#[derive(Debug, Default)]
pub struct Parser {
    /// A multibulk command in progress: arguments still to come and where the next one
    /// starts (its `$` header, or its payload when `bulk` is set).
    multibulk: Option<Pending>,
    /// An inline command in progress: how far the search for its newline got.
    inline_scanned: usize,
    /// Bytes examined since the parser was made: headers and lines scanned, payloads
    /// accepted. Parsing is incremental when this stays near the bytes received.
    scanned: u64,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    remaining: u64,
    next: usize,
    /// The payload of the argument being read, once its header was parsed: `(start, end)`.
    bulk: Option<(usize, usize)>,
}

impl Parser {
    /// Bytes examined so far (see the field's doc).
    pub fn scanned(&self) -> u64 {
        self.scanned
    }

    /// Whether a command is partly parsed (its arguments so far are in the caller's vector).
    pub fn in_progress(&self) -> bool {
        self.multibulk.is_some() || self.inline_scanned > 0
    }

    /// Parse one command from the start of `buf`. `Ok(Some(n))`: a command took the first
    /// `n` bytes and its arguments are in `args` as `(start, end)` ranges of `buf`
    /// (possibly none: an empty line or an empty array, which callers skip); `Ok(None)`:
    /// the command is not complete yet: read more and call again with a buffer that starts
    /// at the same byte, holds the same bytes and more, and the same `args` untouched.
    /// After an error the parser starts afresh (the connection is to be closed anyway).
    pub fn parse(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        args: &mut Vec<(usize, usize)>,
    ) -> Result<Option<usize>, ProtocolError> {
        let r = match (self.multibulk, buf.first()) {
            (Some(p), _) => self.resume_multibulk(buf, limits, args, p),
            (None, None) => return Ok(None),
            (None, Some(b'*')) => {
                args.clear();
                self.inline_scanned = 0;
                self.start_multibulk(buf, limits, args)
            }
            (None, Some(_)) => {
                if self.inline_scanned == 0 {
                    args.clear();
                }
                self.parse_inline(buf, limits, args)
            }
        };
        match r {
            Ok(Some(_)) | Err(_) => {
                self.multibulk = None;
                self.inline_scanned = 0;
            }
            Ok(None) => {}
        }
        r
    }

    /// [`find_crlf`], counting the bytes it examines.
    fn find_crlf(
        &mut self,
        buf: &[u8],
        from: usize,
        max: usize,
    ) -> Result<Option<usize>, ProtocolError> {
        let r = find_crlf(buf, from, max);
        let upto = match r {
            Ok(Some(cr)) => cr + 2,
            _ => buf.len().min(from.saturating_add(max + 2)),
        };
        self.scanned += upto.saturating_sub(from) as u64;
        r
    }

    fn start_multibulk(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        args: &mut Vec<(usize, usize)>,
    ) -> Result<Option<usize>, ProtocolError> {
        let Some(cr) = self.find_crlf(buf, 1, MAX_HEADER)? else {
            return Ok(None);
        };
        let count = parse_int(&buf[1..cr]).ok_or(ProtocolError::BadMultibulkLength)?;
        let pos = cr + 2;
        if count <= 0 {
            // `*0` and `*-1`: nothing to run (Redis skips them the same way).
            return Ok(Some(pos));
        }
        let count = count as u64;
        if count > limits.max_args as u64 {
            return Err(ProtocolError::TooManyArgs {
                count,
                max: limits.max_args,
            });
        }
        let p = Pending {
            remaining: count,
            next: pos,
            bulk: None,
        };
        self.resume_multibulk(buf, limits, args, p)
    }

    fn resume_multibulk(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        args: &mut Vec<(usize, usize)>,
        mut p: Pending,
    ) -> Result<Option<usize>, ProtocolError> {
        while p.remaining > 0 {
            let (start, end) = match p.bulk {
                Some(b) => b,
                None => {
                    let pos = p.next;
                    let Some(&first) = buf.get(pos) else {
                        self.multibulk = Some(p);
                        return Ok(None);
                    };
                    if first != b'$' {
                        return Err(ProtocolError::ExpectedBulk(first));
                    }
                    let Some(cr) = self.find_crlf(buf, pos + 1, MAX_HEADER)? else {
                        self.multibulk = Some(p);
                        return Ok(None);
                    };
                    let len = parse_int(&buf[pos + 1..cr]).ok_or(ProtocolError::BadBulkLength)?;
                    if len < 0 {
                        return Err(ProtocolError::BadBulkLength);
                    }
                    let len = len as u64;
                    if len > limits.max_bulk as u64 {
                        return Err(ProtocolError::BulkTooLong {
                            len,
                            max: limits.max_bulk,
                        });
                    }
                    let start = cr + 2;
                    (start, start + len as usize)
                }
            };
            if buf.len() < end + 2 {
                p.bulk = Some((start, end));
                self.multibulk = Some(p);
                return Ok(None);
            }
            self.scanned += (end + 2 - start) as u64;
            if &buf[end..end + 2] != b"\r\n" {
                return Err(ProtocolError::MissingCrlf);
            }
            args.push((start, end));
            p = Pending {
                remaining: p.remaining - 1,
                next: end + 2,
                bulk: None,
            };
        }
        Ok(Some(p.next))
    }

    fn parse_inline(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        args: &mut Vec<(usize, usize)>,
    ) -> Result<Option<usize>, ProtocolError> {
        let end = buf.len().min(limits.max_inline + 1);
        let from = self.inline_scanned.min(end);
        self.scanned += (end - from) as u64;
        let Some(nl) = buf[from..end].iter().position(|&b| b == b'\n') else {
            if buf.len() > limits.max_inline {
                return Err(ProtocolError::InlineTooLong(limits.max_inline));
            }
            // Never 0 here (`buf` is not empty), so `in_progress` holds.
            self.inline_scanned = buf.len();
            return Ok(None);
        };
        split_inline(buf, from + nl, limits, args)
    }
}

/// Find `\r\n` in `buf[from..]` within `max` bytes: `Ok(Some(pos of \r))`, `Ok(None)` if
/// not yet there, `Err` if it cannot be there within `max`.
fn find_crlf(buf: &[u8], from: usize, max: usize) -> Result<Option<usize>, ProtocolError> {
    let end = buf.len().min(from.saturating_add(max + 2));
    let window = &buf[from.min(end)..end];
    match window.iter().position(|&b| b == b'\r') {
        Some(i) => {
            let at = from + i;
            match buf.get(at + 1) {
                Some(b'\n') => Ok(Some(at)),
                Some(_) => Err(ProtocolError::MissingCrlf),
                None => Ok(None),
            }
        }
        None if buf.len() - from > max => Err(ProtocolError::HeaderTooLong),
        None => Ok(None),
    }
}

/// A header's number (`-1` allowed), or `None` if it is not one.
fn parse_int(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if neg { -n } else { n })
}

/// Split the inline line ending with the newline at `nl` into arguments.
fn split_inline(
    buf: &[u8],
    nl: usize,
    limits: &Limits,
    args: &mut Vec<(usize, usize)>,
) -> Result<Option<usize>, ProtocolError> {
    let line_end = if nl > 0 && buf[nl - 1] == b'\r' {
        nl - 1
    } else {
        nl
    };
    // Split on blanks; a double- or single-quoted argument keeps its blanks (without
    // escapes: the quotes must balance, and the argument is the text between them).
    let mut i = 0;
    while i < line_end {
        let b = buf[i];
        if b == b' ' || b == b'\t' {
            i += 1;
            continue;
        }
        if b == b'"' || b == b'\'' {
            let close = buf[i + 1..line_end]
                .iter()
                .position(|&c| c == b)
                .ok_or(ProtocolError::UnbalancedQuotes)?;
            args.push((i + 1, i + 1 + close));
            i += close + 2;
        } else {
            let start = i;
            while i < line_end && buf[i] != b' ' && buf[i] != b'\t' {
                i += 1;
            }
            args.push((start, i));
        }
        if args.len() > limits.max_args {
            return Err(ProtocolError::TooManyArgs {
                count: args.len() as u64,
                max: limits.max_args,
            });
        }
    }
    Ok(Some(nl + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parsed command: bytes consumed and its arguments.
    type Parsed = Option<(usize, Vec<Vec<u8>>)>;

    fn one(buf: &[u8]) -> Result<Parsed, ProtocolError> {
        let mut args = Vec::new();
        let r = parse(buf, &Limits::default(), &mut args)?;
        Ok(r.map(|n| (n, args.iter().map(|&(s, e)| buf[s..e].to_vec()).collect())))
    }

    #[test]
    fn multibulk_whole_and_in_pieces() {
        let cmd = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n*1\r\n$4\r\nPING\r\n";
        let (n, args) = one(cmd).unwrap().unwrap();
        assert_eq!(
            args,
            vec![b"SET".to_vec(), b"k".to_vec(), b"hello".to_vec()]
        );
        let (m, args) = one(&cmd[n..]).unwrap().unwrap();
        assert_eq!(args, vec![b"PING".to_vec()]);
        assert_eq!(n + m, cmd.len());
        // Every strict prefix of the first command is incomplete, never an error.
        for cut in 0..n {
            assert_eq!(one(&cmd[..cut]).unwrap(), None, "prefix of {cut} bytes");
        }
    }

    #[test]
    fn inline_commands() {
        let (n, args) = one(b"set k 'a b'\r\nPING\n").unwrap().unwrap();
        assert_eq!(n, 13);
        assert_eq!(args, vec![b"set".to_vec(), b"k".to_vec(), b"a b".to_vec()]);
        let (_, args) = one(b"\r\n").unwrap().unwrap();
        assert!(args.is_empty());
        assert_eq!(one(b"GET \"k"), Ok(None));
        assert_eq!(one(b"GET \"k\n"), Err(ProtocolError::UnbalancedQuotes));
    }

    /// Feed `stream` to one parser `chunk` bytes per "read", as a store's connection does
    /// (parse, consume what a command took, keep the rest). Returns the commands' argument
    /// counts and the bytes the parser examined.
    fn feed(stream: &[u8], chunk: usize, limits: &Limits) -> (Vec<usize>, u64) {
        let mut p = Parser::default();
        let mut args = Vec::new();
        let mut cmds = Vec::new();
        let (mut start, mut avail) = (0, 0);
        while avail < stream.len() {
            avail = (avail + chunk).min(stream.len());
            while let Some(n) = p.parse(&stream[start..avail], limits, &mut args).unwrap() {
                cmds.push(args.len());
                start += n;
            }
        }
        assert_eq!(start, stream.len());
        (cmds, p.scanned())
    }

    /// A million-argument MGET arriving slowly cost the store seconds of CPU when every
    /// read re-parsed the command from its start: the bytes examined must stay near the
    /// bytes received, however the command is cut.
    #[test]
    fn a_command_arriving_in_many_reads_is_parsed_once() {
        let n = 100_000;
        let mut cmd = format!("*{}\r\n$4\r\nMGET\r\n", n + 1).into_bytes();
        for i in 0..n {
            let k = format!("key:{i}");
            cmd.extend_from_slice(format!("${}\r\n{k}\r\n", k.len()).as_bytes());
        }
        cmd.extend_from_slice(b"*1\r\n$4\r\nPING\r\n");
        let limits = Limits::default();
        for chunk in [4096, 1000, 7] {
            let (cmds, scanned) = feed(&cmd, chunk, &limits);
            assert_eq!(cmds, vec![n + 1, 1]);
            let reads = cmd.len().div_ceil(chunk) as u64;
            // Each read may look again at one partial header (at most MAX_HEADER + 2 bytes).
            let bound = cmd.len() as u64 + reads * (MAX_HEADER as u64 + 3);
            assert!(
                scanned <= bound,
                "{chunk}-byte reads: parsed {scanned} bytes for a {}-byte stream (bound {bound})",
                cmd.len()
            );
        }
        // A long inline line arriving a byte at a time is scanned once too.
        let line = format!("GET {}\r\n", "k".repeat(20_000));
        let (cmds, scanned) = feed(line.as_bytes(), 1, &limits);
        assert_eq!(cmds, vec![2]);
        assert!(scanned <= 2 * line.len() as u64, "inline: {scanned} bytes");
    }

    /// Any split of any stream gives the same commands as the stream whole.
    #[test]
    fn resumed_parsing_matches_whole_parsing() {
        let stream: &[u8] = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\nPING\r\n*0\r\nset a 'b c'\n*2\r\n$3\r\nGET\r\n$0\r\n\r\n";
        let limits = Limits::default();
        let (whole, _) = feed(stream, stream.len(), &limits);
        for chunk in 1..stream.len() {
            assert_eq!(feed(stream, chunk, &limits).0, whole, "chunk {chunk}");
        }
    }

    #[test]
    fn malformed_and_bounds() {
        assert_eq!(one(b"*x\r\n"), Err(ProtocolError::BadMultibulkLength));
        assert_eq!(
            one(b"*1\r\n+OK\r\n"),
            Err(ProtocolError::ExpectedBulk(b'+'))
        );
        assert_eq!(one(b"*1\r\n$-5\r\n"), Err(ProtocolError::BadBulkLength));
        assert_eq!(one(b"*1\r\n$2\r\nabcd"), Err(ProtocolError::MissingCrlf));
        assert_eq!(
            one(b"*1\r\n$99999999999999999\r\n"),
            Err(ProtocolError::BulkTooLong {
                len: 99999999999999999,
                max: 16 << 20
            })
        );
        assert_eq!(
            one(b"*1\r\n$999999999999999999999\r\n"),
            Err(ProtocolError::BadBulkLength)
        );
        assert_eq!(
            one(b"*123456789012345678901234567890"),
            Err(ProtocolError::HeaderTooLong)
        );
        let limits = Limits {
            max_bulk: 4,
            max_args: 2,
            max_inline: 8,
        };
        let mut args = Vec::new();
        assert_eq!(
            parse(b"*3\r\n", &limits, &mut args),
            Err(ProtocolError::TooManyArgs { count: 3, max: 2 })
        );
        assert_eq!(
            parse(b"*1\r\n$5\r\n", &limits, &mut args),
            Err(ProtocolError::BulkTooLong { len: 5, max: 4 })
        );
        assert_eq!(
            parse(b"aaaaaaaaaaaa", &limits, &mut args),
            Err(ProtocolError::InlineTooLong(8))
        );
        assert_eq!(
            parse(b"a b c\n", &limits, &mut args),
            Err(ProtocolError::TooManyArgs { count: 3, max: 2 })
        );
    }
}
