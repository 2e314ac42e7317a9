//! Image patch extraction for ViT (im2col with stride = kernel = patch): the patch embedding is
//! this followed by a linear layer whose weight is the PyTorch conv weight
//! `[hidden, channels, patch, patch]` viewed as `[hidden, channels·patch·patch]`.

use crate::error::{Result, check_len, config_error};
use crate::scalar::Float;
use rayon::prelude::*;

/// Elements one rayon task should at least move: below this, spawning costs more than copying.
const MIN_TASK_ELEMS: usize = 16 * 1024;

/// Shape of a batch of images cut into square patches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatchDims {
    /// Images in the batch.
    pub batch: usize,
    /// Colour channels.
    pub channels: usize,
    /// Image height in pixels (a multiple of `patch`).
    pub height: usize,
    /// Image width in pixels (a multiple of `patch`).
    pub width: usize,
    /// Patch side in pixels.
    pub patch: usize,
}

impl PatchDims {
    /// Patches per image, `(height/patch)·(width/patch)`, in row-major patch order.
    pub fn num_patches(&self) -> usize {
        (self.height / self.patch) * (self.width / self.patch)
    }
    /// Elements of one flattened patch, `channels·patch·patch`, ordered (channel, row, column).
    pub fn patch_len(&self) -> usize {
        self.channels * self.patch * self.patch
    }
}

/// `out[b, p, (c, y, x)] = img[b, c, py·patch + y, px·patch + x]`, `img` as `[B, C, H, W]`.
pub fn patch_forward<T: Float>(out: &mut [T], img: &[T], d: PatchDims) -> Result<()> {
    const OP: &str = "patch_forward";
    check_dims(d)?;
    check_len(OP, "img", img.len(), d.batch * d.channels * d.height * d.width)?;
    check_len(OP, "out", out.len(), d.batch * d.num_patches() * d.patch_len())?;
    let (p, np, plen) = (d.patch, d.num_patches(), d.patch_len());
    if plen == 0 || np == 0 {
        return Ok(());
    }
    let patches_x = d.width / p;
    let plane = d.height * d.width;
    // One task per run of output rows (patches): each patch gathers `channels·patch` short
    // pixel rows from the image.
    out.par_chunks_mut(plen).enumerate().with_min_len((MIN_TASK_ELEMS / plen).max(1)).for_each(|(i, o)| {
        let (b, pi) = (i / np, i % np);
        let (py, px) = (pi / patches_x, pi % patches_x);
        for c in 0..d.channels {
            let img_c = &img[(b * d.channels + c) * plane..];
            for y in 0..p {
                let src = (py * p + y) * d.width + px * p;
                let dst = (c * p + y) * p;
                o[dst..dst + p].copy_from_slice(&img_c[src..src + p]);
            }
        }
    });
    Ok(())
}

/// The exact adjoint of [`patch_forward`]: writes `dimg` (col2im; patches do not overlap).
pub fn patch_backward<T: Float>(dimg: &mut [T], dout: &[T], d: PatchDims) -> Result<()> {
    const OP: &str = "patch_backward";
    check_dims(d)?;
    check_len(OP, "dimg", dimg.len(), d.batch * d.channels * d.height * d.width)?;
    check_len(OP, "dout", dout.len(), d.batch * d.num_patches() * d.patch_len())?;
    let (p, np, plen) = (d.patch, d.num_patches(), d.patch_len());
    if dimg.is_empty() {
        return Ok(());
    }
    let patches_x = d.width / p;
    // One task per run of image pixel rows: image row `yy` of channel `c` is scattered from
    // row `yy % patch` of channel `c` of each patch in patch row `yy / patch`.
    dimg.par_chunks_mut(d.width).enumerate().with_min_len((MIN_TASK_ELEMS / d.width).max(1)).for_each(|(i, row)| {
        let yy = i % d.height;
        let bc = i / d.height;
        let (b, c) = (bc / d.channels, bc % d.channels);
        let (py, y) = (yy / p, yy % p);
        for px in 0..patches_x {
            let src = (b * np + py * patches_x + px) * plen + (c * p + y) * p;
            row[px * p..(px + 1) * p].copy_from_slice(&dout[src..src + p]);
        }
    });
    Ok(())
}

/// `out[b, 0, :] = token`, `out[b, 1 + t, :] = inp[b, t, :]`: prepends ViT's class token to
/// each sequence. `inp` is `[batch, seq, dim]`, `out` is `[batch, seq + 1, dim]`.
pub fn prepend_token_forward<T: Float>(
    out: &mut [T],
    token: &[T],
    inp: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "prepend_token_forward";
    check_len(OP, "token", token.len(), dim)?;
    check_len(OP, "inp", inp.len(), batch * seq * dim)?;
    check_len(OP, "out", out.len(), batch * (seq + 1) * dim)?;
    if dim == 0 {
        return Ok(());
    }
    out.par_chunks_mut(dim).enumerate().with_min_len((MIN_TASK_ELEMS / dim).max(1)).for_each(|(i, o)| {
        let (b, t) = (i / (seq + 1), i % (seq + 1));
        if t == 0 {
            o.copy_from_slice(token);
        } else {
            let src = (b * seq + t - 1) * dim;
            o.copy_from_slice(&inp[src..src + dim]);
        }
    });
    Ok(())
}

/// Adds `dtoken += Σ_b dout[b, 0, :]` (fixed order) and, when asked, writes
/// `dinp[b, t, :] = dout[b, 1 + t, :]`.
pub fn prepend_token_backward<T: Float>(
    dtoken: &mut [T],
    dinp: Option<&mut [T]>,
    dout: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "prepend_token_backward";
    check_len(OP, "dtoken", dtoken.len(), dim)?;
    check_len(OP, "dout", dout.len(), batch * (seq + 1) * dim)?;
    if let Some(dinp) = &dinp {
        check_len(OP, "dinp", dinp.len(), batch * seq * dim)?;
    }
    if dim == 0 {
        return Ok(());
    }
    // `batch` rows of `dim`: too little work to split, and summing in b order is what makes
    // the result independent of the thread count.
    for b in 0..batch {
        let src = &dout[b * (seq + 1) * dim..][..dim];
        for (t, &g) in dtoken.iter_mut().zip(src) {
            *t += g;
        }
    }
    if let Some(dinp) = dinp {
        let seq_len = seq * dim;
        if seq_len > 0 {
            dinp.par_chunks_mut(seq_len).enumerate().for_each(|(b, di)| {
                let src = (b * (seq + 1) + 1) * dim;
                di.copy_from_slice(&dout[src..src + seq_len]);
            });
        }
    }
    Ok(())
}

/// Patches must tile the image exactly: a zero patch or a ragged edge is a configuration error.
pub(crate) fn check_dims(d: PatchDims) -> Result<()> {
    if d.patch == 0 || !d.height.is_multiple_of(d.patch) || !d.width.is_multiple_of(d.patch) {
        return Err(config_error(
            "patch_size",
            format!(
                "a {}×{} image cannot be cut into {}×{} patches; height and width must be multiples of a positive patch size",
                d.height, d.width, d.patch, d.patch
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    const D: PatchDims = PatchDims { batch: 3, channels: 3, height: 6, width: 9, patch: 3 };

    fn img_len(d: PatchDims) -> usize {
        d.batch * d.channels * d.height * d.width
    }

    /// Naive gather written from the definition, in the output's index order.
    fn reference(img: &[f64], d: PatchDims) -> Vec<f64> {
        let (p, gx) = (d.patch, d.width / d.patch);
        let mut out = Vec::new();
        for b in 0..d.batch {
            for pi in 0..d.num_patches() {
                for c in 0..d.channels {
                    for y in 0..p {
                        for x in 0..p {
                            let (yy, xx) = ((pi / gx) * p + y, (pi % gx) * p + x);
                            out.push(img[((b * d.channels + c) * d.height + yy) * d.width + xx]);
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn patch_forward_matches_reference() {
        let mut rng = Rng::new(31);
        for d in [D, PatchDims { batch: 2, channels: 1, height: 4, width: 8, patch: 4 }] {
            let img = rng.vec(img_len(d), 1.0);
            let mut out = vec![0.0; d.batch * d.num_patches() * d.patch_len()];
            patch_forward(&mut out, &img, d).unwrap();
            assert_eq!(rel_err(&out, &reference(&img, d)), 0.0);
        }
    }

    #[test]
    fn patch_backward_matches_finite_differences() {
        let mut rng = Rng::new(32);
        let mut img = rng.vec(img_len(D), 1.0);
        let n_out = D.batch * D.num_patches() * D.patch_len();
        let r = rng.vec(n_out, 1.0);
        let mut dimg = vec![5.0; img_len(D)];
        patch_backward(&mut dimg, &r, D).unwrap();
        let numeric = numeric_gradient(&mut img, FD_STEP, |x| {
            let mut out = vec![0.0; n_out];
            patch_forward(&mut out, x, D).unwrap();
            dot(&out, &r)
        });
        assert_grad("dimg", &dimg, &numeric);
    }

    #[test]
    fn prepend_token_forward_matches_reference() {
        let mut rng = Rng::new(33);
        let (batch, seq, dim) = (3, 13, 5);
        let token = rng.vec(dim, 1.0);
        let inp = rng.vec(batch * seq * dim, 1.0);
        let mut out = vec![0.0; batch * (seq + 1) * dim];
        prepend_token_forward(&mut out, &token, &inp, batch, seq, dim).unwrap();
        let mut want = Vec::new();
        for b in 0..batch {
            want.extend_from_slice(&token);
            want.extend_from_slice(&inp[b * seq * dim..(b + 1) * seq * dim]);
        }
        assert_eq!(rel_err(&out, &want), 0.0);
    }

    #[test]
    fn prepend_token_backward_matches_finite_differences() {
        let mut rng = Rng::new(34);
        let (batch, seq, dim) = (3, 13, 5);
        let mut token = rng.vec(dim, 1.0);
        let mut inp = rng.vec(batch * seq * dim, 1.0);
        let r = rng.vec(batch * (seq + 1) * dim, 1.0);
        let t0 = -1.5;
        let mut dtoken = vec![t0; dim];
        let mut dinp = vec![3.0; batch * seq * dim];
        prepend_token_backward(&mut dtoken, Some(&mut dinp), &r, batch, seq, dim).unwrap();
        let dtoken: Vec<f64> = dtoken.iter().map(|x| x - t0).collect();
        let loss = |token: &[f64], inp: &[f64]| {
            let mut out = vec![0.0; batch * (seq + 1) * dim];
            prepend_token_forward(&mut out, token, inp, batch, seq, dim).unwrap();
            dot(&out, &r)
        };
        let i_ = inp.clone();
        assert_grad("dtoken", &dtoken, &numeric_gradient(&mut token, FD_STEP, |t| loss(t, &i_)));
        let t_ = token.clone();
        assert_grad("dinp", &dinp, &numeric_gradient(&mut inp, FD_STEP, |x| loss(&t_, x)));
    }

    #[test]
    fn prepend_token_backward_accumulates_dtoken() {
        let mut rng = Rng::new(35);
        let (batch, seq, dim) = (3, 13, 7);
        let dout = rng.vec(batch * (seq + 1) * dim, 1.0);
        let mut dtoken = vec![1.0; dim];
        prepend_token_backward(&mut dtoken, None, &dout, batch, seq, dim).unwrap();
        let once = dtoken.clone();
        prepend_token_backward(&mut dtoken, None, &dout, batch, seq, dim).unwrap();
        let want: Vec<f64> = once.iter().map(|x| 1.0 + 2.0 * (x - 1.0)).collect();
        assert!(rel_err(&dtoken, &want) < 1e-14);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let img = vec![0.0f64; img_len(D)];
        let mut out = vec![0.0; D.batch * D.num_patches() * D.patch_len() - 1];
        let e = patch_forward(&mut out, &img, D).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "out", .. }), "{e}");
        assert!(e.to_string().contains("`out` has 485 elements, expected 486"), "{e}");
        let mut dimg = vec![0.0; img_len(D)];
        let e = patch_backward(&mut dimg, &out, D).unwrap_err();
        assert!(e.to_string().contains("`dout`"), "{e}");
        let ragged = PatchDims { width: 10, ..D };
        let e = patch_forward(&mut out, &img, ragged).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        let (mut out, mut dtoken) = (vec![0.0; 3 * 14 * 5], vec![0.0; 4]);
        let e = prepend_token_forward(&mut out, &dtoken, &[0.0; 3 * 13 * 5], 3, 13, 5).unwrap_err();
        assert!(e.to_string().contains("`token`"), "{e}");
        let mut dinp = vec![0.0; 3 * 13 * 5 + 1];
        dtoken.push(0.0);
        let e = prepend_token_backward(&mut dtoken, Some(&mut dinp), &out, 3, 13, 5).unwrap_err();
        assert!(e.to_string().contains("`dinp`"), "{e}");
    }
}
