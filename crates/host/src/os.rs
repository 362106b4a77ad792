//! Scheduling and allocator requests to the operating system: a thread's nice value and
//! scheduler slice, returning the allocator's free memory, ignoring SIGPIPE (which no
//! safe wrapper covers), and CPU affinity (which nix covers; it lives here so that every
//! affinity call of the workspace goes through one place). The host crate's only
//! `unsafe` code (each block carries a `// SAFETY:` note), and with `shipping.rs` in the
//! runtime, the workspace's; a test (`crates/granule/tests/layout.rs`) keeps it so.
#![allow(unsafe_code)]

use std::time::Duration;

#[doc(hidden)]
pub use ctor as __ctor;

/// Run a function before `main` (at program start, as a C constructor would), in any
/// executable that links the crate using it: `before_main! { fn hook() { ... } }`.
///
/// This is how a Granule executable becomes a node when its driver starts it in node
/// mode — integration tests too, whose `main` belongs to libtest.
///
/// SAFETY (the contract of the expansion, which the `ctor` crate asks to acknowledge
/// with `unsafe`): the function runs before Rust's runtime start-up, when only libc is
/// guaranteed initialised. It must not rely on anything `main`'s start-up sets up (std's
/// SIGPIPE disposition, panics unwinding out of it, other constructors having run) and
/// must not return control in a state `main` cannot start from; the runtime's hook only
/// reads one environment variable and, when it is set, runs the node loop and exits.
#[macro_export]
macro_rules! before_main {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[$crate::os::__ctor::ctor(unsafe, crate_path = $crate::os::__ctor)]
        fn $name() $body
    };
}

/// Give memory the allocator holds but no longer uses back to the kernel. After a large
/// proclet moves away, glibc keeps its freed pages in its arenas; the node's cgroup is
/// still charged for them and a node shedding under memory pressure would see no relief.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: `malloc_trim` only walks the allocator's own free lists (under its locks)
    // and returns unused pages with madvise; it takes no pointers and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The calling thread's nice value (on Linux the nice value is per thread).
pub fn thread_nice() -> std::io::Result<i32> {
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    nix::errno::Errno::clear();
    // SAFETY: getpriority reads a scheduling attribute of the given thread id; it takes no
    // pointers. -1 is a valid answer, so errno (cleared above) tells failure apart.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    if nice == -1 && nix::errno::Errno::last_raw() != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(nice)
}

/// The calling thread's nice value, then set it to `nice`; `None` if either step failed
/// (raising a thread's priority back needs CAP_SYS_NICE, so a restore may fail
/// unprivileged). This leaves the process's other threads alone.
pub fn swap_thread_nice(nice: i32) -> Option<i32> {
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    let old = thread_nice().ok()?;
    // SAFETY: setpriority changes a scheduling attribute of the calling thread only (the
    // id is our own tid); it takes no pointers.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
    (rc == 0).then_some(old)
}

/// Ask the scheduler for a slice of `slice` for the calling thread, or for the kernel's
/// default with `None` (Linux 6.12+ EEVDF: a thread with a shorter slice gets an earlier
/// deadline, so when it wakes it preempts a thread that asked for none instead of waiting
/// out that thread's slice). The thread keeps its policy (SCHED_OTHER) and nice value.
/// Older kernels accept and ignore the request.
#[cfg(target_os = "linux")]
pub fn set_thread_slice(slice: Option<Duration>) -> std::io::Result<()> {
    /// `struct sched_attr` as in include/uapi/linux/sched/types.h (SCHED_ATTR_SIZE_VER1).
    #[repr(C)]
    #[derive(Default)]
    struct SchedAttr {
        size: u32,
        sched_policy: u32,
        sched_flags: u64,
        sched_nice: i32,
        sched_priority: u32,
        sched_runtime: u64,
        sched_deadline: u64,
        sched_period: u64,
        sched_util_min: u32,
        sched_util_max: u32,
    }
    // sched_setattr sets the nice value too: keep the thread's own.
    let nice = thread_nice()?;
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: nice,
        // 0: no custom slice, the kernel's default.
        sched_runtime: slice.map_or(0, |d| d.as_nanos() as u64),
        ..SchedAttr::default()
    };
    // SAFETY: sched_setattr(0 = calling thread, attr, flags 0) reads `size` bytes from
    // `attr`, a live, properly laid out `struct sched_attr` on our stack; it keeps no
    // pointer after returning.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Elsewhere there is no such request to make.
#[cfg(not(target_os = "linux"))]
pub fn set_thread_slice(_slice: Option<Duration>) -> std::io::Result<()> {
    Ok(())
}

/// Ignore SIGPIPE: a process booted before `main` runs without std's start-up code, which
/// normally does this; without it a write to a closed socket would kill the process.
pub fn ignore_sigpipe() {
    // SAFETY: installing SIG_IGN for SIGPIPE is async-signal-safe and involves no handler
    // code; it is what Rust's own runtime does before main.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Give SIGINT (Ctrl-C) its default action back: end the process. A program started in
/// the background by a non-interactive shell (`cmd &` in a script, which `nohup` and CI
/// runners often are) inherits SIGINT ignored, and so does every process it starts; a
/// program that is meant to end on Ctrl-C — a test of exactly that — calls this first.
pub fn default_sigint() {
    // SAFETY: installing SIG_DFL for SIGINT is async-signal-safe and involves no handler
    // code; it changes only this process's disposition for one signal.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Pin the calling thread (0) or thread `tid` to the given CPUs.
pub fn set_affinity(tid: i32, cpus: &[usize]) -> std::io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        set.set(*c).map_err(std::io::Error::from)?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set)
        .map_err(std::io::Error::from)
}

/// Let the calling thread (0) or thread `tid` run on any CPU (the kernel keeps those
/// that exist and that its cpuset allows).
pub fn allow_all_cpus(tid: i32) -> std::io::Result<()> {
    let all: Vec<usize> = (0..nix::sched::CpuSet::count()).collect();
    set_affinity(tid, &all)
}

/// The CPUs the calling thread (0) or thread `tid` may run on.
pub fn affinity(tid: i32) -> std::io::Result<Vec<usize>> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(tid))
        .map_err(std::io::Error::from)?;
    Ok((0..nix::sched::CpuSet::count())
        .filter(|c| set.is_set(*c).unwrap_or(false))
        .collect())
}

/// This process's limit on open file descriptors (`RLIMIT_NOFILE`): (soft, hard).
/// `u64::MAX` stands for no limit.
pub fn nofile_limit() -> std::io::Result<(u64, u64)> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_err(std::io::Error::from)
}

/// Raise this process's soft limit on open file descriptors to its hard limit, and
/// return the new soft limit. Why: the soft limit is often 1024 while the hard limit is
/// far higher; a node (or a test holding thousands of client sockets) should have every
/// descriptor the system grants it, and the HTTP doors keep a reserve of them for cluster
/// traffic below that limit.
pub fn raise_nofile_limit() -> std::io::Result<u64> {
    use nix::sys::resource::{setrlimit, Resource};
    let (soft, hard) = nofile_limit()?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(std::io::Error::from)?;
    }
    Ok(soft.max(hard))
}

/// Set the soft limit on open file descriptors of process `pid` to `soft` (its hard
/// limit is kept; a soft limit above it is refused by the kernel). Tests use it to give
/// one node process a small limit after it started (a node raises its own soft limit at
/// start-up); it needs the same user as the target, or root.
pub fn set_nofile_soft_limit_of(pid: u32, soft: u64) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit with a null new limit only writes the current limits into `old`, a
    // valid, exclusively borrowed rlimit for the duration of the call.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let new = libc::rlimit {
        rlim_cur: soft as libc::rlim_t,
        rlim_max: old.rlim_max,
    };
    // SAFETY: `new` is a valid rlimit read by the kernel during the call; the old value is
    // not asked for (null).
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turn the swap file or device `path` on (`swapon(2)`), at the kernel's default priority
/// or at `priority` (0..=32767). Needs CAP_SYS_ADMIN.
pub fn swapon(path: &std::path::Path, priority: Option<u16>) -> std::io::Result<()> {
    let c = c_path(path)?;
    let flags = match priority {
        // <linux/swap.h>: SWAP_FLAG_PREFER, and the priority in the low 15 bits.
        Some(p) => 0x8000 | (libc::c_int::from(p) & 0x7fff),
        None => 0,
    };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; the kernel only
    // reads it.
    let rc = unsafe { libc::swapon(c.as_ptr(), flags) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turn the swap area `path` off (`swapoff(2)`): the kernel first reads every page stored
/// there back into memory, which can take a while and fails (ENOMEM) when memory cannot
/// hold them. Needs CAP_SYS_ADMIN.
pub fn swapoff(path: &std::path::Path) -> std::io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: as in `swapon`: a valid C string the kernel only reads.
    let rc = unsafe { libc::swapoff(c.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn c_path(path: &std::path::Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))
}

/// Ask the kernel to read the pages of process `pid` in `ranges` (start address, length)
/// back from swap ahead of use: `process_madvise(2)` with `MADV_WILLNEED` through a pidfd.
/// For anonymous memory the kernel starts asynchronous swap-in of every swapped page of
/// the ranges into the swap cache (the process then maps them with cheap minor faults
/// instead of waiting for the device). Returns the bytes the kernel accepted advice for.
/// Needs the right to ptrace `pid` and CAP_SYS_NICE (root has both); kernels before 5.10
/// lack the call (ENOSYS).
pub fn prefetch_ranges(pid: u32, ranges: &[(u64, u64)]) -> std::io::Result<u64> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or -1;
    // no memory is shared with the kernel.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = fd as libc::c_int;
    let mut advised = 0u64;
    let mut result = Ok(());
    // The kernel takes at most IOV_MAX (1024) ranges a call.
    for batch in ranges.chunks(1024) {
        let iov: Vec<libc::iovec> = batch
            .iter()
            .map(|&(start, len)| libc::iovec {
                iov_base: start as usize as *mut libc::c_void,
                iov_len: len as usize,
            })
            .collect();
        // SAFETY: `iov` is a valid array of `iov.len()` iovecs that lives across the call;
        // the kernel only reads it, and the addresses in it name the *target* process's
        // memory, which this process never dereferences. `fd` is the pidfd opened above.
        let n = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                fd,
                iov.as_ptr(),
                iov.len(),
                libc::MADV_WILLNEED,
                0u32,
            )
        };
        if n < 0 {
            result = Err(std::io::Error::last_os_error());
            break;
        }
        advised += n as u64;
    }
    // SAFETY: `fd` is a descriptor this function opened and no one else holds.
    unsafe {
        libc::close(fd);
    }
    result.map(|()| advised)
}

/// A shared, read-only mapping of a memory file (the stripe arenas of [`crate::shm`]),
/// read by offset. It maps `len` bytes from the file's start, possibly more than the
/// file holds yet: the file grows under it. Touching bytes past the file's end would
/// raise SIGBUS, so every access is bounds-checked against the mapping and the arena only
/// hands out offsets below the file's size.
pub(crate) struct SharedMap {
    raw: memmap2::MmapRaw,
}

impl SharedMap {
    /// Map `len` bytes of `file`, read-only.
    pub(crate) fn map(file: &std::fs::File, len: usize) -> std::io::Result<Self> {
        let raw = memmap2::MmapOptions::new()
            .len(len)
            .map_raw_read_only(file)?;
        Ok(SharedMap { raw })
    }

    pub(crate) fn len(&self) -> usize {
        self.raw.len()
    }

    /// Bytes `off..off + len` of the mapping, `None` past its end.
    ///
    /// The caller keeps the arena's protocol: the range lies below the file's size, and
    /// nobody writes it while the slice lives (a slot is written once, before its offset
    /// is handed out, and is not reused while any reader may hold it).
    pub(crate) fn slice(&self, off: usize, len: usize) -> Option<&[u8]> {
        let end = off.checked_add(len)?;
        if end > self.raw.len() {
            return None;
        }
        // SAFETY: `off..end` lies inside the live mapping (checked above), which outlives
        // the returned borrow of `self`. By the arena's protocol above the range is backed
        // by the file and not written while borrowed, so reading it as `&[u8]` is sound.
        Some(unsafe { std::slice::from_raw_parts(self.raw.as_ptr().add(off), len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_gets_the_slice_it_asks_for_and_back() {
        std::thread::spawn(|| {
            let default = crate::proc::thread_slice_ns();
            set_thread_slice(Some(Duration::from_micros(200))).unwrap();
            let asked = crate::proc::thread_slice_ns();
            set_thread_slice(None).unwrap();
            let back = crate::proc::thread_slice_ns();
            // Kernels before 6.12 accept the request without a custom slice: nothing to see.
            if asked != default {
                assert_eq!(asked, Some(200_000));
                assert_eq!(back, default);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn nice_values_swap_per_thread() {
        std::thread::spawn(|| {
            let before = thread_nice().unwrap();
            let old = swap_thread_nice(before + 1).unwrap();
            assert_eq!(old, before);
            assert_eq!(thread_nice().unwrap(), before + 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn affinity_round_trips() {
        let all = affinity(0).unwrap();
        assert!(!all.is_empty());
        std::thread::spawn(move || {
            set_affinity(0, &all[..1]).unwrap();
            assert_eq!(affinity(0).unwrap(), all[..1].to_vec());
            allow_all_cpus(0).unwrap();
            let after = affinity(0).unwrap();
            assert!(all.iter().all(|c| after.contains(c)), "{after:?}");
        })
        .join()
        .unwrap();
    }
}
