//! Loader tests on small files written to a temp dir: bad input gives a typed error naming the
//! file (and line or record) and what was expected, never a panic; good input parses as
//! documented. No dependency on the real data.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::files::{SetupGroup, read_bytes_within, read_text};
use super::*;
use crate::Error;

/// A fresh directory under the system temp dir, removed when the test passes.
struct TempDir(crate::testing::Scratch);

impl TempDir {
    fn new(name: &str) -> Self {
        Self(crate::testing::Scratch::new(&format!("data-{name}")))
    }
    /// Writes `bytes` to `rel`, compressed by its extension (`.gz`, `.bz2`).
    fn write(&self, rel: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let data = if rel.ends_with(".gz") {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(bytes).unwrap();
            e.finish().unwrap()
        } else if rel.ends_with(".bz2") {
            let mut e = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::fast());
            e.write_all(bytes).unwrap();
            e.finish().unwrap()
        } else {
            bytes.to_vec()
        };
        std::fs::write(&path, data).unwrap();
        path
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

/// The (file, line, message) of a dataset error; panics on anything else.
fn dataset_err<T: std::fmt::Debug>(r: crate::Result<T>) -> (String, Option<usize>, String) {
    match r {
        Err(Error::Dataset { file, line, message }) => (file, line, message),
        other => panic!("expected Error::Dataset, got {other:?}"),
    }
}

fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

fn digit_names() -> Vec<String> {
    (0..10).map(|d| d.to_string()).collect()
}

// --- missing files -----------------------------------------------------------------------

#[test]
fn missing_files_say_how_to_fetch_them() {
    let dir = TempDir::new("missing");
    let cases: Vec<(Error, &str, &str)> = vec![
        (hamlet(dir.path()).unwrap_err(), HAMLET_FILE, "text"),
        (rotten_tomatoes(dir.path()).unwrap_err(), ROTTEN_TOMATOES_FILE, "text"),
        (reuters_r8(dir.path()).unwrap_err(), REUTERS_R8_TRAIN_FILE, "text"),
        (digits(dir.path()).unwrap_err(), DIGITS_FILE, "images"),
        (mnist5k(dir.path()).unwrap_err(), MNIST5K_FILE, "images"),
        (fashion_mnist(dir.path()).unwrap_err(), "fashion-mnist/train-images-idx3-ubyte.gz", "images"),
    ];
    for (err, rel, group) in cases {
        let msg = err.to_string();
        let (file, line, message) = dataset_err::<()>(Err(err));
        assert_eq!(file, dir.path().join(rel).display().to_string());
        assert_eq!(line, None);
        assert_eq!(message, format!("not found: run scripts/setup.sh {group}"), "{msg}");
    }
}

#[test]
fn missing_default_dir_message_reads_well() {
    let err = hamlet("no-such-data-dir").unwrap_err().to_string();
    let cwd = std::env::current_dir().unwrap();
    let from = format!("a relative path, read from {}", cwd.display());
    assert_eq!(err, format!("no-such-data-dir/text/hamlet.txt: not found ({from}): run scripts/setup.sh text"));
}

#[test]
fn corrupt_compressed_stream_is_named() {
    let dir = TempDir::new("corrupt");
    let path = dir.path().join(DIGITS_FILE);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"definitely not gzip").unwrap();
    let (file, _, message) = dataset_err(digits(dir.path()));
    assert!(file.ends_with("digits.csv.gz"));
    assert!(message.contains("not a valid gzip stream"), "{message}");
}

// --- image CSV ---------------------------------------------------------------------------

fn digits_row(label: u32) -> String {
    let mut v: Vec<String> = (0..64).map(|i| (i % 17).to_string()).collect();
    v.push(label.to_string());
    v.join(",")
}

#[test]
fn digits_parse_scale_and_ids() {
    let dir = TempDir::new("digits-ok");
    dir.write(DIGITS_FILE, format!("{}\n\n{}\n{}\n", digits_row(3), digits_row(0), digits_row(9)).as_bytes());
    let d = digits(dir.path()).unwrap();
    assert_eq!(d.len(), 3);
    assert_eq!(d.num_classes(), 10);
    let s = d.get(1).unwrap();
    assert_eq!((s.id, s.label, s.width, s.height), (1, 0, 8, 8));
    assert_eq!(s.pixels.to_f32()[16], 1.0); // 16 / 16
    assert_eq!(s.pixels.to_f32()[1], 1.0 / 16.0);
    assert_eq!(d.class_counts()[9], 1);
}

#[test]
fn image_csv_wrong_column_count() {
    let dir = TempDir::new("digits-cols");
    dir.write(DIGITS_FILE, format!("{}\n1,2,3\n", digits_row(1)).as_bytes());
    let (file, line, message) = dataset_err(digits(dir.path()));
    assert!(file.ends_with(DIGITS_FILE));
    assert_eq!(line, Some(2));
    assert_eq!(message, "has 3 values, expected 65 (64 pixels and a label)");
}

#[test]
fn image_csv_non_integer() {
    let dir = TempDir::new("digits-nonint");
    let bad = digits_row(1).replacen("1,", "x1,", 1);
    dir.write(DIGITS_FILE, format!("{}\n{bad}\n", digits_row(2)).as_bytes());
    let (_, line, message) = dataset_err(digits(dir.path()));
    assert_eq!(line, Some(2));
    assert!(message.contains("`x1` is not a non-negative integer"), "{message}");
}

#[test]
fn image_csv_label_out_of_range() {
    let dir = TempDir::new("digits-label");
    dir.write(DIGITS_FILE, format!("{}\n{}\n", digits_row(2), digits_row(12)).as_bytes());
    let (_, line, message) = dataset_err(digits(dir.path()));
    assert_eq!(line, Some(2));
    assert_eq!(message, "label 12 is out of range; expected 0..=9");
}

#[test]
fn image_csv_pixel_out_of_range() {
    let dir = TempDir::new("digits-pixel");
    let bad = digits_row(1).replacen("0,", "17,", 1);
    dir.write(DIGITS_FILE, bad.as_bytes());
    let (_, line, message) = dataset_err(digits(dir.path()));
    assert_eq!(line, Some(1));
    assert_eq!(message, "column 1: pixel value 17 exceeds the maximum 16");
}

#[test]
fn image_csv_empty() {
    let dir = TempDir::new("digits-empty");
    dir.write(DIGITS_FILE, b"\n\n");
    let (_, line, message) = dataset_err(digits(dir.path()));
    assert_eq!(line, None);
    assert!(message.contains("has no rows"), "{message}");
}

// --- IDX ---------------------------------------------------------------------------------

fn write_fashion(dir: &TempDir, train_images: Vec<u8>, train_labels: Vec<u8>) {
    dir.write("fashion-mnist/train-images-idx3-ubyte.gz", &train_images);
    dir.write("fashion-mnist/train-labels-idx1-ubyte.gz", &train_labels);
    dir.write("fashion-mnist/t10k-images-idx3-ubyte.gz", &idx(0x803, &[1, 2, 2], &[0, 255, 0, 255]));
    dir.write("fashion-mnist/t10k-labels-idx1-ubyte.gz", &idx(0x801, &[1], &[9]));
}

#[test]
fn idx_parses_and_test_ids_are_offset() {
    let dir = TempDir::new("idx-ok");
    write_fashion(&dir, idx(0x803, &[2, 2, 2], &[0, 51, 102, 255, 1, 2, 3, 4]), idx(0x801, &[2], &[3, 0]));
    let s = fashion_mnist(dir.path()).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (2, 1));
    let a = s.train.get(0).unwrap();
    assert_eq!((a.id, a.label, a.width, a.height), (0, 3, 2, 2));
    assert_eq!(a.pixels.to_f32(), vec![0.0, 0.2, 0.4, 1.0]);
    // Held as the file's bytes, a quarter of the floats' memory.
    assert_eq!(a.pixels, Pixels::Levels(vec![0, 51, 102, 255]));
    let t = s.test.get(0).unwrap();
    assert_eq!((t.id, t.label), (TEST_FILE_ID_BASE, 9));
    assert_eq!(s.test.class_names()[9], "Ankle boot");
}

#[test]
fn idx_wrong_magic() {
    let dir = TempDir::new("idx-magic");
    write_fashion(&dir, idx(0x801, &[2], &[0, 0]), idx(0x801, &[2], &[3, 0]));
    let (file, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(file.ends_with("train-images-idx3-ubyte.gz"));
    assert_eq!(message, "has IDX magic 0x00000801, expected 0x00000803 (unsigned-byte images, 3 dimensions)");
}

#[test]
fn idx_truncated_data_and_header() {
    let dir = TempDir::new("idx-trunc");
    write_fashion(&dir, idx(0x803, &[3, 2, 2], &[0; 9]), idx(0x801, &[3], &[3, 0, 1]));
    let (_, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(message.contains("is truncated: the header promises 3 records of 4 bytes (12 bytes), the file holds 9 (record 2 is incomplete)"), "{message}");
    let mut short = idx(0x803, &[3, 2, 2], &[]);
    short.truncate(10);
    write_fashion(&dir, short, idx(0x801, &[3], &[3, 0, 1]));
    let (_, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert_eq!(message, "is truncated: 10 bytes, expected a 16-byte IDX header");
}

#[test]
fn idx_label_out_of_range_and_count_mismatch() {
    let dir = TempDir::new("idx-labels");
    write_fashion(&dir, idx(0x803, &[2, 1, 1], &[0, 0]), idx(0x801, &[2], &[3, 10]));
    let (file, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(file.ends_with("train-labels-idx1-ubyte.gz"));
    assert_eq!(message, "record 1: label 10 is out of range; expected 0..=9");
    write_fashion(&dir, idx(0x803, &[2, 1, 1], &[0, 0]), idx(0x801, &[1], &[3]));
    let (_, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(message.starts_with("holds 1 labels, expected 2"), "{message}");
}

#[test]
fn idx_test_images_of_another_shape() {
    let dir = TempDir::new("idx-shape");
    write_fashion(&dir, idx(0x803, &[1, 1, 4], &[0, 1, 2, 3]), idx(0x801, &[1], &[3]));
    let (file, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(file.ends_with("t10k-images-idx3-ubyte.gz"), "{file}");
    assert_eq!(message, "holds 2×2 images, expected 1×4 as in train-images-idx3-ubyte.gz");
}

/// `pbzip2`, `bgzip` and `cat a.gz b.gz` write several streams to one file: all are read.
#[test]
fn compressed_files_of_several_streams_are_read_whole() {
    let dir = TempDir::new("multi-stream");
    let rows = [digits_row(1) + "\n", digits_row(2) + "\n"];
    let mut gz = Vec::new();
    let mut bz = Vec::new();
    for row in &rows {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(row.as_bytes()).unwrap();
        gz.extend(e.finish().unwrap());
        let mut e = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::fast());
        e.write_all(row.as_bytes()).unwrap();
        bz.extend(e.finish().unwrap());
    }
    let text = rows.concat();
    // Named for their compression or not: a user's file is read by its first bytes too.
    for (name, bytes) in [("two.csv.gz", &gz), ("two.csv.bz2", &bz), ("gz.csv", &gz), ("bz.csv", &bz)] {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(read_text(&path, SetupGroup::Images).unwrap(), text, "{name}");
    }
    // Text that starts as bzip2 does, without its block magic, is text; a damaged stream
    // that has it is named as bzip2.
    let path = dir.write("bzh.csv", b"BZh9 is not a stream\n");
    assert_eq!(read_text(&path, SetupGroup::User).unwrap(), "BZh9 is not a stream\n");
    let path = dir.write("cut.csv", &bz[..bz.len() / 2]);
    let (file, _, message) = dataset_err(read_text(&path, SetupGroup::User));
    assert!(file.ends_with("cut.csv") && message.starts_with("is not a valid bzip2 stream"), "{message}");
}

/// A compressed file that expands past the bound is refused by name before it is held whole.
#[test]
fn a_compressed_file_expanding_past_the_bound_is_refused() {
    let dir = TempDir::new("bomb");
    let path = dir.write("zeros.gz", &[0; 10_000]);
    assert_eq!(read_bytes_within(&path, SetupGroup::User, 10_000).unwrap().len(), 10_000);
    let (file, _, message) = dataset_err(read_bytes_within(&path, SetupGroup::User, 9_999));
    assert!(file.ends_with("zeros.gz"));
    assert_eq!(message, "expands to more than 9999 bytes of gzip-compressed data; expected a dataset file below that");
}

/// A UTF-8 byte-order mark (Excel writes one) is not part of the header's first name.
#[test]
fn a_byte_order_mark_is_dropped() {
    let dir = TempDir::new("bom");
    let path = dir.write("bom.csv", "\u{feff}category,text\n".as_bytes());
    assert_eq!(read_text(&path, SetupGroup::User).unwrap(), "category,text\n");
}

#[test]
fn idx_empty() {
    let dir = TempDir::new("idx-empty");
    write_fashion(&dir, idx(0x803, &[0, 28, 28], &[]), idx(0x801, &[0], &[]));
    let (_, _, message) = dataset_err(fashion_mnist(dir.path()));
    assert!(message.starts_with("is empty"), "{message}");
}

// --- Rotten Tomatoes ---------------------------------------------------------------------

const RT_HEADER: &str = "category,text,movie_name,has_plot_and_reviews\n";

#[test]
fn rotten_tomatoes_filters_dedups_and_keeps_file_ids() {
    let dir = TempDir::new("rt-ok");
    let csv = format!(
        "{RT_HEADER}plot,\"A plot,\nover lines\",m,True\nfresh,great fun,m,True\nrotten,\"dull, \"\"slow\"\"\",m,True\n\
         fresh,great fun,n,False\nrotten,bad,n,False\n"
    );
    dir.write(ROTTEN_TOMATOES_FILE, csv.as_bytes());
    let d = rotten_tomatoes(dir.path()).unwrap();
    let got: Vec<(u64, &str, u32)> = d.samples().iter().map(|s| (s.id, s.text.as_str(), s.label)).collect();
    assert_eq!(got, vec![(1, "great fun", 1), (2, "dull, \"slow\"", 0), (4, "bad", 0)]);
    assert_eq!(d.class_names(), ["rotten", "fresh"]);
}

#[test]
fn rotten_tomatoes_wrong_field_count() {
    let dir = TempDir::new("rt-cols");
    dir.write(ROTTEN_TOMATOES_FILE, format!("{RT_HEADER}fresh,ok,m,True\n\"multi\nline\",x\n").as_bytes());
    let (file, line, message) = dataset_err(rotten_tomatoes(dir.path()));
    assert!(file.ends_with(ROTTEN_TOMATOES_FILE));
    assert_eq!(line, Some(3));
    assert_eq!(message, "has 2 fields, expected 4 (as in the header)");
}

#[test]
fn rotten_tomatoes_unknown_category_and_bad_header() {
    let dir = TempDir::new("rt-cat");
    dir.write(ROTTEN_TOMATOES_FILE, format!("{RT_HEADER}spoiled,ok,m,True\n").as_bytes());
    let (_, line, message) = dataset_err(rotten_tomatoes(dir.path()));
    assert_eq!(line, Some(2));
    assert_eq!(message, "category `spoiled` is not one of fresh, rotten, plot");
    dir.write(ROTTEN_TOMATOES_FILE, b"kind,text\nfresh,ok\n");
    let (_, line, message) = dataset_err(rotten_tomatoes(dir.path()));
    assert_eq!(line, Some(1));
    assert!(message.contains("no `category` column"), "{message}");
}

#[test]
fn rotten_tomatoes_empty() {
    let dir = TempDir::new("rt-empty");
    dir.write(ROTTEN_TOMATOES_FILE, format!("{RT_HEADER}plot,only a plot,m,False\n").as_bytes());
    let (_, _, message) = dataset_err(rotten_tomatoes(dir.path()));
    assert!(message.contains("no fresh or rotten reviews"), "{message}");
    dir.write(ROTTEN_TOMATOES_FILE, b"");
    let (_, _, message) = dataset_err(rotten_tomatoes(dir.path()));
    assert!(message.starts_with("is empty"), "{message}");
}

// --- Orange .tab -------------------------------------------------------------------------

const TAB_HEADER: &str = "Category\tText\nd\tstring\nclass\t\n";

#[test]
fn orange_tab_sorted_classes_and_ids() {
    let dir = TempDir::new("tab-ok");
    dir.write(REUTERS_R8_TRAIN_FILE, format!("{TAB_HEADER}\ntrade\tt one\nearn\te one\ntrade\tt two\n").as_bytes());
    dir.write(REUTERS_R8_TEST_FILE, format!("{TAB_HEADER}earn\te test\n").as_bytes());
    let s = reuters_r8(dir.path()).unwrap();
    assert_eq!(s.train.class_names(), ["earn", "trade"]);
    let got: Vec<(u64, u32)> = s.train.samples().iter().map(|t| (t.id, t.label)).collect();
    assert_eq!(got, vec![(0, 1), (1, 0), (2, 1)]);
    assert_eq!(s.test.get(0).unwrap().id, TEST_FILE_ID_BASE);
    assert_eq!(s.train.class_counts(), vec![1, 2]);
}

#[test]
fn orange_tab_unknown_test_label() {
    let dir = TempDir::new("tab-label");
    dir.write(REUTERS_R8_TRAIN_FILE, format!("{TAB_HEADER}earn\ta\n").as_bytes());
    dir.write(REUTERS_R8_TEST_FILE, format!("{TAB_HEADER}earn\tb\ngrain\tc\n").as_bytes());
    let (file, line, message) = dataset_err(reuters_r8(dir.path()));
    assert!(file.ends_with(REUTERS_R8_TEST_FILE));
    assert_eq!(line, Some(5));
    assert_eq!(message, "category `grain` does not occur in the train file; expected one of [\"earn\"]");
}

#[test]
fn orange_tab_wrong_field_count_missing_column_and_empty() {
    let dir = TempDir::new("tab-bad");
    dir.write(REUTERS_R8_TEST_FILE, format!("{TAB_HEADER}earn\tb\n").as_bytes());
    dir.write(REUTERS_R8_TRAIN_FILE, format!("{TAB_HEADER}earn\ta\nearn a b c\n").as_bytes());
    let (_, line, message) = dataset_err(reuters_r8(dir.path()));
    assert_eq!(line, Some(5));
    assert_eq!(message, "has 1 tab-separated fields, expected 2 (as in the header)");
    dir.write(REUTERS_R8_TRAIN_FILE, b"Topic\tText\nd\tstring\nclass\t\nearn\ta\n");
    let (_, line, message) = dataset_err(reuters_r8(dir.path()));
    assert_eq!(line, Some(1));
    assert!(message.contains("no `Category` column"), "{message}");
    dir.write(REUTERS_R8_TRAIN_FILE, TAB_HEADER.as_bytes());
    let (_, _, message) = dataset_err(reuters_r8(dir.path()));
    assert!(message.starts_with("has no documents"), "{message}");
}

// --- LM ----------------------------------------------------------------------------------

#[test]
fn char_corpus_vocab_split_and_sequences() {
    let dir = TempDir::new("lm");
    let path = dir.write(HAMLET_FILE, b"abcabcabcd");
    let c = char_corpus_file(&path, 0.1).unwrap();
    assert_eq!(c.vocab.chars(), ['a', 'b', 'c', 'd']);
    assert_eq!(c.train, vec![0, 1, 2, 0, 1, 2, 0, 1, 2]);
    assert_eq!(c.held_out, vec![3]);
    assert_eq!(c.vocab.decode(&c.train).unwrap(), "abcabcabc");
    assert!(c.vocab.encode("abz").is_err());
    assert!(c.vocab.decode(&[4]).is_err());
    let seqs = c.train_sequences(4).unwrap();
    assert_eq!(seqs.len(), 2); // (9 - 1) / 4
    assert_eq!((seqs[1].id, seqs[1].input.clone(), seqs[1].target.clone()), (1, vec![1, 2, 0, 1], vec![2, 0, 1, 2]));
    assert!(c.held_out_sequences(1).is_err()); // one token cannot make a pair
    assert!(lm_sequences(&c.train, 0, 0).is_err());
    let b = lm_batch(&[&seqs[0], &seqs[1]], 6).unwrap();
    assert_eq!((b.batch, b.seq, b.sample_offset), (2, 4, 6));
    assert_eq!(b.tokens.unwrap()[4..], seqs[1].input[..]);
    assert_eq!(b.targets[..4], seqs[0].target[..]);
}

#[test]
fn char_corpus_empty_and_bad_utf8() {
    let dir = TempDir::new("lm-bad");
    let path = dir.write(HAMLET_FILE, b"");
    let (_, _, message) = dataset_err(char_corpus_file(&path, 0.1));
    assert_eq!(message, "is empty; expected text");
    let path = dir.write(HAMLET_FILE, b"ok\nline two \xff\n");
    let (_, line, message) = dataset_err(char_corpus_file(&path, 0.1));
    assert_eq!(line, Some(2));
    assert!(message.contains("not valid UTF-8"), "{message}");
}

// --- splits and batches ------------------------------------------------------------------

fn toy(n: usize, classes: u32) -> Dataset<TextSample> {
    let samples =
        (0..n).map(|i| TextSample { id: 100 + i as u64, text: format!("t{i}"), label: i as u32 % classes }).collect();
    Dataset::new("toy", (0..classes).map(|c| c.to_string()).collect(), samples).unwrap()
}

#[test]
fn stratified_split_is_seeded_and_stratified() {
    let a = toy(103, 3).split_stratified(0.2, 5).unwrap();
    let b = toy(103, 3).split_stratified(0.2, 5).unwrap();
    let c = toy(103, 3).split_stratified(0.2, 6).unwrap();
    assert_eq!(a, b);
    assert_ne!(a.test, c.test);
    // Per class: 35, 34, 34 samples -> 7, 7, 7 in test.
    assert_eq!(a.test.class_counts(), vec![7, 7, 7]);
    assert_eq!(a.train.class_counts(), vec![28, 27, 27]);
    // Disjoint, complete, and in source order.
    let mut ids: Vec<u64> = a.train.samples().iter().chain(a.test.samples()).map(|s| s.id).collect();
    assert!(a.test.samples().windows(2).all(|w| w[0].id < w[1].id));
    ids.sort_unstable();
    assert_eq!(ids, (100..203).collect::<Vec<_>>());
    assert_eq!(a.test.name(), "toy/test");
}

#[test]
fn bad_split_fractions_and_dataset_invariants() {
    for f in [0.0, 1.0, -0.5, f64::NAN] {
        assert!(matches!(toy(10, 2).split_stratified(f, 1), Err(Error::Config { .. })), "{f}");
    }
    assert!(matches!(toy(3, 3).split_stratified(0.1, 1), Err(Error::Config { .. })));
    let dup = vec![TextSample { id: 1, text: "a".into(), label: 0 }, TextSample { id: 1, text: "b".into(), label: 0 }];
    assert!(matches!(Dataset::new("d", vec!["x".into()], dup), Err(Error::Data { .. })));
    let out = vec![TextSample { id: 1, text: "a".into(), label: 1 }];
    assert!(matches!(Dataset::new("d", vec!["x".into()], out), Err(Error::Data { .. })));
    assert!(matches!(Dataset::<TextSample>::new("d", vec!["x".into()], vec![]), Err(Error::Data { .. })));
}

#[test]
fn image_batches_are_bchw() {
    let img = |id, label, w, h| ImageSample {
        id,
        pixels: vec![id as f32; w * h].into(),
        label,
        width: w,
        height: h,
        channels: 1,
    };
    let d = Dataset::new("imgs", digit_names(), vec![img(0, 1, 2, 3), img(1, 2, 2, 3), img(2, 3, 2, 3)]).unwrap();
    let b = d.batch(&[2, 0], 10).unwrap();
    assert_eq!((b.batch, b.targets.clone(), b.sample_offset), (2, vec![3, 1], 10));
    let px = b.pixels.unwrap();
    assert_eq!(px.len(), 2 * 6);
    assert!(px[..6].iter().all(|&v| v == 2.0) && px[6..].iter().all(|&v| v == 0.0));
    assert!(matches!(d.batch(&[3], 0), Err(Error::Data { .. })));
    assert!(matches!(image_batch(&[], 0), Err(Error::Data { .. })));
    // Images of two channels follow each other whole; a batch of mixed channel counts is refused.
    let planes =
        |id| ImageSample { id, pixels: vec![id as f32; 12].into(), label: 0, width: 2, height: 3, channels: 2 };
    let b = image_batch(&[&planes(4), &planes(5)], 0).unwrap();
    assert_eq!(b.pixels.unwrap(), [vec![4.0; 12], vec![5.0; 12]].concat());
    let message = image_batch(&[&planes(4), &img(1, 0, 2, 3)], 0).unwrap_err().to_string();
    assert!(message.contains("sample id 1 is 2×3 of 1 channel with 6 values; expected 2×3 of 2"), "{message}");
    let other = img(9, 0, 3, 2);
    assert!(matches!(image_batch(&[d.get(0).unwrap(), &other], 0), Err(Error::Data { .. })));
}

#[test]
fn idx_files_and_csv_take_explicit_paths() {
    let dir = TempDir::new("explicit");
    let images = dir.write("im", &idx(0x803, &[1, 1, 2], &[255, 0]));
    let labels = dir.write("lb", &idx(0x801, &[1], &[1]));
    let d = idx_files("x", &images, &labels, 5, digit_names()).unwrap();
    assert_eq!((d.get(0).unwrap().id, d.get(0).unwrap().width, d.get(0).unwrap().height), (5, 2, 1));
    let csv = dir.write("c.csv", b"0,255,1\n");
    let d = image_csv_file("c", &csv, 2, 1, 255, digit_names()).unwrap();
    assert_eq!(d.get(0).unwrap().pixels.to_f32(), vec![0.0, 1.0]);
}

/// A user's labelled texts: classes are the training file's labels, sorted (as numbers where
/// all are integers); ids count rows, the held-out file's from its own base; every bad row is
/// named by its line.
#[test]
fn a_users_labelled_texts_are_read_row_by_row() {
    let dir = TempDir::new("labelled-texts");
    let train = dir.write("train.tsv.gz", b"pos\tthe cat sat\n\nneg\t  a dog ran  \npos\tbig red mat\n");
    let test = dir.write("test.tsv", b"neg\ta cat\n");
    let (train_set, test_set) = labelled_text_files(&train, Some(&test)).unwrap();
    assert_eq!(train_set.class_names(), ["neg", "pos"]);
    let rows: Vec<(u64, &str, u32)> = train_set.samples().iter().map(|s| (s.id, s.text.as_str(), s.label)).collect();
    assert_eq!(rows, [(0, "the cat sat", 1), (1, "a dog ran", 0), (2, "big red mat", 1)]);
    let test_set = test_set.unwrap();
    assert_eq!((test_set.samples()[0].id, test_set.samples()[0].label), (TEST_FILE_ID_BASE, 0));
    assert!(labelled_text_files(&train, None).unwrap().1.is_none());

    // Integer labels sort as numbers: `2` is class 0, `10` class 1.
    let numbers = dir.write("numbers.tsv", b"10\ta\n2\tb\n");
    let (set, _) = labelled_text_files(&numbers, None).unwrap();
    assert_eq!(set.class_names(), ["2", "10"]);

    let unknown = dir.write("unknown.tsv", b"neg\tfine\nmaybe\tnot a class\n");
    let (file, line, message) = dataset_err(labelled_text_files(&train, Some(&unknown)));
    assert!(file.ends_with("unknown.tsv") && line == Some(2), "{file} {line:?}");
    assert!(message.starts_with("label `maybe` does not occur in the training file") && message.ends_with("neg, pos"));
    for (name, bytes, line, said) in [
        ("no-tab.tsv", &b"pos\tfine\npos only\n"[..], Some(2), "has no tab; expected `label<TAB>text`"),
        ("no-label.tsv", b" \tsome text\n", Some(1), "has an empty label; expected `label<TAB>text`"),
        ("no-text.tsv", b"pos\tfine\n\nneg\t \n", Some(3), "has an empty text; expected `label<TAB>text`"),
        ("blank.tsv", b"\n \n", None, "has no rows; expected `label<TAB>text` lines"),
    ] {
        let path = dir.write(name, bytes);
        assert_eq!(dataset_err(labelled_text_files(&path, None)), (path.display().to_string(), line, said.into()));
    }
    let (file, _, message) = dataset_err(labelled_text_files(&dir.path().join("missing.tsv"), None));
    assert!(file.ends_with("missing.tsv") && message.contains("check the path"), "{message}");

    // A row that reads as no sample would become a class of its own: a header, a typo.
    for (name, bytes, line, said) in [
        ("header.tsv", &b"Label\ttext\npos\tgood\nneg\tbad\n"[..], 1, "on the first row, a column's name"),
        ("typo.tsv", b"0\tgood\n1\tbad\ncat\tugly\n1\tworse\n", 3, "every other row's label is an integer"),
    ] {
        let path = dir.write(name, bytes);
        let (_, at, message) = dataset_err(labelled_text_files(&path, None));
        assert!(at == Some(line) && message.contains(said) && message.contains("no header"), "{name}: {message}");
    }
    // ...but a word among words, or a name some rows share, is a class like any.
    for bytes in [&b"label\tgood\nlabel\tfine\nneg\tbad\n"[..], b"pos\tgood\nneg\tbad\nneutral\tmeh\n"] {
        assert!(labelled_text_files(&dir.write("fine.tsv", bytes), None).is_ok());
    }
}

/// A user's text as a corpus: the last tenth held out, or a held-out file, the vocabulary over
/// both so the held-out part meets no unknown character.
#[test]
fn a_users_corpus_holds_out_its_end_or_a_file() {
    let dir = TempDir::new("user-corpus");
    let train = dir.write("corpus.txt", "abcdefghij".repeat(2).as_bytes());
    let corpus = user_corpus_files(&train, None).unwrap();
    assert_eq!((corpus.train.len(), corpus.held_out.len(), corpus.vocab.len()), (18, 2, 10));
    let held_out = dir.write("held-out.txt.bz2", "xyz".as_bytes());
    let corpus = user_corpus_files(&train, Some(&held_out)).unwrap();
    assert_eq!((corpus.train.len(), corpus.held_out.len(), corpus.vocab.len()), (20, 3, 13));
    assert_eq!(corpus.vocab.decode(&corpus.held_out).unwrap(), "xyz");
    let empty = dir.write("empty.txt", b"");
    assert_eq!(dataset_err(user_corpus_files(&train, Some(&empty))).2, "is empty; expected text");
}

/// A user's labelled images: square rows of raw pixels then a label; classes sorted as the
/// texts' are; every bad row named by its line (a header, a pixel past the maximum, a row of
/// another size, no square).
#[test]
fn a_users_labelled_images_are_read_row_by_row() {
    let dir = TempDir::new("labelled-images");
    let train = dir.write("train.csv.gz", b"0,1,2,3,cat\n\n4,4,0,0,dog\n");
    let test = dir.write("test.csv", b"1,1,1,1,dog\n");
    let (set, held_out, scale) = labelled_image_files(&train, Some(&test), 4, 1, None).unwrap();
    assert_eq!(scale, 4);
    assert_eq!(set.class_names(), ["cat", "dog"]);
    let s = &set.samples()[1];
    assert_eq!((s.id, s.label, s.width, s.height, s.pixels.to_f32()), (1, 1, 2, 2, vec![1.0, 1.0, 0.0, 0.0]));
    let held_out = held_out.unwrap();
    let t = &held_out.samples()[0];
    assert_eq!((t.id, t.label, t.pixels.to_f32()[0]), (TEST_FILE_ID_BASE, 1, 0.25));
    for (name, bytes, line, said) in [
        (
            "header.csv",
            &b"p0,p1,p2,p3,label\n0,0,0,0,cat\n"[..],
            1,
            "column 1: `p0` is not a whole number ≥ 0 (a header row? the file holds none)",
        ),
        ("bright.csv", b"0,0,0,0,cat\n0,9,0,0,dog\n", 2, "column 2: pixel value 9 exceeds data.pixel_max = 4"),
        (
            "sizes.csv",
            b"0,0,0,0,cat\n0,0,0,0,0,0,0,0,0,dog\n",
            2,
            "has 9 values, expected 4 (a 2×2 image) then the label",
        ),
        (
            "oblong.csv",
            b"0,0,0,cat\n",
            1,
            "has 3 values, which is no square image of data.channels = 1; expected side² pixel values then the label",
        ),
        ("no-label.csv", b"0,0,0,0, \n", 1, "has an empty label; expected CSV pixels then the label"),
    ] {
        let path = dir.write(name, bytes);
        assert_eq!(
            dataset_err(labelled_image_files(&path, None, 4, 1, None)),
            (path.display().to_string(), Some(line), said.into())
        );
    }
    // The held-out file's images must be the training file's size, its labels its classes.
    let small = dir.write("small.csv", b"0,cat\n");
    assert_eq!(
        dataset_err(labelled_image_files(&train, Some(&small), 4, 1, None)).2,
        "has 1 values, expected 4 (a 2×2 image) then the label"
    );
    let other = dir.write("other.csv", b"0,0,0,0,bird\n");
    let (_, _, message) = dataset_err(labelled_image_files(&train, Some(&other), 4, 1, None));
    assert!(message.starts_with("label `bird` does not occur in the training file") && message.ends_with("cat, dog"));
}

/// Images of several channels: a row holds each channel's plane whole, one after another (the
/// model's `[C, H, W]`); its side follows from the channel count, and a row that is no square
/// image of that many channels, or another size than the first, is named.
#[test]
fn a_users_images_of_several_channels_are_read_plane_by_plane() {
    let dir = TempDir::new("labelled-planes");
    // Two 2×2 images of 3 channels (12 values); 12 is no square, so one channel would refuse it.
    let train = dir.write(
        "rgb.csv",
        b"0,1,2,3,4,5,6,7,8,9,10,11,red
11,0,0,0,0,0,0,0,0,0,0,0,blue
",
    );
    let (set, _, _) = labelled_image_files(&train, None, 11, 3, None).unwrap();
    let s = &set.samples()[1];
    assert_eq!(
        (set.class_names(), s.label, s.width, s.height, s.channels),
        (&["blue".into(), "red".into()][..], 0, 2, 2, 3)
    );
    let first = &set.samples()[0];
    // (Scaled as the loader scales: times 1/pixel_max.)
    assert_eq!(first.pixels.to_f32(), (0..12).map(|v| v as f32 * (1.0 / 11.0)).collect::<Vec<_>>());
    assert_eq!(
        dataset_err(labelled_image_files(&train, None, 11, 1, None)).2,
        "has 12 values, which is no square image of data.channels = 1; expected side² pixel values then the label \
         (as data.channels = 3, 3 channels of 2×2)"
    );
    let four = dir.write(
        "four.csv",
        b"0,0,0,0,a
0,0,0,0,b
",
    );
    assert_eq!(
        dataset_err(labelled_image_files(&four, None, 1, 3, None)).2,
        "has 4 values, which is no square image of data.channels = 3; expected 3 × side² pixel values then the label \
         (as data.channels = 1, 1 channel of 2×2)"
    );
    let short = dir.write(
        "short.csv",
        b"0,0,0,a
",
    );
    assert_eq!(
        dataset_err(labelled_image_files(&train, Some(&short), 11, 3, None)).2,
        "has 3 values, expected 12 (a 2×2 image of 3 channels) then the label"
    );
}

/// A PGM (`P5`, maximum 255) of `width` × `height` pixels, each `value`.
fn pgm(width: usize, height: usize, value: u8) -> Vec<u8> {
    [format!("P5\n{width} {height}\n255\n").into_bytes(), vec![value; width * height]].concat()
}

/// A 2×2 PNG of one colour: RGB, or RGBA with 4 values.
fn rgb_png(colour: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, 2, 2);
        enc.set_color(if colour.len() == 4 { png::ColorType::Rgba } else { png::ColorType::Rgb });
        enc.set_depth(png::BitDepth::Eight);
        enc.write_header().unwrap().write_image_data(&colour.repeat(4)).unwrap();
    }
    bytes
}

/// A user's images as a folder of class subfolders: the classes are the subfolders' names
/// (sorted as labels are), the images come in name order, scaled by their format, hidden
/// entries skipped; a held-out folder's classes must be among them. Each wrong layout is named
/// by its path: a file beside the classes, a folder inside one, an empty class, one class, an
/// oblong image, another size or channel count, a held-out class the training folder lacks, a
/// folder beside a file.
#[test]
fn a_users_images_are_read_from_class_folders() {
    let dir = TempDir::new("image-folder");
    let at = |rel: &str| dir.path().join(rel);
    dir.write("train/10/b.pgm", &pgm(2, 2, 51));
    dir.write("train/10/a.pgm", &pgm(2, 2, 255));
    dir.write("train/9/x.pgm", &pgm(2, 2, 0));
    dir.write("train/9/.thumbnail", b"no image");
    dir.write("test/9/y.pgm", &pgm(2, 2, 102));
    let (set, held_out, scale) = labelled_image_files(&at("train"), Some(&at("test")), 16, 1, None).unwrap();
    assert_eq!(scale, 255, "the files' format's, not pixel_max's");
    assert_eq!(set.class_names(), ["9", "10"]);
    let got: Vec<(u64, u32, f32)> = set.samples().iter().map(|s| (s.id, s.label, s.pixels.to_f32()[0])).collect();
    assert_eq!(got, [(0, 1, 1.0), (1, 1, 0.2), (2, 0, 0.0)]);
    let held_out = held_out.unwrap();
    let t = &held_out.samples()[0];
    assert_eq!((t.id, t.label, t.pixels.to_f32(), t.channels), (TEST_FILE_ID_BASE, 0, vec![0.4; 4], 1));
    // Colour images, with data.channels = 3: each plane whole.
    dir.write("rgb/red/a.png", &rgb_png(&[255, 0, 51]));
    dir.write("rgb/blue/a.png", &rgb_png(&[0, 0, 255]));
    dir.write("rgba/a/x.png", &rgb_png(&[0, 0, 255, 128]));
    dir.write("rgba/b/x.png", &rgb_png(&[0, 0, 255, 128]));
    let (set, _, _) = labelled_image_files(&at("rgb"), None, 255, 3, None).unwrap();
    let red = &set.samples()[1];
    assert_eq!((red.label, red.channels, red.width), (1, 3, 2));
    assert_eq!(red.pixels.to_f32(), [vec![1.0; 4], vec![0.0; 4], vec![0.2; 4]].concat());
    // A grayscale image among them reads as RGB (its plane three times, as Pillow's
    // convert("RGB")), resized or not; among grayscale ones, an RGB image is still refused.
    dir.write("rgb/red/b.pgm", &pgm(2, 2, 51));
    for resize in [None, Some(1)] {
        let (set, _, _) = labelled_image_files(&at("rgb"), None, 255, 3, resize).unwrap();
        let gray = &set.samples()[2];
        assert_eq!((gray.label, gray.channels), (1, 3));
        let values = gray.pixels.to_f32();
        let plane = &values[..values.len() / 3];
        assert!(plane.iter().all(|&v| v == 0.2), "{plane:?}");
        assert_eq!(values, plane.repeat(3));
    }
    // PGMs of another maximum are divided by it, and it is the data's scale.
    dir.write("deep/a/x.pgm", b"P5\n1 1\n16\n\x08");
    dir.write("deep/b/x.pgm", b"P5\n1 1\n16\n\x10");
    let (set, _, scale) = labelled_image_files(&at("deep"), None, 255, 1, None).unwrap();
    assert_eq!((scale, set.samples()[0].pixels.to_f32()), (16, vec![0.5]));
    // (A depth other than 8 bits is held scaled: its values are no levels of 255.)
    assert_eq!(set.samples()[0].pixels, Pixels::Scaled(vec![0.5]));

    dir.write("beside/a/x.pgm", &pgm(2, 2, 0));
    dir.write("beside/notes.txt", b"hi");
    dir.write("nested/a/deeper/x.pgm", &pgm(2, 2, 0));
    dir.write("nested/b/x.pgm", &pgm(2, 2, 0));
    dir.write("empty/a/.keep", b"");
    dir.write("empty/b/x.pgm", &pgm(2, 2, 0));
    dir.write("one/a/x.pgm", &pgm(2, 2, 0));
    dir.write("flat/x.pgm", &pgm(2, 2, 0));
    dir.write("oblong/a/x.pgm", &pgm(2, 3, 0));
    dir.write("oblong/b/x.pgm", &pgm(2, 2, 0));
    dir.write("sizes/a/x.pgm", &pgm(2, 2, 0));
    dir.write("sizes/b/x.pgm", &pgm(3, 3, 0));
    dir.write("big/9/y.pgm", &pgm(3, 3, 0));
    dir.write("depths/a/x.pgm", &pgm(2, 2, 0));
    dir.write("depths/b/x.pgm", b"P5\n2 2\n16\n\0\0\0\0");
    dir.write("deep-test/9/x.pgm", b"P5\n2 2\n16\n\0\0\0\0");
    let none: Option<&str> = None;
    for (folder, channels, test, path, said) in [
        (
            "beside",
            1,
            none,
            "beside/notes.txt",
            format!(
                "is a file beside the class folders of {}; expected only one subfolder per class, each holding its images",
                at("beside").display()
            ),
        ),
        (
            "nested",
            1,
            none,
            "nested/a/deeper",
            "is a folder inside the folder of class `a`; expected only its image files".into(),
        ),
        ("empty", 1, none, "empty/a", "holds no images; expected the PNG, JPEG or PGM images of class `a`".into()),
        ("one", 1, none, "one", "holds one class folder, `a`; expected at least two classes to tell apart".into()),
        (
            "oblong",
            1,
            none,
            "oblong/a/x.pgm",
            "is 2×3; expected square images (or set data.resize_to to the model's image_size to resize each)".into(),
        ),
        (
            "depths",
            1,
            none,
            "depths/b/x.pgm",
            format!(
                "stores values up to 16, but {} is up to 255; expected every image of one depth (the values are \
                 divided by it)",
                at("depths/a/x.pgm").display()
            ),
        ),
        (
            "train",
            1,
            Some("deep-test"),
            "deep-test/9/x.pgm",
            "stores values up to 16, but the training images are up to 255; expected every image of one depth (the \
             values are divided by it)"
                .into(),
        ),
        ("train", 1, Some("nowhere"), "nowhere", "not found; expected a folder of class subfolders of images".into()),
        (
            "flat",
            1,
            none,
            "flat",
            "holds files but no class subfolders; expected one subfolder per class, each holding its images \
             (name the folder above them)"
                .into(),
        ),
        (
            "sizes",
            1,
            none,
            "sizes/b/x.pgm",
            format!(
                "is 3×3, but {} is 2×2; expected every image of one size (or set data.resize_to to the model's \
                 image_size to resize each)",
                at("sizes/a/x.pgm").display()
            ),
        ),
        (
            "rgb",
            1,
            none,
            "rgb/blue/a.png",
            "has 3 channels, but data.channels = 1; set data.channels (and the model's num_channels) to the images' \
             (with 3, a grayscale image reads as RGB)"
                .into(),
        ),
        (
            "rgba",
            1,
            none,
            "rgba/a/x.png",
            "has 3 channels (its alpha channel dropped), but data.channels = 1; set data.channels (and the model's \
             num_channels) to the images' (with 3, a grayscale image reads as RGB)"
                .into(),
        ),
        (
            "train",
            1,
            Some("sizes"),
            "sizes/a",
            format!("is no class of the training folder {}: `a`; expected one of 9, 10", at("train").display()),
        ),
        (
            "train",
            1,
            Some("big"),
            "big/9/y.pgm",
            "is 3×3, but the training images are 2×2; expected every image of one size (or set data.resize_to to \
             the model's image_size to resize each)"
                .into(),
        ),
    ] {
        let test = test.map(&at);
        let got = dataset_err(labelled_image_files(&at(folder), test.as_deref(), 255, channels, None));
        assert_eq!((got.0, got.2), (at(path).display().to_string(), said), "{folder}");
    }
    let rows = dir.write("rows.csv", b"0,0,0,0,a\n");
    let (file, _, message) = dataset_err(labelled_image_files(&at("train"), Some(&rows), 255, 1, None));
    assert_eq!(file, rows.display().to_string());
    assert!(message.starts_with("is a file, but the other of data.train_file and data.test_file is a folder"));
}

/// With `data.resize_to`, a folder's images of any size and shape are resized to it, each as
/// [`resize_image`] resizes its pixels (one already of that size is kept as it is), in the
/// held-out folder too; their depth must still be one.
#[test]
fn a_users_images_of_any_size_are_resized_to_one() {
    let dir = TempDir::new("image-folder-resize");
    let at = |rel: &str| dir.path().join(rel);
    let gradient = |w: usize, h: usize| -> Vec<u8> {
        let pixels = (0..w * h).map(|i| (i * 37 % 256) as u8);
        format!("P5\n{w} {h}\n255\n").into_bytes().into_iter().chain(pixels).collect()
    };
    dir.write("train/a/wide.pgm", &gradient(7, 3));
    dir.write("train/a/same.pgm", &gradient(4, 4));
    dir.write("train/b/big.pgm", &gradient(9, 9));
    dir.write("test/b/small.pgm", &gradient(2, 2));
    let (set, held_out, _) = labelled_image_files(&at("train"), Some(&at("test")), 255, 1, Some(4)).unwrap();
    let pixels = |w: usize, h: usize| gradient(w, h)[format!("P5\n{w} {h}\n255\n").len()..].to_vec();
    let resized = |w: usize, h: usize| {
        let raw: Vec<f32> = pixels(w, h).iter().map(|&v| v as f32 / 255.0).collect();
        resize_image(&raw, 255, 1, (h, w), (4, 4))
    };
    let got: Vec<(usize, usize, Vec<f32>)> =
        set.samples().iter().map(|s| (s.width, s.height, s.pixels.to_f32())).collect();
    let same: Vec<f32> = pixels(4, 4).iter().map(|&v| v as f32 / 255.0).collect();
    assert_eq!(got, [(4, 4, same), (4, 4, resized(7, 3)), (4, 4, resized(9, 9))]);
    // 8-bit images, resized or not, are held as their levels.
    assert!(set.samples().iter().all(|s| matches!(s.pixels, Pixels::Levels(_))));
    assert_ne!(resized(7, 3), resized(9, 9));
    assert_eq!(held_out.unwrap().samples()[0].pixels.to_f32(), resized(2, 2));
    dir.write("train/b/deep.pgm", b"P5\n1 1\n16\n\x08");
    let (file, _, message) = dataset_err(labelled_image_files(&at("train"), None, 255, 1, Some(4)));
    assert!(file.ends_with("deep.pgm") && message.starts_with("stores values up to 16"), "{file}: {message}");
}

/// A user's file of one label has nothing to tell apart; a label the training file lacks is
/// named with the classes, the first 20 of many.
#[test]
fn a_users_classes_are_two_or_more_and_named_briefly() {
    let dir = TempDir::new("user-classes");
    let single = dir.write("single.tsv", b"pos\ta\npos\tb\n");
    let (_, _, message) = dataset_err(labelled_text_files(&single, None));
    assert_eq!(message, "has one label, `pos`, on every row; expected at least two classes to tell apart");
    let images = dir.write("single.csv", b"0,cat\n1,cat\n");
    assert!(dataset_err(labelled_image_files(&images, None, 1, 1, None)).2.starts_with("has one label, `cat`"));
    let many: String = (0..30).map(|i| format!("{i}\ttext\n")).collect();
    let many = dir.write("many.tsv", many.as_bytes());
    let other = dir.write("other.tsv", b"99\ttext\n");
    let (_, _, message) = dataset_err(labelled_text_files(&many, Some(&other)));
    let first: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    assert!(message.ends_with(&format!("expected one of {}, … (30 in all)", first.join(", "))), "{message}");
}

/// A folder's images are decoded on every core, but what is wrong with it is said as a reading
/// in order would say it: the first bad file's error, though later files fail to decode and
/// the threads reach them first; and a folder read on all cores gives what it gives on one.
#[test]
fn a_folders_first_bad_image_is_named_whichever_thread_reads_it() {
    let dir = TempDir::new("image-folder-order");
    let at = |rel: &str| dir.path().join(rel);
    for i in 0..40 {
        // In `late`: a/05 of another size, and every file from a/10 on no image at all.
        let bytes = match i {
            5 => pgm(3, 3, 0),
            10.. => b"no image".to_vec(),
            _ => pgm(2, 2, i as u8),
        };
        dir.write(&format!("late/a/{i:02}.pgm"), &bytes);
        // In `early`: a/03 no image, every file from a/20 on of three channels.
        let bytes = match i {
            3 => b"no image".to_vec(),
            20.. => rgb_png(&[1, 2, 3]),
            _ => pgm(2, 2, i as u8),
        };
        dir.write(&format!("early/a/{i:02}.pgm"), &bytes);
        dir.write(&format!("good/{}/{i:02}.png", i % 3), &rgb_png(&[i as u8, 7, 200 - i as u8]));
    }
    dir.write("late/b/x.pgm", &pgm(2, 2, 0));
    dir.write("early/b/x.pgm", &pgm(2, 2, 0));
    for _ in 0..8 {
        let (file, _, message) = dataset_err(labelled_image_files(&at("late"), None, 255, 1, None));
        assert_eq!(file, at("late/a/05.pgm").display().to_string(), "{message}");
        assert!(message.starts_with("is 3×3, but"), "{message}");
        let (file, _, message) = dataset_err(labelled_image_files(&at("early"), None, 255, 1, None));
        assert_eq!(file, at("early/a/03.pgm").display().to_string(), "{message}");
    }
    let (set, _, _) = labelled_image_files(&at("good"), None, 255, 3, None).unwrap();
    let got: Vec<(u64, u32, Vec<f32>)> = set.samples().iter().map(|s| (s.id, s.label, s.pixels.to_f32())).collect();
    let want: Vec<(u64, u32, Vec<f32>)> = (0..40u32)
        .map(|i| (i % 3, i))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .enumerate()
        .map(|(id, (label, i))| {
            let rgb = [i as f32 / 255.0, 7.0 / 255.0, (200 - i) as f32 / 255.0];
            (id as u64, label, rgb.iter().flat_map(|&v| [v; 4]).collect())
        })
        .collect();
    assert_eq!(got, want, "in class then file order, each its own pixels");
}

/// A line longer than any input ends the list there, named by its number, without being
/// held whole (a file with no line breaks, `/dev/zero` given as --file, would otherwise fill
/// memory); a line of exactly the longest length is read; a line without its newline at the
/// end of the file is a line.
#[test]
fn a_line_longer_than_any_input_ends_the_list() {
    let dir = TempDir::new("longest-line");
    let longest = super::files::LONGEST_LINE;
    let mut bytes = b"first\r\n".to_vec();
    bytes.extend(std::iter::repeat_n(b'x', longest));
    bytes.extend(b"\nlast");
    let path = dir.write("fits.txt", &bytes);
    let lines: Vec<String> = user_lines(&path).unwrap().map(Result::unwrap).collect();
    assert_eq!(lines.iter().map(String::len).collect::<Vec<_>>(), [5, longest, 4]);
    let mut bytes = b"first\n".to_vec();
    bytes.extend(std::iter::repeat_n(b'x', longest + 1));
    bytes.extend(b"\nnever read\n");
    let path = dir.write("too-long.txt", &bytes);
    let mut lines = user_lines(&path).unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    let e = lines.next().unwrap().unwrap_err().to_string();
    assert!(e.contains("line 2 is longer than 16 MiB"), "{e}");
    assert!(lines.next().is_none(), "the list ends at the long line");
}
