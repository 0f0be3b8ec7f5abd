//! Secrets: random tokens with a recognisable prefix, and the SHA-256
//! under which tokens, codes and keys are stored (never the secret itself).

use sha2::{Digest, Sha256};

/// A new random token with a recognisable prefix.
pub fn new_token(prefix: &str) -> String {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes).expect("the OS random source works");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}_{hex}")
}

/// A secret's SHA-256, in hex: what the store keeps of it.
pub fn hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
