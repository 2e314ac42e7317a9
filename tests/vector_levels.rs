//! The element-wise kernels give the same bits at every vector level (`ops::simd`): AVX-512,
//! AVX2 + FMA and the x86-64 baseline. A loop that the wider copy computed differently (a fused
//! multiply-add, a reordered sum, another `exp`) would change a result here. Its own test
//! binary: capping the level is process-wide.

use pipetransformer::ops::attention::{AttentionDims, attention_backward, attention_forward};
use pipetransformer::ops::dropout::{DropoutCoords, dropout_forward};
use pipetransformer::ops::gelu::{Activation, gelu_backward, gelu_forward};
use pipetransformer::ops::gemm_bf16::{matmul_bf16_fallback, round_to_bf16};
use pipetransformer::ops::layernorm::{layernorm_backward, layernorm_forward};
use pipetransformer::ops::linear::linear_backward;
use pipetransformer::ops::matmul::MatRef;
use pipetransformer::ops::optim::{AdamWStep, CHUNK, adamw_update, scale_inplace, sum_squares};
use pipetransformer::ops::residual::{residual_backward, residual_forward};
use pipetransformer::ops::simd::{VectorLevel, cap_vector_level};
use pipetransformer::rng::Rng;

fn random(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    rng.vec(n, scale).iter().map(|&x| x as f32).collect()
}

/// Every output of every wrapped kernel, as bits, on fixed inputs.
fn outputs() -> Vec<(&'static str, Vec<u32>)> {
    let mut rng = Rng::new(42);
    let mut out = Vec::new();
    // Inputs spanning GELU's whole range, erf's clamp at ±4 and the tanh form's floor.
    let x = random(&mut rng, 10_007, 12.0);
    let dy = random(&mut rng, x.len(), 1.0);
    for (name, kind) in [("gelu_erf", Activation::GeluErf), ("gelu_tanh", Activation::GeluTanh)] {
        let mut y = vec![0.0f32; x.len()];
        gelu_forward(&mut y, &x, kind).unwrap();
        out.push((name, y.iter().map(|v| v.to_bits()).collect()));
        gelu_backward(&mut y, &x, &dy, kind).unwrap();
        out.push((name, y.iter().map(|v| v.to_bits()).collect()));
    }
    // Dropout over rows with a stride, as a token slice draws its mask.
    let mut y = vec![0.0f32; x.len()];
    dropout_forward(&mut y, &x, 0.3, DropoutCoords { seed: 9, offset: 17, row: 37, stride: 50 }).unwrap();
    out.push(("dropout", y.iter().map(|v| v.to_bits()).collect()));
    // Attention with a padding mask, causal prefix and dropout: softmax's exp, the mask's hash.
    let d = AttentionDims {
        batch: 2,
        q_len: 19,
        kv_len: 23,
        heads: 3,
        head_dim: 8,
        causal: true,
        dropout: 0.2,
        dropout_seed: 5,
        dropout_offset: 100,
        mask_seq: 23,
    };
    let c = d.heads * d.head_dim;
    let (q, k, v) =
        (random(&mut rng, 2 * 19 * c, 3.0), random(&mut rng, 2 * 23 * c, 3.0), random(&mut rng, 2 * 23 * c, 1.0));
    let mask: Vec<u32> = (0..2 * 23).map(|i| u32::from(i % 23 < 20)).collect();
    let mut o = vec![0.0f32; q.len()];
    let mut probs = vec![0.0f32; 2 * 3 * 19 * 23];
    attention_forward(&mut o, &mut probs, &q, &k, &v, Some(&mask), &d).unwrap();
    out.push(("attention out", o.iter().map(|v| v.to_bits()).collect()));
    out.push(("attention probs", probs.iter().map(|v| v.to_bits()).collect()));
    let dout = random(&mut rng, o.len(), 1.0);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; q.len()], vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
    attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &probs, Some(&mask), &d).unwrap();
    for (name, g) in [("attention dq", dq), ("attention dk", dk), ("attention dv", dv)] {
        out.push((name, g.iter().map(|v| v.to_bits()).collect()));
    }
    // AdamW: f32 arithmetic, sqrt and division.
    let mut p = random(&mut rng, 5_003, 1.0);
    let g = random(&mut rng, p.len(), 1e-2);
    let (mut m, mut vv) = (random(&mut rng, p.len(), 1e-3), random(&mut rng, p.len(), 1e-6));
    vv.iter_mut().for_each(|x| *x = x.abs());
    let h = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 7, grad_scale: 1.0 };
    adamw_update(&mut p, &g, &mut m, &mut vv, &h).unwrap();
    for (name, t) in [("adamw p", p), ("adamw m", m), ("adamw v", vv)] {
        out.push((name, t.iter().map(|v| v.to_bits()).collect()));
    }
    // Clipping's sum of squares (f64 lanes) over more than one chunk and a ragged tail.
    let big = random(&mut rng, 2 * CHUNK + 13, 3.0);
    out.push(("sum_squares", sum_squares(&big).to_bits().to_le_bytes().chunks(4).map(bits).collect()));
    let mut scaled = big.clone();
    scale_inplace(&mut scaled, 0.37);
    out.push(("scale_inplace", scaled.iter().map(|v| v.to_bits()).collect()));
    // LayerNorm on rows wider than the lanes with a ragged tail, forward and backward.
    let (rows, dim) = (37, 389);
    let (x, w, b) = (random(&mut rng, rows * dim, 4.0), random(&mut rng, dim, 1.0), random(&mut rng, dim, 1.0));
    let (mut y, mut mean, mut rstd) = (vec![0.0f32; x.len()], vec![0.0f32; rows], vec![0.0f32; rows]);
    layernorm_forward(&mut y, &mut mean, &mut rstd, &x, &w, &b, rows, dim, 1e-12).unwrap();
    let dy = random(&mut rng, x.len(), 1.0);
    let (mut dx, mut dw, mut db) = (vec![0.0f32; x.len()], vec![0.5f32; dim], vec![0.25f32; dim]);
    layernorm_backward(&mut dx, &mut dw, &mut db, &dy, &x, &w, &mean, &rstd, rows, dim).unwrap();
    for (name, t) in [("layernorm y", y), ("layernorm dx", dx), ("layernorm dw", dw), ("layernorm db", db)] {
        out.push((name, t.iter().map(|v| v.to_bits()).collect()));
    }
    // Residual add and its backward; a linear layer's bias gradient.
    let (a, c) = (random(&mut rng, CHUNK + 7, 1.0), random(&mut rng, CHUNK + 7, 1.0));
    let mut sum = vec![0.0f32; a.len()];
    residual_forward(&mut sum, &a, &c).unwrap();
    residual_backward(&mut sum, &c).unwrap();
    out.push(("residual", sum.iter().map(|v| v.to_bits()).collect()));
    let (in_dim, out_dim, rows) = (5, 83, 29);
    let (inp, weight, dout) = (
        random(&mut rng, rows * in_dim, 1.0),
        random(&mut rng, out_dim * in_dim, 1.0),
        random(&mut rng, rows * out_dim, 1.0),
    );
    let mut dbias = vec![0.125f32; out_dim];
    linear_backward(None, None, Some(&mut dbias), &dout, &inp, &weight, rows, in_dim, out_dim).unwrap();
    out.push(("linear dbias", dbias.iter().map(|v| v.to_bits()).collect()));
    // The bf16 fallback's rounding pass (lines of 23: the vector body and a tail), read back
    // through a product with the identity, which adds exact zeros to each rounded value.
    let (m, k) = (435, 23);
    let mut a = random(&mut rng, m * k, 12.0);
    // Ties to even both ways, just past a tie, subnormals, the largest bf16 (nothing that
    // rounds to infinity: its products with the identity's zeros would be NaN).
    let edges = [0x3f80_8000u32, 0x3f81_8000, 0x3f80_8001, 0x0000_8000, 0x0001_8000, 0x807f_ffff, 0x7f7f_0000];
    a.iter_mut().step_by(97).zip(edges).for_each(|(x, e)| *x = f32::from_bits(e));
    let eye: Vec<f32> = (0..k * k).map(|i| f32::from(i % (k + 1) == 0)).collect();
    let mut rounded = vec![0.0f32; m * k];
    matmul_bf16_fallback(&mut rounded, k, MatRef::rows(&a, k), MatRef::rows(&eye, k), m, k, k, false);
    let read_back = rounded.iter().zip(&a).all(|(r, &x)| r.to_bits() == round_to_bf16(x).to_bits());
    assert!(read_back, "the product with the identity is not the rounded operand");
    out.push(("bf16 fallback rounding", rounded.iter().map(|v| v.to_bits()).collect()));
    out
}

/// Four bytes as one word, for outputs that are not f32.
fn bits(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[test]
fn every_vector_level_gives_the_same_bits() {
    let widest = VectorLevel::detect();
    let reference = {
        assert_eq!(cap_vector_level(VectorLevel::Baseline), VectorLevel::Baseline);
        outputs()
    };
    for level in [VectorLevel::Avx2, VectorLevel::Avx512] {
        if level > widest {
            eprintln!("{level:?}: not on this CPU, not compared");
            continue;
        }
        assert_eq!(cap_vector_level(level), level);
        for ((name, want), (_, got)) in reference.iter().zip(outputs()) {
            let differing = want.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(
                differing,
                0,
                "{name}: {differing} of {} elements differ between {level:?} and the baseline",
                want.len()
            );
        }
    }
}
