//! Debug output by environment variable level, as tinygrad does: `PT_DEBUG=1` prints where each
//! training step's time goes (batch, cache, pipeline, bookkeeping) to stderr; 0 or unset prints
//! nothing.

use std::sync::OnceLock;

/// The level `PT_DEBUG` asks for (0 when unset or not a number).
pub fn level() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| std::env::var("PT_DEBUG").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}
