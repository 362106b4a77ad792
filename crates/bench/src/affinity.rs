//! CPU placement of the benchmark processes: pinning every thread of a process to a vCPU,
//! and restoring the driver's affinity after a benchmark (so `granule-bench all` does not
//! carry one benchmark's pinning into the next). The affinity calls and the task lists
//! are `granule_host`'s.

use granule_host::os::{affinity, allow_all_cpus, set_affinity};
use granule_host::proc::{tasks_of, thread_ids};

/// Every thread of this process may run on `cpus` only (threads and processes created
/// later inherit it). Threads that exit during the walk are skipped.
pub fn set_process_affinity(cpus: &[usize]) -> anyhow::Result<()> {
    for tid in thread_ids() {
        let _ = set_affinity(tid, cpus);
    }
    Ok(())
}

/// Pin every thread of process `pid` to vCPU `cpu` (threads it creates later inherit it).
/// Threads that exit during the walk are skipped.
pub fn pin_pid(pid: u32, cpu: usize) -> anyhow::Result<()> {
    let tasks = tasks_of(pid);
    if tasks.is_empty() {
        anyhow::bail!("process {pid} has no threads to pin (is it gone?)");
    }
    for tid in tasks {
        let _ = set_affinity(tid, &[cpu]);
    }
    Ok(())
}

/// Pin every thread of this process to vCPU `cpu`.
pub fn pin_process(cpu: usize) -> anyhow::Result<()> {
    set_process_affinity(&[cpu])
}

/// Pin the calling thread (only it) to vCPU `cpu`.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    set_affinity(0, &[cpu])
}

/// The driver's affinity when this was made; restored when it is dropped.
pub struct SavedAffinity(Option<Vec<usize>>);

impl SavedAffinity {
    /// Remember the current affinity.
    pub fn save() -> SavedAffinity {
        SavedAffinity(affinity(0).ok())
    }

    /// Remember the current affinity, then let every thread float over all vCPUs (node
    /// processes started now inherit that).
    pub fn unpin() -> SavedAffinity {
        let saved = SavedAffinity::save();
        // The kernel keeps only CPUs that exist and that the cgroup allows.
        for tid in thread_ids() {
            let _ = allow_all_cpus(tid);
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
