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

/// Parse one command from the start of `buf`. `Ok(Some(n))`: a command took the first
/// `n` bytes and its arguments are in `args` as `(start, end)` ranges of `buf` (possibly
/// none: an empty line or an empty array, which callers skip); `Ok(None)`: the command
/// is not complete yet (read more and call again with the same start).
pub fn parse(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<(usize, usize)>,
) -> Result<Option<usize>, ProtocolError> {
    args.clear();
    match buf.first() {
        None => Ok(None),
        Some(b'*') => parse_multibulk(buf, limits, args),
        Some(_) => parse_inline(buf, limits, args),
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

fn parse_multibulk(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<(usize, usize)>,
) -> Result<Option<usize>, ProtocolError> {
    let Some(cr) = find_crlf(buf, 1, MAX_HEADER)? else {
        return Ok(None);
    };
    let count = parse_int(&buf[1..cr]).ok_or(ProtocolError::BadMultibulkLength)?;
    let mut pos = cr + 2;
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
    for _ in 0..count {
        let Some(&first) = buf.get(pos) else {
            return Ok(None);
        };
        if first != b'$' {
            return Err(ProtocolError::ExpectedBulk(first));
        }
        let Some(cr) = find_crlf(buf, pos + 1, MAX_HEADER)? else {
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
        let end = start + len as usize;
        if buf.len() < end + 2 {
            return Ok(None);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(ProtocolError::MissingCrlf);
        }
        args.push((start, end));
        pos = end + 2;
    }
    Ok(Some(pos))
}

fn parse_inline(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<(usize, usize)>,
) -> Result<Option<usize>, ProtocolError> {
    let scan = &buf[..buf.len().min(limits.max_inline + 1)];
    let Some(nl) = scan.iter().position(|&b| b == b'\n') else {
        if buf.len() > limits.max_inline {
            return Err(ProtocolError::InlineTooLong(limits.max_inline));
        }
        return Ok(None);
    };
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
