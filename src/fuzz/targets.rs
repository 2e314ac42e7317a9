//! The fuzz targets: every parser a user's file reaches, each with small valid seeds built in
//! code, an optional fix-up that repairs what a random mutation almost always breaks first
//! (a hash, a length field, a CRC) so that mutations reach the structure behind it, and a
//! function that writes the input where the real parser reads it and exercises the result.
//!
//! A target returns the parser's `Err` for a rejected input. What a parser returns on success
//! is checked with `assert!`: a broken invariant is a bug, and the harness reports the panic.

use std::path::{Path, PathBuf};

use crate::data::{self, ImageSample};
use crate::error::{Error, Result, config_error};
use crate::model::ModelConfig;
use crate::rng::Rng;
use crate::text::{TextInput, TextTokenizer};
use crate::train::checkpoint;
use crate::weights::{self, TensorRef};

/// One fuzz target.
pub(crate) struct Target {
    /// Name on the command line.
    pub name: &'static str,
    /// Valid inputs to start the corpus from; may write files under the scratch folder.
    pub seeds: fn(&Path) -> Result<Vec<Vec<u8>>>,
    /// Applied after mutation (structure awareness).
    pub fix_up: Option<fn(&mut [u8], &mut Rng)>,
    /// Parses one input (scratch folder for its files) and exercises the result.
    pub run: fn(&[u8], &Path) -> Result<()>,
}

/// Every target, in the order `all` runs them.
pub(crate) const TARGETS: &[Target] = &[
    Target { name: "safetensors", seeds: safetensors_seeds, fix_up: Some(safetensors_fix_up), run: safetensors },
    Target { name: "checkpoint", seeds: checkpoint_seeds, fix_up: Some(checkpoint_fix_up), run: checkpoint_target },
    Target { name: "idx", seeds: idx_seeds, fix_up: Some(idx_fix_up), run: idx },
    Target { name: "csv", seeds: csv_seeds, fix_up: None, run: csv },
    Target { name: "tsv", seeds: tsv_seeds, fix_up: None, run: tsv },
    Target { name: "tokenizer", seeds: tokenizer_seeds, fix_up: None, run: tokenizer },
    Target { name: "config", seeds: config_seeds, fix_up: None, run: config },
    Target { name: "hf_config", seeds: hf_config_seeds, fix_up: None, run: hf_config },
    Target { name: "image", seeds: image_seeds, fix_up: Some(image_fix_up), run: image },
    Target { name: "rendezvous", seeds: rendezvous_seeds, fix_up: None, run: rendezvous },
    Target { name: "user_text", seeds: user_text_seeds, fix_up: None, run: user_text },
    Target { name: "compressed", seeds: compressed_seeds, fix_up: None, run: compressed },
    Target { name: "export", seeds: export_seeds, fix_up: None, run: export },
    Target { name: "labelled_images", seeds: labelled_images_seeds, fix_up: None, run: labelled_images },
];

/// Writes `bytes` to `dir/name`.
fn put(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(|source| crate::files::io_error(&path, source))?;
    Ok(path)
}

/// Splits a two-file input: a u16 LE length, the first file (that many bytes, or what there
/// is), the second file.
fn split_pair(input: &[u8]) -> (&[u8], &[u8]) {
    let [a, b, rest @ ..] = input else { return (input, &[]) };
    rest.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(rest.len()))
}

/// Joins two files the way [`split_pair`] splits them.
fn join_pair(first: &[u8], second: &[u8]) -> Vec<u8> {
    let mut out = u16::try_from(first.len()).unwrap_or(u16::MAX).to_le_bytes().to_vec();
    out.extend_from_slice(first);
    out.extend_from_slice(second);
    out
}

/// The end (exclusive) of the JSON object that starts at `start`, counting brackets outside
/// strings; `None` if there is no object there or it never closes.
fn json_object_end(b: &[u8], start: usize) -> Option<usize> {
    if b.get(start) != Some(&b'{') {
        return None;
    }
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, &c) in b.iter().enumerate().skip(start) {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Every float tensor read in f32 and f64; the lengths must match the shapes.
fn exercise_tensor_file(file: &weights::TensorFile) -> Result<()> {
    for t in file.tensors() {
        let bytes = file.bytes(t);
        assert_eq!(bytes.len(), t.data.len(), "tensor `{}`: byte slice and data_offsets disagree", t.name);
        if t.dtype.is_float() {
            let v = file.read_f32(t)?;
            assert_eq!(
                v.len(),
                t.numel(),
                "tensor `{}`: read_f32 gave {} values for shape {:?}",
                t.name,
                v.len(),
                t.shape
            );
            let w = file.read_f64(t)?;
            assert_eq!(w.len(), v.len(), "tensor `{}`: read_f64 and read_f32 disagree on the count", t.name);
        } else {
            assert!(file.read_f32(t).is_err(), "tensor `{}`: dtype {} converted to f32", t.name, t.dtype);
        }
    }
    Ok(())
}

// ---- safetensors ----------------------------------------------------------------------------

fn safetensors_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let mut written = Vec::new();
    let io = |e| Error::Io { path: "fuzz seed (safetensors)".into(), source: e };
    weights::write_safetensors(
        &mut written,
        &[
            TensorRef { name: "embeddings.weight", shape: &[2, 3], values: &[1.5, -2.0, 3.25, 0.0, 1e-38, 7.0] },
            TensorRef { name: "bias", shape: &[], values: &[9.0] },
            TensorRef { name: "empty", shape: &[0, 4], values: &[] },
        ],
    )
    .map_err(io)?;
    // Written by hand: `write_safetensors` only writes F32.
    let header = serde_json::json!({
        "__metadata__": {"format": "pt", "note": "fuzz"},
        "h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
        "b": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [4, 8]},
        "d": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]},
        "i": {"dtype": "I32", "shape": [2], "data_offsets": [16, 24]},
    })
    .to_string();
    let mut mixed = (header.len() as u64).to_le_bytes().to_vec();
    mixed.extend_from_slice(header.as_bytes());
    for x in [1.0f32, -0.5] {
        mixed.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
    for x in [2.0f32, 0.25] {
        mixed.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
    mixed.extend_from_slice(&0.1f64.to_le_bytes());
    for x in [7i32, -3] {
        mixed.extend_from_slice(&x.to_le_bytes());
    }
    Ok(vec![written, mixed])
}

/// Mostly re-derives the header length from where the JSON object ends (and the spaces that
/// pad it to a multiple of 8 end), so that an edit that grows or shrinks the header still gets
/// the header parsed.
fn safetensors_fix_up(b: &mut [u8], rng: &mut Rng) {
    if b.len() >= 8
        && rng.below(4) != 0
        && let Some(end) = json_object_end(b, 8)
    {
        let end = end + b[end..].iter().take_while(|&&c| c == b' ').count();
        b[..8].copy_from_slice(&(end as u64 - 8).to_le_bytes());
    }
}

fn safetensors(input: &[u8], dir: &Path) -> Result<()> {
    let path = put(dir, "model.safetensors", input)?;
    let file = weights::load_safetensors(&path)?;
    exercise_tensor_file(&file)
}

// ---- checkpoint -----------------------------------------------------------------------------

fn checkpoint_seeds(dir: &Path) -> Result<Vec<Vec<u8>>> {
    let path = dir.join("seed.ckpt");
    let meta = serde_json::json!({"step": 7, "epoch": 1, "rng": {"state": 12345}, "note": "fuzz"});
    let tensors = [
        checkpoint::Tensor { name: "param/embeddings.weight".into(), data: vec![1.0, -2.5, 1e-38] },
        checkpoint::Tensor { name: "opt/m".into(), data: vec![] },
        checkpoint::Tensor { name: "opt/v".into(), data: vec![3.25; 5] },
    ];
    checkpoint::save(&path, &meta, &tensors)?;
    let bytes = std::fs::read(&path).map_err(|source| crate::files::io_error(&path, source))?;
    Ok(vec![bytes])
}

/// Repairs, each most of the time: the magic, the header length (from where the JSON header
/// ends) and the trailing hash. Without the hash repair nearly every mutation stops at the
/// hash check and the header parser is never reached.
pub(crate) fn checkpoint_fix_up(b: &mut [u8], rng: &mut Rng) {
    // Shorter than magic + length + hash: the loader refuses it before any of these matter.
    if b.len() < 24 {
        return;
    }
    if rng.below(16) != 0 {
        // Both formats' readers (they differ in the checksum only).
        b[..8].copy_from_slice(if rng.below(4) == 0 { checkpoint::MAGIC_V1 } else { checkpoint::MAGIC });
    }
    if rng.below(4) != 0
        && let Some(end) = json_object_end(b, 16).filter(|&e| e <= b.len() - 8)
    {
        b[8..16].copy_from_slice(&(end as u64 - 16).to_le_bytes());
    }
    if rng.below(16) != 0 {
        let body = b.len() - 8;
        let hash = checkpoint::hash(&b[..body]);
        b[body..].copy_from_slice(&hash.to_le_bytes());
    }
}

fn checkpoint_target(input: &[u8], dir: &Path) -> Result<()> {
    let path = put(dir, "fuzz.ckpt", input)?;
    let (meta, tensors) = checkpoint::load(&path)?;
    let values: usize = tensors.iter().map(|t| t.data.len()).sum();
    assert!(16 + 4 * values + 8 <= input.len(), "checkpoint: {values} values from a {}-byte file", input.len());
    let _ = meta.to_string();
    Ok(())
}

// ---- IDX ------------------------------------------------------------------------------------

fn idx_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let mut images = vec![0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 4];
    images.extend((0..48u32).map(|i| (i * 37 % 256) as u8));
    let labels = [0, 0, 8, 1, 0, 0, 0, 3, 0, 7, 9];
    Ok(vec![join_pair(&images, &labels)])
}

/// Mostly points the split at where the image file's header says its data ends, so a
/// mutation of the dimensions still hands the label file its own bytes.
fn idx_fix_up(b: &mut [u8], rng: &mut Rng) {
    if b.len() < 2 + 16 || rng.below(4) == 0 {
        return;
    }
    let word = |i: usize| u64::from(u32::from_be_bytes([b[2 + i], b[3 + i], b[4 + i], b[5 + i]]));
    let want = word(4).checked_mul(word(8)).and_then(|n| n.checked_mul(word(12))).and_then(|n| n.checked_add(16));
    if let Some(want) = want.filter(|&w| w <= (b.len() - 2) as u64).and_then(|w| u16::try_from(w).ok()) {
        b[..2].copy_from_slice(&want.to_le_bytes());
    }
}

fn digit_classes() -> Vec<String> {
    (0..10).map(|d| d.to_string()).collect()
}

/// Every image batched, as a ViT would take it.
fn exercise_images(ds: &data::Dataset<ImageSample>) -> Result<()> {
    let all: Vec<usize> = (0..ds.len()).collect();
    let batch = ds.batch(&all, 0)?;
    let first = &ds.samples()[0];
    let pixels = batch.pixels.as_ref().map_or(0, Vec::len);
    assert_eq!(pixels, ds.len() * first.pixels.len(), "image batch holds the wrong number of pixels");
    for s in ds.samples() {
        assert!(
            s.pixels.to_f32().iter().all(|p| (0.0..=1.0).contains(p)),
            "sample {}: a pixel is outside [0, 1]",
            s.id
        );
    }
    Ok(())
}

fn idx(input: &[u8], dir: &Path) -> Result<()> {
    let (images, labels) = split_pair(input);
    let images = put(dir, "images-idx3-ubyte", images)?;
    let labels = put(dir, "labels-idx1-ubyte", labels)?;
    let ds = data::idx_files("fuzz", &images, &labels, 0, digit_classes())?;
    exercise_images(&ds)
}

// ---- CSV ------------------------------------------------------------------------------------

/// The first byte picks the loader: even for Rotten Tomatoes, odd for image rows.
fn csv_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let reviews = "category,text,movie_name,has_plot_and_reviews\n\
                   fresh,\"Great, fun; a \"\"must\"\" see\",Movie A,True\n\
                   rotten,dull and long,Movie B,False\r\n\
                   plot,\"A plot that\nspans lines\",Movie A,True\n\n\
                   fresh,dull and long,Movie C,False\n";
    let images = "0,255,17,3,1\n4,5,6,7,2\r\n\n255,255,255,255,0\n";
    Ok(vec![[b"\x00", reviews.as_bytes()].concat(), [b"\x01", images.as_bytes()].concat()])
}

fn csv(input: &[u8], dir: &Path) -> Result<()> {
    let Some((&selector, file)) = input.split_first() else {
        return Err(config_error("fuzz csv input", "is empty; expected a selector byte and a file"));
    };
    if selector % 2 == 0 {
        let path = put(dir, "reviews.csv", file)?;
        let ds = data::rotten_tomatoes_file(&path)?;
        for s in ds.samples() {
            assert!(s.label < 2, "review {} has label {}", s.id, s.label);
        }
    } else {
        let path = put(dir, "images.csv", file)?;
        let classes = vec!["a".to_string(), "b".into(), "c".into()];
        let ds = data::image_csv_file("fuzz", &path, 2, 2, 255, classes)?;
        exercise_images(&ds)?;
    }
    Ok(())
}

// ---- Orange .tab ----------------------------------------------------------------------------

fn tsv_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let train = "Category\tText\ndiscrete\tstring\nclass\tmeta\nearn\tprofits rose 12 pct\n\nacq\tcompany bought\n\
                 earn\tprofits rose 12 pct\n";
    let test = "Category\tText\ndiscrete\tstring\nclass\tmeta\nacq\tshares acquired\r\nearn\tdividend 3.5\n";
    let reordered = "Text\tid\tCategory\n\t\t\n\t\tclass\nsome text\t1\tearn\n";
    Ok(vec![join_pair(train.as_bytes(), test.as_bytes()), join_pair(reordered.as_bytes(), reordered.as_bytes())])
}

fn tsv(input: &[u8], dir: &Path) -> Result<()> {
    let (train, test) = split_pair(input);
    let train = put(dir, "train.tab", train)?;
    let test = put(dir, "test.tab", test)?;
    let split = data::orange_tab_files("fuzz", &train, &test)?;
    let classes = split.train.class_names().len();
    for s in split.train.samples().iter().chain(split.test.samples()) {
        assert!((s.label as usize) < classes, "document {} has label {} of {classes}", s.id, s.label);
    }
    Ok(())
}

// ---- tokenizer.json -------------------------------------------------------------------------

const TINY_TOKENIZER: &str = include_str!("../../tests/fixtures/tiny_tokenizer.json");

fn tokenizer_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    Ok(vec![TINY_TOKENIZER.as_bytes().to_vec()])
}

fn tokenizer(input: &[u8], dir: &Path) -> Result<()> {
    let path = put(dir, "tokenizer.json", input)?;
    let t = TextTokenizer::from_file(&path, 8)?;
    // Combining marks, a title-case digraph, astral plane, zero-width joiner, a noncharacter,
    // NUL and a right-to-left mark: what normalisers and pre-tokenisers trip on.
    let odd = "ǅe\u{301} 𝔘𝔫𝔦 \u{200d}\u{ffff}\u{0}\u{200f}ﬁ Ⅻ 😀👍🏽";
    for input in [TextInput::Single("hello world, [SEP] [UNK]"), TextInput::Single(odd), TextInput::Pair("hello", odd)]
    {
        let e = t.encode_input(input)?;
        assert!(e.ids.len() <= t.max_len(), "{} ids for max_len {}", e.ids.len(), t.max_len());
        assert_eq!(e.ids.len(), e.type_ids.len(), "ids and type ids differ in length");
    }
    Ok(())
}

// ---- run config (TOML) ----------------------------------------------------------------------

const CONFIGS: [&str; 5] = [
    include_str!("../../configs/gpt-hamlet.toml"),
    include_str!("../../configs/minilm-r8.toml"),
    include_str!("../../configs/minilm-rt.toml"),
    include_str!("../../configs/vit-digits.toml"),
    include_str!("../../configs/vit-fashion.toml"),
];

fn config_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    Ok(CONFIGS.iter().map(|c| c.as_bytes().to_vec()).collect())
}

fn utf8<'a>(input: &'a [u8], what: &str) -> Result<&'a str> {
    std::str::from_utf8(input).map_err(|e| config_error(what, format!("is not UTF-8: {e}")))
}

/// A config as a run takes it apart before any work: the plan, the model's spec, the
/// freezing switches against the layer count, the learning-rate schedule, the optimizer, the
/// token slices.
fn config(input: &[u8], _: &Path) -> Result<()> {
    let c = crate::run::RunConfig::parse(utf8(input, "fuzz.toml")?, "fuzz.toml", &[])?;
    c.pipeline.resolve()?;
    if let Some(model) = &c.model.config {
        // As a run does: the data decides the class count (or a GPT's vocabulary).
        let mut model = model.clone();
        match &mut model {
            ModelConfig::Bert(m) => m.num_labels = 2,
            ModelConfig::Vit(m) => m.num_labels = 10,
            ModelConfig::Gpt(m) => m.vocab_size = 65,
        }
        let spec = model.spec()?;
        let _ = (spec.max_seq(), spec.head_dim());
        c.elastic.validate(spec.layers, false)?;
    }
    c.train.lr_schedule(c.train.total_batches(1000))?;
    c.train.optimizer.validate()?;
    if !matches!(c.pipeline.token_slices, crate::terapipe::TokenSlices::Auto) {
        c.pipeline.token_slices.lengths(c.data.max_len)?;
    }
    Ok(())
}

// ---- Hugging Face config.json ---------------------------------------------------------------

fn hf_config_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let minilm = r#"{"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "hidden_size": 384, "intermediate_size": 1536, "layer_norm_eps": 1e-12,
        "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 6,
        "type_vocab_size": 2, "vocab_size": 30522}"#;
    let mut seeds = vec![minilm.as_bytes().to_vec()];
    // Our own exports' config.json for the architectures the shipped run configs build.
    for text in CONFIGS {
        let c = crate::run::RunConfig::parse(text, "fuzz seed", &[])?;
        if let Some(model) = &c.model.config {
            let mut model = model.clone();
            if let ModelConfig::Gpt(m) = &mut model {
                m.vocab_size = 65; // set from the data at run time
            }
            let json = weights::hf_config_json(&model, &[])?;
            seeds.push(serde_json::to_vec_pretty(&json).map_err(|e| config_error("fuzz seed", e.to_string()))?);
        }
    }
    Ok(seeds)
}

fn hf_config(input: &[u8], _: &Path) -> Result<()> {
    let model = weights::parse_hf_config(utf8(input, "config.json")?, "config.json", None)?;
    let spec = model.spec()?;
    let _ = (spec.max_seq(), spec.head_dim());
    Ok(())
}

// ---- rendezvous messages ---------------------------------------------------------------------

/// What a stranger can send either side of the rendezvous: to rank 0, a hello frame; to a
/// member, a challenge frame then a welcome frame; and at a member's ring port, a ring hello
/// (or, over the rendezvous link, an address); and what a pipeline stage's process reads from
/// its neighbours (after the ring's handshake).
fn rendezvous_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    use crate::comm::rendezvous::{MAC, NONCE, frame};
    let hello = frame(&[&1u32.to_le_bytes(), &2u32.to_le_bytes(), &[7; MAC]]);
    let mut member_side = frame(&[&[3; NONCE]]);
    member_side.extend(frame(&[&[9; MAC], &[1; 128]]));
    let ring_hello = frame(&[&2u32.to_le_bytes(), &[4; NONCE], &[5; MAC]]);
    let address = frame(&[b"127.0.0.1:29500"]);
    // A stage's activation of 3 values, a zero gradient, and the end of its step.
    let mut stage = vec![0u8, 0];
    stage.extend([1u32, 0, 2].iter().flat_map(|n| n.to_le_bytes()));
    stage.extend(3u64.to_le_bytes());
    stage.extend([1.5f32, -2.0, 0.25].iter().flat_map(|v| v.to_le_bytes()));
    stage.extend([1u8, 1].iter().chain(&[0; 12]).chain(&0u64.to_le_bytes()));
    stage.extend([2u8, 0].iter().chain(&[0; 20]));
    Ok(vec![hello, member_side, ring_hello, address, stage])
}

/// Rank 0's reading of a hello, a member's reading of a challenge and welcome, and the ring's
/// readings of a hello and an address, from the same bytes: every message is framed and
/// length-checked before any MAC is computed.
fn rendezvous(input: &[u8], _: &Path) -> Result<()> {
    use crate::comm::peers::{parse_address, parse_peer_hello};
    use crate::comm::rendezvous::{parse_hello, read_challenge, read_frame, read_welcome};
    let refused = |why: String| config_error("rendezvous message", why);
    let hello = read_frame(&mut &input[..]).and_then(|body| parse_hello(&body));
    let member = read_challenge(&mut &input[..]).and_then(|_| {
        let mut rest = input;
        read_frame(&mut rest)?; // the challenge again, to reach the welcome
        read_welcome(&mut rest)
    });
    let ring = read_frame(&mut &input[..]).and_then(|body| {
        parse_peer_hello(&body).map(drop).or_else(|a| parse_address(&body).map(drop).map_err(|b| format!("{a}; {b}")))
    });
    // A pipeline stage's messages, one after another, as a reader takes them off its link.
    let mut rest = input;
    let stage = std::iter::from_fn(|| crate::pipeline::runtime::processes::read_message(&mut rest).transpose())
        .take(64)
        .try_for_each(|m| m.map(drop))
        .map_err(|e| e.to_string());
    match (hello, member, ring, stage) {
        (Err(a), Err(b), Err(c), Err(d)) => Err(refused(format!("{a}; {b}; {c}; {d}"))),
        _ => Ok(()),
    }
}

// ---- PNG, JPEG and PGM images ----------------------------------------------------------------

fn png_bytes(width: u32, height: u32, color: png::ColorType, depth: png::BitDepth, data: &[u8]) -> Result<Vec<u8>> {
    let bad = |e: png::EncodingError| config_error("fuzz seed (png)", e.to_string());
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(color);
    enc.set_depth(depth);
    if color == png::ColorType::Indexed {
        enc.set_palette(vec![0, 0, 0, 255, 128, 0]);
    }
    let mut w = enc.write_header().map_err(bad)?;
    w.write_image_data(data).map_err(bad)?;
    w.finish().map_err(bad)?;
    Ok(out)
}

fn image_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    use png::{BitDepth, ColorType};
    Ok(vec![
        png_bytes(2, 1, ColorType::Rgb, BitDepth::Eight, &[255, 0, 51, 0, 255, 102])?,
        png_bytes(2, 2, ColorType::Grayscale, BitDepth::Sixteen, &[0, 0, 255, 255, 128, 0, 0, 1])?,
        png_bytes(1, 2, ColorType::Rgba, BitDepth::Eight, &[1, 2, 3, 4, 5, 6, 7, 8])?,
        png_bytes(3, 1, ColorType::Indexed, BitDepth::Two, &[0b0001_1000])?,
        b"P2\n# two by two\n2 2\n16\n0 16\n8 4\n".to_vec(),
        b"P5 1 2 255\n\x00\xff".to_vec(),
        b"P5\n2 1\n65535\n\x12\x34\xff\xff".to_vec(),
        include_bytes!("../../tests/fixtures/jpeg/cjpeg-17x9-h2v1-restart-3b.jpg").to_vec(),
        include_bytes!("../../tests/fixtures/jpeg/cjpeg-3x3-h1v2-progressive.jpg").to_vec(),
        include_bytes!("../../tests/fixtures/jpeg/cjpeg-3x3-gray-progressive.jpg").to_vec(),
    ])
}

/// Mostly recomputes every PNG chunk's CRC, which the decoder checks before it looks at the
/// chunk: without this, a mutated header or palette is refused for its checksum alone.
fn image_fix_up(b: &mut [u8], rng: &mut Rng) {
    if !b.starts_with(b"\x89PNG") || rng.below(8) == 0 {
        return;
    }
    let mut at = 8;
    while at + 12 <= b.len() {
        let len = u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        let Some(end) = (at + 8).checked_add(len).filter(|&e| e + 4 <= b.len()) else { break };
        let mut crc = flate2::Crc::new();
        crc.update(&b[at + 4..end]);
        b[end..end + 4].copy_from_slice(&crc.sum().to_be_bytes());
        at = end + 4;
    }
}

fn image(input: &[u8], dir: &Path) -> Result<()> {
    let path = put(dir, "image.img", input)?;
    let (w, h, c, px) = data::read_image_file(&path)?;
    assert_eq!(px.len(), w * h * c, "{w}×{h}×{c} image with {} values", px.len());
    assert!(px.iter().all(|p| (0.0..=1.0).contains(p)), "a pixel is outside [0, 1]");
    Ok(())
}

// ---- a user's labelled images: a folder of class subfolders, or CSV rows ---------------------

/// The resize sides the options byte picks from (`None`: kept as stored).
const RESIZE_SIDES: [Option<usize>; 4] = [None, Some(1), Some(3), Some(8)];

/// The first byte holds the options: bit 0 the channels (1 or 3), bits 1–2 the resize side
/// ([`RESIZE_SIDES`]), bit 3 the source (clear: a folder, set: CSV rows of pixels, each
/// ending in its label). A folder's files follow as entries, each a class byte (its subfolder,
/// of three), a u16 LE length and that many bytes.
fn labelled_images_seeds(dir: &Path) -> Result<Vec<Vec<u8>>> {
    let images = image_seeds(dir)?;
    let folder = |options: u8, picks: &[(u8, usize)]| -> Vec<u8> {
        let mut out = vec![options];
        for &(class, i) in picks {
            let bytes = &images[i];
            out.push(class);
            out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    };
    let rows = |options: u8, text: &str| [&[options][..], text.as_bytes()].concat();
    Ok(vec![
        // Gray images as they are and resized (from 2×2 and 2×1), RGB and gray JPEGs read as
        // RGB, and JPEGs of three sizes resized.
        folder(0b000, &[(0, 4), (1, 4), (2, 4)]),
        folder(0b010, &[(0, 1), (1, 6), (2, 1)]),
        folder(0b001, &[(0, 8), (1, 9), (1, 8)]),
        folder(0b111, &[(0, 7), (1, 8), (2, 9)]),
        rows(0b1000, "0,3,255,9,cat\n255,255,0,1,dog\n\n1,2,3,4,cat\n"),
        rows(0b1001, "0,0,0,9,9,9,9,9,9,9,9,9,red\n1,1,1,1,1,1,1,1,1,1,1,1,blue\n"),
        rows(0b1100, "0,1,2,3,4,5,6,7,8,a\n8,7,6,5,4,3,2,1,0,b\n"),
    ])
}

fn labelled_images(input: &[u8], dir: &Path) -> Result<()> {
    let Some((&options, rest)) = input.split_first() else { return Ok(()) };
    let channels = if options & 1 == 0 { 1 } else { 3 };
    let resize = RESIZE_SIDES[usize::from(options >> 1) & 3];
    let train = match options & 0b1000 {
        0 => {
            // (The scratch folder is the last input's: its files must not join this one's.)
            let root = dir.join("images");
            if root.exists() {
                std::fs::remove_dir_all(&root).map_err(|e| crate::files::io_error(&root, e))?;
            }
            let mut rest = rest;
            let mut n = 0;
            // (A handful of files: the reader's work is per file, not per byte.)
            while let [class, a, b, tail @ ..] = rest
                && n < 8
            {
                let (bytes, tail) = tail.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(tail.len()));
                let class_dir = root.join(["a", "b", "c"][usize::from(*class % 3)]);
                std::fs::create_dir_all(&class_dir).map_err(|e| crate::files::io_error(&class_dir, e))?;
                put(&class_dir, &format!("{n}.img"), bytes)?;
                (rest, n) = (tail, n + 1);
            }
            root
        }
        _ => put(dir, "rows.csv", rest)?,
    };
    let (ds, _, _) = data::labelled_image_files(&train, None, 255, channels, resize)?;
    let first = &ds.samples()[0];
    for s in ds.samples() {
        assert_eq!((s.width, s.height, s.channels), (first.width, first.height, channels), "sample {}", s.id);
        assert_eq!(s.pixels.len(), channels * s.width * s.height, "sample {}", s.id);
        if let Some(side) = resize.filter(|_| options & 0b1000 == 0) {
            assert_eq!((s.width, s.height), (side, side), "sample {} was not resized", s.id);
        }
    }
    exercise_images(&ds)
}

// ---- a user's texts: labelled rows and character corpora ------------------------------------

/// The first byte picks the reader: even for labelled rows (`labelled_texts`), odd for a
/// character corpus (`text_corpus`); then a training file and a held-out one.
fn user_text_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    let train = "pos\ta fine film\r\n\nneg\t dull, long \u{e9}t\u{e9}\n10\tten\n2\ttwo\npos\tagain\n";
    let test = "neg\tshort\npos\tlong enough\n";
    let corpus = "To be, or not to be: that is the question.\n\u{feff}Whether 'tis nobler\n";
    Ok(vec![
        [&[0u8][..], &join_pair(train.as_bytes(), test.as_bytes())].concat(),
        [&[0u8][..], &join_pair(train.as_bytes(), b"")].concat(),
        [&[1u8][..], &join_pair(corpus.as_bytes(), b"not to be")].concat(),
    ])
}

/// Labelled rows: every label one of the training file's classes. A corpus: every id below
/// the vocabulary, whose characters are distinct.
fn user_text(input: &[u8], dir: &Path) -> Result<()> {
    let Some((&selector, files)) = input.split_first() else {
        return Err(config_error("fuzz user_text input", "is empty; expected a selector byte and two files"));
    };
    let (train, held_out) = split_pair(files);
    let train = put(dir, "train.txt", train)?;
    // (An empty second file stands for none: the reader cuts its own held-out part.)
    let held_out = (!held_out.is_empty()).then(|| put(dir, "held_out.txt", held_out)).transpose()?;
    if selector % 2 == 0 {
        exercise_labelled_texts(&train, held_out.as_deref())
    } else {
        let corpus = data::user_corpus_files(&train, held_out.as_deref())?;
        let vocab = corpus.vocab.len();
        for &id in corpus.train.iter().chain(&corpus.held_out) {
            assert!((id as usize) < vocab, "token id {id} of a vocabulary of {vocab}");
        }
        Ok(())
    }
}

fn exercise_labelled_texts(train: &Path, held_out: Option<&Path>) -> Result<()> {
    let (train, held_out) = data::labelled_text_files(train, held_out)?;
    let classes = train.class_names().len();
    for s in train.samples().iter().chain(held_out.iter().flat_map(|d| d.samples())) {
        assert!((s.label as usize) < classes, "row {} has label {} of {classes}", s.id, s.label);
        assert!(!s.text.trim().is_empty(), "row {} has an empty text", s.id);
    }
    Ok(())
}

// ---- gzip and bzip2 -------------------------------------------------------------------------

/// Labelled rows compressed whole: gzip, two gzip members one after another (`cat a.gz
/// b.gz`), and bzip2.
fn compressed_seeds(_: &Path) -> Result<Vec<Vec<u8>>> {
    use std::io::Write;
    let io = |e| Error::Io { path: "fuzz seed (compressed)".into(), source: e };
    let rows = b"pos\ta fine film\nneg\tdull and long\npos\tagain\n";
    let gzip = |bytes: &[u8]| -> Result<Vec<u8>> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).map_err(io)?;
        e.finish().map_err(io)
    };
    let mut bzip2 = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::best());
    bzip2.write_all(rows).map_err(io)?;
    let members = [gzip(&rows[..20])?, gzip(&rows[20..])?].concat();
    Ok(vec![gzip(rows)?, members, bzip2.finish().map_err(io)?])
}

/// The stream's own bytes, decompressed as a user's file is (by its first bytes: the file's
/// name says nothing), then read as labelled rows.
fn compressed(input: &[u8], dir: &Path) -> Result<()> {
    exercise_labelled_texts(&put(dir, "rows", input)?, None)
}

// ---- an exported model's folder -------------------------------------------------------------

/// A tiny model of each family exported as a run exports it: its `config.json`, then the
/// companion that family reads (a ViT's pixel preprocessing, a GPT's characters, a BERT's
/// sentence-transformers settings).
fn export_seeds(dir: &Path) -> Result<Vec<Vec<u8>>> {
    use crate::model::{GptConfig, Model, Pooling, tiny};
    let dev = crate::device::CpuDevice::<f32>::new(0, 1)?;
    let chars: Vec<char> = "ab\n é".chars().collect();
    let gpt = ModelConfig::Gpt(GptConfig::without_dropout(chars.len(), 8, 4, 1, 2));
    let (two, three) = (["fresh", "10"].map(String::from), ["fresh", "rotten", "10"].map(String::from));
    let mut seeds = Vec::new();
    for (i, config) in [tiny::tiny_gray_vit(), tiny::tiny_bert(Pooling::Mean, 0.0), gpt].iter().enumerate() {
        let extras = match config {
            ModelConfig::Gpt(_) => weights::ExportExtras { chars: &chars, ..Default::default() },
            ModelConfig::Vit(_) => weights::ExportExtras { labels: &two, pixel_max: Some(16), ..Default::default() },
            ModelConfig::Bert(_) => weights::ExportExtras { labels: &three, ..Default::default() },
        };
        let out = dir.join(format!("export-seed-{i}"));
        let model = Model::new(&dev, config, 1)?;
        weights::export_model(&model, &dev, config, &extras, &out)?;
        let read = |name: &str| std::fs::read(out.join(name)).map_err(|e| crate::files::io_error(&out.join(name), e));
        let companion = match config {
            ModelConfig::Vit(_) => read(weights::PREPROCESSOR_FILE)?,
            ModelConfig::Gpt(_) => read(weights::VOCAB_FILE)?,
            ModelConfig::Bert(_) => br#"{"max_seq_length": 6, "do_lower_case": false}"#.to_vec(),
        };
        seeds.push(join_pair(&read(weights::CONFIG_FILE)?, &companion));
    }
    Ok(seeds)
}

/// Values in the one tensor of the weights file every input's folder shares: more bytes than
/// any seed's model has parameters, so its configs get past the size check.
const EXPORT_WEIGHTS: usize = 4096;

/// A folder of `config.json` and the second file under each companion's name (each family
/// reads its own), beside a weights file the reader only opens and sizes; read as `predict`
/// reads an export. What it gives must agree with its config.
fn export(input: &[u8], dir: &Path) -> Result<()> {
    let folder = dir.join("export");
    let weights_file = folder.join(weights::WEIGHTS_FILE);
    if !weights_file.is_file() {
        std::fs::create_dir_all(&folder).map_err(|e| crate::files::io_error(&folder, e))?;
        let mut bytes = Vec::new();
        let values = vec![0.5; EXPORT_WEIGHTS];
        let tensor = TensorRef { name: "w", shape: &[EXPORT_WEIGHTS], values: &values };
        weights::write_safetensors(&mut bytes, &[tensor]).map_err(|e| crate::files::io_error(&weights_file, e))?;
        put(&folder, weights::WEIGHTS_FILE, &bytes)?;
    }
    let (config, companion) = split_pair(input);
    put(&folder, weights::CONFIG_FILE, config)?;
    for name in [weights::PREPROCESSOR_FILE, weights::VOCAB_FILE, "sentence_bert_config.json"] {
        put(&folder, name, companion)?;
    }
    let export = weights::read_export(&folder)?;
    let spec = export.config.spec()?;
    if let crate::model::HeadSpec::Classifier { num_labels, .. } = spec.head {
        assert!(export.labels.is_empty() || export.labels.len() == num_labels, "{} labels", export.labels.len());
    }
    if let ModelConfig::Gpt(c) = &export.config {
        assert_eq!(export.chars.len(), c.vocab_size, "characters for a vocabulary of {}", c.vocab_size);
        let distinct: std::collections::HashSet<&char> = export.chars.iter().collect();
        assert_eq!(distinct.len(), export.chars.len(), "a character twice in the vocabulary");
    }
    if let Some(scale) = export.pixel_scale {
        assert!(scale.is_finite() && scale > 0.0, "pixel scale {scale}");
    }
    assert!(export.max_seq_length.is_none_or(|n| n >= 1), "max_seq_length {:?}", export.max_seq_length);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> crate::files::Scratch {
        crate::files::Scratch::new(&format!("fuzz-targets-{name}"))
    }

    #[test]
    fn fuzz_json_object_end_skips_strings() {
        assert_eq!(json_object_end(b"xx{\"a}\": [1, {}]} tail", 2), Some(17));
        assert_eq!(json_object_end(b"{\"a\\\"}\":1", 0), None);
        assert_eq!(json_object_end(b"[1]", 0), None);
    }

    /// After the fix-up, a checkpoint whose JSON header was mutated gets past the hash check
    /// and is refused by the header parser (or loads).
    #[test]
    fn fuzz_checkpoint_fix_up_reaches_the_header_parser() {
        let dir = scratch("ckpt");
        let seed = checkpoint_seeds(&dir).unwrap().remove(0);
        let at = seed.windows(7).position(|w| w == b"tensors").unwrap();
        let mut mutated = seed.clone();
        mutated[at + 2] = b'{';
        let path = put(&dir, "m.ckpt", &mutated).unwrap();
        let before = checkpoint::load(&path).unwrap_err().to_string();
        assert!(before.contains("hash mismatch"), "{before}");
        let mut reached = 0;
        for s in 0..64 {
            let mut fixed = mutated.clone();
            checkpoint_fix_up(&mut fixed, &mut Rng::new(s));
            let path = put(&dir, "m.ckpt", &fixed).unwrap();
            let e = checkpoint::load(&path).unwrap_err().to_string();
            if !e.contains("hash mismatch") {
                assert!(e.contains("bad header"), "seed {s}: {e}");
                reached += 1;
            }
        }
        assert!(reached > 48, "only {reached} of 64 fix-ups got past the hash");
    }

    /// Each fix-up repairs the damage it exists for, so that a mutation there still reaches
    /// the parser behind: a space in a checkpoint's or a safetensors file's JSON header (still
    /// valid JSON, now longer than its length field says), an IDX pair split a byte late, a
    /// PNG chunk's CRC broken. Refused as broken; accepted after most fix-ups (each repairs
    /// most of the time, at random).
    #[test]
    fn fuzz_fix_ups_repair_what_they_are_for() {
        let dir = scratch("repairs");
        let first = |name: &str| {
            let t = TARGETS.iter().find(|t| t.name == name).unwrap();
            (t, (t.seeds)(&dir).unwrap().remove(0))
        };
        let spaced = |(t, mut b): (&'static Target, Vec<u8>), header: usize| {
            assert_eq!(b[header], b'{', "{}: the JSON header's start", t.name);
            b.insert(header + 1, b' ');
            (t, b)
        };
        let flipped = |(t, mut b): (&'static Target, Vec<u8>), at: usize| {
            b[at] ^= 1;
            (t, b)
        };
        // (A PNG's IHDR CRC follows the signature, the chunk's length and type, and 13 bytes.)
        let cases = [
            spaced(first("checkpoint"), 16),
            spaced(first("safetensors"), 8),
            flipped(first("idx"), 0),
            flipped(first("image"), 8 + 8 + 13),
        ];
        for (t, broken) in cases {
            let e = (t.run)(&broken, &dir).expect_err("broken");
            let fix = t.fix_up.unwrap();
            let repaired = (0..64)
                .filter(|&s| {
                    let mut b = broken.clone();
                    fix(&mut b, &mut Rng::new(s));
                    (t.run)(&b, &dir).is_ok()
                })
                .count();
            assert!(repaired >= 32, "{}: {repaired} of 64 fix-ups repaired it (before: {e})", t.name);
        }
    }

    #[test]
    fn fuzz_fix_ups_keep_seeds_valid() {
        let dir = scratch("seeds");
        for t in TARGETS {
            for (i, seed) in (t.seeds)(&dir).unwrap().into_iter().enumerate() {
                (t.run)(&seed, &dir).unwrap_or_else(|e| panic!("{} seed {i}: {e}", t.name));
                if let Some(fix) = t.fix_up {
                    let mut fixed = seed.clone();
                    fix(&mut fixed, &mut Rng::new(1));
                    (t.run)(&fixed, &dir).unwrap_or_else(|e| panic!("{} seed {i} after its fix-up: {e}", t.name));
                }
            }
        }
    }
}
