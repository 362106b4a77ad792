//! What `/proc` says about a process: the cgroups it runs in (v1 and v2) and when it
//! started.

use granule_wire::CgroupPaths;

/// The memory and cpu cgroup paths in the text of a `/proc/<pid>/cgroup` file.
///
/// v1 lines look like `4:memory:/granule/c1-2-0/node0` or `1:cpu,cpuacct:/x`; the
/// unified (v2) line `0::/...` and other controllers are ignored. The root `/` counts as
/// no cgroup: it limits nothing and its usage is the whole machine's. `None` when neither
/// controller sits in a non-root v1 group.
pub fn parse_proc_cgroup(text: &str) -> Option<CgroupPaths> {
    let mut paths = CgroupPaths::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim();
        if path == "/" || !path.starts_with('/') {
            continue;
        }
        for c in controllers.split(',') {
            match c {
                "memory" => paths.memory = Some(path.to_string()),
                "cpu" => paths.cpu = Some(path.to_string()),
                _ => {}
            }
        }
    }
    (paths.memory.is_some() || paths.cpu.is_some()).then_some(paths)
}

/// This process's memory and cpu cgroups (see [`parse_proc_cgroup`]).
pub fn current_paths() -> Option<CgroupPaths> {
    parse_proc_cgroup(&std::fs::read_to_string("/proc/self/cgroup").ok()?)
}

/// The calling thread's memory and cpu cgroups, which differ from its process's when the
/// thread alone was moved (a pushdown pool thread in its capped group; see
/// [`crate::antagonist::ThreadCpuGroup`]).
pub fn current_thread_paths() -> Option<CgroupPaths> {
    parse_proc_cgroup(&std::fs::read_to_string("/proc/thread-self/cgroup").ok()?)
}

/// Another process's memory and cpu cgroups (`None` also when it does not exist).
pub fn paths_of(pid: u32) -> Option<CgroupPaths> {
    parse_proc_cgroup(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// The path of the v1 group of controller `name` (`memory`, `cpuacct`, ...) in the text
/// of a `/proc/<pid>/cgroup` file, the root `/` included; `None` if no v1 hierarchy with
/// that controller is listed.
pub fn v1_path(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim();
        (path.starts_with('/') && controllers.split(',').any(|c| c == name))
            .then(|| path.to_string())
    })
}

/// The path of the unified (v2) group in the text of a `/proc/<pid>/cgroup` file (the
/// `0::/...` line), the root `/` included; `None` where no v2 hierarchy is mounted.
pub fn unified_path(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let path = line.strip_prefix("0::")?.trim();
        path.starts_with('/').then(|| path.to_string())
    })
}

/// The text of a process's `/proc/<pid>/cgroup` (`None` if there is no such process).
pub fn proc_cgroup_text(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()
}

/// When a process started, in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
/// Together with the pid it names one process for the life of the machine: a pid reused
/// by a later process has a later start time. `None` if there is no such process (a
/// zombie still has one: it is not gone until reaped).
pub fn process_start_time(pid: u32) -> Option<u64> {
    parse_start_time(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) is in parentheses
/// and may itself contain spaces and parentheses, so fields are counted after the last
/// `)`: the first field there is field 3.
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_lines_are_parsed_and_root_is_none() {
        let text = "9:name=systemd:/\n8:pids:/user.slice\n4:memory:/granule/c1-2-0/node0\n\
                    3:cpuset:/\n2:cpuacct:/\n1:cpu,cpuacct:/granule/c1-2-0/node0\n0::/\n";
        let p = parse_proc_cgroup(text).unwrap();
        assert_eq!(p.memory.as_deref(), Some("/granule/c1-2-0/node0"));
        assert_eq!(p.cpu.as_deref(), Some("/granule/c1-2-0/node0"));

        // cpuacct and cpuset are not cpu; the root is no cgroup.
        let p = parse_proc_cgroup("4:memory:/a/b\n3:cpuset:/x\n2:cpuacct:/y\n1:cpu:/\n").unwrap();
        assert_eq!(p.memory.as_deref(), Some("/a/b"));
        assert_eq!(p.cpu, None);

        // Pure v2, all-root v1, and garbage: nothing to report.
        assert_eq!(parse_proc_cgroup("0::/user.slice/session-1.scope\n"), None);
        assert_eq!(parse_proc_cgroup("4:memory:/\n1:cpu,cpuacct:/\n"), None);
        assert_eq!(parse_proc_cgroup("garbage\n\n::\n"), None);
    }

    #[test]
    fn v1_and_v2_paths_by_controller() {
        let text =
            "9:name=systemd:/\n4:memory:/producer\n2:cpu,cpuacct:/x/y\n0::/user.slice/a.scope\n";
        assert_eq!(v1_path(text, "memory").as_deref(), Some("/producer"));
        assert_eq!(v1_path(text, "cpuacct").as_deref(), Some("/x/y"));
        assert_eq!(v1_path(text, "cpuset"), None);
        assert_eq!(v1_path(text, "name=systemd").as_deref(), Some("/"));
        assert_eq!(unified_path(text).as_deref(), Some("/user.slice/a.scope"));
        assert_eq!(unified_path("4:memory:/a\n"), None);
        assert_eq!(unified_path("0::/\n").as_deref(), Some("/"));
        let mine = proc_cgroup_text(std::process::id()).unwrap();
        assert!(!mine.is_empty());
    }

    #[test]
    fn start_time_is_field_22_even_with_odd_names() {
        let stat = "1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000000 200 18446744073709551615";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time("1234 (x) S 1"), None);
        assert_eq!(parse_start_time("no parens"), None);
    }

    #[test]
    fn this_process_has_a_start_time() {
        let mine = process_start_time(std::process::id()).unwrap();
        assert!(mine > 0);
        assert_eq!(process_start_time(std::process::id()), Some(mine));
    }
}
