//! The scavenging file system (`granule fs mount`) against tmpfs, as real processes: a
//! real crate from the local cargo cache unpacked and built inside the mount with the same
//! result as outside; seeded random operations (writes at random offsets across stripe
//! boundaries, appends, truncates, renames, links, open handles, overlapping reads and
//! disjoint writes from two threads) compared with the same operations on tmpfs after
//! every step; and the calls beyond read and write that tools use: shared writable mmap,
//! advisory locks, fallocate, utimens, statfs and ENOSPC, and calls the mount does not
//! support (an errno, promptly, never a hang).
//!
//! These tests need root, /dev/fuse and fusermount3 (and tar, unshare and mount for the
//! build test). Where FUSE is missing they fail, unless GRANULE_SKIP_FUSE_TESTS is set:
//! then they print why and pass. A failing random-operation seed is printed with its
//! operations; `GRANULE_FS_SEED=S GRANULE_FS_OPS=N` reruns only seed S for N steps.

#[path = "common/fsmount.rs"]
mod fsmount;

use fsmount::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// ---------------------------------------------------------------------------------------
// Trees: walk and compare.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Clone, Debug)]
struct Node {
    kind: Kind,
    mode: u32,
    size: u64,
    nlink: u64,
    ino: u64,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    target: Option<PathBuf>,
}

/// Every entry under `root` (not `root` itself), by path relative to `root`.
fn walk(root: &Path) -> io::Result<BTreeMap<PathBuf, Node>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for e in fs::read_dir(root.join(&rel))? {
            let e = e?;
            let r = rel.join(e.file_name());
            let p = root.join(&r);
            let md = fs::symlink_metadata(&p)?;
            let ft = md.file_type();
            let kind = if ft.is_file() {
                Kind::File
            } else if ft.is_dir() {
                Kind::Dir
            } else if ft.is_symlink() {
                Kind::Symlink
            } else {
                Kind::Other
            };
            let target = if kind == Kind::Symlink {
                Some(fs::read_link(&p)?)
            } else {
                None
            };
            if kind == Kind::Dir {
                stack.push(r.clone());
            }
            out.insert(
                r,
                Node {
                    kind,
                    mode: md.mode() & 0o7777,
                    size: md.len(),
                    nlink: md.nlink(),
                    ino: md.ino(),
                    uid: md.uid(),
                    gid: md.gid(),
                    mtime: (md.mtime(), md.mtime_nsec()),
                    target,
                },
            );
        }
    }
    Ok(out)
}

#[derive(Clone, Copy)]
struct Check<'a> {
    /// Compare the modification times of files and symlinks (to the nanosecond; a
    /// directory's changes whenever an entry is added, so two unpackings differ).
    mtimes: bool,
    /// Files with these names hold JSON and are compared as JSON values.
    json_names: &'a [&'a str],
    /// Files whose records may come in any order: compared by length and by the sorted
    /// list of the printable strings in them.
    unordered: fn(&Path) -> bool,
}

fn never(_: &Path) -> bool {
    false
}

/// The printable runs (4 bytes or longer) in `b`, sorted.
fn strings(b: &[u8]) -> Vec<&[u8]> {
    let mut v: Vec<&[u8]> = b
        .split(|c| !(0x20..0x7f).contains(c))
        .filter(|s| s.len() >= 4)
        .collect();
    v.sort();
    v
}

/// Compare the tree at `got` (in the mount) with the tree at `want` (tmpfs): the same
/// entries, kinds, permission bits, owners, symlink targets, file sizes, link counts and
/// bytes, and the same hard-link structure. Returns the walk of `want`.
fn compare_trees(got: &Path, want: &Path, check: Check) -> Result<BTreeMap<PathBuf, Node>, String> {
    let g = walk(got).map_err(|e| format!("walking the mount's tree {}: {e}", got.display()))?;
    let w = walk(want).map_err(|e| format!("walking tmpfs's tree {}: {e}", want.display()))?;
    let mut diffs = Vec::new();
    let gk: BTreeSet<&PathBuf> = g.keys().collect();
    let wk: BTreeSet<&PathBuf> = w.keys().collect();
    for missing in wk.difference(&gk) {
        diffs.push(format!("{}: missing in the mount", missing.display()));
    }
    for extra in gk.difference(&wk) {
        diffs.push(format!("{}: only in the mount", extra.display()));
    }
    let mut inodes: HashMap<u64, u64> = HashMap::new();
    let mut inodes_back: HashMap<u64, u64> = HashMap::new();
    for (rel, wn) in &w {
        let Some(gn) = g.get(rel) else { continue };
        let name = rel.display();
        if gn.kind != wn.kind {
            diffs.push(format!(
                "{name}: {:?} in the mount, {:?} on tmpfs",
                gn.kind, wn.kind
            ));
            continue;
        }
        if gn.kind != Kind::Symlink && gn.mode != wn.mode {
            diffs.push(format!("{name}: mode {:o}, tmpfs {:o}", gn.mode, wn.mode));
        }
        if (gn.uid, gn.gid) != (wn.uid, wn.gid) {
            diffs.push(format!(
                "{name}: owner {}:{}, tmpfs {}:{}",
                gn.uid, gn.gid, wn.uid, wn.gid
            ));
        }
        if check.mtimes && gn.kind != Kind::Dir && gn.mtime != wn.mtime {
            diffs.push(format!(
                "{name}: mtime {:?}, tmpfs {:?}",
                gn.mtime, wn.mtime
            ));
        }
        if gn.target != wn.target {
            diffs.push(format!(
                "{name}: link to {:?}, tmpfs {:?}",
                gn.target, wn.target
            ));
        }
        if gn.kind != Kind::File {
            continue;
        }
        if gn.size != wn.size {
            diffs.push(format!("{name}: size {}, tmpfs {}", gn.size, wn.size));
        }
        // Directories' link counts are the file system's own business (many report 1);
        // regular files' counts are what `link` and `unlink` promise.
        if gn.nlink != wn.nlink {
            diffs.push(format!("{name}: {} links, tmpfs {}", gn.nlink, wn.nlink));
        }
        if *inodes.entry(wn.ino).or_insert(gn.ino) != gn.ino
            || *inodes_back.entry(gn.ino).or_insert(wn.ino) != wn.ino
        {
            diffs.push(format!(
                "{name}: hard links differ (tmpfs inode {} is mount inode {})",
                wn.ino, gn.ino
            ));
        }
        let gb = fs::read(got.join(rel)).map_err(|e| format!("{name}: read in the mount: {e}"));
        let wb = fs::read(want.join(rel)).map_err(|e| format!("{name}: read on tmpfs: {e}"))?;
        let gb = match gb {
            Ok(b) => b,
            Err(e) => {
                diffs.push(e);
                continue;
            }
        };
        let json = rel
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| check.json_names.contains(&n));
        if json {
            let gv: Result<serde_json::Value, _> = serde_json::from_slice(&gb);
            let wv: Result<serde_json::Value, _> = serde_json::from_slice(&wb);
            match (gv, wv) {
                (Ok(a), Ok(b)) if a == b => {}
                _ => diffs.push(format!("{name}: JSON differs")),
            }
        } else if (check.unordered)(rel) {
            if gb.len() != wb.len() || strings(&gb) != strings(&wb) {
                diffs.push(format!(
                    "{name}: {} bytes, expected {}, or other strings in it",
                    gb.len(),
                    wb.len()
                ));
            }
        } else if let Some(d) = first_difference(&gb, &wb) {
            diffs.push(format!("{name}: contents: {d}"));
        }
    }
    if diffs.is_empty() {
        Ok(w)
    } else {
        let n = diffs.len();
        diffs.truncate(12);
        Err(format!("{n} differences:\n  {}", diffs.join("\n  ")))
    }
}

// ---------------------------------------------------------------------------------------
// 1. A real source tree, unpacked and built.

/// Small dependency-free crates the workspace's lock file holds (so `cargo fetch` put them
/// in the local cache), each with a main program that uses it; the first found is used.
const CRATES: &[(&str, &str)] = &[
    (
        "itoa",
        "fn main() {\n    let mut b = itoa::Buffer::new();\n    for n in [0u64, 7, 42, 1 << 40, u64::MAX] {\n        println!(\"{}\", b.format(n));\n    }\n    println!(\"{}\", b.format(i128::MIN));\n}\n",
    ),
    (
        "cfg-if",
        "cfg_if::cfg_if! {\n    if #[cfg(unix)] {\n        fn os() -> &'static str { \"unix\" }\n    } else {\n        fn os() -> &'static str { \"other\" }\n    }\n}\nfn main() {\n    println!(\"{}\", os());\n}\n",
    ),
    (
        "fnv",
        "use std::hash::Hasher;\nfn main() {\n    let mut h = fnv::FnvHasher::default();\n    h.write(b\"granule\");\n    println!(\"{:x}\", h.finish());\n}\n",
    ),
    (
        "scopeguard",
        "fn main() {\n    let g = scopeguard::guard(7, |v| println!(\"dropped {v}\"));\n    println!(\"holding {}\", *g);\n}\n",
    ),
    (
        "ryu",
        "fn main() {\n    let mut b = ryu::Buffer::new();\n    for x in [0.1f64, 1.5, 1e300, -2.5e-8] {\n        println!(\"{}\", b.format(x));\n    }\n}\n",
    ),
];

fn cargo_home() -> PathBuf {
    if let Some(h) = std::env::var_os("CARGO_HOME") {
        return PathBuf::from(h);
    }
    PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo")
}

/// The version of `name` in the workspace's Cargo.lock.
fn locked_version(lock: &str, name: &str) -> Option<String> {
    let want = format!("name = \"{name}\"");
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l.trim() == want {
            let v = lines.next()?.trim();
            return v
                .strip_prefix("version = \"")
                .and_then(|v| v.strip_suffix('"'))
                .map(str::to_string);
        }
    }
    None
}

/// A crate archive from the local cargo cache: (name, archive, unpacked dir name, main).
fn find_crate() -> (String, PathBuf, String, &'static str) {
    let lock_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    let lock = fs::read_to_string(&lock_path).unwrap_or_default();
    let cache = cargo_home().join("registry/cache");
    let registries: Vec<PathBuf> = fs::read_dir(&cache)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    for (name, main) in CRATES {
        let mut found: Vec<PathBuf> = Vec::new();
        for reg in &registries {
            if let Some(v) = locked_version(&lock, name) {
                let p = reg.join(format!("{name}-{v}.crate"));
                if p.is_file() {
                    found.insert(0, p);
                    continue;
                }
            }
            // Another version of the same crate will do.
            if let Ok(rd) = fs::read_dir(reg) {
                for e in rd.flatten() {
                    let f = e.file_name().to_string_lossy().to_string();
                    let rest = f.strip_prefix(&format!("{name}-")).unwrap_or("");
                    if rest.ends_with(".crate") && rest.starts_with(|c: char| c.is_ascii_digit()) {
                        found.push(e.path());
                    }
                }
            }
        }
        if let Some(p) = found.into_iter().next() {
            let file = p.file_name().map(|f| f.to_string_lossy().to_string());
            let dir = file
                .and_then(|f| f.strip_suffix(".crate").map(str::to_string))
                .expect("a .crate file name");
            return (name.to_string(), p, dir, main);
        }
    }
    panic!(
        "none of {:?} is in the local cargo cache {}; run `cargo fetch` in the workspace",
        CRATES.iter().map(|c| c.0).collect::<Vec<_>>(),
        cache.display()
    );
}

/// Cargo's encoded dep-info: `.fingerprint/UNIT/dep-*`.
fn cargo_dep_info(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let fingerprint = p
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .is_some_and(|n| n == ".fingerprint");
    fingerprint && name.starts_with("dep-")
}

/// `cargo build --offline` of `tree/demo` with the tree bind-mounted at `at`, in a mount
/// namespace of its own (the bind goes away with the process).
fn cargo_build_at(tree: &Path, at: &Path) -> std::process::Output {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind \"$1\" \"$2\" && cd \"$2/demo\" && exec \"$3\" build --offline")
        .arg("sh")
        .arg(tree)
        .arg(at)
        .arg(&cargo)
        .env("CARGO_TARGET_DIR", at.join("demo/target"))
        .env("CARGO_INCREMENTAL", "0")
        .env("CARGO_TERM_COLOR", "never");
    for v in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
    ] {
        cmd.env_remove(v);
    }
    run_bounded(&mut cmd, Duration::from_secs(600))
}

#[test]
fn source_tree_unpacks_and_builds_inside_the_mount() {
    if !fuse_usable("source_tree_unpacks_and_builds_inside_the_mount") {
        return;
    }
    let _one = serial();
    let (name, archive, unpacked, main) = find_crate();
    eprintln!("using {}", archive.display());
    let m = Mount::start(&[], Duration::from_secs(1200));
    let reference = Tmpfs::new();
    let inside = m.path("tree");
    let outside = reference.path().join("tree");
    for t in [&inside, &outside] {
        fs::create_dir(t).expect("tree dir");
        let out = run_bounded(
            Command::new("tar")
                .arg("xzf")
                .arg(&archive)
                .arg("-C")
                .arg(t),
            Duration::from_secs(120),
        );
        assert!(
            out.status.success(),
            "tar xzf into {} failed: {}",
            t.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // tar restores modes and modification times (utimensat): compare them too.
    let unpacked_check = Check {
        mtimes: true,
        json_names: &[],
        unordered: never,
    };
    let files = compare_trees(&inside, &outside, unpacked_check)
        .unwrap_or_else(|e| panic!("the unpacked crate differs from tmpfs: {e}"));
    assert!(
        files.values().filter(|n| n.kind == Kind::File).count() >= 3,
        "the archive held almost nothing: {files:?}"
    );

    // A program using the crate (a path dependency), built by cargo in each tree.
    for t in [&inside, &outside] {
        fs::create_dir_all(t.join("demo/src")).expect("demo dir");
        fs::write(
            t.join("demo/Cargo.toml"),
            format!(
                "[package]\nname = \"demo\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
                 [dependencies]\n{name} = {{ path = \"../{unpacked}\" }}\n\n[workspace]\n"
            ),
        )
        .expect("Cargo.toml");
        fs::write(t.join("demo/src/main.rs"), main).expect("main.rs");
    }
    // Both builds run at the same absolute path (each tree bind-mounted there in turn):
    // cargo hashes a path dependency's absolute path into its artifacts' names and rustc
    // writes source paths into the rlib, its metadata and the debug info, so only builds
    // at the same path can be compared byte for byte. Incremental compilation is off (its
    // session directories get random names). Then every file cargo and rustc wrote must
    // be the same, except .rustc_info.json, a cache whose JSON map order varies between
    // runs, compared as JSON, and cargo's encoded dep-info (.fingerprint/*/dep-*), whose
    // source files cargo writes from a hash map in an order that varies between runs,
    // compared by length and the paths in it.
    let at_dir = tempfile::tempdir().expect("temp dir");
    let at = at_dir.path().join("build");
    fs::create_dir(&at).expect("bind target");
    let mut outputs = Vec::new();
    for (t, side) in [(&outside, "tmpfs"), (&inside, "the mount")] {
        let out = cargo_build_at(t, &at);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success(),
            "cargo build in {side} failed:\n{stderr}"
        );
        assert!(
            stderr.contains("Compiling demo"),
            "no compile in {side}: {stderr}"
        );
        let run = run_bounded(
            &mut Command::new(t.join("demo/target/debug/demo")),
            Duration::from_secs(60),
        );
        assert!(run.status.success(), "the program built in {side} failed");
        assert!(
            !run.stdout.is_empty(),
            "the program built in {side} printed nothing"
        );
        outputs.push(run.stdout);
    }
    assert_eq!(
        String::from_utf8_lossy(&outputs[0]),
        String::from_utf8_lossy(&outputs[1]),
        "the program built in the mount prints something else"
    );
    let built = Check {
        mtimes: false,
        json_names: &[".rustc_info.json"],
        unordered: cargo_dep_info,
    };
    let all = compare_trees(&inside, &outside, built)
        .unwrap_or_else(|e| panic!("the build in the mount differs from the one on tmpfs: {e}"));
    let rlibs = all
        .keys()
        .filter(|p| p.extension().is_some_and(|e| e == "rlib" || e == "rmeta"))
        .count();
    assert!(
        rlibs >= 2,
        "no rlib or rmeta was compared: {:?}",
        all.keys()
    );

    // A second build finds everything fresh: the mount keeps the modification times cargo
    // judges freshness by.
    let again = cargo_build_at(&inside, &at);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        again.status.success(),
        "second cargo build failed: {stderr}"
    );
    assert!(
        !stderr.contains("Compiling"),
        "the second build in the mount compiled again (modification times not kept?):\n{stderr}"
    );

    fs::remove_dir_all(&inside).expect("rm -r the tree in the mount");
    assert!(
        fs::read_dir(m.path("")).expect("readdir").next().is_none(),
        "the mount is not empty after rm -r"
    );
    m.unmount_cleanly();
}

// ---------------------------------------------------------------------------------------
// 2. Seeded random operations against tmpfs.

/// Largest file the operations make, and the most bytes a tree holds before the
/// operations only shrink it (every file is read back after every step).
const MAX_FILE: u64 = 8 * MIB as u64;
const TOTAL_CAP: u64 = 24 * MIB as u64;
const SLOTS: usize = 3;
const NAMES: &[&str] = &["a", "b", "c", "d", "x", "y"];

#[derive(Clone, Debug)]
enum Op {
    Create {
        path: String,
        mode: u32,
        len: usize,
        data: u64,
    },
    Write {
        path: String,
        off: u64,
        len: usize,
        data: u64,
    },
    Append {
        path: String,
        len: usize,
        data: u64,
    },
    Truncate {
        path: String,
        len: u64,
        by_path: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    Unlink {
        path: String,
    },
    Link {
        from: String,
        to: String,
    },
    Symlink {
        target: String,
        path: String,
    },
    Mkdir {
        path: String,
        mode: u32,
    },
    Rmdir {
        path: String,
    },
    Chmod {
        path: String,
        mode: u32,
    },
    Fsync {
        path: String,
        data_only: bool,
    },
    Open {
        slot: usize,
        path: String,
    },
    HandleWrite {
        slot: usize,
        off: u64,
        len: usize,
        data: u64,
    },
    HandleRead {
        slot: usize,
        off: u64,
        len: usize,
    },
    HandleTruncate {
        slot: usize,
        len: u64,
    },
    HandleFsync {
        slot: usize,
    },
    Close {
        slot: usize,
    },
    /// Two threads read these ranges at once, three each (thread 0 the first three).
    ParallelRead {
        path: String,
        ranges: Vec<(u64, usize)>,
    },
    /// Two threads write disjoint ranges at once (off, len, data seed).
    ParallelWrite {
        path: String,
        a: (u64, usize, u64),
        b: (u64, usize, u64),
    },
    DropCache,
}

/// What an operation returned: bytes it read, or nothing; or the errno.
type Res = Result<Option<Vec<u8>>, i32>;

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn same_outcome(a: &Res, b: &Res) -> bool {
    match (a, b) {
        (Ok(x), Ok(y)) => x == y,
        // POSIX allows EEXIST where Linux's file systems say ENOTEMPTY.
        (Err(x), Err(y)) => {
            x == y
                || ([libc::ENOTEMPTY, libc::EEXIST].contains(x)
                    && [libc::ENOTEMPTY, libc::EEXIST].contains(y))
        }
        _ => false,
    }
}

fn show(r: &Res) -> String {
    match r {
        Ok(None) => "ok".into(),
        Ok(Some(b)) => format!("ok, {} bytes read", b.len()),
        Err(e) => format!("errno {e} ({})", io::Error::from_raw_os_error(*e)),
    }
}

fn read_range(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    let mut n = 0;
    while n < len {
        let r = f.read_at(&mut v[n..], off + n as u64)?;
        if r == 0 {
            break;
        }
        n += r;
    }
    v.truncate(n);
    Ok(v)
}

fn c_path(p: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).expect("no NUL")
}

fn ok(r: io::Result<()>) -> Res {
    r.map(|()| None).map_err(errno)
}

/// Apply `op` to the tree at `root` with the open handles `h`. `concurrent`: the
/// two-thread operations run on two threads (the mount); else one after the other.
fn apply(op: &Op, root: &Path, h: &mut [Option<File>], concurrent: bool) -> Res {
    let p = |s: &str| root.join(s);
    match op {
        Op::Create {
            path,
            mode,
            len,
            data,
        } => ok((|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(*mode)
                .open(p(path))?;
            f.write_all(&seeded_bytes(*data, *len))
        })()),
        Op::Write {
            path,
            off,
            len,
            data,
        } => ok((|| {
            let f = OpenOptions::new().write(true).open(p(path))?;
            f.write_all_at(&seeded_bytes(*data, *len), *off)
        })()),
        Op::Append { path, len, data } => ok((|| {
            let mut f = OpenOptions::new().append(true).open(p(path))?;
            f.write_all(&seeded_bytes(*data, *len))
        })()),
        Op::Truncate { path, len, by_path } => {
            if *by_path {
                let c = c_path(&p(path));
                // SAFETY: `c` is a valid C string.
                let r = unsafe { libc::truncate(c.as_ptr(), *len as libc::off_t) };
                ok(if r == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                })
            } else {
                ok(OpenOptions::new()
                    .write(true)
                    .open(p(path))
                    .and_then(|f| f.set_len(*len)))
            }
        }
        Op::Rename { from, to } => ok(fs::rename(p(from), p(to))),
        Op::Unlink { path } => ok(fs::remove_file(p(path))),
        Op::Link { from, to } => ok(fs::hard_link(p(from), p(to))),
        Op::Symlink { target, path } => ok(std::os::unix::fs::symlink(target, p(path))),
        Op::Mkdir { path, mode } => ok(fs::DirBuilder::new().mode(*mode).create(p(path))),
        Op::Rmdir { path } => ok(fs::remove_dir(p(path))),
        Op::Chmod { path, mode } => ok(fs::set_permissions(
            p(path),
            fs::Permissions::from_mode(*mode),
        )),
        Op::Fsync { path, data_only } => ok(File::open(p(path)).and_then(|f| {
            if *data_only {
                f.sync_data()
            } else {
                f.sync_all()
            }
        })),
        Op::Open { slot, path } => match OpenOptions::new().read(true).write(true).open(p(path)) {
            Ok(f) => {
                h[*slot] = Some(f);
                Ok(None)
            }
            Err(e) => Err(errno(e)),
        },
        Op::HandleWrite {
            slot,
            off,
            len,
            data,
        } => {
            let f = h[*slot].as_ref().expect("open slot");
            ok(f.write_all_at(&seeded_bytes(*data, *len), *off))
        }
        Op::HandleRead { slot, off, len } => {
            let f = h[*slot].as_ref().expect("open slot");
            read_range(f, *off, *len).map(Some).map_err(errno)
        }
        Op::HandleTruncate { slot, len } => ok(h[*slot].as_ref().expect("open slot").set_len(*len)),
        Op::HandleFsync { slot } => ok(h[*slot].as_ref().expect("open slot").sync_all()),
        Op::Close { slot } => {
            h[*slot] = None;
            Ok(None)
        }
        Op::ParallelRead { path, ranges } => {
            let file = p(path);
            let read_all = |rs: &[(u64, usize)], drop_first: bool| -> io::Result<Vec<u8>> {
                let f = File::open(&file)?;
                let mut out = Vec::new();
                for &(off, len) in rs {
                    if drop_first {
                        drop_cache_fd(&f)?;
                    }
                    out.extend(read_range(&f, off, len)?);
                }
                Ok(out)
            };
            let (r0, r1) = if concurrent {
                std::thread::scope(|s| {
                    let t0 = s.spawn(|| read_all(&ranges[..3], true));
                    let t1 = s.spawn(|| read_all(&ranges[3..], false));
                    (
                        t0.join().expect("reader thread"),
                        t1.join().expect("reader thread"),
                    )
                })
            } else {
                (read_all(&ranges[..3], false), read_all(&ranges[3..], false))
            };
            let mut v = r0.map_err(errno)?;
            v.extend(r1.map_err(errno)?);
            Ok(Some(v))
        }
        Op::ParallelWrite { path, a, b } => {
            let file = p(path);
            let write = |(off, len, data): (u64, usize, u64)| -> io::Result<()> {
                let f = OpenOptions::new().write(true).open(&file)?;
                f.write_all_at(&seeded_bytes(data, len), off)
            };
            let (ra, rb) = if concurrent {
                std::thread::scope(|s| {
                    let t0 = s.spawn(|| write(*a));
                    let t1 = s.spawn(|| write(*b));
                    (
                        t0.join().expect("writer thread"),
                        t1.join().expect("writer thread"),
                    )
                })
            } else {
                (write(*a), write(*b))
            };
            ok(ra.and(rb))
        }
        Op::DropCache => Ok(None),
    }
}

/// The reference tree as the generator sees it.
struct View {
    files: Vec<(String, u64)>,
    dirs: Vec<String>,
    symlinks: Vec<String>,
    total: u64,
    /// Size of each open handle's file (None: slot free).
    slots: Vec<Option<u64>>,
}

impl View {
    fn new(tree: &BTreeMap<PathBuf, Node>, handles: &[Option<File>]) -> View {
        let mut v = View {
            files: Vec::new(),
            dirs: vec![String::new()],
            symlinks: Vec::new(),
            total: 0,
            slots: handles
                .iter()
                .map(|h| {
                    h.as_ref()
                        .map(|f| f.metadata().map(|m| m.len()).unwrap_or(0))
                })
                .collect(),
        };
        for (p, n) in tree {
            let s = p.to_string_lossy().to_string();
            match n.kind {
                Kind::File => {
                    v.total += n.size;
                    v.files.push((s, n.size));
                }
                Kind::Dir => v.dirs.push(s),
                Kind::Symlink => v.symlinks.push(s),
                Kind::Other => {}
            }
        }
        v
    }

    fn entries(&self) -> Vec<String> {
        let mut e: Vec<String> = self.files.iter().map(|f| f.0.clone()).collect();
        e.extend(self.dirs.iter().filter(|d| !d.is_empty()).cloned());
        e.extend(self.symlinks.iter().cloned());
        e
    }
}

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> Option<&'a T> {
    (!v.is_empty()).then(|| &v[rng.random_range(0..v.len())])
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// A path in an existing directory (that name may exist already).
fn new_path(rng: &mut StdRng, v: &View) -> String {
    let dirs: Vec<&String> = v
        .dirs
        .iter()
        .filter(|d| d.matches('/').count() < 2)
        .collect();
    let d = pick(rng, &dirs).map(|d| d.as_str()).unwrap_or("");
    join(d, NAMES[rng.random_range(0..NAMES.len())])
}

/// 1 B to 3 MiB: many small writes, some that cross one or more stripes.
fn write_len(rng: &mut StdRng) -> usize {
    match rng.random_range(0..10) {
        0..4 => rng.random_range(1..=4096),
        4..7 => rng.random_range(4097..=256 * KIB),
        _ => rng.random_range(256 * KIB..=3 * MIB),
    }
}

/// An offset in or past a file of `size` bytes, often near a stripe boundary.
fn offset(rng: &mut StdRng, size: u64, stripe: u64) -> u64 {
    match rng.random_range(0..10) {
        0..4 => rng.random_range(0..=size),
        4..7 => {
            let k = rng.random_range(1..=size / stripe + 1) * stripe;
            let d = rng.random_range(0..=8192u64);
            if rng.random_bool(0.5) {
                k.saturating_sub(d)
            } else {
                k + d
            }
        }
        7..9 => size,
        _ => size + rng.random_range(1..=2 * stripe),
    }
}

/// Keep `off + len` within MAX_FILE.
fn fit(rng: &mut StdRng, off: u64, len: usize) -> (u64, usize) {
    let off = if off >= MAX_FILE {
        rng.random_range(0..MAX_FILE / 2)
    } else {
        off
    };
    (off, len.min((MAX_FILE - off) as usize).max(1))
}

fn gen_op(rng: &mut StdRng, v: &View, stripe: u64) -> Op {
    let data = rng.random::<u64>();
    // Over the byte budget: only shrink.
    if v.total > TOTAL_CAP {
        let biggest = v.files.iter().max_by_key(|f| f.1).expect("files");
        return if rng.random_bool(0.5) {
            Op::Truncate {
                path: biggest.0.clone(),
                len: rng.random_range(0..=biggest.1 / 2),
                by_path: rng.random_bool(0.5),
            }
        } else {
            Op::Unlink {
                path: pick(rng, &v.files).expect("files").0.clone(),
            }
        };
    }
    let open: Vec<usize> = (0..SLOTS).filter(|s| v.slots[*s].is_some()).collect();
    let free: Vec<usize> = (0..SLOTS).filter(|s| v.slots[*s].is_none()).collect();
    let entries = v.entries();
    loop {
        let file = pick(rng, &v.files).cloned();
        let op = match rng.random_range(0..100) {
            0..10 => Some(Op::Create {
                path: new_path(rng, v),
                mode: [0o644, 0o600, 0o755, 0o640][rng.random_range(0..4)],
                len: if rng.random_bool(0.3) {
                    0
                } else {
                    write_len(rng)
                },
                data,
            }),
            10..30 => file.map(|(path, size)| {
                // Now and then through a symlink (which may dangle: ENOENT both sides).
                let path = match pick(rng, &v.symlinks) {
                    Some(l) if rng.random_bool(0.1) => l.clone(),
                    _ => path,
                };
                let (o, l) = (offset(rng, size, stripe), write_len(rng));
                let (off, len) = fit(rng, o, l);
                Op::Write {
                    path,
                    off,
                    len,
                    data,
                }
            }),
            30..36 => file.map(|(path, size)| Op::Append {
                path,
                len: {
                    let l = write_len(rng);
                    fit(rng, size, l).1
                },
                data,
            }),
            36..44 => file.map(|(path, size)| {
                let len = match rng.random_range(0..3) {
                    0 => rng.random_range(0..=size),
                    1 => (size + rng.random_range(1..=2 * stripe)).min(MAX_FILE),
                    _ => {
                        let k = rng.random_range(0..=size / stripe + 1) * stripe;
                        (k + rng.random_range(0..=2))
                            .saturating_sub(1)
                            .min(MAX_FILE)
                    }
                };
                Op::Truncate {
                    path,
                    len,
                    by_path: rng.random_bool(0.5),
                }
            }),
            44..52 => pick(rng, &entries).map(|from| {
                let to = match pick(rng, &entries) {
                    Some(e) if rng.random_bool(0.4) => e.clone(),
                    _ => new_path(rng, v),
                };
                Op::Rename {
                    from: from.clone(),
                    to,
                }
            }),
            52..57 => {
                let path = if rng.random_bool(0.8) {
                    file.map(|f| f.0)
                } else {
                    pick(rng, &entries).cloned()
                };
                path.map(|path| Op::Unlink { path })
            }
            57..61 => {
                let from = match pick(rng, &v.symlinks) {
                    Some(l) if rng.random_bool(0.2) => Some(l.clone()),
                    _ => file.map(|f| f.0),
                };
                from.map(|from| Op::Link {
                    from,
                    to: new_path(rng, v),
                })
            }
            61..64 => {
                let base = pick(rng, &entries)
                    .cloned()
                    .unwrap_or_else(|| "nowhere".into());
                let up = if rng.random_bool(0.3) { "../" } else { "" };
                Some(Op::Symlink {
                    target: format!("{up}{base}"),
                    path: new_path(rng, v),
                })
            }
            64..67 => Some(Op::Mkdir {
                path: new_path(rng, v),
                mode: [0o755, 0o700, 0o750, 0o777][rng.random_range(0..4)],
            }),
            67..70 => {
                let dirs: Vec<String> = v.dirs.iter().filter(|d| !d.is_empty()).cloned().collect();
                let path = if rng.random_bool(0.85) {
                    pick(rng, &dirs).cloned()
                } else {
                    pick(rng, &entries).cloned()
                };
                path.map(|path| Op::Rmdir { path })
            }
            70..74 => pick(rng, &entries).map(|path| Op::Chmod {
                path: path.clone(),
                mode: [
                    0o644, 0o600, 0o640, 0o755, 0o700, 0o444, 0o666, 0o777, 0o400,
                ][rng.random_range(0..9)],
            }),
            74..77 => pick(rng, &entries).map(|path| Op::Fsync {
                path: path.clone(),
                data_only: rng.random_bool(0.5),
            }),
            77..80 => match (pick(rng, &free), file) {
                (Some(&slot), Some((path, _))) => Some(Op::Open { slot, path }),
                _ => None,
            },
            80..85 => pick(rng, &open).map(|&slot| {
                let size = v.slots[slot].unwrap_or(0);
                let (o, l) = (offset(rng, size, stripe), write_len(rng));
                let (off, len) = fit(rng, o, l);
                Op::HandleWrite {
                    slot,
                    off,
                    len,
                    data,
                }
            }),
            85..88 => pick(rng, &open).map(|&slot| {
                let size = v.slots[slot].unwrap_or(0);
                Op::HandleRead {
                    slot,
                    off: rng.random_range(0..=size + 100),
                    len: write_len(rng),
                }
            }),
            88 => pick(rng, &open).map(|&slot| Op::HandleTruncate {
                slot,
                len: rng.random_range(0..=v.slots[slot].unwrap_or(0) + stripe),
            }),
            89 => pick(rng, &open).map(|&slot| Op::HandleFsync { slot }),
            90..92 => pick(rng, &open).map(|&slot| Op::Close { slot }),
            92..96 => file.filter(|f| f.1 > 0).map(|(path, size)| {
                let center = rng.random_range(0..size);
                let ranges = (0..6)
                    .map(|_| {
                        let off = center.saturating_sub(rng.random_range(0..=256 * KIB as u64));
                        (off, rng.random_range(1..=MIB + 512 * KIB))
                    })
                    .collect();
                Op::ParallelRead { path, ranges }
            }),
            96..99 => file.map(|(path, size)| {
                let (o, l) = (offset(rng, size, stripe), write_len(rng).min(MIB));
                let (off1, len1) = fit(rng, o, l);
                let off2 = off1 + len1 as u64 + rng.random_range(0..=4096u64);
                let l = write_len(rng).min(MIB);
                let (off2, len2) = fit(rng, off2, l);
                let b = (off2, len2, data ^ 0x5555);
                // `fit` may have moved the second range back over the first: then one
                // thread writes only.
                let b = if off2 < off1 + len1 as u64 {
                    (off1, len1, data)
                } else {
                    b
                };
                Op::ParallelWrite {
                    path,
                    a: (off1, len1, data),
                    b,
                }
            }),
            _ => Some(Op::DropCache),
        };
        if let Some(op) = op {
            return op;
        }
    }
}

/// Run `ops` seeded random operations on `mnt` (a directory in the mount) and on `reference`
/// (tmpfs), comparing outcomes and both trees after every step. On a mismatch: the step,
/// the operations so far, and what differs.
fn run_seed(
    seed: u64,
    ops: usize,
    stripe: u64,
    mnt: &Path,
    reference: &Path,
) -> Result<Vec<String>, (usize, Vec<String>, String)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut hm: Vec<Option<File>> = (0..SLOTS).map(|_| None).collect();
    let mut hr: Vec<Option<File>> = (0..SLOTS).map(|_| None).collect();
    let mut log = Vec::new();
    let check = Check {
        mtimes: false,
        json_names: &[],
        unordered: never,
    };
    let mut tree = walk(reference).map_err(|e| (0, vec![], format!("walk tmpfs: {e}")))?;
    for step in 0..ops {
        let view = View::new(&tree, &hr);
        let op = gen_op(&mut rng, &view, stripe);
        log.push(format!("{step}: {op:?}"));
        let want = apply(&op, reference, &mut hr, false);
        let got = apply(&op, mnt, &mut hm, true);
        if let Some(last) = log.last_mut() {
            last.push_str(&format!(" -> {}", show(&want)));
        }
        if !same_outcome(&got, &want) {
            let what = match (&got, &want) {
                (Ok(Some(g)), Ok(Some(w))) => first_difference(g, w).unwrap_or_default(),
                _ => String::new(),
            };
            return Err((
                step,
                log,
                format!("the mount: {}, tmpfs: {} {what}", show(&got), show(&want)),
            ));
        }
        // Every few steps, and when asked, the next reads come from the file system rather
        // than the page cache.
        if step % 4 == 3 || matches!(op, Op::DropCache) {
            drop_cache_tree(mnt);
            for f in hm.iter().flatten() {
                let _ = drop_cache_fd(f);
            }
        }
        tree = compare_trees(mnt, reference, check).map_err(|e| (step, log.clone(), e))?;
    }
    hm.clear();
    hr.clear();
    drop_cache_tree(mnt);
    compare_trees(mnt, reference, check).map_err(|e| (ops, log.clone(), e))?;
    Ok(log)
}

#[test]
fn random_operations_match_tmpfs() {
    if !fuse_usable("random_operations_match_tmpfs") {
        return;
    }
    let _one = serial();
    let ops: usize = std::env::var("GRANULE_FS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let only: Option<u64> = std::env::var("GRANULE_FS_SEED")
        .ok()
        .and_then(|v| v.parse().ok());
    let runs: [(&str, u64, &[u64]); 2] = [
        ("1MiB", MIB as u64, &[1, 2, 3, 4]),
        ("64KiB", 64 * KIB as u64, &[5]),
    ];
    let mut failures = Vec::new();
    for (stripe_arg, stripe, seeds) in runs {
        let seeds: Vec<u64> = seeds
            .iter()
            .copied()
            .filter(|s| only.is_none_or(|o| o == *s))
            .collect();
        if seeds.is_empty() {
            continue;
        }
        let m = Mount::start(&["--stripe", stripe_arg], Duration::from_secs(1500));
        let reference = Tmpfs::new();
        let mut failed = false;
        for seed in seeds {
            let a = m.path(&format!("seed{seed}"));
            let b = reference.path().join(format!("seed{seed}"));
            fs::create_dir(&a).expect("seed dir in the mount");
            fs::create_dir(&b).expect("seed dir on tmpfs");
            let started = std::time::Instant::now();
            match run_seed(seed, ops, stripe, &a, &b) {
                Ok(log) => {
                    let errors = log.iter().filter(|l| l.contains("-> errno")).count();
                    eprintln!(
                        "seed {seed} (--stripe {stripe_arg}): {ops} operations ({errors} of them \
                         failing alike on both sides) match tmpfs ({:.1} s)",
                        started.elapsed().as_secs_f64()
                    );
                    if std::env::var_os("GRANULE_FS_PRINT_OPS").is_some() {
                        eprintln!("{}", log.join("\n"));
                    }
                    fs::remove_dir_all(&a).expect("rm -r the seed's tree in the mount");
                }
                Err((step, log, what)) => {
                    failed = true;
                    eprintln!(
                        "seed {seed} (--stripe {stripe_arg}) failed at step {step}: {what}\n\
                         operations:\n{}",
                        log.join("\n")
                    );
                    failures.push(format!(
                        "seed {seed} (--stripe {stripe_arg}), step {step}: {what}\n  \
                         rerun: GRANULE_FS_SEED={seed} GRANULE_FS_OPS={} cargo test -p \
                         granule-cli --test fs_posix random_operations_match_tmpfs -- --nocapture",
                        step + 1
                    ));
                }
            }
        }
        if !failed {
            m.unmount_cleanly();
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn concurrent_writers_of_one_stripe_lose_no_update() {
    if !fuse_usable("concurrent_writers_of_one_stripe_lose_no_update") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let p = m.path("shared");
    let len = 3 * MIB;
    let mut want = seeded_bytes(31, len);
    fs::write(&p, &want).expect("write");
    // Four threads, each with its own descriptor, write single bytes at seeded random
    // places (distinct, so the result is defined): the kernel sends them as page writes
    // from several threads at once, many into the same stripe.
    let mut rng = StdRng::seed_from_u64(32);
    let mut places: Vec<usize> = Vec::new();
    while places.len() < 800 {
        let x = rng.random_range(0..len);
        if !places.contains(&x) {
            places.push(x);
        }
    }
    for &x in &places {
        want[x] ^= 0x5a;
    }
    std::thread::scope(|s| {
        for t in 0..4 {
            let (p, want, places) = (&p, &want, &places);
            s.spawn(move || {
                let f = OpenOptions::new().write(true).open(p).expect("open");
                for &x in places.iter().skip(t).step_by(4) {
                    f.write_all_at(&want[x..x + 1], x as u64).expect("pwrite");
                }
            });
        }
    });
    File::open(&p).and_then(|f| f.sync_all()).expect("fsync");
    drop_cache(&p).expect("drop the page cache");
    let got = fs::read(&p).expect("read");
    let lost: Vec<usize> = places
        .iter()
        .copied()
        .filter(|&x| got[x] != want[x])
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} single-byte writes from 4 threads were lost, e.g. at {:?}",
        lost.len(),
        places.len(),
        &lost[..lost.len().min(8)]
    );
    if let Some(d) = first_difference(&got, &want) {
        panic!("other bytes changed: {d}");
    }
    m.unmount_cleanly();
}

/// A page of `file`'s stripe `idx` at generation `gen`: every 4-byte word names all three.
fn stamp(file: u32, idx: u32, gen: u32) -> [u8; 4] {
    ((file << 28) | (idx << 16) | gen).to_le_bytes()
}

#[test]
fn in_place_reads_see_only_whole_versions_while_files_are_rewritten() {
    if !fuse_usable("in_place_reads_see_only_whole_versions_while_files_are_rewritten") {
        return;
    }
    let _one = serial();
    // Own stores here are processes of this machine: the mount reads their stripes in
    // place, from shared memory. Two files are rewritten over and over (each rewrite
    // stores new stripe versions and deletes the old ones, whose slots are then reused)
    // while two readers read them with direct I/O. A reader must never see a
    // freed slot (zeros) or a slot reused by another stripe.
    let stripe = 64 * KIB;
    let stripes = 16u32;
    // Each in-place read holds its stripe a little before answering (a named failpoint),
    // so rewrites try to delete stripes while they are being read.
    let m = Mount::start_env(
        &["--stripe", "64KiB"],
        &[
            ("GRANULE_FAULTS", "on"),
            ("GRANULE_FAILPOINTS", "fs.read.in_place=delay(3ms)"),
        ],
        Duration::from_secs(300),
    );
    let paths = [m.path("a"), m.path("b")];
    // Rewritten in place (no truncation, which would let a reader meet a short file).
    let write_gen = |file: u32, gen: u32| {
        let mut buf = Vec::with_capacity(stripe * stripes as usize);
        for idx in 0..stripes {
            for _ in 0..stripe / 4 {
                buf.extend_from_slice(&stamp(file, idx, gen));
            }
        }
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&paths[file as usize])
            .expect("open for writing");
        f.write_all_at(&buf, 0).expect("write");
        f.sync_all().expect("fsync");
    };
    write_gen(0, 1);
    write_gen(1, 1);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let pages_checked = std::sync::atomic::AtomicU64::new(0);
    let bad: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for r in 0..2u32 {
            let (paths, stop, bad, pages_checked) = (&paths, &stop, &bad, &pages_checked);
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for (file, p) in paths.iter().enumerate() {
                        // Direct I/O: every read reaches the mount, and holds no page lock
                        // that would make the writer wait for it.
                        let f = OpenOptions::new()
                            .read(true)
                            .custom_flags(libc::O_DIRECT)
                            .open(p)
                            .expect("open for reading");
                        let got = read_range(&f, 0, stripe * stripes as usize).expect("read");
                        // A page may mix two generations (the page cache does not make a
                        // read atomic against a write), but every word must be a stamp of
                        // this file's stripe: zeros would be a freed slot, another stamp a
                        // slot reused by another stripe.
                        for (page, bytes) in got.chunks(4096).enumerate() {
                            let idx = (page * 4096 / stripe) as u32;
                            let wrong = bytes.chunks(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).find(|&w| {
                                let gen = w & 0xffff;
                                gen == 0 || w != u32::from_le_bytes(stamp(file as u32, idx, gen))
                            });
                            if let Some(w) = wrong {
                                bad.lock().unwrap().push(format!(
                                    "reader {r}: file {file} page {page} (stripe {idx}) holds {w:#010x}"
                                ));
                            }
                            pages_checked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        for gen in 2..=40 {
            write_gen(0, gen);
            write_gen(1, gen);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let bad = bad.into_inner().unwrap();
    assert!(
        bad.is_empty(),
        "{} bad pages, e.g.:\n{}",
        bad.len(),
        bad[..bad.len().min(8)].join("\n")
    );
    let checked = pages_checked.load(std::sync::atomic::Ordering::Relaxed);
    assert!(checked > 0, "the readers read nothing");
    let status = fs_status_json(&m.dir);
    let stores = status["stores"].as_array().expect("status.stores");
    let own: Vec<&serde_json::Value> = stores.iter().filter(|s| s["class"] == "own").collect();
    assert!(!own.is_empty(), "no own store: {status:#}");
    for st in &own {
        assert_eq!(
            st["in_place"], true,
            "an own store on this machine is not read in place: {st}"
        );
    }
    let in_place: u64 = own
        .iter()
        .map(|s| s["in_place_reads"].as_u64().unwrap_or(0))
        .sum();
    assert!(in_place > 0, "no stripe was read in place: {status:#}");
    eprintln!("{checked} pages checked; {in_place} stripe reads answered in place");
    m.unmount_cleanly();
}

// ---------------------------------------------------------------------------------------
// 3. The calls beyond read and write.

#[test]
fn shared_writable_mmap_reads_back_through_read() {
    if !fuse_usable("shared_writable_mmap_reads_back_through_read") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let p = m.path("mapped");
    let len = 3 * MIB + 12345;
    let mut want = seeded_bytes(11, len);
    fs::write(&p, &want).expect("write the file");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open");
    // SAFETY: nothing else changes the file while it is mapped (this test owns it).
    let mut map = unsafe { memmap2::MmapMut::map_mut(&f) }.expect("mmap MAP_SHARED, writable");
    if let Some(d) = first_difference(&map[..], &want) {
        panic!("the mapping shows other bytes than write(2) wrote: {d}");
    }
    // Through the mapping: across both stripe boundaries, the first and last byte, and
    // scattered single bytes.
    for (at, seed) in [(MIB - 4096, 12), (2 * MIB - 100, 13)] {
        let patch = seeded_bytes(seed, 8192);
        map[at..at + patch.len()].copy_from_slice(&patch);
        want[at..at + patch.len()].copy_from_slice(&patch);
    }
    let mut rng = StdRng::seed_from_u64(14);
    for pos in [0, len - 1]
        .into_iter()
        .chain((0..1000).map(|_| rng.random_range(0..len)))
    {
        map[pos] ^= 0x5a;
        want[pos] ^= 0x5a;
    }
    map.flush().expect("msync");
    let got = fs::read(&p).expect("read(2) after msync");
    if let Some(d) = first_difference(&got, &want) {
        panic!("read(2) after msync differs from what was written through the mapping: {d}");
    }
    drop(map);
    f.sync_all().expect("fsync");
    drop(f);
    drop_cache(&p).expect("drop the page cache");
    let got = fs::read(&p).expect("read(2) from the file system");
    if let Some(d) = first_difference(&got, &want) {
        panic!("after msync, munmap and fsync the file system holds other bytes: {d}");
    }
    // write(2) is seen through a new mapping.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open");
    let patch = seeded_bytes(15, 100);
    f.write_all_at(&patch, (2 * MIB - 50) as u64)
        .expect("pwrite");
    want[2 * MIB - 50..2 * MIB + 50].copy_from_slice(&patch);
    // SAFETY: as above.
    let map = unsafe { memmap2::Mmap::map(&f) }.expect("mmap read-only");
    if let Some(d) = first_difference(&map[..], &want) {
        panic!("a new mapping does not show write(2)'s bytes: {d}");
    }
    drop(map);
    drop(f);
    m.unmount_cleanly();
}

fn flock(f: &File, how: libc::c_int) -> io::Result<()> {
    // SAFETY: the descriptor is open for the duration of the call.
    if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// fcntl(cmd) with a lock of `ty` over [start, start + len).
fn ofd_lock(
    f: &File,
    cmd: libc::c_int,
    ty: libc::c_int,
    start: i64,
    len: i64,
) -> io::Result<libc::flock> {
    // SAFETY: an all-zero flock is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = ty as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = start;
    l.l_len = len;
    // SAFETY: `l` lives across the call; the descriptor is open.
    if unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut l) } == 0 {
        Ok(l)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `flock -n [-s] FILE true` in another process: true if it got the lock.
fn other_process_gets_flock(p: &Path, shared: bool) -> bool {
    let mut cmd = Command::new("flock");
    cmd.arg("-n");
    if shared {
        cmd.arg("-s");
    }
    let out = run_bounded(cmd.arg(p).arg("true"), Duration::from_secs(10));
    match out.status.code() {
        Some(0) => true,
        Some(1) => false,
        c => panic!(
            "flock -n exited with {c:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

#[test]
fn advisory_locks_flock_and_fcntl() {
    if !fuse_usable("advisory_locks_flock_and_fcntl") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let p = m.path("locked");
    fs::write(&p, vec![7u8; 1000]).expect("write");
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .expect("open")
    };
    let (f1, f2) = (open(), open());
    let would_block = |r: io::Result<()>| {
        let e = r.expect_err("the lock is held elsewhere");
        assert_eq!(e.raw_os_error(), Some(libc::EWOULDBLOCK), "{e}");
    };

    // flock(2): exclusive and shared, in this process and another.
    flock(&f1, libc::LOCK_EX | libc::LOCK_NB).expect("flock LOCK_EX");
    would_block(flock(&f2, libc::LOCK_EX | libc::LOCK_NB));
    would_block(flock(&f2, libc::LOCK_SH | libc::LOCK_NB));
    assert!(
        !other_process_gets_flock(&p, false),
        "another process got a held flock"
    );
    flock(&f1, libc::LOCK_UN).expect("unlock");
    flock(&f2, libc::LOCK_EX | libc::LOCK_NB).expect("flock after unlock");
    assert!(!other_process_gets_flock(&p, true));
    flock(&f2, libc::LOCK_UN).expect("unlock");
    assert!(
        other_process_gets_flock(&p, false),
        "no one holds the lock now"
    );
    flock(&f1, libc::LOCK_SH | libc::LOCK_NB).expect("shared");
    flock(&f2, libc::LOCK_SH | libc::LOCK_NB).expect("shared twice");
    assert!(other_process_gets_flock(&p, true));
    assert!(!other_process_gets_flock(&p, false));
    flock(&f1, libc::LOCK_UN).expect("unlock");
    flock(&f2, libc::LOCK_UN).expect("unlock");

    // A blocked flock wakes when the holder lets go.
    flock(&f1, libc::LOCK_EX).expect("flock");
    let f2c = f2.try_clone().expect("dup");
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = flock(&f2c, libc::LOCK_EX);
        let _ = tx.send(r.is_ok());
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "a conflicting flock did not wait");
    flock(&f1, libc::LOCK_UN).expect("unlock");
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)),
        Ok(true),
        "the waiting flock did not get the lock within 10 s of the unlock"
    );
    waiter.join().expect("waiter");
    flock(&f2, libc::LOCK_UN).expect("unlock");

    // fcntl byte-range locks (open file description locks, so this one process has two
    // owners): conflicts, F_OFD_GETLK, disjoint ranges, unlock.
    let (wr, un) = (libc::F_WRLCK, libc::F_UNLCK);
    ofd_lock(&f1, libc::F_OFD_SETLK, wr, 0, 100).expect("F_OFD_SETLK [0,100)");
    let e = ofd_lock(&f2, libc::F_OFD_SETLK, wr, 50, 10).expect_err("overlapping lock");
    assert!(
        matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)),
        "a conflicting F_OFD_SETLK failed with {e}"
    );
    let l = ofd_lock(&f2, libc::F_OFD_GETLK, wr, 50, 10).expect("F_OFD_GETLK");
    assert_eq!(
        (l.l_type as libc::c_int, l.l_start, l.l_len),
        (wr, 0, 100),
        "F_OFD_GETLK does not report the conflicting lock"
    );
    ofd_lock(&f2, libc::F_OFD_SETLK, wr, 200, 10).expect("a disjoint range");
    ofd_lock(&f1, libc::F_OFD_SETLK, un, 0, 0).expect("unlock all");
    ofd_lock(&f2, libc::F_OFD_SETLK, wr, 50, 10).expect("lock after the unlock");
    let l = ofd_lock(&f1, libc::F_OFD_GETLK, wr, 0, 0).expect("F_OFD_GETLK");
    assert_eq!(l.l_type as libc::c_int, wr, "f2's locks are not reported");
    ofd_lock(&f2, libc::F_OFD_SETLK, un, 0, 0).expect("unlock all");
    let l = ofd_lock(&f1, libc::F_OFD_GETLK, wr, 0, 0).expect("F_OFD_GETLK");
    assert_eq!(
        l.l_type as libc::c_int, un,
        "a lock is left after unlocking"
    );
    drop((f1, f2));
    m.unmount_cleanly();
}

fn fallocate(f: &File, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: the descriptor is open for the duration of the call.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn utimensat(p: &Path, times: [libc::timespec; 2], flags: libc::c_int) -> io::Result<()> {
    let c = c_path(p);
    // SAFETY: `c` and `times` outlive the call.
    if unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), flags) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn ts(sec: i64, nsec: i64) -> libc::timespec {
    libc::timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    }
}

#[test]
fn fallocate_and_utimens_match_tmpfs() {
    if !fuse_usable("fallocate_and_utimens_match_tmpfs") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let reference = Tmpfs::new();
    let roots = [m.path(""), reference.path().to_path_buf()];
    let unsupported = |e: &io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);

    // fallocate: mode 0 extends with zeros (required); KEEP_SIZE and PUNCH_HOLE either do
    // what tmpfs does or say EOPNOTSUPP (tmpfs has no ZERO_RANGE to compare with).
    let mut optional = Vec::new();
    for (i, root) in roots.iter().enumerate() {
        let p = root.join("fallocated");
        fs::write(&p, seeded_bytes(21, 100 * KIB)).expect("write");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .expect("open");
        fallocate(&f, 0, (MIB - 10) as u64, 2 * MIB as u64).expect("fallocate mode 0");
        assert_eq!(f.metadata().expect("stat").len(), (3 * MIB - 10) as u64);
        let modes = [
            (
                "FALLOC_FL_KEEP_SIZE",
                libc::FALLOC_FL_KEEP_SIZE,
                3 * MIB as u64,
                MIB as u64,
            ),
            (
                "FALLOC_FL_PUNCH_HOLE",
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                50 * KIB as u64,
                10 * KIB as u64,
            ),
        ];
        for (name, mode, off, len) in modes {
            match fallocate(&f, mode, off, len) {
                Ok(()) => {}
                Err(e) if i == 0 && unsupported(&e) => optional.push(name),
                Err(e) => panic!("fallocate {name} on {}: {e}", root.display()),
            }
        }
        // posix_fallocate works everywhere (glibc writes zeros where fallocate cannot).
        // SAFETY: the descriptor is open for the duration of the call.
        let r = unsafe {
            libc::posix_fallocate(f.as_raw_fd(), (4 * MIB) as libc::off_t, MIB as libc::off_t)
        };
        assert_eq!(r, 0, "posix_fallocate on {}: errno {r}", root.display());
        f.sync_all().expect("fsync");
    }
    eprintln!("fallocate modes the mount does not support: {optional:?}");
    let (got, want) = (roots[0].join("fallocated"), roots[1].join("fallocated"));
    drop_cache(&got).expect("drop cache");
    let (g, w) = (
        fs::read(&got).expect("read"),
        fs::read(&want).expect("read"),
    );
    if optional.is_empty() {
        if let Some(d) = first_difference(&g, &w) {
            panic!("after fallocate the mount's file differs from tmpfs's: {d}");
        }
    } else {
        assert_eq!(g.len(), w.len(), "size after fallocate");
        assert_eq!(
            g[..20 * KIB],
            w[..20 * KIB],
            "fallocate changed the data before its range"
        );
        assert!(
            g[MIB..].iter().all(|b| *b == 0),
            "fallocated space is not zeros"
        );
    }

    // utimensat: exact times (to the nanosecond), UTIME_OMIT, UTIME_NOW, a symlink's own
    // times; a write moves mtime, chmod moves ctime.
    for root in &roots {
        let p = root.join("timed");
        fs::write(&p, b"time").expect("write");
        std::os::unix::fs::symlink("timed", root.join("timed-link")).expect("symlink");
    }
    let stamp = |p: &Path| {
        let md = fs::symlink_metadata(p).expect("stat");
        (md.atime(), md.atime_nsec(), md.mtime(), md.mtime_nsec())
    };
    for root in &roots {
        let p = root.join("timed");
        utimensat(
            &p,
            [
                ts(1_000_000_000, 123_456_789),
                ts(1_500_000_000, 987_654_321),
            ],
            0,
        )
        .expect("utimensat");
        assert_eq!(
            stamp(&p),
            (1_000_000_000, 123_456_789, 1_500_000_000, 987_654_321),
            "utimensat on {}",
            p.display()
        );
        let omit = ts(0, libc::UTIME_OMIT);
        utimensat(&p, [omit, ts(1_600_000_000, 5)], 0).expect("utimensat UTIME_OMIT");
        assert_eq!(stamp(&p), (1_000_000_000, 123_456_789, 1_600_000_000, 5));
        let link = root.join("timed-link");
        utimensat(
            &link,
            [ts(1_100_000_000, 0), ts(1_200_000_000, 0)],
            libc::AT_SYMLINK_NOFOLLOW,
        )
        .expect("utimensat on a symlink");
        assert_eq!(
            stamp(&link),
            (1_100_000_000, 0, 1_200_000_000, 0),
            "symlink times"
        );
        assert_eq!(stamp(&p).2, 1_600_000_000, "the symlink's target changed");

        // futimens on an open descriptor.
        let f = OpenOptions::new().write(true).open(&p).expect("open");
        let t = [ts(1_300_000_000, 1), ts(1_400_000_000, 2)];
        // SAFETY: `t` outlives the call; the descriptor is open.
        assert_eq!(
            unsafe { libc::futimens(f.as_raw_fd(), t.as_ptr()) },
            0,
            "futimens"
        );
        assert_eq!(stamp(&p), (1_300_000_000, 1, 1_400_000_000, 2));

        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs() as i64;
        f.write_all_at(b"later", 10).expect("write");
        drop(f);
        let mtime = fs::metadata(&p).expect("stat").mtime();
        assert!(
            (now - 5..=now + 5).contains(&mtime),
            "a write did not move mtime to now on {} ({mtime}, now {now})",
            p.display()
        );
        let now_ts = ts(0, libc::UTIME_NOW);
        utimensat(&p, [now_ts, ts(1_000, 0)], 0).expect("UTIME_NOW");
        let (atime, _, mtime, _) = stamp(&p);
        assert!(
            (now - 5..=now + 5).contains(&atime) && mtime == 1_000,
            "UTIME_NOW"
        );
        let ctime = fs::metadata(&p).expect("stat").ctime();
        utimensat(&p, [ts(1, 0), ts(1, 0)], 0).expect("old times");
        fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(
            fs::metadata(&p).expect("stat").ctime() >= ctime,
            "chmod moved ctime back"
        );
    }
    m.unmount_cleanly();
}

#[test]
fn statfs_follows_the_space_and_enospc_is_reported() {
    if !fuse_usable("statfs_follows_the_space_and_enospc_is_reported") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(600));
    let space = |what: &str| {
        let s = statvfs(&m.dir).unwrap_or_else(|e| panic!("statvfs ({what}): {e}"));
        let unit = s.f_frsize.max(1);
        assert!(
            s.f_blocks > 0 && s.f_bsize > 0,
            "statvfs shows no space: f_blocks {}",
            s.f_blocks
        );
        assert!(
            s.f_bfree <= s.f_blocks && s.f_bavail <= s.f_bfree,
            "statvfs is inconsistent"
        );
        (
            s.f_blocks * unit,
            (s.f_blocks - s.f_bfree) * unit,
            s.f_bavail * unit,
        )
    };
    let (total, used0, avail0) = space("empty");
    eprintln!("empty mount: total {total} B, used {used0} B, available {avail0} B");
    let df = run_bounded(
        Command::new("df").arg("-B1").arg(&m.dir),
        Duration::from_secs(10),
    );
    assert!(
        df.status.success(),
        "df failed: {}",
        String::from_utf8_lossy(&df.stderr)
    );
    assert!(
        String::from_utf8_lossy(&df.stdout).contains(&*m.dir.to_string_lossy()),
        "df does not show the mount"
    );

    // 64 MiB in: the used space grows by about that much (more with replicas).
    let w = 64 * MIB as u64;
    let p = m.path("big");
    {
        let mut f = File::create(&p).expect("create");
        for i in 0..64 {
            f.write_all(&seeded_bytes(i, MIB)).expect("write");
        }
        f.sync_all().expect("fsync");
    }
    let (_, used1, avail1) = space("after 64 MiB");
    assert!(
        used1 >= used0 + w * 9 / 10 && used1 <= used0 + 2 * w + 16 * MIB as u64,
        "64 MiB written, the used space went from {used0} to {used1} B"
    );
    assert!(
        avail1 + w * 9 / 10 <= avail0,
        "available space went from {avail0} to {avail1} B"
    );
    fs::remove_file(&p).expect("unlink");
    let start = std::time::Instant::now();
    loop {
        let (_, used, _) = space("after unlink");
        if used <= used0 + w / 10 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "20 s after unlinking 64 MiB the used space is {used} B (empty: {used0} B)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // ENOSPC: fill the space statfs offers (when it is small enough to fill here).
    let (_, _, avail) = space("before filling");
    if avail > 4 * (1u64 << 30) {
        eprintln!("{avail} B available: too much to fill in a test; ENOSPC not checked");
        m.unmount_cleanly();
        return;
    }
    let p = m.path("filler");
    let mut f = File::create(&p).expect("create");
    let mut written = 0u64;
    let chunk = seeded_bytes(99, MIB);
    let err = loop {
        match f.write_all(&chunk) {
            Ok(()) => written += MIB as u64,
            Err(e) => break Some(e),
        }
        if written > avail + 256 * MIB as u64 {
            break None;
        }
    };
    let err = err.or_else(|| f.sync_all().err());
    let e = err.unwrap_or_else(|| {
        panic!("{written} B written into {avail} B of available space without an error")
    });
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ENOSPC),
        "a full mount said {e}"
    );
    assert!(written >= avail / 2, "ENOSPC after {written} of {avail} B");
    drop(f);
    fs::remove_file(&p).expect("unlink the filler");
    fs::write(m.path("after"), seeded_bytes(1, 16 * MIB)).expect("write after ENOSPC");
    assert_eq!(
        fs::read(m.path("after")).expect("read"),
        seeded_bytes(1, 16 * MIB)
    );
    m.unmount_cleanly();
}

/// The refusals docs/guide/fs.md lists under "Unsupported calls fail at once": each
/// item's text before its last colon, and the errno named first after it.
fn guide_refusals() -> Vec<(String, i32)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/guide/fs.md");
    let text = fs::read_to_string(&path).expect("read docs/guide/fs.md");
    let (_, after) = text
        .split_once("Unsupported calls fail at once")
        .expect("docs/guide/fs.md has the list of unsupported calls");
    let items: Vec<(String, i32)> = after
        .lines()
        .skip(1)
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| l.starts_with("- "))
        .map(|l| {
            let (what, name) = l[2..]
                .rsplit_once(':')
                .unwrap_or_else(|| panic!("a refusal without `: ERRNO` in the guide: {l}"));
            // The errno is the first word after the colon (a remark may follow).
            let mut words = name
                .trim_start()
                .split(|c: char| !c.is_ascii_alphanumeric());
            let e = match words.next().unwrap_or_default() {
                "EOPNOTSUPP" => libc::EOPNOTSUPP,
                "EPERM" => libc::EPERM,
                "EINVAL" => libc::EINVAL,
                "ENOTTY" => libc::ENOTTY,
                other => panic!("the guide names an errno this test does not know: {other}"),
            };
            (what.trim().to_string(), e)
        })
        .collect();
    assert!(!items.is_empty(), "the guide lists no refusals");
    items
}

#[test]
fn unsupported_calls_fail_promptly() {
    if !fuse_usable("unsupported_calls_fail_promptly") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let dir = m.dir.clone();
    fs::write(dir.join("f"), b"data").expect("write");
    fs::write(dir.join("g"), b"other").expect("write");
    /// Errors a call the mount does not support may answer with; never EIO or ENOTCONN.
    const FINE: &[i32] = &[
        libc::EOPNOTSUPP,
        libc::ENOSYS,
        libc::EPERM,
        libc::EINVAL,
        libc::ENODATA,
        libc::ENOTTY,
        libc::EXDEV,
        libc::EACCES,
        libc::EEXIST,
    ];
    let call = |what: &'static str, f: Box<dyn FnOnce() -> libc::c_long + Send>| {
        let (r, e) = bounded(what, Duration::from_secs(10), move || {
            let r = f();
            (r, io::Error::last_os_error().raw_os_error().unwrap_or(0))
        });
        if r < 0 {
            assert!(
                FINE.contains(&e),
                "{what} failed with {}",
                io::Error::from_raw_os_error(e)
            );
            eprintln!("{what}: {}", io::Error::from_raw_os_error(e));
            Err(e)
        } else {
            eprintln!("{what}: ok");
            Ok(r)
        }
    };
    // A call the guide lists as refused fails with exactly the errno it names; every item
    // of the list is tried here.
    let refusals = guide_refusals();
    let mut tried = BTreeSet::new();
    let mut refused = |item: &str, what: &str, r: Result<libc::c_long, i32>| {
        let &(_, want) = refusals.iter().find(|(w, _)| w == item).unwrap_or_else(|| {
            panic!("docs/guide/fs.md does not list {item} among the refusals: {refusals:?}")
        });
        assert_eq!(
            r,
            Err(want),
            "{what}: the guide says {item} fails with {}",
            io::Error::from_raw_os_error(want)
        );
        tried.insert(item.to_string());
    };
    let cp = |name: &str| c_path(&dir.join(name));
    let (f, g, dev, fifo) = (cp("f"), cp("g"), cp("dev"), cp("fifo"));
    let (f2, f3) = (f.clone(), f.clone());
    // SAFETY (all the closures): every pointer is to a C string or buffer moved into the
    // closure, alive for the call.
    let r = call(
        "setxattr",
        Box::new(move || unsafe {
            libc::setxattr(
                f.as_ptr(),
                c"user.granule".as_ptr(),
                b"v".as_ptr().cast(),
                1,
                0,
            ) as _
        }),
    );
    refused("extended attributes", "setxattr", r);
    let r = call(
        "getxattr",
        Box::new(move || unsafe {
            let mut buf = [0u8; 64];
            libc::getxattr(
                f2.as_ptr(),
                c"user.none".as_ptr(),
                buf.as_mut_ptr().cast(),
                64,
            ) as _
        }),
    );
    refused("extended attributes", "getxattr", r);
    let r = call(
        "listxattr",
        Box::new(move || unsafe {
            let mut buf = [0u8; 256];
            libc::listxattr(f3.as_ptr(), buf.as_mut_ptr().cast(), 256) as _
        }),
    );
    refused("extended attributes", "listxattr", r);
    let r = call(
        "mknod of a character device",
        Box::new(move || unsafe {
            libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) as _
        }),
    );
    refused("device nodes and FIFOs", "mknod", r);
    let r = call(
        "mkfifo",
        Box::new(move || unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) as _ }),
    );
    refused("device nodes and FIFOs", "mkfifo", r);
    let d = c_path(&dir);
    let r = call(
        "open O_TMPFILE",
        Box::new(move || unsafe {
            let fd = libc::open(d.as_ptr(), libc::O_TMPFILE | libc::O_RDWR, 0o600);
            if fd >= 0 {
                libc::close(fd);
            }
            fd as _
        }),
    );
    refused("`O_TMPFILE`", "open O_TMPFILE", r);
    let (f4, g2) = (cp("f"), g.clone());
    let r = call(
        "renameat2 RENAME_EXCHANGE",
        Box::new(move || unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                f4.as_ptr(),
                libc::AT_FDCWD,
                g2.as_ptr(),
                libc::RENAME_EXCHANGE,
            ) as _
        }),
    );
    refused("`RENAME_EXCHANGE`", "renameat2 RENAME_EXCHANGE", r);
    let fa = "f";
    assert_eq!(fs::read(dir.join("f")).expect("read"), b"data");
    assert_eq!(fs::read(dir.join("g")).expect("read"), b"other");
    let (f5, g3) = (cp("f"), g);
    let noreplace = call(
        "renameat2 RENAME_NOREPLACE",
        Box::new(move || unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                f5.as_ptr(),
                libc::AT_FDCWD,
                g3.as_ptr(),
                libc::RENAME_NOREPLACE,
            ) as _
        }),
    );
    assert!(
        noreplace.is_err(),
        "RENAME_NOREPLACE replaced an existing file"
    );
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("f"))
        .expect("open");
    let fd = file.as_raw_fd();
    let r = call(
        "ioctl FS_IOC_GETFLAGS",
        Box::new(move || unsafe {
            let mut flags: libc::c_long = 0;
            libc::ioctl(fd, 0x8008_6601u64 as _, &mut flags) as _
        }),
    );
    refused("ioctls", "ioctl FS_IOC_GETFLAGS", r);
    let r = call(
        "fallocate FALLOC_FL_PUNCH_HOLE",
        Box::new(move || unsafe {
            let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            libc::fallocate(fd, mode, 0, 2) as _
        }),
    );
    refused("punching holes", "fallocate FALLOC_FL_PUNCH_HOLE", r);
    call(
        "lseek SEEK_DATA",
        Box::new(move || unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) as _ }),
    )
    .expect("lseek SEEK_DATA");
    drop(file);
    let listed: BTreeSet<String> = refusals.iter().map(|(w, _)| w.clone()).collect();
    assert_eq!(
        tried, listed,
        "the refusals docs/guide/fs.md lists and those this test tries differ"
    );
    // copy_file_range works (the kernel copies itself where the mount does not).
    let src = File::open(dir.join(fa)).expect("open");
    let dst = File::create(dir.join("copy")).expect("create");
    let (s, t) = (src.as_raw_fd(), dst.as_raw_fd());
    let n = call(
        "copy_file_range",
        Box::new(move || unsafe {
            libc::copy_file_range(s, std::ptr::null_mut(), t, std::ptr::null_mut(), 4, 0) as _
        }),
    );
    drop((src, dst));
    if n == Ok(4) {
        assert_eq!(fs::read(dir.join("copy")).expect("read"), b"data");
    }
    // The mount still serves.
    fs::write(dir.join("still"), seeded_bytes(3, 3 * MIB)).expect("write after the calls");
    assert_eq!(
        fs::read(dir.join("still")).expect("read"),
        seeded_bytes(3, 3 * MIB)
    );
    m.unmount_cleanly();
}

/// syncfs(2) on a descriptor `f` holds: Ok, or the errno it failed with.
fn syncfs(f: &File) -> io::Result<()> {
    // SAFETY: the descriptor is open for the duration of the call.
    if unsafe { libc::syncfs(f.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[test]
fn syncfs_succeeds_after_unlink_and_rename_over() {
    if !fuse_usable("syncfs_succeeds_after_unlink_and_rename_over") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let keep = m.path("keep");
    fs::write(&keep, b"kept").expect("write");
    let f = File::open(&keep).expect("open");
    syncfs(&f).expect("syncfs of a fresh mount");
    let used = || {
        let s = statvfs(&m.dir).expect("statvfs");
        (s.f_blocks - s.f_bfree) * s.f_frsize
    };
    let used0 = used();
    // The kernel writes back the times it cached for a file after its last unlink (and
    // for a file renamed over): those must not fail, or syncfs reports them.
    let gone = m.path("gone");
    fs::write(&gone, seeded_bytes(1, 8 * MIB)).expect("write");
    fs::remove_file(&gone).expect("unlink");
    syncfs(&f).expect("syncfs after an unlink");
    fs::write(m.path("old"), b"old").expect("write");
    fs::write(m.path("new"), b"new").expect("write");
    fs::rename(m.path("new"), m.path("old")).expect("rename over a file");
    syncfs(&f).expect("syncfs after a rename over a file");
    let open = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("open"))
        .expect("create");
    open.write_all_at(b"written while open", 0).expect("write");
    fs::remove_file(m.path("open")).expect("unlink while open");
    let mut back = [0u8; 18];
    open.read_exact_at(&mut back, 0)
        .expect("read the unlinked file through its handle");
    assert_eq!(&back, b"written while open");
    drop(open);
    syncfs(&f).expect("syncfs after closing an unlinked file");
    let out = run_bounded(
        Command::new("sync").arg("-f").arg(&keep),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "sync -f failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(fs::read(m.path("old")).expect("read"), b"new");
    // The unlinked files' data is still freed (when the kernel forgets them).
    let start = std::time::Instant::now();
    while used() > used0 + MIB as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "20 s after the unlinks {} B are used (before: {used0} B)",
            used()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(f);
    m.unmount_cleanly();
}

fn lseek(f: &File, offset: u64, whence: libc::c_int) -> io::Result<u64> {
    // SAFETY: the descriptor is open for the duration of the call.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, whence) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as u64)
    }
}

/// A fresh read-only descriptor of `p` once lseek(0, `whence`) on it answers `want` (an
/// offset or an errno), within 10 s: a writer's handle is released a moment after its
/// close returns, and while one is open the whole file counts as data.
fn lseek_settles(p: &Path, whence: libc::c_int, want: Result<u64, i32>) -> File {
    let start = std::time::Instant::now();
    loop {
        let f = File::open(p).expect("open");
        let got = lseek(&f, 0, whence).map_err(|e| e.raw_os_error().unwrap_or(0));
        if got == want {
            return f;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "lseek(0, {whence}) in {}: {got:?}, expected {want:?}",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sparse_files_report_their_blocks_and_holes() {
    if !fuse_usable("sparse_files_report_their_blocks_and_holes") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    let stripe = fs_status_json(&m.dir)["stripe"]
        .as_u64()
        .expect("the status names the stripe size");
    let gib = 1u64 << 30;
    let at = gib / 2;
    let p = m.path("sparse");
    File::create(&p)
        .expect("create")
        .set_len(gib)
        .expect("truncate -s 1G");
    let md = fs::metadata(&p).expect("stat");
    assert_eq!(
        (md.len(), md.blocks()),
        (gib, 0),
        "a 1 GiB hole: size, st_blocks"
    );
    let f = lseek_settles(&p, libc::SEEK_DATA, Err(libc::ENXIO));
    assert_eq!(lseek(&f, 0, libc::SEEK_HOLE).expect("SEEK_HOLE"), 0);
    drop(f);
    let data = seeded_bytes(7, 4 * KIB);
    OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open")
        .write_all_at(&data, at)
        .expect("write 4 KiB at 512 MiB");
    let md = fs::metadata(&p).expect("stat");
    assert_eq!(md.len(), gib);
    assert!(
        md.blocks() * 512 >= 4 * KIB as u64 && md.blocks() * 512 <= stripe,
        "4 KiB written in a 1 GiB hole: st_blocks {} (stripe {stripe} B)",
        md.blocks()
    );
    let f = lseek_settles(&p, libc::SEEK_DATA, Ok(at));
    assert_eq!(
        lseek(&f, at + 100, libc::SEEK_DATA).expect("SEEK_DATA"),
        at + 100
    );
    let hole = lseek(&f, at, libc::SEEK_HOLE).expect("SEEK_HOLE");
    assert!(
        hole >= at + 4 * KIB as u64 && hole <= at + stripe,
        "SEEK_HOLE after the data at {at}: {hole}"
    );
    assert_eq!(lseek(&f, 0, libc::SEEK_HOLE).expect("SEEK_HOLE"), 0);
    let e = lseek(&f, at + stripe, libc::SEEK_DATA).expect_err("no data after the stripe");
    assert_eq!(e.raw_os_error(), Some(libc::ENXIO), "{e}");
    let e = lseek(&f, gib, libc::SEEK_HOLE).expect_err("SEEK_HOLE at the end");
    assert_eq!(e.raw_os_error(), Some(libc::ENXIO), "{e}");
    drop(f);

    // du counts what is stored; cp --sparse=always keeps the holes, inside the mount and
    // out of it, with the same bytes.
    let du = run_bounded(
        Command::new("du").arg("-B1").arg(&p),
        Duration::from_secs(30),
    );
    let du_bytes: u64 = String::from_utf8_lossy(&du.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("du printed {:?}", String::from_utf8_lossy(&du.stdout)));
    assert!(
        du_bytes <= stripe,
        "du of a 1 GiB file with 4 KiB in it: {du_bytes} B"
    );
    let reference = Tmpfs::new();
    for copy in [m.path("copy"), reference.path().join("copy")] {
        let out = run_bounded(
            Command::new("cp").arg("--sparse=always").arg(&p).arg(&copy),
            Duration::from_secs(120),
        );
        assert!(
            out.status.success(),
            "cp --sparse=always to {}: {}",
            copy.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let md = fs::metadata(&copy).expect("stat the copy");
        assert_eq!(md.len(), gib, "size of {}", copy.display());
        assert!(
            md.blocks() * 512 <= stripe,
            "{} holds {} blocks: its holes were filled",
            copy.display(),
            md.blocks()
        );
        let f = File::open(&copy).expect("open the copy");
        assert_eq!(read_range(&f, at, data.len()).expect("read"), data);
        assert_eq!(
            read_range(&f, at - 4096, 4096).expect("read"),
            vec![0u8; 4096]
        );
    }

    // A writer's pages may not have reached the mount yet: while one is open, no part of
    // the file is reported as a hole.
    let w = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open for writing");
    w.write_all_at(&data, gib / 4).expect("write at 256 MiB");
    assert_eq!(lseek(&w, 0, libc::SEEK_DATA).expect("SEEK_DATA"), 0);
    assert_eq!(lseek(&w, 0, libc::SEEK_HOLE).expect("SEEK_HOLE"), gib);
    drop(w);
    drop(lseek_settles(&p, libc::SEEK_DATA, Ok(gib / 4)));
    m.unmount_cleanly();
}

#[test]
fn isatty_and_other_ioctls_get_enotty_without_a_log_line() {
    if !fuse_usable("isatty_and_other_ioctls_get_enotty_without_a_log_line") {
        return;
    }
    let _one = serial();
    let m = Mount::start(&[], Duration::from_secs(300));
    fs::write(m.path("f"), b"data").expect("write");
    let f = File::open(m.path("f")).expect("open");
    let before = m.log_text();
    for _ in 0..200 {
        // SAFETY: the descriptor is open for the duration of the call.
        let tty = unsafe { libc::isatty(f.as_raw_fd()) };
        let e = io::Error::last_os_error();
        assert_eq!(
            (tty, e.raw_os_error()),
            (0, Some(libc::ENOTTY)),
            "isatty on a file in the mount: {e}"
        );
    }
    drop(f);
    fs::write(m.path("g"), b"still serves").expect("write after the ioctls");
    let after = m.log_text();
    let new = &after[before.len().min(after.len())..];
    assert!(
        new.trim().is_empty(),
        "200 isatty() calls made the mount log:\n{}",
        new.lines().take(12).collect::<Vec<_>>().join("\n")
    );
    m.unmount_cleanly();
}

#[test]
fn df_with_replicas_shows_what_files_can_use() {
    if !fuse_usable("df_with_replicas_shows_what_files_can_use") {
        return;
    }
    let _one = serial();
    // Two small stores of the same size (no store in the mount's own process): filling
    // takes seconds, and every stripe has room for both its copies until the end.
    let m = Mount::start_env(
        &[
            "--replicas",
            "2",
            "--nodes",
            "cpu=1,mem=256MiB;cpu=1,mem=256MiB",
        ],
        &[("GRANULE_FS_DRIVER_STORE", "off")],
        Duration::from_secs(600),
    );
    let status = fs_status_json(&m.dir);
    assert_eq!(status["replicas"].as_u64(), Some(2));
    let raw: u64 = status["stores"]
        .as_array()
        .expect("stores")
        .iter()
        .map(|s| s["capacity"].as_u64().expect("capacity"))
        .sum();
    let space = || {
        let s = statvfs(&m.dir).expect("statvfs");
        let unit = s.f_frsize.max(1);
        (
            s.f_blocks * unit,
            (s.f_blocks - s.f_bfree) * unit,
            s.f_bavail * unit,
        )
    };
    let (total, used0, avail0) = space();
    eprintln!("raw {raw} B; statvfs: total {total} B, used {used0} B, available {avail0} B");
    assert!(
        total <= raw / 2 && total + 8192 >= raw / 2,
        "with 2 copies of each stripe statvfs shows {total} B of {raw} B raw"
    );

    // 32 MiB in: about 32 MiB more used and less available, not 64.
    let w = 32 * MIB as u64;
    {
        let mut f = File::create(m.path("some")).expect("create");
        for i in 0..32 {
            f.write_all(&seeded_bytes(i, MIB)).expect("write");
        }
        f.sync_all().expect("fsync");
    }
    let (_, used1, avail1) = space();
    assert!(
        used1 >= used0 + w * 9 / 10 && used1 <= used0 + w * 11 / 10,
        "32 MiB written with 2 copies: used went from {used0} to {used1} B"
    );
    assert!(
        avail1 + w * 9 / 10 <= avail0 && avail1 + w * 11 / 10 >= avail0,
        "32 MiB written with 2 copies: available went from {avail0} to {avail1} B"
    );

    // Filling it: about what statfs offered fits before ENOSPC (which the write that
    // does not fit gets; a sync every 8 MiB).
    let mut f = File::create(m.path("filler")).expect("create");
    let chunk = seeded_bytes(99, MIB);
    let mut synced = 0u64;
    let e = loop {
        let r = (0..8)
            .try_for_each(|_| f.write_all(&chunk))
            .and_then(|()| f.sync_data());
        match r {
            Ok(()) => synced += 8 * MIB as u64,
            Err(e) => break e,
        }
        assert!(
            synced <= 2 * avail1 + 64 * MIB as u64,
            "{synced} B written and synced, {avail1} B offered: no ENOSPC"
        );
    };
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ENOSPC),
        "a full mount said {e}"
    );
    eprintln!("{synced} B written and synced before ENOSPC; {avail1} B were offered");
    assert!(
        synced >= avail1 * 8 / 10 && synced <= avail1 * 12 / 10 + 16 * MIB as u64,
        "statfs offered {avail1} B; {synced} B fit"
    );
    drop(f);
    m.unmount_cleanly();
}

/// A full mount fails the writer's own `write()` with ENOSPC (cut short first when part
/// of a write fits), not a later fsync after acknowledged bytes; what was acknowledged
/// syncs without error, and the file's size and contents are exactly those bytes, from
/// the kernel's cache and after it is dropped. Before the mount wrote through, the
/// kernel's write-back cache acknowledged writes far past full, fsync failed, and the
/// size and contents disagreed.
#[test]
fn enospc_reaches_the_writer_and_the_file_keeps_what_was_acknowledged() {
    if !fuse_usable("enospc_reaches_the_writer_and_the_file_keeps_what_was_acknowledged") {
        return;
    }
    let _one = serial();
    let m = Mount::start_env(
        &["--nodes", "cpu=1,mem=256MiB;cpu=1,mem=256MiB"],
        &[("GRANULE_FS_DRIVER_STORE", "off")],
        Duration::from_secs(600),
    );
    let s = statvfs(&m.dir).expect("statvfs");
    let avail = s.f_bavail * s.f_frsize.max(1);
    assert!(avail > 0 && avail < 1 << 30, "{avail} B available");
    // Writes of 3 MiB and a page and a byte: each crosses stripe boundaries at offsets
    // that are not stripe-aligned, so the last one can fit only in part.
    let chunk = 3 * MIB + 4097;
    let mut want: Vec<u8> = Vec::new();
    let mut f = File::create(m.path("filler")).expect("create");
    let mut short_writes = 0;
    // One pattern, each write stamped with its offset (generating bytes is slow in a
    // debug build of this test).
    let pattern = seeded_bytes(5, chunk);
    let err = loop {
        let mut buf = pattern.clone();
        buf[..8].copy_from_slice(&(want.len() as u64).to_le_bytes());
        match f.write(&buf) {
            Ok(0) => panic!("write() returned 0 at {} B", want.len()),
            Ok(n) => {
                if n < chunk {
                    short_writes += 1;
                }
                want.extend_from_slice(&buf[..n]);
            }
            Err(e) => break e,
        }
        assert!(
            want.len() as u64 <= avail + 4 * MIB as u64,
            "{} B acknowledged with {avail} B available and no error",
            want.len()
        );
    };
    let acked = want.len() as u64;
    eprintln!(
        "{acked} B acknowledged of {avail} B available ({short_writes} short writes), then: {err}"
    );
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENOSPC),
        "a full mount said {err}"
    );
    assert!(
        acked >= avail * 8 / 10,
        "ENOSPC after {acked} of {avail} B available"
    );
    // What was acknowledged was promised room: it syncs and closes without error.
    f.sync_all()
        .expect("fsync of acknowledged bytes after ENOSPC");
    drop(f);
    let check = |when: &str| {
        let len = fs::metadata(m.path("filler")).expect("stat").len();
        assert_eq!(len, acked, "size {when}: {len} B, {acked} B acknowledged");
        let got = fs::read(m.path("filler")).expect("read");
        assert_eq!(got.len() as u64, acked, "bytes read {when}");
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            panic!("{when}: byte {at:?} of {acked} differs from what was written");
        }
    };
    check("from the kernel's cache");
    let dropped = Command::new("sysctl")
        .args(["-q", "-w", "vm.drop_caches=3"])
        .status()
        .is_ok_and(|s| s.success());
    if dropped {
        check("after dropping the kernel's caches");
    } else {
        eprintln!("sysctl vm.drop_caches failed: checked through the kernel's cache only");
    }
    // Full stays full (what was counted twice while in flight may fit now: a few
    // stripes), and room freed is room again.
    let mut more = File::create(m.path("more")).expect("create");
    let mut extra = 0;
    let e = loop {
        match more.write(&seeded_bytes(7, MIB)) {
            Ok(n) => extra += n,
            Err(e) => break e,
        }
        assert!(
            extra <= 16 * MIB,
            "{extra} B more written into a full mount"
        );
    };
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ENOSPC),
        "a full mount said {e}"
    );
    drop(more);
    fs::remove_file(m.path("filler")).expect("unlink the filler");
    let _ = fs::remove_file(m.path("more"));
    let start = std::time::Instant::now();
    loop {
        match fs::write(m.path("after"), seeded_bytes(1, 16 * MIB)) {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                // Deleting the filler's stripes runs in the background.
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "20 s after unlinking the filler: {e}"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("write after unlinking the filler: {e}"),
        }
    }
    assert_eq!(
        fs::read(m.path("after")).expect("read"),
        seeded_bytes(1, 16 * MIB)
    );
    m.unmount_cleanly();
}
