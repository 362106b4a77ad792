//! Errors a user can cause, as the `granule` command reports them: each run fails with a
//! non-zero exit status and a message that says what went wrong and what to do, never a
//! panic or a backtrace. The troubleshooting chapter of the guide quotes these messages.

mod common;

use common::GRANULE;
use std::process::Command;

/// Run `granule args` with `env` set; assert it fails cleanly and its stderr contains
/// every one of `needles`. Returns stderr.
fn fails_with(args: &[&str], env: &[(&str, &str)], needles: &[&str]) -> String {
    let mut cmd = Command::new(GRANULE);
    cmd.args(args)
        .env_remove("GRANULE_CONTROLLER")
        .env_remove("GRANULE_NODES")
        .env_remove("GRANULE_DASHBOARD")
        .env_remove("GRANULE_LISTEN_HOST")
        .env("RUST_BACKTRACE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run granule");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "granule {args:?} {env:?} should fail:\n{err}"
    );
    assert_eq!(out.status.code(), Some(1), "a clean error exit: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("stack backtrace"),
        "granule {args:?} panicked:\n{err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "granule {args:?} {env:?}: '{n}' missing from:\n{err}"
        );
    }
    err
}

#[test]
fn bad_node_specs_name_the_setting_and_show_an_example() {
    fails_with(
        &["demo", "--seconds", "0.01", "--exit"],
        &[("GRANULE_NODES", "cpu=1,mem=lots")],
        &[
            "cluster.nodes (GRANULE_NODES=cpu=1,mem=lots)",
            "'lots' is not a size",
            "accepts ';'-separated node specs such as cpu=1,mem=512MiB;cpu=2,mem=2GiB",
        ],
    );
    fails_with(
        &["demo", "--exit"],
        &[("GRANULE_NODES", "cpu=1,ram=3")],
        &["unknown key 'ram' (known: cpu, mem)"],
    );
    fails_with(
        &["node", "--controller", "127.0.0.1:1", "--mem", "lots"],
        &[],
        &["--mem", "'lots' is not a size (examples: 512MiB"],
    );
    fails_with(
        &["node", "--controller", "127.0.0.1:1", "--cpu", "0"],
        &[],
        &["cpu must be > 0"],
    );
    fails_with(
        &["demo", "--exit"],
        &[("GRANULE_CGROUPS", "yes")],
        &[
            "cluster.cgroups (GRANULE_CGROUPS=yes)",
            "accepts auto or off",
        ],
    );
}

#[test]
fn ports_in_use_and_foreign_addresses_say_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    fails_with(
        &["controller", "--listen", &addr],
        &[],
        &["--listen: cannot listen on", "in use", "pick another port"],
    );
    fails_with(
        &[
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--dashboard",
            &addr,
        ],
        &[],
        &[
            "cannot serve the dashboard",
            "GRANULE_DASHBOARD=IP:PORT or --dashboard",
        ],
    );
    fails_with(
        &["demo", "--seconds", "0.01", "--exit"],
        &[("GRANULE_DASHBOARD", &addr)],
        &["cannot serve the dashboard", "port 0 picks a free one"],
    );
    fails_with(
        &["controller", "--listen", "nonsense"],
        &[],
        &["--listen", "is not IP:PORT"],
    );
    // 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    fails_with(
        &[
            "node",
            "--controller",
            "127.0.0.1:1",
            "--listen-host",
            "192.0.2.1",
        ],
        &[],
        &["--listen-host", "use an address of this machine"],
    );
    fails_with(
        &["demo", "--exit"],
        &[("GRANULE_LISTEN_HOST", "192.0.2.1")],
        &[
            "cluster.listen_host (GRANULE_LISTEN_HOST=192.0.2.1)",
            "use an address of this machine",
        ],
    );
}

#[test]
fn an_unreachable_controller_is_named_with_a_hint() {
    for args in [
        &["status", "--controller", "127.0.0.1:1"][..],
        &["top", "--controller", "127.0.0.1:1", "--iterations", "1"][..],
        &["node", "--controller", "127.0.0.1:1"][..],
    ] {
        fails_with(args, &[], &["127.0.0.1:1", "unreachable", "is it running?"]);
    }
    fails_with(
        &["top", "--controller", "127.0.0.1:1", "--interval", "1ms"],
        &[],
        &["--interval must be at least 50ms"],
    );
}

/// The separately built `granule` binary cannot join a cluster this test binary drives.
#[test]
fn a_binary_mismatch_says_to_run_the_drivers_build() {
    let cluster = granule::Cluster::builder()
        .nodes("cpu=1,mem=128MiB")
        .unwrap()
        .start()
        .unwrap();
    fails_with(
        &[
            "node",
            "--controller",
            cluster.controller_addr(),
            "--mem",
            "128MiB",
        ],
        &[],
        &[
            "binary mismatch",
            "identical",
            "Start the node from the driver's build",
        ],
    );
}

/// Without permission to create cgroups (not root), the antagonists refuse and say what
/// they need. Needs root (to drop to an unprivileged user) and `setpriv`.
#[test]
fn cgroups_not_writable_is_explained() {
    let root = granule_host::proc::is_root();
    let setpriv = std::path::Path::new("/usr/bin/setpriv");
    if !root || !setpriv.exists() {
        eprintln!("skipped: needs root and /usr/bin/setpriv to run granule as another user");
        return;
    }
    let out = Command::new(setpriv)
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            GRANULE,
        ])
        .args([
            "antagonist",
            "cpu",
            "--node",
            "n1",
            "--controller",
            "127.0.0.1:1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("Permission denied") && !err.contains("granule") {
        eprintln!("skipped: user 65534 cannot execute the test binary here: {err}");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot use cgroups here") && err.contains("run as root"),
        "{err}"
    );
}
