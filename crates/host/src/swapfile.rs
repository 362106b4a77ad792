//! Swap files: creating one (allocated, formatted with a version-1 swap header as
//! `mkswap` writes it), turning it on and off, and removing it. The memory market's
//! producer sets one up when the machine has no swap, so that a harvested workload's cold
//! anonymous pages have somewhere to go, and takes it away again on exit.
//!
//! Nothing here decides whether a machine should have swap; the caller does, and records
//! what it changed so that it can be undone after a crash.

use crate::HostError;
use std::io::Write;
use std::path::Path;

/// The swap header's signature, in the last ten bytes of the first page.
const MAGIC: &[u8; 10] = b"SWAPSPACE2";

/// Build the first page of a swap area of `pages` pages of `page_size` bytes: the
/// version-1 header (`struct swap_header` of `<linux/swap.h>`): version, last page, no bad
/// pages, a UUID, no label, and the signature at the page's end.
pub fn swap_header(page_size: usize, pages: u64, uuid: [u8; 16]) -> Result<Vec<u8>, HostError> {
    if page_size < 4096 || pages < 10 {
        return Err(HostError::Invalid {
            what: "swap area (at least 10 pages of 4 KiB or more)",
            value: format!("{pages} pages of {page_size} bytes"),
        });
    }
    let last = u32::try_from(pages - 1).map_err(|_| HostError::Invalid {
        what: "swap area size (at most 2^32 pages)",
        value: pages.to_string(),
    })?;
    let mut page = vec![0u8; page_size];
    page[1024..1028].copy_from_slice(&1u32.to_ne_bytes());
    page[1028..1032].copy_from_slice(&last.to_ne_bytes());
    // nr_badpages stays 0.
    page[1036..1052].copy_from_slice(&uuid);
    page[page_size - MAGIC.len()..].copy_from_slice(MAGIC);
    Ok(page)
}

/// How a new swap file's blocks are allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// `fallocate(2)`: blocks reserved at once, nothing written (ext4 and xfs take such a
    /// file as swap). Writing gigabytes of zeros instead costs seconds of disk writes and
    /// page cache on a machine whose workload the producer must not disturb.
    Allocate,
    /// Zeros written through the page cache: for file systems that refuse the above.
    Zeros,
}

/// Create the swap file `path` of `size` bytes (rounded down to whole pages), allocated
/// as `fill` says (with no holes: the kernel refuses swap files with holes; `Allocate`
/// falls back to `Zeros` where the file system has no `fallocate`), readable by root
/// only, with a swap header. Fails if the file exists.
pub fn create(path: &Path, size: u64, fill: Fill) -> Result<(), HostError> {
    use std::os::unix::fs::OpenOptionsExt;
    let page_size = crate::proc::page_size() as usize;
    let pages = size / page_size as u64;
    let mut uuid = [0u8; 16];
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
        ^ u128::from(std::process::id()) << 64;
    uuid.copy_from_slice(&seed.to_le_bytes());
    let header = swap_header(page_size, pages, uuid)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| HostError::io("create", dir, e))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| HostError::io("create", path, e))?;
    let total = pages * page_size as u64;
    let write = |f: &mut std::fs::File| -> std::io::Result<()> {
        f.write_all(&header)?;
        let allocated = fill == Fill::Allocate
            && match nix::fcntl::fallocate(
                &*f,
                nix::fcntl::FallocateFlags::empty(),
                0,
                i64::try_from(total).unwrap_or(i64::MAX),
            ) {
                Ok(()) => true,
                Err(nix::errno::Errno::EOPNOTSUPP) => false,
                Err(e) => return Err(e.into()),
            };
        if !allocated {
            let zeros = vec![0u8; 1 << 20];
            let mut left = total - page_size as u64;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                f.write_all(&zeros[..n])?;
                left -= n as u64;
            }
        }
        f.sync_all()
    };
    if let Err(e) = write(&mut f) {
        drop(f);
        let _ = std::fs::remove_file(path);
        return Err(HostError::io("write", path, e));
    }
    Ok(())
}

/// Create the swap file `path` and turn it on: allocated with `fallocate` first, and
/// if the kernel refuses that file (`EINVAL`: some file systems take only written-out
/// swap files), made again with zeros written. Not retried on a file system that holds
/// no swap file at all (tmpfs, ramfs, overlayfs): writing gigabytes there would only
/// fill memory before failing the same way.
pub fn create_and_enable(path: &Path, size: u64) -> Result<(), HostError> {
    create(path, size, Fill::Allocate)?;
    let Err(first) = enable(path) else {
        return Ok(());
    };
    let einval = matches!(&first, HostError::Io { source, .. }
        if source.raw_os_error() == Some(libc::EINVAL));
    if !einval || !may_hold_swap(path) {
        let _ = remove(path);
        return Err(first);
    }
    remove(path)?;
    tracing::debug!(
        "swap file {}: {first}; writing it out instead",
        path.display()
    );
    create(path, size, Fill::Zeros)?;
    if let Err(e) = enable(path) {
        let _ = remove(path);
        return Err(e);
    }
    Ok(())
}

/// Whether the file system holding `path` could hold a swap file at all (not one kept
/// in memory or layered over others).
fn may_hold_swap(path: &Path) -> bool {
    // statfs(2)'s f_type values (<linux/magic.h>).
    const IN_MEMORY_OR_LAYERED: [i64; 3] = [
        0x0102_1994, // tmpfs
        0x8584_58f6, // ramfs
        0x794c_7630, // overlayfs
    ];
    match nix::sys::statfs::statfs(path) {
        // f_type's width differs between targets (i64 here, u32 on some).
        #[allow(clippy::unnecessary_cast)]
        Ok(fs) => !IN_MEMORY_OR_LAYERED.contains(&(fs.filesystem_type().0 as i64)),
        Err(_) => true,
    }
}

/// Turn the swap file `path` on.
pub fn enable(path: &Path) -> Result<(), HostError> {
    crate::os::swapon(path, None).map_err(|e| HostError::io("swapon", path, e))
}

/// Turn the swap file `path` off (its pages are read back into memory first).
pub fn disable(path: &Path) -> Result<(), HostError> {
    crate::os::swapoff(path).map_err(|e| HostError::io("swapoff", path, e))
}

/// Whether `path` is an active swap area now.
pub fn is_active(path: &Path) -> Result<bool, HostError> {
    let want = path.to_string_lossy();
    Ok(crate::mem::swaps()?.iter().any(|a| a.path == want))
}

/// Remove the swap file `path` (after [`disable`]); a file already gone is fine.
pub fn remove(path: &Path) -> Result<(), HostError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(HostError::io("remove", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_where_the_kernel_looks() {
        let h = swap_header(4096, 256, [7; 16]).unwrap();
        assert_eq!(h.len(), 4096);
        assert_eq!(&h[4086..], b"SWAPSPACE2");
        assert_eq!(u32::from_ne_bytes(h[1024..1028].try_into().unwrap()), 1);
        assert_eq!(u32::from_ne_bytes(h[1028..1032].try_into().unwrap()), 255);
        assert_eq!(&h[1036..1052], &[7; 16]);
        assert!(swap_header(4096, 3, [0; 16]).is_err());
    }

    /// Really turns a small swap file on and off (root only; skipped otherwise).
    #[test]
    fn a_swap_file_goes_on_and_off() {
        if !crate::proc::is_root() {
            eprintln!("skipped: needs root to swapon");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("test.swap");
        create(&path, 16 << 20, Fill::Zeros).unwrap();
        assert!(
            create(&path, 16 << 20, Fill::Zeros).is_err(),
            "exists already"
        );
        match enable(&path) {
            Ok(()) => {}
            Err(e) => {
                // A file system that cannot hold swap files (tmpfs, overlay) is not a failure
                // of this code.
                eprintln!("skipped: {e}");
                remove(&path).unwrap();
                return;
            }
        }
        assert!(is_active(&path).unwrap());
        disable(&path).unwrap();
        assert!(!is_active(&path).unwrap());
        remove(&path).unwrap();
        assert!(!path.exists());
    }

    /// An allocated (not written) swap file holds a header, has no holes, and goes on
    /// where the file system takes it (root only for the swapon part).
    #[test]
    fn an_allocated_swap_file_has_its_header_and_no_holes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alloc.swap");
        create(&path, 8 << 20, Fill::Allocate).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 8 << 20);
        // Every block is allocated (512-byte units), which is what "no holes" means.
        assert!(meta.blocks() * 512 >= 8 << 20, "{} blocks", meta.blocks());
        let page = crate::proc::page_size() as usize;
        let head = std::fs::read(&path).unwrap();
        assert_eq!(&head[page - 10..page], b"SWAPSPACE2");
        std::fs::remove_file(&path).unwrap();
        if crate::proc::is_root() {
            match create_and_enable(&path, 8 << 20) {
                Ok(()) => {
                    assert!(is_active(&path).unwrap());
                    disable(&path).unwrap();
                    remove(&path).unwrap();
                }
                Err(e) => eprintln!("skipped swapon: {e}"),
            }
        }
    }

    /// On tmpfs (memory) a refused swap file is not written out with zeros: the file
    /// system could never hold it.
    #[test]
    fn memory_file_systems_are_not_retried_with_zeros() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("skipped: no /dev/shm");
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let path = dir.path().join("refused.swap");
        std::fs::write(&path, b"x").unwrap();
        assert!(!may_hold_swap(&path));
        std::fs::remove_file(&path).unwrap();
        if crate::proc::is_root() {
            assert!(create_and_enable(&path, 8 << 20).is_err());
            assert!(!path.exists(), "the refused file is removed");
        }
    }
}
