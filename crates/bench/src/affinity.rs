//! CPU placement of the benchmark processes: pinning every thread of a process to a vCPU,
//! and restoring the driver's affinity after a benchmark (so `granule bench all` does not
//! carry one benchmark's pinning into the next).

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Every thread of this process gets `set` (threads and processes created later inherit
/// it). Threads that exit during the walk are skipped.
pub fn set_process_affinity(set: &CpuSet) -> anyhow::Result<()> {
    for entry in std::fs::read_dir("/proc/self/task")? {
        let tid: i32 = entry?.file_name().to_string_lossy().parse()?;
        let _ = sched_setaffinity(Pid::from_raw(tid), set);
    }
    Ok(())
}

/// Pin every thread of process `pid` to vCPU `cpu` (threads it creates later inherit it).
/// Threads that exit during the walk are skipped.
pub fn pin_pid(pid: u32, cpu: usize) -> anyhow::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let tid: i32 = entry?.file_name().to_string_lossy().parse()?;
        let _ = sched_setaffinity(Pid::from_raw(tid), &set);
    }
    Ok(())
}

/// Pin every thread of this process to vCPU `cpu`.
pub fn pin_process(cpu: usize) -> anyhow::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    set_process_affinity(&set)
}

/// The driver's affinity when this was made; restored when it is dropped.
pub struct SavedAffinity(Option<CpuSet>);

impl SavedAffinity {
    /// Remember the current affinity.
    pub fn save() -> SavedAffinity {
        SavedAffinity(sched_getaffinity(Pid::from_raw(0)).ok())
    }

    /// Remember the current affinity, then let every thread float over all vCPUs (node
    /// processes started now inherit that).
    pub fn unpin() -> SavedAffinity {
        let saved = SavedAffinity::save();
        let mut all = CpuSet::new();
        for cpu in 0..CpuSet::count() {
            let _ = all.set(cpu);
        }
        // The kernel keeps only CPUs that exist and that the cgroup allows.
        if let Err(e) = set_process_affinity(&all) {
            eprintln!("bench: cannot reset the driver's CPU affinity: {e}");
        }
        saved
    }
}

impl Drop for SavedAffinity {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            let _ = set_process_affinity(s);
        }
    }
}
