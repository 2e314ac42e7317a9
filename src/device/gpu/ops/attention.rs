//! `kernels/attention.cu`: fused attention forward and backward (online softmax; the saved state
//! is one log-sum-exp per query row, never the T×T matrix).
//!
//! Forward: one launch over query tiles. Backward: the dq kernel (query tiles; it also writes
//! `rowdot_i = dout_i·out_i` into a scratch buffer), then the dk/dv kernel (key tiles), so
//! every gradient element is written by one thread and no float atomics are needed.

use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, GpuIds, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len, config_error};
use crate::ops::attention::AttentionDims;

/// The largest head dimension the kernels hold in registers (`ATTN_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 128;

/// Elements the forward saves for the backward: one log-sum-exp per (batch, head, query).
pub fn saved_len(d: &AttentionDims) -> usize {
    d.batch * d.heads * d.q_len
}

/// Rows a block owns and streams per step: 32, or 16 above head_dim 64, so that the f32 tiles
/// fit the default 48 KiB of dynamic shared memory.
fn tile(d: &AttentionDims) -> usize {
    if d.head_dim <= 64 { 32 } else { 16 }
}

/// Bytes of dynamic shared memory of a kernel holding `row_tiles` tiles of `T × (head_dim+1)`
/// floats, `square_tiles` of `T × (T+1)` and `vectors` of `T`.
fn shared_bytes(d: &AttentionDims, row_tiles: usize, square_tiles: usize, vectors: usize) -> usize {
    let t = tile(d);
    4 * (row_tiles * t * (d.head_dim + 1) + square_tiles * t * (t + 1) + vectors * t)
}

/// Grid `(⌈rows/T⌉, batch, heads)` of `4·T`-thread blocks.
fn config(d: &AttentionDims, rows: usize, shared: usize) -> LaunchConfig {
    let t = tile(d);
    LaunchConfig {
        grid: (rows.div_ceil(t) as u32, d.batch as u32, d.heads as u32),
        block: (4 * t as u32, 1, 1),
        shared_bytes: shared as u32,
    }
}

/// The cpu reference's dimension checks (same fields and messages), plus the kernels' limits.
fn check_dims(op: &'static str, d: &AttentionDims) -> Result<()> {
    if d.kv_len < d.q_len {
        return Err(config_error(
            "attention.kv_len",
            format!(
                "kv_len {} is below q_len {}: keys are a prefix plus the queries' own positions",
                d.kv_len, d.q_len
            ),
        ));
    }
    if d.head_dim == 0 {
        return Err(config_error("attention.head_dim", "must be at least 1 (scores are scaled by 1/√head_dim)"));
    }
    if d.head_dim > MAX_HEAD_DIM {
        return Err(config_error(
            "attention.head_dim",
            format!("{} exceeds {MAX_HEAD_DIM}, the largest the GPU attention kernels support", d.head_dim),
        ));
    }
    if !(0.0..1.0).contains(&d.dropout) {
        return Err(config_error("attention.dropout", format!("{} is not in [0, 1)", d.dropout)));
    }
    if d.mask_seq < d.kv_len {
        return Err(config_error(
            "attention.mask_seq",
            format!("{} is below kv_len {}: the dropout mask spans the whole sequence", d.mask_seq, d.kv_len),
        ));
    }
    for (what, n) in [("batch", d.batch), ("heads", d.heads)] {
        if n > 65535 {
            return Err(config_error(format!("attention.{what}"), format!("{n} exceeds the grid limit of 65535")));
        }
    }
    int(op, "k", d.batch * d.kv_len * d.heads * d.head_dim)?;
    Ok(())
}

/// The kernels' trailing arguments (`MASK_AND_DIMS` in attention.cu): the key mask (null for
/// none), the dimensions, the score scale and the dropout parameters computed as the cpu
/// backend computes them (threshold `p·2⁶⁴`, scale `1/(1−p)`, rounded from f64).
fn mask_and_dims(d: &AttentionDims, key_mask: Option<&GpuIds>) -> [Arg; 12] {
    let (threshold, keep_scale) = if d.dropout > 0.0 {
        (crate::ops::dropout::keep_threshold(d.dropout), (1.0 / (1.0 - d.dropout as f64)) as f32)
    } else {
        (0, 1.0)
    };
    [
        Arg::Ptr(key_mask.map_or(0, GpuIds::ptr)),
        Arg::I32(d.q_len as i32),
        Arg::I32(d.kv_len as i32),
        Arg::I32(d.heads as i32),
        Arg::I32(d.head_dim as i32),
        Arg::I32(d.causal as i32),
        Arg::F32((1.0 / (d.head_dim as f64).sqrt()) as f32),
        Arg::F32(keep_scale),
        Arg::U64(threshold),
        Arg::U64(d.dropout_seed),
        Arg::U64(d.dropout_offset),
        Arg::I32(d.mask_seq as i32),
    ]
}

/// See [`crate::ops::attention::attention_forward`]; `saved` holds [`saved_len`] f32 values
/// (the log-sum-exp of each query row, +∞ for a row that sees no key).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    saved: &mut GpuBuf,
    q: &GpuBuf,
    k: &GpuBuf,
    v: &GpuBuf,
    key_mask: Option<&GpuIds>,
    d: &AttentionDims,
) -> Result<()> {
    const OP: &str = "attention_forward";
    check_dims(OP, d)?;
    let AttentionDims { batch, q_len, kv_len, heads, head_dim, .. } = *d;
    let c = heads * head_dim;
    check_len(OP, "out", out.len(), batch * q_len * c)?;
    check_len(OP, "saved", saved.len(), saved_len(d))?;
    check_len(OP, "q", q.len(), batch * q_len * c)?;
    check_len(OP, "k", k.len(), batch * kv_len * c)?;
    check_len(OP, "v", v.len(), batch * kv_len * c)?;
    if let Some(m) = key_mask {
        check_len(OP, "key_mask", m.len(), batch * kv_len)?;
    }
    let act = dev.act();
    for (name, buf) in [("out", &*out), ("q", q), ("k", k), ("v", v)] {
        check_elem(OP, name, buf, act)?;
    }
    check_elem(OP, "saved", saved, Elem::F32)?;
    if saved_len(d) == 0 {
        return Ok(()); // no query: `out` and `saved` are empty
    }
    let mut args =
        vec![Arg::Ptr(out.ptr()), Arg::Ptr(saved.ptr()), Arg::Ptr(q.ptr()), Arg::Ptr(k.ptr()), Arg::Ptr(v.ptr())];
    args.extend(mask_and_dims(d, key_mask));
    dev.launch(&format!("attention_forward_{}", act.suffix()), config(d, q_len, shared_bytes(d, 3, 1, 1)), &args)
}

/// See [`crate::ops::attention::attention_backward`]: writes `dq`, `dk` and `dv` from `dout`,
/// the forward's `out` and its `saved` log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dev: &GpuDevice,
    dq: &mut GpuBuf,
    dk: &mut GpuBuf,
    dv: &mut GpuBuf,
    dout: &GpuBuf,
    q: &GpuBuf,
    k: &GpuBuf,
    v: &GpuBuf,
    out: &GpuBuf,
    saved: &GpuBuf,
    key_mask: Option<&GpuIds>,
    d: &AttentionDims,
) -> Result<()> {
    const OP: &str = "attention_backward";
    check_dims(OP, d)?;
    let AttentionDims { batch, q_len, kv_len, heads, head_dim, .. } = *d;
    let c = heads * head_dim;
    check_len(OP, "dq", dq.len(), batch * q_len * c)?;
    check_len(OP, "dk", dk.len(), batch * kv_len * c)?;
    check_len(OP, "dv", dv.len(), batch * kv_len * c)?;
    check_len(OP, "dout", dout.len(), batch * q_len * c)?;
    check_len(OP, "q", q.len(), batch * q_len * c)?;
    check_len(OP, "k", k.len(), batch * kv_len * c)?;
    check_len(OP, "v", v.len(), batch * kv_len * c)?;
    check_len(OP, "out", out.len(), batch * q_len * c)?;
    check_len(OP, "saved", saved.len(), saved_len(d))?;
    if let Some(m) = key_mask {
        check_len(OP, "key_mask", m.len(), batch * kv_len)?;
    }
    let act = dev.act();
    for (name, buf) in
        [("dq", &*dq), ("dk", &*dk), ("dv", &*dv), ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)]
    {
        check_elem(OP, name, buf, act)?;
    }
    check_elem(OP, "saved", saved, Elem::F32)?;
    if dk.is_empty() {
        return Ok(()); // no key (hence no query): every gradient is empty
    }
    let sfx = act.suffix();
    let tail = mask_and_dims(d, key_mask);
    // D_i = dout_i·out_i, one per query row: written by the dq kernel, read by the dk/dv kernel.
    let rowdot = dev.alloc_elem(saved_len(d), Elem::F32)?;
    if q_len > 0 {
        let mut args = vec![
            Arg::Ptr(dq.ptr()),
            Arg::Ptr(rowdot.ptr()),
            Arg::Ptr(dout.ptr()),
            Arg::Ptr(out.ptr()),
            Arg::Ptr(q.ptr()),
            Arg::Ptr(k.ptr()),
            Arg::Ptr(v.ptr()),
            Arg::Ptr(saved.ptr()),
        ];
        args.extend(tail);
        dev.launch(&format!("attention_backward_dq_{sfx}"), config(d, q_len, shared_bytes(d, 4, 1, 1)), &args)?;
    }
    // With no query the dk/dv kernel streams nothing and writes zeros, as the cpu backend does.
    let mut args = vec![
        Arg::Ptr(dk.ptr()),
        Arg::Ptr(dv.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::Ptr(q.ptr()),
        Arg::Ptr(k.ptr()),
        Arg::Ptr(v.ptr()),
        Arg::Ptr(saved.ptr()),
        Arg::Ptr(rowdot.ptr()),
    ];
    args.extend(tail);
    dev.launch(&format!("attention_backward_dkdv_{sfx}"), config(d, kv_len, shared_bytes(d, 4, 2, 2)), &args)
}
