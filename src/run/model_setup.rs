//! The model a run trains: a pretrained Hugging Face folder with a new head sized for the data,
//! or an architecture from scratch, each checked against the data before a step (the kind of
//! data it reads, its tokenizer's ids, its images' shape, its heads' width on the device).

use super::config::RunConfig;
use super::data_setup::{DataInfo, DataKind};
use crate::data;
use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::model::{InputSpec, Model, ModelConfig};
use crate::weights::{self, LoadOptions, LoadReport};

/// Refuses a `model.pretrained` that is not a folder, naming the setting and how the configs'
/// folders are installed (a missing one otherwise surfaced as its first file's read error).
pub(super) fn check_pretrained(dir: &std::path::Path) -> Result<()> {
    match dir.is_dir() {
        true => Ok(()),
        false => Err(config_error(
            "model.pretrained",
            format!(
                "{} is not a folder; expected a Hugging Face model folder (config.json, model.safetensors, \
                 tokenizer.json): `make setup` (scripts/setup.sh) installs the ones configs/ name",
                dir.display()
            ),
        )),
    }
}

/// The folder a text run's `tokenizer.json` is read from: `model.tokenizer`, else the
/// pretrained model's.
pub(super) fn tokenizer_dir(config: &RunConfig) -> Result<&std::path::Path> {
    let m = &config.model;
    match (&m.tokenizer, &m.pretrained) {
        (Some(dir), _) if !dir.is_dir() => Err(config_error(
            "model.tokenizer",
            format!("{} is not a folder; expected a folder holding tokenizer.json", dir.display()),
        )),
        (Some(dir), _) if !dir.join(weights::TOKENIZER_FILE).is_file() => Err(config_error(
            "model.tokenizer",
            format!("{} holds no {}; expected a folder holding one", dir.display(), weights::TOKENIZER_FILE),
        )),
        (Some(dir), _) => Ok(dir),
        (None, Some(dir)) => check_pretrained(dir).map(|()| dir.as_path()),
        (None, None) => Err(config_error(
            "model.tokenizer",
            "a text dataset needs a tokenizer: model.pretrained (a Hugging Face model folder), or, for a model \
             built from model.config, model.tokenizer (a folder holding tokenizer.json, such as \
             weights/all-minilm-l6-v2)",
        )),
    }
}

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
            let report = weights::load_into_model(&mut model, dev, &file, &LoadOptions::default())?;
            deferred.draw(&mut model, dev, &report.missing)?;
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
                ModelConfig::Gpt(c) => c.vocab_size = info.classes,
            }
            let model = Model::new_keeping(dev, &model_config, m.seed, keep)?;
            Ok((model, model_config, None))
        }
        (None, None) => Err(Error::Config { field: "model".into(), message: "set `pretrained` or `config`".into() }),
    }
}

/// A model of another kind than the dataset (a GPT on digits, a ViT on hamlet) is refused by
/// the dataset's name when the run is built, not by the first step's upload.
pub(super) fn check_kind(model: &ModelConfig, info: &DataInfo) -> Result<()> {
    let (wants, data) = (DataKind::of_config(model), DataKind::of_data(info));
    if wants == data {
        return Ok(());
    }
    let reads = match wants {
        DataKind::Chars => "a character-level language model",
        DataKind::Images => "an image classifier",
        DataKind::Texts => "a text classifier",
    };
    Err(config_error(
        "data.dataset",
        format!(
            "{} is {}; the model (a {}) is {reads}: give a dataset of the model's kind, or a model of the \
             dataset's (model.config or model.pretrained)",
            info.name,
            data.describe(info),
            model.family()
        ),
    ))
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

#[cfg(test)]
mod tests {
    /// A pretrained folder that is not there is named by its setting, with the way to install it.
    #[test]
    fn a_missing_pretrained_folder_is_named_by_its_setting() {
        let config = super::RunConfig::parse(
            "[model]\npretrained = \"weights/pt-no-such-model\"\n[data]\ndataset = \"rotten_tomatoes\"\nbatch_size = 8\n\
             [train]\nepochs = 1\nlr = 1e-4\n[output]\ndir = \"runs/x\"\n",
            "test",
            &[],
        )
        .unwrap();
        let e = super::tokenizer_dir(&config).unwrap_err().to_string();
        assert!(e.contains("model.pretrained") && e.contains("pt-no-such-model is not a folder"), "{e}");
        assert!(e.contains("make setup"), "{e}");
    }
}
