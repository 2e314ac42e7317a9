//! Kernel tests: `kernels/loss.cu` against the cpu backend.

use crate::elementwise::{PRECISIONS, act_data, compare};
use crate::harness::{self, act, host, rand};
use pipetransformer::device::Device;

/// The label that marks a row without a target.
const IGNORE: u32 = u32::MAX;

/// `(rows, vocab)`: one logit, a classifier, sizes past a block, a wide vocabulary.
const SHAPES: [(usize, usize); 5] = [(1, 1), (13, 2), (13, 13), (5, 385), (3, 3000)];

/// Losses, the fused gradient (with grad_scale = 1/count, as the trainer passes it) and the
/// count of real targets; every third row is ignored. Without `dlogits` only the losses.
#[test]
fn cross_entropy_matches_cpu() {
    for precision in PRECISIONS {
        for (s, &(rows, vocab)) in SHAPES.iter().enumerate() {
            let seed = 10 * s as u64;
            let logits = act_data(precision, rand(seed, rows * vocab, 6.0));
            let targets: Vec<u32> =
                (0..rows).map(|r| if r % 3 == 2 { IGNORE } else { (r * 7 + s) as u32 % vocab as u32 }).collect();
            let count = targets.iter().filter(|&&t| t != IGNORE).count();
            let scale = 1.0 / count as f64;
            for with_grad in [true, false] {
                compare!(format!("cross_entropy {rows}x{vocab} grad {with_grad}"), precision, |dev| {
                    let (logits, targets) = (act(dev, &logits), dev.upload_ids(&targets).unwrap());
                    let mut losses = dev.alloc_stats(rows).unwrap();
                    let mut dlogits = with_grad.then(|| dev.alloc(rows * vocab).unwrap());
                    let counted = dev
                        .cross_entropy_forward_backward(
                            &mut losses,
                            dlogits.as_mut(),
                            &logits,
                            &targets,
                            rows,
                            vocab,
                            IGNORE,
                            scale,
                        )
                        .unwrap();
                    assert_eq!(counted, count, "count of real targets");
                    let mut outputs = vec![("losses", host(dev, &losses))];
                    outputs.extend(dlogits.map(|d| ("dlogits", host(dev, &d))));
                    outputs
                });
            }
        }
    }
}

/// No classes at all: every row must be ignored; the losses are zeros.
#[test]
fn cross_entropy_without_classes_matches_cpu() {
    for precision in PRECISIONS {
        compare!(format!("cross_entropy 4x0"), precision, |dev| {
            let (logits, targets) = (dev.alloc(0).unwrap(), dev.upload_ids(&[IGNORE; 4]).unwrap());
            let mut losses = dev.alloc_stats(4).unwrap();
            let mut dlogits = dev.alloc(0).unwrap();
            let n = dev.cross_entropy_forward_backward(
                &mut losses,
                Some(&mut dlogits),
                &logits,
                &targets,
                4,
                0,
                IGNORE,
                1.0,
            );
            assert_eq!(n.unwrap(), 0);
            vec![("losses", host(dev, &losses))]
        });
    }
}

/// Bad calls, and the cpu's error message for each.
fn bad_calls<D: Device>(dev: &D) -> Vec<String> {
    let (logits, targets) = (dev.alloc(12).unwrap(), dev.upload_ids(&[0, IGNORE, 4]).unwrap());
    let (mut losses, mut dlogits) = (dev.alloc_stats(3).unwrap(), dev.alloc(11).unwrap());
    let results = [
        dev.cross_entropy_forward_backward(&mut losses, None, &logits, &targets, 3, 4, IGNORE, 1.0),
        dev.cross_entropy_forward_backward(&mut losses, Some(&mut dlogits), &logits, &targets, 3, 4, IGNORE, 1.0),
        dev.cross_entropy_forward_backward(&mut losses, None, &logits, &targets, 4, 3, IGNORE, 1.0),
    ];
    results.into_iter().map(|r| r.expect_err("a bad call must fail").to_string()).collect()
}

/// Out-of-range labels and wrong lengths fail with the cpu's errors.
#[test]
fn bad_calls_fail_as_on_cpu() {
    let want = bad_calls(&harness::cpu());
    for precision in PRECISIONS {
        for dev in harness::devices(precision) {
            assert_eq!(bad_calls(&dev), want, "{}", dev.name());
        }
    }
}
