//! The hello handshake and the identical-binary rule.
//!
//! Every connection starts with the client's `Hello` request and the server's `HelloOk`
//! (or a refusal). Both sides state their role and, if they host proclets, the blake3
//! hash of their executable. Two proclet hosts with different hashes cannot talk: shipped
//! code is an offset into the binary, meaningless in another build. Programs that host no
//! proclets (the standalone controller, `granule status`, load generators) present no hash
//! and are accepted *unverified*: they may send control requests but never code.

use granule_wire::{BinaryHash, NodeId, Role};

/// Who this process is, as told in hellos.
#[derive(Clone, Debug)]
pub struct Identity {
    pub role: Role,
    pub node: Option<NodeId>,
    pub binary: Option<BinaryHash>,
    /// Executable path (for error messages only).
    pub program: String,
}

impl Identity {
    /// An identity for a program that hosts no proclets.
    pub fn tool(role: Role, program: impl Into<String>) -> Self {
        Identity {
            role,
            node: None,
            binary: None,
            program: program.into(),
        }
    }
}

fn short(h: &Option<BinaryHash>) -> String {
    match h {
        Some(h) => h[..6].iter().map(|b| format!("{b:02x}")).collect(),
        None => "none".into(),
    }
}

/// Decide whether a peer that sent (`role`, `binary`, `program`) may talk to `local`.
///
/// Returns `Ok(verified)`: `verified` is true when both sides host proclets and run the
/// identical binary (the peer may ship code). Returns `Err(explanation)` when they may not
/// talk at all: both host proclets but their binaries differ.
pub fn judge_hello(
    local: &Identity,
    role: Role,
    binary: &Option<BinaryHash>,
    program: &str,
) -> Result<bool, String> {
    if !(local.role.hosts_proclets() && role.hosts_proclets()) {
        return Ok(false);
    }
    match (&local.binary, binary) {
        (Some(a), Some(b)) if a == b => Ok(true),
        _ => Err(format!(
            "binary mismatch: {program} (blake3 {}) cannot join {} (blake3 {}); every node \
             of a Granule cluster must run the identical executable, because shipped \
             closures are offsets into it. Start the node from the same build as the driver.",
            short(binary),
            local.program,
            short(&local.binary),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(role: Role, h: u8) -> Identity {
        Identity {
            role,
            node: None,
            binary: Some([h; 32]),
            program: "/x".into(),
        }
    }

    #[test]
    fn same_binary_is_verified() {
        assert_eq!(
            judge_hello(&host(Role::Node, 1), Role::Driver, &Some([1; 32]), "/y"),
            Ok(true)
        );
    }

    #[test]
    fn different_binary_is_refused_with_explanation() {
        let err = judge_hello(&host(Role::Node, 1), Role::Node, &Some([2; 32]), "/y").unwrap_err();
        assert!(err.contains("binary mismatch"), "{err}");
        let err = judge_hello(&host(Role::Node, 1), Role::Node, &None, "/y").unwrap_err();
        assert!(err.contains("binary mismatch"), "{err}");
    }

    #[test]
    fn tools_are_accepted_unverified() {
        assert_eq!(
            judge_hello(&host(Role::Node, 1), Role::Tool, &None, "/status"),
            Ok(false)
        );
        let ctl = Identity::tool(Role::Controller, "ctl");
        assert_eq!(
            judge_hello(&ctl, Role::Node, &Some([3; 32]), "/n"),
            Ok(false)
        );
    }
}
