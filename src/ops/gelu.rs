//! GELU, in its exact erf form (BERT's `gelu`) and its tanh approximation (GPT-2's `gelu_new`).

use crate::error::{Error, Result, check_len, config_error};
use crate::scalar::Float;

/// Which GELU formula a model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// `x·Φ(x) = x/2·(1 + erf(x/√2))`.
    #[serde(rename = "gelu")]
    GeluErf,
    /// `x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    #[serde(rename = "gelu_tanh")]
    GeluTanh,
}

impl Activation {
    /// Parses a Hugging Face `hidden_act` name: `gelu` → erf form; `gelu_new`,
    /// `gelu_pytorch_tanh`, `gelu_tanh` → tanh form. Anything else is an `Error::Config` naming
    /// `field` and listing the accepted names.
    pub fn parse(name: &str, field: &str) -> Result<Self, Error> {
        match name {
            "gelu" => Ok(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_tanh" => Ok(Self::GeluTanh),
            other => Err(config_error(
                field,
                format!("unknown activation `{other}`; expected one of gelu, gelu_new, gelu_pytorch_tanh, gelu_tanh"),
            )),
        }
    }
}

/// `out[i] = gelu(inp[i])`.
pub fn gelu_forward<T: Float>(out: &mut [T], inp: &[T], kind: Activation) -> Result<()> {
    todo!()
}

/// Writes `dinp[i] = gelu'(inp[i])·dout[i]`.
pub fn gelu_backward<T: Float>(dinp: &mut [T], inp: &[T], dout: &[T], kind: Activation) -> Result<()> {
    todo!()
}
