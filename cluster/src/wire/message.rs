//! Typed control messages, carried as JSON in `Hello` and `Control` frames.

use serde::{Deserialize, Serialize};

use super::WireError;

/// Control messages are small; a larger control frame is a protocol violation.
pub const MESSAGE_BYTES_MAX: u32 = 64 << 10;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum ControlMessage {
    /// The dialer's first frame: who it claims to be. The claim is checked against its certificate.
    Hello { node: String, rank: u32, world: u32 },
    /// A graceful departure: the sender has finished and is closing; its peers must not treat the
    /// closed connection as a loss.
    Goodbye { rank: u32 },
    /// A rank abandons the collective `seq` of `epoch` (e.g. it lost another peer).
    Abort { epoch: u64, seq: u64, reason: String },
    /// The control plane's first frame on each side's stream: the sender's node name and role. As
    /// with `Hello`, the name is checked against the sender's certificate, never trusted alone.
    Introduce { node: String, role: PeerRole },
    /// The dialer's first frame on a connection of the plaintext TCP data plane: the rank it claims to
    /// be and the token the listener gave that rank over the authenticated control transport. A claim
    /// whose token does not match is refused.
    TcpHello { rank: u32, world: u32, token: String },
}

/// What kind of process speaks on a control-plane connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PeerRole {
    /// A daemon: a member of the cluster.
    Node,
    /// A command-line client talking to a daemon; never a member.
    Client,
}

impl ControlMessage {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("control messages always serialize")
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        if bytes.len() > MESSAGE_BYTES_MAX as usize {
            return Err(WireError::BadControl(format!("{} bytes exceeds {MESSAGE_BYTES_MAX}", bytes.len())));
        }
        serde_json::from_slice(bytes).map_err(|e| WireError::BadControl(e.to_string()))
    }
}
