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
        // Worded as the controller words the same refusal at registration (and as the
        // guide quotes it): which side refuses first depends only on who hosts the
        // controller, and a user should meet one message.
        _ => Err(format!(
            "binary mismatch: {program} is not the executable this cluster runs ({}); \
             every node must run the identical binary because shipped closures are offsets \
             into it. Start the node from the driver's build.",
            local.program,
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
        // The controller's wording of the same refusal (`granule-controller`'s state), which
        // docs/guide/troubleshooting.md quotes.
        assert_eq!(
            err,
            "binary mismatch: /y is not the executable this cluster runs (/x); every node \
             must run the identical binary because shipped closures are offsets into it. \
             Start the node from the driver's build."
        );
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
