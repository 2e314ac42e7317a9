//! Batches: `HostBatch` as the data pipeline builds it, `Batch` as a device sees it (validated,
//! uploaded, with position ids and the dropout coordinates).

use super::config::{HeadSpec, InputSpec, ModelConfig, Spec};
use crate::device::Device;
use crate::error::{Result, data_error};
use crate::ops::dropout::DropoutCoords;
use crate::rng::Rng;

/// Label value that contributes no loss (padding positions of a language-model batch).
pub const IGNORE_INDEX: u32 = u32::MAX;

/// One batch on the host. Text batches set `tokens` (and optionally `token_types` and
/// `attention_mask`); image batches set `pixels`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostBatch {
    /// Samples in the batch.
    pub batch: usize,
    /// Tokens per sample (text); ignored for images.
    pub seq: usize,
    /// Token ids, `[batch, seq]`.
    pub tokens: Option<Vec<u32>>,
    /// Token-type ids, `[batch, seq]` (zeros when absent).
    pub token_types: Option<Vec<u32>>,
    /// 1 for real tokens, 0 for padding, `[batch, seq]` (all real when absent).
    pub attention_mask: Option<Vec<u32>>,
    /// Pixels, `[batch, channels, height, width]`.
    pub pixels: Option<Vec<f32>>,
    /// Class per sample `[batch]` (classifiers), or next token per position `[batch, seq]`
    /// with [`IGNORE_INDEX`] where no loss applies (language models).
    pub targets: Vec<u32>,
    /// Tokens that precede this batch's first position in each sequence (a TeraPipe slice);
    /// position ids start here.
    pub position_offset: usize,
    /// Tokens of the whole sequences when this batch is a token slice of them (TeraPipe), else
    /// 0: a slice draws the whole sequences' dropout masks.
    pub whole_seq: usize,
    /// Global index of the first sample, so that dropout masks of a micro-batch equal those of
    /// the same samples in the whole batch.
    pub sample_offset: u64,
    /// Each sample's stable id in its dataset (`[batch]`; empty when the source has none): the
    /// key of the frozen-activation cache, which must not depend on the batch a sample is in.
    pub sample_ids: Vec<u64>,
    /// The hidden states entering unit `depth`, when a cache supplies them: the model starts
    /// there instead of at unit 0.
    pub hidden: Option<Hidden>,
}

/// Hidden states entering unit `depth` of a model, `[batch, seq, width]` on the host: a frozen
/// prefix's output (PipeTransformer's AutoCache), from which the first stage starts instead of
/// running the frozen units again.
#[derive(Clone, Debug, PartialEq)]
pub struct Hidden {
    /// The unit these states enter.
    pub depth: usize,
    /// Elements per position (the model's hidden size).
    pub width: usize,
    /// Values, `[batch, seq, width]`.
    pub data: Vec<f32>,
}

impl HostBatch {
    /// A batch of random inputs for `config`, drawn from `seed`: `batch` sequences of `seq`
    /// tokens (text), or `batch` random images; random labels (next tokens for a language
    /// model). The benchmarks' and the tests' synthetic workload.
    pub fn random(config: &ModelConfig, batch: usize, seq: usize, seed: u64) -> HostBatch {
        let mut rng = Rng::new(seed);
        let ids = |rng: &mut Rng, n: usize, below: usize| -> Vec<u32> {
            (0..n).map(|_| rng.below(below as u64) as u32).collect()
        };
        match config {
            ModelConfig::Bert(c) => HostBatch {
                batch,
                seq,
                tokens: Some(ids(&mut rng, batch * seq, c.vocab_size)),
                targets: ids(&mut rng, batch, c.num_labels),
                ..Default::default()
            },
            ModelConfig::Gpt(c) => {
                let tokens = ids(&mut rng, batch * seq, c.vocab_size);
                // Next-token targets: the sequence shifted left, the last position ignored.
                let targets =
                    (0..batch * seq).map(|i| if (i + 1) % seq == 0 { IGNORE_INDEX } else { tokens[i + 1] }).collect();
                HostBatch { batch, seq, tokens: Some(tokens), targets, ..Default::default() }
            }
            ModelConfig::Vit(c) => {
                let n = batch * c.num_channels * c.image_size * c.image_size;
                let pixels = (0..n).map(|_| rng.uniform() as f32).collect();
                let targets = ids(&mut rng, batch, c.num_labels);
                HostBatch { batch, pixels: Some(pixels), targets, ..Default::default() }
            }
        }
    }

    /// Refuses a batch whose fields disagree with its `batch` and `seq` (a batch source's
    /// mistake), naming the field and the size expected, before anything cuts it by them:
    /// token fields of `batch × seq` ids, a target per sample or per token (or none), pixels,
    /// sample ids and cached hidden states a whole share per sample.
    pub fn check_sizes(&self) -> Result<()> {
        let b = self.batch;
        let exactly = |what: &str, got: usize, want: usize| match got == want {
            true => Ok(()),
            false => Err(data_error(what, format!("has {got} values; a batch of {b} × {} expects {want}", self.seq))),
        };
        for (what, field) in
            [("tokens", &self.tokens), ("token_types", &self.token_types), ("attention_mask", &self.attention_mask)]
        {
            if let Some(v) = field {
                exactly(what, v.len(), b * self.seq)?;
            }
        }
        // (A language model's targets are per token, and its cached batches carry no tokens;
        // a batch without labels, none.)
        if !self.targets.is_empty() && self.targets.len() != b * self.seq {
            exactly("targets", self.targets.len(), b)?;
        }
        if !self.sample_ids.is_empty() {
            exactly("sample_ids", self.sample_ids.len(), b)?;
        }
        let shared = |what: &str, len: usize, unit: usize| match b > 0 && len.is_multiple_of(b * unit.max(1)) {
            true => Ok(()),
            false => Err(data_error(what, format!("has {len} values, not an equal share for each of {b} samples"))),
        };
        if let Some(p) = &self.pixels {
            shared("pixels", p.len(), 1)?;
        }
        if let Some(h) = &self.hidden {
            shared("hidden", h.data.len(), h.width)?;
        }
        Ok(())
    }

    /// Cuts the batch into `parts` contiguous pieces of near-equal size (the first
    /// `batch mod parts` get one sample more), each keeping its samples' global positions (so
    /// dropout masks, and hence the training step, do not depend on the cut).
    pub fn split(&self, parts: usize) -> Result<Vec<HostBatch>> {
        self.check_sizes()?;
        if parts == 0 || parts > self.batch {
            return Err(crate::error::config_error(
                "micro_batches",
                format!("cannot cut a batch of {} samples into {parts} non-empty parts", self.batch),
            ));
        }
        let (base, extra) = (self.batch / parts, self.batch % parts);
        let per_sample_targets = self.targets.len().checked_div(self.batch).unwrap_or(0);
        let mut start = 0;
        Ok((0..parts)
            .map(|i| {
                let n = base + usize::from(i < extra);
                let rows = |v: &Vec<u32>| v[start * self.seq..(start + n) * self.seq].to_vec();
                let pixels_per = self.pixels.as_ref().map_or(0, |p| p.len() / self.batch);
                let part = HostBatch {
                    batch: n,
                    seq: self.seq,
                    tokens: self.tokens.as_ref().map(rows),
                    token_types: self.token_types.as_ref().map(rows),
                    attention_mask: self.attention_mask.as_ref().map(rows),
                    pixels: self.pixels.as_ref().map(|p| p[start * pixels_per..(start + n) * pixels_per].to_vec()),
                    targets: self.targets[start * per_sample_targets..(start + n) * per_sample_targets].to_vec(),
                    position_offset: self.position_offset,
                    whole_seq: self.whole_seq,
                    sample_offset: self.sample_offset + start as u64,
                    sample_ids: self.sample_ids.get(start..start + n).map(<[u64]>::to_vec).unwrap_or_default(),
                    hidden: self.hidden.as_ref().map(|h| {
                        let per = h.data.len() / self.batch;
                        Hidden { depth: h.depth, width: h.width, data: h.data[start * per..(start + n) * per].to_vec() }
                    }),
                };
                start += n;
                part
            })
            .collect())
    }

    /// The samples at `indices`, in that order, keeping the batch's padding and offsets (a
    /// sample's dropout position changes with its index; select only for work without dropout,
    /// such as running a frozen prefix). An index past the batch is an error.
    pub fn select(&self, indices: &[usize]) -> Result<HostBatch> {
        self.check_sizes()?;
        if let Some(&i) = indices.iter().find(|&&i| i >= self.batch) {
            return Err(crate::error::data_error(
                "sample index",
                format!("{i} selected from a batch of {} samples (0 to {})", self.batch, self.batch.saturating_sub(1)),
            ));
        }
        let rows = |v: &Vec<u32>, per: usize| {
            indices.iter().flat_map(|&i| v[i * per..(i + 1) * per].iter().copied()).collect()
        };
        let per_sample_targets = self.targets.len().checked_div(self.batch).unwrap_or(0);
        let floats = |v: &Vec<f32>| {
            let per = v.len() / self.batch.max(1);
            indices.iter().flat_map(|&i| v[i * per..(i + 1) * per].iter().copied()).collect()
        };
        Ok(HostBatch {
            batch: indices.len(),
            seq: self.seq,
            tokens: self.tokens.as_ref().map(|v| rows(v, self.seq)),
            token_types: self.token_types.as_ref().map(|v| rows(v, self.seq)),
            attention_mask: self.attention_mask.as_ref().map(|v| rows(v, self.seq)),
            pixels: self.pixels.as_ref().map(floats),
            targets: rows(&self.targets, per_sample_targets),
            position_offset: self.position_offset,
            whole_seq: self.whole_seq,
            sample_offset: self.sample_offset,
            sample_ids: indices.iter().filter_map(|&i| self.sample_ids.get(i).copied()).collect(),
            hidden: self.hidden.as_ref().map(|h| Hidden { depth: h.depth, width: h.width, data: floats(&h.data) }),
        })
    }

    /// Joins consecutive batches into one (a step that takes several of the source's batches).
    /// Token sequences are padded to the longest (token 0, masked out, type 0; targets of a
    /// language model padded with [`IGNORE_INDEX`]); the first part's offsets are kept, so the
    /// parts must be consecutive in their epoch.
    pub fn concat(parts: &[HostBatch]) -> Result<HostBatch> {
        let Some(first) = parts.first() else {
            return Err(crate::error::data_error("batches", "nothing to join"));
        };
        if parts.len() == 1 {
            return Ok(first.clone());
        }
        let seq = parts.iter().map(|p| p.seq).max().unwrap_or(0);
        let padded = |p: &HostBatch, v: &Option<Vec<u32>>, fill: u32| -> Option<Vec<u32>> {
            v.as_ref().map(|v| {
                let mut out = Vec::with_capacity(p.batch * seq);
                for row in v.chunks(p.seq.max(1)) {
                    out.extend_from_slice(row);
                    out.resize(out.len() + seq - p.seq, fill);
                }
                out
            })
        };
        let lm = first.targets.len() != first.batch;
        let mut out = HostBatch { seq, position_offset: first.position_offset, ..first.clone() };
        out.batch = parts.iter().map(|p| p.batch).sum();
        let join = |f: &dyn Fn(&HostBatch) -> Option<Vec<u32>>| -> Option<Vec<u32>> {
            parts.iter().map(f).collect::<Option<Vec<_>>>().map(|v| v.concat())
        };
        out.tokens = join(&|p| padded(p, &p.tokens, 0));
        out.token_types = join(&|p| padded(p, &p.token_types, 0));
        // A part without a mask is all real tokens; padding it needs one.
        let needs_mask = parts.iter().any(|p| p.attention_mask.is_some() || p.seq != seq);
        out.attention_mask = needs_mask.then(|| {
            parts
                .iter()
                .flat_map(|p| {
                    let mask = p.attention_mask.clone().unwrap_or_else(|| vec![1; p.batch * p.seq]);
                    padded(p, &Some(mask), 0).unwrap_or_default()
                })
                .collect()
        });
        out.targets = if lm {
            parts.iter().flat_map(|p| padded(p, &Some(p.targets.clone()), IGNORE_INDEX).unwrap_or_default()).collect()
        } else {
            parts.iter().flat_map(|p| p.targets.iter().copied()).collect()
        };
        out.pixels = parts.iter().map(|p| p.pixels.clone()).collect::<Option<Vec<_>>>().map(|v| v.concat());
        out.sample_ids = parts.iter().flat_map(|p| p.sample_ids.iter().copied()).collect();
        out.hidden = None;
        Ok(out)
    }

    /// Cuts every sequence into consecutive token slices of `lengths` (TeraPipe): slice `j`
    /// holds positions `c_j..c_j + l_j` of every sample, with its targets, its position ids
    /// starting at `c_j`, and the whole sequences' dropout coordinates. Only language-model
    /// batches of unpadded sequences can be sliced (a classifier's loss needs the whole
    /// sequence; a padding mask would have to cover the context as well).
    pub fn token_slices(&self, lengths: &[usize]) -> Result<Vec<HostBatch>> {
        self.check_sizes()?;
        let bad = |message: String| Err(crate::error::config_error("pipeline.token_slices", message));
        let total: usize = lengths.iter().sum();
        if lengths.is_empty() || lengths.contains(&0) {
            return bad(format!("{lengths:?} has a zero-length slice (or none); every slice needs at least one token"));
        }
        if total != self.seq {
            return bad(format!("{lengths:?} covers {total} tokens; the sequences have {}", self.seq));
        }
        let Some(tokens) = &self.tokens else {
            return bad("only token sequences can be sliced; this batch holds images".into());
        };
        if self.targets.len() != self.batch * self.seq {
            return bad("only language-model batches (a target per token) can be sliced".into());
        }
        if self.attention_mask.as_ref().is_some_and(|m| m.contains(&0)) || self.hidden.is_some() {
            return bad("sequences with padding or cached hidden states cannot be sliced".into());
        }
        let mut start = 0;
        Ok(lengths
            .iter()
            .map(|&len| {
                let cols = |v: &Vec<u32>| -> Vec<u32> {
                    v.chunks(self.seq).flat_map(|row| row[start..start + len].iter().copied()).collect()
                };
                let slice = HostBatch {
                    seq: len,
                    tokens: Some(cols(tokens)),
                    token_types: self.token_types.as_ref().map(cols),
                    attention_mask: None,
                    targets: cols(&self.targets),
                    position_offset: self.position_offset + start,
                    whole_seq: if self.whole_seq > 0 { self.whole_seq } else { self.seq },
                    ..self.clone()
                };
                start += len;
                slice
            })
            .collect())
    }

    /// Targets that count (not [`IGNORE_INDEX`]).
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// A batch on a device, checked against the model's [`Spec`].
pub struct Batch<D: Device> {
    /// Samples.
    pub batch: usize,
    /// Hidden-state positions per sample (tokens, or patches + 1).
    pub seq: usize,
    /// Token ids (text models).
    pub tokens: Option<D::Ids>,
    /// Token-type ids (BERT; zeros when the host batch had none).
    pub token_types: Option<D::Ids>,
    /// Key padding mask for attention and mean pooling.
    pub attention_mask: Option<D::Ids>,
    /// Position ids `[batch, seq]`.
    pub positions: D::Ids,
    /// Pixels (image models).
    pub pixels: Option<D::Buf>,
    /// Targets, as in [`HostBatch::targets`].
    pub targets: D::Ids,
    /// Targets that are not [`IGNORE_INDEX`] (the loss is their mean).
    pub target_count: usize,
    /// Training mode: dropout on, activations saved for the backward.
    pub train: bool,
    /// Seed of this step's dropout masks.
    pub dropout_seed: u64,
    /// See [`HostBatch::sample_offset`].
    pub sample_offset: u64,
    /// See [`HostBatch::position_offset`].
    pub position_offset: usize,
    /// Positions of the whole sequences this batch is a token slice of (`seq` when unsliced).
    pub whole_seq: usize,
}

/// How a dropped tensor's elements map onto the batch: per token (`[batch, seq, width]`) or per
/// sample (`[batch, width]`, e.g. a pooled classifier input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropoutLayout {
    /// `width` elements per token.
    Tokens(usize),
    /// `width` elements per sample.
    Samples(usize),
}

impl<D: Device> Batch<D> {
    /// Validates `host` against `spec` and uploads it. Errors name the field and the expected
    /// size (e.g. a sequence longer than the position table).
    pub fn upload(dev: &D, spec: &Spec, host: &HostBatch, train: bool, dropout_seed: u64) -> Result<Self> {
        let b = host.batch;
        if b == 0 {
            return Err(data_error("batch", "is empty; expected at least one sample"));
        }
        let check = |what: &str, got: usize, want: usize| {
            if got == want { Ok(()) } else { Err(data_error(what, format!("has {got} values, expected {want}"))) }
        };
        let (seq, tokens, token_types, pixels) = match spec.input {
            InputSpec::Tokens { max_positions, type_vocab, .. } => {
                let t = host.seq;
                let Some(tok) = &host.tokens else {
                    return Err(data_error("tokens", "missing: this model takes token ids"));
                };
                check("tokens", tok.len(), b * t)?;
                if t == 0 {
                    return Err(data_error("tokens", "sequence length is 0"));
                }
                if host.position_offset + t > max_positions {
                    return Err(data_error(
                        "tokens",
                        format!(
                            "sequence length {} exceeds the position table ({max_positions} positions)",
                            host.position_offset + t
                        ),
                    ));
                }
                let types = match (type_vocab, &host.token_types) {
                    (Some(_), Some(tt)) => {
                        check("token_types", tt.len(), b * t)?;
                        Some(dev.upload_ids(tt)?)
                    }
                    (Some(_), None) => Some(dev.upload_ids(&vec![0; b * t])?),
                    (None, _) => None,
                };
                (t, Some(dev.upload_ids(tok)?), types, None)
            }
            InputSpec::Image { channels, image_size, patch } => {
                let Some(px) = &host.pixels else {
                    return Err(data_error("pixels", "missing: this model takes images"));
                };
                check("pixels", px.len(), b * channels * image_size * image_size)?;
                ((image_size / patch).pow(2) + 1, None, None, Some(dev.upload(px)?))
            }
        };
        let mask = match &host.attention_mask {
            Some(m) => {
                check("attention_mask", m.len(), b * seq)?;
                Some(dev.upload_ids(m)?)
            }
            None => None,
        };
        let want_targets = match spec.head {
            HeadSpec::Classifier { .. } => b,
            HeadSpec::TiedLmHead => b * seq,
        };
        check("targets", host.targets.len(), want_targets)?;
        let positions: Vec<u32> = (0..b).flat_map(|_| (0..seq).map(|t| (host.position_offset + t) as u32)).collect();
        Ok(Self {
            batch: b,
            seq,
            tokens,
            token_types,
            attention_mask: mask,
            positions: dev.upload_ids(&positions)?,
            pixels,
            targets: dev.upload_ids(&host.targets)?,
            target_count: host.target_count(),
            train,
            dropout_seed,
            sample_offset: host.sample_offset,
            position_offset: host.position_offset,
            whole_seq: host.whole_seq.max(seq),
        })
    }

    /// Rows of hidden states, `batch·seq`.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Where dropout site `site`'s mask lies for a tensor of this batch: the seed mixes the step
    /// seed with the site; the counters place each element at its sample's global index and, per
    /// token, at its position in the whole sequence, so micro-batches and token slices draw the
    /// masks of the full batch.
    pub fn dropout_coords(&self, site: u64, layout: DropoutLayout) -> DropoutCoords {
        let seed = crate::rng::hash_u64(self.dropout_seed, site);
        match layout {
            DropoutLayout::Samples(width) => DropoutCoords::contiguous(seed, self.sample_offset * width as u64),
            DropoutLayout::Tokens(width) => {
                let stride = (self.whole_seq * width) as u64;
                DropoutCoords {
                    seed,
                    offset: self.sample_offset * stride + (self.position_offset * width) as u64,
                    row: (self.seq * width) as u64,
                    stride,
                }
            }
        }
    }

    /// Seed and counter offset of attention-probability dropout at site `site` (`heads` heads):
    /// each sample owns a `heads × whole_seq × whole_seq` block of counters.
    pub fn attention_dropout(&self, site: u64, heads: usize) -> (u64, u64) {
        let per_sample = (heads * self.whole_seq * self.whole_seq) as u64;
        (crate::rng::hash_u64(self.dropout_seed, site), self.sample_offset * per_sample)
    }
}
