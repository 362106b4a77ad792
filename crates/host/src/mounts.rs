//! Mount points and block-device settings, for the file system's mount: whether a
//! directory is a mount point now (`/proc/self/mountinfo`), and the read-ahead of a
//! mount's backing device (`/sys/class/bdi/MAJOR:MINOR/read_ahead_kb`), which decides
//! how large the reads the kernel sends a FUSE file system are.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Whether `dir` (absolute or relative to the working directory) is a mount point.
pub fn is_mount_point(dir: &Path) -> bool {
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    // mountinfo escapes spaces, tabs, newlines and backslashes as octal.
    let want = abs
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    let want = if want.len() > 1 {
        want.trim_end_matches('/')
    } else {
        &want
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| t.lines().any(|l| l.split(' ').nth(4) == Some(want)))
        .unwrap_or(false)
}

/// The file system type of the mount at `dir` (`tmpfs`, `fuse.granule`, ...), if `dir`
/// is a mount point (the last mount there, when several are stacked).
pub fn mount_type(dir: &Path) -> Option<String> {
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let want = abs.to_string_lossy().replace(' ', "\\040");
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        if fields.get(4) != Some(&want.as_str()) {
            return None;
        }
        let dash = fields.iter().position(|f| *f == "-")?;
        fields.get(dash + 1).map(|s| s.to_string())
    })
}

/// The (major, minor) device number of the file system `dir` is on.
pub fn device_of(dir: &Path) -> std::io::Result<(u64, u64)> {
    let dev = std::fs::metadata(dir)?.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    Ok((major, minor))
}

/// Set the read-ahead of the file system at `dir` to `kib` KiB; its previous value.
pub fn set_read_ahead(dir: &Path, kib: u64) -> std::io::Result<u64> {
    let (major, minor) = device_of(dir)?;
    let file = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let old = std::fs::read_to_string(&file)?
        .trim()
        .parse::<u64>()
        .unwrap_or(0);
    std::fs::write(&file, kib.to_string())?;
    Ok(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_a_mount_point_and_a_subdirectory_usually_not() {
        assert!(is_mount_point(Path::new("/")));
        let d = std::env::temp_dir().join(format!("granule-mounts-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        assert!(!is_mount_point(&d));
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn device_numbers_of_the_root() {
        let (major, minor) = device_of(Path::new("/")).unwrap();
        assert!(major > 0 || minor > 0);
    }
}
