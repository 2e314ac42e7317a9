//! Gradient checks of every unit and of whole models against central finite differences in
//! f64 (tolerance `GRAD_TOL` = 1e-6 relative per tensor), with dropout on (its masks are fixed
//! by the seed, so the loss is a smooth function of the parameters), plus frozen prefixes and
//! f32-vs-f64 agreement.

mod common;

use common::{tiny_batch, tiny_bert, tiny_gpt, tiny_vit};
use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::model::{Batch, Model, ModelConfig, Pooling, Saved};
use pipetransformer::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

type Dev = CpuDevice<f64>;

/// A tiny model whose parameters are all redrawn uniform in [-0.5, 0.5]: at the real init
/// (N(0, 0.02²)) attention is nearly uniform and the query/key gradients are ~1e-8, where the
/// finite differences' rounding noise (~1e-11) would dominate the comparison.
fn setup(config: &ModelConfig) -> (Dev, Model<Dev>, Batch<Dev>) {
    let dev = Dev::new(0, 1).unwrap();
    let mut model = Model::new(&dev, config, 7).unwrap();
    let mut rng = Rng::new(17);
    let mut tied_value = None;
    for p in model.params_mut() {
        let tied = p.name == "transformer.wte.weight" || p.name == "lm_head.weight";
        let values = match (&tied_value, tied) {
            (Some(v), true) => Vec::clone(v),
            _ => rng.vec(p.numel(), 0.5),
        };
        if tied {
            tied_value = Some(values.clone());
        }
        p.value = dev.upload_f64(&values).unwrap();
    }
    let batch = Batch::upload(&dev, model.spec(), &tiny_batch(config, 3), true, 11).unwrap();
    (dev, model, batch)
}

fn set_values(dev: &Dev, buf: &mut <Dev as Device>::Buf, values: &[f64]) {
    *buf = dev.upload_f64(values).unwrap();
}

/// Runs unit `i` alone on input `x`; returns its output.
fn unit_forward(dev: &Dev, model: &Model<Dev>, batch: &Batch<Dev>, i: usize, x: Option<&[f64]>) -> Vec<f64> {
    let x = x.map(|x| dev.upload_f64(x).unwrap());
    let (y, _) = model.units()[i].forward(dev, batch, x, true, None).unwrap();
    dev.download_f64(&y).unwrap()
}

/// Checks unit `i`'s input gradient and every parameter gradient against finite differences
/// of `L = Σ unit(x) ⊙ R`.
fn check_unit(config: &ModelConfig, i: usize) {
    let (dev, mut model, batch) = setup(config);
    let mut rng = Rng::new(100 + i as u64);
    let hidden = model.spec().hidden;
    let mut x = if i == 0 { None } else { Some(rng.vec(batch.rows() * hidden, 1.0)) };
    let y = unit_forward(&dev, &model, &batch, i, x.as_deref());
    let r = rng.vec(y.len(), 1.0);
    let name = format!("{:?} unit {i} ({})", model.spec().family, model.units()[i].kind_name());

    // Analytic gradients.
    model.zero_grad(&dev).unwrap();
    let xin = x.as_ref().map(|x| dev.upload_f64(x).unwrap());
    let (_, saved) = model.units()[i].forward(&dev, &batch, xin, true, None).unwrap();
    assert!(!matches!(saved, Saved::None), "{name}: a trainable unit in training mode saves activations");
    let dy = dev.upload_f64(&r).unwrap();
    let dx = model.units_mut()[i].backward(&dev, &batch, saved, dy, true, None).unwrap();

    // Input gradient.
    if let Some(x) = x.as_mut() {
        let analytic = dev.download_f64(dx.as_ref().expect("input gradient")).unwrap();
        let numeric = numeric_gradient(x, FD_STEP, |x| dot(&unit_forward(&dev, &model, &batch, i, Some(x)), &r));
        assert_grad(&format!("{name}: d input"), &analytic, &numeric);
    }

    // Parameter gradients.
    let nparams = model.units()[i].params().len();
    for j in 0..nparams {
        let (pname, analytic, mut values) = {
            let p = &model.units()[i].params()[j];
            (p.name.clone(), dev.download_f64(p.grad.as_ref().unwrap()).unwrap(), dev.download_f64(&p.value).unwrap())
        };
        let numeric = numeric_gradient(&mut values, FD_STEP, |v| {
            set_values(&dev, &mut model.units_mut()[i].params_mut()[j].value, v);
            dot(&unit_forward(&dev, &model, &batch, i, x.as_deref()), &r)
        });
        set_values(&dev, &mut model.units_mut()[i].params_mut()[j].value, &values);
        assert_grad(&format!("{name}: d {pname}"), &analytic, &numeric);
    }
}

fn all_configs() -> Vec<ModelConfig> {
    vec![
        tiny_bert(Pooling::ClsPooler, 0.1),
        tiny_bert(Pooling::Mean, 0.1),
        tiny_bert(Pooling::Cls, 0.0),
        tiny_gpt(0.1),
        tiny_vit(0.1),
    ]
}

#[test]
fn every_unit_matches_finite_differences() {
    for config in all_configs() {
        let n = Model::new(&Dev::new(0, 1).unwrap(), &config, 7).unwrap().units().len();
        for i in 0..n {
            check_unit(&config, i);
        }
    }
}

/// Mean loss of the model on the batch (training mode: the same dropout masks every call).
fn model_loss(dev: &Dev, model: &Model<Dev>, batch: &Batch<Dev>) -> f64 {
    let (logits, _) = model.forward(dev, batch).unwrap();
    let out = model.loss(dev, batch, &logits, None).unwrap();
    out.loss_sum / batch.target_count as f64
}

/// Whole-model check: every parameter's gradient of the mean loss. A tied pair (GPT's token
/// embedding and LM head) is one weight: perturbing it moves both copies, and each copy's
/// gradient must equal the total.
fn check_model(config: &ModelConfig, freeze: usize) {
    let (dev, mut model, batch) = setup(config);
    model.freeze_prefix(&dev, freeze).unwrap();
    model.zero_grad(&dev).unwrap();
    model.forward_backward(&dev, &batch).unwrap();
    let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
    let tied = |n: &str| n == "transformer.wte.weight" || n == "lm_head.weight";
    for (j, pname) in names.iter().enumerate() {
        let Some(grad) = model.params()[j].grad.as_ref().map(|g| dev.download_f64(g).unwrap()) else { continue };
        let mut values = dev.download_f64(&model.params()[j].value).unwrap();
        let targets: Vec<usize> =
            if tied(pname) { (0..names.len()).filter(|&k| tied(&names[k])).collect() } else { vec![j] };
        let numeric = numeric_gradient(&mut values, FD_STEP, |v| {
            for &k in &targets {
                set_values(&dev, &mut model.params_mut()[k].value, v);
            }
            model_loss(&dev, &model, &batch)
        });
        for &k in &targets {
            set_values(&dev, &mut model.params_mut()[k].value, &values);
        }
        assert_grad(&format!("{:?} (frozen prefix {freeze}): d {pname}", model.spec().family), &grad, &numeric);
    }
}

#[test]
fn whole_models_match_finite_differences() {
    for config in all_configs() {
        check_model(&config, 0);
    }
}

#[test]
fn frozen_prefix_has_no_gradients_and_leaves_the_rest_unchanged() {
    // Without dropout, freezing changes nothing but where the backward stops. (With dropout,
    // frozen units run without it, deterministically: checked below.)
    for (config, with_dropout) in [
        (tiny_bert(Pooling::ClsPooler, 0.0), tiny_bert(Pooling::ClsPooler, 0.1)),
        (tiny_gpt(0.0), tiny_gpt(0.1)),
        (tiny_vit(0.0), tiny_vit(0.1)),
    ] {
        let (dev, mut full, batch) = setup(&config);
        full.forward_backward(&dev, &batch).unwrap();
        for freeze in [1, 3] {
            let (_, mut frozen, _) = setup(&config);
            frozen.freeze_prefix(&dev, freeze).unwrap();
            assert_eq!(frozen.frozen_prefix(), freeze);
            let loss = frozen.forward_backward(&dev, &batch).unwrap();
            assert!(loss.is_finite());
            for (u, (uf, ut)) in frozen.units().iter().zip(full.units()).enumerate() {
                for (pf, pt) in uf.params().iter().zip(ut.params()) {
                    let tied_to_frozen = pf.name == "lm_head.weight";
                    match &pf.grad {
                        None => assert!(
                            u < freeze || tied_to_frozen,
                            "{}: unit {u} above the boundary lost its gradient",
                            pf.name
                        ),
                        Some(g) => {
                            assert!(u >= freeze, "{}: frozen unit {u} has a gradient", pf.name);
                            let a = dev.download_f64(g).unwrap();
                            let b = dev.download_f64(pt.grad.as_ref().unwrap()).unwrap();
                            // The LM head's copy of a tied weight no longer gets the embedding's
                            // share; every other gradient is the very same computation.
                            if !tied_to_frozen {
                                assert_eq!(a, b, "{}: gradient above the boundary changed", pf.name);
                            }
                        }
                    }
                }
            }
        }
        // The frozen model's gradients themselves pass a finite-difference check.
        check_model(&with_dropout, 3);
        // A frozen prefix's output does not depend on the step's dropout seed (what makes a
        // cached activation exact); a trainable unit's does.
        let (dev, mut model, _) = setup(&with_dropout);
        model.freeze_prefix(&dev, 3).unwrap();
        let host = tiny_batch(&with_dropout, 9);
        let prefix = |seed: u64, train: bool| {
            let b = Batch::upload(&dev, model.spec(), &host, true, seed).unwrap();
            let mut x = None;
            for u in &model.units()[..3] {
                x = Some(u.forward(&dev, &b, x.take(), train, None).unwrap().0);
            }
            dev.download_f64(&x.unwrap()).unwrap()
        };
        assert_eq!(prefix(1, false), prefix(2, false));
        assert_ne!(prefix(1, true), prefix(2, true), "the check would see dropout");
    }
}

#[test]
fn f32_forward_matches_f64() {
    for config in all_configs() {
        let d64 = CpuDevice::<f64>::new(0, 1).unwrap();
        let d32 = CpuDevice::<f32>::new(0, 1).unwrap();
        let m64 = Model::new(&d64, &config, 5).unwrap();
        let m32 = Model::new(&d32, &config, 5).unwrap();
        let host = tiny_batch(&config, 9);
        let b64 = Batch::upload(&d64, m64.spec(), &host, false, 0).unwrap();
        let b32 = Batch::upload(&d32, m32.spec(), &host, false, 0).unwrap();
        let (l64, _) = m64.forward(&d64, &b64).unwrap();
        let (l32, _) = m32.forward(&d32, &b32).unwrap();
        let (l64, l32) = (d64.download_f64(&l64).unwrap(), d32.download(&l32).unwrap());
        let e = rel_err(&l32, &l64);
        assert!(e <= 1e-5, "{:?}: f32 vs f64 logits rel err {e:.2e}", m64.spec().family);
    }
}
