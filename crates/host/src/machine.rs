//! What machine this is: CPU model and count (`/proc/cpuinfo`), memory (`MemTotal`) and
//! kernel release (`/proc/sys/kernel/osrelease`) — what benchmark reports are stamped
//! with. It only reads, and never fails: what cannot be read is "unknown" or 0.

use crate::file::read_text;
use std::path::Path;

pub const CPUINFO: &str = "/proc/cpuinfo";
pub const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// The machine, as far as its `/proc` tells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// CPU model name (blanks collapsed), or "unknown CPU".
    pub cpu_model: String,
    /// Logical CPUs listed in `/proc/cpuinfo` (0 if none are listed).
    pub cpus: usize,
    /// `MemTotal`, bytes (0 if unknown).
    pub mem_total_bytes: u64,
    /// Kernel release (`6.18.44-...`), or "unknown".
    pub kernel: String,
}

impl Machine {
    /// Read it now.
    pub fn read() -> Machine {
        let (cpu_model, cpus) = parse_cpuinfo(&read_text(Path::new(CPUINFO)).unwrap_or_default());
        Machine {
            cpu_model,
            cpus,
            mem_total_bytes: mem_total_bytes().unwrap_or(0),
            kernel: kernel_release().unwrap_or_else(|| "unknown".to_owned()),
        }
    }
}

/// `MemTotal`, bytes.
pub fn mem_total_bytes() -> Option<u64> {
    crate::mem::meminfo().ok().map(|m| m.total)
}

/// The kernel release (`uname -r`).
pub fn kernel_release() -> Option<String> {
    let s = read_text(Path::new(OSRELEASE)).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

/// `(model name, number of "processor" entries)` from the text of `/proc/cpuinfo`.
pub fn parse_cpuinfo(text: &str) -> (String, usize) {
    let mut model = None;
    let mut count = 0;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = key.trim();
        let value = value.trim();
        if key == "processor" {
            count += 1;
        }
        // x86 says "model name"; some ARM kernels "Model", "Hardware" or "cpu model".
        if model.is_none()
            && matches!(key, "model name" | "Model" | "Hardware" | "cpu model")
            && !value.is_empty()
        {
            model = Some(value.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }
    (model.unwrap_or_else(|| "unknown CPU".to_owned()), count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_parsing() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  7B13 64-Core Processor\n\n\
                    processor\t: 1\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n";
        assert_eq!(
            parse_cpuinfo(text),
            ("AMD EPYC 7B13 64-Core Processor".to_owned(), 2)
        );
        assert_eq!(
            parse_cpuinfo("processor : 0\nHardware : BCM2835\n"),
            ("BCM2835".to_owned(), 1)
        );
        assert_eq!(parse_cpuinfo(""), ("unknown CPU".to_owned(), 0));
    }

    #[test]
    fn this_machine() {
        let m = Machine::read();
        assert!(m.cpus >= 1, "{m:?}");
        assert!(m.mem_total_bytes > 0, "{m:?}");
        assert_ne!(m.kernel, "unknown");
        assert_eq!(kernel_release().as_deref(), Some(m.kernel.as_str()));
    }
}
