//! The model a run trains: a pretrained Hugging Face folder with a new head sized for the data,
//! or an architecture from scratch, each checked against the data before a step (the kind of
//! data it reads, its tokenizer's ids, its images' shape, its heads' width on the device).

use super::config::RunConfig;
use super::data_setup::{DataInfo, check_kind, check_pretrained};
use crate::data;
use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::model::{InputSpec, Model, ModelConfig};
use crate::weights::{self, LoadOptions, LoadReport};

/// Builds the model: a pretrained Hugging Face checkpoint with a new head sized for the data,
/// or an architecture from scratch (its label count or vocabulary set from the data), keeping
/// the values of the units `keep` names only (the others [hollow](Model::new_keeping)).
pub fn build_model<D: Device>(
    dev: &D,
    config: &RunConfig,
    info: &DataInfo,
    keep: &dyn Fn(usize) -> bool,
) -> Result<(Model<D>, ModelConfig, Option<LoadReport>)> {
    let m = &config.model;
    match (&m.pretrained, &m.config) {
        (Some(dir), _) => {
            check_pretrained(dir)?;
            let mut model_config = weights::read_hf_config(dir.join(weights::CONFIG_FILE), None)?;
            check_kind(&model_config, info)?;
            match &mut model_config {
                ModelConfig::Bert(c) => {
                    c.num_labels = info.classes;
                    if let Some(p) = m.pooling {
                        c.pooling = p;
                    }
                    if let Some(ids) = &info.tokenizer {
                        // (Named by the setting that gave the tokenizer.)
                        let field = if m.tokenizer.is_some() { "model.tokenizer" } else { "model.pretrained" };
                        let (model, expected) =
                            (dir.display().to_string(), "expected the tokenizer made for this model");
                        ids.fit(field, &model, c.vocab_size, c.type_vocab_size, expected)?;
                    }
                }
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                ModelConfig::Gpt(_) => {}
            }
            if m.pooling.is_some() && !matches!(model_config, ModelConfig::Bert(_)) {
                return Err(config_error(
                    "model.pooling",
                    format!(
                        "chooses a BERT classifier's pooling; {} holds a {}, whose head has none to choose: leave it out",
                        dir.display(),
                        model_config.family()
                    ),
                ));
            }
            // Drawn only where the file has no weights (the new head), as a random build would.
            let (mut model, deferred) = Model::new_for_loading(dev, &model_config, m.seed, keep)?;
            let file = weights::load_safetensors(dir.join(weights::WEIGHTS_FILE))?;
            let mut report = weights::load_into_model(&mut model, dev, &file, &LoadOptions::default())?;
            deferred.draw(&mut model, dev, &report.missing)?;
            if let ModelConfig::Vit(c) = &model_config {
                // The pixels its processor fed it, from this run's: folded into the patch
                // embedding (a Google ViT's `(x/255 − 0.5)/0.5`, where this run feeds `x/255`).
                let path = dir.join(weights::PREPROCESSOR_FILE);
                let data_max = f64::from(info.pixel_max.unwrap_or(255));
                if let Some(t) =
                    weights::read_pixel_transform(&path, c.num_channels)?.filter(|t| !t.is_identity(data_max))
                {
                    t.fold_into(&mut model, dev, data_max)?;
                    report.folded = Some(format!(
                        "{}'s pixel preprocessing (rescale {}, mean {:?}, std {:?}) folded into the patch embedding, \
                         which now takes this run's pixels (raw values / {data_max})",
                        path.display(),
                        t.scale,
                        t.mean,
                        t.std
                    ));
                }
            }
            Ok((model, model_config, Some(report)))
        }
        (None, Some(c)) => {
            check_kind(c, info)?;
            if let Some(n) = m.num_labels_written.filter(|n| *n != info.classes) {
                return Err(Error::Config {
                    field: "model.config.num_labels".into(),
                    message: format!(
                        "is {n}, but {} has {} classes: set it to {} or leave it out (the data sets it)",
                        info.name, info.classes, info.classes
                    ),
                });
            }
            let mut model_config = c.clone();
            match &mut model_config {
                ModelConfig::Bert(c) => {
                    c.num_labels = info.classes;
                    if let Some(ids) = &info.tokenizer {
                        // (0: the tokenizer's, as the data gives a GPT its vocabulary.)
                        if c.vocab_size == 0 {
                            c.vocab_size = ids.vocab;
                        }
                        let what = format!("vocab_size {}, type_vocab_size {}", c.vocab_size, c.type_vocab_size);
                        let expected = format!(
                            "expected a vocab_size of at least {} (0 takes the tokenizer's) and a type_vocab_size above {}",
                            ids.vocab, ids.pad_type_id
                        );
                        ids.fit("model.config", &what, c.vocab_size, c.type_vocab_size, &expected)?;
                    }
                }
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                // (0: the data's characters, which a written size must equal.)
                ModelConfig::Gpt(c) if c.vocab_size != 0 && c.vocab_size != info.classes => {
                    return Err(Error::Config {
                        field: "model.config.vocab_size".into(),
                        message: format!(
                            "is {}, but {} has {} characters: set it to {} or to 0 (the data sets it)",
                            c.vocab_size, info.name, info.classes, info.classes
                        ),
                    });
                }
                ModelConfig::Gpt(c) => c.vocab_size = info.classes,
            }
            let model = Model::new_keeping(dev, &model_config, m.seed, keep)?;
            Ok((model, model_config, None))
        }
        (None, None) => Err(Error::Config { field: "model".into(), message: "set `pretrained` or `config`".into() }),
    }
}

/// Bytes a trained parameter takes on a cpu device: f32 weight, gradient and AdamW's two
/// moments.
const TRAINED_PARAMETER_BYTES: u64 = 16;

/// A model whose parameters cannot fit this machine's memory on a cpu device (the only kind
/// with threads, which holds its buffers in host memory) is refused with the sizes, before a
/// byte is allocated: otherwise the kernel kills the process mid-build, saying nothing. (For a
/// process that holds the whole model: a launched run's stages hold their own units only.)
pub(super) fn check_host_memory<D: Device>(dev: &D, model: &ModelConfig) -> Result<()> {
    let Some(total) = dev.threads().and_then(|_| host_memory_bytes()) else { return Ok(()) };
    // (Sizes the data sets, not known yet, at their least; a config the build would refuse
    // is left to it, which names what is wrong.)
    let mut model = model.clone();
    match &mut model {
        ModelConfig::Bert(c) => (c.vocab_size, c.num_labels) = (c.vocab_size.max(1), c.num_labels.max(1)),
        ModelConfig::Gpt(c) => c.vocab_size = c.vocab_size.max(1),
        ModelConfig::Vit(c) => c.num_labels = c.num_labels.max(1),
    }
    let Ok(spec) = model.spec() else { return Ok(()) };
    let params = spec.parameter_count().unwrap_or(usize::MAX) as u64;
    let needs = params.saturating_mul(TRAINED_PARAMETER_BYTES);
    if needs <= total {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    Err(config_error(
        "model.config",
        format!(
            "has {params} parameters, which take {:.1} GiB on a cpu device (f32 weights, gradients and AdamW's two \
             moments: {TRAINED_PARAMETER_BYTES} bytes each) where this machine has {:.1} GiB of memory: give a \
             smaller one",
            gib(needs),
            gib(total)
        ),
    ))
}

/// The machine's memory (`MemTotal` in /proc/meminfo), where it can be read.
fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim();
    kib.parse::<u64>().ok()?.checked_mul(1024)
}

/// A model whose attention heads are wider than the device's kernels run (the GPU's hold a
/// head's row in registers) is refused by its settings when the run is built, not by the
/// first forward's launch.
pub(super) fn check_head_dim<D: Device>(config: &RunConfig, spec: &crate::model::Spec, dev: &D) -> Result<()> {
    let Some(most) = dev.max_head_dim().filter(|&most| spec.head_dim() > most) else { return Ok(()) };
    let field = if config.model.pretrained.is_some() { "model.pretrained" } else { "model.config" };
    Err(config_error(
        field,
        format!(
            "a hidden size of {} over {} head{} is {} channels a head; the attention kernels of {} run at most \
             {most}: give more heads or a smaller hidden size (cpu devices have no such bound)",
            spec.hidden,
            spec.heads,
            if spec.heads == 1 { "" } else { "s" },
            spec.head_dim(),
            dev.name()
        ),
    ))
}

/// An image model whose input does not fit the dataset's images is refused by its settings
/// when the run is built, not by the first step's upload; so is one whose channels and side
/// differ though the count of values agrees (3 channels of 8² read as 12 of 4²).
pub(super) fn check_images(spec: &crate::model::Spec, info: &DataInfo) -> Result<()> {
    let (InputSpec::Image { channels, image_size, .. }, Some(image)) = (spec.input, info.image) else {
        return Ok(());
    };
    if image == (channels, image_size) {
        return Ok(());
    }
    Err(Error::Config {
        field: "model.config".into(),
        message: format!(
            "num_channels {channels} and image_size {image_size} ({channels} × {image_size}² values per image), but \
             the images of {} are {} of {}×{} ({} values): set the model's num_channels and image_size to the \
             dataset's",
            info.name,
            data::image_channels(image.0),
            image.1,
            image.1,
            image.0 * image.1 * image.1
        ),
    })
}
