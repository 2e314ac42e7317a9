//! The tests of [`super`] and its modules.

use super::evaluate::*;
use super::stream::*;
use super::*;

/// A split overlaps the training samples where the dataset's split is cut by the seed and a
/// fraction that differ, or where a validation part is carved otherwise; never on another
/// dataset, nor on the test files of a dataset that has its own.
#[test]
fn a_split_overlaps_the_training_samples_only_where_it_can() {
    let config = |dataset: &str, sets: &[&str]| {
        let text = format!(
            "[model]\npretrained = \"w\"\n[data]\ndataset = \"{dataset}\"\nbatch_size = 8\n[train]\nepochs = 1\n\
             lr = 1e-4\n[output]\ndir = \"r\"\n"
        );
        RunConfig::parse(&text, "t", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    };
    let overlap = |dataset: &str, trained: &[&str], now: &[&str]| {
        split_overlap(&data_settings(&config(dataset, trained)), &config(dataset, now)).map(|(key, _)| key)
    };
    assert_eq!(overlap("digits", &[], &[]), None);
    assert_eq!(overlap("digits", &[], &["data.split_seed=5"]).as_deref(), Some("data.split_seed"));
    assert_eq!(overlap("digits", &[], &["data.test_fraction=0.3"]).as_deref(), Some("data.test_fraction"));
    assert_eq!(overlap("digits", &[], &["train.seed=3", "data.test_limit=10"]), None, "order and limit only");
    let carved = ["data.validation_fraction=0.2"];
    assert_eq!(overlap("digits", &[], &carved).as_deref(), Some("data.validation_fraction"));
    assert_eq!(overlap("digits", &carved, &carved), None, "the run's own validation part");
    assert_eq!(overlap("digits", &carved, &[]), None, "the test split it never saw");
    // Fashion-MNIST's test split is its own file: another seed scores the same test set...
    assert_eq!(overlap("fashion_mnist", &[], &["data.split_seed=5"]), None);
    // ...and carves another validation part from the training half.
    let other = ["data.validation_fraction=0.2", "data.split_seed=5"];
    assert_eq!(overlap("fashion_mnist", &carved, &other).as_deref(), Some("data.split_seed"));
    let (_, message) =
        split_overlap(&data_settings(&config("digits", &[])), &config("digits", &["data.split_seed=5"])).unwrap();
    assert!(message.contains("data.split_seed = 0 (here 5)") && message.contains("samples it trained on"));
    // Another dataset is the class check's to refuse.
    assert_eq!(split_overlap(&data_settings(&config("digits", &[])), &config("mnist5k", &["data.split_seed=5"])), None);
    // A user's labelled texts: cut by the seed from the same file (by its bytes) overlap
    // under another seed; another file's, or a held-out file, is not known to.
    let dir = crate::testing::Scratch::new("overlap-user-files");
    let (a, b) = (dir.join("a.tsv"), dir.join("b.tsv"));
    std::fs::write(&a, "x\tone\n").unwrap();
    std::fs::write(&b, "x\ttwo\n").unwrap();
    let (a, b) = (format!("data.train_file=\"{}\"", a.display()), format!("data.train_file=\"{}\"", b.display()));
    let seed = "data.split_seed=5";
    assert_eq!(overlap("labelled_texts", &[&a], &[&a, seed]).as_deref(), Some("data.split_seed"));
    assert_eq!(overlap("labelled_texts", &[&a], &[&b, seed]), None);
    // The same file edited since: a split cut from it is not the run's.
    let trained = data_settings(&config("labelled_texts", &[&a]));
    std::fs::write(dir.join("a.tsv"), "x\tone\ny\ttwo\n").unwrap();
    let edited = split_overlap(&trained, &config("labelled_texts", &[&a]));
    assert!(
        edited.as_ref().is_some_and(|(key, m)| key == "data.train_file" && m.contains("edited since")),
        "{edited:?}"
    );
    // A run that held out a file trained on all of the training file.
    let held_out = "data.test_file=\"t.tsv\"";
    let cut =
        split_overlap(&data_settings(&config("labelled_texts", &[&a, held_out])), &config("labelled_texts", &[&a]));
    assert!(cut.as_ref().is_some_and(|(key, m)| key == "data.test_file" && m.contains("trained on all of")), "{cut:?}");
    assert_eq!(
        overlap("labelled_texts", &[&a, "data.test_file=\"t.tsv\""], &[&a, "data.test_file=\"t.tsv\"", seed]),
        None
    );
}

/// A labelled row's label is a class name, or an index where no class is named by another
/// number: with classes `3` and `5`, `0` is no class (not the one named `3`).
#[test]
fn a_label_is_an_index_only_where_no_class_is_named_by_another_number() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let words = names(&["cat", "dog"]);
    assert_eq!([class_of(&words, "dog"), class_of(&words, "0"), class_of(&words, "2")], [Some(1), Some(0), None]);
    let digits = names(&["0", "1", "2"]);
    assert!(indices_are_read(&digits));
    assert_eq!([class_of(&digits, "2"), class_of(&digits, "3")], [Some(2), None]);
    let numbered = names(&["3", "5"]);
    assert!(!indices_are_read(&numbered));
    assert_eq!([class_of(&numbered, "5"), class_of(&numbered, "0"), class_of(&numbered, "1")], [Some(1), None, None]);
    // (A name that is no number leaves the others' indices alone: `0` is the class named `0`.)
    let mixed = names(&["0", "other"]);
    assert_eq!([class_of(&mixed, "1"), class_of(&mixed, "other")], [Some(1), Some(1)]);
    // Negative numbers are numbers too: with classes `-1` and `1`, `0` is no class.
    let signed = names(&["-1", "1"]);
    assert!(!indices_are_read(&signed));
    assert_eq!([class_of(&signed, "-1"), class_of(&signed, "0")], [Some(0), None]);
}

/// An export whose config.json describes less than its weights hold (one layer of two)
/// is refused, naming the tensors, instead of answering with a model that is not the one
/// trained.
#[test]
fn an_export_whose_weights_and_config_disagree_is_refused() {
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let config = crate::model::tiny::tiny_gpt(0.0);
    let model = Model::new(&dev, &config, 1).unwrap();
    let scratch = crate::files::Scratch::new("predict-disagree");
    let dir = scratch.join("export");
    let chars: Vec<char> = "abcdefghijklmnopq".chars().collect();
    let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
    weights::export_model(&model, &dev, &config, &extras, &dir).unwrap();
    assert!(Predictor::load(crate::device::CpuDevice::<f32>::new(0, 1).unwrap(), &dir).is_ok());
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["n_layer"] = 1.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let err = Predictor::load(dev, &dir).err().unwrap().to_string();
    assert!(err.contains("the weights hold") && err.contains("transformer.h.1."), "{err}");
}

/// `open` takes an export folder or a run's folder with the export in `model/`; a folder
/// with neither is refused by the export's missing file.
#[test]
fn a_model_opens_from_its_export_or_its_runs_folder() {
    let dev = || crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(4, 8, 8, 1, 2));
    let scratch = crate::files::Scratch::new("predict-open");
    let chars: Vec<char> = "abcd".chars().collect();
    let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
    let export = scratch.join("model");
    weights::export_model(&Model::new(&dev(), &config, 1).unwrap(), &dev(), &config, &extras, &export).unwrap();
    for path in [&export, &scratch.to_path_buf()] {
        assert!(Predictor::open(dev(), path).is_ok(), "{}", path.display());
    }
    let err = Predictor::open(dev(), &scratch.join("elsewhere")).err().unwrap().to_string();
    assert!(err.contains("elsewhere") && err.contains("does not exist") && err.contains("checkpoint.ckpt"), "{err}");
    // A file inside the export: pointed to its folder.
    let err = Predictor::open(dev(), &export.join(weights::WEIGHTS_FILE)).err().unwrap().to_string();
    assert!(err.contains("is a file of the exported model in") && err.contains("pass that folder"), "{err}");
    // A folder that holds neither an export nor a run's: the export's missing file.
    std::fs::create_dir(scratch.join("empty")).unwrap();
    let err = Predictor::open(dev(), &scratch.join("empty")).err().unwrap().to_string();
    assert!(err.contains("config.json"), "{err}");
}

/// An input that is neither a file nor a row of pixels: a name that reads as a file's is
/// said to be missing; anything else is named by its first value that is not a pixel.
#[test]
fn a_missing_image_file_is_called_missing() {
    let (_scratch, p) = tiny_vit_predictor("predict-missing");
    for input in ["/tmp/pt-no-such-dir/7.png", "seven.png", "rows.csv.gz"] {
        let e = p.read_images(input).unwrap_err().to_string();
        assert!(e.contains(&format!("`{input}`: no such file")), "{input}: {e}");
    }
    for input in ["1,2,x", "1.5e3", "0.5,0.25"] {
        let e = p.read_images(input).unwrap_err().to_string();
        assert!(!e.contains("no such file"), "{input}: {e}");
    }
}

/// A PGM file's bytes: a `side × side` 8-bit image, its pixels drawn from `seed`.
fn pgm(side: usize, seed: usize) -> Vec<u8> {
    let pixels = (0..side * side).map(|i| ((i * 7 + seed * 31) % 251) as u8);
    format!("P5\n{side} {side}\n255\n").into_bytes().into_iter().chain(pixels).collect()
}

/// A folder given to `predict` is every file under it, subfolders walked, in name order,
/// names starting with `.` left out: an image the model takes is answered as the same file
/// alone is, and a file that is no image, or an image of another size, fails alone, named
/// by its path. A folder with no file is an error.
#[test]
fn a_folder_is_every_image_under_it_each_failing_alone() {
    let (scratch, p) = tiny_vit_predictor("predict-folder");
    let dir = scratch.join("images");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for (name, bytes) in [
        ("a.pgm", pgm(4, 1)),
        ("sub/b.pgm", pgm(4, 2)),
        ("c.txt", b"hello".to_vec()),
        ("d.pgm", pgm(5, 3)),
        (".e.pgm", pgm(4, 4)),
    ] {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let json = options(2, Sampling::default(), OutputFormat::JsonLines);
    let (r, out) = run(&p, &[dir.to_str().unwrap()], &json);
    assert_eq!(r.unwrap(), (4, 2), "{out}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let inputs: Vec<&str> = lines.iter().map(|l| l["input"].as_str().unwrap()).collect();
    let named = |f: &str| dir.join(f).display().to_string();
    assert_eq!(inputs, [named("a.pgm"), named("c.txt"), named("d.pgm"), named("sub/b.pgm")]);
    assert!(lines[0]["label"].is_string() && lines[3]["label"].is_string(), "{out}");
    assert!(lines[1]["error"].as_str().unwrap().contains("starts with bytes"), "{out}");
    assert!(lines[2]["error"].as_str().unwrap().contains("a 5×5 image with 1 channel"), "{out}");
    let (_, alone) = run(&p, &[&named("a.pgm")], &json);
    let alone: serde_json::Value = serde_json::from_str(alone.trim()).unwrap();
    assert_eq!(alone["probabilities"], lines[0]["probabilities"]);

    std::fs::create_dir(scratch.join("empty")).unwrap();
    let e = p.read_images(scratch.join("empty").to_str().unwrap()).unwrap_err().to_string();
    assert!(e.contains("is a folder with no files"), "{e}");
    // A link to a folder inside the folder is named, not followed (a link back up would
    // never end); the folder's other files are answered.
    std::os::unix::fs::symlink(&dir, dir.join("sub/up")).unwrap();
    let (r, out) = run(&p, &[dir.to_str().unwrap()], &json);
    assert_eq!(r.unwrap(), (5, 3), "{out}");
    let up = out.lines().find(|l| l.contains("sub/up")).unwrap_or_default();
    assert!(up.contains("a link to a folder, not followed"), "{out}");
}

/// Images are read ahead of the batches, several inputs at a time on every core, and still
/// answered in the inputs' order: a folder of 30 files, every fourth no image, in batches
/// of 3 (so the reads run past a batch's end), each good file answered as it is alone, each
/// bad one failing in its place; an input that cannot be read at all ends the stream after
/// the answers before it, and the inputs after it are not answered.
#[test]
fn images_read_ahead_are_answered_in_order() {
    let (scratch, p) = tiny_vit_predictor("predict-read-ahead");
    let dir = scratch.join("many");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..30 {
        let bytes = if i % 4 == 3 { b"no image".to_vec() } else { pgm(4, i) };
        std::fs::write(dir.join(format!("{i:02}.pgm")), bytes).unwrap();
    }
    let json = options(3, Sampling::default(), OutputFormat::JsonLines);
    let inputs = vec![
        Ok(dir.display().to_string()),
        Err(Error::Io { path: "stdin".into(), source: std::io::Error::other("gone") }),
        Ok(dir.join("00.pgm").display().to_string()),
    ];
    let mut out = Vec::new();
    let r = predict_stream(&p, inputs.into_iter(), &json, &mut out);
    assert!(r.is_err_and(|e| e.to_string().contains("gone")));
    let out = String::from_utf8(out).unwrap();
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 30, "{out}");
    for (i, line) in lines.iter().enumerate() {
        let file = dir.join(format!("{i:02}.pgm")).display().to_string();
        assert_eq!(line["input"], file.as_str());
        if i % 4 == 3 {
            assert!(line["error"].as_str().unwrap().contains("starts with bytes"), "{line}");
        } else {
            let (_, alone) = run(&p, &[&file], &json);
            let alone: serde_json::Value = serde_json::from_str(alone.trim()).unwrap();
            assert_eq!(alone["probabilities"], line["probabilities"], "{file}");
        }
    }
}

/// A CSV file's rows are images of their own, each failing alone: a header (the first row
/// with no number, after a blank line too), a row of another count, a value out of range;
/// the good rows around them are answered, each as it is alone.
#[test]
fn a_csv_files_bad_rows_fail_alone() {
    let (scratch, p) = tiny_vit_predictor("predict-csv-rows");
    let row = |v: usize| vec![(v % 17).to_string(); 16].join(",");
    let header = (0..16).map(|i| format!("p{i}")).collect::<Vec<_>>().join(",");
    let too_short = vec!["1"; 15].join(",");
    let too_bright = vec!["17"; 16].join(",");
    let text = format!("\n{header}\n{}\n{too_short}\n{}\n{too_bright}\n{}\n", row(3), row(9), row(16));
    let file = scratch.join("rows.csv");
    std::fs::write(&file, text).unwrap();
    let file = file.display().to_string();
    let json = options(2, Sampling::default(), OutputFormat::JsonLines);
    let (r, out) = run(&p, &[&file], &json);
    assert_eq!(r.unwrap(), (6, 3), "{out}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = lines.iter().map(|l| l["input"].as_str().unwrap()).collect();
    let want: Vec<String> = (2..=7).map(|line| format!("{file}:{line}")).collect();
    assert_eq!(names, want);
    let error = |i: usize| lines[i]["error"].as_str().unwrap_or_default().to_string();
    assert!(error(0).contains("line 2: reads as a header row (`p0` is no number)"), "{out}");
    assert!(error(2).contains("line 4: a CSV row of 15 values"), "{out}");
    assert!(error(4).contains("line 6:") && error(4).contains("17"), "{out}");
    for (i, v) in [(1, 3), (3, 9), (5, 16)] {
        let (_, alone) = run(&p, &[&row(v)], &json);
        let alone: serde_json::Value = serde_json::from_str(alone.trim()).unwrap();
        assert_eq!(lines[i]["probabilities"], alone["probabilities"], "{out}");
    }
}

/// Images are read ahead no further than a batch: at batch size 1 (someone typing) each
/// input is answered before the next is asked for.
#[test]
fn an_image_is_answered_before_the_next_input_is_read_at_batch_size_one() {
    struct Watch<'a> {
        pulled: &'a std::cell::Cell<usize>,
        pulled_at_each_answer: Vec<usize>,
    }
    impl std::io::Write for Watch<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.pulled_at_each_answer.extend(buf.iter().filter(|&&b| b == b'\n').map(|_| self.pulled.get()));
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let (scratch, p) = tiny_vit_predictor("predict-one-at-a-time");
    let files: Vec<String> = (0..4)
        .map(|i| {
            let path = scratch.join(format!("{i}.pgm"));
            std::fs::write(&path, pgm(4, i)).unwrap();
            path.display().to_string()
        })
        .collect();
    let pulled = std::cell::Cell::new(0);
    let inputs = files.iter().map(|f| {
        pulled.set(pulled.get() + 1);
        Ok(f.clone())
    });
    let mut out = Watch { pulled: &pulled, pulled_at_each_answer: Vec::new() };
    predict_stream(&p, inputs, &options(1, Sampling::default(), OutputFormat::JsonLines), &mut out).unwrap();
    assert_eq!(out.pulled_at_each_answer, [1, 2, 3, 4]);
}

/// `evaluate --file` reads a folder of class subfolders, each named by a class of the model,
/// as the labelled images of those classes (each scaled as `predict` scales
/// the file); a subfolder that names no class, a file that is no image or one of another
/// size is an error naming its path, as is a folder for a model that reads no images.
#[test]
fn a_folder_of_class_subfolders_is_scored_by_its_names() {
    let (scratch, p) = tiny_vit_predictor("predict-labelled-folder");
    let dir = scratch.join("held-out");
    for (i, class) in ["a", "a", "b"].iter().enumerate() {
        std::fs::create_dir_all(dir.join(class)).unwrap();
        std::fs::write(dir.join(class).join(format!("{i}.pgm")), pgm(4, i)).unwrap();
    }
    let read_all = |dir: &Path| p.labelled_rows(dir, 2)?.batches.collect::<Result<Vec<HostBatch>>>();
    let read = read_all(&dir).unwrap();
    let targets: Vec<u32> = read.iter().flat_map(|b| b.targets.clone()).collect();
    // Folders in name order: `a`, `b`.
    assert_eq!(targets, [0, 0, 1]);
    assert_eq!(read.iter().map(|b| b.batch).collect::<Vec<_>>(), [2, 1]);
    let alone = p.read_images(dir.join("a/0.pgm").to_str().unwrap()).unwrap();
    let first = read[0].pixels.as_ref().unwrap();
    assert_eq!(alone[0].1.as_ref().unwrap()[..], first[..16]);
    // A class's index is no class name (as for a run's held-out folder).
    std::fs::create_dir(dir.join("1")).unwrap();
    std::fs::write(dir.join("1/9.pgm"), pgm(4, 9)).unwrap();
    let e = p.labelled_rows(&dir, 2).unwrap_err().to_string();
    assert!(e.contains("names class `1`, which is not one of the model's classes (a, b)"), "{e}");
    std::fs::remove_dir_all(dir.join("1")).unwrap();

    std::fs::create_dir(dir.join("c")).unwrap();
    std::fs::write(dir.join("c/9.pgm"), pgm(4, 9)).unwrap();
    let e = p.labelled_rows(&dir, 2).unwrap_err().to_string();
    assert!(e.contains("names class `c`, which is not one of the model's classes (a, b)"), "{e}");
    std::fs::remove_dir_all(dir.join("c")).unwrap();
    std::fs::write(dir.join("b/big.pgm"), pgm(5, 0)).unwrap();
    let e = read_all(&dir).unwrap_err().to_string();
    assert!(e.contains("big.pgm") && e.contains("a 5×5 image"), "{e}");
    std::fs::write(dir.join("b/big.pgm"), "not an image").unwrap();
    let e = read_all(&dir).unwrap_err().to_string();
    assert!(e.contains("big.pgm") && e.contains("not a PNG, JPEG or PGM"), "{e}");

    let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-labelled-folder-gpt", "abc ");
    let e = gpt.labelled_rows(&dir, 2).err().unwrap().to_string();
    assert!(e.contains("is a folder; expected") && e.contains("--config"), "{e}");
}

/// A labelled folder is read as it is scored, `FOLDER_READ` images (in whole batches) at a
/// time: its first batches come before a bad file further on is read, which then ends them
/// with its error; the batches are those of a folder read at once.
#[test]
fn a_labelled_folder_is_read_as_it_is_scored() {
    let (scratch, p) = tiny_vit_predictor("predict-labelled-folder-lazy");
    let dir = scratch.join("held-out");
    let n = FOLDER_READ + 40;
    for class in ["a", "b"] {
        std::fs::create_dir_all(dir.join(class)).unwrap();
    }
    for i in 0..n {
        let class = if i < n / 2 { "a" } else { "b" };
        std::fs::write(dir.join(class).join(format!("{i:03}.pgm")), pgm(4, i % 7)).unwrap();
    }
    let batch = 3;
    let all: Vec<HostBatch> = p.labelled_rows(&dir, batch).unwrap().batches.map(Result::unwrap).collect();
    assert_eq!(all.iter().map(|b| b.batch).sum::<usize>(), n);
    assert!(all[..all.len() - 1].iter().all(|b| b.batch == batch));
    let targets: Vec<u32> = all.iter().flat_map(|b| b.targets.clone()).collect();
    assert_eq!(targets, (0..n).map(|i| u32::from(i >= n / 2)).collect::<Vec<_>>());
    let file = |i: usize| dir.join(if i < n / 2 { "a" } else { "b" }).join(format!("{i:03}.pgm"));
    for (i, b) in all.iter().enumerate().step_by(17) {
        let alone = p.read_images(file(batch * i).to_str().unwrap()).unwrap();
        assert_eq!(alone[0].1.as_ref().unwrap()[..], b.pixels.as_ref().unwrap()[..16], "batch {i}");
    }
    // A bad file past the first read: the batches of that read come, then its error.
    let bad = n - 5;
    std::fs::write(file(bad), "not an image").unwrap();
    let mut batches = p.labelled_rows(&dir, batch).unwrap().batches;
    let first_read = FOLDER_READ.div_ceil(batch);
    for b in all.iter().take(first_read) {
        assert_eq!(&batches.next().unwrap().unwrap(), b);
    }
    let e = batches.next().unwrap().unwrap_err().to_string();
    assert!(e.contains(&format!("{bad:03}.pgm")) && e.contains("not a PNG, JPEG or PGM"), "{e}");
    assert!(batches.next().is_none(), "nothing after the error");
}

/// Nothing to score is an error, as a forward of no input is, not metrics of 0 %.
#[test]
fn an_evaluation_of_nothing_is_an_error() {
    let (_scratch, p) = tiny_gpt_predictor("predict-empty-eval", "abcd");
    let err = p.evaluate(std::iter::empty()).unwrap_err().to_string();
    assert!(err.contains("no labelled target to score"), "{err}");
    let ignored =
        HostBatch { batch: 1, seq: 2, tokens: Some(vec![1, 2]), targets: vec![IGNORE_INDEX; 2], ..Default::default() };
    assert!(p.evaluate(std::iter::once(Ok(ignored))).is_err());
    let scored = HostBatch { batch: 1, seq: 2, tokens: Some(vec![1, 2]), targets: vec![2, 3], ..Default::default() };
    assert_eq!(p.evaluate(std::iter::once(Ok(scored))).unwrap().count, 2);
}

/// A tiny character GPT's export, loaded (`vocab` its characters).
fn tiny_gpt_predictor(name: &str, vocab: &str) -> (crate::files::Scratch, Predictor<crate::device::CpuDevice<f32>>) {
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let chars: Vec<char> = vocab.chars().collect();
    let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(chars.len(), 8, 8, 1, 2));
    let scratch = crate::files::Scratch::new(name);
    let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
    weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
    let predictor = Predictor::load(dev, &scratch).unwrap();
    (scratch, predictor)
}

/// A text the tokenizer reads nothing of (a zero-width space, control characters) is an
/// empty text, for `predict` and for `evaluate --file` (by its line), not scored as
/// `[CLS] [SEP]`; an unknown word is still a word (`[UNK]`).
#[test]
fn a_text_the_tokenizer_reads_nothing_of_is_empty() {
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let config = crate::model::tiny::tiny_bert(crate::model::Pooling::Cls, 0.0);
    let scratch = crate::files::Scratch::new("predict-empty-text");
    let tokenizer = scratch.join("tokenizer");
    std::fs::create_dir_all(&tokenizer).unwrap();
    std::fs::write(tokenizer.join("tokenizer.json"), crate::text::tokenizer::tests::TINY_JSON).unwrap();
    let labels: Vec<String> = ["a", "b", "c"].map(String::from).into();
    let extras = weights::ExportExtras { labels: &labels, tokenizer_dir: Some(&tokenizer), ..Default::default() };
    let model = scratch.join("model");
    weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &model).unwrap();
    let p = Predictor::load(dev, &model).unwrap();
    for nothing in ["\u{200b}", "\u{0}\u{1}", " \t "] {
        let e = p.classify_texts(&["zzz", nothing]).unwrap_err().to_string();
        assert!(e.contains("an empty text (no token the tokenizer reads"), "{nothing:?}: {e}");
    }
    assert_eq!(p.classify_texts(&["zzz"]).unwrap().len(), 1);
    let rows = scratch.join("rows.tsv");
    std::fs::write(&rows, "a\tzzz\nb\t\u{200b}\n").unwrap();
    let e = p.labelled_rows(&rows, 8).unwrap_err().to_string();
    assert!(e.contains("line 2: an empty text"), "{e}");
    // A text past the 9 positions is cut there, and counted.
    std::fs::write(&rows, format!("a\tzzz\nb\t{}\n", ["zzz"; 20].join(" "))).unwrap();
    let read = p.labelled_rows(&rows, 1).unwrap();
    assert_eq!((read.batches.count(), read.cut), (2, 1));
}

/// A prompt longer than the window is read from its end, with a warning; the window is the
/// run's `data.max_len` where the export records it (positions past it never trained),
/// else the position table (8 here).
#[test]
fn a_prompt_past_the_window_is_read_from_its_end_and_said_so() {
    let greedy = Sampling { max_new_tokens: 3, temperature: 0.0, ..Sampling::default() };
    let (_dir, gpt) = tiny_gpt_predictor("predict-window", "ab");
    let whole = gpt.generate("abbab", &greedy).unwrap();
    assert_eq!(whole.warning, None);
    let long = gpt.generate("aabbabaabab", &greedy).unwrap();
    let said = long.warning.as_deref().unwrap_or_default();
    assert!(said.contains("its last 8 characters") && said.contains("the first 3 left unread"), "{said}");
    // Trained on windows of 4: the last 4 characters are what the model reads.
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(2, 8, 8, 1, 2));
    let scratch = crate::files::Scratch::new("predict-window-trained");
    let trained_on = serde_json::json!({ MAX_LEN: 4 });
    let chars = ['a', 'b'];
    let extras = weights::ExportExtras { chars: &chars, trained_on: Some(&trained_on), ..Default::default() };
    weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
    let gpt = Predictor::load(dev, &scratch).unwrap();
    let long = gpt.generate("aabbab", &greedy).unwrap();
    assert!(long.warning.as_deref().is_some_and(|w| w.contains("its last 4 characters")), "{long:?}");
    assert_eq!(long.text, gpt.generate("bbab", &greedy).unwrap().text);
}

/// A continuation is written as it is drawn, in a table: each character flushed as it comes,
/// the row ending as a whole generation's does. Prompts are continued one at a time, each as
/// soon as it is read, whatever the batch size (someone typing gets an answer to each).
#[test]
fn a_continuation_is_written_character_by_character_as_it_is_drawn() {
    struct Watch<'a> {
        pulled: &'a std::cell::Cell<usize>,
        written: Vec<u8>,
        /// What was written at each flush, and how many prompts had been read by then.
        flushed: Vec<(String, usize)>,
    }
    impl std::io::Write for Watch<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.written.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.flushed.push((String::from_utf8(self.written.clone()).unwrap(), self.pulled.get()));
            Ok(())
        }
    }
    let (_dir, gpt) = tiny_gpt_predictor("predict-streamed", "abc ");
    let sampling = Sampling { max_new_tokens: 5, seed: 3, ..Sampling::default() };
    let prompts = ["ab", "ca"];
    let whole: Vec<Generation> = prompts.iter().map(|p| gpt.generate(p, &sampling).unwrap()).collect();
    let pulled = std::cell::Cell::new(0);
    let inputs = prompts.iter().map(|p| {
        pulled.set(pulled.get() + 1);
        Ok(p.to_string())
    });
    let mut out = Watch { pulled: &pulled, written: Vec::new(), flushed: Vec::new() };
    let header = "prompt, then the generated text; a rule under each\n";
    let r = predict_stream(&gpt, inputs, &options(32, sampling, OutputFormat::Table), &mut out);
    assert_eq!(r.unwrap(), (2, 0));
    let first = format!("{header}{GENERATION_RULE}\n{}{}\n{GENERATION_RULE}\n", prompts[0], whole[0].text);
    let text = String::from_utf8(out.written.clone()).unwrap();
    assert_eq!(text, format!("{first}{}{}\n{GENERATION_RULE}\n", prompts[1], whole[1].text));
    // One flush per character, each showing the continuation so far, before the next prompt
    // is read.
    let mut want = Vec::new();
    for (i, (prompt, g)) in prompts.iter().zip(&whole).enumerate() {
        let before = if i == 0 { format!("{header}{GENERATION_RULE}\n") } else { first.clone() };
        for n in 1..=5 {
            let so_far: String = g.text.chars().take(n).collect();
            want.push((format!("{before}{prompt}{so_far}"), i + 1));
        }
    }
    let streamed: Vec<_> = out.flushed.iter().filter(|(w, _)| !w.ends_with('\n')).cloned().collect();
    assert_eq!(streamed, want);
    // Output that closes halfway through a continuation (`| head -c`) stops the run there, by
    // the error writing, not by a prompt's failure.
    struct Closes(usize);
    impl std::io::Write for Closes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.checked_sub(buf.len()).ok_or(std::io::ErrorKind::BrokenPipe)?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut closes = Closes(header.len() + GENERATION_RULE.len() + 1 + "ab".len() + 2);
    let r = predict_stream(
        &gpt,
        prompts.iter().map(|p| Ok(p.to_string())),
        &options(1, sampling, OutputFormat::Table),
        &mut closes,
    );
    let Err(Error::Io { path, source }) = r else { panic!("{r:?}") };
    assert!(path == "writing the predictions" && source.kind() == std::io::ErrorKind::BrokenPipe);
}

/// A classification's JSON line lists the probabilities in label order, as the model's
/// labels are (not sorted by name).
#[test]
fn probabilities_come_in_label_order() {
    let p = ClassPrediction {
        label: "zebra".into(),
        probability: 0.75,
        probabilities: vec![("zebra".into(), 0.75), ("ant".into(), 0.25)],
        warning: None,
    };
    let mut out = Vec::new();
    write_outcome(&mut out, OutputFormat::JsonLines, false, "x", &Outcome::Class(p)).unwrap();
    let line = String::from_utf8(out).unwrap();
    assert!(
        line.starts_with(r#"{"input":"x","#) && line.contains(r#""probabilities":{"zebra":0.75,"ant":0.25}"#),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!((v["input"].as_str(), v["label"].as_str()), (Some("x"), Some("zebra")));
}

/// A tiny 4×4 ViT's export (pixels 0..=16, classes `a`, `b`), loaded.
fn tiny_vit_predictor(name: &str) -> (crate::files::Scratch, Predictor<crate::device::CpuDevice<f32>>) {
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let config = crate::model::tiny::tiny_gray_vit();
    let scratch = crate::files::Scratch::new(name);
    let labels = ["a".to_string(), "b".to_string()];
    let extras = weights::ExportExtras { labels: &labels, pixel_max: Some(16), ..Default::default() };
    weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
    let predictor = Predictor::load(dev, &scratch).unwrap();
    (scratch, predictor)
}

/// A grayscale image given to a colour model reads as RGB, its plane three times (as the run's
/// image folders read it): answered as the RGB image of three equal planes is, where a model
/// of one channel refuses an RGB image by its channels.
#[test]
fn a_grayscale_image_reads_as_rgb_for_a_colour_model() {
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let crate::model::ModelConfig::Vit(gray) = crate::model::tiny::tiny_gray_vit() else { unreachable!() };
    let config = crate::model::ModelConfig::Vit(crate::model::VitConfig { num_channels: 3, ..gray });
    let scratch = crate::files::Scratch::new("predict-gray-as-rgb");
    let labels = ["a".to_string(), "b".to_string()];
    let extras = weights::ExportExtras { labels: &labels, pixel_max: Some(255), ..Default::default() };
    weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
    let p = Predictor::load(dev, &scratch).unwrap();
    let gray = pgm(4, 5);
    let plane = &gray[gray.len() - 16..];
    let mut rgb = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut rgb, 4, 4);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let interleaved: Vec<u8> = plane.iter().flat_map(|&v| [v, v, v]).collect();
        enc.write_header().unwrap().write_image_data(&interleaved).unwrap();
    }
    let (gray_file, rgb_file) = (scratch.join("gray.pgm"), scratch.join("rgb.png"));
    std::fs::write(&gray_file, &gray).unwrap();
    std::fs::write(&rgb_file, &rgb).unwrap();
    let json = options(2, Sampling::default(), OutputFormat::JsonLines);
    let (r, out) = run(&p, &[gray_file.to_str().unwrap(), rgb_file.to_str().unwrap()], &json);
    assert_eq!(r.unwrap(), (2, 0), "{out}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines[0]["probabilities"].is_object(), "{out}");
    assert_eq!(lines[0]["probabilities"], lines[1]["probabilities"], "{out}");
    let (_, gray_model) = tiny_vit_predictor("predict-rgb-for-gray");
    let (_, out) = run(&gray_model, &[rgb_file.to_str().unwrap()], &json);
    assert!(out.contains("a 4×4 image with 3 channels; the model takes 4×4 with 1"), "{out}");
}

/// An export whose processor normalises its pixels (a ViT exported elsewhere) is answered as
/// its model answers the normalised pixels: the normalisation is folded into the patch
/// embedding as it loads, where an export of this engine's has none to fold.
#[test]
fn an_exported_normalisation_is_applied_as_the_processor_would() {
    let (scratch, original) = tiny_vit_predictor("predict-normalising");
    let path = scratch.join(weights::PREPROCESSOR_FILE);
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["do_normalize"] = true.into();
    json["image_mean"] = serde_json::json!([0.25]);
    json["image_std"] = serde_json::json!([0.5]);
    std::fs::write(&path, json.to_string()).unwrap();
    let normalising = Predictor::load(crate::device::CpuDevice::<f32>::new(0, 1).unwrap(), &scratch).unwrap();
    let image: Vec<f32> = (0..16).map(|i| i as f32 / 15.0).collect();
    let normalised: Vec<f32> = image.iter().map(|v| (v - 0.25) / 0.5).collect();
    let probabilities = |p: &Predictor<crate::device::CpuDevice<f32>>, image: &[f32]| {
        p.classify_images(&[image.to_vec()]).unwrap()[0].probabilities.iter().map(|(_, v)| *v).collect::<Vec<f64>>()
    };
    let (want, got) = (probabilities(&original, &normalised), probabilities(&normalising, &image));
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() < 1e-6), "{want:?} vs {got:?}");
    assert_ne!(probabilities(&original, &image), want, "the normalisation changes the answer");
}

fn options(batch_size: usize, sampling: Sampling, format: OutputFormat) -> PredictOptions {
    PredictOptions { batch_size, sampling, format }
}

fn run(
    predictor: &Predictor<crate::device::CpuDevice<f32>>,
    inputs: &[&str],
    options: &PredictOptions,
) -> (Result<(usize, usize)>, String) {
    let mut out = Vec::new();
    let r = predict_stream(predictor, inputs.iter().map(|s| Ok(s.to_string())), options, &mut out);
    (r, String::from_utf8(out).unwrap())
}

/// Options no input could use are refused once, before any input is read or any line
/// written: a bad temperature (not an error per prompt), a top-k of every character, a batch
/// size of 0, and sampling flags for a model that does not generate.
#[test]
fn bad_options_are_refused_once_before_any_input() {
    let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-options-gpt", "abc ");
    let json = OutputFormat::JsonLines;
    let bad = Sampling { temperature: -1.0, max_new_tokens: 2, ..Sampling::default() };
    let (r, out) = run(&gpt, &["ab", "ba", "c"], &options(4, bad, json));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("--temperature") && e.contains("is -1") && out.is_empty(), "{e} / {out}");
    for t in [f64::NAN, f64::INFINITY] {
        let (r, _) = run(&gpt, &["ab"], &options(1, Sampling { temperature: t, ..bad }, json));
        assert!(r.unwrap_err().to_string().contains("--temperature"));
    }
    let none = Sampling { max_new_tokens: 0, ..Sampling::default() };
    let (r, _) = run(&gpt, &["ab"], &options(1, none, json));
    assert!(r.unwrap_err().to_string().contains("--max-new-tokens"));
    // Greedy decoding with a top-k or a seed, which it would ignore.
    for (flag, greedy) in [
        ("--top-k 3 has no effect at --temperature 0", Sampling { temperature: 0.0, top_k: 3, ..Sampling::default() }),
        ("--seed 7 has no effect at --temperature 0", Sampling { temperature: 0.0, seed: 7, ..Sampling::default() }),
    ] {
        let (r, out) = run(&gpt, &["ab"], &options(1, greedy, json));
        let e = r.unwrap_err().to_string();
        assert!(e.contains(flag) && out.is_empty(), "{e} / {out}");
        let sampled = Sampling { temperature: 0.5, max_new_tokens: 2, ..greedy };
        assert!(run(&gpt, &["ab"], &options(1, sampled, json)).0.is_ok());
    }
    // A top-k of every character, or more, which draws as 0 does.
    let all = Sampling { top_k: 4, max_new_tokens: 2, ..Sampling::default() };
    let (r, out) = run(&gpt, &["ab"], &options(1, all, json));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("--top-k 4 keeps every one of the model's 4 characters") && out.is_empty(), "{e}");
    assert!(run(&gpt, &["ab"], &options(1, Sampling { top_k: 3, ..all }, json)).0.is_ok());
    let good = Sampling { max_new_tokens: 2, temperature: 0.0, ..Sampling::default() };
    let (r, out) = run(&gpt, &["ab", "ba"], &options(1, good, json));
    assert_eq!((r.unwrap(), out.lines().count()), ((2, 0), 2), "{out}");
    let (r, out) = run(&gpt, &["ab"], &options(0, good, json));
    assert!(r.unwrap_err().to_string().contains("--batch-size") && out.is_empty());

    let (vit_dir, vit) = tiny_vit_predictor("predict-options-vit");
    let row = ["0"; 16].join(",");
    let (r, out) = run(&vit, &[&row], &options(0, Sampling::default(), json));
    assert!(r.unwrap_err().to_string().contains("--batch-size") && out.is_empty());
    let greedy = Sampling { temperature: 0.0, seed: 5, ..Sampling::default() };
    let e = run(&vit, &[&row], &options(8, greedy, json)).0.unwrap_err().to_string();
    assert!(e.contains("only apply to text generation") && !e.contains("most probable"), "{e}");
    let gpt_only = Sampling { temperature: 0.5, top_k: 3, ..Sampling::default() };
    let (r, out) = run(&vit, &[&row], &options(8, gpt_only, json));
    let e = r.unwrap_err().to_string();
    assert!(out.is_empty(), "{out}");
    assert!(
        e.contains("--temperature 0.5 and --top-k 3 only apply to text generation")
            && e.contains("a ViT image classifier with 2 classes (a, b)"),
        "{e}"
    );
    let (r, out) = run(&vit, &[&row], &options(8, Sampling::default(), json));
    assert_eq!((r.unwrap(), out.lines().count()), ((1, 0), 1), "{out}");
    // Labelled rows in batches of 0 are refused too, not read one by one.
    let rows = vit_dir.join("rows.csv");
    std::fs::write(&rows, format!("{row},a\n")).unwrap();
    assert!(vit.labelled_rows(&rows, 0).unwrap_err().to_string().contains("--batch-size"));
    assert_eq!(vit.labelled_rows(&rows, 1).unwrap().batches.count(), 1);
}

/// A table starts with a header naming its columns, above the rows it heads.
#[test]
fn a_table_has_a_header_row() {
    let (_vit_dir, vit) = tiny_vit_predictor("predict-table");
    let row = ["16"; 16].join(",");
    let (r, out) = run(&vit, &[&row, "1,2"], &options(8, Sampling::default(), OutputFormat::Table));
    assert_eq!(r.unwrap(), (2, 1));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(header, ["input", "label", "probability"], "{out}");
    // The probability ends where its header does.
    assert_eq!(lines[1].find('%').map(|i| i + 1), Some(lines[0].len()), "{out}");
    assert!(lines[2].contains("error:"), "{out}");
    let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-table-gpt", "abc ");
    let sampling = Sampling { max_new_tokens: 3, temperature: 0.0, ..Sampling::default() };
    let (r, out) = run(&gpt, &["ab", "z", "ba"], &options(1, sampling, OutputFormat::Table));
    assert_eq!(r.unwrap(), (3, 1));
    // Each generation, or prompt that failed, ends at a rule (a text may break lines): the
    // header's, then one under each.
    let blocks: Vec<&str> = out.split(&format!("{GENERATION_RULE}\n")).collect();
    assert_eq!(blocks.len(), 5, "{out}");
    assert_eq!(blocks[0], "prompt, then the generated text; a rule under each\n", "{out}");
    assert!(blocks[1].starts_with("ab") && blocks[1].len() > "ab\n".len(), "{out}");
    assert!(blocks[2].starts_with("z  error:"), "{out}");
    assert!(blocks[3].starts_with("ba") && blocks[4].is_empty(), "{out}");
    // JSON lines have no header.
    let (_, out) = run(&vit, &[&row], &options(8, Sampling::default(), OutputFormat::JsonLines));
    assert!(out.starts_with('{'), "{out}");
}

/// The table's columns are counted as a terminal shows them: a wide (CJK) character takes
/// two, so a row of them pads to the same column, and one cut ends within its width.
#[test]
fn table_columns_are_counted_in_terminal_widths() {
    use unicode_width::UnicodeWidthStr;
    assert_eq!(padded("映画", 6), "映画  ");
    assert_eq!(padded("film", 6), "film  ");
    let long = "映".repeat(40);
    let cut = shorten(&long, INPUT_COLUMN);
    assert!(cut.ends_with('…') && cut.width() <= INPUT_COLUMN && cut.width() >= INPUT_COLUMN - 1, "{cut}");
    assert_eq!(shorten("a\tb", 8), "a b");
    let (_vit_dir, vit) = tiny_vit_predictor("predict-table-wide");
    let row = ["16"; 16].join(",");
    let (_, out) = run(&vit, &[&row, "映画", "1,2"], &options(8, Sampling::default(), OutputFormat::Table));
    let errors: Vec<usize> = out.lines().filter_map(|l| l.find("error:").map(|i| l[..i].width())).collect();
    assert_eq!(errors, [INPUT_COLUMN + 2, INPUT_COLUMN + 2], "{out}");
}

#[test]
fn sampling_keeps_to_the_top_k_and_is_greedy_at_temperature_zero() {
    let logits = [0.0f32, 3.0, 1.0, 2.9];
    let s = Sampling { max_new_tokens: 1, temperature: 0.0, top_k: 0, seed: 1 };
    assert_eq!(draw(&logits, &s, &mut Rng::new(1)), 1);
    let top2 = Sampling { temperature: 1.0, top_k: 2, ..s };
    let mut rng = Rng::new(3);
    let drawn: Vec<usize> = (0..200).map(|_| draw(&logits, &top2, &mut rng)).collect();
    assert!(drawn.iter().all(|&i| i == 1 || i == 3), "only the two most probable");
    assert!(drawn.contains(&1) && drawn.contains(&3), "both drawn");
    let p = softmax(&logits, 1.0);
    assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12 && p[1] > p[3] && p[3] > p[2]);
    // A temperature so small that logit / T overflows: all the mass on the largest logit.
    assert_eq!(softmax(&logits, 1e-310), [0.0, 1.0, 0.0, 0.0]);
    assert_eq!(draw(&logits, &Sampling { temperature: 1e-310, ..top2 }, &mut rng), 1);
}
