//! TeraPipe's token-sliced step equals the unsliced step: the same loss, gradient norm and
//! weights (f32, 1e-5 relative) for uniform and uneven slicings, single-token slices, dropout on
//! (embedding, attention probabilities, residual branches), with and without a frozen prefix, on
//! one device (`Model::forward_backward_sliced`) and through the pipeline runtime for K in
//! {1, 2, 4}, M in {1, 2}, GPipe and 1F1B over slices; on the `cpu` backend and on `cuda-emu`
//! (the GPU kernels emulated; with `PT_TEST_DEVICE=cuda`, a real GPU). What a bug would change: a dropout mask placed by the slice's
//! shape, a key/value gradient not accumulated across slices, position ids restarting at each
//! slice, a loss scaled per slice, or a schedule that runs a slice before the one it reads.

mod common;

use common::{params_rel, tiny_batch, tiny_gpt};
use pipetransformer::device::{CpuDevice, Device, GpuDevice, Precision};
use pipetransformer::model::{Batch, Model, ModelConfig};
use pipetransformer::optim::{Optimizer, OptimizerConfig, clip_coefficient, global_grad_norm, scale_grads};
use pipetransformer::pipeline::{Pipeline, PipelineConfig, Plan, ScheduleKind, UnitProfile, unit_profiles};

const STEPS: usize = 3;

/// `(loss, grad norm)` of each step, and the final weights by name.
type Run = (Vec<(f64, f64)>, Vec<(String, Vec<f64>)>);

/// Every parameter's value, by name.
fn weights<D: Device>(dev: &D, model: &Model<D>) -> Vec<(String, Vec<f64>)> {
    model
        .units()
        .iter()
        .flat_map(|u| u.params())
        .map(|p| (p.name.clone(), dev.download_f64(&p.value).unwrap()))
        .collect()
}

/// `(loss, grad norm)` of each of `STEPS` AdamW steps on the tiny GPT batch, cut into `slices`
/// (`None`: the whole sequence), and the final weights.
fn run<D: Device>(dev: &D, config: &ModelConfig, slices: Option<&[usize]>, frozen: usize) -> Run {
    let mut model = Model::new(dev, config, 1).unwrap();
    model.freeze_prefix(dev, frozen).unwrap();
    let host = tiny_batch(config, 2);
    let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
    let mut stats = Vec::new();
    for step in 0..STEPS {
        let seed = 3 + step as u64;
        model.zero_grad(dev).unwrap();
        let loss = match slices {
            None => model.forward_backward(dev, &Batch::upload(dev, model.spec(), &host, true, seed).unwrap()),
            Some(lengths) => {
                let batches: Vec<Batch<D>> = host
                    .token_slices(lengths)
                    .unwrap()
                    .iter()
                    .map(|s| Batch::upload(dev, model.spec(), s, true, seed).unwrap())
                    .collect();
                model.forward_backward_sliced(dev, &batches)
            }
        }
        .unwrap();
        // The norm of the distinct parameters (the tied weight once), both copies scaled.
        let norm = global_grad_norm(dev, &model.distinct_params()).unwrap();
        let mut params = model.params_mut();
        if let Some(coef) = clip_coefficient(norm, 1.0).unwrap() {
            scale_grads(dev, &mut params, coef).unwrap();
        }
        opt.step(dev, &mut params, 1e-2).unwrap();
        stats.push((loss, norm));
    }
    (stats, weights(dev, &model))
}

/// Every step's loss and gradient norm, and the final weights, within 1e-5 relative of `want`.
fn assert_same_run(got: &Run, want: &Run, what: &str) {
    assert_close_run(got, want, 1e-5, what);
}

/// Every step's loss and gradient norm, and the final weights, within `tol` relative of `want`.
fn assert_close_run(got: &Run, want: &Run, tol: f64, what: &str) {
    assert_eq!(got.0.len(), want.0.len(), "{what}: steps");
    for (step, ((lg, ng), (lw, nw))) in got.0.iter().zip(&want.0).enumerate() {
        let (dl, dn) = ((lg - lw).abs() / lw.abs(), (ng - nw).abs() / nw.abs());
        assert!(
            dl <= tol && dn <= tol,
            "{what}, step {step}: loss {lg} vs {lw} ({dl:.1e}), grad norm {ng} vs {nw} ({dn:.1e})"
        );
    }
    let rel = params_rel(&got.1, &want.1);
    assert!(rel <= tol, "{what}: weights differ by {rel:.1e}");
}

fn check<D: Device>(dev: &D, what: &str) {
    let config = tiny_gpt(0.1);
    for frozen in [0, 2] {
        let want = run(dev, &config, None, frozen);
        // The tiny batch has 7 tokens.
        for slices in [&[7][..], &[3, 4], &[2, 2, 3], &[1, 5, 1], &[1; 7]] {
            let got = run(dev, &config, Some(slices), frozen);
            assert_same_run(&got, &want, &format!("{what}, slices {slices:?}, {frozen} frozen"));
        }
    }
}

/// Emulated GPU `i` (f32), or the GPU itself under `PT_TEST_DEVICE=cuda` (every device of a
/// pipeline on GPU 0).
fn gpu(i: usize) -> GpuDevice {
    gpu_in(i, Precision::F32)
}

/// [`gpu`] in `precision`.
fn gpu_in(i: usize, precision: Precision) -> GpuDevice {
    match std::env::var("PT_TEST_DEVICE").as_deref() {
        Ok("cuda") => pipetransformer::device::cuda::device(0, precision).unwrap(),
        _ => pipetransformer::device::emu::device(i, precision, 1 + i as u64).unwrap(),
    }
}

#[test]
fn sliced_steps_equal_unsliced_on_cpu() {
    check(&CpuDevice::<f32>::new(0, 1).unwrap(), "cpu");
}

#[test]
fn sliced_steps_equal_unsliced_on_cuda_emu() {
    check(&gpu(0), "cuda-emu");
}

/// `(loss, grad norm)` of `STEPS` steps through a pipeline on `devices` as `plan` says, its
/// first `frozen` units frozen, and the final weights.
fn run_pipeline<D: Device>(devices: Vec<D>, config: &ModelConfig, plan: PipelineConfig, frozen: usize) -> Run {
    let mut model = Model::new(&devices[0], config, 1).unwrap();
    let host = tiny_batch(config, 2);
    let profiles = unit_profiles(&devices[0], &mut model, &host, false).unwrap();
    let mut pipeline = Pipeline::new(devices, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
    pipeline.freeze_prefix(frozen).unwrap();
    let stats = (0..STEPS)
        .map(|step| {
            let out = pipeline.step(&host, 3 + step as u64, 1e-2, Some(1.0)).unwrap();
            (out.loss, out.grad_norm)
        })
        .collect();
    let dev = &pipeline.devices()[0];
    let weights = pipeline
        .units()
        .flat_map(|u| u.params())
        .map(|p| (p.name.clone(), dev.download_f64(&p.value).unwrap()))
        .collect();
    (stats, weights)
}

fn check_pipelines<D: Device>(devices: impl Fn(usize) -> Vec<D>, what: &str) {
    let config = tiny_gpt(0.1);
    let plan = |k, m, schedule, slices: &[usize]| PipelineConfig {
        pipeline_len: k,
        micro_batches: m,
        schedule,
        token_slices: slices.to_vec(),
        ..Default::default()
    };
    let want = run(&devices(1)[0], &config, None, 0);
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        for k in [1, 2, 4] {
            for m in [1, 2] {
                for slices in [&[][..], &[2, 5], &[3, 1, 3]] {
                    let got = run_pipeline(devices(k), &config, plan(k, m, schedule, slices), 0);
                    let label = format!("{what} {schedule} K={k} M={m} slices {slices:?}");
                    assert_same_run(&got, &want, &label);
                }
            }
        }
    }
    // A frozen prefix (what the elastic loop makes): its units run forward only, without
    // dropout, and the backward stops at the boundary, in every slice.
    let want = run(&devices(1)[0], &config, None, 2);
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        for (k, slices) in [(2, &[2, 5][..]), (4, &[3, 1, 3])] {
            let got = run_pipeline(devices(k), &config, plan(k, 2, schedule, slices), 2);
            assert_same_run(&got, &want, &format!("{what} {schedule} K={k} M=2 slices {slices:?}, 2 frozen"));
        }
    }
}

#[test]
fn sliced_pipelines_equal_the_unsliced_step_on_cpu() {
    check_pipelines(|k| (0..k).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect(), "cpu");
}

#[test]
fn sliced_pipelines_equal_the_unsliced_step_on_cuda_emu() {
    check_pipelines(|k| (0..k).map(gpu).collect(), "cuda-emu");
}

/// On a bf16 GPU (emulated, or the GPU under `PT_TEST_DEVICE=cuda`) activations and their gradients are bf16: the key/value arena,
/// the hidden states a stage receives and the planner's probe must be too, or the kernels
/// refuse them. Sliced and pipelined runs stay within bf16's rounding of the unsliced one.
#[test]
fn sliced_pipelines_run_in_bf16_on_cuda_emu() {
    let bf16 = |i: usize| gpu_in(i, Precision::Bf16);
    let config = tiny_gpt(0.1);
    let want = run(&bf16(0), &config, None, 0);
    assert_close_run(&run(&bf16(0), &config, Some(&[2, 5]), 0), &want, 2e-2, "bf16, one device, slices [2, 5]");
    for (k, slices) in [(1, vec![2, 5]), (2, vec![]), (2, vec![3, 1, 3])] {
        let plan =
            PipelineConfig { pipeline_len: k, micro_batches: 2, token_slices: slices.clone(), ..Default::default() };
        let got = run_pipeline((0..k).map(bf16).collect(), &config, plan, 0);
        assert_close_run(&got, &want, 2e-2, &format!("bf16 K={k} M=2 slices {slices:?}"));
    }
    let micro = tiny_batch(&config, 2);
    let mut model = Model::new(&bf16(0), &config, 1).unwrap();
    let latency = pipetransformer::terapipe::measure_latency(&bf16(0), &mut model, &micro, 2);
    assert!(latency.is_ok(), "the slicing planner's probe in bf16: {:?}", latency.err());
}

/// The dropout masks matter: with them placed by the slice's shape instead of the sequence's,
/// the test above would fail. Here: slicing with dropout off and on gives different losses
/// (dropout is really on), while slicing never changes the loss.
#[test]
fn dropout_is_on_in_the_comparison() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let (on, _) = run(&dev, &tiny_gpt(0.1), Some(&[2, 5]), 0);
    let (off, _) = run(&dev, &tiny_gpt(0.0), Some(&[2, 5]), 0);
    assert!((on[0].0 - off[0].0).abs() > 1e-4, "dropout changed nothing: {on:?} vs {off:?}");
}

#[test]
fn bad_slicings_are_refused_with_the_reason() {
    let host = tiny_batch(&tiny_gpt(0.0), 2);
    for (slices, needle) in [
        (&[3, 3][..], "covers 6 tokens; the sequences have 7"),
        (&[3, 0, 4], "zero-length slice"),
        (&[], "zero-length slice (or none)"),
        (&[1; 8], "covers 8 tokens"),
    ] {
        let err = host.token_slices(slices).unwrap_err().to_string();
        assert!(err.contains("token_slices") && err.contains(needle), "{slices:?}: {err}");
    }
    // A classifier's batch (one target per sequence) cannot be sliced.
    let bert = tiny_batch(&common::tiny_bert(pipetransformer::model::Pooling::ClsPooler, 0.0), 2);
    let err = bert.token_slices(&[3, 4]).unwrap_err().to_string();
    assert!(err.contains("language-model") || err.contains("padding"), "{err}");
}

/// The plan's predicted bubble counts pieces: `n` slices of `M` micro-batches fill and drain
/// like `M·n` micro-batches a slice long.
#[test]
fn predicted_bubble_counts_slices() {
    use pipetransformer::pipeline::{Plan, UnitProfile};
    let unit = UnitProfile {
        forward: 1.0,
        backward: 2.0,
        params: 10,
        activation_bytes: 100,
        trainable: true,
        ..Default::default()
    };
    let names: Vec<String> = (0..4).map(|i| format!("u{i}")).collect();
    for (slices, m, want) in [(vec![], 1, 1.0 / 2.0), (vec![8, 8, 8, 8], 1, 1.0 / 5.0), (vec![16, 16], 2, 1.0 / 5.0)] {
        let config =
            PipelineConfig { pipeline_len: 2, micro_batches: m, token_slices: slices.clone(), ..Default::default() };
        let plan = Plan::new(config, &[unit; 4], names.clone(), 2, 0).unwrap();
        let got = plan.predicted_bubble();
        assert!((got - want).abs() < 1e-12, "slices {slices:?}, M = {m}: {got} vs {want}");
        assert!((plan.schedule.bubble_formula() - want).abs() < 1e-12);
    }
}

/// `auto`: the latency model measured on a device, then the planner. Its slicing covers the
/// sequence and predicts a step no longer than any uniform slicing under the same model, and a
/// pipeline runs it to the unsliced step's loss.
#[test]
fn the_planned_slicing_beats_every_uniform_one_under_its_model() {
    use pipetransformer::terapipe::{
        MicroBatchSlicing, PlannerConfig, measure_latency, plan, predict_step_seconds, uniform,
    };
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let config = tiny_gpt(0.1);
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let host = tiny_batch(&config, 2);
    for k in [1, 2, 4] {
        let latency = measure_latency(&dev, &mut model, &host, k).unwrap();
        let planned = plan(&latency, &PlannerConfig::new(k, host.seq, 1)).unwrap();
        let lengths = planned.micro_batches[0].slices.clone();
        assert_eq!(lengths.iter().sum::<usize>(), host.seq, "K = {k}: {lengths:?}");
        let score = |slices: Vec<usize>| {
            predict_step_seconds(&latency, k, &[MicroBatchSlicing { samples: 1, slices }]).unwrap()
        };
        assert!(
            (score(lengths.clone()) - planned.predicted_step_seconds).abs() <= 1e-12 * planned.predicted_step_seconds
        );
        for n in 1..=host.seq {
            assert!(
                planned.predicted_step_seconds <= score(uniform(host.seq, n)) * (1.0 + 1e-12),
                "K = {k}, {n} slices"
            );
        }
        if lengths.len() > 1 {
            let plan = PipelineConfig { pipeline_len: k, token_slices: lengths, ..Default::default() };
            let cpus = (0..k).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
            let (got, _) = run_pipeline(cpus, &config, plan, 0);
            let (want, _) = run(&dev, &config, None, 0);
            assert!((got[0].0 - want[0].0).abs() <= 1e-5 * want[0].0.abs(), "K = {k}: {got:?} vs {want:?}");
        }
    }
}

/// The memory tests' GPT: 8 heads over `seq` tokens of width `width`, so that the attention
/// probabilities outweigh the rest of a layer's activations; two sequences.
fn many_headed_gpt(width: usize, seq: usize) -> (ModelConfig, pipetransformer::model::HostBatch) {
    use pipetransformer::model::GptConfig;
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config = ModelConfig::Gpt(GptConfig { n_embd: width, n_head: 8, n_positions: seq, n_inner: Some(16), ..tiny });
    let host = pipetransformer::model::HostBatch::random(&config, 2, seq, 5);
    (config, host)
}

/// A 4-layer GPT over a 65-character vocabulary, 16 wide, 4 heads, and four sequences of 32
/// tokens: big enough for two stages of two layers each.
fn four_layer_gpt() -> (ModelConfig, pipetransformer::model::HostBatch) {
    use pipetransformer::model::GptConfig;
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config = ModelConfig::Gpt(GptConfig {
        vocab_size: 65,
        n_embd: 16,
        n_head: 4,
        n_positions: 32,
        n_inner: None,
        n_layer: 4,
        ..tiny
    });
    let host = pipetransformer::model::HostBatch::random(&config, 4, 32, 5);
    (config, host)
}

/// Activation bytes a micro-batch like `micro` keeps in the last stage's end (final norm and
/// head, per token): `measure_memory`'s model is of the larger end stage, here the last, while
/// stage 0's end (GPT's embeddings) keeps nothing.
fn tail_bytes(dev: &CpuDevice<f32>, model: &Model<CpuDevice<f32>>, micro: &pipetransformer::model::HostBatch) -> f64 {
    let costs = model.costs(dev, micro.seq);
    let tail = model.units().iter().rposition(|u| u.kind_name().starts_with("mlp")).unwrap() + 1;
    costs[tail..].iter().map(|c| (c.activation_bytes * micro.batch) as f64).sum()
}

/// One step of `model` as `plan`'s 2-stage pipeline on `host` (micro-batches like `micro`),
/// its stage 0 holding one attention layer: the bytes that stage kept for backwards at its
/// peak (4-byte elements), and the partition's count of them (its memory less the state).
fn stage_zero_bytes(
    dev: &CpuDevice<f32>,
    mut model: Model<CpuDevice<f32>>,
    micro: &pipetransformer::model::HostBatch,
    plan: PipelineConfig,
    host: &pipetransformer::model::HostBatch,
) -> (f64, f64) {
    let profiles = unit_profiles(dev, &mut model, micro, false).unwrap();
    let cpus = (0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
    let mut pipeline = Pipeline::new(cpus, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
    let stage = pipeline.plan().partition.stages[0].clone();
    let names = &pipeline.plan().unit_names[stage.clone()];
    assert_eq!(names.iter().filter(|n| n.starts_with("attention")).count(), 1, "{names:?}");
    let measured = 4.0 * pipeline.step(host, 3, 1e-2, None).unwrap().peak_activations[0] as f64;
    let state: usize = profiles[stage].iter().map(UnitProfile::state_bytes).sum();
    (measured, (pipeline.plan().partition.stage_memory[0] - state) as f64)
}

/// The planner's memory model (measured on one layer) bounds what a stage really keeps. On
/// stage 0 of a K = 2 GPipe pipeline over slices (GPT's embeddings keep nothing, so the stage's
/// activations are its one layer's), the measured peak (saved activations and key/value arenas,
/// 4-byte elements) lies between the modelled activations plus every micro-batch's keys and
/// values, and that plus one micro-batch's key/value gradients (the first backward's). The
/// model has many heads over 32 tokens, so the attention probabilities (`l·(c+l)` per slice)
/// outweigh that window: a wrong score or per-token term falls outside it. The arenas count
/// once per resident micro-batch: all `M` under GPipe, `min(M, K)` under 1F1B. The partition's
/// memory check (`UnitProfile::sliced`) counts the same bytes as the planner.
#[test]
fn the_memory_model_bounds_a_stages_measured_peak() {
    use pipetransformer::terapipe::measure_memory;
    let (width, seq) = (8, 32);
    let (config, host) = many_headed_gpt(width, seq);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    for m in [1, 2] {
        for slices in [vec![16, 16], vec![5, 20, 7], vec![4; 8]] {
            let plan = PipelineConfig {
                pipeline_len: 2,
                micro_batches: m,
                schedule: ScheduleKind::Gpipe,
                token_slices: slices.clone(),
                ..Default::default()
            };
            let model = Model::new(&dev, &config, 1).unwrap();
            let micro = host.split(m).unwrap().swap_remove(0);
            let memory = measure_memory(&dev, &model, &micro, &plan).unwrap();
            let (mut context, mut per_micro) = (0, 0.0);
            for &l in &slices {
                per_micro += memory.slice_bytes(1, l, context);
                context += l;
            }
            let per_micro = per_micro - tail_bytes(&dev, &model, &micro);
            // Keys and values of one layer, one micro-batch (their gradients as much again).
            let kv = (2 * micro.batch * seq * width * 4) as f64;
            let low = m as f64 * (per_micro + kv);
            let high = low + kv;

            let (measured, partition) = stage_zero_bytes(&dev, model, &micro, plan, &host);
            // The partition's memory check counts the same: the sliced activations and every
            // resident micro-batch's arena with gradients (the planner's model).
            let planned = m as f64 * (per_micro + 2.0 * kv);
            assert!((partition - planned).abs() <= 1.0, "M = {m}, slices {slices:?}: {partition} vs {planned}");
            assert!(
                low <= measured + 1e-6 && measured <= high + 1e-6,
                "M = {m}, slices {slices:?}: measured {measured} B outside the model's [{low}, {high}]"
            );
        }
    }
    // The arenas (with gradients) of resident micro-batches: M under GPipe, min(M, K) under 1F1B.
    let model = Model::new(&dev, &config, 1).unwrap();
    let micro = host.split(2).unwrap().swap_remove(0);
    // Charged to sliced plans only (an unsliced step keeps none).
    let memory = |m, schedule| {
        let plan = PipelineConfig { pipeline_len: 2, micro_batches: m, schedule, ..Default::default() };
        measure_memory(&dev, &model, &micro, &plan).unwrap()
    };
    let arena = 4 * micro.batch * seq * width * 4;
    let (one, four) = (memory(1, ScheduleKind::Gpipe), memory(4, ScheduleKind::Gpipe));
    assert_eq!((one.sliced_bytes, four.sliced_bytes), (arena, 4 * arena));
    assert_eq!(one.fixed_bytes, four.fixed_bytes);
    assert_eq!(memory(4, ScheduleKind::OneFOneB), memory(2, ScheduleKind::Gpipe));
}

/// Run whole, a trained attention layer saves its keys and values with its activations; the
/// memory model's per-token bytes, measured on a slice, have them in the arena instead, so the
/// model counts them apart for the unsliced plan (`unsliced_bytes`): with them, its modelled
/// peak for stage 0 of a K = 2 GPipe pipeline is what the step measures, and without them it
/// falls short by a micro-batch's keys and values per micro-batch.
#[test]
fn the_memory_model_counts_an_unsliced_plans_keys_and_values() {
    use pipetransformer::terapipe::measure_memory;
    let (width, seq) = (8, 32);
    let (config, host) = many_headed_gpt(width, seq);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    for m in [1, 2] {
        let plan =
            PipelineConfig { pipeline_len: 2, micro_batches: m, schedule: ScheduleKind::Gpipe, ..Default::default() };
        let model = Model::new(&dev, &config, 1).unwrap();
        let micro = host.split(m).unwrap().swap_remove(0);
        let memory = measure_memory(&dev, &model, &micro, &plan).unwrap();
        let kv = (2 * micro.batch * seq * width * 4) as f64;
        assert_eq!(memory.unsliced_bytes as f64, m as f64 * kv, "M = {m}");
        let end = tail_bytes(&dev, &model, &micro);
        let modelled = m as f64 * (memory.slice_bytes(1, seq, 0) - end) + memory.unsliced_bytes as f64;

        let (measured, partition) = stage_zero_bytes(&dev, model, &micro, plan, &host);
        assert!(
            (measured - modelled).abs() <= 1e-9 * measured,
            "M = {m}: measured {measured} B, modelled {modelled} B"
        );
        // The partition's memory check (analytic costs) counts the same.
        assert!((partition - measured).abs() <= 1.0, "M = {m}: partition {partition} B, measured {measured} B");
    }
}

/// The planner models each stage apart: the first holds the embeddings' weights, the last
/// the head's logits, and under 1F1B stage `s` holds `min(M, K − s)` micro-batches (here 2
/// and 1). Whole and sliced, each stage's model (activations, keys and values or their arenas,
/// weights) counts what the partition counts for it, and bounds the step's measured peak.
#[test]
fn each_stages_memory_model_counts_what_the_partition_counts() {
    use pipetransformer::terapipe::SlicingProfile;
    let (config, host) = four_layer_gpt();
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let micro = host.split(2).unwrap().swap_remove(0);
    for slices in [vec![], vec![8, 8, 16]] {
        let mut model = Model::new(&dev, &config, 1).unwrap();
        let units = unit_profiles(&dev, &mut model, &micro, false).unwrap();
        let plan = PipelineConfig {
            pipeline_len: 2,
            micro_batches: 2,
            schedule: ScheduleKind::OneFOneB,
            token_slices: slices.clone(),
            ..Default::default()
        };
        let profile = SlicingProfile::measure(&dev, &mut model, &micro).unwrap();
        let stages = Plan::time_cut(&plan, &units, 0).unwrap();
        let loads = profile.stages(&units, &stages, micro.batch).unwrap();
        // The planner counts `min(M, K)` sequences resident on every stage: 2 of one sequence
        // here, each stage's share in its model.
        let modelled: Vec<f64> = profile
            .pipeline_memory(&loads, &plan, micro.batch)
            .iter()
            .map(|m| match slices.is_empty() {
                true => (m.fixed_bytes + m.unsliced_bytes) as f64 + 2.0 * m.slice_bytes(1, host.seq, 0),
                false => {
                    let mut context = 0;
                    let each: f64 = slices.iter().map(|&l| (m.slice_bytes(1, l, context), context += l).0).sum();
                    (m.fixed_bytes + m.sliced_bytes) as f64 + 2.0 * each
                }
            })
            .collect();
        let cpus = (0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
        let mut pipeline = Pipeline::new(cpus, model, OptimizerConfig::adamw(), plan, &units).unwrap();
        assert_eq!(pipeline.plan().partition.stages, stages);
        let measured = pipeline.step(&host, 3, 1e-2, None).unwrap().peak_activations;
        for (s, range) in stages.iter().enumerate() {
            let partition = pipeline.plan().partition.stage_memory[s] as f64;
            let what = format!("slices {slices:?}, stage {s}");
            assert!(
                (modelled[s] - partition).abs() <= 1.0,
                "{what}: modelled {} B, partition {partition} B",
                modelled[s]
            );
            let state: usize = units[range.clone()].iter().map(UnitProfile::state_bytes).sum();
            let kept = (4 * measured[s] + state) as f64;
            assert!(kept <= modelled[s] + 1e-6, "{what}: measured {kept} B, modelled {} B", modelled[s]);
        }
        assert!(modelled[1] < modelled[0], "the last stage holds one micro-batch: {modelled:?}");
    }
}

/// Recomputation over token slices: a stage that recomputes runs each slice's forward again in
/// that slice's backward, its attention reading its context from the key/value arena and
/// writing its own keys and values there again. The loss and gradient norm of every step
/// equal the plain sliced run's to the bit and the weights after them too, for GPipe and 1F1B,
/// every stage recomputing (`all`) and `auto` recomputing part of a stage under a limit; every
/// stage keeps no more than the partition counts (which keeps the arenas and the logits'
/// gradient per micro-batch in flight, and one slice's activations regained) and no less than
/// that but the key/value gradients not yet made, and stage 0 less than without recomputation.
#[test]
fn sliced_pipelines_that_recompute_train_to_the_bit_and_keep_less() {
    use pipetransformer::pipeline::Recompute;
    let (config, host) = four_layer_gpt();
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let micro = host.split(2).unwrap().swap_remove(0);
    let units = unit_profiles(&dev, &mut Model::new(&dev, &config, 1).unwrap(), &micro, false).unwrap();
    let state = |r: &std::ops::Range<usize>| units[r.clone()].iter().map(UnitProfile::state_bytes).sum::<usize>();
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        let plain = PipelineConfig {
            pipeline_len: 2,
            micro_batches: 2,
            schedule,
            token_slices: vec![8, 8, 16],
            ..Default::default()
        };
        let run = |plan: &PipelineConfig| {
            let cpus = (0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
            let model = Model::new(&dev, &config, 1).unwrap();
            let mut pipeline = Pipeline::new(cpus, model, OptimizerConfig::adamw(), plan.clone(), &units).unwrap();
            let steps: Vec<_> =
                (0..STEPS).map(|s| pipeline.step(&host, 3 + s as u64, 1e-2, Some(1.0)).unwrap()).collect();
            let weights: Vec<Vec<f64>> = pipeline
                .units()
                .flat_map(|u| u.params())
                .map(|p| pipeline.devices()[0].download_f64(&p.value).unwrap())
                .collect();
            (steps, weights, pipeline.plan().clone())
        };
        let partial = common::partial_recompute(&plain, &units);
        let (want, want_weights, _) = run(&plain);
        let all = PipelineConfig { recompute: Recompute::All, ..plain.clone() };
        for (policy, config) in [("all", &all), ("auto", &partial)] {
            let (got, got_weights, plan) = run(config);
            let what = format!("{schedule}, recompute {policy}");
            assert!(plan.partition.recomputed.iter().any(|r| !r.is_empty()), "{what}");
            for (s, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}, step {s}: loss");
                assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{what}, step {s}: gradient norm");
            }
            assert!(want_weights == got_weights, "{what}: weights");
            let p = &plan.partition;
            for (s, r) in p.stages.iter().enumerate() {
                let (kept, counted) = (4 * got[2].peak_activations[s], p.stage_memory[s] - state(r));
                assert!(kept <= counted, "{what}, stage {s}: measured {kept} B, counted {counted} B");
                // And no more than it keeps: what is counted but not held at the peak is the
                // key/value gradients of the micro-batches whose backward has not begun (a
                // stage that recomputes peaks in a backward, which has made its own), and of
                // the one in backward, its input to the recomputed units. Each regains one
                // slice at a time, the last (the longest, with the most context here).
                let in_flight = if schedule == ScheduleKind::Gpipe { 2 } else { 2 - s };
                let kv_grads: usize = units[r.clone()].iter().map(|u| u.kv_grad_bytes).sum();
                let again = &p.recomputed[s];
                let slack = match again.is_empty() {
                    true => in_flight * kv_grads,
                    false => (in_flight - 1) * kv_grads + units[again.start].input_bytes,
                };
                assert!(
                    counted - kept <= slack,
                    "{what}, stage {s}: measured {kept} B, counted {counted} B, slack {slack} B"
                );
            }
            if !p.recomputed[0].is_empty() {
                let (kept, plain_kept) = (got[2].peak_activations[0], want[2].peak_activations[0]);
                assert!(kept < plain_kept, "{what}: stage 0 kept {kept}, {plain_kept} without recomputing");
            }
        }
    }
}

/// A frozen layer of a sliced pipeline keeps no activations, but its key/value arena holds
/// every resident micro-batch's keys and values for the later slices: the partition's memory
/// (what a memory limit is checked against) counts them. On stage 0 of a K = 2 GPipe pipeline
/// over slices with the embedding and two of three layers frozen, the step's measured peak
/// lies within the partition's bytes, less at most the trained layer's key/value gradients
/// (GPipe's peak comes before most backwards allocate them). The frozen arenas outweigh those
/// gradients: a partition that left them out would claim less than the step keeps.
#[test]
fn a_frozen_layers_arena_counts_in_a_sliced_plans_memory() {
    use pipetransformer::model::GptConfig;
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config =
        ModelConfig::Gpt(GptConfig { n_embd: 8, n_head: 2, n_positions: 32, n_inner: Some(16), n_layer: 3, ..tiny });
    let host = pipetransformer::model::HostBatch::random(&config, 2, 32, 5);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, &config, 1).unwrap();
    model.freeze_prefix(&dev, 5).unwrap();
    let micro = host.split(2).unwrap().swap_remove(0);
    let profiles = unit_profiles(&dev, &mut model, &micro, false).unwrap();
    let plan = PipelineConfig {
        pipeline_len: 2,
        micro_batches: 2,
        schedule: ScheduleKind::Gpipe,
        token_slices: vec![8, 16, 8],
        ..Default::default()
    };
    let cpus = (0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
    let mut pipeline = Pipeline::new(cpus, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
    let stage = pipeline.plan().partition.stages[0].clone();
    let names = &pipeline.plan().unit_names[stage.clone()];
    assert_eq!(names.iter().filter(|n| n.starts_with("attention")).count(), 3, "{names:?}");
    let state: usize = profiles[stage.clone()].iter().map(UnitProfile::state_bytes).sum();
    let planned = (pipeline.plan().partition.stage_memory[0] - state) as f64;
    // Two micro-batches resident: layers 0 and 1's keys and values (1 sequence × 32 tokens ×
    // width 8, f32), and layer 2's gradients of its own.
    let frozen = (2 * 2 * (2 * 32 * 8 * 4)) as f64;
    let trained_grads =
        2.0 * profiles[stage].iter().filter(|u| u.trainable).map(|u| u.kv_grad_bytes).sum::<usize>() as f64;
    assert!(frozen > trained_grads && trained_grads > 0.0, "{frozen} vs {trained_grads}");
    let measured = 4.0 * pipeline.step(&host, 3, 1e-2, None).unwrap().peak_activations[0] as f64;
    assert!(
        planned - trained_grads <= measured + 1e-6 && measured <= planned + 1e-6,
        "measured {measured} B; planned {planned} B, of which {frozen} B the frozen arenas and {trained_grads} B the \
         trained layer's key/value gradients"
    );
}

/// One measurement plans every shape an elastic run changes to: a stage's latency is its
/// layers' (`⌈L/K⌉`: 4, 2, 2, 1 of 4 layers) and scales with the micro-batch's sequences, as the
/// transfer's bytes do (not its fixed cost); its memory is exactly what measuring that shape
/// gives, for any `K`, `M`, schedule and micro-batch.
#[test]
fn a_slicing_profile_models_every_shape_from_one_measurement() {
    use pipetransformer::model::GptConfig;
    use pipetransformer::terapipe::{SlicingProfile, measure_memory};
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config =
        ModelConfig::Gpt(GptConfig { n_embd: 8, n_head: 8, n_positions: 32, n_inner: Some(16), n_layer: 4, ..tiny });
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let host = pipetransformer::model::HostBatch::random(&config, 2, 32, 5);
    let one = host.split(2).unwrap().swap_remove(0);
    let profile = SlicingProfile::measure(&dev, &mut model, &host).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
    for k in 1..=4 {
        for m in [1, 2, 4] {
            for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                for micro in [&host, &one] {
                    let plan = PipelineConfig { pipeline_len: k, micro_batches: m, schedule, ..Default::default() };
                    let (got, want) = (
                        profile.memory(&profile.uniform_stage(k), &plan, micro.batch),
                        measure_memory(&dev, &model, micro, &plan).unwrap(),
                    );
                    let what = format!("K={k} M={m} {schedule} {} sequences: {got:?} vs {want:?}", micro.batch);
                    assert!(close(got.per_token_bytes, want.per_token_bytes), "{what}");
                    assert!(close(got.per_score_bytes, want.per_score_bytes), "{what}");
                    assert_eq!((got.fixed_bytes, got.sliced_bytes), (want.fixed_bytes, want.sliced_bytes), "{what}");
                }
            }
        }
    }
    // The compute part of a slice's time (the transfer's taken off).
    let compute = |k: usize, samples: usize, len: usize, context: usize| {
        let latency = profile.latency(&profile.uniform_stage(k), k, samples).unwrap();
        let comm = latency.comm().map_or(0.0, |c| c.seconds(len));
        (latency.slice_time(1, len, context).unwrap() - comm, latency.comm().copied())
    };
    for (len, context) in [(1, 0), (32, 0), (8, 16), (4, 20)] {
        let (all, none) = compute(1, 2, len, context);
        assert!(all > 0.0 && none.is_none_or(|c| c.fixed_seconds == 0.0 && c.seconds_per_token == 0.0));
        for (k, samples, share) in [(2, 2, 0.5), (3, 2, 0.5), (4, 2, 0.25), (2, 1, 0.25)] {
            let (part, _) = compute(k, samples, len, context);
            assert!(close(part, all * share), "K={k}, {samples} sequences, {len}@{context}: {part} vs {all} × {share}");
        }
    }
    let (_, two) = compute(2, 2, 1, 0);
    let (_, half) = compute(2, 1, 1, 0);
    let (two, half) = (two.unwrap(), half.unwrap());
    assert!(close(half.seconds_per_token, two.seconds_per_token / 2.0), "{two:?} {half:?}");
    assert_eq!(half.fixed_seconds, two.fixed_seconds);
}

/// A stage's memory from its load: attention and MLP units keep their own activations (the
/// attention probabilities the attention's alone), only trained ones; a frozen attention
/// unit's arena holds keys and values without their gradients (its latency: the unit test
/// `a_stage_adds_its_ends_per_token`).
#[test]
fn a_stages_memory_counts_its_units_and_frees_its_frozen_layers() {
    use pipetransformer::model::GptConfig;
    use pipetransformer::terapipe::{SlicingProfile, StageLoad};
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config = ModelConfig::Gpt(GptConfig { n_embd: 8, n_head: 8, n_positions: 32, n_inner: Some(16), ..tiny });
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let host = pipetransformer::model::HostBatch::random(&config, 2, 32, 5);
    let profile = SlicingProfile::measure(&dev, &mut model, &host).unwrap();
    let plan =
        PipelineConfig { pipeline_len: 2, micro_batches: 2, schedule: ScheduleKind::Gpipe, ..Default::default() };
    let memory = |load: &StageLoad| profile.memory(load, &plan, 2);
    let one = memory(&StageLoad::of_layers(1));
    let attention = memory(&StageLoad { trained_mlp: 0, ..StageLoad::of_layers(1) });
    let mlp = memory(&StageLoad { trained_attention: 0, ..StageLoad::of_layers(1) });
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
    assert!(close(attention.per_token_bytes + mlp.per_token_bytes, one.per_token_bytes), "{attention:?} {mlp:?}");
    assert!(mlp.per_token_bytes > 0.0 && attention.per_token_bytes > 0.0, "{attention:?} {mlp:?}");
    assert_eq!((attention.per_score_bytes, mlp.per_score_bytes), (one.per_score_bytes, 0.0));
    let frozen = memory(&StageLoad { frozen_attention: 1, ..StageLoad::of_layers(1) });
    assert_eq!((frozen.per_token_bytes, frozen.per_score_bytes), (one.per_token_bytes, one.per_score_bytes));
    // Two micro-batches resident under GPipe, each with one more layer's keys and values
    // (2 sequences × 32 tokens × width 8, f32), and no more gradients.
    assert_eq!(frozen.sliced_bytes - one.sliced_bytes, 2 * (2 * 2 * 32 * 8 * 4));
}

/// `auto` under a GPipe memory limit between the finest slicing's peak and the unsliced one's:
/// every micro-batch gets the same slicing (the runtime cuts them alike), and its predicted
/// peak is within the limit.
#[test]
fn auto_under_a_memory_limit_plans_one_slicing_within_it() {
    use pipetransformer::model::GptConfig;
    use pipetransformer::terapipe::{
        MicroBatchSlicing, PlannerConfig, SliceSchedule, SlicingProfile, peak_memory_bytes, plan_slices,
    };
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    // Many heads over a narrow width: the attention scores slicing saves outweigh the
    // key/value arenas it costs.
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config =
        ModelConfig::Gpt(GptConfig { n_embd: 8, n_head: 8, n_positions: 32, n_inner: Some(16), n_layer: 2, ..tiny });
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let host = pipetransformer::model::HostBatch::random(&config, 2, 32, 5);
    let micro = host.split(2).unwrap().swap_remove(0);
    let base =
        PipelineConfig { pipeline_len: 2, micro_batches: 2, schedule: ScheduleKind::Gpipe, ..Default::default() };
    // The planner's model of the pipeline's slowest stage.
    let units = unit_profiles(&dev, &mut model, &micro, false).unwrap();
    let profile = SlicingProfile::measure(&dev, &mut model, &micro).unwrap();
    let stages = Plan::time_cut(&base, &units, 0).unwrap();
    let memory = profile.pipeline_memory(&profile.stages(&units, &stages, micro.batch).unwrap(), &base, micro.batch);
    let planner = PlannerConfig { memory, schedule: SliceSchedule::Gpipe, ..PlannerConfig::new(2, host.seq, 2) };
    let peak = |slices: Vec<usize>| peak_memory_bytes(&planner, &vec![MicroBatchSlicing { samples: 1, slices }; 2]);
    let (finest, whole) = (peak(vec![1; host.seq]), peak(vec![host.seq]));
    assert!(finest < whole, "{finest} vs {whole}");
    for limit in [finest, (finest + whole) / 2, whole] {
        let request = PipelineConfig { memory_limit: Some(limit), ..base.clone() };
        let (planned, _) = plan_slices(&dev, &mut model, &micro, &request, &units, &stages).unwrap();
        let first = &planned.micro_batches[0];
        assert_eq!(planned.micro_batches.len(), 2, "{planned}");
        assert!(planned.micro_batches.iter().all(|m| m == first), "{planned}");
        assert_eq!(first.slices.iter().sum::<usize>(), host.seq);
        assert!(planned.peak_memory_bytes <= limit, "{planned}: limit {limit}");
    }
    let tight = PipelineConfig { memory_limit: Some(finest - 1), ..base };
    let e = plan_slices(&dev, &mut model, &micro, &tight, &units, &stages).unwrap_err().to_string();
    assert!(e.contains("pipeline.memory_limit") && e.contains("no slicing meets the memory limit"), "{e}");
}

/// Under 1F1B over token slices a stage keeps at most what the partition planned for it (its
/// sliced activations and the key/value arenas of the micro-batches resident at once), on
/// every device of pipelines of 2 to 4 stages: a schedule that held one micro-batch's arena
/// more than `in_flight` counts would overfill a memory limit the plan claims to meet.
#[test]
fn one_f_one_b_over_slices_keeps_within_the_planned_memory() {
    use pipetransformer::model::GptConfig;
    let (width, seq) = (8, 32);
    let ModelConfig::Gpt(tiny) = tiny_gpt(0.1) else { unreachable!() };
    let config = ModelConfig::Gpt(GptConfig {
        n_embd: width,
        n_head: 8,
        n_positions: seq,
        n_inner: Some(16),
        n_layer: 4,
        ..tiny
    });
    let host = pipetransformer::model::HostBatch::random(&config, 6, seq, 5);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    for k in 2..=4 {
        for m in [1, 2, 3, 6] {
            for slices in [vec![16, 16], vec![5, 20, 7], vec![8; 4]] {
                let plan = PipelineConfig {
                    pipeline_len: k,
                    micro_batches: m,
                    schedule: ScheduleKind::OneFOneB,
                    token_slices: slices.clone(),
                    ..Default::default()
                };
                let mut model = Model::new(&dev, &config, 1).unwrap();
                let micro = host.split(m).unwrap().swap_remove(0);
                let profiles = unit_profiles(&dev, &mut model, &micro, false).unwrap();
                let cpus = (0..k).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
                let mut pipeline = Pipeline::new(cpus, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
                let measured = pipeline.step(&host, 3, 1e-2, None).unwrap().peak_activations;
                let p = pipeline.plan();
                for (s, stage) in p.partition.stages.iter().enumerate() {
                    let state: usize = profiles[stage.clone()].iter().map(UnitProfile::state_bytes).sum();
                    let planned = p.partition.stage_memory[s] - state;
                    assert!(
                        4 * measured[s] <= planned,
                        "K = {k}, M = {m}, slices {slices:?}, stage {s}: measured {} B over the planned {planned} B",
                        4 * measured[s]
                    );
                }
            }
        }
    }
}
