//! The pipeline engine trains exactly as one device does: for every schedule, pipeline length,
//! micro-batch count and replica count, three AdamW steps (dropout on, clipping on) end with
//! the weights of three one-device steps; schedules agree with each other; a run that changes
//! plan twice follows the run that never does; failures stop the step cleanly.

mod common;
use common::params_rel;

use pipetransformer::device::{CpuDevice, Device, GpuDevice, Precision};
use pipetransformer::model::{Batch, GptConfig, HostBatch, Model, ModelConfig, Pooling, Unit};
use pipetransformer::optim::{Optimizer, OptimizerConfig, train_step};
use pipetransformer::pipeline::partition::UnitProfile;
use pipetransformer::pipeline::{Fault, Pipeline, PipelineConfig, Recompute, ScheduleKind};
use std::sync::Arc;

const STEPS: u64 = 3;
const LR: f64 = 1e-2;

fn adamw() -> OptimizerConfig {
    OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
}

/// A 4-layer GPT (11 units) with dropout, and a 6-sample batch of 7 tokens.
fn gpt() -> ModelConfig {
    let mut c = GptConfig::without_dropout(17, 9, 8, 4, 2);
    c.resid_pdrop = 0.1;
    c.attn_pdrop = 0.1;
    c.embd_pdrop = 0.1;
    ModelConfig::Gpt(c)
}

fn batch(config: &ModelConfig, samples: usize, step: u64) -> HostBatch {
    let mut parts: Vec<HostBatch> =
        (0..samples.div_ceil(2) as u64).map(|i| common::tiny_batch(config, 100 * step + i)).collect();
    let mut host = parts.remove(0);
    for p in parts {
        host.batch += p.batch;
        host.tokens.as_mut().unwrap().extend(p.tokens.unwrap());
        if let (Some(a), Some(b)) = (host.token_types.as_mut(), p.token_types) {
            a.extend(b);
        }
        if let (Some(a), Some(b)) = (host.attention_mask.as_mut(), p.attention_mask) {
            a.extend(b);
        }
        host.targets.extend(p.targets);
    }
    host
}

fn cpus(n: usize) -> Vec<CpuDevice<f32>> {
    (0..n).map(|i| CpuDevice::new(i, 1).unwrap()).collect()
}

/// `n` cpu devices computing on one pool of `threads` threads, as a run opens them.
fn pooled_cpus(n: usize, threads: usize) -> Vec<CpuDevice<f32>> {
    pooled_cpus_in(n, threads, Precision::F32)
}

fn pooled_cpus_in(n: usize, threads: usize, precision: Precision) -> Vec<CpuDevice<f32>> {
    let pool = pipetransformer::device::HostPool::shared("test", threads).unwrap();
    (0..n).map(|i| CpuDevice::sharing(i, pool.clone(), 1, precision).unwrap()).collect()
}

/// Emulated CUDA devices (f32 mode), each with its own thread-order seed.
fn emus(n: usize) -> Vec<GpuDevice> {
    (0..n).map(|i| pipetransformer::device::emu::device(i, Precision::F32, 1 + i as u64).unwrap()).collect()
}

fn profiles<D: Device>(model: &Model<D>, dev: &D) -> Vec<UnitProfile> {
    model
        .costs(dev, 7)
        .iter()
        .zip(model.units())
        .map(|(c, u)| UnitProfile::analytic(c, 2, 1e9, u.trainable()))
        .collect()
}

/// Parameters after `STEPS` one-device steps.
fn reference(config: &ModelConfig, samples: usize) -> Vec<(String, Vec<f64>)> {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, config, 7).unwrap();
    let mut opt = Optimizer::new(adamw()).unwrap();
    for step in 0..STEPS {
        let b = Batch::upload(&dev, model.spec(), &batch(config, samples, step), true, 1000 + step).unwrap();
        train_step(&dev, &mut model, &mut opt, &b, LR, Some(1.0)).unwrap();
    }
    model.params().iter().map(|p| (p.name.clone(), dev.download_f64(&p.value).unwrap())).collect()
}

fn pipeline(config: &ModelConfig, plan: PipelineConfig) -> Pipeline<CpuDevice<f32>> {
    let n = plan.pipeline_len * plan.replicas;
    pipeline_on(config, plan, cpus(n))
}

fn pipeline_on<D: Device>(config: &ModelConfig, plan: PipelineConfig, devices: Vec<D>) -> Pipeline<D> {
    let model = Model::new(&devices[0], config, 7).unwrap();
    let prof = profiles(&model, &devices[0]);
    Pipeline::new(devices, model, adamw(), plan, &prof).unwrap()
}

fn run(config: &ModelConfig, plan: PipelineConfig, samples: usize) -> Vec<(String, Vec<f64>)> {
    let n = plan.pipeline_len * plan.replicas;
    run_on(config, plan, samples, cpus(n))
}

fn run_on<D: Device>(
    config: &ModelConfig,
    plan: PipelineConfig,
    samples: usize,
    devices: Vec<D>,
) -> Vec<(String, Vec<f64>)> {
    let mut p = pipeline_on(config, plan, devices);
    for step in 0..STEPS {
        let s = p.step(&batch(config, samples, step), 1000 + step, LR, Some(1.0)).unwrap();
        assert!(s.applied && s.loss.is_finite());
    }
    p.parameters(0).unwrap()
}

/// Every schedule family; 1F1B second, zero bubble last.
const ALL_SCHEDULES: [ScheduleKind; 4] =
    [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZeroBubble];

fn cfg(k: usize, r: usize, m: usize, schedule: ScheduleKind) -> PipelineConfig {
    let chunks = if schedule == ScheduleKind::Interleaved { 2 } else { 1 };
    PipelineConfig {
        pipeline_len: k,
        replicas: r,
        micro_batches: m,
        schedule,
        chunks,
        memory_limit: None,
        token_slices: Vec::new(),
        recompute: Recompute::Off,
    }
}

#[test]
fn every_schedule_trains_like_one_device() {
    let config = gpt();
    let want = reference(&config, 6);
    for k in 1..=4 {
        for m in [1, 2, 3, 5] {
            let mut by_schedule = Vec::new();
            for schedule in ALL_SCHEDULES {
                let got = run(&config, cfg(k, 1, m, schedule), 6);
                let e = params_rel(&got, &want);
                assert!(e <= 1e-5, "{schedule} K={k} M={m}: weights differ from one device by {e:.2e}");
                by_schedule.push(got);
            }
            for other in &by_schedule[1..] {
                let e = params_rel(other, &by_schedule[0]);
                assert!(e <= 1e-6, "K={k} M={m}: schedules disagree by {e:.2e}");
            }
            // Zero bubble only moves each weight gradient's product later, in the same order:
            // the same bits as 1F1B.
            assert!(by_schedule[3] == by_schedule[1], "K={k} M={m}: zb-h1 and 1f1b differ");
        }
    }
}

/// Every step's workers count the actions they finish, alike step after step: the progress
/// the NCCL watchdog reads (a long step that goes on is not a stalled one).
#[test]
fn the_workers_count_the_actions_they_finish() {
    let config = gpt();
    let (k, m) = (2, 3);
    let mut p = pipeline(&config, cfg(k, 1, m, ScheduleKind::OneFOneB));
    let mut counts = vec![p.actions_finished()];
    for step in 0..2 {
        p.step(&batch(&config, 6, step), 1000 + step, LR, Some(1.0)).unwrap();
        counts.push(p.actions_finished());
    }
    let per_step = counts[1] - counts[0];
    // Each micro-batch's forward and backward on each stage at least.
    assert!(counts[0] == 0 && per_step >= (2 * k * m) as u64, "{counts:?}");
    assert_eq!(counts[2] - counts[1], per_step, "{counts:?}");
}

#[test]
fn the_same_holds_on_emulated_cuda_devices() {
    let config = gpt();
    let want = reference(&config, 6);
    for k in 1..=4 {
        for m in [1, 2, 3, 5] {
            for schedule in ALL_SCHEDULES {
                let got = run_on(&config, cfg(k, 1, m, schedule), 6, emus(k));
                let e = params_rel(&got, &want);
                assert!(e <= 1e-5, "cuda-emu {schedule} K={k} M={m}: weights differ from one cpu device by {e:.2e}");
            }
        }
    }
    for (k, r) in [(1, 2), (2, 2), (1, 3)] {
        let got = run_on(&config, cfg(k, r, 2, ScheduleKind::OneFOneB), 6, emus(k * r));
        let e = params_rel(&got, &want);
        assert!(e <= 1e-5, "cuda-emu R={r} K={k}: weights differ from one cpu device by {e:.2e}");
    }
    // Stages that recompute their activations run the same kernels a second time (the
    // emulator's thread orders differ between runs: compared within the tolerance).
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        let plan = PipelineConfig { recompute: Recompute::All, ..cfg(2, 1, 3, schedule) };
        let mut p = pipeline_on(&config, plan, emus(2));
        assert!(p.plan().partition.recomputed.iter().all(|r| !r.is_empty()));
        for step in 0..STEPS {
            assert!(p.step(&batch(&config, 6, step), 1000 + step, LR, Some(1.0)).unwrap().applied);
        }
        let e = params_rel(&p.parameters(0).unwrap(), &want);
        assert!(e <= 1e-5, "cuda-emu {schedule}, recomputing: weights differ from one cpu device by {e:.2e}");
    }
}

/// Zero bubble puts each linear layer's weight gradient off with the layer's input and output
/// gradient. Attention's q, k and v projections read one input: their put-off gradients keep
/// one copy of it between them (6 row blocks per attention unit: that input, dq, dk, dv, and the
/// output projection's input and output gradient; 8 when each kept its own). Added later, the
/// put-off products give the same bits as the backward adding them at once.
#[test]
fn put_off_weight_gradients_keep_attentions_input_once() {
    let config = gpt();
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let host = batch(&config, 6, 0);
    let grads = |defer: bool| {
        let mut model = Model::new(&dev, &config, 7).unwrap();
        let b = Batch::upload(&dev, model.spec(), &host, true, 1000).unwrap();
        let mut x = None;
        let mut saved = Vec::new();
        for unit in model.units() {
            let (y, s) = unit.forward(&dev, &b, x.take(), true, None).unwrap();
            saved.push(s);
            x = Some(y);
        }
        let mut dy = model.loss(&dev, &b, &x.unwrap(), Some(1.0)).unwrap().dlogits.unwrap();
        for (i, (unit, s)) in model.units_mut().iter_mut().zip(saved).enumerate().rev() {
            unit.defer_weight_grads(defer);
            match unit.backward(&dev, &b, s, dy, i > 0, None).unwrap() {
                Some(dx) => dy = dx,
                None => break,
            }
        }
        for unit in model.units_mut() {
            if let Unit::Attention(a) = unit {
                let block = b.rows() * a.query.out_dim;
                let want = if defer { 6 * block } else { 0 };
                assert_eq!(unit.deferred_elements(), want, "elements kept for put-off weight gradients");
            }
            if defer {
                unit.backward_weights(&dev).unwrap();
            }
        }
        model.params().iter().map(|p| p.grad.as_ref().map(|g| g.to_vec())).collect::<Vec<_>>()
    };
    assert!(grads(true) == grads(false), "put-off weight gradients differ from those added at once");
}

#[test]
fn replicas_train_like_one_device_on_the_same_global_batch() {
    for config in [gpt(), common::tiny_bert(Pooling::Mean, 0.1)] {
        let want = reference(&config, 6);
        for r in 1..=3 {
            for k in 1..=2 {
                for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
                    let got = run(&config, cfg(k, r, 2, schedule), 6);
                    let e = params_rel(&got, &want);
                    assert!(e <= 1e-5, "{schedule} R={r} K={k}: weights differ from one device by {e:.2e}");
                }
            }
        }
    }
}

/// A stage's last backward sends its units' gradients to be summed as it goes, in buckets of
/// at least `set_bucket_elements` values. One unit per bucket changes no bit with two replicas
/// (a + b either way) and stays within 1e-5 of one device with three (the ring's order of
/// addition follows its chunks, which follow the buckets); under every schedule family, zero
/// bubble included (whose weight gradients come after the last backward: one bucket per stage).
#[test]
fn gradients_summed_unit_by_unit_as_the_backward_goes_change_nothing() {
    let config = gpt();
    let want = reference(&config, 6);
    let run_with = |plan: PipelineConfig, bucket: usize| {
        let mut p = pipeline(&config, plan);
        p.set_bucket_elements(bucket);
        for step in 0..STEPS {
            assert!(p.step(&batch(&config, 6, step), 1000 + step, LR, Some(1.0)).unwrap().applied);
        }
        p.parameters(0).unwrap()
    };
    // With a frozen prefix too, ending inside the first stage (its backward stops there).
    let frozen_first = |plan: PipelineConfig, bucket: usize| {
        let mut p = pipeline(&config, plan);
        p.set_bucket_elements(bucket);
        p.freeze_prefix(2).unwrap();
        for step in 0..STEPS {
            assert!(p.step(&batch(&config, 6, step), 1000 + step, LR, Some(1.0)).unwrap().applied);
        }
        p.parameters(0).unwrap()
    };
    let plan = cfg(2, 2, 2, ScheduleKind::OneFOneB);
    assert!(frozen_first(plan.clone(), 1) == frozen_first(plan, usize::MAX), "a frozen prefix");
    for schedule in ALL_SCHEDULES {
        for (k, r) in [(1, 2), (2, 2), (1, 3)] {
            let per_unit = run_with(cfg(k, r, 2, schedule), 1);
            if r == 2 {
                assert!(per_unit == run_with(cfg(k, r, 2, schedule), usize::MAX), "{schedule} K={k} R={r}");
            }
            let e = params_rel(&per_unit, &want);
            assert!(e <= 1e-5, "{schedule} K={k} R={r}: weights differ from one device by {e:.2e}");
        }
    }
}

/// Recomputing activations in the backwards changes nothing a step gives, to the bit: loss,
/// gradient norm and per-unit norms at every step and the weights after, for GPipe, 1F1B and
/// interleaved, every stage recomputing all its trained units (`all`) or some stage only some
/// of them (`auto` under a memory limit), also with a frozen prefix ending inside the first
/// stage (dropout is on: the second forward must draw the first one's masks). And it keeps
/// less: every device's measured peak is within the partition's count of its stages, below the
/// plain run's where a recomputing stage holds several micro-batches, and a partial
/// recomputation's no lower than `all`'s.
/// Without a frozen prefix, each stage of GPipe and 1F1B is counted within one micro-batch's
/// input (the first recomputed unit keeps its input), and stage 0 (the embeddings read the
/// batch: nothing kept) exactly; the last stage's logits' gradients, held from the loss on
/// whether the head recomputes or not, are counted and measured. Zero bubble is refused.
#[test]
fn recomputed_activations_train_to_the_bit_and_keep_less() {
    let config = gpt();
    let batches = step_batches(&config, 12, 6, 3);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let units = profiles(&Model::new(&dev, &config, 7).unwrap(), &dev);
    let state = |r: &std::ops::Range<usize>| units[r.clone()].iter().map(UnitProfile::state_bytes).sum::<usize>();
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
        let plain_config = cfg(2, 1, 3, schedule);
        let all_config = PipelineConfig { recompute: Recompute::All, ..plain_config.clone() };
        let partial_config = common::partial_recompute(&plain_config, &units);
        for frozen in [0, 2] {
            let run = |plan: &PipelineConfig| {
                let mut p = pipeline(&config, plan.clone());
                p.freeze_prefix(frozen).unwrap();
                let steps: Vec<_> = batches
                    .iter()
                    .enumerate()
                    .map(|(s, h)| p.step(h, 1000 + s as u64, LR, Some(1.0)).unwrap())
                    .collect();
                (steps, p.parameters(0).unwrap(), p.plan().clone())
            };
            let (plain, plain_weights, plain_plan) = run(&plain_config);
            assert!(plain_plan.partition.recomputed.iter().all(|r| r.is_empty()));
            let mut all_measured = Vec::new();
            for (policy, plan_config) in [("all", &all_config), ("auto", &partial_config)] {
                let (again, again_weights, plan) = run(plan_config);
                let what = format!("{schedule}, {frozen} units frozen, recompute {policy}");
                let p = &plan.partition;
                assert_eq!(p.stages, plain_plan.partition.stages, "{what}");
                for (s, (stage, again)) in p.stages.iter().zip(&p.recomputed).enumerate() {
                    let whole = stage.start..stage.end;
                    assert!(policy == "auto" || *again == whole, "{what}, stage {s}: {again:?}");
                }
                for (s, (a, b)) in plain.iter().zip(&again).enumerate() {
                    assert!(a.applied && b.applied, "{what}, step {s}");
                    assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}, step {s}: loss");
                    assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{what}, step {s}: gradient norm");
                    assert!(a.unit_grad_sq == b.unit_grad_sq, "{what}, step {s}: per-unit norms");
                }
                assert!(plain_weights == again_weights, "{what}: weights");
                // What each device kept, against the partition's count of its stages (the plan
                // was made before the freeze, with every unit trained: a bound).
                let (measured, plain_measured) = (&again[2].peak_activations, &plain[2].peak_activations);
                let mut per_device = [0usize; 2];
                let (mut recomputing, mut less_than_all) = ([false; 2], [false; 2]);
                for (s, r) in p.stages.iter().enumerate() {
                    per_device[s % 2] += p.stage_memory[s] - state(r);
                    recomputing[s % 2] |= !p.recomputed_units(s, frozen).is_empty();
                    // (What `all` recomputes once the freeze trims it: the stage's trained units.)
                    let all = r.start.max(frozen).min(r.end)..r.end;
                    less_than_all[s % 2] |= p.recomputed_units(s, frozen).len() < all.len();
                }
                for d in 0..2 {
                    let (kept, counted) = (4 * measured[d], per_device[d]);
                    assert!(kept <= counted, "{what}, device {d}: {kept} B over {counted} B");
                    // (1F1B's last stage holds one micro-batch: recomputing keeps no less there.)
                    let several = schedule != ScheduleKind::OneFOneB || d == 0;
                    assert!(measured[d] <= plain_measured[d], "{what}: {measured:?} vs {plain_measured:?}");
                    if recomputing[d] && several {
                        assert!(measured[d] < plain_measured[d], "{what}: {measured:?} vs {plain_measured:?}");
                    }
                }
                if policy == "all" {
                    assert!(recomputing[0], "{what}");
                    all_measured = measured.clone();
                } else {
                    for d in 0..2 {
                        let several = schedule != ScheduleKind::OneFOneB || d == 0;
                        let fewer = less_than_all[d] && several;
                        let (a, b) = (measured[d], all_measured[d]);
                        assert!(a >= b && (a > b || !fewer), "{what}, device {d}: {measured:?} vs {all_measured:?}");
                    }
                }
                if frozen > 0 || schedule == ScheduleKind::Interleaved {
                    continue;
                }
                for (s, stage) in p.stages.iter().enumerate() {
                    let (kept, counted) = (4 * measured[s], p.stage_memory[s] - state(stage));
                    // Over-counted: one micro-batch's input to the recomputed units (the one
                    // whose backward runs holds its activations instead).
                    let again = &p.recomputed[s];
                    let input = if again.is_empty() { 0 } else { units[again.start].input_bytes };
                    assert!(
                        counted - kept <= input,
                        "{what}, stage {s}: measured {kept} B, counted {counted} B (slack {input} B)"
                    );
                }
                assert_eq!(4 * measured[0], p.stage_memory[0] - state(&p.stages[0]), "{what}");
            }
        }
    }
    let model = Model::new(&dev, &config, 7).unwrap();
    let zb = PipelineConfig { recompute: Recompute::Auto, ..cfg(2, 1, 3, ScheduleKind::ZeroBubble) };
    let e =
        Pipeline::new(cpus(2), model, adamw(), zb, &units).err().expect("zero bubble with recomputation").to_string();
    assert!(e.contains("zb-h1") && e.contains("recompute"), "{e}");
}

#[test]
fn supplied_communicators_replace_the_host_ring() {
    use pipetransformer::comm::{Communicator, ring_group};
    use std::sync::Arc;
    let config = gpt();
    let want = reference(&config, 6);
    let (k, r) = (2, 3);
    let mut p = pipeline(&config, cfg(k, r, 2, ScheduleKind::OneFOneB));
    // A sum per unit, started as each unit's backward ends.
    p.set_bucket_elements(1);
    // Each member counts the `complete` calls (the runtime must wait for a device
    // communicator's sums before the optimizer reads them: NCCL runs them on its own stream)
    // and the sums.
    use std::sync::atomic::AtomicUsize;
    struct Counting(pipetransformer::comm::RingCommunicator, AtomicUsize, AtomicUsize);
    type Buf = <CpuDevice<f32> as Device>::Buf;
    impl Communicator<CpuDevice<f32>> for Counting {
        fn rank(&self) -> usize {
            Communicator::<CpuDevice<f32>>::rank(&self.0)
        }
        fn size(&self) -> usize {
            Communicator::<CpuDevice<f32>>::size(&self.0)
        }
        fn name(&self) -> String {
            "counting ring".into()
        }
        fn all_reduce_sum(&self, dev: &CpuDevice<f32>, bufs: &mut [&mut Buf]) -> pipetransformer::Result<()> {
            self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.all_reduce_sum(dev, bufs)
        }
        fn complete(&self, _: &CpuDevice<f32>) -> pipetransformer::Result<()> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
        fn broadcast(&self, dev: &CpuDevice<f32>, buf: &mut Buf, root: usize) -> pipetransformer::Result<()> {
            self.0.broadcast(dev, buf, root)
        }
    }
    let members: Vec<Vec<Arc<Counting>>> = (0..k)
        .map(|_| ring_group(r).into_iter().map(|m| Arc::new(Counting(m, 0.into(), 0.into()))).collect())
        .collect();
    let groups: Vec<Vec<Arc<dyn Communicator<CpuDevice<f32>>>>> = members
        .iter()
        .map(|g| g.iter().map(|m| m.clone() as Arc<dyn Communicator<CpuDevice<f32>>>).collect())
        .collect();
    // A group of the wrong size is refused.
    let wrong: Vec<Vec<Arc<dyn Communicator<CpuDevice<f32>>>>> = vec![];
    assert!(p.set_communicators(Some(wrong)).unwrap_err().to_string().contains("one per pipeline position"));
    p.set_communicators(Some(groups)).unwrap();
    for step in 0..STEPS {
        p.step(&batch(&config, 6, step), 1000 + step, LR, Some(1.0)).unwrap();
    }
    let e = params_rel(&p.parameters(0).unwrap(), &want);
    assert!(e <= 1e-5, "weights differ from one device by {e:.2e}");
    assert_eq!(p.parameters(2).unwrap(), p.parameters(0).unwrap(), "replicas diverged");
    let units: Vec<usize> = (0..k).map(|s| p.plan().partition.stages[s].len()).collect();
    for (s, m) in members.iter().enumerate().flat_map(|(s, g)| g.iter().map(move |m| (s, m))) {
        assert_eq!(m.1.load(std::sync::atomic::Ordering::Relaxed), STEPS as usize, "one wait per step and device");
        let sums = m.2.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(sums, STEPS as usize * units[s], "stage {s}: one sum per unit and step");
    }
}

#[test]
fn replanning_twice_mid_run_follows_the_same_trajectory() {
    let config = gpt();
    let steps = 6;
    let mut fixed = pipeline(&config, cfg(2, 1, 2, ScheduleKind::OneFOneB));
    let mut moving = pipeline_on(&config, cfg(2, 1, 2, ScheduleKind::OneFOneB), cpus(4));
    let prof = {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        profiles(&Model::new(&dev, &config, 7).unwrap(), &dev)
    };
    for step in 0..steps {
        if step == 2 {
            moving.replan(cfg(3, 1, 3, ScheduleKind::Gpipe), &prof, 0).unwrap();
        }
        if step == 4 {
            // A plan the devices cannot hold is refused and the old plan stays in force.
            let e = moving.replan(cfg(5, 1, 2, ScheduleKind::OneFOneB), &prof, 0).unwrap_err().to_string();
            assert!(e.contains("need 5 devices; 4 available"), "{e}");
            assert_eq!(moving.plan().config.pipeline_len, 3);
            // So is a pinned prefix that leaves the other stages nothing to hold.
            let e = moving.replan(cfg(2, 1, 2, ScheduleKind::Gpipe), &prof, prof.len()).unwrap_err().to_string();
            assert!(e.contains("cannot be cut from the model's 0 active units"), "{e}");
            assert_eq!(moving.plan().config.pipeline_len, 3);
            moving.replan(cfg(2, 2, 1, ScheduleKind::Interleaved), &prof, 0).unwrap();
        }
        let b = batch(&config, 6, step);
        let a = fixed.step(&b, 1000 + step, LR, Some(1.0)).unwrap();
        let c = moving.step(&b, 1000 + step, LR, Some(1.0)).unwrap();
        assert!((a.loss - c.loss).abs() <= 1e-5 * a.loss.abs(), "step {step}: loss {} vs {}", c.loss, a.loss);
    }
    let e = params_rel(&moving.parameters(0).unwrap(), &fixed.parameters(0).unwrap());
    assert!(e <= 1e-5, "re-planned run drifted by {e:.2e}");
}

#[test]
fn a_failing_worker_stops_the_step_with_its_error_and_changes_nothing() {
    let config = gpt();
    for (panic, device, action) in [(false, 1, 3), (true, 2, 0), (false, 0, 5), (true, 3, 7)] {
        // Workers on threads of their own, and on the threads of a pool their devices share
        // (where waits lend the thread instead of sleeping, and must still see the abort).
        for mut p in [
            pipeline(&config, cfg(2, 2, 2, ScheduleKind::OneFOneB)),
            pipeline_on(&config, cfg(2, 2, 2, ScheduleKind::OneFOneB), pooled_cpus(4, 4)),
        ] {
            let before = p.parameters(0).unwrap();
            p.set_fault(Some(Fault { device, action, panic }));
            let e = p.step(&batch(&config, 6, 0), 1000, LR, Some(1.0)).unwrap_err().to_string();
            assert!(e.contains(&format!("device {device}")), "{e}");
            assert!(e.contains(if panic { "panicked" } else { "injected" }), "{e}");
            assert_eq!(p.parameters(0).unwrap(), before, "an optimizer step was applied");
            // The pipeline is still usable.
            p.set_fault(None);
            p.step(&batch(&config, 6, 0), 1000, LR, Some(1.0)).unwrap();
        }
    }
}

/// Devices that share one pool run the workers on its threads, and a waiting worker computes
/// pieces of the others' ops: which thread computes a piece changes nothing. Loss, gradient
/// norm and weights at every step are those of devices with a thread each, to the bit, for
/// every schedule and with replicas; where the pool has fewer threads than workers, the step
/// runs them on threads of their own instead, with the same result.
#[test]
fn devices_sharing_one_pool_train_bitwise_as_devices_with_their_own() {
    let config = gpt();
    for (k, r, m, threads) in [(2, 1, 4, 2), (1, 2, 2, 2), (2, 2, 2, 4), (3, 1, 3, 2)] {
        for schedule in ALL_SCHEDULES {
            let plan = cfg(k, r, m, schedule);
            let mut own = pipeline(&config, plan.clone());
            let mut pooled = pipeline_on(&config, plan, pooled_cpus(k * r, threads));
            for step in 0..STEPS {
                let host = batch(&config, 6, step);
                let (a, b) = (
                    own.step(&host, 1000 + step, LR, Some(1.0)).unwrap(),
                    pooled.step(&host, 1000 + step, LR, Some(1.0)).unwrap(),
                );
                let what = format!("K={k} R={r} M={m} {schedule} step {step}");
                assert_eq!(
                    (a.loss.to_bits(), a.grad_norm.to_bits()),
                    (b.loss.to_bits(), b.grad_norm.to_bits()),
                    "{what}"
                );
                assert!(!a.pooled, "{what}: devices with pools of their own");
                assert_eq!(b.pooled, k * r <= threads, "{what}: on the pool's threads where it has one per worker");
            }
            assert!(own.parameters(0).unwrap() == pooled.parameters(0).unwrap(), "K={k} R={r} M={m} {schedule}");
        }
    }
    // bf16 products (whose row blocks follow the pool's thread count) too.
    let bf16 = |n: usize| -> Vec<CpuDevice<f32>> {
        (0..n).map(|i| CpuDevice::with_precision(i, 1, Precision::Bf16).unwrap()).collect()
    };
    let plan = cfg(2, 1, 4, ScheduleKind::OneFOneB);
    let mut own = pipeline_on(&config, plan.clone(), bf16(2));
    let mut pooled = pipeline_on(&config, plan, pooled_cpus_in(2, 2, Precision::Bf16));
    for step in 0..STEPS {
        let host = batch(&config, 6, step);
        let (a, b) = (
            own.step(&host, 1000 + step, LR, Some(1.0)).unwrap(),
            pooled.step(&host, 1000 + step, LR, Some(1.0)).unwrap(),
        );
        assert_eq!(
            (a.loss.to_bits(), a.grad_norm.to_bits()),
            (b.loss.to_bits(), b.grad_norm.to_bits()),
            "bf16 step {step}"
        );
        assert!(b.pooled);
    }
    assert!(own.parameters(0).unwrap() == pooled.parameters(0).unwrap(), "bf16");
    // The planner reckons with the threads the profiles ran on: all of the shared pool's, so
    // one device at work computes at that speed and each of two at half of it.
    let p = pipeline_on(&config, cfg(2, 1, 2, ScheduleKind::OneFOneB), pooled_cpus(2, 2));
    assert_eq!([p.lent_speed(1), p.lent_speed(2)], [1.0, 0.5]);
}

#[test]
fn bad_requests_are_refused_before_any_work() {
    let config = gpt();
    let devices = cpus(4);
    let model = Model::new(&devices[0], &config, 7).unwrap();
    let prof = profiles(&model, &devices[0]);
    let refuse = |plan: PipelineConfig, n: usize| {
        let model = Model::new(&devices[0], &config, 7).unwrap();
        Pipeline::new(cpus(n), model, adamw(), plan, &prof).err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(refuse(cfg(12, 1, 2, ScheduleKind::OneFOneB), 12).contains("11 active units"));
    assert!(refuse(cfg(2, 3, 2, ScheduleKind::OneFOneB), 4).contains("need 6 devices; 4 available"));
    assert!(refuse(cfg(2, 1, 0, ScheduleKind::OneFOneB), 4).contains("micro_batches"));
    // Sizes that would overflow are refused, not wrapped (to 0 stages, say).
    let chunks = PipelineConfig { chunks: usize::MAX / 2 + 1, ..cfg(2, 1, 2, ScheduleKind::Interleaved) };
    assert!(refuse(chunks, 4).contains("chunks of stages cannot be cut"));
    assert!(refuse(cfg(2, usize::MAX, 2, ScheduleKind::OneFOneB), 4).contains("need more devices; 4 available"));
    let tight = PipelineConfig { memory_limit: Some(1 << 10), ..cfg(2, 1, 2, ScheduleKind::OneFOneB) };
    assert!(refuse(tight, 4).contains("memory_limit"));
    let mut p = Pipeline::new(devices, model, adamw(), cfg(2, 2, 2, ScheduleKind::OneFOneB), &prof).unwrap();
    let e = p.step(&batch(&config, 1, 0).split(2).unwrap()[0], 1, LR, None).unwrap_err().to_string();
    assert!(e.contains("1 sample cannot feed 2 replicas"), "{e}");
    // Too short for the micro-batches (an epoch's last batch): fewer of them, same result.
    let short = p.step(&batch(&config, 2, 0), 1, LR, None).unwrap();
    assert_eq!(p.plan().config.micro_batches, 2, "the plan is kept");
    assert!(short.loss.is_finite());
}

/// A step's loss and gradient norm against one device's `(loss, norm)`, within 1e-5 relative.
fn like_one_device(what: &str, got: &pipetransformer::pipeline::PipelineStep, (loss, norm): (f64, f64)) {
    assert!((got.loss - loss).abs() <= 1e-5 * loss, "{what}: loss {} vs {loss}", got.loss);
    assert!((got.grad_norm - norm).abs() <= 1e-5 * norm, "{what}: gradient norm {} vs {norm}", got.grad_norm);
}

/// `STEPS` training batches of `batch` samples from a pool of `n` (seed `seed`): the pool's
/// first two batches, alternating (GPT samples count different numbers of targets).
fn step_batches(config: &ModelConfig, n: usize, batch: usize, seed: u64) -> Vec<HostBatch> {
    use pipetransformer::train::BatchSource;
    let data = common::Pool::new(config, n, batch, seed);
    (0..STEPS as usize).map(|i| data.train_batch(0, i % 2).unwrap()).collect()
}

/// Loss and gradient norm of one-device steps on `batches` (seeds 1000, 1001, ...), and the
/// parameters after them: what every pipelined or multi-process run must reproduce.
#[allow(clippy::type_complexity)]
fn one_device(config: &ModelConfig, batches: &[HostBatch]) -> (Vec<(f64, f64)>, Vec<(String, Vec<f64>)>) {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, config, 7).unwrap();
    let mut opt = Optimizer::new(adamw()).unwrap();
    let per_step = batches
        .iter()
        .enumerate()
        .map(|(s, host)| {
            let b = Batch::upload(&dev, model.spec(), host, true, 1000 + s as u64).unwrap();
            let st = train_step(&dev, &mut model, &mut opt, &b, LR, Some(1.0)).unwrap();
            (st.loss, st.grad_norm)
        })
        .collect();
    let params = model.params().iter().map(|p| (p.name.clone(), dev.download_f64(&p.value).unwrap())).collect();
    (per_step, params)
}

/// Loss and gradient norm at every step, not only the weights after clipped AdamW (which would
/// hide a gradient off by a constant factor): GPT batches whose samples count different numbers
/// of targets, so a micro-batch or replica weighted by its own target count instead of the
/// global batch's would show.
#[test]
fn loss_and_gradient_norm_follow_one_device_at_every_step_with_unequal_targets() {
    let config = gpt();
    let batches = step_batches(&config, 12, 6, 3);
    let counts: Vec<usize> = batches[0].split(6).unwrap().iter().map(HostBatch::target_count).collect();
    assert!(counts.iter().any(|&c| c != counts[0]), "samples must count different targets: {counts:?}");
    let (want, _) = one_device(&config, &batches);
    for (k, r, m) in [(1, 2, 1), (2, 1, 3), (2, 2, 2), (3, 1, 2), (1, 3, 2), (3, 2, 1)] {
        for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
            let mut p = pipeline(&config, cfg(k, r, m, schedule));
            for (s, host) in batches.iter().enumerate() {
                let got = p.step(host, 1000 + s as u64, LR, Some(1.0)).unwrap();
                let norm = want[s].1;
                like_one_device(&format!("K={k} R={r} M={m} {schedule} step {s}"), &got, want[s]);
                let units: f64 = got.unit_grad_sq.iter().sum();
                assert!((units.sqrt() - got.grad_norm).abs() <= 1e-9 * norm, "per-unit norms add up to the global one");
            }
        }
    }
}

#[test]
fn pipelined_evaluation_gives_each_batch_what_one_device_gives_it() {
    use pipetransformer::train::BatchSource;
    let config = common::tiny_bert(Pooling::Mean, 0.1);
    let data = common::Pool::new(&config, 30, 5, 4);
    let batches: Vec<HostBatch> = (0..6).map(|i| data.train_batch(0, i).unwrap()).collect();
    let one = pipeline(&config, cfg(1, 1, 1, ScheduleKind::OneFOneB));
    let want: Vec<_> = batches.iter().map(|b| one.evaluate(0, b).unwrap()).collect();
    // Devices with pools of their own (a thread per stage), and sharing one pool, as a run
    // opens them (the stages on its threads).
    let setups = [(1, 1, false), (2, 1, false), (3, 1, false), (2, 2, false), (2, 1, true), (3, 1, true), (2, 2, true)];
    for (k, r, pooled) in setups {
        let plan = cfg(k, r, 1, ScheduleKind::OneFOneB);
        let p = if pooled { pipeline_on(&config, plan, pooled_cpus(k * r, 3)) } else { pipeline(&config, plan) };
        for replica in 0..r {
            let mut queue = batches.clone().into_iter();
            let mut got = Vec::new();
            let mut on_pool = Vec::new();
            p.evaluate_all(replica, &mut || queue.next().map(Ok), &mut |host, out| {
                got.push((host.sample_ids.clone(), out));
                on_pool.push(rayon::current_thread_index().is_some());
                Ok(())
            })
            .unwrap();
            // On a pool's threads wherever the devices have one in common (one device, its own).
            let common = pooled || k * r == 1;
            assert!(on_pool.iter().all(|&on| on == common), "K={k} R={r} pooled {pooled}: {on_pool:?}");
            assert_eq!(got.len(), batches.len(), "K={k} R={r} pooled {pooled}");
            for ((ids, out), (b, w)) in got.iter().zip(batches.iter().zip(&want)) {
                assert_eq!(ids, &b.sample_ids, "K={k} pooled {pooled}: batches come back in order");
                assert_eq!(
                    out, w,
                    "K={k} R={r} pooled {pooled} replica {replica}: the same loss and logits, bit for bit"
                );
            }
        }
        // A batch that fails to load ends the evaluation with its error, after the ones before.
        let mut queue = batches
            .clone()
            .into_iter()
            .map(Ok)
            .take(2)
            .chain([Err(pipetransformer::Error::Data { what: "batch 2".into(), message: "unreadable".into() })]);
        let mut seen = 0;
        let err = p.evaluate_all(0, &mut || queue.next(), &mut |_, _| {
            seen += 1;
            Ok(())
        });
        assert!(err.unwrap_err().to_string().contains("unreadable"), "K={k} pooled {pooled}");
        assert_eq!(seen, 2, "K={k} pooled {pooled}");
        // A failing `each` ends it with its own error, the stages before stopping too.
        let mut queue = batches.clone().into_iter().map(Ok);
        let err = p.evaluate_all(0, &mut || queue.next(), &mut |_, _| {
            Err(pipetransformer::Error::Data { what: "metrics".into(), message: "full".into() })
        });
        assert!(err.unwrap_err().to_string().contains("full"), "K={k} pooled {pooled}");
    }
}

/// `size` members of one process group meeting on loopback, one per thread.
fn process_group(size: usize) -> Vec<Arc<pipetransformer::comm::process_group::ProcessGroup>> {
    process_group_waiting(size, std::time::Duration::from_secs(30))
}

/// [`process_group`] whose collectives wait at most `timeout` for a peer.
fn process_group_waiting(
    size: usize,
    timeout: std::time::Duration,
) -> Vec<Arc<pipetransformer::comm::process_group::ProcessGroup>> {
    use pipetransformer::comm::process_group::ProcessGroup;
    use pipetransformer::comm::rendezvous::Secret;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (addr, secret) = (format!("127.0.0.1:{port}"), Secret::new("test").unwrap());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|r| {
                let (addr, secret) = (&addr, &secret);
                s.spawn(move || Arc::new(ProcessGroup::join(addr, r, size, secret, timeout).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn processes_train_like_one_device_with_loss_and_norm_at_every_step() {
    let config = gpt();
    let batches = step_batches(&config, 24, 12, 5);
    let (want, reference) = one_device(&config, &batches);
    // (processes, K, R per process): 2 and 4 processes, pipelines and in-process replicas inside.
    // (R = 1 here: the workers sum over the processes unit by unit as the backward goes, in
    // buckets of 2²⁰ values or of one unit, over a ring per pipeline position where K > 1;
    // with in-process replicas, after the step.)
    for (procs, k, r, bucket) in
        [(2, 1, 1, 1 << 20), (2, 1, 1, 1), (2, 2, 1, 1), (2, 2, 1, 1 << 20), (4, 2, 1, 1), (4, 1, 1, 1), (2, 1, 2, 1)]
    {
        let what = format!("{procs} processes K={k} R={r}");
        train_processes_like_one_device(&what, &process_group(procs), &batches, &want, &reference, |member| {
            let mut p = pipeline(&config, cfg(k, r, 2, ScheduleKind::OneFOneB));
            p.set_process_group(Some(member.clone())).unwrap();
            p.set_bucket_elements(bucket);
            assert_eq!(p.sums_during_backward(), r == 1, "{what}");
            p
        });
    }
}

/// Trains `batches` on every member of `group` (threads standing for processes), each on the
/// pipeline `setup` gives it: each step's loss and gradient norm as one device's (`want`),
/// bitwise the same weights on every process, within 1e-5 of one device's (`reference`).
fn train_processes_like_one_device(
    what: &str,
    group: &[Arc<pipetransformer::comm::process_group::ProcessGroup>],
    batches: &[HostBatch],
    want: &[(f64, f64)],
    reference: &[(String, Vec<f64>)],
    setup: impl Fn(&Arc<pipetransformer::comm::process_group::ProcessGroup>) -> Pipeline<CpuDevice<f32>> + Sync,
) {
    let finals: Vec<Vec<(String, Vec<f64>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .iter()
            .map(|member| {
                let setup = &setup;
                s.spawn(move || {
                    let mut p = setup(member);
                    for (step, host) in batches.iter().enumerate() {
                        let got = p.step(host, 1000 + step as u64, LR, Some(1.0)).unwrap();
                        like_one_device(&format!("{what}, rank {} step {step}", member.rank()), &got, want[step]);
                    }
                    p.parameters(0).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for f in &finals {
        assert_eq!(f, &finals[0], "{what}: the processes hold bitwise the same weights");
    }
    let rel = params_rel(&finals[0], reference);
    assert!(rel <= 1e-5, "{what}: weights differ from one device by {rel:e}");
}

/// A communicator spanning processes, for cpu devices: what NCCL over every GPU of a launched
/// run is to its processes. Each bucket crosses a process group with one member per replica
/// of every process.
struct Spanning(Arc<pipetransformer::comm::process_group::ProcessGroup>);

impl pipetransformer::comm::Communicator<CpuDevice<f32>> for Spanning {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn name(&self) -> String {
        "spanning".into()
    }
    fn all_reduce_sum(
        &self,
        dev: &CpuDevice<f32>,
        bufs: &mut [&mut <CpuDevice<f32> as Device>::Buf],
    ) -> pipetransformer::Result<()> {
        for b in bufs.iter_mut() {
            let mut v = dev.download(b)?;
            self.0.all_reduce_sum_f32(&mut v)?;
            **b = dev.upload(&v)?;
        }
        Ok(())
    }
    fn broadcast(
        &self,
        dev: &CpuDevice<f32>,
        buf: &mut <CpuDevice<f32> as Device>::Buf,
        root: usize,
    ) -> pipetransformer::Result<()> {
        let mut v = dev.download(buf)?;
        if self.0.rank() != root {
            v.fill(0.0);
        }
        self.0.all_reduce_sum_f32(&mut v)?;
        *buf = dev.upload(&v)?;
        Ok(())
    }
}

/// Processes of a launched run whose communicators span them (NCCL over every GPU of the run)
/// sum each replica of each process once, on those communicators as the backward goes, and
/// nothing more after the step: loss and gradient norm as one device's at every step, with
/// one replica per process and with two. Groups that do not fit are refused by name.
#[test]
fn communicators_spanning_processes_sum_every_replica_once() {
    use pipetransformer::comm::Communicator;
    let config = gpt();
    let batches = step_batches(&config, 24, 12, 5);
    let (want, reference) = one_device(&config, &batches);
    for (procs, r) in [(2, 1), (2, 2)] {
        let (group, members) = (process_group(procs), process_group(procs * r));
        let what = format!("{procs} processes R={r}");
        train_processes_like_one_device(&what, &group, &batches, &want, &reference, |member| {
            let mut p = pipeline(&config, cfg(1, r, 2, ScheduleKind::OneFOneB));
            p.set_process_group(Some(member.clone())).unwrap();
            let mine = |at: usize| -> Vec<Arc<dyn Communicator<CpuDevice<f32>>>> {
                (0..r).map(|i| Arc::new(Spanning(members[at * r + i].clone())) as _).collect()
            };
            if member.rank() == 0 {
                // Another process's members: refused.
                let e = p.set_communicators(Some(vec![mine(1)])).unwrap_err().to_string();
                assert!(e.contains(&format!("ranked 0..{r} of {}", procs * r)), "{e}");
            }
            p.set_communicators(Some(vec![mine(member.rank())])).unwrap();
            assert!(p.communicators_span_processes() && p.sums_during_backward());
            assert_eq!(p.communicator(), "spanning");
            p
        });
    }
    // Spanning groups need one stage per process.
    let group = process_group(2);
    std::thread::scope(|s| {
        for member in &group {
            s.spawn(move || {
                let mut p = pipeline(&gpt(), cfg(2, 1, 2, ScheduleKind::OneFOneB));
                p.set_process_group(Some(member.clone())).unwrap();
                let span = || Arc::new(Spanning(member.clone())) as Arc<dyn Communicator<CpuDevice<f32>>>;
                let e = p.set_communicators(Some(vec![vec![span()], vec![span()]])).unwrap_err().to_string();
                assert!(e.contains("pipeline_len = 1"), "{e}");
            });
        }
    });
}

/// A spanning communicator whose collectives wait for a peer that never comes, as NCCL's do
/// when a process is gone: only an abort ends the wait.
struct Stuck {
    rank: usize,
    size: usize,
    aborted: std::sync::Mutex<bool>,
    woken: std::sync::Condvar,
}

impl pipetransformer::comm::Communicator<CpuDevice<f32>> for Stuck {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> String {
        "stuck".into()
    }
    fn all_reduce_sum(
        &self,
        _: &CpuDevice<f32>,
        _: &mut [&mut <CpuDevice<f32> as Device>::Buf],
    ) -> pipetransformer::Result<()> {
        let mut aborted = self.aborted.lock().unwrap();
        while !*aborted {
            aborted = self.woken.wait(aborted).unwrap();
        }
        Err(pipetransformer::Error::Device { what: "stuck".into(), message: "aborted".into() })
    }
    fn broadcast(
        &self,
        _: &CpuDevice<f32>,
        _: &mut <CpuDevice<f32> as Device>::Buf,
        _: usize,
    ) -> pipetransformer::Result<()> {
        Ok(())
    }
    fn abort(&self) {
        *self.aborted.lock().unwrap() = true;
        self.woken.notify_all();
    }
}

/// A collective on communicators spanning the processes that never ends (a lost peer: NCCL has
/// no timeout) is aborted by the step's watchdog once the step has made no progress for the
/// group's timeout, and the step fails saying so, on every process, instead of hanging.
#[test]
fn spanning_collectives_that_never_end_are_aborted_at_the_timeout() {
    use pipetransformer::comm::Communicator;
    let config = gpt();
    let batches = step_batches(&config, 24, 12, 1);
    let group = process_group_waiting(2, std::time::Duration::from_millis(500));
    let (done, finished) = std::sync::mpsc::channel();
    for member in group {
        let (done, config, host) = (done.clone(), config.clone(), batches[0].clone());
        // Detached: were the feature gone, these would hang, and the test fails below instead.
        std::thread::spawn(move || {
            let mut p = pipeline(&config, cfg(1, 1, 2, ScheduleKind::OneFOneB));
            p.set_process_group(Some(member.clone())).unwrap();
            let stuck = Stuck { rank: member.rank(), size: 2, aborted: Default::default(), woken: Default::default() };
            p.set_communicators(Some(vec![vec![Arc::new(stuck) as Arc<dyn Communicator<CpuDevice<f32>>>]])).unwrap();
            let _ = done.send(p.step(&host, 1, LR, Some(1.0)).map(|_| ()).map_err(|e| e.to_string()));
        });
    }
    for _ in 0..2 {
        let got = finished.recv_timeout(std::time::Duration::from_secs(60)).expect("a step hung");
        let e = got.expect_err("a step whose collectives never end must fail");
        assert!(e.contains("made no progress") && e.contains("PT_COLLECTIVE_TIMEOUT"), "{e}");
    }
}

/// Processes that time their units may cut different stages: each position's buckets then
/// differ across the processes, so such a step sums after the step, as a whole, instead of on
/// the per-position rings, and still trains as one device does (loss and gradient norm at
/// every step), with bitwise the same weights on each process.
#[test]
fn processes_that_cut_different_stages_still_sum_right() {
    let config = gpt();
    let batches = step_batches(&config, 24, 12, 5);
    let (want, reference) = one_device(&config, &batches);
    let group = process_group(2);
    // Per process: its stages and its weights.
    type Outcome = (Vec<std::ops::Range<usize>>, Vec<(String, Vec<f64>)>);
    let finals: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .iter()
            .map(|member| {
                let (batches, want, config) = (&batches, &want, &config);
                s.spawn(move || {
                    let devices = cpus(2);
                    let model = Model::new(&devices[0], config, 7).unwrap();
                    let mut prof = profiles(&model, &devices[0]);
                    // Rank 1 times its first unit far slower: its first stage ends sooner.
                    prof[0].forward *= (1 + 50 * member.rank()) as f64;
                    let plan = cfg(2, 1, 2, ScheduleKind::OneFOneB);
                    let mut p = Pipeline::new(devices, model, adamw(), plan, &prof).unwrap();
                    p.set_process_group(Some(member.clone())).unwrap();
                    assert!(p.sums_during_backward(), "the rings exist");
                    for (step, host) in batches.iter().enumerate() {
                        let got = p.step(host, 1000 + step as u64, LR, Some(1.0)).unwrap();
                        like_one_device(&format!("rank {} step {step}", member.rank()), &got, want[step]);
                    }
                    (p.plan().partition.stages.clone(), p.parameters(0).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_ne!(finals[0].0, finals[1].0, "the processes cut the same stages: nothing tested");
    assert_eq!(finals[0].1, finals[1].1, "the processes hold bitwise the same weights");
    let rel = params_rel(&finals[0].1, &reference);
    assert!(rel <= 1e-5, "weights differ from one device by {rel:e}");
}

/// Each member of a group of `procs` processes builds the same pipeline across processes
/// (`procs / K` replicas of `plan`'s `K` stages) and runs `f` on it, in its own thread;
/// returns what each returned, in rank order.
fn across_processes<T: Send>(
    config: &ModelConfig,
    plan: PipelineConfig,
    procs: usize,
    f: impl Fn(usize, Pipeline<CpuDevice<f32>>) -> T + Sync,
) -> Vec<T> {
    across_processes_on(config, plan, procs, |rank| CpuDevice::new(rank, 1).unwrap(), f)
}

/// [`across_processes`] with each rank's device from `device`.
fn across_processes_on<D: Device, T: Send>(
    config: &ModelConfig,
    plan: PipelineConfig,
    procs: usize,
    device: impl Fn(usize) -> D + Sync,
    f: impl Fn(usize, Pipeline<D>) -> T + Sync,
) -> Vec<T> {
    let group = process_group(procs);
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|member| {
                let (f, plan, device) = (&f, plan.clone(), &device);
                s.spawn(move || {
                    let dev = device(member.rank());
                    // As a launched stage process builds it: the shapes first, which give the
                    // plan, then its own stages' values only.
                    let (rank, size) = (member.rank(), member.size());
                    let shapes = Model::new_keeping(&dev, config, 7, &|_| false).unwrap();
                    let prof = profiles(&shapes, &dev);
                    let own = Pipeline::units_of_process(&shapes, plan.clone(), &prof, rank, size).unwrap();
                    let model = Model::new_keeping(&dev, config, 7, &|u| own[u]).unwrap();
                    f(rank, Pipeline::across_processes(dev, model, adamw(), plan, &prof, member).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A pipeline whose stages are processes computes what the same pipeline in one process
/// computes, to the bit: the loss and gradient norm of every step (batches with unequal target
/// counts, dropout on, clipping on, GPT's tied embedding summed across the first and last
/// stage's processes), then every weight once the stages are shared.
#[test]
fn stages_across_processes_train_like_one_process_to_the_bit() {
    let config = gpt();
    let data = common::Pool::new(&config, 24, 12, 5);
    let batches: Vec<HostBatch> = (0..STEPS as usize)
        .map(|i| {
            use pipetransformer::train::BatchSource;
            data.train_batch(0, i % 2).unwrap()
        })
        .collect();
    for (k, m, schedule) in
        [(2, 3, ScheduleKind::OneFOneB), (3, 4, ScheduleKind::Gpipe), (2, 2, ScheduleKind::Interleaved)]
    {
        let mut one = pipeline(&config, cfg(k, 1, m, schedule));
        let want: Vec<(f64, f64)> = batches
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let s = one.step(b, 1000 + i as u64, LR, Some(1.0)).unwrap();
                (s.loss, s.grad_norm)
            })
            .collect();
        let weights = one.parameters(0).unwrap();
        let got = across_processes(&config, cfg(k, 1, m, schedule), k, |rank, mut p| {
            assert_eq!(p.process_stage(), Some(rank));
            // Gradient buffers only for this process's stages (the others' units are weights).
            for (s, range) in p.plan().partition.stages.clone().into_iter().enumerate() {
                let here = s % k == rank;
                assert!(p.units().skip(range.start).take(range.len()).all(|u| u.trainable() == here), "stage {s}");
            }
            assert_eq!(p.frozen_prefix(), 0);
            let steps: Vec<(f64, f64)> = batches
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let s = p.step(b, 1000 + i as u64, LR, Some(1.0)).unwrap();
                    assert!(s.trace.per_device.iter().enumerate().all(|(g, spans)| (g == rank) != spans.is_empty()));
                    (s.loss, s.grad_norm)
                })
                .collect();
            // Other stages' copies are out of date until shared, and dropped: while it trains
            // a process holds its own stage's weights only. Reading them is refused.
            for (s, range) in p.plan().partition.stages.clone().into_iter().enumerate() {
                let held = p.units().skip(range.start).take(range.len()).flat_map(|u| u.params());
                let lens: Vec<usize> = held.map(|q| <CpuDevice<f32> as Device>::len(&q.value)).collect();
                assert!(lens.iter().all(|&n| (n > 0) == (s % k == rank)), "stage {s} on rank {rank}: {lens:?}");
            }
            let stale = p.parameters(0).unwrap_err().to_string();
            assert!(stale.contains("share_stages"), "{stale}");
            p.share_stages().unwrap();
            assert!(p.optimizer_state().unwrap_err().to_string().contains("share_optimizer_state"));
            (steps, p.parameters(0).unwrap())
        });
        for (rank, (steps, params)) in got.iter().enumerate() {
            let what = format!("{schedule:?} K={k} M={m}, rank {rank}");
            assert_eq!(steps, &want, "{what}: losses and gradient norms, step by step");
            assert!(
                params == &weights,
                "{what}: weights differ from one process's (rel {:e})",
                params_rel(params, &weights)
            );
        }
    }
}

/// `K·R` processes as `R` replicas of a `K`-stage pipeline train as the same pipeline with
/// `R` replicas in one process, to the bit: every step's loss and gradient norm, then every
/// weight, on batches with unequal target counts, GPT's tied embedding summed across each
/// row's first and last stage (a column sums a stage's gradients in the bucket and ring order
/// the in-process replicas use, so three replicas add alike too). Each row evaluates its share
/// of the batches on its stages' own weights, as one process evaluates them. An interleaved
/// schedule wraps round its row's own ring.
#[test]
fn stages_and_replicas_across_processes_train_like_one_process() {
    let config = gpt();
    let batches = step_batches(&config, 24, 12, 5);
    // The last with a sum per unit as the backward goes, on both sides.
    for (k, r, m, schedule, bucket) in [
        (2, 2, 3, ScheduleKind::OneFOneB, 1 << 20),
        (2, 2, 2, ScheduleKind::Interleaved, 1 << 20),
        (3, 2, 2, ScheduleKind::Gpipe, 1 << 20),
        (2, 3, 2, ScheduleKind::OneFOneB, 1 << 20),
        (2, 3, 2, ScheduleKind::OneFOneB, 1),
    ] {
        let mut one = pipeline(&config, cfg(k, r, m, schedule));
        one.set_bucket_elements(bucket);
        let run = |p: &mut Pipeline<CpuDevice<f32>>| -> Vec<(f64, f64)> {
            let steps = batches.iter().enumerate();
            steps
                .map(|(i, b)| p.step(b, 1000 + i as u64, LR, Some(1.0)).map(|s| (s.loss, s.grad_norm)).unwrap())
                .collect()
        };
        let want = run(&mut one);
        let weights = one.parameters(0).unwrap();
        // Evaluation: every batch through one process's replica 0, and through the rows.
        let evaluate = |p: &Pipeline<CpuDevice<f32>>, row: usize, rows: usize| {
            let mut queue = batches.iter().skip(row).step_by(rows).cloned().map(Ok);
            let mut outs = Vec::new();
            p.evaluate_all(0, &mut || queue.next(), &mut |_, out| {
                outs.push(out);
                Ok(())
            })
            .unwrap();
            outs
        };
        let evaluated = evaluate(&one, 0, 1);
        let want_state = one.optimizer_state().unwrap();
        let got = across_processes(&config, cfg(k, 1, m, schedule), k * r, |rank, mut p| {
            assert_eq!(p.process_stage(), Some(rank % k));
            assert_eq!(p.process_group().map(|g| (g.rank(), g.size())), Some((rank / k, r)));
            assert_eq!(p.evaluation_share(), (rank / k, r));
            p.set_bucket_elements(bucket);
            let steps = run(&mut p);
            // Each row evaluates its batches on its stages' own weights (nothing shared).
            let outs = evaluate(&p, rank / k, r);
            // A checkpoint's collection: everything in rank 0's host memory, nothing more on any
            // device (rank 0's evaluates nothing from it), nothing anywhere else.
            p.collect_on_rank_zero().unwrap();
            let collected = (rank == 0).then(|| (p.parameters(0).unwrap(), p.optimizer_state().unwrap()));
            if rank != 0 {
                assert!(p.parameters(0).is_err() && p.optimizer_state().is_err(), "rank {rank} holds no copies");
            }
            let others = p.units().flat_map(|u| u.params()).filter(|q| <CpuDevice<f32> as Device>::len(&q.value) == 0);
            assert!(others.count() > 0, "rank {rank}: the other stages' weights stay off the device");
            assert!(p.gather(&CpuDevice::new(9, 1).unwrap()).is_err(), "rank {rank}: no device copy to gather");
            // Sharing the optimizer state alone brings the weights it needs along.
            p.share_optimizer_state().unwrap();
            assert!(p.optimizer_state().unwrap() == want_state, "rank {rank}: every stage's optimizer state");
            (steps, p.parameters(0).unwrap(), outs, collected)
        });
        let what = format!("{schedule:?} K={k} R={r} M={m}");
        let (params0, state0) = got[0].3.as_ref().unwrap();
        assert!(params0 == &weights, "{what}: rank 0 collects the weights");
        assert!(state0 == &want_state, "{what}: rank 0 collects the optimizer state");
        for (rank, (steps, params, outs, _)) in got.iter().enumerate() {
            assert_eq!(params, &got[rank % k].1, "{what}, rank {rank}: the same weights as its stage's replicas");
            match rank % k == k - 1 {
                true => {
                    let row: Vec<_> = evaluated.iter().skip(rank / k).step_by(r).cloned().collect();
                    assert!(
                        outs == &row,
                        "{what}, rank {rank}: its row's batches evaluate to the bit as in one process"
                    );
                }
                false => assert!(outs.is_empty(), "{what}, rank {rank}: only the last stage has outputs"),
            }
            assert_eq!(steps, &want, "{what}, rank {rank}: losses and gradient norms, step by step");
            assert!(params == &weights, "{what}, rank {rank}: weights (rel {:e})", params_rel(params, &weights));
        }
    }
}

/// A process of one replica that fails ends every process of the run at once, its row's
/// and the other replicas', each with an error naming a peer that is gone, not a hang.
#[test]
fn a_failing_process_ends_every_row_and_column_naming_a_peer() {
    let config = gpt();
    let host = batch(&config, 8, 0);
    let started = std::time::Instant::now();
    let errors = across_processes(&config, cfg(2, 1, 2, ScheduleKind::OneFOneB), 4, |rank, mut p| {
        if rank == 3 {
            p.set_fault(Some(Fault { device: 1, action: 2, panic: false }));
        }
        p.step(&host, 1, LR, Some(1.0)).unwrap_err().to_string()
    });
    assert!(errors[3].contains("injected"), "{}", errors[3]);
    for (rank, e) in errors.iter().enumerate().take(3) {
        assert!(e.contains("closed its connection"), "rank {rank}: {e}");
    }
    assert!(errors[2].contains("rank 3"), "rank 3's own row names it: {}", errors[2]);
    assert!(started.elapsed() < std::time::Duration::from_secs(25), "no one waited for the 30 s timeout");
}

/// A stage process holds its own stages' weights only, from the start: the model it builds
/// (`Model::new_keeping` for `units_of_process`) has the other units hollow, its own with the
/// values a whole build gives, to the bit; a model built whole has the other stages' values
/// dropped as the pipeline takes it.
#[test]
fn a_stage_process_holds_only_its_own_stages_weights() {
    let config = gpt();
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let whole = Model::new(&dev, &config, 7).unwrap();
    let values = |m: &Model<CpuDevice<f32>>| -> Vec<Vec<Vec<f32>>> {
        m.units().iter().map(|u| u.params().iter().map(|p| dev.download(&p.value).unwrap()).collect()).collect()
    };
    let want = values(&whole);
    // Interleaved: each process runs two stages (units in two runs).
    let plan = cfg(2, 1, 4, ScheduleKind::Interleaved);
    let held = across_processes(&config, plan.clone(), 2, |rank, p| {
        let own: Vec<bool> = (0..p.unit_count()).map(|u| p.plan().stage_of(u) % 2 == rank).collect();
        let hollow: Vec<bool> = p.units().map(|u| u.params().iter().all(|q| q.is_hollow())).collect();
        let got: Vec<Vec<Vec<f32>>> = p
            .units()
            .map(|u| u.params().iter().map(|q| p.devices()[0].download(&q.value).unwrap()).collect())
            .collect();
        (own, hollow, got)
    });
    for (rank, (own, hollow, got)) in held.iter().enumerate() {
        assert!(own.iter().any(|&o| o) && own.iter().any(|&o| !o), "rank {rank} runs some units: {own:?}");
        for (u, &mine) in own.iter().enumerate() {
            assert_eq!(hollow[u], !mine, "rank {rank}, unit {u}: hollow exactly where another process trains");
            if mine {
                assert!(got[u] == want[u], "rank {rank}, unit {u}: the values a whole build gives");
            }
        }
    }
    let built_whole = build_across_processes(2, |_| plan.clone());
    assert!(built_whole.iter().all(|b| b == "built"), "{built_whole:?}");
}

/// Processes that do not make whole rows of the pipeline are refused by name.
#[test]
fn processes_that_do_not_make_whole_rows_are_refused() {
    let errors = build_across_processes(3, |_| cfg(2, 1, 2, ScheduleKind::OneFOneB));
    assert!(errors.iter().all(|e| e.contains("pipeline_len must be at least 2 and divide 3")), "{errors:?}");
}

/// Each of `procs` processes builds a GPT pipeline across them with the plan `plan(rank)`;
/// what each got: "built", or its error.
fn build_across_processes(procs: usize, plan: impl Fn(usize) -> PipelineConfig + Sync) -> Vec<String> {
    let config = gpt();
    let group = process_group(procs);
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|member| {
                let (config, plan) = (&config, &plan);
                s.spawn(move || {
                    let dev = CpuDevice::<f32>::new(member.rank(), 1).unwrap();
                    let model = Model::new(&dev, config, 7).unwrap();
                    let prof = profiles(&model, &dev);
                    let plan = plan(member.rank());
                    let rank = member.rank();
                    match Pipeline::across_processes(dev, model, adamw(), plan, &prof, member) {
                        // A model built whole: the other stages' values are dropped as the
                        // pipeline takes it.
                        Ok(p) => {
                            let k = p.plan().config.pipeline_len;
                            let mut units = p.units().enumerate();
                            match units.all(|(u, x)| {
                                x.params().iter().all(|q| q.is_hollow()) == (p.plan().stage_of(u) % k != rank % k)
                            }) {
                                true => "built".to_string(),
                                false => "built, holding other stages' weights".to_string(),
                            }
                        }
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The same on emulated CUDA devices, one per process, against the same pipeline in one
/// process: every step's loss and gradient norm, then every weight, to the bit.
#[test]
fn stages_across_processes_on_emulated_cuda_devices() {
    let config = gpt();
    let batches: Vec<HostBatch> = (0..STEPS).map(|i| batch(&config, 6, i)).collect();
    let plan = cfg(2, 1, 3, ScheduleKind::OneFOneB);
    let mut one = pipeline_on(&config, plan.clone(), emus(2));
    let run = |p: &mut Pipeline<GpuDevice>| -> Vec<(f64, f64)> {
        let steps = batches.iter().enumerate();
        steps.map(|(i, b)| p.step(b, 1000 + i as u64, LR, Some(1.0)).map(|s| (s.loss, s.grad_norm)).unwrap()).collect()
    };
    let want = run(&mut one);
    let weights = one.parameters(0).unwrap();
    let emu = |rank: usize| pipetransformer::device::emu::device(rank, Precision::F32, 1 + rank as u64).unwrap();
    let got = across_processes_on(&config, plan, 2, emu, |_, mut p| {
        let steps = run(&mut p);
        p.share_stages().unwrap();
        (steps, p.parameters(0).unwrap())
    });
    for (rank, (steps, params)) in got.iter().enumerate() {
        assert_eq!(steps, &want, "rank {rank}");
        assert!(params == &weights, "rank {rank}: weights differ (rel {:e})", params_rel(params, &weights));
    }
}

/// Processes that plan differently (here: another micro-batch count) are told so when the
/// pipeline is built, instead of waiting for messages that never come.
#[test]
fn stage_processes_that_plan_differently_are_refused() {
    let errors = build_across_processes(2, |rank| cfg(2, 1, 3 + rank, ScheduleKind::OneFOneB));
    for e in &errors {
        assert!(e.contains("rank 1 planned a different model or pipeline"), "{e}");
    }
}

/// A stage's process that fails ends the others' steps at once with an error naming it.
#[test]
fn a_failing_stage_process_ends_the_others_naming_it() {
    let config = gpt();
    let host = batch(&config, 6, 0);
    let started = std::time::Instant::now();
    let errors = across_processes(&config, cfg(3, 1, 3, ScheduleKind::OneFOneB), 3, |rank, mut p| {
        if rank == 1 {
            p.set_fault(Some(Fault { device: 1, action: 4, panic: false }));
        }
        p.step(&host, 1, LR, Some(1.0)).unwrap_err().to_string()
    });
    assert!(errors[1].contains("injected"), "{}", errors[1]);
    for r in [0, 2] {
        assert!(errors[r].contains("rank 1") && errors[r].contains("closed its connection"), "rank {r}: {}", errors[r]);
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(25), "no one waited for the 30 s timeout");
}

#[test]
fn a_process_that_dies_ends_the_others_with_its_rank_not_a_hang() {
    let config = gpt();
    let group = process_group(3);
    let started = std::time::Instant::now();
    let errors: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|member| {
                let config = &config;
                s.spawn(move || {
                    let rank = member.rank();
                    let mut p = pipeline(config, cfg(1, 1, 1, ScheduleKind::OneFOneB));
                    p.set_process_group(Some(member)).unwrap();
                    if rank == 2 {
                        return None; // dies before its first step: its connection closes
                    }
                    Some(p.step(&batch(config, 6, 0), 1, LR, Some(1.0)).unwrap_err().to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let e0 = errors[0].as_deref().unwrap();
    assert!(e0.contains("rank 2") && e0.contains("closed its connection"), "{e0}");
    // Rank 1 hears it from writing to rank 2 or from rank 0 hanging up, whichever comes first.
    let e1 = errors[1].as_deref().unwrap();
    assert!((e1.contains("rank 0") || e1.contains("rank 2")) && e1.contains("closed its connection"), "{e1}");
    assert!(started.elapsed() < std::time::Duration::from_secs(25), "no one waited for the 30 s timeout");
}

/// Device work is timed by markers (CUDA events on a GPU; on the emulator, which runs each
/// launch before returning, the host clock when the work is done). On emulated devices the
/// spans they give are a well-formed time line: per device in schedule order, not
/// overlapping, inside the step, with the optimizer's tail after the pipelined part.
#[test]
fn marker_timed_spans_form_a_time_line_on_emulated_devices() {
    let config = gpt();
    let host = batch(&config, 8, 0);
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        let mut p = pipeline_on(&config, cfg(2, 1, 4, schedule), emus(2));
        let t = p.step(&host, 3, LR, Some(1.0)).unwrap().trace;
        for (g, spans) in t.per_device.iter().enumerate() {
            let compute =
                spans.iter().filter(|s| !matches!(s.action, pipetransformer::pipeline::Action::OptimizerStep));
            let mut last = 0.0;
            for s in compute {
                assert!(s.start >= last - 1e-9 && s.end >= s.start, "{schedule} device {g}: {s:?} after {last}");
                last = s.end;
            }
            assert!(last <= t.pipeline_end() + 1e-12 && t.pipeline_end() <= t.makespan);
        }
        let bubble = t.bubble();
        assert!((0.0..1.0).contains(&bubble), "{schedule}: bubble {bubble}");
        assert!(t.tail() > 0.0, "{schedule}: the optimizer runs after the pipelined part");
    }
}

/// `unit_values` reads each unit's parameters wherever its stage lives, in model order: what
/// the freeze rule's settling test compares (units `1 + 2ℓ` and `2 + 2ℓ` are layer `ℓ`).
#[test]
fn unit_values_are_each_units_parameters_across_stages() {
    let config = gpt();
    let p = pipeline(&config, cfg(2, 1, 2, ScheduleKind::OneFOneB));
    let by_name: std::collections::HashMap<String, Vec<f32>> = p.parameter_values().unwrap().into_iter().collect();
    let n = p.unit_count();
    let all = p.unit_values(0..n).unwrap();
    assert_eq!(all.len(), n);
    for (i, unit) in p.units().enumerate() {
        let want: Vec<f32> = unit.params().iter().flat_map(|q| by_name[&q.name].clone()).collect();
        assert_eq!(all[i], want, "unit {i}");
    }
    assert_eq!(p.unit_values(3..5).unwrap(), all[3..5].to_vec());
}

/// Untied models, where each worker reads its units' gradient norms itself: every unit's
/// squared gradient norm, the loss and the gradient norm as one device gives them, step by
/// step, with a frozen prefix and replicas, under 1F1B and zero bubble (whose put-off weight
/// gradients include BERT's pooler and ViT's patch projection).
#[test]
fn untied_models_give_every_units_gradient_norm_as_one_device() {
    use pipetransformer::optim::grad_sum_squares;
    for config in [common::tiny_bert(Pooling::ClsPooler, 0.1), common::tiny_vit(0.1)] {
        let batches: Vec<HostBatch> = (0..STEPS).map(|s| HostBatch::random(&config, 6, 5, 20 + s)).collect();
        for frozen in [0, 2] {
            let dev = CpuDevice::<f32>::new(0, 1).unwrap();
            let mut model = Model::new(&dev, &config, 7).unwrap();
            model.freeze_prefix(&dev, frozen).unwrap();
            let mut opt = Optimizer::new(adamw()).unwrap();
            let want: Vec<(f64, f64, Vec<f64>)> = batches
                .iter()
                .enumerate()
                .map(|(s, host)| {
                    let b = Batch::upload(&dev, model.spec(), host, true, 1000 + s as u64).unwrap();
                    let st = train_step(&dev, &mut model, &mut opt, &b, LR, Some(1.0)).unwrap();
                    let units = model.units().iter().map(|u| grad_sum_squares(&dev, &u.params()).unwrap()).collect();
                    (st.loss, st.grad_norm, units)
                })
                .collect();
            for (k, r, m) in [(2, 1, 3), (3, 1, 2), (2, 2, 3)] {
                for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
                    let mut p = pipeline_on(&config, cfg(k, r, m, schedule), cpus(k * r));
                    p.freeze_prefix(frozen).unwrap();
                    for (s, host) in batches.iter().enumerate() {
                        let got = p.step(host, 1000 + s as u64, LR, Some(1.0)).unwrap();
                        let (loss, norm, units) = &want[s];
                        let at = format!("frozen {frozen} K={k} R={r} M={m} {schedule} step {s}");
                        like_one_device(&at, &got, (*loss, *norm));
                        assert_eq!(got.unit_grad_sq.len(), units.len(), "{at}");
                        for (u, (a, b)) in got.unit_grad_sq.iter().zip(units).enumerate() {
                            assert!((a - b).abs() <= 1e-4 * b + 1e-12, "{at}: unit {u}: {a} vs {b}");
                            assert!(u >= frozen || *a == 0.0, "{at}: frozen unit {u} has a gradient");
                        }
                    }
                }
            }
        }
    }
}

/// A tied weight is one parameter: the gradient norm counts GPT's token embedding once, with
/// the summed gradient both copies hold (as PyTorch's `clip_grad_norm_` over `parameters()`
/// does), on one device and through a two-stage pipeline, whose copies sit on different
/// devices. Counted twice, the norm grew by up to √2 and clipping bit harder than asked.
#[test]
fn the_gradient_norm_counts_a_tied_weight_once() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let config = common::tiny_gpt(0.0);
    let host = common::tiny_batch(&config, 0);
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
    let batch = Batch::upload(&dev, model.spec(), &host, true, 0).unwrap();
    let stats = train_step(&dev, &mut model, &mut opt, &batch, 0.0, None).unwrap();
    let grad = |name: &str| {
        let p = model.params().into_iter().find(|p| p.name == name).unwrap();
        dev.download(p.grad.as_ref().unwrap()).unwrap()
    };
    assert_eq!(grad("transformer.wte.weight"), grad("lm_head.weight"), "both copies hold the sum");
    let once: f64 = model
        .params()
        .into_iter()
        .filter(|p| p.name != "lm_head.weight")
        .filter_map(|p| p.grad.as_ref())
        .map(|g| dev.download(g).unwrap().iter().map(|&v| f64::from(v).powi(2)).sum::<f64>())
        .sum();
    assert!((stats.grad_norm - once.sqrt()).abs() <= 1e-6 * once.sqrt(), "{} vs {}", stats.grad_norm, once.sqrt());

    let mut fresh = Model::new(&dev, &config, 1).unwrap();
    let profiles = pipetransformer::pipeline::unit_profiles(&dev, &mut fresh, &host, false).unwrap();
    let cpus = (0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
    let plan = PipelineConfig { pipeline_len: 2, ..Default::default() };
    let mut pipeline = Pipeline::new(cpus, fresh, OptimizerConfig::adamw(), plan, &profiles).unwrap();
    let step = pipeline.step(&host, 0, 0.0, None).unwrap();
    assert!(
        (step.grad_norm - stats.grad_norm).abs() <= 1e-5 * stats.grad_norm,
        "{} vs {}",
        step.grad_norm,
        stats.grad_norm
    );
}

/// What a library caller hands the pipeline is checked: profiles for another number of units
/// (which would place units out of order), or a replica the pipeline does not have, are errors
/// naming them, not panics.
#[test]
fn profiles_of_another_model_and_a_replica_past_the_pipeline_are_refused() {
    let config = common::tiny_gpt(0.0);
    let devices = cpus(2);
    let model = Model::new(&devices[0], &config, 0).unwrap();
    let units = profiles(&model, &devices[0]);
    let plan = PipelineConfig { pipeline_len: 2, ..Default::default() };
    let optimizer = OptimizerConfig::default();
    let Err(e) =
        Pipeline::new(cpus(2), Model::new(&devices[0], &config, 0).unwrap(), optimizer, plan.clone(), &units[1..])
    else {
        panic!("a unit's profile short")
    };
    assert!(e.to_string().contains(&format!("{} unit profiles for a model of {} units", units.len() - 1, units.len())));
    let mut pipeline = Pipeline::new(devices, model, optimizer, plan.clone(), &units).unwrap();
    assert!(pipeline.replan(plan, &units[..2], 0).is_err_and(|e| e.to_string().contains("unit profiles")));
    let host = common::tiny_batch(&config, 0);
    assert!(pipeline.evaluate(0, &host).is_ok());
    let past = |e: pipetransformer::Error| e.to_string().contains("on replica 1; the pipeline has 1");
    assert!(pipeline.evaluate(1, &host).is_err_and(past));
    assert!(pipeline.parameters(1).is_err_and(past));
    let mut next = || None;
    assert!(pipeline.evaluate_all(1, &mut next, &mut |_, _| Ok(())).is_err_and(past));
}
