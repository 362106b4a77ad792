//! Reading and writing the kernel's text files: one-shot reads, and files opened once and
//! re-read from offset 0 for monitors that sample every few milliseconds.

use crate::HostError;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A kernel file opened once and re-read whole, from offset 0, with `pread`.
///
/// `/proc` and `/sys` files regenerate their content when read from offset 0, so a
/// reading costs two or three system calls (the content, possibly in pieces, then the
/// end) instead of open + read + close and a path lookup. The buffer grows to the largest
/// content seen and is reused.
#[derive(Debug)]
pub(crate) struct Sampled {
    file: File,
    path: PathBuf,
    buf: Vec<u8>,
}

impl Sampled {
    pub(crate) fn open(path: impl Into<PathBuf>) -> Result<Sampled, HostError> {
        let path = path.into();
        let file = File::open(&path).map_err(|e| HostError::io("open", &path, e))?;
        Ok(Sampled {
            file,
            path,
            buf: vec![0; 4096],
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The whole current content.
    pub(crate) fn read(&mut self) -> Result<&str, HostError> {
        let mut len = 0;
        loop {
            if len == self.buf.len() {
                // Files here are small (vmstat, the largest, is ~4 KiB); a content that
                // keeps growing is cut at 1 MiB rather than taking the memory.
                if self.buf.len() >= 1 << 20 {
                    break;
                }
                self.buf.resize(self.buf.len() * 2, 0);
            }
            // A short read is not the end: seq_file hands out at most a page at a time.
            let n = self
                .file
                .read_at(&mut self.buf[len..], len as u64)
                .map_err(|e| HostError::io("read", &self.path, e))?;
            if n == 0 {
                break;
            }
            len += n;
        }
        std::str::from_utf8(&self.buf[..len]).map_err(|_| HostError::Parse {
            path: self.path.clone(),
            text: "not UTF-8".into(),
        })
    }
}

/// The whole content of a file, as text.
pub(crate) fn read_text(path: &Path) -> Result<String, HostError> {
    std::fs::read_to_string(path).map_err(|e| HostError::io("read", path, e))
}

/// The file's trimmed content parsed as `T`.
pub(crate) fn read_parsed<T: std::str::FromStr>(path: &Path) -> Result<T, HostError> {
    let text = read_text(path)?;
    let t = text.trim();
    t.parse().map_err(|_| HostError::Parse {
        path: path.to_path_buf(),
        text: t.to_string(),
    })
}

/// Write `value` to a kernel file (one `write` call, as the kernel expects).
pub(crate) fn write_text(path: &Path, value: &str) -> Result<(), HostError> {
    std::fs::write(path, value).map_err(|e| HostError::io("write", path, e))
}

/// The value of `key` in `key value` lines (`memory.stat`, `cpu.stat`, vmstat, zswap's
/// debugfs-like files). `Err(line)` when the key is there but its value is no number.
pub(crate) fn keyed<'t>(text: &'t str, key: &str) -> Result<Option<u64>, &'t str> {
    for line in text.lines() {
        let mut parts = line.split_ascii_whitespace();
        if parts.next() == Some(key) {
            return match parts.next().and_then(|v| v.parse().ok()) {
                Some(v) => Ok(Some(v)),
                None => Err(line),
            };
        }
    }
    Ok(None)
}

/// Every `key value` line whose value is a number, in order; other lines are skipped.
pub(crate) fn pairs(text: &str) -> impl Iterator<Item = (&str, u64)> {
    text.lines().filter_map(|line| {
        let mut parts = line.split_ascii_whitespace();
        let key = parts.next()?;
        let value = parts.next()?.parse().ok()?;
        Some((key, value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampled_file_sees_new_content_and_grows() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f");
        std::fs::write(&p, "a 1\n").unwrap();
        let mut s = Sampled::open(&p).unwrap();
        assert_eq!(s.read().unwrap(), "a 1\n");
        let big = "x 2\n".repeat(3000); // 12 000 bytes: past the first buffer
        std::fs::write(&p, &big).unwrap();
        assert_eq!(s.read().unwrap(), big);
        std::fs::write(&p, "b 3\n").unwrap();
        assert_eq!(s.read().unwrap(), "b 3\n");
        assert_eq!(s.path(), p);
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(s.read().is_err());
        assert!(Sampled::open(t.path().join("nope")).is_err());
    }

    #[test]
    fn keyed_lines() {
        let text = "a 1\nbb 22\nc x\n";
        assert_eq!(keyed(text, "bb"), Ok(Some(22)));
        assert_eq!(keyed(text, "b"), Ok(None));
        assert_eq!(keyed(text, "c"), Err("c x"));
        let all: Vec<_> = pairs(text).collect();
        assert_eq!(all, vec![("a", 1), ("bb", 22)]);
    }
}
