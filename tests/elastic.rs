//! PipeTransformer's elastic loop changes how a run is executed, never what it computes: a run
//! that freezes layers through transitions (AutoPipe shortening the pipeline, AutoDP adding a
//! replica, AutoCache feeding the first stage, spilling to disk and advancing its entries)
//! follows, step by step, a one-device run that freezes the same units at the same steps; an
//! advanced cache entry is exactly a fresh forward; a run resumed after a transition continues
//! where it stopped.

mod common;

use common::{Pool, params_rel};
use pipetransformer::device::{CpuDevice, Device, GpuDevice, Precision};
use pipetransformer::elastic::autodp::lends_threads;
use pipetransformer::elastic::controller::Surroundings;
use pipetransformer::elastic::{
    BatchPolicy, CacheDtype, Elastic, ElasticConfig, FreedDevices, FreezeInterval, FreezeName,
};
use pipetransformer::model::{ModelConfig, Pooling};
use pipetransformer::optim::Decay;
use pipetransformer::pipeline::{PipelineConfig, ScheduleKind, StepOptions};
use pipetransformer::testing::Scratch;
use pipetransformer::train::{BatchSource, Event, KeepBest, RecordedPlan, TrainConfig, Trainer, Transition};

const EPOCHS: u64 = 4;
const SAMPLES: usize = 12;
const BATCH: usize = 4;

fn train_config() -> TrainConfig {
    TrainConfig {
        epochs: EPOCHS,
        max_steps: 0,
        lr: 1e-2,
        min_lr: 0.0,
        warmup_fraction: 0.1,
        decay: Decay::Cosine,
        optimizer: Default::default(),
        max_grad_norm: 1.0,
        seed: 5,
        eval_every: 0,
        ..TrainConfig::new(0, 0.0)
    }
}

/// A 2-layer BERT with dropout and mean pooling: layers frozen through the table below.
fn bert() -> ModelConfig {
    common::tiny_bert(Pooling::Mean, 0.1)
}

/// A 2-layer ViT with dropout: images, whose cached hidden states have a class token.
fn vit() -> ModelConfig {
    common::tiny_vit(0.1)
}

fn cpus(n: usize) -> Vec<CpuDevice<f32>> {
    (0..n).map(|i| CpuDevice::new(i, 1).unwrap()).collect()
}

fn emus(n: usize) -> Vec<GpuDevice> {
    (0..n).map(|i| pipetransformer::device::emu::device(i, Precision::F32, 3 + i as u64).unwrap()).collect()
}

/// A fresh folder for one test's cache, removed when the test passes.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("elastic-{name}"))
}

/// Per step: (loss, gradient norm).
type Curve = Vec<(f64, f64)>;

fn curve(events: &[Event]) -> Curve {
    events
        .iter()
        .filter_map(|e| if let Event::Step { loss, grad_norm, .. } = e { Some((*loss, *grad_norm)) } else { None })
        .collect()
}

/// One layer frozen after `every` steps, the second after `2·every` (units 0..3, then 0..5),
/// by hand on one device: no plan changes, no cache.
fn by_hand(model: &ModelConfig, data: &Pool, every: u64) -> (Curve, Vec<(String, Vec<f64>)>) {
    by_hand_from(model, data, every, None)
}

/// [`by_hand`] with units `0..n` frozen before the first step when `first` is `Some(n)`.
fn by_hand_from(
    model: &ModelConfig,
    data: &Pool,
    every: u64,
    first: Option<usize>,
) -> (Curve, Vec<(String, Vec<f64>)>) {
    let mut t = common::trainer_on(model, 3, cpus(1), PipelineConfig::default(), train_config(), 3);
    let mut events = Vec::new();
    for frozen in [first, Some(3), Some(5)] {
        if let Some(n) = frozen {
            t.pipeline.freeze_prefix(n).unwrap();
        }
        let steps = if frozen == Some(5) { None } else { Some(every) };
        t.fit(data, steps, &mut (), &mut |e| events.push(e.clone())).unwrap();
    }
    assert!(t.done());
    (curve(&events), t.pipeline.parameters(0).unwrap())
}

/// The whole system on two devices: a two-stage pipeline first; the table freezes one layer
/// per interval; AutoPipe, AutoDP and a cache small enough to spill take over.
fn elastic_trainer<D: Device>(
    model: &ModelConfig,
    devices: Vec<D>,
    cache_dir: &std::path::Path,
    interval: FreezeInterval,
    freed_devices: FreedDevices,
) -> (Trainer<D>, Elastic) {
    elastic_trainer_with(train_config(), model, devices, cache_dir, interval, freed_devices)
}

/// [`elastic_trainer`] under `train`.
fn elastic_trainer_with<D: Device>(
    train: TrainConfig,
    model: &ModelConfig,
    devices: Vec<D>,
    cache_dir: &std::path::Path,
    interval: FreezeInterval,
    freed_devices: FreedDevices,
) -> (Trainer<D>, Elastic) {
    let plan = PipelineConfig { pipeline_len: 2, micro_batches: 2, ..Default::default() };
    let mut t = common::trainer_on(model, 3, devices, plan, train, 3);
    // Frozen units cost a second per sample: reading the cache always pays here.
    for p in &mut t.profiles {
        p.forward = 1.0;
    }
    // The shapes are asserted below: the planner decides them here, not a timing.
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1, 2],
        auto_pipe: true,
        time_pipeline_len: false,
        auto_dp: true,
        cache: true,
        cache_bytes: 1500,
        freeze_interval: interval,
        freed_devices,
        ..Default::default()
    };
    t.pipeline.lend_idle_threads(lends_threads(freed_devices, t.pipeline.devices())).unwrap();
    (t, Elastic::new(config, surroundings(model), cache_dir).unwrap())
}

/// What the controller is told of the run: 2 layers, 2 devices, one replica to start.
fn surroundings(model: &ModelConfig) -> Surroundings {
    // Positions per sample: BERT's longest snippet; ViT's 4 patches and the class token.
    let positions = if matches!(model, ModelConfig::Vit(_)) { 5 } else { 7 };
    Surroundings {
        layers: 2,
        devices: 2,
        initial_replicas: 1,
        batch: BATCH,
        positions,
        width: 10,
        activation_dtype: CacheDtype::F32,
    }
}

/// The BERT trained to the end on two cpu devices under `config`: the trainer and its events.
fn fit_bert(config: ElasticConfig, dir: &std::path::Path) -> (Trainer<CpuDevice<f32>>, Vec<Event>) {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let (mut t, _) = elastic_trainer(&bert(), cpus(2), dir, FreezeInterval::Epoch, FreedDevices::Replicas);
    let mut elastic = Elastic::new(config, surroundings(&bert()), dir).unwrap();
    let mut events = Vec::new();
    t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    (t, events)
}

/// The transitions that froze more layers.
fn freezes(events: &[Event]) -> Vec<Transition> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Transition(t) if t.frozen_layers.0 != t.frozen_layers.1 => Some(t.clone()),
            _ => None,
        })
        .collect()
}

fn assert_follows(got: &Curve, want: &Curve, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g.0 - w.0).abs() <= 1e-5 * w.0.abs(), "{what}: step {i} loss {} vs {}", g.0, w.0);
        assert!((g.1 - w.1).abs() <= 1e-5 * w.1.abs(), "{what}: step {i} gradient norm {} vs {}", g.1, w.1);
    }
}

/// `train.freeze_embeddings` under the whole system: the embedding never trains, the table's
/// freezes still take units 0..3 and then 0..5, and every step's loss and gradient norm follow
/// a one-device run that froze the embedding by hand before its first step (dropout included:
/// a frozen unit drops nothing).
#[test]
fn embeddings_frozen_from_the_start_follow_a_run_frozen_by_hand() {
    let model = bert();
    let data = Pool::new(&model, SAMPLES, BATCH, 11);
    let (want_curve, want_params) = by_hand_from(&model, &data, 3, Some(1));
    let dir = scratch("frozen-embeddings");
    let train = TrainConfig { freeze_embeddings: true, ..train_config() };
    let (mut t, mut elastic) =
        elastic_trainer_with(train, &model, cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
    assert_eq!(t.pipeline.frozen_prefix(), 1);
    let embedding = |params: Vec<(String, Vec<f64>)>| -> Vec<(String, Vec<f64>)> {
        params.into_iter().filter(|(name, _)| name.starts_with("embeddings.")).collect()
    };
    let initial = embedding(t.pipeline.parameters(0).unwrap());
    assert!(!initial.is_empty());
    let mut events = Vec::new();
    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert_follows(&curve(&events), &want_curve, "frozen embeddings");
    let e = params_rel(&t.pipeline.parameters(0).unwrap(), &want_params);
    assert!(e <= 1e-5, "weights differ from the run frozen by hand by {e:.2e}");
    assert_eq!(embedding(t.pipeline.parameters(0).unwrap()), initial, "the embedding moved");
    let freezes = freezes(&events);
    assert_eq!(freezes.iter().map(|t| t.frozen_units).collect::<Vec<_>>(), [3, 5]);
    // Every transition records the prefix in force: the embedding alone before the first freeze.
    for e in &events {
        if let Event::Transition(t) = e {
            let want = if t.frozen_layers.1 == 0 { 1 } else { 1 + 2 * t.frozen_layers.1 };
            assert_eq!(t.frozen_units, want, "{t:?}");
        }
    }
}

fn check_transitions_follow_by_hand<D: Device>(
    model: ModelConfig,
    devices: Vec<D>,
    name: &str,
    interval: FreezeInterval,
    freed_devices: FreedDevices,
) {
    let data = Pool::new(&model, SAMPLES, BATCH, 11);
    let every = match interval {
        FreezeInterval::Epoch => 3,
        FreezeInterval::Steps(n) => n,
    };
    let (want_curve, want_params) = by_hand(&model, &data, every);
    let dir = scratch(name);
    let (mut t, mut elastic) = elastic_trainer(&model, devices, &dir, interval, freed_devices);
    let mut events = Vec::new();
    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert_follows(&curve(&events), &want_curve, name);
    let e = params_rel(&t.pipeline.parameters(0).unwrap(), &want_params);
    assert!(e <= 1e-5, "{name}: weights differ from the run frozen by hand by {e:.2e}");

    // The machinery really ran: two freezes, the first shrinking the pipeline and adding a
    // replica (or, cpu devices lending threads, giving the first device the second's); the cache (counting samples) missed in epoch 1, advanced its entries in epoch 2
    // and served them in epoch 3, spilling past its cap.
    let freezes = freezes(&events);
    assert_eq!(freezes.len(), 2, "{name}: {freezes:?}");
    let threads: Vec<Option<usize>> = t.pipeline.devices().iter().map(Device::threads).collect();
    if lends_threads(freed_devices, t.pipeline.devices()) {
        assert_eq!((freezes[0].pipeline_len, freezes[0].replicas), ((2, 1), (1, 1)), "{name}");
        assert_eq!(threads, [Some(2), Some(1)], "{name}: the idle device's thread lent to the one at work");
    } else {
        assert_eq!((freezes[0].pipeline_len, freezes[0].replicas), ((2, 1), (1, 2)), "{name}");
        assert!(threads.iter().all(|&n| n.is_none_or(|n| n == 1)), "{name}: {threads:?}");
    }
    assert_eq!((freezes[0].frozen_units, freezes[1].frozen_units), (3, 5));
    assert!(freezes.iter().all(|t| t.cache), "{name}: the cache pays with these costs");
    let cache: Vec<(usize, usize, usize)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Cache { hits, misses, disk_bytes, .. } => Some((*hits, *misses, *disk_bytes)),
            _ => None,
        })
        .collect();
    if interval == FreezeInterval::Epoch {
        let hits: Vec<(usize, usize)> = cache.iter().map(|c| (c.0, c.1)).collect();
        assert_eq!(hits, vec![(0, 0), (0, 12), (12, 0), (12, 0)], "{name}");
    } else {
        // Boundaries that move mid-epoch leave samples at mixed depths: still served.
        assert_eq!((cache[3].0, cache[3].1), (12, 0), "{name}: {cache:?}");
    }
    assert!(cache[3].2 > 0, "{name}: the cache spilled to disk");
    // Each step logs what it looked up (what a report of a run stopped inside an epoch
    // counts): per epoch, as the epoch's cache event sums them.
    let mut looked = [(0, 0); 4];
    for e in &events {
        if let Event::Step { epoch, samples, cache_hits: Some(hits), .. } = e {
            looked[*epoch as usize].0 += hits;
            looked[*epoch as usize].1 += samples - hits;
        }
    }
    assert_eq!(looked.to_vec(), cache.iter().map(|c| (c.0, c.1)).collect::<Vec<_>>(), "{name}");
    drop(elastic);
}

#[test]
fn transitions_with_the_cache_follow_a_run_frozen_by_hand_on_cpu() {
    let replicas = FreedDevices::Replicas;
    check_transitions_follow_by_hand(bert(), cpus(2), "cpu", FreezeInterval::Epoch, replicas);
    // Every 4 steps of 3-batch epochs: the boundary moves mid-epoch.
    check_transitions_follow_by_hand(bert(), cpus(2), "cpu-mid-epoch", FreezeInterval::Steps(4), replicas);
    check_transitions_follow_by_hand(vit(), cpus(2), "cpu-vit", FreezeInterval::Epoch, replicas);
}

/// Freed cpu devices lending their threads instead of becoming replicas: the same steps.
#[test]
fn transitions_lending_threads_follow_a_run_frozen_by_hand() {
    check_transitions_follow_by_hand(bert(), cpus(2), "cpu-threads", FreezeInterval::Epoch, FreedDevices::Threads);
}

#[test]
fn transitions_with_the_cache_follow_a_run_frozen_by_hand_on_emulated_cuda() {
    // GPUs have no threads to lend: asked to, they still become replicas.
    check_transitions_follow_by_hand(bert(), emus(2), "emu", FreezeInterval::Epoch, FreedDevices::Threads);
}

#[test]
fn an_advanced_cache_entry_equals_a_fresh_forward() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let batch = data.train_batch(0, 0).unwrap();
    let options = StepOptions {
        dropout_seed: 9,
        lr: 1e-2,
        max_grad_norm: Some(1.0),
        capture_frozen_output: true,
        stop_requested: false,
    };
    let trainer = |frozen: usize| {
        let mut t = common::trainer_on(&bert(), 3, cpus(1), PipelineConfig::default(), train_config(), 3);
        t.pipeline.freeze_prefix(frozen).unwrap();
        t
    };
    // Depth 3 (one layer frozen), as the cache would hold it.
    let shallow = trainer(3).pipeline.step_with(&batch, &options).unwrap().frozen_output.unwrap();
    assert_eq!(shallow.depth, 3);
    // Two layers frozen now: from depth 3 (units 3..5 run) and from scratch.
    let (mut advanced, mut fresh) = (trainer(5), trainer(5));
    let mut from_cache = batch.clone();
    from_cache.hidden = Some(shallow);
    let a = advanced.pipeline.step_with(&from_cache, &options).unwrap();
    let b = fresh.pipeline.step_with(&batch, &options).unwrap();
    let (ha, hb) = (a.frozen_output.unwrap(), b.frozen_output.unwrap());
    assert_eq!(ha.depth, 5);
    assert_eq!(
        ha.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        hb.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!((a.loss.to_bits(), a.grad_norm.to_bits()), (b.loss.to_bits(), b.grad_norm.to_bits()));
    assert_eq!(advanced.pipeline.parameters(0).unwrap(), fresh.pipeline.parameters(0).unwrap());
    // Two stages whose boundary the frozen prefix passed without a re-plan: the output is
    // captured on the second device, and is the same.
    let plan = PipelineConfig { pipeline_len: 2, ..Default::default() };
    let mut two = common::trainer_on(&bert(), 3, cpus(2), plan, train_config(), 3);
    assert!(two.pipeline.plan().partition.stages[0].end < 5, "{:?}", two.pipeline.plan().partition.stages);
    two.pipeline.freeze_prefix(5).unwrap();
    let c = two.pipeline.step_with(&batch, &options).unwrap().frozen_output.unwrap();
    assert_eq!(
        c.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        hb.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // States that enter above the first trainable unit are refused.
    let mut too_deep = batch.clone();
    too_deep.hidden = Some(pipetransformer::model::Hidden { depth: 6, ..ha });
    let e = fresh.pipeline.step_with(&too_deep, &options).unwrap_err().to_string();
    assert!(e.contains("unit 5 trains"), "{e}");
}

/// With freed devices as replicas and as lent threads (the restored plan gets them again).
#[test]
fn a_run_resumed_after_a_transition_continues_where_it_stopped() {
    resumed_after_a_transition(FreedDevices::Replicas);
    resumed_after_a_transition(FreedDevices::Threads);
}

fn resumed_after_a_transition(freed: FreedDevices) {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch(&format!("resume-{freed:?}"));
    let (mut straight, mut elastic) = elastic_trainer(&bert(), cpus(2), &dir.join("a"), FreezeInterval::Epoch, freed);
    let mut all = Vec::new();
    elastic.start(&mut straight, &mut |e| all.push(e.clone())).unwrap();
    straight.fit(&data, None, &mut elastic, &mut |e| all.push(e.clone())).unwrap();

    let path = dir.join("ckpt");
    let (mut first, mut elastic) = elastic_trainer(&bert(), cpus(2), &dir.join("b"), FreezeInterval::Epoch, freed);
    let mut events = Vec::new();
    first.fit(&data, Some(5), &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert_eq!(first.pipeline.frozen_prefix(), 3, "the first freeze came at step 3");
    first.save_checkpoint(&path, elastic.state()).unwrap();
    let shape = first.pipeline.plan().partition.stages.clone();
    let config = first.pipeline.plan().config.clone();
    drop((first, elastic));

    // A spill file left behind (here: garbage) is never trusted: the resumed run rebuilds.
    std::fs::create_dir_all(dir.join("c")).unwrap();
    std::fs::write(dir.join("c/activations.bin"), b"not activations").unwrap();
    let (mut second, mut elastic) = elastic_trainer(&bert(), cpus(2), &dir.join("c"), FreezeInterval::Epoch, freed);
    let state = second.load_checkpoint(&path).unwrap();
    elastic.restore(state).unwrap();
    assert_eq!(second.pipeline.frozen_prefix(), 3);
    assert_eq!((&second.pipeline.plan().config, &second.pipeline.plan().partition.stages), (&config, &shape));
    assert_eq!(elastic.frozen_layers(), 1);
    let threads: Vec<Option<usize>> = second.pipeline.devices().iter().map(Device::threads).collect();
    let (lent, r) = if freed == FreedDevices::Threads { (2, 1) } else { (1, 2) };
    assert_eq!(threads, [Some(lent), Some(1)], "{freed:?}");
    assert_eq!(config.replicas, r, "{freed:?}");
    second.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert_follows(&curve(&events), &curve(&all), "resumed");
    let e = params_rel(&second.pipeline.parameters(0).unwrap(), &straight.pipeline.parameters(0).unwrap());
    assert!(e <= 1e-5, "weights differ from the straight run by {e:.2e}");
    drop((straight, second, elastic));
}

/// `max_steps` stopping a run inside an epoch does not end the epoch's freeze interval: the run
/// evaluates there but freezes nothing, and resumed it freezes at the epoch's end (step 3),
/// where a run that had not stopped froze.
#[test]
fn a_run_stopped_inside_an_epoch_freezes_at_the_epochs_end() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("stopped-inside-an-epoch");
    let (interval, freed) = (FreezeInterval::Epoch, FreedDevices::Replicas);
    let stopped = TrainConfig { max_steps: 2, ..train_config() };
    let (mut first, mut elastic) = elastic_trainer_with(stopped, &bert(), cpus(2), &dir.join("a"), interval, freed);
    let mut events = Vec::new();
    elastic.start(&mut first, &mut |e| events.push(e.clone())).unwrap();
    first.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert!(first.done() && first.position.step == 2 && first.position.epoch == 0);
    assert!(events.iter().any(|e| matches!(e, Event::Epoch { .. })), "the run's end evaluates");
    // (Only AutoPipe's timing of micro-batch counts, cut short, may settle at the end.)
    let freezes: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            Event::Transition(t) if t.frozen_layers.0 != t.frozen_layers.1 => Some(t.to_string()),
            _ => None,
        })
        .collect();
    assert!(freezes.is_empty(), "{freezes:?}");
    assert_eq!((first.pipeline.frozen_prefix(), elastic.frozen_layers()), (0, 0));
    let path = dir.join("ckpt");
    first.save_checkpoint(&path, elastic.state()).unwrap();
    drop((first, elastic));

    let (mut second, mut elastic) = elastic_trainer(&bert(), cpus(2), &dir.join("b"), interval, freed);
    elastic.restore(second.load_checkpoint(&path).unwrap()).unwrap();
    second.fit(&data, Some(1), &mut elastic, &mut |_| {}).unwrap();
    assert_eq!(second.position.step, 3);
    assert_eq!((second.pipeline.frozen_prefix(), elastic.frozen_layers()), (3, 1), "frozen at the epoch's end");
}

/// AutoDP's `scale-lr` policy: when a second replica joins, each keeps its share of the batch,
/// so a step takes two of the source's batches at twice the learning rate, and the run still
/// ends after the same source batches (the schedule's clock counts them).
#[test]
fn scale_lr_takes_more_batches_per_step_and_keeps_the_run_length() {
    let dir = scratch("scale-lr");
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1],
        auto_pipe: true,
        auto_dp: true,
        batch_policy: pipetransformer::elastic::BatchPolicy::ScaleLr,
        ..Default::default()
    };
    let (t, events) = fit_bert(config, &dir);
    let steps: Vec<(u64, usize, f64)> = events
        .iter()
        .filter_map(
            |e| if let Event::Step { epoch, samples, lr, .. } = e { Some((*epoch, *samples, *lr)) } else { None },
        )
        .collect();
    // Epoch 0: three steps of one batch; then R = 2: two steps per epoch (2 batches, then 1).
    let shape: Vec<(u64, usize)> = steps.iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(shape, [(0, 4), (0, 4), (0, 4), (1, 8), (1, 4), (2, 8), (2, 4), (3, 8), (3, 4)]);
    assert!(t.done() && t.batches_done() == 12);
    // The learning rate of a two-batch step is twice the schedule's at its first batch.
    assert!((steps[3].2 - 2.0 * t.lr_schedule.lr_at(3)).abs() < 1e-12, "{steps:?}");
    assert!((steps[4].2 - t.lr_schedule.lr_at(5)).abs() < 1e-12);
    let transition = events.iter().find_map(|e| if let Event::Transition(t) = e { Some(t.clone()) } else { None });
    assert_eq!(transition.map(|t| (t.replicas, t.batches_per_step)), Some(((1, 2), 2)));
}

/// A GPT pipelined over token slices through the elastic loop: every step runs the slicing
/// planned for its shape and micro-batch count (here a stand-in for `auto`'s planner: another
/// cut for each count, none on one stage), the counts AutoPipe times and the freeze that leaves
/// one stage (and a second replica) included, and every step's loss and gradient norm still
/// follow a one-device, unsliced run that freezes the same units at the same steps.
#[test]
fn one_stage_left_runs_without_token_slices_and_computes_the_same() {
    let model = common::tiny_gpt(0.1);
    let data = Pool::new(&model, SAMPLES, BATCH, 11);
    let (want_curve, want_params) = by_hand(&model, &data, 3);
    let plan = PipelineConfig { pipeline_len: 2, micro_batches: 2, token_slices: vec![3, 4], ..Default::default() };
    let mut t = common::trainer_on(&model, 3, cpus(2), plan, train_config(), 3);
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1, 2],
        auto_pipe: true,
        time_pipeline_len: false,
        auto_dp: true,
        ..Default::default()
    };
    let dir = scratch("gpt-slices");
    // (The plan's own [3, 4] for two micro-batches on two stages, as the job's `auto` would.)
    let slices = |k: usize, m: usize| match (k, m) {
        (1, _) => vec![],
        (_, 2) => vec![3, 4],
        _ => vec![5, 2],
    };
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    let mut elastic = Elastic::new(config, surroundings(&model), &dir).unwrap();
    elastic.plan_token_slices_with(
        Box::new(move |c, samples, units, stages| {
            let frozen = units.iter().take_while(|u| !u.trainable).count();
            let call = (c.pipeline_len, c.replicas, c.micro_batches, samples, frozen, units.len(), stages.to_vec());
            seen.lock().unwrap().push(call);
            Ok(slices(c.pipeline_len, c.micro_batches))
        }),
        7,
    );
    let mut watched = Watched { elastic, plans: vec![], slices: vec![], stages: vec![] };
    let mut events = Vec::new();
    watched.elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, None, &mut watched, &mut |e| events.push(e.clone())).unwrap();
    // Asked with each count's micro-batch sequences; every step ran what it said.
    let asked = asked.lock().unwrap().clone();
    assert!(asked.iter().all(|&(_, r, m, samples, ..)| samples == (BATCH.div_ceil(r)).div_ceil(m)), "{asked:?}");
    // Over every unit of the model, the frozen ones marked as the freezes went (a stage's time
    // counts their forward only), cut into the stages each sliced step then ran: after a
    // freeze without the cache, AutoPipe spreads the frozen units like any other work.
    let units = t.pipeline.units().count();
    assert!(asked.iter().all(|a| a.5 == units), "{asked:?}");
    assert!(asked.windows(2).all(|w| w[0].4 <= w[1].4) && asked.last().is_some_and(|a| a.4 >= 3), "{asked:?}");
    for ((&(k, m, _), stages), slices) in watched.plans.iter().zip(&watched.stages).zip(&watched.slices) {
        let given = |a: &&(usize, usize, usize, usize, usize, usize, Vec<std::ops::Range<usize>>)| {
            a.0 == k && a.2 == m && &a.6 == stages
        };
        assert!(slices.is_empty() || asked.iter().any(|a| given(&a)), "K={k} M={m} {stages:?}: {asked:?}");
    }
    for (&(k, m, _), ran) in watched.plans.iter().zip(&watched.slices) {
        assert_eq!(ran, &slices(k, m), "K={k} M={m}: {:?}", watched.plans);
    }
    assert!(
        watched.plans.iter().any(|&(k, m, _)| k == 2 && m != 2),
        "a count timed on two stages: {:?}",
        watched.plans
    );
    let freezes = freezes(&events);
    assert_eq!((freezes[0].pipeline_len, freezes[0].replicas), ((2, 1), (1, 2)), "{freezes:?}");
    let m = freezes[0].micro_batches.0;
    let off = format!("token slices {} → none (one stage)", if m == 2 { "3,4" } else { "5,2" });
    assert!(freezes[0].reason.contains(&off), "{}", freezes[0].reason);
    assert!(t.pipeline.plan().config.token_slices.is_empty());
    // The transition logs the stages it started from and those it left.
    assert_eq!((freezes[0].stages_before.len(), freezes[0].stages.len()), (2, 1), "{freezes:?}");
    let all: Vec<&Transition> =
        events.iter().filter_map(|e| if let Event::Transition(t) = e { Some(t) } else { None }).collect();
    for pair in all.windows(2) {
        assert_eq!(pair[1].stages_before, pair[0].stages, "{all:?}");
    }
    assert_follows(&curve(&events), &want_curve, "gpt over slices");
    let e = params_rel(&t.pipeline.parameters(0).unwrap(), &want_params);
    assert!(e <= 1e-5, "weights differ from the run frozen by hand by {e:.2e}");
}

/// Without the cache, AutoPipe spreads the frozen units over the stages like any forward-only
/// work; pinned to the first stage (where the cache's hidden states enter) they would load it
/// with all of them.
#[test]
fn without_the_cache_frozen_units_spread_over_the_stages() {
    let dir = scratch("spread");
    let config =
        ElasticConfig { freeze: FreezeName::Table, table: vec![0, 1, 2], auto_pipe: true, ..Default::default() };
    let (_, events) = fit_bert(config, &dir);
    let stages: Vec<(usize, usize, std::ops::Range<usize>)> =
        freezes(&events).iter().map(|t| (t.frozen_units, t.pipeline_len.1, t.stages[0].clone())).collect();
    // Six units of equal cost (a second per sample; the backward next to nothing): two stages
    // of three, the first holding the three frozen units, then five frozen units over both.
    // Pinned, the first stage would also need an active unit: 0..4, then 0..6 or one stage.
    assert_eq!(stages, [(3, 2, 0..3), (5, 2, 0..3)]);
}

/// A cache pins the frozen units to the first stage, where its hidden states enter. Where the
/// memory limit holds no shape with them all there (the head alone active: no second stage;
/// one stage holds every unit), they run forward-only, spread over the stages, and the run
/// goes on as it computes with no limit at all, step by step.
#[test]
fn frozen_units_the_first_stage_cannot_hold_run_uncached_over_the_stages() {
    let model = bert();
    let data = Pool::new(&model, SAMPLES, BATCH, 11);
    let dir = scratch("cache-unpinned");
    let plan = PipelineConfig { pipeline_len: 4, micro_batches: 4, ..Default::default() };
    let trainer = |limit: Option<usize>| {
        let plan = PipelineConfig { memory_limit: limit, ..plan.clone() };
        let mut t = common::trainer_on(&model, 3, cpus(4), plan, train_config(), 3);
        // Six units of equal cost and weights that outweigh their activations (a large
        // model's): frozen, a unit keeps a quarter of its trained bytes (no gradient, no
        // Adam moments), and five frozen with the head outweigh the limit, two of six units
        // trained.
        for p in &mut t.profiles {
            (p.forward, p.params) = (1.0, 100_000);
        }
        t
    };
    let peak = |t: &Trainer<CpuDevice<f32>>, k: usize, pinned: usize| {
        let profiles = t.profiles_for(BATCH.div_ceil(2 * k), pinned);
        let names = (0..profiles.len()).map(|i| i.to_string()).collect();
        let config = PipelineConfig { pipeline_len: k, micro_batches: 2 * k, ..Default::default() };
        let plan = pipetransformer::pipeline::Plan::new(config, &profiles, names, 4, pinned);
        plan.map(|p| p.partition.stage_memory.into_iter().max().unwrap()).ok()
    };
    let limit = peak(&trainer(None), 4, 0).unwrap();
    let mut frozen = trainer(None);
    frozen.pipeline.freeze_prefix(5).unwrap();
    let over = |bytes: Option<usize>| bytes.is_none_or(|b| b > limit);
    assert!(over(peak(&frozen, 1, 5)) && over(peak(&frozen, 2, 5)) && !over(peak(&frozen, 2, 0)));
    let run = |limit: Option<usize>, name: &str| {
        let config = ElasticConfig {
            freeze: FreezeName::Table,
            table: vec![0, 1, 2],
            auto_pipe: true,
            time_pipeline_len: false,
            cache: true,
            ..Default::default()
        };
        let mut t = trainer(limit);
        let mut elastic =
            Elastic::new(config, Surroundings { devices: 4, ..surroundings(&model) }, &dir.join(name)).unwrap();
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
        // What the cache held at the end of each epoch.
        let held: Vec<(usize, usize)> = events
            .iter()
            .filter_map(|e| match e {
                Event::Cache { entries, memory_bytes, .. } => Some((*entries, *memory_bytes)),
                _ => None,
            })
            .collect();
        (curve(&events), t.pipeline.parameters(0).unwrap(), freezes(&events), held)
    };
    let (want_curve, want_params, unlimited, held_unlimited) = run(None, "unlimited");
    let (got_curve, got_params, limited, held_limited) = run(Some(limit), "limited");
    assert_follows(&got_curve, &want_curve, "limited");
    let e = params_rel(&got_params, &want_params);
    assert!(e <= 1e-5, "weights differ from the run without a limit by {e:.2e}");
    let what = |f: &[Transition]| f.iter().map(|t| (t.frozen_units, t.cache, t.stages[0].clone())).collect::<Vec<_>>();
    // Both cached after the first freeze (three frozen units and an active one on the first
    // stage); after the second, one stage of six cached, or, limited, the cache off and the
    // frozen units over the stages.
    assert_eq!(what(&unlimited), [(3, true, 0..4), (5, true, 0..6)]);
    assert_eq!(what(&limited), [(3, true, 0..4), (5, false, 0..2)]);
    assert!(
        limited[1].reason.contains("cache off, as no shape fits the frozen units on the first stage"),
        "{limited:?}"
    );
    // The cache's price, as each transition measured it: the host's read and a device's upload.
    assert!(unlimited.iter().all(|t| t.reason.contains("cache read ") && t.reason.contains(" + upload ")));
    // A cache switched off gives its memory back: entries filled in epoch 1, then none.
    assert!(held_unlimited[1].0 == 12 && held_unlimited[3].0 == 12, "{held_unlimited:?}");
    assert!(held_limited[1].0 == 12 && held_limited[3] == (0, 0), "{held_limited:?}");
}

/// The settling test caps the rule: with a bound every layer meets, the table's freezes happen
/// as without it (and say how far each layer moved); with a bound no moving layer meets, nothing
/// freezes; and an interval whose start was not seen (a resume, or here no `start`) freezes
/// nothing more, whatever the bound.
#[test]
fn the_settling_test_holds_back_layers_that_still_move() {
    let dir = scratch("settle");
    let table = ElasticConfig { freeze: FreezeName::Table, table: vec![0, 1, 2], ..Default::default() };
    let run = |max_weight_change: Option<f64>, start: bool| {
        let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
        let (mut t, _) = elastic_trainer(&bert(), cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
        let config = ElasticConfig { max_weight_change, ..table.clone() };
        let mut elastic = Elastic::new(config, surroundings(&bert()), &dir).unwrap();
        let mut events = Vec::new();
        if start {
            elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        }
        t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
        freezes(&events).iter().map(|t| (t.step, t.frozen_layers.1, t.reason.clone())).collect::<Vec<_>>()
    };
    let plain = run(None, true);
    assert_eq!(plain.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(), [(3, 1), (6, 2)]);
    let loose = run(Some(1e9), true);
    assert_eq!(loose.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(), [(3, 1), (6, 2)]);
    assert!(loose.iter().all(|f| f.2.contains("weight change per layer [")), "{loose:?}");
    assert!(run(Some(1e-9), true).is_empty(), "every layer moves more than 1e-9 of its norm");
    // Without a reference for the first interval it holds; the second freezes up to the table.
    let unseen = run(Some(1e9), false);
    assert_eq!(unseen.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(), [(6, 2)]);
}

/// The settling test's reference weights travel in the checkpoint: a run stopped between two
/// intervals and resumed freezes where the run that was not stopped freezes; without them the
/// interval under way would hold and the freeze come an interval late (the last assertion).
#[test]
fn a_resumed_run_measures_the_interval_under_way_from_its_start() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("settle-resume");
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1, 2],
        max_weight_change: Some(1e9),
        ..Default::default()
    };
    let trainer = || {
        let (t, _) = elastic_trainer(&bert(), cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
        (t, Elastic::new(config.clone(), surroundings(&bert()), &dir).unwrap())
    };
    let steps = |events: &[Event]| freezes(events).iter().map(|t| (t.step, t.frozen_layers.1)).collect::<Vec<_>>();

    let (mut straight, mut elastic) = trainer();
    let mut all = Vec::new();
    elastic.start(&mut straight, &mut |e| all.push(e.clone())).unwrap();
    straight.fit(&data, None, &mut elastic, &mut |e| all.push(e.clone())).unwrap();
    assert_eq!(steps(&all), [(3, 1), (6, 2)]);

    let path = dir.join("ckpt");
    let (mut first, mut elastic) = trainer();
    let mut events = Vec::new();
    elastic.start(&mut first, &mut |e| events.push(e.clone())).unwrap();
    first.fit(&data, Some(5), &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    let tensors = elastic.state_tensors();
    assert_eq!(tensors.len(), 2, "one reference per layer");
    first.save_checkpoint_with(&path, elastic.state(), tensors).unwrap();
    drop((first, elastic));

    let resume = |with_tensors: bool| {
        let (mut second, mut elastic) = trainer();
        let restored = second.load_checkpoint_with(&path, RecordedPlan::Restore).unwrap();
        let (state, tensors) = (restored.controller, restored.tensors);
        elastic.restore(state).unwrap();
        elastic.restore_tensors(if with_tensors { tensors } else { Vec::new() });
        let mut later = events.clone();
        second.fit(&data, None, &mut elastic, &mut |e| later.push(e.clone())).unwrap();
        steps(&later)
    };
    assert_eq!(resume(true), [(3, 1), (6, 2)]);
    // Without the reference the interval under way holds; the next one freezes.
    assert_eq!(resume(false), [(3, 1), (9, 2)]);
}

/// A run whose last step ends a freeze interval applies the rule there, so the same run
/// resumed under more epochs freezes where a run of that length froze from the start, and
/// every step follows it (the rule used to be skipped on the last step: the resumed run froze
/// its second layer an interval late).
#[test]
fn a_run_resumed_for_more_epochs_freezes_where_the_longer_run_froze() {
    use pipetransformer::optim::Decay;
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("longer");
    // A learning rate that does not depend on the run's length.
    let train = |epochs| TrainConfig { epochs, warmup_fraction: 0.0, decay: Decay::Constant, ..train_config() };
    let trainer = |epochs| {
        let (t, e) =
            elastic_trainer_with(train(epochs), &bert(), cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
        (t, e)
    };
    let steps = |events: &[Event]| freezes(events).iter().map(|t| (t.step, t.frozen_layers.1)).collect::<Vec<_>>();

    let (mut straight, mut elastic) = trainer(EPOCHS);
    let mut all = Vec::new();
    elastic.start(&mut straight, &mut |e| all.push(e.clone())).unwrap();
    straight.fit(&data, None, &mut elastic, &mut |e| all.push(e.clone())).unwrap();
    assert_eq!(steps(&all), [(3, 1), (6, 2)]);

    let path = dir.join("ckpt");
    let (mut short, mut elastic) = trainer(2);
    let mut events = Vec::new();
    elastic.start(&mut short, &mut |e| events.push(e.clone())).unwrap();
    short.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert!(short.done());
    assert_eq!(steps(&events), [(3, 1), (6, 2)], "the rule applied on the run's last step");
    short.save_checkpoint_with(&path, elastic.state(), elastic.state_tensors()).unwrap();
    drop((short, elastic));

    let (mut longer, mut elastic) = trainer(EPOCHS);
    let restored = longer.load_checkpoint_with(&path, RecordedPlan::Restore).unwrap();
    elastic.restore(restored.controller).unwrap();
    elastic.restore_tensors(restored.tensors);
    assert_eq!(elastic.frozen_layers(), 2);
    longer.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert_eq!(steps(&events), steps(&all));
    assert_follows(&curve(&events), &curve(&all), "resumed for more epochs");
}

/// Lending spreads all the threads evenly over the devices a plan uses (the first ones one
/// more while they do not divide), follows every re-plan, and gives each device its own count
/// back when the plan uses them all or lending stops.
#[test]
fn idle_cpu_devices_lend_their_threads_evenly() {
    let plan = PipelineConfig { pipeline_len: 4, micro_batches: 4, ..Default::default() };
    let mut t = common::trainer_on(&bert(), 3, cpus(4), plan.clone(), train_config(), 3);
    let threads = |t: &Trainer<CpuDevice<f32>>| -> Vec<usize> {
        t.pipeline.devices().iter().map(|d| d.threads().unwrap()).collect()
    };
    t.pipeline.lend_idle_threads(true).unwrap();
    assert_eq!(threads(&t), [1, 1, 1, 1], "every device at work: none lends");
    let profiles = t.profiles_for(1, 0);
    for (k, want) in [(3, [2, 1, 1, 1]), (1, [4, 1, 1, 1]), (4, [1, 1, 1, 1]), (1, [4, 1, 1, 1])] {
        t.pipeline.replan(PipelineConfig { pipeline_len: k, ..plan.clone() }, &profiles, 0).unwrap();
        assert_eq!(threads(&t), want, "K = {k}");
    }
    t.pipeline.lend_idle_threads(false).unwrap();
    assert_eq!(threads(&t), [1, 1, 1, 1]);
}

/// A job resumed after a transition that lent the freed device's thread lends it again: the
/// lending is switched on before the checkpoint's plan is restored (digits, ViT, 2 cpu
/// devices of one thread each).
#[test]
fn a_job_resumed_after_lending_threads_lends_them_again() {
    use pipetransformer::run::Job;
    let dir = scratch("job-threads");
    let sets = [
        "output.threads=2",
        "pipeline.devices=2",
        "pipeline.pipeline_len=2",
        "pipeline.micro_batches=2",
        "elastic.freeze=\"table\"",
        "elastic.table=[0, 1]",
        "elastic.freeze_interval=2",
        "elastic.auto_pipe=true",
        "elastic.auto_dp=true",
        "elastic.freed_devices=\"threads\"",
        "elastic.time_pipeline_len=false",
        "train.epochs=1",
        "train.max_steps=4",
        "data.train_limit=96",
        "data.test_limit=32",
    ];
    let Some(config) = common::digits_config(&dir, &sets) else { return };
    let job = |config| common::cpu_job(config, 2, 2);
    let threads = |job: &Job<CpuDevice<f32>>| -> Vec<Option<usize>> {
        job.trainer.pipeline.devices().iter().map(Device::threads).collect()
    };
    let mut first = job(&config);
    assert_eq!(threads(&first), [Some(1), Some(1)]);
    let summary = first.run(&mut |_| {}).unwrap();
    assert_eq!(threads(&first), [Some(2), Some(1)], "lent at the freeze");
    // A job that has reached its end runs no more: a second call returns its summary, sends
    // no event, and leaves the run's files as they were.
    let files = || ["metrics.jsonl", "summary.json", "report.html"].map(|f| std::fs::read(dir.join(f)).unwrap());
    let before = files();
    let mut events = 0;
    let again = first.run(&mut |_| events += 1).unwrap();
    assert_eq!((again.steps, again.seconds, events), (summary.steps, summary.seconds, 0));
    assert!(files() == before && !dir.join("metrics.previous.jsonl").exists());
    let mut resumed = job(&config);
    resumed.resume().unwrap();
    assert_eq!(resumed.trainer.pipeline.plan().config.pipeline_len, 1);
    assert_eq!(threads(&resumed), [Some(2), Some(1)], "lent again on resume");
}

/// A run that starts over in a folder holding an earlier run, and fails at its first step,
/// loses nothing: the earlier run's log and checkpoint stay byte for byte where they were,
/// nothing is set aside, and `--resume` goes on from the earlier run. (Refusals found before
/// the first step: `tests/cli.rs::a_run_folder_holds_one_run_and_its_log`.)
#[test]
fn a_fresh_run_that_fails_at_its_first_step_loses_nothing() {
    use pipetransformer::pipeline::Fault;
    let dir = scratch("job-first-step");
    let Some(config) = common::earlier_run(&dir) else { return };
    let before = common::run_files(&dir);
    let mut fresh = common::cpu_job(&config, 1, 1);
    fresh.trainer.pipeline.set_fault(Some(Fault { device: 0, action: 0, panic: false }));
    let mut steps = 0;
    let err = fresh.run(&mut |e| steps += matches!(e, Event::Step { .. }) as usize).unwrap_err().to_string();
    assert!(err.contains("injected"), "{err}");
    assert_eq!(steps, 0);
    assert!(common::run_files(&dir) == before, "the earlier run's files were changed");
    for aside in common::SET_ASIDE {
        assert!(!dir.join(aside).exists(), "{aside} was set aside");
    }
    let mut resumed = common::cpu_job(&config, 1, 1);
    resumed.resume().unwrap();
    assert_eq!(resumed.trainer.position.step, 2, "the earlier run's checkpoint");
}

/// AutoDP makes no more replicas than the step's batch can feed one sample each: a training
/// set of 3 samples on 4 devices, whose pipeline of 2 stages shrinks to 1 at the freeze,
/// goes on with 3 replicas of it (4 would leave one without a sample, and the step fails).
#[test]
fn a_training_set_shorter_than_the_devices_caps_autodps_replicas() {
    let dir = scratch("job-short-set");
    let sets = [
        "pipeline.devices=4",
        "pipeline.pipeline_len=2",
        "pipeline.replicas=1",
        "pipeline.micro_batches=1",
        "elastic.freeze=\"table\"",
        "elastic.table=[0, 1]",
        "elastic.freeze_interval=2",
        "elastic.auto_pipe=true",
        "elastic.auto_dp=true",
        "elastic.freed_devices=\"replicas\"",
        "elastic.time_pipeline_len=false",
        "train.epochs=4",
        "train.max_steps=4",
        "data.train_limit=3",
        "data.test_limit=32",
    ];
    let Some(config) = common::digits_config(&dir, &sets) else { return };
    let mut job = common::cpu_job(&config, 4, 4);
    let summary = job.run(&mut |_| {}).unwrap();
    assert_eq!(summary.steps, 4);
    let shape = &job.trainer.pipeline.plan().config;
    assert_eq!((shape.pipeline_len, shape.replicas), (1, 3));
}

/// Lending with two replicas from the start (4 cpu devices of one thread, `K R` 2 2): the
/// freeze that shortens each replica's pipeline keeps both replicas, and each device still at
/// work takes the thread of the one its replica freed. The planner's lent speed is the
/// threads' share: all four over the devices at work.
#[test]
fn replicas_keep_their_number_and_each_takes_its_freed_devices_threads() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let plan = PipelineConfig { pipeline_len: 2, replicas: 2, micro_batches: 2, ..Default::default() };
    let mut t = common::trainer_on(&bert(), 3, cpus(4), plan, train_config(), 3);
    assert_eq!([t.pipeline.lent_speed(2), t.pipeline.lent_speed(3), t.pipeline.lent_speed(4)], [2.0, 4.0 / 3.0, 1.0]);
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1, 2],
        auto_pipe: true,
        time_pipeline_len: false,
        auto_dp: true,
        freed_devices: FreedDevices::Threads,
        ..Default::default()
    };
    let around = Surroundings { devices: 4, initial_replicas: 2, ..surroundings(&bert()) };
    let dir = scratch("lend-replicas");
    let mut elastic = Elastic::new(config, around, &dir).unwrap();
    t.pipeline.lend_idle_threads(true).unwrap();
    let mut events = Vec::new();
    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, Some(4), &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    let freezes = freezes(&events);
    assert_eq!((freezes[0].pipeline_len, freezes[0].replicas), ((2, 1), (2, 2)), "{freezes:?}");
    assert!(freezes[0].reason.contains("lend their threads: 2, 2 per device"), "{}", freezes[0].reason);
    // K changed and R did not: the replicas' communicators, dropped with the old shape, are
    // built again for the new one.
    assert!(freezes[0].reason.contains("replicas sum gradients over"), "{}", freezes[0].reason);
    let threads: Vec<Option<usize>> = t.pipeline.devices().iter().map(Device::threads).collect();
    assert_eq!(threads, [Some(2), Some(2), Some(1), Some(1)]);
    drop(elastic);
}

/// Ten epochs of the BERT on two cpu devices lending their threads, the table freezing a
/// layer every 3 steps, AutoPipe on (its trial of pipeline lengths as `time_pipeline_len`).
fn trial_trainer(
    time_pipeline_len: bool,
    table: Vec<usize>,
    dir: &std::path::Path,
) -> (Trainer<CpuDevice<f32>>, Elastic) {
    trial_trainer_until(time_pipeline_len, table, dir, 0)
}

/// [`trial_trainer`] for a run that ends after `max_steps` (0: the ten epochs).
fn trial_trainer_until(
    time_pipeline_len: bool,
    table: Vec<usize>,
    dir: &std::path::Path,
    max_steps: u64,
) -> (Trainer<CpuDevice<f32>>, Elastic) {
    trial_trainer_under(PipelineConfig::default().schedule, time_pipeline_len, table, dir, max_steps)
}

/// [`trial_trainer_until`] under another pipeline schedule.
fn trial_trainer_under(
    schedule: ScheduleKind,
    time_pipeline_len: bool,
    table: Vec<usize>,
    dir: &std::path::Path,
    max_steps: u64,
) -> (Trainer<CpuDevice<f32>>, Elastic) {
    let train = TrainConfig { epochs: 10, max_steps, ..train_config() };
    let plan = PipelineConfig { pipeline_len: 2, micro_batches: 2, schedule, ..Default::default() };
    let mut t = common::trainer_on(&bert(), 3, cpus(2), plan, train, 3);
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table,
        freeze_interval: FreezeInterval::Steps(3),
        auto_pipe: true,
        time_pipeline_len,
        auto_dp: true,
        freed_devices: FreedDevices::Threads,
        ..Default::default()
    };
    t.pipeline.lend_idle_threads(true).unwrap();
    (t, Elastic::new(config, surroundings(&bert()), dir).unwrap())
}

/// Every transition's reason and pipeline length before and after.
fn transition_log(events: &[Event]) -> Vec<(String, usize, usize)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Transition(t) => Some((t.reason.clone(), t.pipeline_len.0, t.pipeline_len.1)),
            _ => None,
        })
        .collect()
}

/// The transitions read as one chain: each one's shape before (frozen layers, K, R, M) is the
/// shape the one before it left, so no change goes unlogged.
fn assert_chained(events: &[Event]) {
    let shapes: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Transition(t) => {
                Some((t.reason.clone(), t.frozen_layers, t.pipeline_len, t.replicas, t.micro_batches))
            }
            _ => None,
        })
        .collect();
    for pair in shapes.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert_eq!(
            (a.1.1, a.2.1, a.3.1, a.4.1),
            (b.1.0, b.2.0, b.3.0, b.4.0),
            "a change between two transitions went unlogged:\n  {}\n  {}",
            a.0,
            b.0
        );
    }
}

/// A run checkpointed while AutoPipe times the first pipeline length of its trial, and
/// resumed, goes on with the trial (the second length is timed after the resume, then one is
/// kept) and follows the run that was not stopped.
#[test]
fn a_run_resumed_during_a_trial_of_pipeline_lengths_goes_on_with_it() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("trial-resume");
    let (mut straight, mut elastic) = trial_trainer(true, vec![0, 1], &dir.join("a"));
    let mut all = Vec::new();
    elastic.start(&mut straight, &mut |e| all.push(e.clone())).unwrap();
    straight.fit(&data, None, &mut elastic, &mut |e| all.push(e.clone())).unwrap();

    let path = dir.join("ckpt");
    let (mut first, mut elastic) = trial_trainer(true, vec![0, 1], &dir.join("b"));
    let mut events = Vec::new();
    elastic.start(&mut first, &mut |e| events.push(e.clone())).unwrap();
    first.fit(&data, Some(8), &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    let log = transition_log(&events);
    assert!(
        log.iter().any(|r| r.0.starts_with("Table rule after interval 1"))
            && !log.iter().any(|r| r.0.starts_with("AutoPipe times")),
        "checkpointed while the first length is timed: {log:?}"
    );
    first.save_checkpoint(&path, elastic.state()).unwrap();
    drop((first, elastic));

    let (mut second, mut elastic) = trial_trainer(true, vec![0, 1], &dir.join("c"));
    let state = second.load_checkpoint(&path).unwrap();
    elastic.restore(state).unwrap();
    let resumed_at = events.len();
    second.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    let after = transition_log(&events[resumed_at..]);
    let trial = after.iter().position(|r| r.0.starts_with("AutoPipe times K=2 against K=1")).expect("{after:?}");
    assert!(after[trial..].iter().any(|r| r.0.starts_with("pipeline lengths timed")), "{after:?}");
    assert_chained(&events);
    assert_follows(&curve(&events), &curve(&all), "resumed during a trial");
    drop((straight, second, elastic));
}

/// Where AutoPipe's price of a shorter pipeline is a guess (cpu devices lending their threads),
/// it times the length it chose against the one in force, each at its best micro-batch count,
/// and keeps the faster: the log shows both rates and the kept length is the faster one's. The
/// trial changes how the steps run, never what they compute: the run follows the same run
/// without a trial, step by step.
#[test]
fn a_trial_of_pipeline_lengths_keeps_the_faster_and_computes_the_same() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let run = |time_pipeline_len: bool, table: Vec<usize>| {
        let dir = scratch(&format!("shape-trial-{time_pipeline_len}-{}", table.len()));
        let (mut t, mut elastic) = trial_trainer(time_pipeline_len, table, &dir);
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
        drop(elastic);
        assert_chained(&events);
        (t.pipeline.plan().config.pipeline_len, events)
    };
    let reasons = transition_log;

    let (k_without, without) = run(false, vec![0, 1]);
    assert_eq!(k_without, 1, "the planner's choice stands");
    assert!(!reasons(&without).iter().any(|r| r.0.contains("AutoPipe times")), "{:?}", reasons(&without));

    let (k, with) = run(true, vec![0, 1]);
    let log = reasons(&with);
    let trial = log.iter().position(|r| r.0.starts_with("AutoPipe times K=2 against K=1")).expect("the trial began");
    assert_eq!((log[trial].1, log[trial].2), (1, 2), "the length left is run again: {log:?}");
    let verdict = log[trial..].iter().find(|r| r.0.starts_with("pipeline lengths timed")).expect("the trial ended");
    // "pipeline lengths timed (positions/s): K=1: a, K=2: b; K=x kept over K=y" (rates
    // rounded: a tie in the log may hide which was faster, never favour the slower)
    let rate = |len: usize| -> f64 {
        let tail = verdict.0.split(&format!("K={len}: ")).nth(1).expect("a rate per length");
        tail.split([',', ';']).next().unwrap().parse().unwrap()
    };
    let kept: usize = verdict.0.split("; K=").nth(1).and_then(|t| t.split(' ').next()).unwrap().parse().unwrap();
    assert!(verdict.0.contains(&format!("; K={kept} kept over K={}", 3 - kept)), "{}", verdict.0);
    assert!(rate(kept) >= rate(3 - kept), "the slower length was kept: {}", verdict.0);
    assert_eq!((verdict.2, k), (kept, kept), "the kept length runs to the end: {log:?}");
    assert_follows(&curve(&with), &curve(&without), "with a trial of pipeline lengths");

    // A second freeze 3 steps later, while the first length is still being timed: priced
    // and timed against the length the trial left, not made permanent untimed.
    let (_, events) = run(true, vec![0, 1, 2]);
    let log = reasons(&events);
    let second = log.iter().position(|r| r.0.starts_with("Table rule after interval 2")).expect("a second freeze");
    assert_eq!((log[second].1, log[second].2), (1, 1), "{log:?}");
    assert!(
        log[second..].iter().any(|r| r.0.starts_with("AutoPipe times K=2 against K=1")),
        "the second freeze's length is timed against K = 2: {log:?}"
    );
}

/// A pipeline that AutoPipe shortens to one stage (which runs 1F1B) and lengthens again runs
/// the schedule the run asked for, even when a second freeze prices the longer shape while one
/// stage is in force; each change of schedule is logged.
#[test]
fn a_pipeline_lengthened_again_runs_the_schedule_the_run_asked_for() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    for table in [vec![0, 1], vec![0, 1, 2]] {
        let dir = scratch(&format!("asked-schedule-{}", table.len()));
        let (mut t, mut elastic) = trial_trainer_under(ScheduleKind::ZeroBubble, true, table.clone(), &dir, 0);
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
        let log = transition_log(&events);
        let shorter = log.iter().find(|r| (r.1, r.2) == (2, 1)).expect("K 2 → 1");
        assert!(shorter.0.contains("; schedule zb-h1 → 1f1b (one stage)"), "{table:?}: {}", shorter.0);
        let longer: Vec<_> = log.iter().filter(|r| (r.1, r.2) == (1, 2)).collect();
        assert!(!longer.is_empty(), "{table:?}: the trial lengthens the pipeline again: {log:?}");
        for r in longer {
            assert!(r.0.contains("; schedule 1f1b → zb-h1"), "{table:?}: {}", r.0);
        }
        let plan = &t.pipeline.plan().config;
        let want = if plan.pipeline_len == 1 { ScheduleKind::OneFOneB } else { ScheduleKind::ZeroBubble };
        assert_eq!(plan.schedule, want, "{table:?}: K={}", plan.pipeline_len);
        drop(elastic);
    }
}

/// A checkpoint from before the plan a run asked for was recorded resumes with the plan this
/// run asks for (so a pipeline lengthened again runs its schedule); one that recorded it keeps
/// its own.
#[test]
fn a_checkpoint_without_the_asked_plan_takes_the_runs() {
    let dir = scratch("asked-restore");
    let zb = PipelineConfig { pipeline_len: 2, schedule: ScheduleKind::ZeroBubble, ..Default::default() };
    let mut earlier = Elastic::new(ElasticConfig::default(), surroundings(&bert()), &dir).unwrap();
    let mut old = earlier.state();
    old.as_object_mut().unwrap().remove("asked");
    let mut resumed = Elastic::new(ElasticConfig::default(), surroundings(&bert()), &dir).unwrap();
    resumed.ask_for(&zb);
    resumed.restore(old).unwrap();
    assert_eq!(resumed.state()["asked"]["schedule"], "zb-h1");
    earlier.ask_for(&PipelineConfig { schedule: ScheduleKind::Gpipe, ..zb });
    resumed.restore(earlier.state()).unwrap();
    assert_eq!(resumed.state()["asked"]["schedule"], "gpipe");
}

/// A step whose gradient norm was not finite (the optimizer skipped it) leaves the freeze
/// rule's interval as it was, so the controller's state stays finite and resumable; an
/// applied step is counted. The state resumes only under the rule, α, interval and settling
/// bound it was taken with.
#[test]
fn skipped_steps_do_not_feed_the_freeze_rule_and_it_resumes_only_under_its_own() {
    use pipetransformer::pipeline::PipelineStep;
    use pipetransformer::train::Controller;
    let dir = scratch("skipped-step");
    let (mut t, _) = elastic_trainer(&bert(), cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
    let config = ElasticConfig { freeze: FreezeName::Eq1, ..Default::default() };
    let mut elastic = Elastic::new(config.clone(), surroundings(&bert()), &dir).unwrap();
    let step = |applied: bool, sq: f64| PipelineStep {
        loss: 0.7,
        grad_norm: sq.sqrt(),
        applied,
        unit_grad_sq: vec![sq; 7],
        frozen_output: None,
        trace: Default::default(),
        stop_requested: false,
        peak_activations: Vec::new(),
        pooled: false,
    };
    let host = pipetransformer::model::HostBatch::default();
    let steps = |e: &Elastic| e.state()["freeze"]["steps"].as_u64();
    for bad in [f64::INFINITY, f64::NAN] {
        elastic.after_step(&mut t, &host, &step(false, bad), &mut |_| {}).unwrap();
        assert_eq!(steps(&elastic), Some(0), "{bad}");
    }
    let mut resumed = Elastic::new(config.clone(), surroundings(&bert()), &dir).unwrap();
    assert_eq!(resumed.restore(elastic.state()).unwrap(), Vec::<String>::new(), "the same settings are no news");
    // Settings beside the rule are taken and named; an unread one of the rule's (a table
    // under Eq. 1) is not.
    let other = ElasticConfig { batch_policy: BatchPolicy::ScaleLr, table: vec![0, 1], ..config.clone() };
    let mut taking = Elastic::new(other, surroundings(&bert()), &dir).unwrap();
    assert_eq!(taking.restore(elastic.state()).unwrap(), [r#"elastic.batch_policy "constant" → "scale-lr""#]);
    // Resumed under another rule or α: refused by name, not silently the checkpoint's.
    for (other, field) in [
        (ElasticConfig { alpha: 0.5, ..config.clone() }, "elastic.alpha: 0.3333333333333333 then, 0.5 now"),
        (ElasticConfig { freeze: FreezeName::Alpha, ..config.clone() }, "eq1 then, alpha now"),
        (
            ElasticConfig { freeze_interval: FreezeInterval::Steps(50), ..config.clone() },
            "elastic.freeze_interval \"epoch\" and max_weight_change none then, freeze_interval 50 and \
             max_weight_change none now",
        ),
        (ElasticConfig { max_weight_change: Some(0.05), ..config.clone() }, "max_weight_change 0.05 now"),
    ] {
        let mut resumed = Elastic::new(other, surroundings(&bert()), &dir).unwrap();
        let err = resumed.restore(elastic.state()).unwrap_err().to_string();
        assert!(err.contains(field) && err.contains("--fresh"), "{err}");
    }
    elastic.after_step(&mut t, &host, &step(true, 4.0), &mut |_| {}).unwrap();
    assert_eq!(steps(&elastic), Some(1));
}

/// The elastic controller, watched: every plan a step runs under, as (K, M, its largest stage's
/// bytes), its token slices and its stages.
struct Watched {
    elastic: Elastic,
    plans: Vec<(usize, usize, usize)>,
    slices: Vec<Vec<usize>>,
    stages: Vec<Vec<std::ops::Range<usize>>>,
}

impl pipetransformer::train::Controller<CpuDevice<f32>> for Watched {
    fn before_step(
        &mut self,
        t: &Trainer<CpuDevice<f32>>,
        host: &mut pipetransformer::model::HostBatch,
    ) -> pipetransformer::Result<pipetransformer::train::Prepared> {
        let plan = t.pipeline.plan();
        let peak = plan.partition.stage_memory.iter().copied().max().unwrap_or(0);
        self.plans.push((plan.config.pipeline_len, plan.config.micro_batches, peak));
        self.slices.push(plan.config.token_slices.clone());
        self.stages.push(plan.partition.stages.clone());
        self.elastic.before_step(t, host)
    }
    fn after_step(
        &mut self,
        t: &mut Trainer<CpuDevice<f32>>,
        host: &pipetransformer::model::HostBatch,
        step: &pipetransformer::pipeline::PipelineStep,
        on_event: &mut dyn FnMut(&Event),
    ) -> pipetransformer::Result<()> {
        self.elastic.after_step(t, host, step, on_event)
    }
    fn after_epoch(
        &mut self,
        t: &mut Trainer<CpuDevice<f32>>,
        epoch: u64,
        whole: bool,
        on_event: &mut dyn FnMut(&Event),
    ) -> pipetransformer::Result<()> {
        self.elastic.after_epoch(t, epoch, whole, on_event)
    }
    fn after_run(
        &mut self,
        t: &mut Trainer<CpuDevice<f32>>,
        on_event: &mut dyn FnMut(&Event),
    ) -> pipetransformer::Result<()> {
        self.elastic.after_run(t, on_event)
    }
}

/// The largest stage's bytes of `config` planned for `t`'s units at `samples` per micro-batch.
fn peak_bytes(t: &Trainer<CpuDevice<f32>>, config: PipelineConfig, samples: usize) -> usize {
    let profiles = t.profiles_for(samples, 0);
    let names = (0..profiles.len()).map(|i| i.to_string()).collect();
    let plan = pipetransformer::pipeline::Plan::new(config, &profiles, names, 2, 0).unwrap();
    plan.partition.stage_memory.into_iter().max().unwrap()
}

/// A memory limit holds for every plan AutoPipe runs: the micro-batch counts it times at the
/// start and after each freeze (fewer micro-batches hold more samples each, and under 1F1B
/// as many of them in flight), and the shapes it packs.
#[test]
fn autopipe_runs_only_plans_within_the_memory_limit() {
    let dir = scratch("memory-limit");
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let (one, two) = (PipelineConfig::default(), PipelineConfig { pipeline_len: 2, ..Default::default() });
    let trainer = |limit: usize| {
        let plan = PipelineConfig { micro_batches: 4, memory_limit: Some(limit), ..two.clone() };
        common::trainer_on(&bert(), 3, cpus(2), plan, train_config(), 3)
    };
    let t = trainer(usize::MAX);
    let start = peak_bytes(&t, PipelineConfig { micro_batches: 4, ..two.clone() }, 1);
    let mut frozen = trainer(usize::MAX);
    frozen.pipeline.freeze_prefix(3).unwrap();
    let (one_of_2, one_of_4) = (peak_bytes(&frozen, one.clone(), 2), peak_bytes(&frozen, one, 4));
    // Two cases. The limit is the configured plan's (K = 2, 4 micro-batches of one sample):
    // at the start, 2 micro-batches of two samples, both in flight on the first stage, need
    // more. The limit is one stage's after layer 0 freezes with 2 micro-batches of two samples
    // (all the cost in the head: one stage is the fastest shape): one micro-batch of 4 needs
    // more, and was planned first.
    assert!(peak_bytes(&t, PipelineConfig { micro_batches: 2, ..two.clone() }, 2) > start && one_of_4 > one_of_2);
    for (limit, cost_in_head) in [(start, false), (one_of_2, true)] {
        assert!(start <= limit);
        let mut t = trainer(limit);
        if cost_in_head {
            for (i, p) in t.profiles.iter_mut().enumerate() {
                let cost = if i == 5 { 1.0 } else { 0.0 };
                (p.forward, p.backward) = (cost, cost);
            }
        }
        let config =
            ElasticConfig { freeze: FreezeName::Table, table: vec![0, 1, 2], auto_pipe: true, ..Default::default() };
        let elastic = Elastic::new(config, surroundings(&bert()), &dir).unwrap();
        let mut watched = Watched { elastic, plans: vec![], slices: vec![], stages: vec![] };
        let mut events = Vec::new();
        watched.elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        t.fit(&data, None, &mut watched, &mut |e| events.push(e.clone())).unwrap();
        assert!(t.done());
        let plans = &watched.plans;
        for &(k, m, peak) in plans {
            assert!(peak <= limit, "K={k} M={m} plans {peak} bytes on a device, over the limit of {limit}: {plans:?}");
        }
        // Every freeze happened, and the tuner timed more than one count.
        assert_eq!(freezes(&events).len(), 2, "{events:?}");
        let counts: std::collections::BTreeSet<usize> = plans.iter().map(|p| p.1).collect();
        assert!(counts.len() > 1, "{plans:?}");
        if cost_in_head {
            assert!(plans.iter().any(|p| p.0 == 1), "{plans:?}");
        }
    }
}

/// The micro-batch counts are timed as checked against the memory limit, at the batch the run
/// planned with, when a step's batch holds more (an epoch's last, with a remainder joined):
/// the step runs, and the timing goes on.
#[test]
fn timing_under_a_memory_limit_goes_on_through_a_batch_larger_than_planned() {
    let dir = scratch("memory-limit-larger");
    // Batches of 5 where the controller plans with 4 (`surroundings`).
    let data = Pool::new(&bert(), 15, 5, 11);
    // The limit is the configured plan's (2 micro-batches of 2): 2 of 3 samples would not fit,
    // and 4 micro-batches, timed beside it, fit.
    let plan = PipelineConfig { pipeline_len: 2, micro_batches: 2, ..Default::default() };
    let unlimited = common::trainer_on(&bert(), 3, cpus(2), plan.clone(), train_config(), 3);
    let limit = peak_bytes(&unlimited, plan.clone(), 2);
    assert!(peak_bytes(&unlimited, plan.clone(), 3) > limit);
    let plan = PipelineConfig { memory_limit: Some(limit), ..plan };
    let mut t = common::trainer_on(&bert(), 3, cpus(2), plan, train_config(), 3);
    let config = ElasticConfig { auto_pipe: true, ..Default::default() };
    let mut elastic = Elastic::new(config, surroundings(&bert()), &dir).unwrap();
    let mut events = Vec::new();
    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert!(t.done());
    let timed = events
        .iter()
        .any(|e| matches!(e, Event::Transition(t) if t.reason.contains("M=2: ") && t.reason.contains("M=4: ")));
    assert!(timed, "{events:?}");
}

/// A checkpoint taken while AutoPipe times its micro-batch counts keeps the timing: the resumed
/// run times the rest and settles on a winner, instead of keeping whichever count was in force.
#[test]
fn a_run_resumed_while_timing_micro_batches_goes_on_timing() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("resume-timing");
    let timed = |events: &[Event]| -> Vec<(u64, String)> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Transition(t) if t.reason.starts_with("micro-batches timed") => Some((t.step, t.reason.clone())),
                _ => None,
            })
            .collect()
    };
    // The first freeze comes at step 9, after the timing of M = 2 and 4 at the start.
    let trainer =
        |at: &str| elastic_trainer(&bert(), cpus(2), &dir.join(at), FreezeInterval::Steps(9), FreedDevices::Replicas);
    let (mut first, mut elastic) = trainer("a");
    let mut events = Vec::new();
    elastic.start(&mut first, &mut |e| events.push(e.clone())).unwrap();
    first.fit(&data, Some(4), &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert!(timed(&events).is_empty(), "still timing at step 4: {events:?}");
    let path = dir.join("ckpt");
    first.save_checkpoint(&path, elastic.state()).unwrap();
    let m = first.pipeline.plan().config.micro_batches;
    // A timing that is not one this build wrote (the count in force past the candidates) is
    // refused by name, not left to index out of range at the next timed step.
    let mut bad = elastic.state();
    bad["tuning"][0]["at"] = 7.into();
    let (_, mut other) = trainer("bad");
    let e = other.restore(bad).unwrap_err().to_string();
    assert!(e.contains("AutoPipe's timing of micro-batch counts") && e.contains("in force at 7"), "{e}");
    drop((first, elastic));

    let (mut second, mut elastic) = trainer("b");
    let state = second.load_checkpoint(&path).unwrap();
    elastic.restore(state).unwrap();
    assert_eq!(second.pipeline.plan().config.micro_batches, m);
    let mut resumed = Vec::new();
    second.fit(&data, None, &mut elastic, &mut |e| resumed.push(e.clone())).unwrap();
    // Step 1 warmed up untimed and steps 2–4 timed half of the 2 counts × 3 rounds; step 5
    // warms the resumed pipeline up, steps 6–8 time the rest.
    let after = timed(&resumed);
    assert_eq!(after.len(), 1, "{resumed:?}");
    let (step, reason) = &after[0];
    assert!(*step == 8 && reason.contains("M=2: ") && reason.contains("M=4: "), "{after:?}");
    drop((second, elastic));
    // Resumed with AutoPipe off, the count in force stays.
    let (mut third, _) = trainer("c");
    let state = third.load_checkpoint(&path).unwrap();
    let config = ElasticConfig {
        freeze: FreezeName::Table,
        table: vec![0, 1, 2],
        freeze_interval: FreezeInterval::Steps(9),
        ..Default::default()
    };
    let mut off = Elastic::new(config, surroundings(&bert()), &dir.join("c")).unwrap();
    off.restore(state).unwrap();
    let mut events = Vec::new();
    third.fit(&data, None, &mut off, &mut |e| events.push(e.clone())).unwrap();
    assert_eq!(third.pipeline.plan().config.micro_batches, m);
    assert!(timed(&events).is_empty(), "{events:?}");
}

/// `Pool`'s batches with the third of each epoch cut to one sample, as an epoch's short last
/// batch is.
struct ShortThird(Pool);

impl BatchSource for ShortThird {
    fn batches_per_epoch(&self) -> usize {
        self.0.batches_per_epoch()
    }
    fn train_batch(&self, epoch: u64, index: usize) -> pipetransformer::Result<pipetransformer::model::HostBatch> {
        let batch = self.0.train_batch(epoch, index)?;
        if index == 2 { Ok(batch.split(batch.batch)?.swap_remove(0)) } else { Ok(batch) }
    }
    fn eval_batches(&self) -> usize {
        self.0.eval_batches()
    }
    fn eval_batch(&self, index: usize) -> pipetransformer::Result<pipetransformer::model::HostBatch> {
        self.0.eval_batch(index)
    }
}

/// A step whose batch is too short for the micro-batch count on trial (it runs fewer: another
/// schedule) is not timed as that count's: step 1 warms up, step 2 times `M` = 2, and step 3,
/// of one sample, times nothing.
#[test]
fn a_batch_shorter_than_the_micro_batches_on_trial_is_not_timed() {
    let data = ShortThird(Pool::new(&bert(), SAMPLES, BATCH, 11));
    let dir = scratch("short-batch-timing");
    let (mut t, mut elastic) =
        elastic_trainer(&bert(), cpus(2), &dir, FreezeInterval::Steps(9), FreedDevices::Replicas);
    elastic.start(&mut t, &mut |_| {}).unwrap();
    let timed = |elastic: &Elastic| -> usize {
        let rates = elastic.state()["tuning"][0]["rates"].clone();
        rates.as_array().map_or(0, |r| r.iter().map(|c| c.as_array().map_or(0, Vec::len)).sum())
    };
    t.fit(&data, Some(2), &mut elastic, &mut |_| {}).unwrap();
    assert_eq!((t.pipeline.plan().config.micro_batches, timed(&elastic)), (4, 1), "{}", elastic.state());
    t.fit(&data, Some(1), &mut elastic, &mut |_| {}).unwrap();
    assert_eq!(timed(&elastic), 1, "{}", elastic.state());
    t.fit(&data, Some(1), &mut elastic, &mut |_| {}).unwrap();
    assert_eq!(timed(&elastic), 2, "the next epoch's first batch is timed: {}", elastic.state());
}

/// A run that ends while AutoPipe times its micro-batch counts ends on the fastest count timed
/// so far, with a transition that says so: not on whichever count was on trial.
#[test]
fn a_run_that_ends_while_timing_keeps_the_fastest_count_timed() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let dir = scratch("end-timing");
    // Timing M = 2 and 4 takes a warm-up step and 2 × 3 rounds; the run has 4 steps.
    let train = TrainConfig { max_steps: 4, ..train_config() };
    let interval = FreezeInterval::Steps(9);
    let (mut t, mut elastic) = elastic_trainer_with(train, &bert(), cpus(2), &dir, interval, FreedDevices::Replicas);
    let mut events = Vec::new();
    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
    t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
    assert!(t.done());
    let Some(Event::Transition(last)) = events.iter().rfind(|e| matches!(e, Event::Transition(_))) else {
        panic!("no transition: {events:?}")
    };
    let m = t.pipeline.plan().config.micro_batches;
    assert_eq!(last.step, 4);
    assert_eq!(last.micro_batches.1, m);
    let rate = |m: usize| -> f64 {
        let at = last.reason.find(&format!("M={m}: ")).unwrap_or_else(|| panic!("M={m} untimed: {}", last.reason));
        last.reason[at + 5..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    assert!(last.reason.starts_with("the run ended during AutoPipe's timing of micro-batch counts"), "{}", last.reason);
    assert!(last.reason.ends_with(&format!("M={m} kept")), "{}", last.reason);
    let other = if m == 2 { 4 } else { 2 };
    assert!(rate(m) >= rate(other), "{}", last.reason);
    assert!(elastic.state()["tuning"].is_null(), "nothing left on trial in the checkpoint");
}

/// A run that ends during AutoPipe's trial of pipeline lengths ends on the length AutoPipe
/// chose (the one timed first), with a transition that says so: while the chosen length is
/// timed, it stays; while the other is, the chosen one comes back.
#[test]
fn a_run_that_ends_during_a_trial_of_pipeline_lengths_keeps_the_chosen_length() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let run = |max_steps: u64| {
        let dir = scratch(&format!("end-trial-{max_steps}"));
        let (mut t, mut elastic) = trial_trainer_until(true, vec![0, 1], &dir, max_steps);
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
        let state = elastic.state();
        assert!(state["shape_trial"].is_null() && state["tuning"].is_null(), "{state}");
        assert_chained(&events);
        (t.pipeline.plan().config.pipeline_len, events)
    };
    let step_of = |events: &[Event], starts: &str| {
        events
            .iter()
            .find_map(|e| match e {
                Event::Transition(t) if t.reason.starts_with(starts) => Some(t.step),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no `{starts}`: {:?}", transition_log(events)))
    };
    let (_, whole) = run(0);
    // The freeze that chose K = 1 and begins the trial; the switch to K = 2 for its timing.
    let (chosen, other) = (step_of(&whole, "Table rule"), step_of(&whole, "AutoPipe times K=2 against K=1"));
    for (end, says) in [
        (chosen + 2, "; K=1 kept, K=2 (in force before the trial) not timed"),
        (other + 2, "the run ended during AutoPipe's trial of pipeline lengths: K=1 ("),
    ] {
        let (k, events) = run(end);
        let log = transition_log(&events);
        let last = log.last().unwrap();
        assert!(last.0.contains(says) && last.2 == 1 && k == 1, "ending at step {end}: {log:?}");
        assert_eq!(step_of(&events, "the run ended"), end);
    }
}

/// The run's end settles what AutoPipe left under way, wherever the end comes from: a freeze at
/// the last epoch's end (an epoch's interval ends after its evaluation, after the run's last
/// step) starts a timing of micro-batch counts for the shape it leaves, and an evaluation that
/// stops the run early can come while the first shape's counts are timed. Either way the run
/// ends on a count it chose, says so, and its checkpoint holds nothing on trial.
#[test]
fn a_run_settles_what_autopipe_left_under_way_wherever_it_ends() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let end = |train: TrainConfig, interval, name: &str| {
        let dir = scratch(name);
        let (mut t, mut elastic) =
            elastic_trainer_with(train, &bert(), cpus(2), &dir, interval, FreedDevices::Replicas);
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        while !t.done() {
            t.fit(&data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
            t.take_new_best();
        }
        let state = elastic.state();
        assert!(state["tuning"].is_null() && state["shape_trial"].is_null(), "{name}: {state}");
        let log = transition_log(&events);
        let last = log.last().map(|l| l.0.as_str()).unwrap_or_default();
        assert!(last.starts_with("the run ended during AutoPipe's timing of micro-batch counts"), "{name}: {log:?}");
        assert_chained(&events);
        (t, events)
    };
    // One epoch of 3 steps, whose end freezes a layer by the table.
    let (_, events) = end(TrainConfig { epochs: 1, ..train_config() }, FreezeInterval::Epoch, "settle-epoch-end");
    assert_eq!(freezes(&events).iter().map(|f| f.step).collect::<Vec<_>>(), [3]);
    // Patience 1 and a gain no evaluation makes: the second evaluation, after step 2, stops the
    // run while the first shape's counts are timed (a warm-up step, then 2 × 3 rounds).
    let train = TrainConfig {
        eval_every: 1,
        keep_best: KeepBest::Loss,
        early_stopping_patience: 1,
        early_stopping_min_delta: 1e9,
        ..train_config()
    };
    let (t, _) = end(train, FreezeInterval::Steps(9), "settle-early-stop");
    assert!(t.stopped_early() && t.position.step == 2, "step {}", t.position.step);
}

/// Launched processes time their own steps, so each would choose its own shape at a
/// transition, and one that changed K alone would meet the others' next collective with
/// another (a hang, or sums of mismatched buffers). Rank 0's choice holds on every process:
/// here rank 0's timings make its head dearer than all else (one device is as fast as two),
/// rank 1's do not (a pipeline of 2 pays).
#[test]
fn launched_processes_take_rank_0s_shape_at_a_transition() {
    use pipetransformer::comm::process_group::ProcessGroup;
    use pipetransformer::comm::rendezvous::Secret;
    use std::sync::Arc;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (addr, secret) = (format!("127.0.0.1:{port}"), Secret::new("test").unwrap());
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let shapes: Vec<Vec<(usize, usize)>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (addr, secret, data) = (&addr, &secret, &data);
                s.spawn(move || {
                    let timeout = std::time::Duration::from_secs(20);
                    let group = Arc::new(ProcessGroup::join(addr, rank, 2, secret, timeout).unwrap());
                    let dir = scratch(&format!("launched-shape-{rank}"));
                    let (mut t, _) =
                        elastic_trainer(&bert(), cpus(2), &dir, FreezeInterval::Epoch, FreedDevices::Replicas);
                    if rank == 0 {
                        let head = t.profiles.last_mut().unwrap();
                        (head.forward, head.backward) = (100.0, 100.0);
                    }
                    t.pipeline.set_process_group(Some(group)).unwrap();
                    let config = ElasticConfig {
                        freeze: FreezeName::Table,
                        table: vec![0, 1],
                        auto_pipe: true,
                        ..Default::default()
                    };
                    let mut elastic = Elastic::new(config, surroundings(&bert()), &dir).unwrap();
                    let mut events = Vec::new();
                    elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
                    t.fit(data, None, &mut elastic, &mut |e| events.push(e.clone())).unwrap();
                    freezes(&events).iter().map(|t| (t.pipeline_len.1, t.replicas.1)).collect()
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(shapes[0], [(1, 1)], "rank 0 shortens the pipeline");
    assert_eq!(shapes[1], shapes[0], "rank 1 takes rank 0's shape");
}

/// Keeping the best evaluation (`train.keep_best`) returns from `fit` after each new best, for
/// its weights to be written: under the whole system, boundaries moving mid-epoch and the
/// cache spilling, a run evaluated every step that keeps its best takes the same steps, to the
/// bit, with the same transitions, as one that does not; each best's weights are those the
/// other run held after that step; and patience then ends the run at its stop.
#[test]
fn keeping_the_best_changes_no_step_of_the_elastic_loop() {
    let data = Pool::new(&bert(), SAMPLES, BATCH, 11);
    let run = |keep: KeepBest, patience: u64, name: &str| {
        let train = TrainConfig { eval_every: 1, keep_best: keep, early_stopping_patience: patience, ..train_config() };
        let dir = scratch(name);
        let (mut t, mut elastic) =
            elastic_trainer_with(train, &bert(), cpus(2), &dir, FreezeInterval::Steps(4), FreedDevices::Replicas);
        let mut events = Vec::new();
        elastic.start(&mut t, &mut |e| events.push(e.clone())).unwrap();
        // Per step, the weights after it (the plain run's), or those of each new best.
        let mut weights = Vec::new();
        while !t.done() {
            t.fit(&data, if keep == KeepBest::Off { Some(1) } else { None }, &mut elastic, &mut |e| {
                events.push(e.clone())
            })
            .unwrap();
            let best = t.take_new_best();
            if keep == KeepBest::Off || best.is_some() {
                weights.push((t.position.step, t.pipeline.parameters(0).unwrap()));
            }
        }
        drop(elastic);
        (t, events, weights)
    };
    let (plain, plain_events, after_each) = run(KeepBest::Off, 0, "plain");
    let (kept, kept_events, bests) = run(KeepBest::Loss, 0, "keep-best");
    let transitions = |events: &[Event]| freezes(events).iter().map(|t| (t.step, t.frozen_units)).collect::<Vec<_>>();
    assert_eq!(curve(&kept_events), curve(&plain_events), "the same steps, to the bit");
    assert_eq!(transitions(&kept_events), transitions(&plain_events));
    assert_eq!(transitions(&plain_events).len(), 2);
    assert_eq!(kept.pipeline.parameters(0).unwrap(), plain.pipeline.parameters(0).unwrap());
    let announced: Vec<u64> =
        kept_events.iter().filter_map(|e| if let Event::Best { step, .. } = e { Some(*step) } else { None }).collect();
    assert!(announced.len() >= 3, "bests at steps {announced:?}");
    assert_eq!(bests.iter().map(|b| b.0).collect::<Vec<_>>(), announced);
    for (step, weights) in &bests {
        let (_, want) = &after_each[*step as usize - 1];
        assert!(weights == want, "the best of step {step} holds the weights after it");
    }
    assert_eq!(kept.selection.best.map(|b| b.step), announced.last().copied());
    // Patience 1 on accuracy (a few values over 12 samples, so ties come) stops at the first
    // evaluation no better than every one before it.
    let accuracy: Vec<f64> = plain_events
        .iter()
        .filter_map(|e| match e {
            Event::Eval { eval, .. } | Event::Epoch { eval, .. } => Some(eval.accuracy),
            _ => None,
        })
        .collect();
    assert_eq!(accuracy.len() as u64, plain.position.step, "an evaluation after every step");
    let best_before = |i: usize| accuracy[..i].iter().copied().fold(f64::MIN, f64::max);
    let not_better = (1..accuracy.len()).find(|&i| accuracy[i] <= best_before(i)).unwrap() as u64 + 1;
    let (stopped, stopped_events, _) = run(KeepBest::Accuracy, 1, "patience");
    assert_eq!(stopped.position.step, not_better);
    let said = stopped_events.iter().any(|e| matches!(e, Event::EarlyStop { step, .. } if *step == not_better));
    assert!(stopped.stopped_early() && said);
    assert_eq!(curve(&stopped_events), curve(&plain_events)[..not_better as usize]);
}
