//! Softmax cross-entropy fused with its gradient (llm.c's fused classifier): one pass per row
//! computes the loss and writes `dlogits`, so probabilities are never stored.

use crate::error::{Result, check_len, data_error};
use crate::scalar::Float;
use rayon::prelude::*;

/// Rows per rayon task: about this many logits, so a small-vocabulary classifier head does not
/// pay a task per row (an LM head's rows are far larger than this anyway).
const TASK_ELEMS: usize = 4096;

/// Loss (and, with `dlogits`, gradient) of one non-ignored row, `vocab ≥ 1`, `target < vocab`.
///
/// `log Σ exp` is taken after subtracting the row max, so no `exp` overflows; the sum is
/// accumulated sequentially in f64, so a 30k-entry vocabulary loses no precision in f32 and the
/// result does not depend on the thread count. With `dlogits`, the exponentials are parked in it
/// on the first pass and scaled on the second, so each logit is exponentiated once.
#[inline]
fn row_loss<T: Float>(logits: &[T], target: usize, dlogits: Option<&mut [T]>, grad_scale: f64) -> T {
    let max = logits.iter().fold(logits[0], |m, &x| m.max(x));
    let mut sum = 0.0f64;
    match dlogits {
        Some(dl) => {
            for (d, &x) in dl.iter_mut().zip(logits) {
                let e = (x - max).exp();
                *d = e;
                sum += e.to_f64();
            }
            // dlogits = (softmax − onehot)·grad_scale; the target entry is formed in f64 so
            // p − 1 does not cancel in T.
            let e_target = dl[target].to_f64();
            let scale = T::from_f64(grad_scale / sum);
            for d in dl.iter_mut() {
                *d *= scale;
            }
            dl[target] = T::from_f64((e_target / sum - 1.0) * grad_scale);
        }
        None => {
            for &x in logits {
                sum += (x - max).exp().to_f64();
            }
        }
    }
    // −log softmax[target] = max + log Σ exp(x − max) − x[target].
    T::from_f64(max.to_f64() + sum.ln() - logits[target].to_f64())
}

/// For each of `rows` rows of `vocab` logits: `losses[r] = −log softmax(logits[r])[targets[r]]`
/// (0 where `targets[r] == ignore_index`), and, when `dlogits` is given,
/// `dlogits[r] = (softmax(logits[r]) − onehot(targets[r]))·grad_scale` (a zero row where
/// ignored). Returns how many rows were not ignored. A target `≥ vocab` other than
/// `ignore_index` is an `Error::Data` naming the row, the label and the valid range.
///
/// `grad_scale` is chosen by the caller (`1/count` of the whole global batch), so a batch split
/// into micro-batches gets exactly the gradient of the unsplit batch.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_backward<T: Float>(
    losses: &mut [T],
    dlogits: Option<&mut [T]>,
    logits: &[T],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    ignore_index: u32,
    grad_scale: f64,
) -> Result<usize> {
    const OP: &str = "cross_entropy";
    check_len(OP, "losses", losses.len(), rows)?;
    check_len(OP, "targets", targets.len(), rows)?;
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    if let Some(dl) = dlogits.as_deref() {
        check_len(OP, "dlogits", dl.len(), rows * vocab)?;
    }
    let count = count_targets(targets, vocab, ignore_index)?;
    if vocab == 0 {
        // Every row is ignored (validated above); no logits, so no gradient to write.
        losses.fill(T::ZERO);
        return Ok(count);
    }

    let min_rows = (TASK_ELEMS / vocab).max(1);
    let rows_in = losses.par_iter_mut().zip(logits.par_chunks(vocab)).zip(targets.par_iter());
    match dlogits {
        Some(dl) => {
            rows_in.zip(dl.par_chunks_mut(vocab)).with_min_len(min_rows).for_each(|(((loss, logits), &t), dl)| {
                if t == ignore_index {
                    *loss = T::ZERO;
                    dl.fill(T::ZERO);
                } else {
                    *loss = row_loss(logits, t as usize, Some(dl), grad_scale);
                }
            })
        }
        None => rows_in.with_min_len(min_rows).for_each(|((loss, logits), &t)| {
            *loss = if t == ignore_index { T::ZERO } else { row_loss(logits, t as usize, None, grad_scale) };
        }),
    }
    Ok(count)
}

/// Validates every label, in order, before anything is written, so a bad batch reports its first
/// bad row and leaves no half-written gradient behind; returns how many rows count.
pub(crate) fn count_targets(targets: &[u32], vocab: usize, ignore_index: u32) -> Result<usize> {
    let mut count = 0;
    for (r, &t) in targets.iter().enumerate() {
        if t == ignore_index {
            continue;
        }
        if t as usize >= vocab {
            return Err(data_error(
                "labels",
                format!("row {r}: label {t} is out of range; expected 0..{vocab} or the ignore index {ignore_index}"),
            ));
        }
        count += 1;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, numeric_gradient, rel_err};

    const IGNORE: u32 = u32::MAX;

    /// Random targets with every fourth row ignored.
    fn targets(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<u32> {
        (0..rows).map(|r| if r % 4 == 1 { IGNORE } else { rng.below(vocab as u64) as u32 }).collect()
    }

    fn losses(logits: &[f64], t: &[u32], vocab: usize) -> Vec<f64> {
        let mut l = vec![0.0; t.len()];
        cross_entropy_forward_backward(&mut l, None, logits, t, t.len(), vocab, IGNORE, 1.0).unwrap();
        l
    }

    #[test]
    fn dlogits_match_finite_differences() {
        for vocab in [7, 15] {
            let rows = 3 * 13;
            let mut rng = Rng::new(vocab as u64);
            let mut x = rng.vec(rows * vocab, 3.0);
            let t = targets(&mut rng, rows, vocab);
            let grad_scale = 1.0 / 29.0; // as if these rows were part of a larger batch
            let mut l = vec![0.0; rows];
            let mut dl = vec![f64::NAN; rows * vocab]; // every entry must be written
            let count =
                cross_entropy_forward_backward(&mut l, Some(&mut dl), &x, &t, rows, vocab, IGNORE, grad_scale).unwrap();
            assert_eq!(count, t.iter().filter(|&&t| t != IGNORE).count());
            let numeric = numeric_gradient(&mut x, FD_STEP, |x| losses(x, &t, vocab).iter().sum::<f64>() * grad_scale);
            assert_grad("cross entropy dlogits", &dl, &numeric);
        }
    }

    #[test]
    fn loss_matches_log_softmax_and_ignored_rows_are_zero() {
        let (rows, vocab) = (39, 15);
        let mut rng = Rng::new(6);
        let mut x = rng.vec(rows * vocab, 4.0);
        let mut t = targets(&mut rng, rows, vocab);
        x[3] = 800.0; // exp would overflow without the max subtraction
        t[0] = 3; // (and the direct reference below stays finite)
        let mut l = vec![0.0; rows];
        let mut dl = vec![0.0; rows * vocab];
        cross_entropy_forward_backward(&mut l, Some(&mut dl), &x, &t, rows, vocab, IGNORE, 1.0).unwrap();
        let mut want = vec![0.0; rows];
        for r in 0..rows {
            if t[r] == IGNORE {
                assert!(dl[r * vocab..(r + 1) * vocab].iter().all(|&g| g == 0.0), "ignored row {r} has a gradient");
                continue;
            }
            let row = &x[r * vocab..(r + 1) * vocab];
            let m = row.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
            want[r] = -((row[t[r] as usize] - m).exp() / z).ln();
        }
        assert!(rel_err(&l, &want) < 1e-13, "rel err {:.2e}", rel_err(&l, &want));
        assert_eq!(l, losses(&x, &t, vocab), "eval (no dlogits) gives the same losses");
        // Each gradient row of a non-ignored row sums to zero (softmax sums to one).
        for r in (0..rows).filter(|&r| t[r] != IGNORE) {
            assert!(dl[r * vocab..(r + 1) * vocab].iter().sum::<f64>().abs() < 1e-12);
        }
    }

    #[test]
    fn f32_matches_f64() {
        let (rows, vocab) = (40, 30_522);
        let mut rng = Rng::new(12);
        let x32: Vec<f32> = rng.vec(rows * vocab, 10.0).iter().map(|&v| v as f32).collect();
        let x64: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let t = targets(&mut rng, rows, vocab);
        let mut l32 = vec![0.0f32; rows];
        let mut dl32 = vec![0.0f32; rows * vocab];
        cross_entropy_forward_backward(&mut l32, Some(&mut dl32), &x32, &t, rows, vocab, IGNORE, 0.5).unwrap();
        let mut l64 = vec![0.0f64; rows];
        let mut dl64 = vec![0.0f64; rows * vocab];
        cross_entropy_forward_backward(&mut l64, Some(&mut dl64), &x64, &t, rows, vocab, IGNORE, 0.5).unwrap();
        let e = rel_err(&l32, &l64);
        assert!(e < 1e-5, "loss f32 vs f64 rel err {e:.2e}");
        let e = rel_err(&dl32, &dl64);
        assert!(e < 1e-5, "dlogits f32 vs f64 rel err {e:.2e}");
    }

    #[test]
    fn one_and_two_threads_are_bitwise_equal() {
        let (rows, vocab) = (64, 1_001);
        let mut rng = Rng::new(13);
        let x: Vec<f32> = rng.vec(rows * vocab, 5.0).iter().map(|&v| v as f32).collect();
        let t = targets(&mut rng, rows, vocab);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut l = vec![0.0f32; rows];
                let mut dl = vec![0.0f32; rows * vocab];
                cross_entropy_forward_backward(&mut l, Some(&mut dl), &x, &t, rows, vocab, IGNORE, 0.25).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&l), bits(&dl))
            })
        };
        assert!(run(1) == run(2), "cross entropy differs between 1 and 2 threads");
    }

    #[test]
    fn out_of_range_label_is_a_data_error() {
        let x = vec![0.0f64; 3 * 4];
        let mut l = vec![0.0; 3];
        let err = cross_entropy_forward_backward(&mut l, None, &x, &[0, 4, 9], 3, 4, IGNORE, 1.0).unwrap_err();
        assert!(matches!(&err, Error::Data { what, .. } if what == "labels"), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("row 1") && msg.contains("label 4") && msg.contains("0..4"), "{msg}");
        // The ignore index itself is fine even though it is ≥ vocab.
        let n = cross_entropy_forward_backward(&mut l, None, &x, &[0, IGNORE, 3], 3, 4, IGNORE, 1.0).unwrap();
        assert_eq!(n, 2);
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let x = vec![0.0f64; 3 * 4];
        let t = [0u32, 1, 2];
        let mut l = vec![0.0; 3];
        let mut dl = [0.0; 3 * 4];
        let err = cross_entropy_forward_backward(&mut l[..2], None, &x, &t, 3, 4, IGNORE, 1.0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "losses", got: 2, expected: 3, .. }), "{err}");
        assert!(err.to_string().contains("`losses`"), "{err}");
        let err = cross_entropy_forward_backward(&mut l, None, &x, &t[..2], 3, 4, IGNORE, 1.0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "targets", .. }), "{err}");
        let err = cross_entropy_forward_backward(&mut l, None, &x[1..], &t, 3, 4, IGNORE, 1.0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "logits", .. }), "{err}");
        let err = cross_entropy_forward_backward(&mut l, Some(&mut dl[1..]), &x, &t, 3, 4, IGNORE, 1.0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dlogits", .. }), "{err}");
        assert!(err.to_string().contains("`dlogits`"), "{err}");
    }
}
