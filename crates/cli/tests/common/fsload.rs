//! I/O against a mount for the file system's victim tests (`fs_victims.rs`,
//! `fs_revoke.rs`), included by them with `#[path]` after `fsmount.rs`: files of seeded
//! bytes, reading them back byte for byte, and a load of writers and readers that runs
//! while a test takes a victim away.
#![allow(dead_code)]

use crate::fsmount::{bounded, drop_cache, first_difference, seeded_bytes, KIB, MIB};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Files and the bytes each must hold.
pub type Files = Vec<(PathBuf, Vec<u8>)>;

/// Files of seeded random bytes, fsynced: (path, bytes).
pub fn write_files(dir: &Path, seed: u64, sizes: &[usize]) -> Files {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let p = dir.join(format!("file-{seed}-{i}"));
            let bytes = seeded_bytes(seed * 1000 + i as u64, len);
            let mut f = File::create(&p).expect("create");
            f.write_all(&bytes).expect("write");
            f.sync_all().expect("fsync");
            (p, bytes)
        })
        .collect()
}

/// Read `p` from the file system (its page cache dropped first), within 60 s.
pub fn read_back(p: &Path) -> io::Result<Vec<u8>> {
    let p = p.to_path_buf();
    bounded(
        &format!("reading {}", p.display()),
        Duration::from_secs(60),
        move || {
            drop_cache(&p)?;
            fs::read(&p)
        },
    )
}

/// Every file reads back byte-identical.
pub fn all_identical(files: &[(PathBuf, Vec<u8>)], when: &str) {
    for (p, want) in files {
        let got = read_back(p).unwrap_or_else(|e| panic!("{when}: reading {}: {e}", p.display()));
        if let Some(d) = first_difference(&got, want) {
            panic!("{when}: {} has other bytes: {d}", p.display());
        }
    }
}

/// A length up to `small` (7 times in 10) or up to `large`: many quick writes, some
/// that cross stripes.
pub fn mostly_small(rng: &mut StdRng, small: usize, large: usize) -> usize {
    if rng.random_bool(0.7) {
        rng.random_range(1..=small)
    } else {
        rng.random_range(1..=large)
    }
}

/// One write: a new file, or an overwrite of a range of one written before; fsynced.
/// Returns the file and the bytes it must hold now.
fn write_one(
    dir: &Path,
    name: String,
    rng: &mut StdRng,
    mine: &mut Files,
) -> Result<(PathBuf, Vec<u8>), String> {
    if mine.is_empty() || rng.random_bool(0.5) {
        let p = dir.join(name);
        let want = seeded_bytes(rng.random(), mostly_small(rng, 256 * KIB, 5 * MIB / 2));
        let mut f = File::create(&p).map_err(|e| format!("create {}: {e}", p.display()))?;
        f.write_all(&want)
            .map_err(|e| format!("write {}: {e}", p.display()))?;
        f.sync_all()
            .map_err(|e| format!("fsync {}: {e}", p.display()))?;
        mine.push((p.clone(), want.clone()));
        return Ok((p, want));
    }
    let i = rng.random_range(0..mine.len());
    let (p, want) = &mut mine[i];
    let off = rng.random_range(0..=want.len());
    let patch = seeded_bytes(rng.random(), mostly_small(rng, 64 * KIB, MIB + 4096));
    let f = OpenOptions::new()
        .write(true)
        .open(&*p)
        .map_err(|e| format!("open {}: {e}", p.display()))?;
    f.write_all_at(&patch, off as u64)
        .map_err(|e| format!("write {}: {e}", p.display()))?;
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", p.display()))?;
    let end = off + patch.len();
    if want.len() < end {
        want.resize(end, 0);
    }
    want[off..end].copy_from_slice(&patch);
    Ok((p.clone(), want.clone()))
}

/// Until `stop`: write (see [`write_one`]) and read each write back from the file
/// system; the files and their bytes go into `done`. Returns the writes made.
fn writer(
    dir: PathBuf,
    seed: u64,
    stop: Arc<AtomicBool>,
    done: Arc<Mutex<Files>>,
    count: Arc<AtomicU64>,
) -> Result<u64, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut mine: Files = Vec::new();
    let mut n = 0u64;
    let mut result = Ok(());
    while !stop.load(Ordering::SeqCst) {
        let step =
            write_one(&dir, format!("w{seed}-{n}"), &mut rng, &mut mine).and_then(|(p, want)| {
                drop_cache(&p).map_err(|e| format!("fadvise {}: {e}", p.display()))?;
                let got = fs::read(&p).map_err(|e| format!("read back {}: {e}", p.display()))?;
                match first_difference(&got, &want) {
                    Some(d) => Err(format!("{} read back other bytes: {d}", p.display())),
                    None => Ok(()),
                }
            });
        if let Err(e) = step {
            result = Err(e);
            break;
        }
        n += 1;
        count.fetch_add(1, Ordering::SeqCst);
    }
    // What was written stays checkable even when a write failed.
    done.lock().expect("lock").extend(mine);
    result.map(|()| n)
}

/// Until `stop`: read `files` from the file system over and over, `pause` apart.
fn reader(
    files: Arc<Files>,
    seed: u64,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
    pause: Duration,
) -> Result<u64, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let (p, want) = &files[rng.random_range(0..files.len())];
        drop_cache(p).map_err(|e| format!("fadvise {}: {e}", p.display()))?;
        let got = fs::read(p).map_err(|e| format!("read {}: {e}", p.display()))?;
        if let Some(d) = first_difference(&got, want) {
            return Err(format!("{} read other bytes: {d}", p.display()));
        }
        n += 1;
        count.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(pause);
    }
    Ok(n)
}

/// Writers of new files and overwrites in `dir`, and readers of `files`, on threads of
/// their own until [`Load::stop`].
pub struct Load {
    stop: Arc<AtomicBool>,
    written: Arc<Mutex<Files>>,
    wrote: Arc<AtomicU64>,
    read: Arc<AtomicU64>,
    writers: Vec<JoinHandle<Result<u64, String>>>,
    readers: Vec<JoinHandle<Result<u64, String>>>,
}

/// What a load did: writes, reads, and the files its writers left (with their bytes).
pub struct LoadDone {
    pub writes: u64,
    pub reads: u64,
    pub written: Files,
    /// Every failed read or write, with the thread that met it.
    pub errors: Vec<String>,
}

impl Load {
    pub fn start(
        dir: &Path,
        files: Arc<Files>,
        writers: u64,
        readers: u64,
        reader_pause: Duration,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(Mutex::new(Vec::new()));
        let (wrote, read) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let writers = (0..writers)
            .map(|i| {
                let (dir, stop, done, count) = (
                    dir.to_path_buf(),
                    stop.clone(),
                    written.clone(),
                    wrote.clone(),
                );
                std::thread::spawn(move || writer(dir, 10 + i, stop, done, count))
            })
            .collect();
        let readers = (0..readers)
            .map(|i| {
                let (files, stop, count) = (files.clone(), stop.clone(), read.clone());
                std::thread::spawn(move || reader(files, 20 + i, stop, count, reader_pause))
            })
            .collect();
        Load {
            stop,
            written,
            wrote,
            read,
            writers,
            readers,
        }
    }

    /// Writes and reads done so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.wrote.load(Ordering::SeqCst),
            self.read.load(Ordering::SeqCst),
        )
    }

    pub fn stop(self) -> LoadDone {
        self.stop.store(true, Ordering::SeqCst);
        let mut done = LoadDone {
            writes: 0,
            reads: 0,
            written: Vec::new(),
            errors: Vec::new(),
        };
        for w in self.writers {
            match w.join().expect("writer thread") {
                Ok(n) => done.writes += n,
                Err(e) => done.errors.push(format!("writer: {e}")),
            }
        }
        for r in self.readers {
            match r.join().expect("reader thread") {
                Ok(n) => done.reads += n,
                Err(e) => done.errors.push(format!("reader: {e}")),
            }
        }
        done.written = std::mem::take(&mut *self.written.lock().expect("lock"));
        done
    }
}
