//! Global-norm gradient clipping, as `torch.nn.utils.clip_grad_norm_` does it: one norm over all
//! trainable gradients, and one scale factor applied to all of them.

use crate::device::Device;
use crate::error::{Result, config_error};
use crate::model::Param;
use std::borrow::{Borrow, BorrowMut};

/// Added to the norm before dividing, as PyTorch does, so an all-zero gradient is never divided
/// by zero.
const CLIP_EPS: f64 = 1e-6;

/// `Σ ‖grad‖²` over the parameters that have a gradient, added in parameter order from
/// [`Device::sum_squares`] (so the result is deterministic). A pipeline adds these per unit and
/// per device to get the global norm of a model spread over devices.
pub fn grad_sum_squares<D: Device, P: Borrow<Param<D>>>(dev: &D, params: &[P]) -> Result<f64> {
    let mut total = 0.0f64;
    for grad in params.iter().filter_map(|p| p.borrow().grad.as_ref()) {
        total += dev.sum_squares(grad)?;
    }
    Ok(total)
}

/// `sqrt(Σ ‖grad‖²)` over the parameters that have a gradient.
pub fn global_grad_norm<D: Device, P: Borrow<Param<D>>>(dev: &D, params: &[P]) -> Result<f64> {
    Ok(grad_sum_squares(dev, params)?.sqrt())
}

/// The factor that brings gradients of global norm `norm` down to `max_norm`: `max_norm /
/// (norm + 1e-6)` when that is below 1, `None` when no clipping is due. A non-finite norm (an
/// overflow or NaN somewhere) is never clipped — scaling would only turn every gradient into
/// NaN — and the caller should skip the step. Errors unless `max_norm` is finite and > 0.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Result<Option<f64>> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(config_error("max_grad_norm", format!("must be finite and > 0, got {max_norm}")));
    }
    let coef = max_norm / (norm + CLIP_EPS);
    Ok((norm.is_finite() && coef < 1.0).then_some(coef))
}

/// Multiplies every gradient by `coef`.
pub fn scale_grads<D: Device, P: BorrowMut<Param<D>>>(dev: &D, params: &mut [P], coef: f64) -> Result<()> {
    for grad in params.iter_mut().filter_map(|p| p.borrow_mut().grad.as_mut()) {
        dev.scale(grad, coef)?;
    }
    Ok(())
}

/// Scales every gradient so their global norm is at most `max_norm` (see [`clip_coefficient`])
/// and returns the norm before clipping.
pub fn clip_grad_norm<D: Device, P: BorrowMut<Param<D>>>(dev: &D, params: &mut [P], max_norm: f64) -> Result<f64> {
    clip_coefficient(0.0, max_norm)?;
    let norm = global_grad_norm(dev, params)?;
    if let Some(coef) = clip_coefficient(norm, max_norm)? {
        scale_grads(dev, params, coef)?;
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::testing::Rng;

    type Dev = CpuDevice<f64>;

    /// Three parameters with random gradients, the middle one frozen.
    fn params(dev: &Dev, grad_scale: f64) -> Vec<Param<Dev>> {
        let mut rng = Rng::new(7);
        ["a", "frozen", "b"]
            .iter()
            .zip([5usize, 4, 300])
            .map(|(name, n)| {
                let mut p = Param::new(dev, *name, &[n], &vec![0.5; n], true).unwrap();
                if *name == "frozen" {
                    p.set_trainable(dev, false).unwrap();
                } else {
                    p.grad = Some(dev.upload_f64(&rng.vec(n, grad_scale)).unwrap());
                }
                p
            })
            .collect()
    }

    /// `sqrt(Σ g²)` over the trainable gradients, straight from the host values.
    fn direct_norm(dev: &Dev, params: &[Param<Dev>]) -> f64 {
        let sq: f64 = params
            .iter()
            .filter_map(|p| p.grad.as_ref())
            .flat_map(|g| dev.download_f64(g).unwrap())
            .map(|x| x * x)
            .sum();
        sq.sqrt()
    }

    #[test]
    fn norm_is_the_root_of_the_sum_of_squares() {
        let dev = Dev::new(0, 1).unwrap();
        let ps = params(&dev, 1.0);
        let norm = global_grad_norm(&dev, &ps).unwrap();
        let want = direct_norm(&dev, &ps);
        assert!((norm - want).abs() <= 1e-12 * want, "{norm} vs {want}");
    }

    #[test]
    fn clipping_scales_the_norm_down_to_max_norm() {
        let dev = Dev::new(0, 1).unwrap();
        let mut ps = params(&dev, 1.0);
        let before = direct_norm(&dev, &ps);
        let max_norm = 0.5;
        let returned = clip_grad_norm(&dev, &mut ps, max_norm).unwrap();
        assert!((returned - before).abs() <= 1e-12 * before, "returns the pre-clip norm");
        let after = direct_norm(&dev, &ps);
        // PyTorch's 1e-6 in the denominator leaves the norm at max_norm·norm/(norm + 1e-6),
        // a relative 1e-6/norm under max_norm (here norm ≈ 5.8).
        assert!((after - max_norm * before / (before + 1e-6)).abs() <= 1e-12, "{after}");
        assert!((after - max_norm).abs() <= max_norm * 1e-6 / before + 1e-12, "{after}");
        assert!(ps[1].grad.is_none(), "frozen parameters stay without gradient");
    }

    #[test]
    fn large_norms_clip_to_max_norm_within_1e9() {
        let dev = Dev::new(0, 1).unwrap();
        let mut ps = params(&dev, 1e4);
        clip_grad_norm(&dev, &mut ps, 1.0).unwrap();
        assert!((direct_norm(&dev, &ps) - 1.0).abs() <= 1e-9);
    }

    #[test]
    fn gradients_under_the_limit_are_unchanged() {
        let dev = Dev::new(0, 1).unwrap();
        let mut ps = params(&dev, 1.0);
        let before: Vec<Vec<f64>> =
            ps.iter().filter_map(|p| p.grad.as_ref()).map(|g| dev.download_f64(g).unwrap()).collect();
        let norm = clip_grad_norm(&dev, &mut ps, 1e3).unwrap();
        assert!(norm < 1e3);
        let after: Vec<Vec<f64>> =
            ps.iter().filter_map(|p| p.grad.as_ref()).map(|g| dev.download_f64(g).unwrap()).collect();
        assert_eq!(before, after);
    }

    #[test]
    fn non_finite_norm_leaves_gradients_alone() {
        let dev = Dev::new(0, 1).unwrap();
        let mut ps = params(&dev, 1.0);
        ps[0].grad = Some(dev.upload_f64(&[f64::INFINITY, 0.0, 0.0, 0.0, 0.0]).unwrap());
        let b = dev.download_f64(ps[2].grad.as_ref().unwrap()).unwrap();
        assert!(clip_grad_norm(&dev, &mut ps, 1.0).unwrap().is_infinite());
        assert_eq!(dev.download_f64(ps[2].grad.as_ref().unwrap()).unwrap(), b);
    }

    #[test]
    fn bad_max_norm_is_a_config_error() {
        let dev = Dev::new(0, 1).unwrap();
        let mut ps = params(&dev, 1.0);
        for bad in [0.0, -1.0, f64::NAN] {
            assert!(matches!(clip_grad_norm(&dev, &mut ps, bad), Err(crate::Error::Config { .. })));
        }
    }
}
