//! The `pipetransformer` binary on bad input: a clear message, a non-zero exit, and a good
//! checkpoint left untouched.

mod common;

use std::io::Write;

use pipetransformer::testing::Scratch;
use std::path::Path;
use std::process::Command;

/// A child whose stdout and stderr the test reads.
trait SpawnPiped {
    fn spawn_piped(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    fn spawn_piped(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    }
}
fn pipetransformer(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(args).output().unwrap();
    (out.status.success(), output_text(&out))
}

/// A finished process's stdout, then its stderr.
fn output_text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A fresh folder for one test's runs, removed when the test passes.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-{name}"))
}

#[test]
fn unknown_set_key_is_rejected_by_name() {
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--set", "train.bogus=1"]);
    assert!(!ok);
    assert!(out.contains("bogus"), "{out}");
}

#[test]
fn missing_config_and_missing_dataset_say_what_to_do() {
    let (ok, out) = pipetransformer(&["train", "--config", "configs/nope.toml"]);
    assert!(!ok && out.contains("configs/nope.toml"), "{out}");
    let empty = scratch("nodata");
    let dir = format!("data.dir={}", empty.display());
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--set", &dir]);
    assert!(!ok && out.contains("digits.csv.gz") && out.contains("scripts/setup.sh"), "{out}");
}

#[test]
fn corrupt_checkpoint_on_resume_is_an_error_and_is_not_replaced() {
    let out_dir = scratch("resume");
    let data = "data/digits/digits.csv.gz";
    if !common::installed(&[std::path::Path::new(data)]) {
        return;
    }
    let set_out = format!("output.dir={}", out_dir.display());
    let args = ["train", "--config", "configs/vit-digits.toml", "--set", &set_out, "--set", "train.epochs=1"];
    let (ok, out) = pipetransformer(&args);
    assert!(ok, "{out}");
    let ckpt = out_dir.join("checkpoint.ckpt");
    // A second fresh run into the same directory is refused without --fresh/--resume.
    let (ok, out) = pipetransformer(&args);
    assert!(!ok && out.contains("--resume"), "{out}");
    // Corrupt it: resuming fails, names the file, and leaves the bytes as they were.
    let mut bytes = std::fs::read(&ckpt).unwrap();
    let n = bytes.len();
    bytes[n / 3] ^= 0xff;
    std::fs::write(&ckpt, &bytes).unwrap();
    let mut resume = args.to_vec();
    resume.push("--resume");
    let (ok, out) = pipetransformer(&resume);
    assert!(!ok && out.contains("checkpoint.ckpt") && out.contains("corrupt"), "{out}");
    assert_eq!(std::fs::read(&ckpt).unwrap(), bytes);
}

/// Options that would be silently dropped are refused instead: inputs given both on the
/// command line and by `--file`, and `--set` (which changes `--config`) with `--file`.
#[test]
fn inputs_that_would_be_ignored_are_refused() {
    let (ok, out) = pipetransformer(&["predict", "--model", "m", "--file", "a.txt", "an extra input"]);
    assert!(!ok && out.contains("--file") && out.contains("cannot be used with"), "{out}");
    let (ok, out) = pipetransformer(&["evaluate", "--model", "m", "--file", "rows.tsv", "--set", "data.max_len=8"]);
    assert!(!ok && out.contains("--set") && out.contains("cannot be used with"), "{out}");
}

/// A path that is not UTF-8 (a Unix file name may be any bytes) is the user's to give: a
/// command that fails on it says why, with exit status 1, instead of panicking while it
/// reports the error.
#[test]
fn a_path_that_is_not_utf8_fails_with_its_error_not_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::OsStr::from_bytes(b"/nowhere/rows-\xff.tsv");
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(["evaluate", "--model", "/nowhere/model", "--file"])
        .arg(path)
        .output()
        .unwrap();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("Error: ") && !text.contains("panicked"), "{text}");
}

/// A report whose reader has gone (`plan ... | head -2`) ends the program quietly, as a
/// closed pipe ends any Unix tool, instead of a panic about printing.
#[test]
fn a_closed_pipe_ends_a_report_quietly() {
    use std::os::unix::process::ExitStatusExt;
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2"])
        .spawn_piped();
    drop(child.stdout.take()); // closed before the first line is printed
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

/// `--token-slices auto` says what it planned and how to keep it: the lengths it names, given
/// back, are taken and run the same schedule.
#[test]
fn an_auto_slicing_says_how_to_keep_it() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let plan = ["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--micro-batches", "2"];
    let (ok, auto) = pipetransformer(&[&plan[..], &["--token-slices", "auto"]].concat());
    // The stage modelled: the slowest of the partition, two of the four layers and the head
    // (by FLOPs, as `plan` costs the units).
    let stage = "token slices (planned from this machine's layer latency, for the slowest stage: 2.00 layers, ends 0.";
    assert!(ok && auto.contains(stage), "{auto}");
    // Its times are measured; the plan's table, here, nominal FLOPs: the output says so.
    let note = "the slicing's times are measured on this machine; the plan's stage times above are FLOPs at the \
                nominal rate, which its bubble and simulation split by the slices' measured shares";
    assert!(auto.contains(note), "{auto}");
    let schedule = |out: &str| out.lines().filter(|l| l.starts_with("device ")).map(str::to_owned).collect::<Vec<_>>();
    // Under a memory limit that no slicing `auto` plans meets, recomputing, it runs the fewest
    // equal slices that fit, says so, and plans as they do given.
    let tiny = ["model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2", "data.max_len=32"];
    let mut small = vec!["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--micro-batches", "2"];
    for set in tiny.iter().chain(&["data.batch_size=4"]) {
        small.extend(["--set", set]);
    }
    small.extend(["--schedule", "gpipe", "--memory-limit", "400KiB", "--recompute", "auto", "--token-slices"]);
    let (ok, out) = pipetransformer(&[&small[..], &["auto"]].concat());
    let said = out.lines().find(|l| l.starts_with("token slices: ") && l.contains("of equal length"));
    let n = said.and_then(|l| l["token slices: ".len()..].split(' ').next()).filter(|_| ok);
    let n = n.unwrap_or_else(|| panic!("{out}"));
    let none = "(`auto`: none of its slicings fits the memory limit as `auto` recomputes (`--recompute all` may let one \
                fit); these are the fewest equal";
    assert!(out.contains(none), "{out}");
    let (ok, given) = pipetransformer(&[&small[..], &[n]].concat());
    assert!(ok && schedule(&given) == schedule(&out) && given.contains("recomputes"), "--token-slices {n}: {given}");
    let (ok, out) = pipetransformer(&[&small[..], &[&(n.parse::<usize>().unwrap() - 1).to_string()]].concat());
    assert!(!ok && out.contains("pipeline.memory_limit"), "one slice fewer does not fit: {out}");
    // On one stage `auto` keeps micro-batches whole, and says why; an empty slicing is refused.
    let one = ["plan", "--config", "configs/gpt-hamlet.toml", "--token-slices", "auto"];
    let (ok, out) = pipetransformer(&one);
    assert!(ok && out.contains("token slices: none (`auto` on one stage"), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--token-slices", ""]].concat());
    assert!(!ok && out.contains("pipeline.token_slices") && out.contains("an empty slicing"), "{out}");
    let Some(kept) = auto.split("(--token-slices ").nth(1).and_then(|rest| rest.split(' ').next()) else {
        assert!(auto.contains("unsliced"), "a sliced plan names its lengths: {auto}");
        return;
    };
    let (ok, pinned) = pipetransformer(&[&plan[..], &["--token-slices", kept]].concat());
    assert!(ok && schedule(&pinned) == schedule(&auto) && !schedule(&auto).is_empty(), "{auto}\n{pinned}");
}

/// `plan` prices a slicing of the run's own as `auto` prices its plans (its slices' times on
/// the slowest stage, measured), sets `auto`'s choice beside it, and splits the stages' time
/// in the printed bubble and simulation by the slices' measured shares; a `train` run does not
/// spend the measurement. Where the layer cannot be measured (too short a sequence), the plan
/// stands and says why.
#[test]
fn a_given_slicing_is_priced_beside_autos_choice() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let tiny = ["model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2", "data.batch_size=4"];
    let mut plan = vec!["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2"];
    for set in tiny {
        plan.extend(["--set", set]);
    }
    let (ok, out) = pipetransformer(&[&plan[..], &["--set", "data.max_len=32", "--token-slices", "4"]].concat());
    let priced = "token slices (as given, priced from this machine's layer latency, for the slowest stage: 1.00 layers";
    assert!(ok && out.contains(priced) && out.contains("(4 seq: 4×8 tokens); 4 slices; predicted step "), "{out}");
    assert!(out.contains("8 after 24: ") && out.contains("\n  the whole sequence's time on that stage, unsliced: "));
    assert!(out.contains("(token slices at their measured shares of a micro-batch's time: "), "{out}");
    let beside = ["`--token-slices auto` would run (4 seq: ", "(`--token-slices auto` plans these same slices)"];
    assert!(beside.iter().any(|b| out.contains(b)), "{out}");
    // `auto`'s own plan is no slicing given.
    let (ok, auto) = pipetransformer(&[&plan[..], &["--set", "data.max_len=32", "--token-slices", "auto"]].concat());
    assert!(ok && !auto.contains("as given") && !auto.contains("would run"), "{auto}");
    // Too short to measure: the plan as before, and why it is not priced.
    let (ok, short) = pipetransformer(&[&plan[..], &["--set", "data.max_len=3", "--token-slices", "2"]].concat());
    let why = "token slices as given: not priced on this machine (config field `pipeline.token_slices`: a 3-token \
               sequence is too short to measure the context term)";
    assert!(ok && short.contains(why) && short.contains("simulated: step "), "{short}");
    assert!(!short.contains("measured shares"), "{short}");
    // A run trains on the slices without pricing them.
    let dir = scratch("given-slices");
    let dir_set = format!("output.dir={}", dir.display());
    let mut train = vec!["train", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--fresh"];
    for set in tiny.iter().chain(&["data.max_len=32", "train.max_steps=1", "data.test_limit=4", &dir_set]) {
        train.extend(["--set", set]);
    }
    let (ok, out) = pipetransformer(&[&train[..], &["--token-slices", "4", "--progress-every", "0"]].concat());
    assert!(ok && !out.contains("priced") && !out.contains("measured shares"), "{out}");
}

/// `auto` slices each shape AutoPipe changes to by the rule that sliced the first: where
/// nothing its planner plans fits the memory limit, the fewest equal slices that do. Here a
/// 4-layer GPT starts on two stages at 4 equal slices; a freeze leaves one stage, where whole
/// micro-batches exceed the limit, and that stage runs more, shorter equal slices (not the first
/// shape's list, which no longer fits one device). A plan of one stage does the same, and keeps
/// micro-batches whole where they fit.
#[test]
fn auto_slices_each_shape_autopipe_changes_to() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("auto-slices-each-shape");
    let out_dir = format!("output.dir={}", dir.display());
    let tiny = ["model.config.n_embd=32", "model.config.n_layer=4", "model.config.n_head=2", "data.max_len=32"];
    let data = ["data.batch_size=4", "data.train_limit=64", "data.test_limit=8", "train.max_steps=6"];
    let mut args = vec!["train", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--fresh"];
    for set in tiny.iter().chain(&data).chain([&out_dir.as_str(), &"elastic.table=[0, 2]"]) {
        args.extend(["--set", set]);
    }
    args.extend(["--freeze", "table", "--freeze-interval", "3", "--auto-pipe", "--progress-every", "0"]);
    args.extend(["--micro-batches", "2", "--schedule", "gpipe", "--recompute", "auto", "--memory-limit", "700KiB"]);
    let (ok, out) = pipetransformer(&[&args[..], &["--token-slices", "auto"]].concat());
    assert!(ok && out.contains("token slices: 4 of equal length, 8,8,8,8 (`auto`: none of its slicings"), "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let reason = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["event"] == "transition" && v["pipeline_len"] == serde_json::json!([2, 1]))
        .map(|v| v["reason"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("the freeze leaves one stage: {log}"));
    let after = reason.split("token slices 8,8,8,8 → ").nth(1).and_then(|t| t.split(' ').next());
    let after: Vec<usize> =
        after.unwrap_or_else(|| panic!("{reason}")).split(',').map(|n| n.parse().unwrap()).collect();
    let (least, most) = (after.iter().min().unwrap(), after.iter().max().unwrap());
    assert!(after.len() > 4 && most - least <= 1 && after.iter().sum::<usize>() == 32, "{reason}");
    assert!(reason.contains("(one stage within the memory limit: the fewest equal slices that fit)"), "{reason}");
    // One stage from the start: equal slices where whole micro-batches exceed the limit, whole
    // where they fit.
    let mut plan = vec!["plan", "--config", "configs/gpt-hamlet.toml", "--recompute", "auto", "--token-slices", "auto"];
    for set in tiny.iter().chain(&["data.batch_size=4"]) {
        plan.extend(["--set", set]);
    }
    let (ok, out) = pipetransformer(&[&plan[..], &["--memory-limit", "2000KiB"]].concat());
    let equal = "of equal length, 16,16 (`auto` on one stage: whole micro-batches exceed the memory limit";
    assert!(ok && out.contains(equal), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--memory-limit", "4MiB"]].concat());
    assert!(ok && out.contains("token slices: none (`auto` on one stage"), "{out}");
    // A run that begins on one stage, its sequences in 4 equal slices to fit, slices again
    // when a freeze (the table's first entry, before the first step) leaves less to hold:
    // fewer equal slices, not whole micro-batches that exceed the limit.
    let long = ["model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2"];
    let long = long.iter().chain(&["model.config.n_positions=256", "data.max_len=256", "data.batch_size=1"]);
    let mut one = vec!["train", "--config", "configs/gpt-hamlet.toml", "--fresh", "--progress-every", "0"];
    for set in long.chain(&["data.train_limit=32", "data.test_limit=8", "train.max_steps=4", out_dir.as_str()]) {
        one.extend(["--set", set]);
    }
    one.extend(["--memory-limit", "1500000", "--recompute", "auto", "--token-slices", "auto", "--freeze", "table"]);
    one.extend(["--set", "elastic.table=[1]", "--freeze-interval", "2", "--auto-pipe"]);
    let (ok, out) = pipetransformer(&one);
    assert!(ok && out.contains("token slices: 4 of equal length, 64,64,64,64 (`auto` on one stage"), "{out}");
    let line = out.lines().find(|l| l.starts_with("transition at step 0")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("token slices 64,64,64,64 → 128,128 (one stage within the memory limit"), "{line}");
}

/// Under a memory limit that no slicing of the time-balanced stages meets (stage 0 then holds
/// two micro-batches of the embeddings and two layers: at least 46.5 MiB), `auto` plans for
/// the stages the limit forces on whole sequences (a unit fewer on stage 0) instead of refusing,
/// and prints each slice's predicted time. A limit no cut meets is still refused.
#[test]
fn auto_slicing_plans_for_the_stages_a_memory_limit_forces() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let plan = ["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--micro-batches", "2"];
    let auto = [&plan[..], &["--token-slices", "auto", "--set"]].concat();
    let (ok, out) = pipetransformer(&[&auto[..], &["pipeline.memory_limit=40MiB"]].concat());
    assert!(ok && out.contains("| 0 | 0 | 0..3 (4 units") && out.contains("token slices (planned"), "{out}");
    // Each slice's predicted time is printed, the largest the plan's largest slice.
    let ms = |t: &str| -> f64 { t.split(" ms").next().unwrap().trim().parse().unwrap() };
    // (How many slices rests on this machine's timings: as many times as the kept list has
    // lengths, none printed for whole sequences.)
    let kept = out.split("--token-slices ").nth(1).map(|t| t.split(' ').next().unwrap().split(',').count());
    let line = out.lines().find(|l| l.contains("each slice's time on that stage"));
    assert_eq!(kept.is_some(), line.is_some(), "{out}");
    if let (Some(kept), Some(line)) = (kept, line) {
        let slices = line.split("after context: ").nth(1).unwrap().split("; ");
        let times: Vec<f64> = slices.map(|t| ms(t.rsplit(": ").next().unwrap())).collect();
        let largest = ms(out.split("largest slice ").nth(1).unwrap());
        assert_eq!((times.len(), times.iter().copied().fold(0.0, f64::max)), (kept, largest), "{out}");
    }
    let (ok, out) = pipetransformer(&[&plan[..], &["--set", "pipeline.memory_limit=40MiB"]].concat());
    assert!(ok && out.contains("| 0 | 0 | 0..3 (4 units"), "the cut of whole sequences: {out}");
    let (ok, out) = pipetransformer(&[&auto[..], &["pipeline.memory_limit=30MiB"]].concat());
    assert!(!ok && out.contains("no slicing meets the memory limit"), "{out}");
}

/// `--recompute auto` plans, under a limit that no split keeping every micro-batch's
/// activations meets, the one stage that needs it recomputing (stage 0, which holds the most
/// micro-batches under 1F1B), and only the units it needs; `all` every stage's units, also over
/// token slices. A limit refused without recomputation says what recomputing would need. An
/// unknown policy (flag or config key), or one with zb-h1, is refused naming what is expected.
#[test]
fn recomputation_plans_what_a_memory_limit_refuses_without_it() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let plan = ["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--micro-batches", "4"];
    let limited = [&plan[..], &["--memory-limit", "20MiB"]].concat();
    let (ok, out) = pipetransformer(&limited);
    assert!(!ok && out.contains("no split of 11 units into 2 stages fits"), "{out}");
    // The refusal says what recomputing would do: fit here, need so many bytes below; and
    // which flag gave the setting it names (not where `--set` gave it).
    assert!(out.contains("; recomputing activations fits (--recompute auto, pipeline.recompute)"), "{out}");
    assert!(out.contains("(`pipeline.memory_limit` is the setting --memory-limit gives)"), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--set", "pipeline.memory_limit=\"20MiB\""]].concat());
    assert!(!ok && out.contains("no split of 11 units") && !out.contains("is the setting"), "{out}");
    // (Nor where a setting's key is another flag's name: `model.config` is not `--config`'s.)
    let (ok, out) = pipetransformer(&[&plan[..], &["--set", "model.config={family=\"vit\"}"]].concat());
    assert!(!ok && out.contains("model.config") && !out.contains("is the setting"), "{out}");
    // A policy given as something other than a string is refused with the policies' names.
    for value in ["true", "3"] {
        let (ok, out) = pipetransformer(&[&plan[..], &["--set", &format!("pipeline.recompute={value}")]].concat());
        let want = "flag `--set pipeline.recompute`: expected a string, one of `off`, `all`, `auto`";
        assert!(!ok && out.contains(want), "{out}");
    }
    let (ok, out) = pipetransformer(&[&plan[..], &["--memory-limit", "10MiB"]].concat());
    assert!(!ok && out.contains("; recomputing activations (--recompute auto, pipeline.recompute) needs "), "{out}");
    let (ok, out) = pipetransformer(&[&limited[..], &["--recompute", "auto"]].concat());
    // (Stage 0's first four units: its fifth's activations fit.)
    assert!(ok && out.contains("| 0 | 0 | 0..4 (5 units") && out.contains("MiB, recomputes units 0..3 |"), "{out}");
    assert_eq!(out.matches(", recomputes").count(), 1, "only the stage that needs it: {out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--recompute", "all"]].concat());
    assert!(ok && out.contains("recomputes units 0..4 |") && out.contains("recomputes units 5..10 |"), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--recompute", "sometimes"]].concat());
    assert!(!ok && out.contains("expected off, all or auto"), "{out}");
    // Over token slices too.
    let (ok, out) = pipetransformer(&[&plan[..], &["--recompute", "all", "--token-slices", "2"]].concat());
    assert!(ok && out.contains("recomputes units 0..4 |") && out.contains(" F0/1.0 "), "{out}");
    // (Every slice printed with its index, the first too.)
    assert!(out.contains("device 0: F0/0.0 F0/1.0 "), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--set", "pipeline.recompute=\"sometimes\""]].concat());
    assert!(!ok && out.contains("pipeline.recompute") && out.contains("expected one of `off`, `all`, `auto`"), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--schedule", "zb-h1", "--recompute", "auto"]].concat());
    assert!(!ok && out.contains("pipeline.recompute") && out.contains("zb-h1 schedule"), "{out}");
}

/// A `train` of the hamlet GPT on 2 cpu devices with `args` after the config, `PT_DEBUG=1`,
/// writing to `dir`, a checkpoint every 2 steps: its output, and what the first device kept
/// for backwards at its last step (MiB, from the debug line).
fn hamlet_train(dir: &Path, args: &[&str]) -> (String, f64) {
    let out_dir = format!("output.dir={}", dir.display());
    let head = ["train", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--progress-every", "0"];
    let tail = ["--set", &out_dir, "--set", "output.checkpoint_every=2"];
    let run = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .env("PT_DEBUG", "1")
        .args([&head[..], args, &tail[..]].concat())
        .output()
        .unwrap();
    let out = output_text(&run);
    assert!(run.status.success(), "{out}");
    let line = out.lines().rfind(|l| l.contains("activations kept at most")).expect("a step's debug line");
    let kept = line.split("at most ").nth(1).and_then(|t| t.split(',').next()).unwrap().parse().unwrap();
    (out, kept)
}

/// A given token-slice list and schedule come back when AutoPipe lengthens a pipeline it had
/// shortened to one stage (which runs 1F1B, whole), even where a second freeze prices the
/// longer shape while one stage is in force; both changes are logged.
#[test]
fn a_given_slicing_comes_back_with_a_longer_pipeline() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("given-slices-back");
    let out_dir = format!("output.dir={}", dir.display());
    let tiny = ["model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2", "data.max_len=32"];
    let data = ["data.batch_size=4", "data.train_limit=16", "data.test_limit=8", "train.max_steps=40"];
    let mut args = vec!["train", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--fresh"];
    for set in tiny.iter().chain(&data).chain([&out_dir.as_str(), &"elastic.table=[1, 2]"]) {
        args.extend(["--set", set]);
    }
    args.extend(["--freeze", "table", "--freeze-interval", "3", "--auto-pipe", "--auto-dp", "--progress-every", "0"]);
    args.extend(["--micro-batches", "2", "--schedule", "gpipe", "--token-slices", "5,27"]);
    let (ok, out) = pipetransformer(&args);
    assert!(ok, "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let transitions: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["event"] == "transition")
        .collect();
    let reasons = |from: u64, to: u64| -> Vec<String> {
        transitions
            .iter()
            .filter(|v| v["pipeline_len"] == serde_json::json!([from, to]))
            .map(|v| v["reason"].as_str().unwrap().to_string())
            .collect()
    };
    let shorter = reasons(2, 1);
    assert!(
        shorter.iter().any(|r| r.contains("schedule gpipe → 1f1b (one stage); token slices 5,27 → none")),
        "{shorter:?}"
    );
    let longer = reasons(1, 2);
    assert!(!longer.is_empty(), "the trial lengthens the pipeline again: {transitions:?}");
    for r in &longer {
        assert!(r.contains("schedule 1f1b → gpipe; token slices none → 5,27"), "{r}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let plan = &summary["final_plan"];
    if plan["pipeline_len"] == 2 {
        assert_eq!(
            (&plan["schedule"], &plan["token_slices"]),
            (&serde_json::json!("gpipe"), &serde_json::json!([5, 27]))
        );
    }
}

/// A run whose stages recompute their activations logs the loss and gradient norm of the run
/// that keeps them, to the bit, at every step, through a freeze that moves the frozen boundary
/// into the first stage (dropout on; the transition names the units that recompute), and its
/// first device keeps less for its backwards.
#[test]
fn a_run_that_recomputes_trains_to_the_bit_through_a_freeze() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("recompute");
    let steps = |recompute: &str| {
        let freeze = ["--freeze", "table", "--set", "elastic.table=[0,1]", "--freeze-interval", "4"];
        let fixed = ["--auto-pipe", "false", "--auto-dp", "false", "--cache", "false"];
        let run = ["--micro-batches", "2", "--recompute", recompute, "--set", "train.max_steps=8", "--fresh"];
        let (_, kept) = hamlet_train(&dir.join(recompute), &[&freeze[..], &fixed[..], &run[..]].concat());
        let log = std::fs::read_to_string(dir.join(recompute).join("metrics.jsonl")).unwrap();
        let events: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let transitions: Vec<String> =
            events.iter().filter(|v| v["event"] == "transition").map(|v| v["reason"].to_string()).collect();
        let steps: Vec<(u64, u64)> = events
            .iter()
            .filter(|v| v["event"] == "step")
            .map(|v| (v["loss"].as_f64().unwrap().to_bits(), v["grad_norm"].as_f64().unwrap().to_bits()))
            .collect();
        (steps, transitions, kept)
    };
    let (kept, kept_transitions, plain_mib) = steps("off");
    let (again, transitions, again_mib) = steps("all");
    assert_eq!(kept.len(), 8);
    assert_eq!(kept, again, "loss and gradient norm bits, step by step");
    assert!(again_mib < plain_mib, "device 0 kept {again_mib} MiB recomputing, {plain_mib} MiB not");
    assert_eq!(kept_transitions.len(), 1, "{kept_transitions:?}");
    assert!(!kept_transitions[0].contains("recompute"), "{kept_transitions:?}");
    // (Stage 0's units 0..2 are frozen now: its others recompute.)
    assert!(
        transitions[0].contains("activations recomputed by stage 0 units 3..4, stage 1 units 5..10"),
        "{transitions:?}"
    );
}

/// A transition while AutoPipe times micro-batch counts starts its `M x → y` from the count the
/// timing began from, which the transition before left (the log reads as one chain), and names
/// the count in force, a candidate being timed (here M = 2, timed at step 2 after the first
/// interval's M = 1).
#[test]
fn a_transition_during_autopipes_timing_names_the_count_in_force() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let elastic =
        ["--micro-batches", "2", "--freeze", "table", "--set", "elastic.table=[1, 2]", "--freeze-interval", "2"];
    let run = ["--auto-pipe", "--auto-dp", "--set", "train.max_steps=3", "--fresh"];
    let (out, _) = hamlet_train(&scratch("timing-transition"), &[&elastic[..], &run[..]].concat());
    let line = out.lines().find(|l| l.starts_with("transition at step 2:")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("M 1 → 1")
            && line.contains("M=2 ran, a micro-batch count AutoPipe was timing (the M shown is the count kept)"),
        "{line}"
    );
}

/// `plan` plans stages as processes (`--across-processes`) as one process would run them,
/// a device per stage, and says so: the same partition and schedule a launch runs.
#[test]
fn plan_shows_stages_as_processes() {
    if !have_digits() {
        return;
    }
    let plan = ["plan", "--config", "configs/vit-digits.toml", "--micro-batches", "2"];
    // (`--devices 1`, as a launch's process takes it, or left out.)
    let across = ["--across-processes", "--pipeline-len", "2"];
    let (ok, out) = pipetransformer(&[&plan[..], &across[..], &["--devices", "1"]].concat());
    assert!(ok && out.contains("stages as processes: planned on a device per stage"), "{out}");
    let (ok, without) = pipetransformer(&[&plan[..], &across[..]].concat());
    assert!(ok && without == out, "{without}");
    let (ok, local) = pipetransformer(&[&plan[..], &["--pipeline-len", "2"]].concat());
    assert!(ok, "{local}");
    let table = |out: &str| -> Vec<String> { out.lines().filter(|l| l.starts_with("| ")).map(String::from).collect() };
    assert!(table(&out).len() == 3 && table(&out) == table(&local), "{out}\n{local}");
    // Refused as a launch refuses it: no stage count (a launch takes its process count), and
    // what works within one process only.
    let (ok, out) = pipetransformer(&[&plan[..], &["--across-processes"]].concat());
    assert!(!ok && out.contains("needs the stage count, --pipeline-len"), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &across[..], &["--freeze", "table", "--auto-pipe"]].concat());
    assert!(!ok && out.contains("elastic.auto_pipe") && out.contains("works within one process"), "{out}");
}

/// A checkpoint's plan resumes with the run's own `--recompute` (it moves nothing between
/// devices): a run checkpointed keeping its activations goes on recomputing them, and says so
/// (a setting changed, no plan gave way), also over token slices. A refused request (recomputation with zb-h1) loses
/// nothing already written.
#[test]
fn a_checkpoint_resumes_with_the_runs_own_recompute() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("recompute-resume");
    let m4 = ["--micro-batches", "4"];
    let (_, plain) = hamlet_train(&dir, &[&m4[..], &["--set", "train.max_steps=2", "--fresh"]].concat());
    let (out, again) =
        hamlet_train(&dir, &[&m4[..], &["--recompute", "all", "--set", "train.max_steps=4", "--resume"]].concat());
    assert!(out.contains("resumed at step 2") && !out.contains("gives way"), "{out}");
    assert!(
        out.contains("settings changed since the checkpoint, taken from here on: ")
            && out.contains(", pipeline.recompute off → all"),
        "{out}"
    );
    assert!(again < plain, "device 0 kept {again} MiB recomputing, {plain} MiB not");
    let sliced = dir.join("sliced");
    let m2 = ["--micro-batches", "2"];
    let (_, plain) =
        hamlet_train(&sliced, &[&m2[..], &["--token-slices", "2", "--set", "train.max_steps=2", "--fresh"]].concat());
    let (out, again) =
        hamlet_train(&sliced, &[&m2[..], &["--recompute", "all", "--set", "train.max_steps=4", "--resume"]].concat());
    assert!(out.contains("resumed at step 2") && !out.contains("gives way"), "{out}");
    assert!(again < plain, "sliced, device 0 kept {again} MiB recomputing, {plain} MiB not");
    // A refused request loses nothing the runs wrote: the log and checkpoint stay as they were.
    let files = ["metrics.jsonl", "checkpoint.ckpt"].map(|f| std::fs::read(sliced.join(f)).unwrap());
    let dir_set = format!("output.dir={}", sliced.display());
    let refused = ["train", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--recompute", "all"];
    let (ok, out) = pipetransformer(&[&refused[..], &["--schedule", "zb-h1", "--set", &dir_set, "--fresh"]].concat());
    assert!(!ok && out.contains("pipeline.recompute") && out.contains("zb-h1"), "{out}");
    assert_eq!(files, ["metrics.jsonl", "checkpoint.ckpt"].map(|f| std::fs::read(sliced.join(f)).unwrap()));
    assert!(!sliced.join("metrics.previous.jsonl").exists());
}

/// `evaluate --threads` is the config's `output.threads`: the count warned about is the one
/// used, not a config's value the flag replaces.
#[test]
fn evaluate_threads_is_the_configs_thread_count() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let many = format!("{}", cores + 1);
    let evaluate = ["evaluate", "--model", "no-such-model", "--config", "configs/vit-digits.toml"];
    let (_, out) =
        pipetransformer(&[&evaluate[..], &["--set", &format!("output.threads={many}"), "--threads", "1"]].concat());
    assert!(!out.contains("output.threads"), "{out}");
    let (_, out) = pipetransformer(&[&evaluate[..], &["--threads", &many]].concat());
    assert!(out.contains(&format!("output.threads = {many}, but this machine has {cores} cores")), "{out}");
}

#[test]
fn diagnostic_commands_reject_zero_counts() {
    // Usage errors, as clap's own: exit status 2, the subcommand's usage line.
    for (args, flag) in
        [(&["overfit", "--steps", "0"][..], "--steps <STEPS>"), (&["bench-step", "--batch", "0"], "--batch <BATCH>")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(args).output().unwrap();
        let text = output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(text.contains(&format!("invalid value '0' for '{flag}': must be at least 1")), "{text}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(["predict", "--model", "m", "--temperature", "-1", "a"])
        .output()
        .unwrap();
    let text = output_text(&out);
    assert!(out.status.code() == Some(2) && text.contains("Usage: pipetransformer predict"), "{text}");
    let (ok, out) = pipetransformer(&["overfit", "--model", "resnet"]);
    assert!(!ok && out.contains("resnet"), "{out}");
    // Sizes past the model or the machine are refused before anything is allocated.
    for (args, says) in [
        (&["bench-step", "--seq", "513"][..], "holds 512 positions"),
        (&["bench-step", "--batch", "4611686018427387904", "--seq", "4"][..], "at most 1048576 tokens"),
        (&["evaluate", "--model", "m", "--file", "rows.csv", "--batch-size", "0"][..], "must be at least 1"),
    ] {
        let (ok, out) = pipetransformer(args);
        assert!(!ok && out.contains(says) && !out.contains("panicked"), "{args:?}: {out}");
    }
    // The largest seed is a seed (its batch's is the next, wrapping), not an overflow.
    let (ok, out) = pipetransformer(&["overfit", "--steps", "1", "--seed", "18446744073709551615"]);
    assert!(ok && !out.contains("panicked"), "{out}");
}

#[test]
fn device_choices_are_checked_with_clear_errors() {
    if !pipetransformer::device::cuda::available() {
        let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--device", "cuda"]);
        assert!(!ok && out.contains("no CUDA driver") && out.contains("--device cuda-emu"), "{out}");
    }
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--device", "tpu"]);
    assert!(!ok && out.contains("expected auto, cpu, cuda or cuda-emu"), "{out}");
    // bf16 on cpu: bf16 products, f32 everything else (tests/cpu_bf16.rs).
    let (ok, out) = pipetransformer(&["overfit", "--device", "cpu", "--precision", "bf16", "--steps", "1"]);
    assert!(ok, "{out}");
    // `--threads` is refused past 4096 by every command, as `output.threads` is, and warned of
    // beyond the cores: only they are used.
    let model = ["--model", "/nonexistent"];
    for command in [&["train", "--config", "configs/vit-digits.toml"][..], &["overfit"], &["bench-step"]]
        .into_iter()
        .chain([&["predict", model[0], model[1], "x"][..], &["evaluate", model[0], model[1], "--file", "-"]])
    {
        let (ok, out) = pipetransformer(&[command, &["--threads", "1000000"]].concat());
        assert!(!ok && out.contains("'--threads <THREADS>': 1000000 threads; expected at most 4096"), "{out}");
    }
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--set", "output.threads=5000"]);
    assert!(!ok && out.contains("output.threads") && out.contains("at most 4096"), "{out}");
    let beyond = (std::thread::available_parallelism().unwrap().get() + 1).to_string();
    for command in [["predict", model[0], model[1], "x"], ["evaluate", model[0], model[1], "--file=-"]] {
        let (ok, out) = pipetransformer(&[&command[..], &["--threads", &beyond]].concat());
        let warned = format!("warning: --threads {beyond}, but this machine has");
        assert!(!ok && out.contains(&warned) && out.contains("loading the model"), "{out}");
    }
    if have_digits() {
        let dir = scratch("threads");
        let out_dir = format!("output.dir={}", dir.display());
        let args = ["train", "--config", "configs/vit-digits.toml", "--threads", "1", "--set", &out_dir];
        let (ok, out) =
            pipetransformer(&[&args[..], &["--set", "train.max_steps=1", "--set", "data.test_limit=32"]].concat());
        assert!(ok && out.contains("on cpu:0 (F32, 1 thread)"), "{out}");
    }
}

/// `train … > log` from a terminal: stdout is a file, stderr still a terminal. Every line the
/// run prints (progress, each epoch's evaluation) goes to stdout, and the bar, drawn on stdout,
/// stays hidden there: the log holds a progress line per step and the epoch's result.
#[test]
fn output_redirected_from_a_terminal_keeps_every_line() {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    if !common::installed(&[Path::new("data/digits/digits.csv.gz")]) {
        return;
    }
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors, owned below; no name, termios or size is asked.
    let status =
        unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(status, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are fresh and owned by nothing else.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    // Whatever reaches the terminal is drained (a full pty would block the run).
    let mut terminal = std::fs::File::from(master);
    let drain = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = terminal.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let dir = scratch("redirected");
    let out_dir = format!("output.dir={}", dir.display());
    let small = ["train.max_steps=3", "train.epochs=1", "data.test_limit=32", "data.train_limit=96"];
    let mut args = vec!["train", "--config", "configs/vit-digits.toml", "--fresh", "--progress-every", "0"];
    for s in small.iter().chain([&out_dir.as_str()]) {
        args.extend(["--set", s]);
    }
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(&args)
        .stderr(std::process::Stdio::from(slave))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{log}");
    for step in 1..=3 {
        assert!(log.lines().any(|l| l.starts_with(&format!("step {step}/3 ("))), "step {step} missing: {log}");
    }
    assert!(log.lines().any(|l| l.starts_with("epoch 0: eval")), "no epoch line: {log}");
    drop(drain);
}

/// The default configs train from the command line on the emulated CUDA kernels (small
/// settings: the emulator runs every GPU thread as a fiber).
#[test]
fn train_runs_on_the_emulated_cuda_kernels() {
    if !common::installed(&[Path::new("data/digits/digits.csv.gz"), Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let small = ["--set", "train.max_steps=3", "--set", "train.epochs=1", "--set", "data.test_limit=32"];
    for (config, precision, limit) in
        [("configs/vit-digits.toml", "f32", "96"), ("configs/gpt-hamlet.toml", "bf16", "48")]
    {
        let dir = scratch(&format!("emu-{precision}"));
        let out_dir = format!("output.dir={}", dir.display());
        let limit = format!("data.train_limit={limit}");
        let mut args = vec!["train", "--config", config, "--device", "cuda-emu", "--precision", precision, "--fresh"];
        args.extend(small);
        args.extend(["--progress-every", "0"]);
        args.extend(["--set", &limit, "--set", &out_dir]);
        if config.contains("gpt") {
            // A narrower GPT keeps the emulated run short.
            args.extend([
                "--set",
                "model.config.n_embd=32",
                "--set",
                "model.config.n_layer=1",
                "--set",
                "data.max_len=32",
            ]);
        }
        let (ok, out) = pipetransformer(&args);
        assert!(ok, "{config}: {out}");
        assert!(out.contains("cuda-emu") && out.contains("done: 3 steps"), "{out}");
        // Not a terminal: a progress line per step (every 0 s), with rate and time left.
        for step in 1..=3 {
            let line = format!("step {step}/3 (");
            assert!(out.lines().any(|l| l.starts_with(&line) && l.contains("samples/s") && l.contains("ETA")), "{out}");
        }
        // The metrics that fit the task: F1 for a classifier, perplexity for a language model.
        let last = out.lines().find(|l| l.starts_with("final eval:")).unwrap_or_else(|| panic!("{out}")).to_string();
        let lm = config.contains("gpt");
        assert_eq!((last.contains("perplexity"), last.contains("macro F1")), (lm, !lm), "{last}");
        let last = last.as_str();
        let summary = std::fs::read_to_string(dir.join("summary.json")).unwrap();
        assert!(summary.contains("\"steps\": 3") || summary.contains("\"steps\":3"), "{summary}");
        // The summary names what computed it, precision included.
        let named = if precision == "bf16" { "(Bf16)" } else { "(F32)" };
        assert!(summary.contains("\"devices\"") && summary.contains(named), "{summary}");
        // The final plan by name, not as an unlabelled triple.
        let json: serde_json::Value = serde_json::from_str(&summary).unwrap();
        assert!(json["final_plan"]["pipeline_len"].as_u64().is_some_and(|k| k >= 1), "{summary}");
        check_predict_and_evaluate(&dir, config, precision, last, &args);
    }
}

/// `evaluate` on the run's export gives the run's own final metrics (the same split, the same
/// kernels), and `predict` answers each input with one JSON line, an error line for a bad one
/// (exit status 1, the others still answered).
fn check_predict_and_evaluate(dir: &std::path::Path, config: &str, precision: &str, final_eval: &str, train: &[&str]) {
    let model = dir.display().to_string();
    let device = ["--device", "cuda-emu", "--precision", precision];
    // The training run's overrides (data limits, GPT shape) describe the same split.
    let sets: Vec<&str> = train.windows(2).filter(|w| w[0] == "--set").flat_map(|w| ["--set", w[1]]).collect();
    let (ok, out) =
        pipetransformer(&[&["evaluate", "--model", &model, "--config", config][..], &device, &sets].concat());
    assert!(ok, "{out}");
    let metrics = final_eval.trim_start_matches("final eval: ");
    assert!(out.lines().next().is_some_and(|l| l.ends_with(metrics)), "evaluate: {out}\nrun: {final_eval}");
    assert!(!out.contains("note:"), "the run's own settings: {out}");
    if config.contains("gpt") {
        // Windows of another length (the run's: 32): scored, with a note that says so; one
        // past the position table: refused by the setting, before any is scored.
        let other = [&["evaluate", "--model", &model, "--config", config][..], &device, &sets].concat();
        let (ok, out) = pipetransformer(&[&other[..], &["--set", "data.max_len=16"]].concat());
        assert!(ok && out.contains("note: data.max_len is 16 here, 32 in the model's run"), "{out}");
        let (ok, out) = pipetransformer(&[&other[..], &["--set", "data.max_len=200"]].concat());
        assert!(!ok && out.contains("`data.max_len`: 200 tokens; the model's position table holds 128"), "{out}");
        assert!(!out.contains("note:"), "{out}");
    }
    // Another split of the same data would hold samples the model trained on: refused.
    if !config.contains("gpt") {
        let other = [&["evaluate", "--model", &model, "--config", config][..], &device, &sets].concat();
        let (ok, out) = pipetransformer(&[&other[..], &["--set", "data.split_seed=5"]].concat());
        assert!(!ok && out.contains("data.split_seed = 0 (here 5)") && out.contains("samples it trained on"), "{out}");
    }
    assert!(out.contains(&format!("({})", if precision == "bf16" { "Bf16" } else { "F32" })), "{out}");
    if precision == "bf16" {
        // Without --precision, in the config's `output.precision`: bf16 named there, f32 not.
        let emu = ["--device", "cuda-emu"];
        let in_config = [&["evaluate", "--model", &model, "--config", config][..], &emu, &sets].concat();
        let (ok, out) = pipetransformer(&[&in_config[..], &["--set", "output.precision=bf16"]].concat());
        assert!(ok && out.lines().next().is_some_and(|l| l.ends_with(metrics)), "evaluate: {out}\nrun: {final_eval}");
        assert!(out.contains("(Bf16)"), "{out}");
        let (ok, out) = pipetransformer(&in_config);
        assert!(ok && out.contains("(F32)"), "{out}");
    }

    if config.contains("gpt") {
        let greedy = ["predict", "--model", &model, "--max-new-tokens", "5", "--temperature", "0", "To be"];
        let (ok, first) = pipetransformer(&[&greedy[..], &device].concat());
        assert!(ok, "{first}");
        let v: serde_json::Value = serde_json::from_str(first.trim()).unwrap_or_else(|e| panic!("{e}: {first}"));
        assert_eq!((v["input"].as_str(), v["generated"].as_str().map(|g| g.chars().count())), (Some("To be"), Some(5)));
        let (_, again) = pipetransformer(&[&greedy[..], &device].concat());
        assert_eq!(first, again, "greedy generation is deterministic");
        // An empty PT_EMU_LIBRARY is unset (`dlopen("")` would load the program itself).
        let mut unset = Command::new(env!("CARGO_BIN_EXE_pipetransformer"));
        let unset = unset.args([&greedy[..], &device].concat()).env("PT_EMU_LIBRARY", "").output().unwrap();
        assert_eq!(output_text(&unset), first);
        let (ok, out) = pipetransformer(&[&["predict", "--model", &model, "To be", "\u{263a}"][..], &device].concat());
        assert!(!ok && out.contains("not in the model's vocabulary") && out.contains("1 of 2 results failed"), "{out}");
    } else {
        let text = String::from_utf8(
            std::process::Command::new("gzip").args(["-dc", "data/digits/digits.csv.gz"]).output().unwrap().stdout,
        )
        .unwrap();
        let row = text.lines().next().unwrap();
        let pixels = &row[..row.rfind(',').unwrap()];
        let (ok, out) =
            pipetransformer(&[&["predict", "--model", &model, pixels, "1,2,3", pixels][..], &device].concat());
        assert!(!ok && out.contains("1 of 3 results failed"), "{out}");
        let lines: Vec<serde_json::Value> =
            out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[1]["error"].as_str().is_some_and(|e| e.contains("expected 1×8×8 = 64 pixels")), "{out}");
        for v in [&lines[0], &lines[2]] {
            let p = v["probabilities"].as_object().unwrap();
            assert_eq!(p.len(), 10);
            let sum: f64 = p.values().map(|x| x.as_f64().unwrap()).sum();
            assert!((sum - 1.0).abs() < 1e-9 && p[v["label"].as_str().unwrap()] == v["probability"], "{v}");
        }
        assert_eq!(lines[0], lines[2], "the same input, the same answer");
        // Labelled rows with a label the model lacks: refused by line, nothing panics.
        let rows = dir.join("rows.csv");
        std::fs::write(&rows, format!("{pixels},3\n{pixels},ten\n")).unwrap();
        let rows_arg = rows.display().to_string();
        let (ok, out) = pipetransformer(&[&["evaluate", "--model", &model, "--file", &rows_arg][..], &device].concat());
        assert!(!ok && out.contains("line 2") && out.contains("`ten` is not one of the model's classes"), "{out}");
        assert!(out.contains("nor an index 0..=9"), "{out}");
        assert!(!out.contains("panicked"), "{out}");
        // The run's checkpoint (its last step, like the export) answers the same.
        let ckpt = dir.join("checkpoint.ckpt").display().to_string();
        let (ok, out) = pipetransformer(&[&["predict", "--model", &ckpt, pixels][..], &device].concat());
        assert!(ok, "{out}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(out.trim()).unwrap(), lines[0]);
        // Image files are told apart by their bytes, not their names: a PGM under a folder
        // named `idx`, and IDX images (two of 8 × 8) in a file whose name does not say so.
        let files = dir.join("idx");
        std::fs::create_dir_all(&files).unwrap();
        let mut pgm = b"P5\n8 8\n255\n".to_vec();
        pgm.extend((0..64).map(|i| (i * 4) as u8));
        std::fs::write(files.join("seven.pgm"), pgm).unwrap();
        let mut idx = vec![0, 0, 8, 3];
        for d in [2u32, 8, 8] {
            idx.extend(d.to_be_bytes());
        }
        idx.extend((0..128).map(|i| (i * 2) as u8));
        std::fs::write(files.join("two.bin"), idx).unwrap();
        let (pgm, idx) = (files.join("seven.pgm").display().to_string(), files.join("two.bin").display().to_string());
        let (ok, out) = pipetransformer(&[&["predict", "--model", &model, &pgm, &idx][..], &device].concat());
        assert!(ok && out.lines().filter(|l| l.contains("\"probability\"")).count() == 3, "{out}");
        // A line that is not UTF-8 fails alone, named by its number; the lines after it go on.
        let inputs = dir.join("inputs.txt");
        std::fs::write(
            &inputs,
            [pixels.as_bytes(), b"\n", pixels.as_bytes(), b"\ncaf\xe9\n", pixels.as_bytes()].concat(),
        )
        .unwrap();
        let inputs = inputs.display().to_string();
        let (ok, out) = pipetransformer(&[&["predict", "--model", &model, "--file", &inputs][..], &device].concat());
        let lines = json_lines(&out);
        assert!(!ok && lines.len() == 4 && out.contains("1 of 4 results failed"), "{out}");
        assert!(lines[2]["input"].as_str().is_some_and(|i| i.ends_with("inputs.txt:3")), "{out}");
        assert!(lines[2]["error"].as_str().is_some_and(|e| e.contains("not valid UTF-8")), "{out}");
        assert_eq!(lines[3]["probabilities"], lines[0]["probabilities"], "{out}");
        // No input at all (standard input empty) is not a failure, but it is said.
        let (ok, out) = pipetransformer(&[&["predict", "--model", &model][..], &device].concat());
        assert!(ok && out.contains("no inputs: standard input held none"), "{out}");
        // An export whose last weight is NaN (a flipped byte: safetensors has no checksum)
        // answers with an error, not class 0 at a `null` probability.
        let damaged = dir.join("damaged");
        std::fs::create_dir_all(&damaged).unwrap();
        for entry in std::fs::read_dir(dir.join("model")).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, damaged.join(path.file_name().unwrap())).unwrap();
        }
        let mut weights = std::fs::read(damaged.join("model.safetensors")).unwrap();
        let n = weights.len();
        weights[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(damaged.join("model.safetensors"), weights).unwrap();
        let damaged = damaged.display().to_string();
        let (ok, out) = pipetransformer(&[&["predict", "--model", &damaged, pixels][..], &device].concat());
        assert!(!ok && out.contains("not finite") && !out.contains("null"), "{out}");
    }
}

fn have_digits() -> bool {
    common::installed(&[Path::new("data/digits/digits.csv.gz")])
}

/// A model larger than the machine's memory is refused with the sizes before it is built,
/// where the kernel killed the process mid-build, saying nothing.
#[test]
fn a_model_larger_than_memory_is_refused_before_it_is_built() {
    if !Path::new("/proc/meminfo").exists() || !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let (ok, out) =
        pipetransformer(&["plan", "--config", "configs/gpt-hamlet.toml", "--set", "model.config.n_layer=100000"]);
    assert!(!ok && out.contains("model.config") && out.contains("parameters, which take"), "{out}");
    assert!(out.contains("GiB of memory: give a smaller one"), "{out}");
}

/// `plan` shows what the first step runs: a freeze table whose first entry freezes a layer
/// does so before it (and AutoPipe reshapes), as `train` does.
#[test]
fn plan_shows_the_freeze_before_the_first_step() {
    if !have_digits() {
        return;
    }
    let args = ["plan", "--config", "configs/vit-digits.toml", "--devices", "2", "--freeze", "table"];
    let (ok, out) =
        pipetransformer(&[&args[..], &["--set", "elastic.table=[1,2]", "--auto-pipe", "--auto-dp"]].concat());
    assert!(ok && out.contains("before the first step: transition at step 0: 0 → 1 frozen layers, K 2 → 1"), "{out}");
    assert!(out.contains("plan: 2 replicas × 1 device"), "{out}");
    let (ok, out) =
        pipetransformer(&[&args[..], &["--set", "elastic.table=[0,2]", "--auto-pipe", "--auto-dp"]].concat());
    assert!(ok && !out.contains("before the first step") && out.contains("plan: 1 replica × 2 devices"), "{out}");
}

#[test]
fn plan_prints_the_partition_schedule_and_bubble_and_refuses_bad_requests() {
    if !have_digits() {
        return;
    }
    let (ok, out) =
        pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--devices", "3", "--micro-batches", "4"]);
    assert!(ok, "{out}");
    assert!(out.contains("1 replica × 3 devices, 4 micro-batches"), "{out}");
    assert!(
        out.contains("| 2 | 2 |") && out.contains("predicted bubble") && out.contains("device 2: F0.2 B0.2"),
        "{out}"
    );
    let (ok, out) =
        pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--devices", "2", "--replicas", "3"]);
    assert!(!ok && out.contains("need 3 devices; 2 available"), "{out}");
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--devices", "9"]);
    assert!(!ok && out.contains("7 active units"), "{out}");
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--schedule", "zigzag"]);
    assert!(!ok && out.contains("expected gpipe, 1f1b, interleaved or zb-h1"), "{out}");
    // Zero bubble lists each backward's put-off weight gradients (`W`) on its device.
    let (ok, out) =
        pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--devices", "2", "--schedule", "zb-h1"]);
    assert!(ok && out.contains("schedule zb-h1") && out.contains("B0.1 W0.1"), "{out}");
    // ...and refuses what it does not run, naming the setting.
    let zb = ["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--schedule", "zb-h1"];
    let (ok, out) = pipetransformer(&[&zb[..], &["--token-slices", "4"]].concat());
    assert!(!ok && out.contains("token_slices") && out.contains("does not run token slices"), "{out}");
    let (ok, out) = pipetransformer(&[&zb[..], &["--chunks", "2"]].concat());
    assert!(!ok && out.contains("zb-h1 runs one chunk per device"), "{out}");
    // The elastic switches are checked as `train` checks them.
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--freeze", "eq1", "--cache"]);
    assert!(!ok && out.contains("elastic.cache") && out.contains("needs elastic.auto_pipe"), "{out}");
    // Devices beyond the plan that AutoDP holds for later are said to wait, and for what.
    let elastic = ["--freeze", "alpha", "--auto-pipe", "--auto-dp", "--devices", "4", "--pipeline-len", "2"];
    let (ok, out) = pipetransformer(&[&["plan", "--config", "configs/vit-digits.toml"][..], &elastic].concat());
    assert!(ok && out.contains("2 more devices wait for AutoDP") && out.contains("they become replicas"), "{out}");
    let threads = ["--freed-devices", "threads"];
    let (ok, out) =
        pipetransformer(&[&["plan", "--config", "configs/vit-digits.toml"][..], &elastic, &threads].concat());
    assert!(ok && out.contains("they lend their threads"), "{out}");
    // A model that is not causal is named as the reason token slices are refused, before the
    // cache beside them (which would send the user to turn the cache off for nothing).
    let (ok, out) = pipetransformer(
        &[&["plan", "--config", "configs/vit-digits.toml", "--token-slices", "4", "--cache"][..], &elastic[..6]]
            .concat(),
    );
    assert!(!ok && out.contains("needs a causal language model") && !out.contains("elastic.cache"), "{out}");
    // On a causal model the cache is what stands in the way.
    let (ok, out) = pipetransformer(
        &[&["plan", "--config", "configs/gpt-hamlet.toml", "--token-slices", "4", "--cache"][..], &elastic[..6]]
            .concat(),
    );
    assert!(!ok && out.contains("pipeline.token_slices") && out.contains("elastic.cache"), "{out}");
    // A pooling no head takes is refused, not silently dropped.
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--set", "model.pooling=mean"]);
    assert!(!ok && out.contains("model.pooling") && out.contains("builds a ViT"), "{out}");
}

#[test]
fn pipelined_train_follows_one_device_and_writes_a_chrome_trace() {
    if !have_digits() {
        return;
    }
    let steps = ["--set", "train.max_steps=6", "--set", "train.epochs=1", "--set", "data.test_limit=64", "--fresh"];
    let single = scratch("single");
    let single_dir = format!("output.dir={}", single.display());
    let mut args = vec!["train", "--config", "configs/vit-digits.toml", "--set", &single_dir];
    args.extend(steps);
    let (ok, out) = pipetransformer(&args);
    assert!(ok, "{out}");
    let piped = scratch("piped");
    let piped_dir = format!("output.dir={}", piped.display());
    // In a folder that does not exist yet: it is made, as the run's output folder is.
    let trace = piped.join("traces").join("trace.json");
    let trace_arg = trace.display().to_string();
    let mut args = vec!["train", "--config", "configs/vit-digits.toml", "--set", &piped_dir, "--devices", "4"];
    args.extend([
        "--pipeline-len",
        "2",
        "--replicas",
        "2",
        "--micro-batches",
        "2",
        "--schedule",
        "gpipe",
        "--trace",
        &trace_arg,
    ]);
    args.extend(steps);
    let (ok, out) = pipetransformer(&args);
    assert!(ok, "{out}");
    assert!(out.contains("plan: 2 replicas × 2 devices"), "{out}");
    let last_step = |dir: &std::path::Path| -> serde_json::Value {
        let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        log.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .rfind(|v| v["event"] == "step")
            .unwrap()
    };
    let (a, b) = (last_step(&single), last_step(&piped));
    let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
    assert!((la - lb).abs() <= 1e-5 * la, "loss {lb} pipelined vs {la} on one device");
    assert!(b["bubble"]["measured"].as_f64().unwrap() > 0.0 && b["bubble"]["formula"].as_f64().unwrap() > 0.0, "{b}");
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let rows: std::collections::BTreeSet<u64> =
        events.iter().filter(|e| e["ph"] == "X").map(|e| e["tid"].as_u64().unwrap()).collect();
    assert_eq!(rows.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3], "one row per device");
    assert!(events.iter().any(|e| e["cat"] == "backward") && events.iter().any(|e| e["cat"] == "comm"));
}

/// `PT_DEBUG=2` prints, per epoch, the time each op took on the cpu devices: the steps' table
/// holds the backward and AdamW, the evaluation's only forwards.
#[test]
fn pt_debug_2_prints_the_time_per_op() {
    if !have_digits() {
        return;
    }
    let dir = scratch("op-times");
    let out_dir = format!("output.dir={}", dir.display());
    let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--fresh", "--devices", "2"];
    let more = ["--set", "train.max_steps=2", "--set", "train.epochs=1", "--set", "data.test_limit=64"];
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(args.iter().chain(&more))
        .env("PT_DEBUG", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    let table = |title: &str| -> Vec<String> {
        let start = err.find(title).unwrap_or_else(|| panic!("no table `{title}` in:\n{err}"));
        err[start..].lines().skip(1).take_while(|l| !l.trim_start().starts_with("total")).map(str::to_owned).collect()
    };
    let (steps, eval) = (table("op times, epoch 0's steps"), table("op times, epoch 0's evaluation"));
    let has = |rows: &[String], op: &str| rows.iter().any(|r| r.split_whitespace().next() == Some(op));
    for op in ["linear_forward", "linear_backward", "attention_backward", "adamw_update_live"] {
        assert!(has(&steps, op), "{op} missing from the steps' table: {steps:#?}");
    }
    assert!(
        has(&eval, "linear_forward") && !has(&eval, "linear_backward") && !has(&eval, "adamw_update_live"),
        "{eval:#?}"
    );
    let (ok, quiet) = pipetransformer(&[&args[..], &more[..]].concat());
    assert!(ok && !quiet.contains("op times"), "without PT_DEBUG nothing is timed: {quiet}");
}

#[test]
fn bad_pipeline_settings_and_an_unwritable_trace_are_clear_errors() {
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--set", "pipeline.bogus=1"]);
    assert!(!ok && out.contains("bogus"), "{out}");
    let (ok, out) =
        pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--set", "pipeline.micro_batches=0"]);
    assert!(!ok && out.contains("micro_batches"), "{out}");
    // Flags are called flags; settings the pipeline and the model refuse are named by the keys
    // the config writes, not by the library's struct fields.
    let (ok, out) = pipetransformer(&["launch", "--nproc-per-node", "0", "--", "train"]);
    assert!(!ok && out.contains("flag `--nproc-per-node`: is 0"), "{out}");
    let (ok, out) = pipetransformer(&["overfit", "--lr", "nan"]);
    assert!(!ok && out.contains("`nan` is not a learning rate"), "{out}");
    if !have_digits() {
        return;
    }
    for (set, key) in [
        ("pipeline.chunks=2", "config field `pipeline.chunks`"),
        ("model.config.hidden_dropout_prob=2.0", "config field `model.config.hidden_dropout_prob`"),
    ] {
        let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--set", set]);
        assert!(!ok && out.contains(key), "{out}");
    }
    // More devices than units, with no pipeline length written: the length they made is said
    // to come from them; a length written needs no such word.
    let many = ["plan", "--config", "configs/vit-digits.toml", "--devices", "64"];
    let (ok, out) = pipetransformer(&many);
    let said = "(pipeline.pipeline_len is not set, so it is pipeline.devices over the replicas: give --pipeline-len";
    assert!(!ok && out.contains("cannot be cut from the model's") && out.contains(said), "{out}");
    let (ok, out) = pipetransformer(&[&many[..], &["--pipeline-len", "64"]].concat());
    assert!(!ok && out.contains("cannot be cut from the model's") && !out.contains(said), "{out}");
    // A trace whose folder cannot be made (a file is in the way) is refused before the run
    // starts: nothing written.
    let dir = scratch("trace-fail");
    let out_dir = format!("output.dir={}", dir.display());
    let blocked = scratch("trace-blocked");
    std::fs::write(blocked.join("file"), b"").unwrap();
    let trace = blocked.join("file").join("trace.json").display().to_string();
    let (ok, out) = pipetransformer(&[
        "train",
        "--config",
        "configs/vit-digits.toml",
        "--set",
        &out_dir,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.epochs=1",
        "--set",
        "data.test_limit=32",
        "--fresh",
        "--devices",
        "2",
        "--pipeline-len",
        "2",
        "--trace",
        &trace,
    ]);
    assert!(
        !ok && out.contains("--trace") && out.contains("trace-blocked") && out.contains("/file is not a folder"),
        "{out}"
    );
    assert!(!out.contains("done:") && std::fs::read_dir(&dir).unwrap().next().is_none(), "{out}");
}

/// A run that starts over and diverges at its second step (its first set the earlier run's
/// files aside) says which step, counted as its progress lines count them; its folder holds
/// its own log and the report drawn from it alone, the earlier run's files whole under their
/// `previous` names, and a `--resume` there names the checkpoint set aside.
#[test]
fn a_fresh_run_that_diverges_after_its_first_step_leaves_its_folder_consistent() {
    if !have_digits() {
        return;
    }
    let dir = scratch("diverged");
    let Some(config) = common::earlier_run(&dir) else { return };
    let before = common::run_files(&dir);
    let out_dir = format!("output.dir={}", dir.display());
    let base = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "data.train_limit=64"];
    let wild = ["--set", "data.test_limit=32", "--set", "train.lr=1e30", "--set", "train.max_grad_norm=0"];
    let (ok, out) = pipetransformer(&[&base[..], &wild, &["--fresh", "--progress-every", "0"]].concat());
    let said = out.lines().filter(|l| l.starts_with("step ")).count();
    assert!(!ok && said >= 1, "{out}");
    assert!(out.contains(&format!("the loss became NaN at step {}", said + 1)), "{said} steps said: {out}");
    for (file, aside) in common::RUN_FILES.iter().zip(common::SET_ASIDE) {
        let kept = before[common::RUN_FILES.iter().position(|f| f == file).unwrap()].clone();
        assert_eq!(std::fs::read(dir.join(aside)).unwrap(), kept, "{aside}");
        assert!(
            ["metrics.jsonl", "report.html"].contains(file) || !dir.join(file).exists(),
            "{file}: the earlier run's, left beside the new log"
        );
    }
    // The report is this run's: its loss curve ends at the last step it logged.
    let report = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(report.contains(&format!(">step {said}</text>")), "{said} steps said: {report}");
    let (ok, out) = pipetransformer(&[&base[..], &["--resume"]].concat());
    let back = "move each back to its own name (metrics.previous.jsonl → metrics.jsonl, checkpoint.previous.ckpt → \
                checkpoint.ckpt, summary.previous.json → summary.json, report.previous.html → report.html, \
                model.previous → model)";
    assert!(!ok && out.contains("no checkpoint to resume from") && out.contains(back), "{out}");
    drop(config);
}

/// A trace path that names the run's config file or a file the run writes in its folder (its
/// checkpoint, through `..` too) is refused before the run starts, both left as they were;
/// another file in the run's folder is the user's to name.
#[test]
fn a_trace_over_the_runs_own_files_is_refused() {
    if !have_digits() {
        return;
    }
    let dir = scratch("trace-own-files");
    let config = dir.join("run.toml");
    let digits = std::fs::read_to_string("configs/vit-digits.toml").unwrap();
    let text = digits.replace("dir = \"runs/vit-digits\"", &format!("dir = {:?}", dir.join("run")));
    std::fs::write(&config, &text).unwrap();
    let train = |trace: &Path| {
        let (config, trace) = (config.display().to_string(), trace.display().to_string());
        let short = ["--set", "data.train_limit=32", "--set", "data.test_limit=16", "--set", "train.max_steps=1"];
        pipetransformer(&[&["train", "--config", &config][..], &short, &["--fresh", "--trace", &trace]].concat())
    };
    let (ok, out) = train(&dir.join("elsewhere.json"));
    assert!(ok, "{out}");
    let ckpt = std::fs::read(dir.join("run/checkpoint.ckpt")).unwrap();
    for (trace, says) in [
        (config.clone(), "is the run's config file (--config)"),
        (dir.join("run/../run/checkpoint.ckpt"), "is where the run writes its own checkpoint.ckpt"),
        (dir.join("run/model/trace.json"), "is where the run writes its own model"),
    ] {
        let (ok, out) = train(&trace);
        assert!(!ok && out.contains("--trace") && out.contains(says), "{}: {out}", trace.display());
        assert!(!out.contains("done:"), "{out}");
    }
    assert_eq!(std::fs::read_to_string(&config).unwrap(), text);
    assert_eq!(std::fs::read(dir.join("run/checkpoint.ckpt")).unwrap(), ckpt);
    let (ok, out) = train(&dir.join("run/trace.json"));
    assert!(ok && out.contains("wrote the Chrome trace"), "{out}");
}

/// A run's folder holds one run at a time and one run's log: an empty `output.dir` is refused,
/// a run that starts over moves the earlier log aside (at its first step: one that fails sooner
/// loses nothing), a resumed one continues it (and says how many steps it took itself), and a
/// second run is refused while another holds the folder.
#[test]
fn a_run_folder_holds_one_run_and_its_log() {
    if !have_digits() {
        return;
    }
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--set", "output.dir=\"\""]);
    assert!(!ok && out.contains("output.dir") && out.contains("is empty"), "{out}");
    let dir = scratch("one-run");
    let out_dir = format!("output.dir={}", dir.display());
    let train = |steps: &str, flag: &str| {
        let steps = format!("train.max_steps={steps}");
        let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", &steps];
        pipetransformer(&[&args[..], &["--set", "data.test_limit=32", flag]].concat())
    };
    let starts = |file: &str| {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        text.lines().filter(|l| l.contains("\"start\"")).map(|l| l.contains("\"resumed\":true")).collect::<Vec<_>>()
    };
    let (ok, out) = train("2", "--fresh");
    assert!(ok && !out.contains("note: the earlier run's files"), "{out}");
    let first = std::fs::read(dir.join("checkpoint.ckpt")).unwrap();
    let (ok, out) = train("3", "--fresh");
    assert!(ok && out.contains("move aside under .previous names") && !out.contains("which are lost"), "{out}");
    assert_eq!(starts("metrics.jsonl"), [false], "the log holds the second run alone");
    assert_eq!(starts("metrics.previous.jsonl"), [false], "the first run's log, moved aside");
    // And its checkpoint: a resume continues the second run, or (had it died before its
    // first checkpoint) none, never the first under the second's log.
    assert_eq!(std::fs::read(dir.join("checkpoint.previous.ckpt")).unwrap(), first);
    let steps = |file: &str| {
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        summary["steps"].as_u64()
    };
    assert_eq!((steps("summary.json"), steps("summary.previous.json")), (Some(3), Some(2)), "each run's own summary");
    assert!(dir.join("report.previous.html").is_file() && dir.join("model.previous/model.safetensors").is_file());
    let (ok, out) = train("5", "--resume");
    assert!(ok && out.contains("done: 5 steps (2 of them since step 3, in"), "{out}");
    assert_eq!(starts("metrics.jsonl"), [false, true], "a resumed run continues the log");
    // Another run holds the folder (here this test, through the same lock): refused, untouched.
    let held = pipetransformer::files::lock_folder(&dir).unwrap();
    let before = std::fs::read(dir.join("checkpoint.ckpt")).unwrap();
    let (ok, out) = train("2", "--fresh");
    let holder = format!("another run (process {}) is writing to this folder", std::process::id());
    assert!(!ok && out.contains(&holder), "{out}");
    // A resume too, before it reads the checkpoint the other run may be writing.
    let (ok, out) = train("6", "--resume");
    assert!(!ok && out.contains(&holder) && !out.contains("resumed at step"), "{out}");
    assert_eq!(std::fs::read(dir.join("checkpoint.ckpt")).unwrap(), before);
    assert_eq!(starts("metrics.jsonl"), [false, true]);
    drop(held);
    // A run that starts over and is refused (a training set of one sample cannot feed two
    // replicas: found as the job is built) loses nothing: the earlier run's log and checkpoint
    // stay where they were, and so do the ones set aside before. (One that fails at its first
    // step: `tests/elastic.rs::a_fresh_run_that_fails_at_its_first_step_loses_nothing`.)
    let files = || {
        ["metrics.jsonl", "checkpoint.ckpt", "metrics.previous.jsonl", "checkpoint.previous.ckpt"]
            .map(|f| std::fs::read(dir.join(f)).unwrap())
    };
    let before = files();
    let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "data.test_limit=32"];
    let one_sample = ["--set", "data.train_limit=1", "--devices", "2", "--replicas", "2", "--fresh"];
    let (ok, out) = pipetransformer(&[&args[..], &one_sample[..]].concat());
    let refused = "a step's batch holds 1 sample, the whole training set (data.train_limit); each of 2 replicas";
    assert!(!ok && out.contains("pipeline.replicas") && out.contains(refused), "{out}");
    // (Said as it starts: had it trained, the run set aside before would have been lost.)
    assert!(out.contains("model.previous, metrics.previous.jsonl), which are lost"), "{out}");
    assert!(files() == before, "{out}");
    let (ok, out) = train("6", "--resume");
    assert!(ok && out.contains("done: 6 steps (1 of them since step 5, in"), "{out}");
    // A log that cannot be written (here every write fails as on a full disk) ends the run,
    // named, once the weights it trained are checkpointed and exported.
    let full = scratch("full-log");
    std::os::unix::fs::symlink("/dev/full", full.join("metrics.jsonl")).unwrap();
    let out_dir = format!("output.dir={}", full.display());
    let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "train.max_steps=2"];
    let (ok, out) = pipetransformer(&[&args[..], &["--set", "data.test_limit=32"]].concat());
    assert!(!ok && out.contains("metrics.jsonl") && out.contains("No space left on device"), "{out}");
    assert!(full.join("checkpoint.ckpt").exists() && full.join("model/model.safetensors").exists(), "{out}");
}

/// Standard output that cannot be written (a full disk; a pipe that `head` closed) does not
/// end a training run: it trains to the end and writes its results. A report's command
/// (`plan`) ends with the failed write named, not a panic.
#[test]
fn a_console_that_cannot_be_written_does_not_end_a_run() {
    if !have_digits() {
        return;
    }
    let full = || std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let bin = env!("CARGO_BIN_EXE_pipetransformer");
    for closed in [false, true] {
        let dir = scratch(if closed { "closed-console" } else { "full-console" });
        let out_dir = format!("output.dir={}", dir.display());
        let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "train.max_steps=2"];
        let mut run = Command::new(bin);
        run.args(args).args(["--set", "data.test_limit=32"]).stderr(std::process::Stdio::piped());
        let out = if closed {
            let mut child = run.stdout(std::process::Stdio::piped()).spawn().unwrap();
            drop(child.stdout.take());
            child.wait_with_output().unwrap()
        } else {
            run.stdout(full()).output().unwrap()
        };
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !err.contains("panicked"), "closed {closed}: {err}");
        assert!(dir.join("summary.json").exists() && dir.join("model/model.safetensors").exists());
    }
    let out = Command::new(bin).args(["plan", "--config", "configs/vit-digits.toml"]).stdout(full()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("writing standard output") && !err.contains("panicked"), "{err}");
}

/// Ctrl-C (or a scheduler's SIGTERM) stops a run after the step under way, with its checkpoint
/// written: the run says where it stopped, and `--resume` goes on from that step.
#[test]
fn an_interrupted_run_checkpoints_and_resumes() {
    use std::time::{Duration, Instant};
    if !have_digits() {
        return;
    }
    let dir = scratch("interrupted");
    let out_dir = format!("output.dir={}", dir.display());
    let long = ["--set", "train.max_steps=100000000", "--set", "train.epochs=1000000", "--set", "data.test_limit=16"];
    let args = ["train", "--config", "configs/vit-digits.toml", "--fresh", "--progress-every", "0", "--set", &out_dir];
    let child = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(args).args(long).spawn_piped();
    // Some steps in (the log holds them), then the signal.
    let started = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.matches("\"step\"").count()) < 3 {
        assert!(started.elapsed() < Duration::from_secs(60), "no steps logged");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(130), "{text}");
    let step = interrupted_steps(&text)[0];
    assert!(text.contains("`train --resume` continues from it"), "{text}");
    // The report of the steps taken is written beside the checkpoint: its loss curve ends at
    // the step the run stopped at.
    let report = std::fs::read_to_string(dir.join("report.html")).unwrap_or_else(|e| panic!("no report: {e}\n{text}"));
    assert!(report.contains("<polyline") && report.contains(&format!(">step {step}</text>")), "{report}");
    // Resumed with no step left: the stopped run wrote no summary, this one does (and says
    // so), but no checkpoint.
    let at = format!("train.max_steps={step}");
    let args = ["train", "--config", "configs/vit-digits.toml", "--resume", "--set", &out_dir, "--set", &at];
    let (ok, out) =
        pipetransformer(&[&args[..], &["--set", "data.test_limit=16", "--set", "train.epochs=1000000"]].concat());
    assert!(ok && out.contains("/{metrics.jsonl, summary.json, report.html, model/}"), "{out}");
    let resume = format!("train.max_steps={}", step + 2);
    let args = ["train", "--config", "configs/vit-digits.toml", "--resume", "--set", &out_dir, "--set", &resume];
    let (ok, out) =
        pipetransformer(&[&args[..], &["--set", "data.test_limit=16", "--set", "train.epochs=1000000"]].concat());
    let done = format!("done: {} steps (2 of them since step {step}, in", step + 2);
    assert!(ok && out.contains(&done), "{out}");
    // Resumed again with no step left: it says it wrote what it wrote, not the summary and
    // checkpoint of the steps it follows.
    let summary = std::fs::read(dir.join("summary.json")).unwrap();
    let (ok, out) =
        pipetransformer(&[&args[..], &["--set", "data.test_limit=16", "--set", "train.epochs=1000000"]].concat());
    assert!(ok && out.contains("/{metrics.jsonl, report.html, model/}"), "{out}");
    assert_eq!(std::fs::read(dir.join("summary.json")).unwrap(), summary);
}

/// Kills what is left of the given processes if a test fails (each still runs, or is an
/// unreaped child, then: its pid is not yet anyone else's).
struct Reap(Vec<u32>);

impl Drop for Reap {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

/// The steps named by each "interrupted at step N" in `text`, in order.
fn interrupted_steps(text: &str) -> Vec<u64> {
    let steps: Vec<u64> = text
        .split("interrupted at step ")
        .skip(1)
        .map(|rest| rest.split(':').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{text}")))
        .collect();
    assert!(!steps.is_empty(), "{text}");
    steps
}

/// A signal to one process of a launched run stops them all after the same step, with the
/// checkpoint written (each on its own would stop at a step of its own, or train on until its
/// peer's leaving failed it); the launch ends interrupted, and resumes from that step. Both
/// ways of dividing the work: replicas, and a grid of two pipelines of two stage processes
/// (the stop asked by the last stage of the second, whose vote crosses its column and rows).
#[test]
fn a_signal_to_one_launched_process_stops_them_all_after_one_step() {
    use std::time::{Duration, Instant};
    if !have_digits() {
        return;
    }
    let grid = ["--across-processes", "--pipeline-len", "2"];
    for (processes, layout) in [(2, &[][..]), (4, &grid[..])] {
        let dir = scratch("interrupted-launch");
        let out_dir = format!("output.dir={}", dir.display());
        let (rdzv, n) = (format!("127.0.0.1:{}", free_port()), processes.to_string());
        let launch = ["launch", "--nproc-per-node", &n, "--rdzv", &rdzv, "--", "train", "--config"];
        let small = ["--set", "data.test_limit=16", "--set", "train.epochs=1000000", "--threads", "1"];
        let run = ["configs/vit-digits.toml", "--fresh", "--progress-every", "0", "--set", &out_dir];
        let launcher = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
            .args(launch)
            .args(run)
            .args(small)
            .args(layout)
            .args(["--set", "train.max_steps=100000000"])
            .spawn_piped();
        // (Killed, its processes stop after a step: they take the kernel's SIGTERM as a stop.)
        let mut reap = Reap(vec![launcher.id()]);
        let started = Instant::now();
        while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.matches("\"step\"").count()) < 3 {
            assert!(started.elapsed() < Duration::from_secs(120), "no steps logged");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The last rank, found among the launcher's children by its environment, and only it.
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", launcher.id())).unwrap();
        let rank = format!("RANK={}", processes - 1);
        let last = children
            .split_whitespace()
            .find(|pid| {
                let environ = std::fs::read(format!("/proc/{pid}/environ"));
                environ.is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == rank.as_bytes()))
            })
            .unwrap_or_else(|| panic!("no {rank} among {children}"));
        // SAFETY: a signal to a process this test's launcher started.
        assert_eq!(unsafe { libc::kill(last.parse().unwrap(), libc::SIGINT) }, 0);
        let out = launcher.wait_with_output().unwrap();
        reap.0.clear(); // reaped: its pid may be another's soon
        let text = output_text(&out);
        assert_eq!(out.status.code(), Some(130), "{text}");
        assert!(text.contains("interrupted: every process stopped after the same step"), "{text}");
        let steps = interrupted_steps(&text);
        assert!(steps.len() == processes && steps.iter().all(|&s| s == steps[0]), "{text}");
        let step = steps[0];
        let resume = format!("train.max_steps={}", step + 2);
        let args = ["configs/vit-digits.toml", "--resume", "--set", &out_dir, "--set", &resume];
        let (ok, out) = pipetransformer(&[&launch[..], &args, &small, layout].concat());
        let done = format!("done: {} steps (2 of them since step {step}, in", step + 2);
        assert!(ok && out.contains(&done), "{out}");
    }
}

/// A model that does not fit the dataset (its images, its classes) is refused by its settings
/// before anything trains or is written (the images used to fail at the first step's upload,
/// and a written `num_labels` was silently replaced by the data's).
#[test]
fn a_model_that_does_not_fit_the_data_is_refused_by_its_settings() {
    if !have_digits() {
        return;
    }
    let dir = scratch("image-fit");
    let out_dir = format!("output.dir={}", dir.join("run").display());
    for (set, says) in [
        ("model.config.num_labels=3", "num_labels`: is 3, but digits has 10 classes"),
        (
            "model.config.num_channels=3",
            "num_channels 3 and image_size 8 (3 × 8² values per image), but the images of digits are 1 channel of \
             8×8 (64 values)",
        ),
        ("model.config.image_size=16", "image_size 16 (1 × 16² values per image), but the images of digits are"),
        // As many values in another shape: 4 channels of 4×4 would read the 8×8 images as other pixels.
        ("model.config.num_channels=4", "num_channels 4 and image_size 4 (4 × 4² values per image)"),
    ] {
        let small = ["--set", "model.config.image_size=4"];
        let extra: &[&str] = if set.ends_with("channels=4") { &small } else { &[] };
        let args = ["train", "--config", "configs/vit-digits.toml", "--set", set, "--set", &out_dir];
        let (ok, out) = pipetransformer(&[&args[..], extra].concat());
        assert!(!ok && out.contains("model.config") && out.contains(says), "{out}");
    }
    assert!(!dir.join("run").exists(), "nothing written");
}

/// A user's error is printed as its message and causes, each once, and no backtrace even
/// where `RUST_BACKTRACE` asks for them (this is no crash).
#[test]
fn errors_print_each_cause_once_and_no_backtrace() {
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(["train", "--config", "/nonexistent/run.toml"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.starts_with("Error: the run config /nonexistent/run.toml"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(!err.contains("backtrace") && !err.contains("main.rs"), "{err}");
    // Only `train` joins a launched run: another command would run once per process.
    let (ok, out) = pipetransformer(&["launch", "--nproc-per-node", "2", "--", "predict", "--model", "x"]);
    assert!(!ok && out.contains("launch runs `train` in each process") && out.contains("predict --model x"), "{out}");
    assert!(out.contains("runs on its own"), "{out}");
    let (ok, out) = pipetransformer(&["launch", "--nproc-per-node", "2", "--", "tarin", "--config", "x"]);
    assert!(!ok && out.contains("got `tarin --config x`, which is not a command of this program"), "{out}");
    // A document without the table's markers is refused by its own name, before any compiling.
    let doc = scratch("kernels-doc");
    let path = doc.join("notes.md");
    std::fs::write(&path, "no markers here\n").unwrap();
    let (ok, out) = pipetransformer(&["kernels", "--update", &path.display().to_string()]);
    assert!(!ok && out.contains(&format!("updating {}", path.display())) && out.contains("markers"), "{out}");
    assert!(!out.contains("KERNELS.md` is") && std::fs::read_to_string(&path).unwrap() == "no markers here\n", "{out}");
}

/// 33 samples in batches of 8 leave one for the last batch, which two replicas cannot share:
/// it joins the batch before, so each epoch is 4 steps over every sample.
#[test]
fn an_epoch_whose_last_batch_is_shorter_than_the_replicas_trains_every_sample() {
    if !have_digits() {
        return;
    }
    let dir = scratch("short-last");
    let out_dir = format!("output.dir={}", dir.display());
    let (ok, out) = pipetransformer(&[
        "train",
        "--config",
        "configs/vit-digits.toml",
        "--fresh",
        "--set",
        &out_dir,
        "--devices",
        "2",
        "--replicas",
        "2",
        "--set",
        "data.train_limit=33",
        "--set",
        "data.batch_size=8",
        "--set",
        "train.epochs=2",
        "--set",
        "data.test_limit=32",
    ]);
    assert!(ok, "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["event"] == "step")
        .collect();
    let samples: Vec<u64> = steps.iter().map(|v| v["samples"].as_u64().unwrap()).collect();
    assert_eq!(samples, [8, 8, 8, 9, 8, 8, 8, 9], "{out}");
}

/// A pipeline of two stages on two devices, two micro-batches a step.
const TWO_STAGES_TWO_MICRO_BATCHES: [&str; 6] = ["--devices", "2", "--pipeline-len", "2", "--micro-batches", "2"];

/// A tiny digits run of two steps in a folder of its own, to run `train` in again with more
/// flags.
struct DigitsRun {
    dir: Scratch,
    out_dir: String,
}

impl DigitsRun {
    /// The run's first two steps; `None` without the digits.
    fn start(name: &str) -> Option<DigitsRun> {
        if !have_digits() {
            return None;
        }
        let dir = scratch(name);
        let out_dir = format!("output.dir={}", dir.display());
        let run = DigitsRun { dir, out_dir };
        let (ok, out) = run.train(&["--fresh", "--set", "train.max_steps=2"]);
        assert!(ok, "{out}");
        Some(run)
    }

    /// `train` in the run's folder with `flags`.
    fn train(&self, flags: &[&str]) -> (bool, String) {
        let base =
            ["train", "--config", "configs/vit-digits.toml", "--set", &self.out_dir, "--set", "data.test_limit=32"];
        pipetransformer(&[&base[..], flags].concat())
    }
}

/// A run resumed with shape flags goes on in that shape, and says so; the summary's final
/// plan is that shape.
#[test]
fn a_run_resumed_with_shape_flags_takes_that_shape() {
    let Some(digits) = DigitsRun::start("resume-shape") else { return };
    let (dir, run) = (&digits.dir, |flags: &[&str]| digits.train(flags));
    let (ok, out) = run(&[&["--resume", "--set", "train.max_steps=4"][..], &TWO_STAGES_TWO_MICRO_BATCHES].concat());
    assert!(ok && out.contains("resumed at step 2"), "{out}");
    assert!(out.contains("settings changed since the checkpoint, taken from here on: train.max_steps 2 → 4"), "{out}");
    assert!(
        out.contains(
            "the checkpoint's plan (K=1 R=1 M=1 1f1b) gives way to the one this run asks for (K=2 R=1 M=2 1f1b)"
        ),
        "{out}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["final_plan"]["pipeline_len"], 2, "{summary}");
    assert_eq!(summary["steps"], 4, "{summary}");
}

/// With AutoPipe on, a resume goes on in the checkpoint's plan and says so whenever the flags
/// ask for another, a schedule or a memory limit as much as K or R (those were dropped
/// silently); and a resume of a finished run keeps the summary of the run that trained.
#[test]
fn a_resume_under_autopipe_names_the_plan_it_keeps() {
    let Some(digits) = DigitsRun::start("resume-autopipe") else { return };
    let (dir, run) = (&digits.dir, |flags: &[&str]| digits.train(flags));
    let elastic = ["--devices", "2", "--pipeline-len", "2", "--freeze", "eq1", "--auto-pipe"];
    let (ok, out) = run(&[&["--fresh", "--set", "train.max_steps=2"][..], &elastic].concat());
    assert!(ok, "{out}");
    // The checkpoint's shape (AutoPipe's choice) asked for again: only the schedule differs.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let k = summary["final_plan"]["pipeline_len"].to_string();
    let schedule = if summary["final_plan"]["schedule"] == "gpipe" { "1f1b" } else { "gpipe" };
    let same_k = ["--devices", "2", "--pipeline-len", &k, "--freeze", "eq1", "--auto-pipe", "--schedule", schedule];
    let (ok, out) = run(&[&["--resume", "--set", "train.max_steps=3"][..], &same_k].concat());
    assert!(ok && out.contains(&format!("the checkpoint's plan (K={k} R=1 M=")) && out.contains("stands"), "{out}");
    assert!(out.contains(&format!("{schedule}) is where a fresh run starts")), "{out}");
    let summary = std::fs::read(dir.join("summary.json")).unwrap();
    let (ok, out) = run(&[&["--resume", "--set", "train.max_steps=3"][..], &elastic].concat());
    assert!(ok && out.contains("0 of them since step 3"), "{out}");
    assert_eq!(std::fs::read(dir.join("summary.json")).unwrap(), summary, "the summary of the steps trained stays");
}

/// A resume names the `[elastic]` settings and the precision that changed since the
/// checkpoint, and takes them: under `constant` a step of two replicas takes one source batch,
/// where `scale-lr` took one for each.
#[test]
fn a_resume_names_and_takes_changed_elastic_settings_and_precision() {
    let Some(digits) = DigitsRun::start("resume-elastic-settings") else { return };
    let (dir, run) = (&digits.dir, |flags: &[&str]| digits.train(flags));
    let elastic = ["--devices", "2", "--freeze", "table", "--set", "elastic.table=[1,2]", "--auto-pipe", "--auto-dp"];
    let scale_lr = ["--set", "elastic.batch_policy=\"scale-lr\""];
    let (ok, out) = run(&[&["--fresh", "--set", "train.max_steps=2"][..], &elastic, &scale_lr].concat());
    assert!(ok && out.contains("R 1 → 2"), "{out}");
    let (ok, out) = run(&[&["--resume", "--set", "train.max_steps=4", "--precision", "bf16"][..], &elastic].concat());
    assert!(ok, "{out}");
    let changed = [r#"elastic.batch_policy "scale-lr" → "constant""#, r#"output.precision "f32" → "bf16""#];
    assert!(changed.iter().all(|c| out.contains(c)), "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let samples: Vec<u64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "step")
        .filter_map(|e| e["samples"].as_u64())
        .collect();
    // A step of both replicas' batches (the log starts at the fresh start), then one batch a step.
    assert_eq!(samples, [64, 32, 32], "{log}");
    // Back to `scale-lr`, with flags that would start a fresh run at two replicas: the run's
    // own start (one replica) still measures the growth, so a step takes both batches again.
    let again = ["--resume", "--set", "train.max_steps=6", "--pipeline-len", "1", "--replicas", "2"];
    let (ok, out) = run(&[&again[..], &elastic, &scale_lr].concat());
    assert!(ok && out.contains(r#"elastic.batch_policy "constant" → "scale-lr""#), "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let last = log.lines().rev().find(|l| l.contains(r#""event":"step""#)).unwrap();
    assert!(last.contains(r#""samples":64"#), "{log}");
    // AutoDP turned off acts at a transition: the replicas it made go on until one, and the
    // change says so rather than that it was taken.
    let off: Vec<&str> = elastic.iter().copied().filter(|f| *f != "--auto-dp").collect();
    let (ok, out) = run(&[&["--resume", "--set", "train.max_steps=7", "--auto-dp", "false"][..], &off].concat());
    let said = "elastic.auto_dp true → false (at the next transition: the checkpoint's plan and its replicas go on";
    assert!(ok && out.contains(said), "{out}");
}

/// Resuming with another seed (another order over as many batches) is refused naming the
/// seed alone, and the checkpoint is kept; with the run's own settings it resumes.
#[test]
fn resuming_over_other_training_data_is_refused() {
    let Some(digits) = DigitsRun::start("resume-data") else { return };
    let (dir, run) = (&digits.dir, |flags: &[&str]| digits.train(flags));
    let saved = std::fs::read(dir.join("checkpoint.ckpt")).unwrap();
    let (ok, out) = run(&["--resume", "--set", "train.max_steps=3", "--set", "train.seed=1"]);
    assert!(!ok && out.contains("other training data") && out.contains("--fresh"), "{out}");
    // Named alone: the one setting that changed, with both values.
    assert!(out.contains("with train.seed = 0, this run's is 1;") && !out.contains("data.split_seed"), "{out}");
    assert_eq!(std::fs::read(dir.join("checkpoint.ckpt")).unwrap(), saved);
    // A line the first run left half-written (killed mid-write) does not swallow the resume
    // marker: it starts a line of its own.
    let log = dir.join("metrics.jsonl");
    std::fs::OpenOptions::new().append(true).open(&log).unwrap().write_all(br#"{"event":"cut-sh"#).unwrap();
    let (ok, out) = run(&["--resume", "--set", "train.max_steps=3"]);
    assert!(ok && out.contains("resumed at step 2"), "{out}");
    let text = std::fs::read_to_string(&log).unwrap();
    let after = text.split(r#"{"event":"cut-sh"#).nth(1).unwrap();
    let marker: serde_json::Value = serde_json::from_str(after.lines().nth(1).unwrap()).unwrap();
    assert!(marker["event"] == "start" && marker["resumed"] == true, "{text}");
    // Another batch size over as many batches per epoch (64 samples: batches of 32 or of 40
    // and 24) would name other samples: refused by its key.
    let limited = |flags: &[&str]| run(&[&["--set", "data.train_limit=64"][..], flags].concat());
    let (ok, out) = limited(&["--fresh", "--set", "train.max_steps=1"]);
    assert!(ok, "{out}");
    let (ok, out) = limited(&["--resume", "--set", "train.max_steps=2", "--set", "data.batch_size=40"]);
    assert!(!ok && out.contains("data.batch_size") && out.contains("batches of 32 samples"), "{out}");
}

/// A checkpoint's export fails on its writing thread (a file where it stages the export's
/// folder; a file named `model` itself is refused before training): the run stops at the next
/// checkpoint with the error, not at its end, and the checkpoint written beside it stays.
#[test]
fn a_failed_background_write_stops_the_run_at_the_next_checkpoint() {
    if !have_digits() {
        return;
    }
    let dir = scratch("write-fail");
    std::fs::write(dir.join(".model.staging"), b"in the way").unwrap();
    let out_dir = format!("output.dir={}", dir.display());
    let args = ["--set", "train.max_steps=6", "--set", "output.checkpoint_every=2", "--set", "data.test_limit=32"];
    let (ok, out) = pipetransformer(
        &[&["train", "--config", "configs/vit-digits.toml", "--fresh", "--set", &out_dir], &args[..]].concat(),
    );
    assert!(!ok && out.contains("model"), "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains(r#""event":"step""#)).count(), 4, "{out}");
    assert!(dir.join("checkpoint.ckpt").exists(), "{out}");
}

/// A BERT built from `model.config` trains on texts with the tokenizer `model.tokenizer`
/// names (its `vocab_size` 0: the tokenizer's), and its export carries that tokenizer, so
/// `predict` reads texts with it. Without a tokenizer, or with a token table smaller than the
/// tokenizer's ids, the run is refused naming the setting and what would fit.
#[test]
fn a_bert_built_from_its_config_trains_with_the_tokenizer_given() {
    let minilm = Path::new("weights/all-minilm-l6-v2");
    if !common::installed(&[minilm, Path::new("data/text/rotten_tomatoes_corpus_full.csv.bz2")]) {
        return;
    }
    let dir = scratch("bert-from-config");
    let config = dir.join("bert.toml");
    let bert = "{ family = \"bert\", vocab_size = 0, hidden_size = 32, num_hidden_layers = 2, num_attention_heads = 2, \
                intermediate_size = 64, max_position_embeddings = 64 }";
    let text = format!(
        "[model]\nconfig = {bert}\ntokenizer = \"{}\"\n[data]\ndataset = \"rotten_tomatoes\"\nbatch_size = 8\nmax_len = 32\n\
         train_limit = 32\ntest_limit = 16\n[train]\nepochs = 1\nlr = 1e-3\n[output]\ndir = \"{}\"\n",
        minilm.display(),
        dir.join("run").display()
    );
    std::fs::write(&config, text).unwrap();
    let train = ["train", "--config", config.to_str().unwrap(), "--fresh", "--progress-every", "0"];
    let (ok, out) = pipetransformer(&train);
    assert!(ok && out.contains("data: rotten_tomatoes"), "{out}");
    let model = dir.join("run/model");
    let exported: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!((exported["vocab_size"].as_u64(), exported["hidden_size"].as_u64()), (Some(30522), Some(32)));
    assert_eq!(
        std::fs::read(model.join("tokenizer.json")).unwrap(),
        std::fs::read(minilm.join("tokenizer.json")).unwrap()
    );
    let (ok, out) =
        pipetransformer(&["predict", "--model", model.to_str().unwrap(), "--format", "json", "a fine film"]);
    assert!(ok && (out.contains(r#""label":"fresh""#) || out.contains(r#""label":"rotten""#)), "{out}");
    // What turns texts into ids is not the samples' fingerprint: a resume under another
    // length or tokenizer names them; the same tokenizer in another folder is the same.
    let copy = dir.join("tokenizer");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(minilm.join("tokenizer.json"), copy.join("tokenizer.json")).unwrap();
    let other = format!("model.tokenizer={}", copy.display());
    let resume = ["train", "--config", config.to_str().unwrap(), "--resume", "--set", "train.epochs=2", "--set"];
    let (ok, out) = pipetransformer(&[&resume[..], &["data.max_len=16", "--set", &other]].concat());
    assert!(ok && out.contains("data.max_len 32 → 16") && !out.contains("model.tokenizer \""), "{out}");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(minilm.join("tokenizer.json")).unwrap()).unwrap();
    json["normalizer"]["lowercase"] = serde_json::json!(false);
    std::fs::write(copy.join("tokenizer.json"), json.to_string()).unwrap();
    let resume = ["train", "--config", config.to_str().unwrap(), "--resume", "--set", "train.epochs=3", "--set"];
    let (ok, out) = pipetransformer(&[&resume[..], &["data.max_len=16", "--set", &other]].concat());
    assert!(ok && out.contains("model.tokenizer \"tokenizer.json #"), "{out}");
    // One whose ids size the model's table otherwise (one added token past MiniLM's 30522,
    // `vocab_size` 0) names it beside the model.
    let added = serde_json::json!({"id": 30522, "special": true, "content": "[NEW]", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false});
    json["added_tokens"].as_array_mut().unwrap().push(added);
    let bigger = dir.join("extended");
    std::fs::create_dir_all(&bigger).unwrap();
    std::fs::write(bigger.join("tokenizer.json"), json.to_string()).unwrap();
    let extended = format!("model.tokenizer={}", bigger.display());
    let (ok, out) = pipetransformer(&[&resume[..], &["data.max_len=16", "--set", &extended]].concat());
    let sized = "`vocab_size` = 30522, this run's is 30523: the model (model.*), or the data that sizes it";
    assert!(!ok && out.contains(sized), "{out}");
    // Grouped by length, a checkpoint within an epoch refuses another length: the epoch's
    // remaining batches follow the samples' token counts.
    let grouped = ["--set", "data.group_by_length=true"];
    let (ok, out) = pipetransformer(&[&train[..], &grouped, &["--set", "train.max_steps=2"]].concat());
    assert!(ok, "{out}");
    let resume = ["train", "--config", config.to_str().unwrap(), "--resume", "--set", "data.max_len=16"];
    let (ok, out) = pipetransformer(&[&resume[..], &grouped].concat());
    assert!(!ok && out.contains("data.max_len") && out.contains("within an epoch (at its batch 2)"), "{out}");
    // Each refusal comes before the run writes: the checkpoint in its folder stays as it was.
    let kept = std::fs::read(dir.join("run/checkpoint.ckpt")).unwrap();
    let (ok, out) = pipetransformer(&[&train[..], &["--set", "model.tokenizer=none"]].concat());
    assert!(!ok && out.contains("model.tokenizer") && out.contains("a text dataset needs a tokenizer"), "{out}");
    let missing = format!("model.tokenizer={}", dir.join("nowhere").display());
    let (ok, out) = pipetransformer(&[&train[..], &["--set", &missing]].concat());
    assert!(!ok && out.contains("is not a folder; expected a folder holding tokenizer.json"), "{out}");
    let empty = format!("model.tokenizer={}", dir.display());
    let (ok, out) = pipetransformer(&[&train[..], &["--set", &empty]].concat());
    assert!(!ok && out.contains("holds no tokenizer.json; expected a folder holding one"), "{out}");
    // On a dataset of images the setting is named as having no effect.
    let (_, out) = pipetransformer(&[&train[..], &["--set", "data.dataset=\"digits\""]].concat());
    assert!(out.contains("is not a dataset of texts: model.tokenizer has no effect"), "{out}");
    assert!(std::fs::read(dir.join("run/checkpoint.ckpt")).unwrap() == kept, "a refused run wrote over the checkpoint");
    let (ok, out) = pipetransformer(&[&train[..], &["--set", "model.config.vocab_size=1000"]].concat());
    assert!(!ok && out.contains("expected a vocab_size of at least 30522"), "{out}");
    // A tokenizer whose ids pass a pretrained model's table is named by the setting that gave
    // it: here `model.tokenizer`, one added token past MiniLM's 30522.
    let pretrained = format!("model.pretrained={}", minilm.display());
    let (ok, out) = pipetransformer(&[&train[..], &["--set", &pretrained, "--set", &extended]].concat());
    assert!(!ok && out.contains("config field `model.tokenizer`") && out.contains("token ids up to 30522"), "{out}");
}

/// `output.checkpoint_every` counts from the run's first step, a resumed run's too: resumed at
/// step 4 with a checkpoint every 6 steps, the next is at step 6 (not 10), then 12, the end.
#[test]
fn a_resumed_run_checkpoints_at_multiples_of_checkpoint_every() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("checkpoint-every");
    let out_dir = format!("output.dir={}", dir.display());
    let tiny = ["model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2", "data.max_len=32"];
    let data = ["data.batch_size=4", "data.train_limit=64", "data.test_limit=8", out_dir.as_str()];
    let mut args = vec!["train", "--config", "configs/gpt-hamlet.toml", "--progress-every", "0"];
    for set in tiny.iter().chain(&data) {
        args.extend(["--set", set]);
    }
    let (ok, out) = pipetransformer(&[&args[..], &["--fresh", "--set", "train.max_steps=4"]].concat());
    assert!(ok, "{out}");
    let resumed = [&args[..], &["--resume", "--set", "train.max_steps=12", "--set", "output.checkpoint_every=6"]];
    let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(resumed.concat()).env("PT_DEBUG", "1").output();
    let out = out.unwrap();
    let text = output_text(&out);
    let steps: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("checkpoint at step "))
        .filter_map(|l| l.split(':').next())
        .collect();
    assert!(out.status.success() && steps == ["6", "12"], "{steps:?}: {text}");
    // Another window length cuts the corpus into other samples: refused, and named.
    let (ok, out) = pipetransformer(&[&args[..], &["--resume", "--set", "data.max_len=16"]].concat());
    assert!(!ok && out.contains("with data.max_len = 32, this run's is 16"), "{out}");
    // So does one that changes the batches per epoch (here with the whole corpus).
    let whole = ["--resume", "--set", "data.max_len=16", "--set", "data.train_limit=0"];
    let (ok, out) = pipetransformer(&[&args[..], &whole].concat());
    assert!(
        !ok && out.contains("batches per epoch")
            && out.contains("the checkpoint's data.max_len = 32, this run's is 16"),
        "{out}"
    );
}

/// The PipeTransformer settings a user can get wrong: each a clear error naming the setting,
/// before anything is written; an existing run's files stay as they were.
#[test]
fn bad_elastic_settings_are_clear_errors_that_write_nothing() {
    if !have_digits() {
        return;
    }
    let dir = scratch("elastic-bad");
    std::fs::write(dir.join("checkpoint.ckpt"), b"an earlier run").unwrap();
    let out_dir = format!("output.dir={}", dir.display());
    let blocker = dir.join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let unwritable = blocker.join("cache").display().to_string();
    let elastic: &[&str] = &["--freeze", "alpha", "--auto-pipe", "--auto-dp", "--freed-devices", "threads"];
    let scale_lr = [elastic, &["--set", "elastic.batch_policy=\"scale-lr\""]].concat();
    let cases: [(&[&str], &str); 14] = [
        (&["--freeze", "alpha", "--alpha", "1.5"], "elastic.alpha"),
        // (Refused under a rule that does not read it too, not only warned about.)
        (&["--freeze", "off", "--alpha", "5"], "`elastic.alpha`: must be in (0, 1), got 5"),
        // (Refused by its range, not as a string TOML does not read.)
        (&["--freeze", "alpha", "--alpha", "nan"], "`elastic.alpha`: must be in (0, 1), got NaN"),
        (&["--cache-bytes", "lots"], "byte count"),
        (&scale_lr, "choose one"),
        (&["--freed-devices", "cores"], "not one of replicas, threads"),
        (&["--set", "elastic.freed_devices=\"cores\""], "expected `replicas` or `threads`"),
        (&["--set", "data.validation_fraction=1.5"], "data.validation_fraction"),
        (&["--freeze", "sometimes"], "not one of off, eq1, alpha, table"),
        (&["--freeze", "table", "--set", "elastic.table=[2, 1]"], "decreases from 2 to 1"),
        (&["--freeze", "table", "--set", "elastic.table=[0, 3]"], "the final norm and the head always train"),
        (&["--freeze", "alpha", "--auto-pipe", "--cache", "--cache-bytes", "100"], "cannot hold one batch"),
        (&["--freeze", "alpha", "--auto-pipe", "--cache", "--cache-dir", &unwritable], "elastic.cache_dir"),
        (&["--devices", "1", "--pipeline-len", "2"], "need 2 devices; 1 available"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--fresh"];
        args.extend(flags);
        let (ok, out) = pipetransformer(&args);
        assert!(!ok && out.contains(want), "{flags:?}: {out}");
    }
    assert_eq!(std::fs::read(dir.join("checkpoint.ckpt")).unwrap(), b"an earlier run");
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["checkpoint.ckpt", "not-a-dir"], "nothing written");
}

/// The digits ViT on two devices through the elastic loop: a two-stage pipeline whose table
/// freezes a layer after two steps, AutoPipe and AutoDP on, a short run; `extra` adds flags.
fn elastic_loop(dir: &Path, extra: &[&str]) -> (bool, String) {
    let out_dir = format!("output.dir={}", dir.display());
    let mut args = vec!["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--fresh"];
    args.extend(TWO_STAGES_TWO_MICRO_BATCHES);
    args.extend([
        "--freeze",
        "table",
        "--set",
        "elastic.table=[0, 1]",
        "--freeze-interval",
        "2",
        "--auto-pipe",
        "--auto-dp",
        "--set",
        "train.epochs=1",
        "--set",
        "data.train_limit=96",
        "--set",
        "data.test_limit=32",
    ]);
    args.extend(extra);
    pipetransformer(&args)
}

/// The whole elastic loop from the command line on emulated CUDA devices: a two-stage
/// pipeline freezes a layer after two steps, shrinks to one stage with two replicas, caches,
/// and reports the transition in the log, the report and the trace.
#[test]
fn the_elastic_loop_runs_on_emulated_cuda_devices() {
    if !have_digits() {
        return;
    }
    let dir = scratch("elastic-emu");
    let trace = dir.join("trace.json").display().to_string();
    let (ok, out) =
        elastic_loop(&dir, &["--device", "cuda-emu", "--cache", "--set", "train.max_steps=6", "--trace", &trace]);
    assert!(ok, "{out}");
    assert!(out.contains("transition at step 2: 0 → 1 frozen layers, K 2 → 1, R 1 → 2"), "{out}");
    let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(log.contains("\"event\":\"transition\"") && log.contains("\"frozen_units\":3"), "{log}");
    let report = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(report.contains("<svg") && report.contains("0 → 1"), "{report}");
    assert!(std::fs::read_to_string(&trace).unwrap().contains("transition: 1 frozen layers, K=1 R=2"));
    drop(dir);
    // In bf16 the hidden states stage 1 receives, and later the cache's, are bf16 on the GPU;
    // the cache keeps them as bf16 unless told f32: half the bytes, the same run.
    let bf16 = ["--device", "cuda-emu", "--precision", "bf16", "--cache", "--set", "train.epochs=2"];
    let runs: Vec<(String, f64)> = [&[][..], &["--set", "elastic.cache_dtype=\"f32\""]]
        .iter()
        .map(|dtype| {
            let dir = scratch("elastic-emu-bf16");
            let (ok, out) = elastic_loop(&dir, &[&bf16[..], dtype].concat());
            // Epoch 1's batches each hold about a third of the 32 cached samples: too few to
            // read, so every sample runs the frozen layers, and none counts as a hit.
            assert!(
                ok && out.contains("K 2 → 1, R 1 → 2") && out.contains("epoch 1: cache 0 hits / 96 misses, 32 samples"),
                "{out}"
            );
            let log = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
            let mut events = log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
            let cache = events.rfind(|v| v["event"] == "cache").unwrap();
            let final_eval = out.lines().find(|l| l.starts_with("final eval")).unwrap().to_string();
            (final_eval, cache["memory_bytes"].as_f64().unwrap())
        })
        .collect();
    assert_eq!(runs[0].0, runs[1].0, "the same evaluation");
    assert!(runs[0].1 > 0.0 && 2.0 * runs[0].1 == runs[1].1, "bf16 entries are half the f32 ones: {runs:?}");
}

/// Freed cpu devices lending their threads, from the command line: after the freeze the one
/// remaining stage runs on a device with both threads, and no replica is made.
#[test]
fn freed_cpu_devices_lend_their_threads_from_the_command_line() {
    if !have_digits() {
        return;
    }
    let dir = scratch("elastic-threads");
    let threads = ["--freed-devices", "threads", "--set", "output.threads=2", "--set", "train.max_steps=4"];
    let (ok, out) = elastic_loop(&dir, &threads);
    assert!(ok, "{out}");
    assert!(out.contains("transition at step 2: 0 → 1 frozen layers, K 2 → 1, R 1 → 1"), "{out}");
    assert!(out.contains("freed cpu devices lend their threads: 2 per device"), "{out}");
}

/// `--token-slices`: refused for a model that is not a causal language model, and a malformed
/// request is refused by the flag parser, before any work.
#[test]
fn token_slices_are_refused_where_they_do_not_apply() {
    if !have_digits() {
        return;
    }
    let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--token-slices", "4"]);
    assert!(!ok && out.contains("token_slices") && out.contains("causal language model"), "{out}");
    for bad in ["3,0,5", "two"] {
        let (ok, out) = pipetransformer(&["plan", "--config", "configs/vit-digits.toml", "--token-slices", bad]);
        assert!(!ok && out.contains("--token-slices") && out.contains("token_slices"), "{bad}: {out}");
        assert!(!out.contains("panicked"), "{out}");
    }
}

/// A resumed run keeps its checkpoint's token slices and says so; it does not announce a
/// slicing planned afresh (`auto`) that the checkpoint's plan replaced; `off` given as such
/// replaces them.
#[test]
fn a_resumed_run_names_the_checkpoints_token_slices() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("resume-slices");
    let out_dir = format!("output.dir={}", dir.display());
    let run = |flags: &[&str], steps: &str| {
        let base = ["train", "--config", "configs/gpt-hamlet.toml", "--set", &out_dir, "--set", "data.test_limit=4"];
        pipetransformer(&[&base[..], &["--set", steps, "--set", "data.batch_size=2"], flags].concat())
    };
    let (ok, first) = run(&["--fresh", "--token-slices", "3,5,120"], "train.max_steps=1");
    assert!(ok, "{first}");
    let (ok, out) = run(&["--resume", "--token-slices", "auto"], "train.max_steps=2");
    assert!(ok, "{out}");
    assert!(out.contains("token slices (the checkpoint's): 3,5,120") && !out.contains("planned from"), "{out}");
    // The restored plan is costed as the fresh run's, for micro-batches of the same samples.
    let table = |out: &str| -> Vec<String> {
        out.lines().filter(|l| l.starts_with("| ") || l.starts_with("simulated")).map(String::from).collect()
    };
    assert!(table(&first).len() > 2 && table(&first) == table(&out), "{first}\n{out}");
    // Whole sequences asked for as such (`off`) replace the checkpoint's slicing.
    let (ok, out) = run(&["--resume", "--token-slices", "off"], "train.max_steps=3");
    assert!(ok && out.contains("gives way") && !out.contains("token slices (the checkpoint's)"), "{out}");
}

/// A model of another kind than its dataset (a GPT on digits, a ViT on hamlet) is refused by
/// `plan` and `train` as the run is built, naming `data.dataset`, with nothing written; an
/// exported model evaluated on images of another size is refused by the dataset too. A
/// pretrained model beside an architecture is warned about: the architecture goes unread. A
/// run's folder without its exported model is named as such.
#[test]
fn a_model_of_another_kind_than_its_dataset_is_refused_before_anything_is_written() {
    let all = ["data/digits/digits.csv.gz", "data/text/hamlet.txt", "data/mnist5k/mnist_5k.csv.gz"];
    if !common::installed(&all.map(Path::new)) {
        return;
    }
    let dir = scratch("kinds");
    let out_dir = format!("output.dir={}", dir.join("run").display());
    for (config, dataset, want) in [
        ("configs/gpt-hamlet.toml", "digits", "digits is image classification with 10 classes"),
        ("configs/vit-digits.toml", "hamlet", "hamlet is character-level text (66 characters); the model (a ViT)"),
    ] {
        let data = format!("data.dataset=\"{dataset}\"");
        for command in ["plan", "train"] {
            let (ok, out) = pipetransformer(&[command, "--config", config, "--set", &data, "--set", &out_dir]);
            assert!(!ok && out.contains("config field `data.dataset`") && out.contains(want), "{out}");
            assert!(!dir.join("run").exists(), "{out}");
        }
    }
    let args = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "train.max_steps=1"];
    let (ok, out) = pipetransformer(&[&args[..], &["--set", "data.test_limit=8"]].concat());
    assert!(ok, "{out}");
    let model = dir.join("run").display().to_string();
    let (ok, out) = pipetransformer(&[
        "evaluate",
        "--model",
        &model,
        "--config",
        "configs/vit-digits.toml",
        "--set",
        "data.dataset=\"mnist5k\"",
    ]);
    assert!(
        !ok && out.contains("the model reads images of 1 channel of 8×8; the images of mnist5k are 1 channel of 28×28"),
        "{out}"
    );
    let (ok, out) = pipetransformer(&[
        "plan",
        "--config",
        "configs/vit-digits.toml",
        "--set",
        &format!("model.pretrained={model}/model"),
    ]);
    assert!(ok && out.contains("warning: model.config (a ViT) is set, but model.pretrained"), "{out}");
    // A pretrained ViT whose processor normalises its pixels (as Google's do) has that folded
    // into its patch embedding, said as it loads; an export of this engine's, read at its own
    // scale, has nothing to fold.
    let normalising = dir.join("normalising");
    std::fs::create_dir(&normalising).unwrap();
    for file in std::fs::read_dir(dir.join("run").join("model")).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, normalising.join(file.file_name().unwrap())).unwrap();
    }
    let processor = normalising.join("preprocessor_config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&processor).unwrap()).unwrap();
    json["do_normalize"] = true.into();
    json["image_mean"] = serde_json::json!([0.5]);
    json["image_std"] = serde_json::json!([0.5]);
    std::fs::write(&processor, json.to_string()).unwrap();
    for (i, (pretrained, folds)) in [(dir.join("run").join("model"), false), (normalising, true)].iter().enumerate() {
        let (ok, out) = pipetransformer(
            &[
                &args[..2],
                &["configs/vit-digits.toml", "--set", "train.max_steps=1", "--set", "data.test_limit=8", "--set"],
                &[&format!("output.dir={}", dir.join(format!("fine-tuned-{i}")).display()), "--set"],
                &[&format!("model.pretrained={}", pretrained.display())],
            ]
            .concat(),
        );
        assert!(ok && out.contains("folded into the patch embedding") == *folds, "{out}");
    }
    // An empty input to an image model is named as such (not as a value that is no pixel).
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--format", "json", ""]);
    assert!(!ok && out.contains("an empty input; expected a CSV row of 64 pixels"), "{out}");
    // A run's folder without its export (taken away, or not written yet) says so.
    std::fs::remove_dir_all(dir.join("run").join("model")).unwrap();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "1"]);
    assert!(!ok && out.contains("is a run's folder (it holds checkpoint.ckpt) without its exported model"), "{out}");
}

/// A resume refused for a changed setting names it as a config writes it: a freeze rule as
/// `table [1, 2]` (not Rust's `Table([1, 2])`), an f32 dropout as `0.1`, another model by its
/// family (before the data's checks would blame the data), and a restored plan that needs more
/// devices than the run has by `pipeline.devices`.
#[test]
fn resume_refusals_name_the_changed_setting_as_written() {
    if !common::installed(&[Path::new("data/digits/digits.csv.gz"), Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("resume-names");
    let out_dir = format!("output.dir={}", dir.display());
    let vit = |flags: &[&str]| {
        let base = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "data.test_limit=8"];
        pipetransformer(&[&base[..], &["--set", "train.epochs=10"], flags].concat())
    };
    let elastic =
        ["--freeze", "table", "--set", "elastic.table=[0, 1]", "--freeze-interval", "2", "--auto-pipe", "--auto-dp"];
    let untimed = [&elastic[..], &["--set", "elastic.time_pipeline_len=false"]].concat();
    let (ok, out) =
        vit(&[&untimed[..], &["--devices", "2", "--pipeline-len", "2", "--set", "train.max_steps=4", "--fresh"]]
            .concat());
    assert!(ok && out.contains("K 2 → 1, R 1 → 2"), "{out}");
    let (ok, out) = vit(&[&untimed[..], &["--devices", "1", "--set", "train.max_steps=5", "--resume"]].concat());
    let want = "its plan (K=1 R=2 M=1) cannot run here: 2 replicas × 1 pipeline stage need 2 devices; 1 available \
                (pipeline.devices)";
    assert!(!ok && out.contains(want), "{out}");
    let (ok, out) = vit(&["--freeze", "off", "--set", "train.max_steps=5", "--resume"]);
    // Every setting of the rule to set back, in one refusal: the rule and its interval.
    let both = "(elastic.freeze / elastic.table: table [0, 1] then, off now; elastic.freeze_interval 2 and \
                max_weight_change none then, freeze_interval \"epoch\" and max_weight_change none now)";
    assert!(!ok && out.contains(both), "{out}");
    let (ok, out) = vit(&[
        &untimed[..],
        &["--set", "model.config.hidden_dropout_prob=0.1", "--set", "train.max_steps=5", "--resume"],
    ]
    .concat());
    assert!(!ok && out.contains("`hidden_dropout_prob` = 0, this run's is 0.1:"), "{out}");
    let gpt =
        ["train", "--config", "configs/gpt-hamlet.toml", "--set", &out_dir, "--set", "train.max_steps=5", "--resume"];
    let (ok, out) = pipetransformer(&gpt);
    assert!(!ok && out.contains("`family` = \"vit\", this run's is \"gpt\""), "{out}");
}

/// An interleaved plan names the setting that cuts too many stages, `pipeline.chunks`; and
/// where its micro-batches do not fill whole groups of `K`, says that its predicted bubble
/// leaves the last group's wait out (the simulation, printed below it, counts it).
#[test]
fn interleaved_plans_name_chunks_and_what_their_prediction_leaves_out() {
    if !have_digits() {
        return;
    }
    let plan = ["plan", "--config", "configs/vit-digits.toml", "--devices", "2", "--schedule", "interleaved"];
    let (ok, out) = pipetransformer(&[&plan[..], &["--chunks", "4"]].concat());
    assert!(!ok && out.contains("config field `pipeline.chunks`: 2 devices × 4 chunks"), "{out}");
    let note = "both leave out the wait of the last group of 1 micro-batch, 3 not being a multiple of K = 2";
    let (ok, out) = pipetransformer(&[&plan[..], &["--chunks", "2", "--micro-batches", "3"]].concat());
    assert!(ok && out.contains(note), "{out}");
    let (ok, out) = pipetransformer(&[&plan[..], &["--chunks", "2", "--micro-batches", "4"]].concat());
    assert!(ok && out.contains("predicted bubble") && !out.contains("leave out"), "{out}");
}

/// A path of the run's folder that holds the other kind of thing than the run writes there (a
/// file named `model`, a folder named `summary.json`) is refused before training, by name,
/// with nothing written; not after the run, when the export or the summary fails.
#[test]
fn a_file_or_folder_in_the_way_of_the_runs_files_is_refused_before_training() {
    if !have_digits() {
        return;
    }
    for (name, folder, says) in [
        ("model", false, "is a file, where the run writes its exported model's folder"),
        ("summary.json", true, "is a folder, where the run writes a file"),
    ] {
        let dir = scratch(&format!("in-the-way-{name}"));
        let path = dir.join(name);
        match folder {
            true => std::fs::create_dir(&path).unwrap(),
            false => std::fs::write(&path, b"mine").unwrap(),
        }
        let out_dir = format!("output.dir={}", dir.display());
        let train = ["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "train.max_steps=1"];
        let (ok, out) = pipetransformer(&train);
        assert!(!ok && out.contains("output.dir") && out.contains(says), "{out}");
        let left: Vec<_> = std::fs::read_dir(&*dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [name], "{out}");
    }
}

/// A plan restored from a checkpoint is costed for what a step's batch holds: with a training
/// set shorter than `data.batch_size`, the set (the resumed run's table equals the fresh one's).
#[test]
fn a_restored_plan_is_costed_for_a_training_set_shorter_than_the_batch() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("resume-short-set");
    let out_dir = format!("output.dir={}", dir.display());
    let run = |flags: &[&str], steps: &str| {
        let base = ["train", "--config", "configs/gpt-hamlet.toml", "--set", &out_dir, "--set", "data.test_limit=4"];
        let short = ["--set", "data.batch_size=8", "--set", "data.train_limit=4", "--set", steps];
        pipetransformer(&[&base[..], &short[..], flags].concat())
    };
    let (ok, first) = run(&["--fresh", "--token-slices", "3,5,120"], "train.max_steps=1");
    assert!(ok && first.contains("4 training"), "{first}");
    // The checkpoint's slicing replaces the one `auto` would plan: its plan is costed anew.
    let (ok, out) = run(&["--resume", "--token-slices", "auto"], "train.max_steps=2");
    assert!(ok && out.contains("token slices (the checkpoint's)"), "{out}");
    let table = |out: &str| -> Vec<String> {
        out.lines().filter(|l| l.starts_with("| ") || l.starts_with("simulated")).map(String::from).collect()
    };
    assert!(table(&first).len() > 2 && table(&first) == table(&out), "{first}\n{out}");
}

/// `plan --token-slices auto` plans one slicing for every micro-batch under the device memory
/// limit (`--memory-limit`, with binary units), prints it with its predicted peak, and a limit
/// that no slicing meets is refused by name with the bytes it would need.
#[test]
fn token_slices_auto_respects_the_memory_limit() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let gpt = ["plan", "--config", "configs/gpt-hamlet.toml", "--devices", "2", "--token-slices", "auto"];
    let (ok, out) = pipetransformer(&[&gpt[..], &["--micro-batches", "2", "--memory-limit", "200MiB"]].concat());
    assert!(ok, "{out}");
    let line = out.lines().find(|l| l.starts_with("token slices")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("2 × (8 seq: ") && line.contains("peak memory") && !line.contains("peak memory 0 B"),
        "{line}"
    );
    // The plan in force runs that slicing: its last slice's forward is in the device's actions.
    // (Lengths print as `96, 32`, equal ones as `2×64`: the measured latencies choose which.)
    let lengths = line.split("seq: ").nth(1).and_then(|l| l.split(')').next()).unwrap();
    let n: usize = lengths
        .split(',')
        .map(|part| part.trim().split_once('×').map_or(1, |(k, _)| k.parse().unwrap_or_else(|_| panic!("{line}"))))
        .sum();
    let device0 = out.lines().find(|l| l.starts_with("device 0:")).unwrap_or_else(|| panic!("{out}"));
    let last = if n > 1 { format!("F0/{}.0 ", n - 1) } else { "F0.0 ".into() };
    assert!(device0.contains(&last) && !device0.contains(&format!("F0/{n}.")), "{n} slices: {device0}");
    let (ok, out) = pipetransformer(&[&gpt[..], &["--memory-limit", "3MiB"]].concat());
    assert!(!ok && out.contains("pipeline.memory_limit") && out.contains("no slicing meets the memory limit"), "{out}");
    let (ok, out) = pipetransformer(&[&gpt[..], &["--memory-limit", "3 parsecs"]].concat());
    assert!(!ok && out.contains("--memory-limit") && out.contains("byte count"), "{out}");
    // A negative number is the flag's value, refused by its own check (not an unknown flag).
    let (ok, out) = pipetransformer(&[&gpt[..], &["--memory-limit", "-1"]].concat());
    assert!(!ok && out.contains("--memory-limit") && out.contains("`-1` is not a byte count"), "{out}");
    // On one stage without recomputation, whole micro-batches past the limit are cut into the
    // fewest equal slices that fit (token slices keep fewer attention scores).
    let one = ["plan", "--config", "configs/gpt-hamlet.toml", "--token-slices", "auto", "--recompute", "off"];
    let long = ["model.config.n_embd=32", "model.config.n_layer=4", "model.config.n_head=4", "data.max_len=128"];
    let mut args = one.to_vec();
    for set in long.iter().chain(&["data.batch_size=4"]) {
        args.extend(["--set", set]);
    }
    let (ok, out) = pipetransformer(&[&args[..], &["--memory-limit", "9MiB"]].concat());
    let said = "token slices: 2 of equal length, 64,64 (`auto` on one stage: whole micro-batches exceed the memory";
    assert!(ok && out.contains(said), "{out}");
    // Counts past what a setting holds are refused by the flag that gave them, not by the
    // `--set` it becomes.
    let huge = u64::MAX.to_string();
    for flag in ["--memory-limit", "--replicas", "--chunks"] {
        let (ok, out) = pipetransformer(&[&gpt[..], &[flag, &huge]].concat());
        let said = format!("`{huge}` is beyond what a setting holds (at most {})", i64::MAX);
        assert!(!ok && out.contains(flag) && out.contains(&said) && !out.contains("--set"), "{flag}: {out}");
    }
    let (ok, out) = pipetransformer(&["train", "--config", "configs/gpt-hamlet.toml", "--threads", &huge]);
    assert!(!ok && out.contains("--threads") && out.contains("is beyond what a setting holds"), "{out}");
}

/// A progress interval that is not a finite, non-negative number of seconds is refused by name.
#[test]
fn a_bad_progress_interval_is_refused() {
    if !have_digits() {
        return;
    }
    for bad in ["--progress-every=-1", "--progress-every=nan"] {
        let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", bad]);
        let named = out.contains("for '--progress-every") && out.contains("is not a number of seconds");
        assert!(!ok && named && !out.contains("panicked"), "{bad}: {out}");
    }
    let set = ["train", "--config", "configs/vit-digits.toml", "--set", "output.progress_every=-1"];
    let (ok, out) = pipetransformer(&set);
    assert!(!ok && out.contains("output.progress_every") && !out.contains("panicked"), "{out}");
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Two nodes launched with different settings are refused on both before anything is built,
/// naming the settings (nodes apart in `train.lr` would train apart while their all-reduced
/// losses looked as one); where each node keeps its files may differ.
#[test]
fn nodes_launched_with_other_settings_are_refused() {
    let (dirs, rdzv) = ([scratch("nodes-0"), scratch("nodes-1")], format!("127.0.0.1:{}", free_port()));
    let node = |rank: usize, more: &[&str]| {
        let out = format!("output.dir={}", dirs[rank].display());
        let launch = ["launch", "--nnodes", "2", "--node-rank", &rank.to_string(), "--rdzv", &rdzv];
        Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
            .args(launch)
            .args(["--rdzv-token", "nodes", "--", "train", "--config", "configs/vit-digits.toml"])
            .args(["--set", &out])
            .args(more)
            .env("PT_COLLECTIVE_TIMEOUT", "60")
            .output()
            .unwrap()
    };
    let second = std::thread::scope(|s| {
        let second =
            s.spawn(|| node(1, &["--fresh", "--set", "train.lr=0.5", "--set", "train.seed=9", "--threads", "1"]));
        let first = node(0, &["--fresh"]);
        let second = second.join().unwrap();
        for (o, who) in [(&first, "node 0"), (&second, "node 1")] {
            let out = output_text(o);
            assert!(!o.status.success(), "{who}: {out}");
            // (Not output.dir nor output.threads, which differ too.)
            assert!(out.contains("settings differ from rank 0's (rank 1: train.lr, train.seed)"), "{who}: {out}");
        }
        second
    });
    assert!(!dirs[0].join("metrics.jsonl").exists() && !dirs[1].join("metrics.jsonl").exists(), "{second:?}");
    // Each node resuming from its own folder's checkpoint, of other steps: refused on both.
    if !have_digits() {
        return;
    }
    for (dir, steps) in dirs.iter().zip(["2", "3"]) {
        let out = format!("output.dir={}", dir.display());
        let small = ["--set", "data.test_limit=16", "--set", &format!("train.max_steps={steps}"), "--set", &out];
        let (ok, out) =
            pipetransformer(&[&["train", "--config", "configs/vit-digits.toml", "--fresh"][..], &small].concat());
        assert!(ok, "{out}");
    }
    let resume = ["--resume", "--set", "train.max_steps=4", "--set", "data.test_limit=16"];
    let outputs = std::thread::scope(|s| {
        let second = s.spawn(|| node(1, &resume));
        [node(0, &resume), second.join().unwrap()]
    });
    let refused = |outputs: &[std::process::Output; 2]| {
        for (o, who) in outputs.iter().zip(["node 0", "node 1"]) {
            let out = output_text(o);
            let says = "rank 1's checkpoint is of step 3, rank 0's of step 2";
            assert!(!o.status.success() && out.contains(says), "{who}: {out}");
        }
    };
    refused(&outputs);
    // The same with the stages as processes (their own group is a column of one).
    let stages = ["--across-processes", "--pipeline-len", "2", "--set", "data.test_limit=16"];
    for (dir, steps) in dirs.iter().zip(["2", "3"]) {
        let rdzv = format!("127.0.0.1:{}", free_port());
        let launch = ["launch", "--nproc-per-node", "2", "--rdzv", &rdzv, "--", "train", "--config"];
        let (out, steps) = (format!("output.dir={}", dir.display()), format!("train.max_steps={steps}"));
        let run = ["configs/vit-digits.toml", "--fresh", "--set", &out, "--set", &steps];
        let (ok, out) = pipetransformer(&[&launch[..], &run, &stages].concat());
        assert!(ok, "{out}");
    }
    let resume = [&["--resume", "--set", "train.max_steps=4"][..], &stages].concat();
    refused(&std::thread::scope(|s| {
        let second = s.spawn(|| node(1, &resume));
        [node(0, &resume), second.join().unwrap()]
    }));
}

/// A launched `train` whose flags or run config are wrong is refused once, by the launcher,
/// before any rank starts (each rank used to say it, and wait on the others).
#[test]
fn a_launched_runs_bad_flag_or_setting_is_said_once() {
    let launch = ["launch", "--nproc-per-node", "2", "--", "train", "--config", "configs/vit-digits.toml"];
    let (ok, out) = pipetransformer(&[&launch[..], &["--set", "train.lr=-1"]].concat());
    assert!(!ok && out.matches("`train.lr`: must be finite and ≥ 0").count() == 1 && !out.contains("[rank"), "{out}");
    let (ok, out) = pipetransformer(&[&launch[..], &["--learning-rate", "1"]].concat());
    let refused = out.matches("unexpected argument '--learning-rate'").count() == 1;
    assert!(!ok && refused && out.contains("Usage: pipetransformer train") && !out.contains("[rank"), "{out}");
}

/// The exported weights of a run directory, by name.
fn exported(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let file = pipetransformer::weights::load_safetensors(dir.join("model/model.safetensors")).unwrap();
    file.tensors().iter().map(|t| (t.name.clone(), file.read_f32(t).unwrap())).collect()
}

/// `launch` with 2 and 4 processes on loopback trains the model one process trains (1e-5),
/// and only rank 0 writes the run's files.
#[test]
fn launched_processes_train_the_weights_one_process_trains() {
    if !have_digits() {
        return;
    }
    let train = |dir: &Path| {
        let out = format!("output.dir={}", dir.display());
        let args = ["train", "--config", "configs/vit-digits.toml", "--fresh", "--progress-every", "0"];
        let small = ["--set", "train.max_steps=4", "--set", "train.epochs=1", "--set", "data.test_limit=32"];
        // (A setting the config warns of: every rank reads it.)
        let warned = ["--set", "train.early_stopping_min_delta=0.01"];
        let mut v: Vec<String> = args.iter().chain(&small).chain(&warned).map(|s| s.to_string()).collect();
        v.extend(["--set".to_string(), out]);
        v
    };
    let one = scratch("launch-1");
    let (ok, out) = pipetransformer(&train(&one).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{out}");
    let want = exported(&one);
    for procs in [2, 4] {
        let port = free_port();
        let dir = scratch(&format!("launch-{procs}"));
        let (n, rdzv) = (procs.to_string(), format!("127.0.0.1:{port}"));
        let mut args = vec!["launch", "--nproc-per-node", &n, "--rdzv", &rdzv, "--"];
        let rest = train(&dir);
        args.extend(rest.iter().map(String::as_str));
        let trace = dir.join("trace.json").display().to_string();
        args.extend(["--trace", &trace]);
        let (ok, out) = pipetransformer(&args);
        assert!(ok, "{procs} processes: {out}");
        // Every process's trace, none overwriting another's.
        for r in 0..procs {
            let name = if r == 0 { "trace.json".to_string() } else { format!("trace.rank{r}.json") };
            let events: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(&name)).unwrap()).unwrap();
            assert!(events["traceEvents"].as_array().is_some_and(|e| !e.is_empty()), "{name}");
            std::fs::remove_file(dir.join(name)).unwrap();
        }
        assert!(out.contains(&format!("a TCP ring across {procs} processes")), "{out}");
        // The config's warning once, from rank 0.
        let warnings: Vec<&str> = out.lines().filter(|l| l.contains("early_stopping_min_delta = 0.01")).collect();
        assert!(warnings.len() == 1 && warnings[0].starts_with("[rank 0] warning:"), "{out}");
        // Each process's lines come through the launcher led by its rank.
        for r in 0..procs {
            assert!(out.lines().any(|l| l.starts_with(&format!("[rank {r}] done: 4 steps"))), "rank {r}: {out}");
        }
        let got = exported(&dir);
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for ((a, x), (b, y)) in got.iter().zip(&want) {
            assert_eq!(a, b);
            num += x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum::<f64>();
            den += y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>();
        }
        let rel = (num / den).sqrt();
        assert!(rel <= 1e-5, "{procs} processes: weights differ from one process by {rel:e}");
        let mut names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        let one_set = [".lock", "checkpoint.ckpt", "metrics.jsonl", "model", "report.html", "summary.json"];
        assert_eq!(names, one_set, "one set of files, from rank 0 (which alone locks the folder)");
        // Again into the same directory without --fresh: rank 0 refuses, and every process
        // hears it before anything is built.
        let again: Vec<&str> = args.iter().copied().filter(|a| *a != "--fresh").collect();
        let (ok, out) = pipetransformer(&again);
        assert!(!ok && out.contains("already holds a checkpoint") && out.contains("rank 0 refused to start"), "{out}");
    }
}

/// `launch` with `--across-processes`: 2 and 3 processes, each running one stage of the
/// pipeline, and 4 running two replicas of a two-stage pipeline, write bitwise the model and
/// checkpoint that one process with the same pipeline on as many devices writes; a run
/// resumed from such a checkpoint continues exactly as one process resumed from its own does.
#[test]
fn a_pipeline_across_launched_processes_writes_what_one_process_writes() {
    if !have_digits() {
        return;
    }
    let run = |dir: &Path, k: usize, procs: usize, steps: usize, launched: bool, resume: bool| {
        let (r, k) = ((procs / k).to_string(), k.to_string());
        let (steps, out) = (format!("train.max_steps={steps}"), format!("output.dir={}", dir.display()));
        let (port, n) = (free_port().to_string(), procs.to_string());
        let rdzv = format!("127.0.0.1:{port}");
        let mut args: Vec<&str> = match launched {
            true => vec!["launch", "--nproc-per-node", &n, "--rdzv", &rdzv, "--", "train", "--across-processes"],
            false => vec!["train", "--devices", &n, "--replicas", &r],
        };
        args.extend(["--config", "configs/vit-digits.toml", "--progress-every", "0", "--pipeline-len", &k]);
        args.extend(["--micro-batches", "4", "--set", "data.test_limit=32", "--set", &steps, "--set", &out]);
        args.push(if resume { "--resume" } else { "--fresh" });
        let (ok, text) = pipetransformer(&args);
        assert!(ok, "{args:?}: {text}");
        text
    };
    let bytes = |dir: &Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    for (k, procs, says) in [
        (2, 2, "stages across 2 processes"),
        (3, 3, "stages across 3 processes"),
        (2, 4, "2 replicas × 2 stages across 4 processes"),
    ] {
        let (one, many) = (scratch(&format!("across-one-{procs}")), scratch(&format!("across-{procs}")));
        run(&one, k, procs, 4, false, false);
        let text = run(&many, k, procs, 4, true, false);
        assert!(text.contains(says), "{text}");
        assert_eq!(text.matches("wrote ").count(), 1, "only rank 0 writes: {text}");
        let model = "model/model.safetensors";
        assert!(bytes(&one, model) == bytes(&many, model), "{procs} processes: the model differs from one process's");
        // The checkpoint too, but for the plan it records: replicas that are processes are
        // not the plan's (it is each process's own, of one replica).
        let load = |dir: &Path| pipetransformer::train::checkpoint::load(&dir.join("checkpoint.ckpt")).unwrap();
        let ((mut meta_one, tensors_one), (mut meta_many, tensors_many)) = (load(&one), load(&many));
        assert!(tensors_one == tensors_many, "{procs} processes: the checkpoint's weights and optimizer state");
        if procs == k {
            assert!(bytes(&one, "checkpoint.ckpt") == bytes(&many, "checkpoint.ckpt"), "{procs} processes");
        }
        meta_one["plan"]["config"]["replicas"] = 1.into();
        meta_many["plan"]["config"]["replicas"] = 1.into();
        assert_eq!(meta_one, meta_many, "{procs} processes: the checkpoint's state");
        // The evaluation too (each row scores its share of the batches through its stages).
        let eval = |dir: &Path| {
            let summary: serde_json::Value = serde_json::from_slice(&bytes(dir, "summary.json")).unwrap();
            summary["eval"].clone()
        };
        assert!(eval(&one)["count"].as_u64().is_some_and(|n| n > 0), "{:?}", eval(&one));
        assert_eq!(eval(&one), eval(&many), "{procs} processes: the evaluation");
        // Half the run, then the rest from the checkpoint, both ways.
        for (dir, launched) in [(&one, false), (&many, true)] {
            run(dir, k, procs, 2, launched, false);
            run(dir, k, procs, 4, launched, true);
        }
        // Resumed with no step left: the run only evaluates and writes (rank 0 collects the
        // other stages first).
        run(&many, k, procs, 4, true, true);
        // Started from the exported model: each process loads its own stages' weights only.
        let exported = format!("model.pretrained={}", many.join("model").display());
        let port = free_port().to_string();
        let rdzv = format!("127.0.0.1:{port}");
        let (n, k) = (procs.to_string(), k.to_string());
        let out = format!("output.dir={}", many.join("again").display());
        let (ok, text) = pipetransformer(&[
            "launch",
            "--nproc-per-node",
            &n,
            "--rdzv",
            &rdzv,
            "--",
            "train",
            "--across-processes",
            "--config",
            "configs/vit-digits.toml",
            "--fresh",
            "--progress-every",
            "0",
            "--pipeline-len",
            &k,
            "--set",
            &exported,
            "--set",
            "train.max_steps=1",
            "--set",
            "data.test_limit=32",
            "--set",
            &out,
        ]);
        assert!(ok, "{text}");
        assert_eq!(text.matches("held by other processes").count(), procs, "{text}");
        assert!(
            bytes(&one, "model/model.safetensors") == bytes(&many, "model/model.safetensors"),
            "resumed, {procs} processes"
        );
    }
}

/// PipeTransformer's freezing with the stages and replicas as processes: four launched
/// processes (two replicas of two stages) freeze the same layers at the same steps as one
/// process with the same pipeline on four devices, and write the same model to the bit. Both
/// under a per-stage memory limit (which each stage process holds from the start); then again
/// with the embedding frozen from the first step (`train.freeze_embeddings`).
#[test]
fn launched_stage_processes_freeze_as_one_process_does() {
    if !have_digits() {
        return;
    }
    for frozen_embedding in [false, true] {
        freeze_across_processes_as_in_one(frozen_embedding);
    }
}

fn freeze_across_processes_as_in_one(frozen_embedding: bool) {
    let embedding = format!("train.freeze_embeddings={frozen_embedding}");
    let run = |dir: &Path, launched: bool| {
        let out = format!("output.dir={}", dir.display());
        let port = free_port().to_string();
        let rdzv = format!("127.0.0.1:{port}");
        let mut args: Vec<&str> = match launched {
            true => vec!["launch", "--nproc-per-node", "4", "--rdzv", &rdzv, "--", "train", "--across-processes"],
            false => vec!["train", "--devices", "4", "--replicas", "2"],
        };
        args.extend(["--config", "configs/vit-digits.toml", "--fresh", "--progress-every", "0", "--pipeline-len", "2"]);
        args.extend(["--freeze", "eq1", "--alpha", "0.3", "--freeze-interval", "8"]);
        args.extend(["--auto-pipe", "false", "--auto-dp", "false", "--cache", "false"]);
        args.extend(["--set", "train.max_steps=24", "--set", "data.test_limit=32", "--set", &out]);
        args.extend(["--set", "pipeline.memory_limit=100000000", "--set", &embedding]);
        let (ok, text) = pipetransformer(&args);
        assert!(ok, "{args:?}: {text}");
        text
    };
    let (one, many) = (scratch(&format!("freeze-one-{embedding}")), scratch(&format!("freeze-across-{embedding}")));
    let want = run(&one, false);
    let got = run(&many, true);
    for text in [&want, &got] {
        assert_eq!(text.contains("the embedding frozen (train.freeze_embeddings)"), frozen_embedding, "{text}");
    }
    // What was frozen when, and on which gradient norms (not the shape each process reports
    // for itself, nor how long the transition took).
    let transitions = |text: &str, rank: &str| -> Vec<String> {
        let lines = text.lines().filter_map(|l| l.strip_prefix(rank)).filter(|l| l.starts_with("transition at step"));
        lines
            .map(|l| format!("{} ({}", l.split(", K").next().unwrap_or(l), l.split_once(" (").map_or("", |x| x.1)))
            .collect()
    };
    let want_transitions = transitions(&want, "");
    assert!(!want_transitions.is_empty(), "the run freezes something: {want}");
    // Every process logs the same transitions, which are one process's (the launcher leads
    // each process's lines with its rank).
    for rank in 0..4 {
        assert_eq!(transitions(&got, &format!("[rank {rank}] ")), want_transitions, "rank {rank}: {got}");
    }
    let model = |dir: &Path| std::fs::read(dir.join("model/model.safetensors")).unwrap();
    assert!(model(&one) == model(&many), "the same model as one process");
    // The checkpoint: weights, the optimizer state the freezes left, the frozen prefix and
    // the controller's state (the plan's replica count aside: each process's is 1).
    let load = |dir: &Path| pipetransformer::train::checkpoint::load(&dir.join("checkpoint.ckpt")).unwrap();
    let ((mut meta_one, tensors_one), (mut meta_many, tensors_many)) = (load(&one), load(&many));
    assert!(meta_one["frozen_prefix"].as_u64().is_some_and(|n| n > 1), "{}", meta_one["frozen_prefix"]);
    assert!(tensors_one == tensors_many, "the checkpoint's tensors");
    meta_one["plan"]["config"]["replicas"] = 1.into();
    meta_many["plan"]["config"]["replicas"] = 1.into();
    assert_eq!(meta_one, meta_many, "the checkpoint's state");
}

/// What a pipeline across processes cannot do is refused by name before anything is written.
#[test]
fn a_pipeline_across_processes_refuses_what_it_cannot_do() {
    if !have_digits() {
        return;
    }
    let dir = scratch("across-refused");
    let out = format!("output.dir={}", dir.display());
    let base = ["train", "--config", "configs/vit-digits.toml", "--fresh", "--across-processes", "--set", &out];
    let (ok, text) = pipetransformer(&base);
    assert!(!ok && text.contains("pipetransformer launch"), "not launched: {text}");
    let (ok, text) = pipetransformer(&[&base[..], &["--replicas", "2"]].concat());
    assert!(!ok && text.contains("pipeline.across_processes") && text.contains("--replicas 1"), "{text}");
    for (flags, key) in [
        (&["--pipeline-len", "2", "--freeze", "eq1", "--max-weight-change", "0.05"][..], "elastic.max_weight_change"),
        (&["--pipeline-len", "2", "--auto-pipe", "true"][..], "elastic.auto_pipe"),
        (&["--pipeline-len", "3"][..], "pipeline_len must be at least 2 and divide 2 (the process count)"),
        // Each process holds its own stage only, so a memory limit applies per stage (below:
        // one that holds is taken) and one no stage fits is refused.
        (&["--pipeline-len", "2", "--set", "pipeline.memory_limit=1000"][..], "fits in 1000 bytes per device"),
    ] {
        let port = free_port().to_string();
        let rdzv = format!("127.0.0.1:{port}");
        let launch = ["launch", "--nproc-per-node", "2", "--rdzv", &rdzv, "--"];
        let (ok, text) = pipetransformer(&[&launch[..], &base[..], flags].concat());
        assert!(!ok && text.contains(key), "{flags:?}: {text}");
    }
    assert!(!dir.join("checkpoint.ckpt").exists() && !dir.join("metrics.jsonl").exists());
    // Whole pipelines per process: a batch too small for every process's replica is refused
    // by its setting, not blamed on the training set.
    let port = free_port().to_string();
    let rdzv = format!("127.0.0.1:{port}");
    let plain = ["train", "--config", "configs/vit-digits.toml", "--fresh", "--set", &out, "--micro-batches", "1"];
    let launch = ["launch", "--nproc-per-node", "2", "--rdzv", &rdzv, "--"];
    let (ok, text) = pipetransformer(&[&launch[..], &plain[..], &["--set", "data.batch_size=1"]].concat());
    let want = "config field `data.batch_size`: 1 sample a step, shared by 2 processes of 1 replica";
    assert!(!ok && text.contains(want), "{text}");
    // Without `--pipeline-len` the stages are the processes: one pipeline of 2.
    let port = free_port().to_string();
    let rdzv = format!("127.0.0.1:{port}");
    let launch = ["launch", "--nproc-per-node", "2", "--rdzv", &rdzv, "--"];
    let short = ["--set", "train.max_steps=2", "--set", "data.test_limit=16", "--micro-batches", "2"];
    let (ok, text) = pipetransformer(&[&launch[..], &base[..], &short[..]].concat());
    assert!(ok && text.contains("stages across 2 processes"), "{text}");
}

/// Killing one process of a launched run ends the other with an error naming it, well within
/// the collective timeout: processes that each hold a whole pipeline, and a pipeline whose
/// stages are the processes.
#[test]
fn killing_one_process_ends_the_other_with_its_rank() {
    if !have_digits() {
        return;
    }
    let across = ["--across-processes", "--pipeline-len", "2"];
    for (name, mode, world) in [("launch-kill", &[][..], 2), ("launch-kill-across", &across[..], 2)] {
        kill_the_last(name, mode, world);
    }
}

/// Two replicas of a two-stage pipeline, four processes: when the last is killed, the other
/// three end with an error naming a peer that closed its connection: its row's, its
/// column's, and the process in neither, which hears it from those two hanging up.
#[test]
fn killing_one_process_of_a_grid_ends_every_other() {
    if !have_digits() {
        return;
    }
    kill_the_last("launch-kill-grid", &["--across-processes", "--pipeline-len", "2"], 4);
}

/// Starts `world` processes of a long run (as `launch` would), kills the last once they
/// train, and checks that every other one fails within 30 s, well inside the 60 s collective
/// timeout, naming a peer that closed its connection (the killed one, where it was a
/// neighbour).
fn kill_the_last(name: &str, mode: &[&str], world: usize) {
    let dir = scratch(name);
    let out = format!("output.dir={}", dir.display());
    let port = free_port().to_string();
    let spawn = |rank: usize| {
        Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
            .args(["train", "--config", "configs/vit-digits.toml", "--fresh", "--progress-every", "0"])
            .args(["--set", "train.epochs=1000", "--set", &out])
            .args(mode)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("PT_RDZV_TOKEN", "kill-test")
            .env("PT_COLLECTIVE_TIMEOUT", "60")
            .spawn_piped()
    };
    let mut all: Vec<_> = (0..world).map(spawn).collect();
    let mut last = all.pop().unwrap();
    // Rank 0 logs its first step only once every process trains (each step waits for its
    // row and column, and theirs for theirs): the kill comes during training.
    let metrics = dir.join("metrics.jsonl");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&metrics).is_ok_and(|m| m.matches("\"event\":\"step\"").count() >= 2) {
        assert!(started.elapsed() < std::time::Duration::from_secs(120), "{name}: no step logged");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    last.kill().unwrap();
    let _ = last.wait();
    let killed = std::time::Instant::now();
    let killed_rank = format!("rank {}", world - 1);
    let mut named = 0;
    for (rank, process) in all.into_iter().enumerate() {
        let result = process.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&result.stderr).to_string() + &String::from_utf8_lossy(&result.stdout);
        assert!(!result.status.success(), "{name}, rank {rank}: {text}");
        assert!(text.contains("closed its connection"), "{name}, rank {rank}: {text}");
        named += usize::from(text.contains(&killed_rank));
    }
    // The first to notice is a neighbour of the killed one, and names it; in a grid the others
    // may hear it from a neighbour that hung up first.
    assert!(named >= 1 && (world > 2 || named == world - 1), "{name}: {named} named {killed_rank}");
    assert!(
        killed.elapsed() < std::time::Duration::from_secs(30),
        "{name}: ended {:?} after the kill",
        killed.elapsed()
    );
}

/// Killing the launcher alone (SIGKILL to its pid: it can pass nothing on) ends the processes
/// it started, within a few seconds: the kernel kills them, and none is left training on its
/// own.
#[test]
fn killing_the_launcher_ends_its_processes() {
    use std::time::{Duration, Instant};
    /// A process's parent and state (`Z` for a zombie), from /proc; None once it is gone.
    fn stat(pid: u32) -> Option<(u32, char)> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let mut after = text[text.rfind(')')? + 1..].split_whitespace();
        let state = after.next()?.chars().next()?;
        Some((after.next()?.parse().ok()?, state))
    }
    let children_of = |parent: u32| -> Vec<u32> {
        let pids = std::fs::read_dir("/proc").unwrap().flatten().filter_map(|e| e.file_name().to_str()?.parse().ok());
        pids.filter(|&pid| stat(pid).is_some_and(|(p, _)| p == parent)).collect()
    };
    let dir = scratch("launch-orphans");
    let (out, rdzv) = (format!("output.dir={}", dir.display()), format!("127.0.0.1:{}", free_port()));
    // Two processes of a run over two nodes, on the first: they wait at the rendezvous for the
    // second node's, which never come, for the whole collective timeout (no data needed).
    let launch = ["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv", &rdzv];
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(launch)
        .args(["--rdzv-token", "orphans", "--", "train", "--config", "configs/vit-digits.toml", "--fresh"])
        .args(["--set", &out])
        .env("PT_COLLECTIVE_TIMEOUT", "120")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut reap = Reap(vec![launcher.id()]);
    // Both children, once they run the program (past exec).
    let started = Instant::now();
    let children = loop {
        let children = children_of(launcher.id());
        for c in &children {
            if !reap.0.contains(c) {
                reap.0.push(*c);
            }
        }
        let train = |c: Vec<u8>| c.split(|b| *b == 0).nth(1) == Some(b"train");
        let running = |pid: &u32| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(train);
        if children.len() == 2 && children.iter().all(running) {
            break children;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the launcher started {children:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(500)); // in the rendezvous
    assert!(Command::new("kill").args(["-KILL", &launcher.id().to_string()]).status().unwrap().success());
    let _ = launcher.wait();
    reap.0.retain(|&p| p != launcher.id());
    let killed = Instant::now();
    // Gone, or a zombie nobody reaped yet: either way no longer running.
    while let Some(left) = children.iter().find(|&&c| stat(c).is_some_and(|(_, state)| state != 'Z')) {
        assert!(killed.elapsed() < Duration::from_secs(5), "process {left} still runs after its launcher was killed");
        std::thread::sleep(Duration::from_millis(50));
    }
    reap.0.clear(); // all gone: their pids may be another's soon
}

/// A tiny ViT export for scikit-learn's digits (8 × 8, pixels 0..=16, classes 0–9) in `dir`,
/// made without training: what `predict` and `evaluate` read from a run's `model/`.
fn tiny_digits_vit(dir: &Path) {
    use pipetransformer::model::{Model, ModelConfig, VitConfig};
    let config = ModelConfig::Vit(VitConfig {
        image_size: 8,
        patch_size: 4,
        num_channels: 1,
        hidden_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 8,
        hidden_act: "gelu".into(),
        layer_norm_eps: 1e-6,
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        num_labels: 10,
    });
    let dev = pipetransformer::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let labels: Vec<String> = (0..10).map(|d| d.to_string()).collect();
    let extras = pipetransformer::weights::ExportExtras { labels: &labels, pixel_max: Some(16), ..Default::default() };
    let model = Model::new(&dev, &config, 3).unwrap();
    pipetransformer::weights::export_model(&model, &dev, &config, &extras, dir).unwrap();
}

/// A tiny character GPT export over `chars` in `dir`.
fn tiny_char_gpt(dir: &Path, chars: &str) {
    use pipetransformer::model::{GptConfig, Model, ModelConfig};
    let chars: Vec<char> = chars.chars().collect();
    let config = ModelConfig::Gpt(GptConfig::without_dropout(chars.len(), 8, 8, 1, 2));
    let dev = pipetransformer::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let extras = pipetransformer::weights::ExportExtras { chars: &chars, ..Default::default() };
    let model = Model::new(&dev, &config, 3).unwrap();
    pipetransformer::weights::export_model(&model, &dev, &config, &extras, dir).unwrap();
}

/// 64 raw digit pixels (0..=16) as a CSV row, different for each `seed`.
fn digit_pixels(seed: usize) -> String {
    (0..64).map(|i| ((i * 7 + seed * 5) % 17).to_string()).collect::<Vec<_>>().join(",")
}

/// The JSON lines of `out`.
fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// An image model's export without `preprocessor_config.json` does not say what scale its
/// pixels were trained at: refused, naming the file, what it holds and why it is needed,
/// instead of scored at a guessed 1/255 (a digits model trained at 1/16 fell from 92 % to
/// 16 % so).
#[test]
fn an_image_model_without_its_pixel_scale_is_refused() {
    let dir = scratch("no-preprocessor");
    let model = dir.join("model");
    tiny_digits_vit(&model);
    let rows = dir.join("rows.csv");
    std::fs::write(&rows, (0..3).map(|i| format!("{},{i}\n", digit_pixels(i))).collect::<String>()).unwrap();
    let (model_arg, rows_arg) = (model.display().to_string(), rows.display().to_string());
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model_arg, "--file", &rows_arg]);
    assert!(ok && out.contains("3 targets"), "{out}");
    // The same rows on standard input (`--file -`), gzip-compressed, score the same.
    let mut child = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
        .args(["evaluate", "--model", &model_arg, "--file", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn_piped();
    let mut encoder = flate2::write::GzEncoder::new(child.stdin.take().unwrap(), flate2::Compression::default());
    encoder.write_all(&std::fs::read(&rows).unwrap()).unwrap();
    drop(encoder.finish().unwrap());
    let piped = child.wait_with_output().unwrap();
    assert!(piped.status.success() && output_text(&piped) == out.replace(&rows_arg, "-"), "{}", output_text(&piped));
    // Bad input on standard input: a short row by its line, a damaged gzip stream by its
    // format, each naming standard input.
    for (bytes, said) in [
        (b"1,2,3\n".to_vec(), "standard input: line 1: a CSV row of 3 values"),
        (vec![0x1f, 0x8b, 8, 0, 1, 2], "standard input: is not a valid gzip stream"),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pipetransformer"))
            .args(["evaluate", "--model", &model_arg, "--file", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn_piped();
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success() && output_text(&out).contains(said), "{}", output_text(&out));
    }
    let (ok, with) = pipetransformer(&["predict", "--model", &model_arg, &digit_pixels(1)]);
    assert!(ok, "{with}");
    // Another scale, another answer: the file's value is what the model reads raw pixels at.
    let preprocessor = model.join("preprocessor_config.json");
    let text = std::fs::read_to_string(&preprocessor).unwrap();
    std::fs::write(&preprocessor, text.replace("0.0625", "0.00392156862745098")).unwrap();
    let (ok, at_255) = pipetransformer(&["predict", "--model", &model_arg, &digit_pixels(1)]);
    assert!(ok && json_lines(&at_255)[0]["probabilities"] != json_lines(&with)[0]["probabilities"], "{at_255}");
    std::fs::remove_file(&preprocessor).unwrap();
    for args in [&["evaluate", "--file", &rows_arg][..], &["predict", &digit_pixels(1)][..]] {
        let (ok, out) = pipetransformer(&[&args[..1], &["--model", &model_arg], &args[1..]].concat());
        assert!(!ok && !out.contains("targets") && !out.contains("probabilit"), "{args:?}: {out}");
        assert!(
            out.contains("preprocessor_config.json: is missing")
                && out.contains("rescale_factor")
                && out.contains("wrong predictions"),
            "{args:?}: {out}"
        );
    }
}

/// A CSV file named as a `predict` input is read as rows of raw pixels (gzip-compressed or
/// not, whatever its name): one answer per row, named `file:line`, each the answer to the row
/// given as an argument. A labelled row is refused, pointing at `evaluate --file`, which reads
/// the same files gzip-compressed too.
#[test]
fn a_csv_file_given_to_predict_is_read_as_rows() {
    let dir = scratch("predict-csv-file");
    let model = dir.join("model");
    tiny_digits_vit(&model);
    let model = model.display().to_string();
    let rows = format!("{}\n\n{}\n", digit_pixels(1), digit_pixels(2));
    let plain = dir.join("rows.csv");
    std::fs::write(&plain, &rows).unwrap();
    let gz = dir.join("rows.csv.gz");
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(rows.as_bytes()).unwrap();
    std::fs::write(&gz, encoder.finish().unwrap()).unwrap();
    let unnamed = dir.join("pixels");
    std::fs::write(&unnamed, &rows).unwrap();
    let files: Vec<String> = [&plain, &gz, &unnamed].iter().map(|p| p.display().to_string()).collect();
    let (one, two) = (digit_pixels(1), digit_pixels(2));
    let args = [&["predict", "--model", &model, &one, &two][..], &files.iter().map(String::as_str).collect::<Vec<_>>()];
    let (ok, out) = pipetransformer(&args.concat());
    assert!(ok, "{out}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 8, "{out}");
    for (i, file) in files.iter().enumerate() {
        for (row, line) in [(0, 1), (1, 3)] {
            let v = &lines[2 + 2 * i + row];
            assert_eq!(v["input"], format!("{file}:{line}"), "{out}");
            assert_eq!(v["probabilities"], lines[row]["probabilities"], "{out}");
        }
    }
    // Labelled rows (a dataset's file): refused by line, saying where they go.
    let labelled = dir.join("labelled.csv");
    std::fs::write(&labelled, format!("{one},1\n{two},2\n")).unwrap();
    let labelled = labelled.display().to_string();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, &labelled]);
    assert!(!ok && out.contains("line 1: a CSV row of 65 values; expected 1×8×8 = 64 pixels"), "{out}");
    assert!(out.contains("`evaluate --file` scores labelled rows") && !out.contains("IDX"), "{out}");
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(format!("{one},1\n{two},2\n").as_bytes()).unwrap();
    let labelled_gz = dir.join("labelled.csv.gz");
    std::fs::write(&labelled_gz, encoder.finish().unwrap()).unwrap();
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--file", &labelled_gz.display().to_string()]);
    assert!(ok && out.contains("2 targets"), "{out}");
}

/// A file `predict` cannot read as an image is named for what it is, not read as IDX: an
/// empty file, one of another format (a JPEG's first bytes), a folder with no file (a folder's
/// files are inputs of their own), a CSV file's header row (failing alone). A CSV file a
/// spreadsheet saved with a byte-order mark is read. `--file` names
/// a list that is not there, or not text (an image given as the list), by what to do.
#[test]
fn files_predict_cannot_read_are_named_for_what_they_are() {
    let dir = scratch("predict-file-kinds");
    let model = dir.join("model");
    tiny_digits_vit(&model);
    let model = model.display().to_string();
    let one = digit_pixels(1);
    let header: Vec<String> = (0..64).map(|i| format!("pixel{i}")).collect();
    let files: [(&str, Vec<u8>); 4] = [
        ("empty.png", Vec::new()),
        ("photo.jpg", b"\xff\xd8\xff\xe0\x00\x10JFIF".to_vec()),
        ("header.csv", format!("{}\n{one}\n", header.join(",")).into_bytes()),
        ("excel.csv", format!("\u{feff}{one}\r\n").into_bytes()),
    ];
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    std::fs::create_dir(dir.join("folder")).unwrap();
    let arg = |name: &str| dir.join(name).display().to_string();
    let names: Vec<String> = ["empty.png", "photo.jpg", "folder", "header.csv", "excel.csv"].map(arg).to_vec();
    let (ok, out) = pipetransformer(
        &[
            &["predict", "--model", &model, "--format", "json"][..],
            &names.iter().map(String::as_str).collect::<Vec<_>>(),
        ]
        .concat(),
    );
    let lines = json_lines(&out);
    // (The header row fails alone: the CSV file's row after it is answered.)
    assert!(!ok && lines.len() == 6 && out.contains("4 of 6 results failed"), "{out}");
    let said = |i: usize| lines[i]["error"].as_str().unwrap_or_default().to_string();
    assert!(said(0).ends_with("is empty; expected an image (PNG, JPEG, PGM), IDX or CSV file"), "{out}");
    assert!(said(1).contains("photo.jpg") && said(1).contains("(FF E0) that runs past the end of the file"), "{out}");
    assert!(
        said(2).contains("is a folder with no files; expected image (PNG, JPEG, PGM), IDX or CSV files in it"),
        "{out}"
    );
    assert!(said(3).contains("line 1: reads as a header row (`pixel0` is no number)"), "{out}");
    assert!(!out.contains("IDX magic") && !out.contains("IDX header"), "{out}");
    // The byte-order mark's row reads as the same row without it.
    let (ok, plain) = pipetransformer(&["predict", "--model", &model, "--format", "json", &one]);
    let plain = &json_lines(&plain)[0]["probabilities"];
    assert!(ok && lines[4]["probabilities"] == *plain && lines[5]["probabilities"] == *plain, "{out}");
    // `--file`: a list not there, and an image given as the list.
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--file", &arg("nowhere.txt")]);
    assert!(!ok && out.contains("nowhere.txt: not found") && out.contains("check the path"), "{out}");
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--file", &arg("photo.jpg")]);
    assert!(
        !ok && out.contains("line 1 holds a NUL byte") && out.contains("an image is given as an argument"),
        "{out}"
    );
    assert!(json_lines(&out).is_empty(), "no input of junk: {out}");
    // (A folder for `evaluate --file` is one of class subfolders; this one has none.)
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--file", &arg("folder")]);
    assert!(!ok && out.contains("folder: holds no class folders; expected one subfolder per class"), "{out}");
    // A gzip-compressed list is read; a damaged one ends with its format named.
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(format!("{one}\n").as_bytes()).unwrap();
    let list = encoder.finish().unwrap();
    std::fs::write(dir.join("list.gz"), &list).unwrap();
    std::fs::write(dir.join("cut.gz"), &list[..list.len() / 2]).unwrap();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--format", "json", "--file", &arg("list.gz")]);
    assert!(ok && json_lines(&out)[0]["probabilities"] == *plain, "{out}");
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--file", &arg("cut.gz")]);
    assert!(!ok && out.contains("cut.gz: is not a valid gzip stream"), "{out}");
}

/// `evaluate --file` on rows of pixels alone says a label is missing, counting the values as
/// they are (not taking the last pixel for the label).
#[test]
fn unlabelled_rows_for_evaluate_say_a_label_is_expected() {
    let dir = scratch("evaluate-unlabelled");
    let model = dir.join("model");
    tiny_digits_vit(&model);
    let rows = dir.join("rows.csv");
    std::fs::write(&rows, format!("{}\n", digit_pixels(0))).unwrap();
    let (model, rows) = (model.display().to_string(), rows.display().to_string());
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--file", &rows]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("line 1: a CSV row of 64 values; expected 1×8×8 = 64 pixels then a label (65 values)"),
        "{out}"
    );
}

/// Scoring a model on a dataset of another kind says what each is.
#[test]
fn a_dataset_of_another_kind_is_refused_saying_what_each_is() {
    if !have_digits() || !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("evaluate-kind");
    let (gpt, vit) = (dir.join("gpt"), dir.join("vit"));
    tiny_char_gpt(&gpt, "abc");
    tiny_digits_vit(&vit);
    let (gpt, vit) = (gpt.display().to_string(), vit.display().to_string());
    let (ok, out) = pipetransformer(&["evaluate", "--model", &gpt, "--config", "configs/vit-digits.toml"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains(
            "the model is a character-level GPT (3 characters); this config's dataset digits is image \
             classification with 10 classes (0, 1, 2, …, 8, 9)"
        ),
        "{out}"
    );
    let (ok, out) = pipetransformer(&["evaluate", "--model", &vit, "--config", "configs/gpt-hamlet.toml"]);
    assert!(!ok && out.contains("the model is a ViT image classifier with 10 classes"), "{out}");
    assert!(out.contains("this config's dataset hamlet is character-level text"), "{out}");
    // The same kind, other characters: said so.
    let (ok, out) = pipetransformer(&["evaluate", "--model", &gpt, "--config", "configs/gpt-hamlet.toml"]);
    assert!(!ok && out.contains("expected the characters the model was trained on"), "{out}");
}

/// Sampling flags are checked once, before any input: a bad temperature is one error, not
/// one per prompt, and a model that does not generate refuses them instead of ignoring them.
#[test]
fn sampling_flags_are_checked_once_before_any_input() {
    let dir = scratch("predict-flags");
    let (gpt, vit) = (dir.join("gpt"), dir.join("vit"));
    tiny_char_gpt(&gpt, "HAMLET: obe");
    tiny_digits_vit(&vit);
    let (gpt, vit) = (gpt.display().to_string(), vit.display().to_string());
    let (ok, out) = pipetransformer(&["predict", "--model", &gpt, "HAMLET: To be", "To be", "--temperature=-1"]);
    assert!(!ok && out.matches("--temperature").count() == 1 && out.contains("is -1"), "{out}");
    assert!(json_lines(&out).is_empty(), "{out}");
    let (ok, out) = pipetransformer(&["predict", "--model", &gpt, "To be", "--temperature=0", "--max-new-tokens=2"]);
    assert!(ok && json_lines(&out).len() == 1, "{out}");
    let (ok, out) = pipetransformer(&["predict", "--model", &vit, &digit_pixels(0), "--max-new-tokens", "5"]);
    assert!(!ok && json_lines(&out).is_empty(), "{out}");
    assert!(out.contains("--max-new-tokens 5 only applies to text generation (a GPT)"), "{out}");
    assert!(out.contains("the model is a ViT image classifier with 10 classes"), "{out}");
}

/// `predict --format table` starts with a header naming its columns.
#[test]
fn a_predict_table_has_a_header() {
    let dir = scratch("predict-table");
    tiny_digits_vit(&dir.join("model"));
    let model = dir.join("model").display().to_string();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "--format", "table", &digit_pixels(0)]);
    let lines: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
    assert!(ok && lines.len() == 2, "{out}");
    assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), ["input", "label", "probability"], "{out}");
    assert!(lines[1].ends_with('%'), "{out}");
}

/// `--batch-size 0` is refused the same way by every path of `predict` and `evaluate` (with
/// `--config` too, where the flag sets the evaluation batches), as a usage error before
/// anything loads; `evaluate` without data names both choices; bad sampling is a usage error
/// before the model loads.
#[test]
fn predict_and_evaluate_usage_errors_are_said_once_up_front() {
    let usage = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(args).output().unwrap();
        let text = output_text(&out);
        (out.status.code(), text)
    };
    for args in [
        &["evaluate", "--model", "m", "--config", "configs/gpt-hamlet.toml", "--batch-size", "0"][..],
        &["evaluate", "--model", "m", "--file", "rows.csv", "--batch-size", "0"][..],
        &["predict", "--model", "m", "--batch-size", "0", "1,2"][..],
    ] {
        let (code, err) = usage(args);
        assert!(code == Some(2) && err.contains("'--batch-size <BATCH_SIZE>': must be at least 1"), "{args:?}: {err}");
    }
    let (code, err) = usage(&["evaluate", "--model", "m"]);
    assert!(code != Some(0) && err.contains("--config") && err.contains("--file"), "{err}");
    let (code, err) = usage(&["predict", "--model", "m", "To be", "--temperature=-1"]);
    assert!(code == Some(2) && err.matches("--temperature").count() == 1 && !err.contains("loading"), "{err}");
    let (code, help) = usage(&["predict", "--help"]);
    assert_eq!(code, Some(0));
    assert!(!help.contains("run's devices") && !help.contains("bench-step") && help.contains("CSV files"), "{help}");
}

/// A BERT trains on the user's own labelled texts (`dataset = "labelled_texts"`): the classes
/// are the file's labels, the held-out file is what it scores (or a seeded cut without one),
/// its export predicts by those labels, and `evaluate --file` reads the same rows. A resume
/// after the file was edited (same rows, other words) is refused by the file's name.
#[test]
fn a_bert_trains_on_the_users_labelled_texts() {
    let dir = scratch("user-texts");
    let tokenizer = dir.join("tokenizer");
    std::fs::create_dir_all(&tokenizer).unwrap();
    std::fs::copy("tests/fixtures/tiny_tokenizer.json", tokenizer.join("tokenizer.json")).unwrap();
    let rows = |n: usize, cat: &str, dog: &str| -> String {
        (0..n).map(|i| if i % 2 == 0 { format!("cat\t{cat}\n") } else { format!("dog\t{dog}\n") }).collect()
    };
    let (train, test) = (dir.join("train.tsv"), dir.join("test.tsv"));
    std::fs::write(&train, rows(24, "the cat sat on the mat", "a big dog ran far")).unwrap();
    std::fs::write(&test, rows(6, "the cat sat", "the dog ran")).unwrap();
    let bert = "{ family = \"bert\", vocab_size = 0, hidden_size = 16, num_hidden_layers = 1, num_attention_heads = 2, \
                intermediate_size = 32, max_position_embeddings = 16 }";
    let config = dir.join("texts.toml");
    let text = format!(
        "[model]\nconfig = {bert}\ntokenizer = \"{}\"\n[data]\ndataset = \"labelled_texts\"\ntrain_file = \"{}\"\n\
         test_file = \"{}\"\nbatch_size = 8\nmax_len = 16\n[train]\nepochs = 1\nmax_steps = 2\nlr = 1e-3\n[output]\ndir = \"{}\"\n",
        tokenizer.display(),
        train.display(),
        test.display(),
        dir.join("run").display()
    );
    std::fs::write(&config, text).unwrap();
    let config = config.display().to_string();
    let (ok, out) = pipetransformer(&["train", "--config", &config, "--fresh", "--progress-every", "0"]);
    assert!(ok && out.contains("data: labelled_texts — 24 training / 6 test samples, 2 classes"), "{out}");
    // Without the held-out file, a seeded cut of a quarter.
    let (ok, out) = pipetransformer(&[
        "train",
        "--config",
        &config,
        "--fresh",
        "--set",
        "data.test_file=none",
        "--set",
        "data.test_fraction=0.25",
        "--set",
        &format!("output.dir=\"{}\"", dir.join("cut").display()),
        "--progress-every",
        "0",
    ]);
    assert!(ok && out.contains("data: labelled_texts — 18 training / 6 test samples, 2 classes"), "{out}");
    // A length that leaves no room for text beside the special tokens names the run's setting.
    let short = ["train", "--config", &config, "--fresh", "--set", "data.max_len=2"];
    let (ok, out) =
        pipetransformer(&[&short[..], &["--set", &format!("output.dir=\"{}\"", dir.join("short").display())]].concat());
    assert!(!ok && out.contains("config field `data.max_len`: is 2; it must exceed the 3 special tokens"), "{out}");

    let model = dir.join("run").display().to_string();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, "the cat sat"]);
    let label = json_lines(&out).first().map(|l| l["label"].as_str().unwrap_or_default().to_string());
    assert!(ok && matches!(label.as_deref(), Some("cat" | "dog")), "{out}");
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--file", test.to_str().unwrap()]);
    assert!(ok && out.contains("6 targets"), "{out}");
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--config", &config]);
    assert!(ok && out.contains("6 targets"), "{out}");

    std::fs::write(&train, rows(24, "the red cat sat on the mat", "a big dog ran far")).unwrap();
    let written = |f: &str| std::fs::read(dir.join("run").join(f)).unwrap();
    let (checkpoint, log) = (written("checkpoint.ckpt"), written("metrics.jsonl"));
    let (ok, out) = pipetransformer(&[
        "train",
        "--config",
        &config,
        "--resume",
        "--set",
        "train.max_steps=4",
        "--progress-every",
        "0",
    ]);
    assert!(!ok && out.contains("taken over other training data: with data.train_file = \"train.tsv #"), "{out}");
    // The refusal loses nothing the run wrote.
    assert!(written("checkpoint.ckpt") == checkpoint && written("metrics.jsonl") == log);
}

/// A GPT trains on the user's own text (`dataset = "text_corpus"`): its last tenth held out,
/// or a held-out file, and the export continues a prompt in its characters.
#[test]
fn a_gpt_trains_on_the_users_text() {
    let dir = scratch("user-corpus");
    let (train, held_out) = (dir.join("corpus.txt"), dir.join("held-out.txt.gz"));
    std::fs::write(&train, "to be or not to be, that is the question. ".repeat(8)).unwrap();
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all("whether tis nobler in the mind to suffer ".as_bytes()).unwrap();
    std::fs::write(&held_out, encoder.finish().unwrap()).unwrap();
    let run = |extra: &[&str], name: &str| {
        let out_dir = format!("output.dir=\"{}\"", dir.join(name).display());
        let train_file = format!("data.train_file=\"{}\"", train.display());
        let args = [
            "train",
            "--config",
            "configs/gpt-hamlet.toml",
            "--fresh",
            "--progress-every",
            "0",
            "--set",
            "data.dataset=\"text_corpus\"",
            "--set",
            &train_file,
            "--set",
            &out_dir,
            "--set",
            "model.config.n_embd=16",
            "--set",
            "model.config.n_layer=1",
            "--set",
            "model.config.n_head=2",
            "--set",
            "data.max_len=16",
            "--set",
            "data.batch_size=4",
            "--set",
            "train.max_steps=2",
        ];
        pipetransformer(&[&args[..], extra].concat())
    };
    // 336 characters, 33 held out: (303 − 1) / 16 = 18 training sequences, (33 − 1) / 16 = 2.
    let (ok, out) = run(&[], "end");
    assert!(
        ok && out.contains("data: text_corpus — 18 training / 2 test samples, a vocabulary of 15 characters"),
        "{out}"
    );
    // A held-out file: its characters join the vocabulary; all 336 train.
    let test_file = format!("data.test_file=\"{}\"", held_out.display());
    let (ok, out) = run(&["--set", &test_file], "file");
    assert!(
        ok && out.contains("data: text_corpus — 20 training / 2 test samples, a vocabulary of 20 characters"),
        "{out}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("file/summary.json")).unwrap()).unwrap();
    assert!(summary["unigram_baseline_loss"].as_f64().is_some_and(|l| l > 0.0), "{summary}");
    // A held-out file too short for one sequence is named, not the training file.
    let short = dir.join("short.txt");
    std::fs::write(&short, "abc").unwrap();
    let (ok, out) = run(&["--set", &format!("data.test_file=\"{}\"", short.display())], "short");
    assert!(!ok && out.contains("the held-out part of") && out.contains("short.txt holds 3 characters"), "{out}");
    // One too short for any sequence names the file, not a `max_len` no value meets.
    std::fs::write(&short, "a").unwrap();
    let (ok, out) = run(&["--set", &format!("data.test_file=\"{}\"", short.display())], "shorter");
    let said = "the held-out part of ";
    assert!(!ok && out.contains("data.test_file") && out.contains(said) && !out.contains("max_len"), "{out}");
    assert!(out.contains("short.txt holds 1 character; a sequence needs at least 2"), "{out}");
    // A written vocabulary size is the data's or refused, not overwritten unsaid.
    let (ok, out) = run(&["--set", "model.config.vocab_size=5"], "vocab");
    let said = "model.config.vocab_size`: is 5, but text_corpus has 15 characters: set it to 15 or to 0";
    assert!(!ok && out.contains(said), "{out}");
    let model = dir.join("file").display().to_string();
    let (ok, out) =
        pipetransformer(&["predict", "--model", &model, "whether", "--temperature", "0", "--max-new-tokens", "4"]);
    let generated = json_lines(&out).first().map(|l| l["generated"].as_str().unwrap_or_default().chars().count());
    assert!(ok && generated == Some(4), "{out}");
}

/// `PT_EMU_SEED` runs the emulated kernels in another block and thread order (named in the
/// device's banner): the losses agree with seed 0's to rounding (a kernel with a race would
/// not); a seed that is no number is refused by name.
#[test]
fn the_emulators_order_is_drawn_from_pt_emu_seed() {
    if !common::installed(&[Path::new("data/digits/digits.csv.gz")]) {
        return;
    }
    let dir = scratch("emu-seed");
    let run = |seed: &str| {
        let out_dir = format!("output.dir={}", dir.join(format!("seed-{seed}")).display());
        let args = [
            "train",
            "--config",
            "configs/vit-digits.toml",
            "--device",
            "cuda-emu",
            "--fresh",
            "--progress-every",
            "0",
            "--set",
            "train.max_steps=2",
            "--set",
            "data.train_limit=64",
            "--set",
            "data.test_limit=16",
            "--set",
            &out_dir,
        ];
        let out = Command::new(env!("CARGO_BIN_EXE_pipetransformer")).args(args).env("PT_EMU_SEED", seed).output();
        let out = out.unwrap();
        (out.status.success(), output_text(&out))
    };
    let losses = |seed: &str| -> Vec<f64> {
        let log = std::fs::read_to_string(dir.join(format!("seed-{seed}/metrics.jsonl"))).unwrap();
        let events = log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        events.filter(|e| e["event"] == "step").map(|e| e["loss"].as_f64().unwrap()).collect()
    };
    let (ok, out) = run("0");
    assert!(ok && out.contains("cuda-emu:0 (seed 0, "), "{out}");
    let (ok, out) = run("7");
    assert!(ok && out.contains("cuda-emu:0 (seed 7, "), "{out}");
    let (natural, drawn) = (losses("0"), losses("7"));
    assert_eq!(natural.len(), 2);
    for (a, b) in natural.iter().zip(&drawn) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{natural:?} vs {drawn:?}");
    }
    let (ok, out) = run("seven");
    assert!(!ok && out.contains("PT_EMU_SEED") && out.contains("is \"seven\"; expected a whole number"), "{out}");
}

/// Attention heads wider than the GPU kernels run are refused by the model's setting when
/// the run is built, on `cuda-emu` as on `cuda`; the cpu backend trains them.
#[test]
fn a_head_wider_than_the_gpu_kernels_is_refused_by_its_setting() {
    if !common::installed(&[Path::new("data/text/hamlet.txt")]) {
        return;
    }
    let dir = scratch("wide-head");
    let run = |device: &str| {
        let out_dir = format!("output.dir={}", dir.join(device).display());
        pipetransformer(&[
            "train",
            "--config",
            "configs/gpt-hamlet.toml",
            "--device",
            device,
            "--fresh",
            "--progress-every",
            "0",
            "--set",
            "model.config.n_embd=136",
            "--set",
            "model.config.n_head=1",
            "--set",
            "model.config.n_layer=1",
            "--set",
            "data.max_len=16",
            "--set",
            "data.train_limit=8",
            "--set",
            "data.test_limit=4",
            "--set",
            "train.max_steps=1",
            "--set",
            &out_dir,
        ])
    };
    let (ok, out) = run("cuda-emu");
    assert!(
        !ok && out.contains("config field `model.config`: a hidden size of 136 over 1 head is 136 channels"),
        "{out}"
    );
    assert!(out.contains("run at most 128") && !out.contains("done:"), "{out}");
    let (ok, out) = run("cpu");
    assert!(ok && out.contains("done: 1 step "), "{out}");
}

/// Freed devices lend their threads only where they are cpu devices: on emulated GPUs they
/// become replicas, and the run says why at its start.
#[test]
fn freed_gpu_devices_become_replicas_saying_threads_are_a_cpu_setting() {
    if !common::installed(&[Path::new("data/digits/digits.csv.gz")]) {
        return;
    }
    let dir = scratch("freed-emu");
    let out_dir = format!("output.dir={}", dir.display());
    let (ok, out) = pipetransformer(&[
        "train",
        "--config",
        "configs/vit-digits.toml",
        "--device",
        "cuda-emu",
        "--freeze",
        "alpha",
        "--auto-pipe",
        "--auto-dp",
        "--devices",
        "4",
        "--pipeline-len",
        "2",
        "--freed-devices",
        "threads",
        "--fresh",
        "--progress-every",
        "0",
        "--set",
        "train.max_steps=1",
        "--set",
        "data.train_limit=32",
        "--set",
        "data.test_limit=8",
        "--set",
        &out_dir,
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("they become replicas (elastic.freed_devices = \"threads\" applies to cpu devices"), "{out}");
}

/// A device flag names a kind, not one device: `cuda:1` is refused saying how a count is given,
/// and the message is the flag's (clap names it), not a config field's.
#[test]
fn a_device_named_by_index_is_refused_saying_how_to_count() {
    let (ok, out) = pipetransformer(&["train", "--config", "configs/vit-digits.toml", "--device", "cuda:1"]);
    assert!(!ok && out.contains("invalid value 'cuda:1' for '--device <DEVICE>': unknown device `cuda:1`"), "{out}");
    assert!(
        out.contains("(a kind, not one device: train and plan take how many as --devices N")
            && !out.contains("config field"),
        "{out}"
    );
}

/// `train` of the tiny ViT of `configs/vit-digits.toml`, with `extra` flags.
fn train_tiny_vit(extra: &[&str]) -> (bool, String) {
    pipetransformer(&[&["train", "--config", "configs/vit-digits.toml", "--progress-every", "0"][..], extra].concat())
}

/// [`train_tiny_vit`] on a user's images (batches of 8), with `extra` flags.
fn train_on_users_images(extra: &[&str]) -> (bool, String) {
    let base = ["--set", "data.dataset=\"labelled_images\"", "--set", "data.batch_size=8"];
    train_tiny_vit(&[&base[..], extra].concat())
}

/// Class folders `even` and `odd` of 16 images in `dir/train` and 8 in `dir/test`: image `i`
/// (`{i:02}.pgm`, even `i` in `even`) holds `bytes(i)`.
fn write_even_odd_folders(dir: &Path, bytes: impl Fn(usize) -> Vec<u8>) {
    for i in 0..24 {
        let class = if i % 2 == 0 { "even" } else { "odd" };
        let folder = if i < 16 { "train" } else { "test" };
        let path = dir.join(folder).join(class).join(format!("{i:02}.pgm"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes(i)).unwrap();
    }
}

/// The loss printed on the first line of `out` holding `marker` (`final eval:`, `targets:`).
fn printed_loss(out: &str, marker: &str) -> Option<String> {
    let line = out.lines().find(|l| l.contains(marker))?;
    line.split("loss ").nth(1).and_then(|l| l.split(',').next()).map(str::to_string)
}

/// `evaluate` of `model` on a user's images of two classes, through `configs/vit-digits.toml`
/// with the `--set`s naming the files (`data.train_file=…`, `data.test_file=…`).
fn user_images_evaluation<'a>(model: &'a str, train_file: &'a str, test_file: &'a str) -> [&'a str; 13] {
    [
        "evaluate",
        "--model",
        model,
        "--config",
        "configs/vit-digits.toml",
        "--set",
        "data.dataset=\"labelled_images\"",
        "--set",
        train_file,
        "--set",
        test_file,
        "--set",
        "model.config.num_labels=2",
    ]
}

/// A ViT trains on the user's own images (`dataset = "labelled_images"`): CSV rows of raw
/// pixels then a label, scaled by `data.pixel_max`, which the export carries, so `predict`
/// reads raw rows the same; images of another size than the model's are refused by its setting.
#[test]
fn a_vit_trains_on_the_users_labelled_images() {
    let dir = scratch("user-images");
    let (train, test) = (dir.join("train.csv"), dir.join("test.csv"));
    let rows = |n: usize, from: usize| -> String {
        (from..from + n).map(|i| format!("{},{}\n", digit_pixels(i), if i % 2 == 0 { "even" } else { "odd" })).collect()
    };
    std::fs::write(&train, rows(40, 0)).unwrap();
    std::fs::write(&test, rows(10, 40)).unwrap();
    let run = |extra: &[&str]| {
        let args = ["--fresh", "--set", "data.pixel_max=16", "--set", "train.max_steps=2"];
        train_on_users_images(&[&args[..], &["--set", "model.config.num_labels=2"], extra].concat())
    };
    let out_dir = format!("output.dir=\"{}\"", dir.join("run").display());
    let (train_file, test_file) =
        (format!("data.train_file=\"{}\"", train.display()), format!("data.test_file=\"{}\"", test.display()));
    let (ok, out) = run(&["--set", &train_file, "--set", &test_file, "--set", &out_dir]);
    assert!(ok && out.contains("data: labelled_images — 40 training / 10 test samples, 2 classes"), "{out}");
    let model = dir.join("run").display().to_string();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, &digit_pixels(3)]);
    let label = json_lines(&out).first().map(|l| l["label"].as_str().unwrap_or_default().to_string());
    assert!(ok && matches!(label.as_deref(), Some("even" | "odd")), "{out}");
    let (ok, out) = pipetransformer(&["evaluate", "--model", &model, "--file", test.to_str().unwrap()]);
    assert!(ok && out.contains("10 targets"), "{out}");
    // Scored from a config, at the run's scale; at another one, refused by the setting.
    let config = user_images_evaluation(&model, &train_file, &test_file);
    let (ok, out) = pipetransformer(&[&config[..], &["--set", "data.pixel_max=16"]].concat());
    assert!(ok && out.contains("10 targets"), "{out}");
    let (ok, out) = pipetransformer(&config);
    assert!(!ok && out.contains("data.pixel_max`: is 255 here, 16 in the model's run"), "{out}");
    // A run that starts over in the folder, on classes named otherwise, sets this one's
    // checkpoint and export aside together: each checkpoint answers in its own run's classes.
    let renamed = |text: String| text.replace(",even", ",a").replace(",odd", ",b");
    let (train2, test2) = (dir.join("train2.csv"), dir.join("test2.csv"));
    std::fs::write(&train2, renamed(rows(40, 0))).unwrap();
    std::fs::write(&test2, renamed(rows(10, 40))).unwrap();
    let (train2, test2) =
        (format!("data.train_file=\"{}\"", train2.display()), format!("data.test_file=\"{}\"", test2.display()));
    let (ok, out) = run(&["--set", &train2, "--set", &test2, "--set", &out_dir]);
    assert!(ok, "{out}");
    let label_of = |checkpoint: &str| {
        let path = dir.join("run").join(checkpoint).display().to_string();
        let (ok, out) = pipetransformer(&["predict", "--model", &path, &digit_pixels(3)]);
        let label = json_lines(&out).first().map(|l| l["label"].as_str().unwrap_or_default().to_string());
        label.filter(|_| ok).unwrap_or_else(|| panic!("{checkpoint}: {out}"))
    };
    assert!(matches!(label_of("checkpoint.previous.ckpt").as_str(), "even" | "odd"));
    assert!(matches!(label_of("checkpoint.ckpt").as_str(), "a" | "b"));
    // 3×3 images for a model of 8×8 ones: refused by the model's setting, before a step.
    let small = dir.join("small.csv");
    std::fs::write(&small, (0..8).map(|i| format!("0,1,2,3,4,5,6,7,{},{}\n", i % 9, i % 2)).collect::<String>())
        .unwrap();
    let small = format!("data.train_file=\"{}\"", small.display());
    let other_dir = format!("output.dir=\"{}\"", dir.join("small").display());
    let (ok, out) = run(&["--set", &small, "--set", &other_dir]);
    assert!(
        !ok && out.contains("model.config") && out.contains("are 1 channel of 3×3") && !out.contains("done:"),
        "{out}"
    );
}

/// A ViT trains on a folder of class subfolders of images (`labelled_images` where
/// `data.train_file` names a folder); `predict` reads one of those files and the held-out
/// folder, and `evaluate --config` and `evaluate --file` score that folder to the run's own
/// final loss; `data.pixel_max` (for raw
/// CSV rows) is refused beside a folder, and so is a held-out folder that is the training one;
/// a resume after an image was edited is refused by the folder's name, losing nothing written.
#[test]
fn a_vit_trains_on_a_folder_of_the_users_images() {
    let dir = scratch("user-folder");
    let image = |seed: usize| {
        let pixels: Vec<u8> = (0..64).map(|i| ((i * 7 + seed * 5) % 17 * 15) as u8).collect();
        [b"P5\n8 8\n255\n".to_vec(), pixels].concat()
    };
    write_even_odd_folders(&dir, image);
    let train_file = format!("data.train_file=\"{}\"", dir.join("train").display());
    let test_file = format!("data.test_file=\"{}\"", dir.join("test").display());
    let out_dir = format!("output.dir=\"{}\"", dir.join("run").display());
    let files = ["--set", &train_file, "--set", &test_file, "--set", &out_dir, "--set", "model.config.num_labels=2"];
    let run = |extra: &[&str]| train_on_users_images(&[&files[..], extra].concat());
    let (ok, out) = run(&["--fresh", "--set", "data.pixel_max=16"]);
    assert!(!ok && out.contains("data.pixel_max`: is 16, but data.train_file") && out.contains("is a folder"), "{out}");
    let same = format!("data.test_file=\"{}/\"", dir.join("train").display());
    let (ok, out) = run(&["--fresh", "--set", &same]);
    assert!(!ok && out.contains("data.test_file`: is ") && out.contains("the training data itself"), "{out}");
    let (ok, out) = run(&["--fresh", "--set", "train.max_steps=2"]);
    assert!(ok && out.contains("data: labelled_images — 16 training / 8 test samples, 2 classes"), "{out}");
    let trained = printed_loss(&out, "final eval:");
    let model = dir.join("run").display().to_string();
    let file = dir.join("test/even/16.pgm").display().to_string();
    let (ok, out) = pipetransformer(&["predict", "--model", &model, &file]);
    let label = json_lines(&out).first().map(|l| l["label"].as_str().unwrap_or_default().to_string());
    assert!(ok && matches!(label.as_deref(), Some("even" | "odd")), "{out}");
    // Scored again from the folders by `evaluate --config`: the run's final loss.
    let (ok, scored) = pipetransformer(&user_images_evaluation(&model, &train_file, &test_file));
    assert!(
        ok && scored.contains("8 targets") && trained.is_some() && printed_loss(&scored, "targets:") == trained,
        "{scored}"
    );
    // ...and by `evaluate --file` from the held-out folder alone, its subfolders' names the
    // classes; `predict` answers each image of the folder.
    let test_dir = dir.join("test").display().to_string();
    let (ok, scored) = pipetransformer(&["evaluate", "--model", &model, "--file", &test_dir]);
    assert!(ok && scored.contains("8 targets") && printed_loss(&scored, "targets:") == trained, "{scored}");
    let (ok, out) = pipetransformer(&["predict", "--model", &model, &test_dir]);
    assert!(ok && json_lines(&out).len() == 8 && json_lines(&out)[0]["input"] == file, "{out}");

    std::fs::write(dir.join("train/odd/01.pgm"), image(99)).unwrap();
    let written = |f: &str| std::fs::read(dir.join("run").join(f)).unwrap();
    let (checkpoint, log) = (written("checkpoint.ckpt"), written("metrics.jsonl"));
    let (ok, out) = run(&["--resume", "--set", "train.max_steps=4"]);
    assert!(!ok && out.contains("taken over other training data: with data.train_file = \"train #"), "{out}");
    assert!(written("checkpoint.ckpt") == checkpoint && written("metrics.jsonl") == log);
}

/// Random augmentation of training images (`data.random_flip`, `data.random_crop`): a run
/// draws other batches than one without it (another loss from the first step), and the same
/// ones when resumed, into its second epoch (a run of 4 steps and one of 2 resumed to 4 log
/// the same losses and gradient norms, bit for bit: a view depends on the seed, the epoch and
/// the sample alone); AutoCache, which would keep one view of a sample, is refused unless
/// allowed; a resume that turns a draw off names the change.
#[test]
fn random_augmentation_draws_by_epoch_and_resumes_to_the_bit() {
    if !have_digits() {
        return;
    }
    let dir = scratch("augment");
    let train = |name: &str, extra: &[&str]| {
        let out_dir = format!("output.dir=\"{}\"", dir.join(name).display());
        let base = [
            "--set",
            "data.train_limit=64",
            "--set",
            "data.test_limit=16",
            // A learning rate that does not follow train.max_steps, which the resume raises.
            "--set",
            "train.decay=\"constant\"",
            "--set",
            "train.warmup_fraction=0",
            "--set",
            &out_dir,
        ];
        train_tiny_vit(&[&base[..], extra].concat())
    };
    let steps = |name: &str| -> Vec<(u64, u64, u64)> {
        let log = std::fs::read_to_string(dir.join(name).join("metrics.jsonl")).unwrap();
        let events = log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        let steps = events.filter(|e| e["event"] == "step");
        let bits = |e: &serde_json::Value, k: &str| e[k].as_f64().unwrap().to_bits();
        steps.map(|e| (e["step"].as_u64().unwrap(), bits(&e, "loss"), bits(&e, "grad_norm"))).collect()
    };
    let augment = ["--set", "data.random_flip=true", "--set", "data.random_crop=1"];
    let four = ["--fresh", "--set", "train.max_steps=4"];
    let (ok, out) = train("plain", &four);
    assert!(ok, "{out}");
    let (ok, out) = train("straight", &[&augment[..], &four[..]].concat());
    assert!(ok, "{out}");
    let (plain, straight) = (steps("plain"), steps("straight"));
    assert_eq!(straight.len(), 4, "{straight:?}");
    assert_ne!(plain[0].1, straight[0].1, "augmentation changed nothing");
    let (ok, out) = train("resumed", &[&augment[..], &["--fresh", "--set", "train.max_steps=2"]].concat());
    assert!(ok, "{out}");
    let (ok, out) = train("resumed", &[&augment[..], &["--resume", "--set", "train.max_steps=4"]].concat());
    assert!(ok, "{out}");
    let mut resumed = steps("resumed");
    resumed.dedup_by_key(|s| s.0);
    assert_eq!(resumed, straight);

    let cache = ["--freeze", "alpha", "--auto-pipe", "--cache", "true", "--fresh", "--set", "train.max_steps=2"];
    let (ok, out) = train("cached", &[&augment[..], &cache[..]].concat());
    assert!(!ok && out.contains("randomly augmented") && out.contains("elastic.cache_augmented"), "{out}");
    let allowed = ["--set", "elastic.cache_augmented=true"];
    let (ok, out) = train("cached", &[&augment[..], &cache[..], &allowed[..]].concat());
    assert!(ok, "{out}");
    let (ok, out) = train("straight", &["--set", "data.random_crop=1", "--resume", "--set", "train.max_steps=5"]);
    assert!(ok && out.contains("data.random_flip true → false"), "{out}");
    // A crop padded by the images' side (8) or more could be all padding: refused.
    let (ok, out) = train("wide", &["--fresh", "--set", "data.random_crop=8"]);
    assert!(!ok && out.contains("data.random_crop`: is 8, but the images are 8×8"), "{out}");
}

/// `data.resize_to`: a folder of images of several sizes and shapes trains once each is
/// resized to the model's size; the export says so, so `evaluate --file` scores the held-out
/// folder, resizing its files alike, to the run's own final loss, and `predict` takes a file
/// of another size. Without it the first image of another size is named; beside CSV rows,
/// which are read at their own size, it is refused.
#[test]
fn a_vit_trains_on_a_folder_of_images_of_any_size_resized() {
    let dir = scratch("user-folder-resize");
    let image = |seed: usize, w: usize, h: usize| {
        let pixels: Vec<u8> = (0..w * h).map(|i| ((i * 7 + seed * 5) % 17 * 15) as u8).collect();
        [format!("P5\n{w} {h}\n255\n").into_bytes(), pixels].concat()
    };
    let sizes = [(8, 8), (12, 12), (10, 6), (5, 5)];
    write_even_odd_folders(&dir, |i| {
        let (w, h) = sizes[i / 2 % 4];
        image(i, w, h)
    });
    let train = |extra: &[&str]| {
        let base = ["--fresh", "--set", "model.config.num_labels=2", "--set", "train.max_steps=2"];
        train_on_users_images(&[&base[..], extra].concat())
    };
    let (train_dir, test_dir, run_dir) = (dir.join("train"), dir.join("test"), dir.join("run"));
    let train_file = format!("data.train_file=\"{}\"", train_dir.display());
    let test_file = format!("data.test_file=\"{}\"", test_dir.display());
    let out_dir = format!("output.dir=\"{}\"", run_dir.display());
    let files = ["--set", &train_file, "--set", &test_file, "--set", &out_dir];
    let (ok, out) = train(&files);
    assert!(!ok && out.contains("expected every image of one size") && out.contains("data.resize_to"), "{out}");
    let (ok, out) = train(&[&files[..], &["--set", "data.resize_to=16"]].concat());
    assert!(!ok && out.contains("data.resize_to`: is 16, but model.config.image_size is 8"), "{out}");
    let (ok, out) = train(&[&files[..], &["--set", "data.resize_to=8"]].concat());
    assert!(ok && out.contains("data: labelled_images — 16 training / 8 test samples, 2 classes"), "{out}");
    let trained = printed_loss(&out, "final eval:");
    let preprocessor = std::fs::read_to_string(run_dir.join("model/preprocessor_config.json")).unwrap();
    assert!(preprocessor.contains("\"do_resize\": true"), "{preprocessor}");
    let model = run_dir.display().to_string();
    let (ok, scored) = pipetransformer(&["evaluate", "--model", &model, "--file", test_dir.to_str().unwrap()]);
    assert!(
        ok && scored.contains("8 targets") && trained.is_some() && printed_loss(&scored, "targets:") == trained,
        "{scored}"
    );
    let big = test_dir.join("odd/19.pgm");
    let (ok, out) = pipetransformer(&["predict", "--model", &model, big.to_str().unwrap()]);
    assert!(ok && json_lines(&out).len() == 1 && json_lines(&out)[0]["label"].is_string(), "{out}");

    let rows = dir.join("rows.csv");
    std::fs::write(&rows, (0..8).map(|i| format!("{},{}\n", digit_pixels(i), i % 2)).collect::<String>()).unwrap();
    let rows = format!("data.train_file=\"{}\"", rows.display());
    let (ok, out) = train(&["--set", &rows, "--set", &out_dir, "--set", "data.resize_to=8"]);
    assert!(!ok && out.contains("data.resize_to`: is 8, but data.train_file") && out.contains("pixel rows"), "{out}");
}

/// A folder of colour JPEGs (the decoder's fixtures, of three sizes and every sampling), resized:
/// trained on, scored by `evaluate --file` to the run's own final loss, classified by `predict`.
#[test]
fn a_vit_trains_on_a_folder_of_jpeg_photos() {
    let dir = scratch("user-jpegs");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jpeg");
    let mut photos: Vec<std::path::PathBuf> = std::fs::read_dir(&fixtures)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg") && !p.to_string_lossy().contains("gray"))
        .collect();
    photos.sort();
    assert!(photos.len() >= 24, "{} colour fixtures", photos.len());
    for (i, photo) in photos[..24].iter().enumerate() {
        let folder = dir.join(if i < 16 { "train" } else { "test" }).join(["cat", "dog"][i % 2]);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::copy(photo, folder.join(photo.file_name().unwrap())).unwrap();
    }
    let (test_dir, run_dir) = (dir.join("test"), dir.join("run"));
    let (ok, out) = train_on_users_images(&[
        "--fresh",
        "--set",
        &format!("data.train_file=\"{}\"", dir.join("train").display()),
        "--set",
        &format!("data.test_file=\"{}\"", test_dir.display()),
        "--set",
        "data.channels=3",
        "--set",
        "model.config.num_channels=3",
        "--set",
        "data.resize_to=8",
        "--set",
        "model.config.num_labels=2",
        "--set",
        "train.max_steps=2",
        "--set",
        &format!("output.dir=\"{}\"", run_dir.display()),
    ]);
    assert!(ok && out.contains("data: labelled_images — 16 training / 8 test samples, 2 classes"), "{out}");
    let trained = printed_loss(&out, "final eval:");
    let model = run_dir.display().to_string();
    let (ok, scored) = pipetransformer(&["evaluate", "--model", &model, "--file", test_dir.to_str().unwrap()]);
    assert!(
        ok && scored.contains("8 targets") && trained.is_some() && printed_loss(&scored, "targets:") == trained,
        "{scored}"
    );
    let (ok, out) = pipetransformer(&["predict", "--model", &model, photos[30].to_str().unwrap()]);
    assert!(ok && json_lines(&out).len() == 1 && json_lines(&out)[0]["label"].is_string(), "{out}");
}

/// Images of three channels (`data.channels`): a row holds the channels' planes whole, one after
/// another, as `evaluate --file` reads a row for the model, so both score the held-out file
/// alike (the same loss to the printed digit: another layout in either would move it); a model
/// of one channel is refused by its setting before a step.
#[test]
fn a_vit_trains_on_the_users_images_of_three_channels() {
    let dir = scratch("user-rgb");
    let (train, test) = (dir.join("train.csv"), dir.join("test.csv"));
    let rows = |n: usize, from: usize| -> String {
        (from..from + n)
            .map(|i| format!("{},{},{},{}\n", digit_pixels(i), digit_pixels(3 * i), digit_pixels(i + 7), i % 3))
            .collect()
    };
    std::fs::write(&train, rows(30, 0)).unwrap();
    std::fs::write(&test, rows(9, 30)).unwrap();
    let run = |channels: &str, out_dir: &str| {
        train_on_users_images(&[
            "--fresh",
            "--set",
            &format!("data.train_file=\"{}\"", train.display()),
            "--set",
            &format!("data.test_file=\"{}\"", test.display()),
            "--set",
            "data.pixel_max=16",
            "--set",
            "data.channels=3",
            "--set",
            channels,
            "--set",
            "train.max_steps=3",
            "--set",
            "model.config.num_labels=3",
            "--set",
            &format!("output.dir=\"{}\"", dir.join(out_dir).display()),
        ])
    };
    let (ok, out) = run("model.config.num_channels=3", "run");
    assert!(ok && out.contains("data: labelled_images — 30 training / 9 test samples, 3 classes"), "{out}");
    let trained = printed_loss(&out, "final eval:");
    let model = dir.join("run").display().to_string();
    let (ok, scored) = pipetransformer(&["evaluate", "--model", &model, "--file", test.to_str().unwrap()]);
    assert!(ok && scored.contains("9 targets"), "{scored}");
    assert!(trained.is_some() && printed_loss(&scored, "loss") == trained, "{out}\n{scored}");
    let (ok, out) = run("model.config.num_channels=1", "one-channel");
    assert!(
        !ok && out.contains("model.config") && out.contains("num_channels 1") && out.contains("are 3 channels of 8×8"),
        "{out}"
    );
    assert!(!out.contains("done:"), "{out}");
}

/// Settings of the model-selection tests: a constant learning rate, so a run's length does not
/// change its steps; an evaluation every 5 steps on a validation split; the best by accuracy,
/// and a stop after two evaluations without a better one.
const SELECTION: [&str; 5] = [
    "data.validation_fraction=0.2",
    "train.eval_every=5",
    "train.decay=\"constant\"",
    "train.warmup_fraction=0",
    "train.lr=2e-4",
];
const SELECTING: [&str; 2] = ["train.keep_best=\"accuracy\"", "train.early_stopping_patience=2"];

/// `train` of vit-digits into `dir` with the model-selection settings and `extra` (`--set`s),
/// after `lead` (`launch …`, and `train`'s own flags); its output, having succeeded.
fn train_selecting(lead: &[&str], dir: &Path, extra: &[&str]) -> String {
    let out_dir = format!("output.dir={}", dir.display());
    let mut args: Vec<&str> = lead.to_vec();
    args.extend(["--config", "configs/vit-digits.toml", "--progress-every", "0"]);
    for s in std::iter::once(out_dir.as_str()).chain(SELECTION).chain(extra.iter().copied()) {
        args.extend(["--set", s]);
    }
    let (ok, text) = pipetransformer(&args);
    assert!(ok, "{args:?}: {text}");
    text
}

fn summary_of(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// An accuracy from a summary, as the logs show it.
fn accuracy(value: &serde_json::Value) -> String {
    pipetransformer::train::KeepBest::Accuracy.show(value.as_f64().unwrap())
}

fn weights_in(dir: &Path, folder: &str) -> Vec<u8> {
    std::fs::read(dir.join(folder).join("model.safetensors")).unwrap()
}

/// `train.keep_best` writes the weights of the best evaluation to `best/`: the same bytes as a
/// run stopped at that step exports, though the run went on. `train.early_stopping_patience`
/// ends the run after that many evaluations without a better one, its last weights those of a
/// run that planned to stop there; and a run resumed in between compares against the best and
/// counts the evaluations from before the resume, stopping at the same step with the same best.
#[test]
fn the_best_evaluation_is_kept_and_patience_ends_the_run() {
    if !have_digits() {
        return;
    }
    let fresh = ["train", "--fresh"];
    let kept = scratch("keep-best");
    let out = train_selecting(&fresh, &kept, &SELECTING);
    let s = summary_of(&kept);
    let (best, stop) = (s["best"]["step"].as_u64().unwrap(), s["steps"].as_u64().unwrap());
    assert_eq!(s["stopped_early"], true, "{out}");
    assert!(
        out.contains(&format!("best accuracy: {} at step {best}, stopped early", accuracy(&s["best"]["value"]))),
        "{out}"
    );
    // From the log: the best is the first evaluation of the highest accuracy, and the run
    // stopped at the second evaluation after it.
    let log = std::fs::read_to_string(kept.join("metrics.jsonl")).unwrap();
    let mut evals: Vec<(u64, f64)> = Vec::new();
    let mut step = 0;
    for e in log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()) {
        match e["event"].as_str().unwrap() {
            "step" => step = e["step"].as_u64().unwrap(),
            "eval" | "epoch" => evals.push((step, e["eval"]["accuracy"].as_f64().unwrap())),
            _ => {}
        }
    }
    let top = evals.iter().map(|e| e.1).fold(f64::MIN, f64::max);
    let at = evals.iter().position(|e| e.1 == top).unwrap();
    assert_eq!((evals[at].0, s["best"]["value"].as_f64().unwrap()), (best, top), "{out}");
    assert_eq!(evals.len() - at - 1, 2, "two evaluations after the best: {evals:?}");
    assert_eq!(evals.last().map(|e| e.0), Some(stop), "{out}");
    let report = std::fs::read_to_string(kept.join("report.html")).unwrap();
    assert!(
        report.contains(&format!("Best validation accuracy: <b>{}</b> at step {best}", accuracy(&s["best"]["value"])))
    );
    assert!(report.contains(&format!("Stopped early at step {stop}: 2 evaluations")), "{report}");

    // The best weights are those of a run that ends at the best step; the last ones, those
    // of a run that ends where this one stopped.
    let plain = scratch("keep-best-plain");
    train_selecting(&fresh, &plain, &[&format!("train.max_steps={best}")]);
    assert!(weights_in(&kept, "best") == weights_in(&plain, "model"), "best/ holds the weights of step {best}");
    assert!(!plain.join("best").exists() && summary_of(&plain)["best"].is_null());
    train_selecting(&fresh, &plain, &[&format!("train.max_steps={stop}")]);
    assert!(weights_in(&kept, "model") == weights_in(&plain, "model"), "model/ holds the weights of step {stop}");
    assert!(weights_in(&kept, "best") != weights_in(&kept, "model"));
    // `evaluate` of best/ on the run's validation split scores what the run's best evaluation did.
    let best_dir = kept.join("best").display().to_string();
    let args = ["evaluate", "--model", &best_dir, "--config", "configs/vit-digits.toml", "--set", SELECTION[0]];
    let (ok, out) = pipetransformer(&args);
    assert!(ok && out.contains(&format!("accuracy {},", accuracy(&s["best"]["value"]))), "{out}");

    // Stopped one evaluation after the best, and resumed: the same best, the same stop.
    let resumed = scratch("keep-best-resumed");
    let first_after = format!("train.max_steps={}", evals[at + 1].0);
    train_selecting(&fresh, &resumed, &[&SELECTING[..], &[first_after.as_str()]].concat());
    assert_eq!(summary_of(&resumed)["stopped_early"], false);
    let out = train_selecting(&["train", "--resume"], &resumed, &[&SELECTING[..], &["train.max_steps=0"]].concat());
    assert!(out.contains(&format!("early stop at step {stop}")), "{out}");
    let r = summary_of(&resumed);
    assert_eq!((&r["best"], r["steps"].as_u64()), (&s["best"], Some(stop)));
    assert!(weights_in(&resumed, "best") == weights_in(&kept, "best"));
    assert!(weights_in(&resumed, "model") == weights_in(&kept, "model"));
}

/// A pipeline across two launched processes keeps the same best evaluation and stops at the
/// same step as one process with the same pipeline on two devices, and writes the same
/// `best/`: every process scores the same evaluation, and rank 0 collects the other stage's
/// weights for it.
#[test]
fn launched_stage_processes_keep_the_best_one_process_keeps() {
    if !have_digits() {
        return;
    }
    let (one, many) = (scratch("keep-best-one"), scratch("keep-best-launched"));
    let two = ["--pipeline-len", "2", "--micro-batches", "2", "--fresh"];
    train_selecting(&[&["train", "--devices", "2"][..], &two].concat(), &one, &SELECTING);
    let rdzv = format!("127.0.0.1:{}", free_port());
    let launch = ["launch", "--nproc-per-node", "2", "--rdzv", &rdzv, "--", "train", "--across-processes"];
    let text = train_selecting(&[&launch[..], &two].concat(), &many, &SELECTING);
    assert!(text.contains("stages across 2 processes") && text.contains("early stop at step"), "{text}");
    let (a, b) = (summary_of(&one), summary_of(&many));
    assert_eq!((&a["best"], &a["steps"], &a["stopped_early"]), (&b["best"], &b["steps"], &b["stopped_early"]));
    assert!(weights_in(&one, "best") == weights_in(&many, "best"), "best/ as one process writes it");
    assert!(weights_in(&one, "model") == weights_in(&many, "model"));
}

/// A model folder given where it does not fit is named as what it is, not by the first file
/// its reader misses: an image model's export to fine-tune on texts (by the kinds, not its
/// missing tokenizer), a pretrained encoder given to `predict` (by its missing head, not as
/// damaged), a pretrained folder without its tokenizer, a run whose export lost its config;
/// an image file given to `evaluate --file` (by what it is, not as text that is not UTF-8);
/// and standard output that cannot be written is named so.
#[test]
fn a_model_folder_where_it_does_not_fit_is_named_as_what_it_is() {
    let minilm = Path::new("weights/all-minilm-l6-v2");
    if !common::installed(&[minilm, Path::new("data/text/rotten_tomatoes_corpus_full.csv.bz2")]) {
        return;
    }
    let dir = scratch("misplaced-model");
    let vit = dir.join("vit");
    tiny_digits_vit(&vit);
    let run = dir.join("run");
    let train = |pretrained: &Path| {
        pipetransformer(&[
            "train",
            "--config",
            "configs/minilm-rt.toml",
            "--set",
            &format!("model.pretrained={}", pretrained.display()),
            "--set",
            &format!("output.dir={}", run.display()),
        ])
    };
    let (ok, out) = train(&vit);
    assert!(
        !ok && out.contains("config field `data.dataset`") && out.contains("the model (a ViT) is an image"),
        "{out}"
    );
    let no_tokenizer = dir.join("no-tokenizer");
    std::fs::create_dir(&no_tokenizer).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(minilm.join(file), no_tokenizer.join(file)).unwrap();
    }
    let (ok, out) = train(&no_tokenizer);
    assert!(!ok && out.contains("model.pretrained") && out.contains("holds no tokenizer.json"), "{out}");
    assert!(!run.exists(), "{out}");

    let (ok, out) = pipetransformer(&["predict", "--model", "weights/all-minilm-l6-v2", "a fine film"]);
    assert!(!ok && out.contains("a pretrained model without a classifier head") && !out.contains("damaged"), "{out}");

    let png = dir.join("digit.png");
    std::fs::write(&png, b"\x89PNG\r\n\x1a\n").unwrap();
    let vit_text = vit.display().to_string();
    let (ok, out) = pipetransformer(&["evaluate", "--model", &vit_text, "--file", &png.display().to_string()]);
    assert!(!ok && out.contains("is a PNG image, with no label to score") && !out.contains("UTF-8"), "{out}");
    let rows = dir.join("rows.csv");
    std::fs::write(&rows, format!("{},3\n", digit_pixels(1))).unwrap();
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let bin = env!("CARGO_BIN_EXE_pipetransformer");
    let out = Command::new(bin)
        .args(["evaluate", "--model", &vit_text, "--file", &rows.display().to_string()])
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("writing standard output"), "{err}");

    // A run's folder whose model/ lost its config.json: that file is named.
    let export = run.join("model");
    std::fs::create_dir_all(&export).unwrap();
    std::fs::copy(vit.join("model.safetensors"), export.join("model.safetensors")).unwrap();
    std::fs::write(run.join("checkpoint.ckpt"), b"").unwrap();
    let (ok, out) = pipetransformer(&["predict", "--model", &run.display().to_string(), "1"]);
    assert!(!ok && out.contains("model/config.json: is missing") && !out.contains("without its exported"), "{out}");
}

/// Settings outside the run config are named when they are what is wrong: the default
/// `--config` looked for under another folder, a Python given for the comparison that cannot
/// run (refused before any timing, not "skipped"), a `PT_DEBUG` that is not a level
/// (ignored, said), and a batch larger than the training set (taken whole each step, said).
#[test]
fn settings_outside_the_config_are_named_when_wrong() {
    if !have_digits() {
        return;
    }
    let dir = scratch("outside-settings");
    let bin = env!("CARGO_BIN_EXE_pipetransformer");
    let out = Command::new(bin).arg("train").current_dir(&*dir).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("(the run config `train` reads without --config) is not under"),
        "{err}"
    );
    let (ok, out) = pipetransformer(&["bench-step", "--python", "/nonexistent/python3", "--steps", "1"]);
    assert!(!ok && out.contains("--python /nonexistent/python3: cannot run it") && !out.contains("| ours"), "{out}");
    let out_dir = format!("output.dir={}", dir.join("run").display());
    let out = Command::new(bin)
        .args(["train", "--config", "configs/vit-digits.toml", "--set", &out_dir, "--set", "train.max_steps=1"])
        .args(["--set", "data.test_limit=8", "--set", "data.batch_size=100000"])
        .env("PT_DEBUG", "verbose")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning: PT_DEBUG=verbose ignored; expected a level"), "{err}");
    assert!(err.contains("data.batch_size = 100000 is more than the 1438 training samples"), "{err}");
}

/// More settings outside the config, each with bad input: a negative process count (the
/// flag's value, not the command to run), a `PT_CUDA_HOME` that is not the CUDA folder (named
/// in the error), an empty `XDG_CACHE_HOME` (no kernel cache in the working folder), and
/// predictions that cannot be written (said as such).
#[test]
fn launch_cuda_and_output_settings_are_named_when_wrong() {
    let bin = env!("CARGO_BIN_EXE_pipetransformer");
    let (ok, out) = pipetransformer(&["launch", "--nproc-per-node", "-1", "--", "train"]);
    assert!(!ok && out.contains("invalid value '-1' for '--nproc-per-node"), "{out}");
    let dir = scratch("outside-cuda");
    let out = Command::new(bin).arg("kernels").env("PT_CUDA_HOME", "/etc/passwd").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("PT_CUDA_HOME=/etc/passwd names the folder"), "{err}");
    // (Where NVRTC is installed the kernels compile, and their cache goes under HOME.)
    let (work, home) = (dir.join("work"), dir.join("home"));
    std::fs::create_dir_all(&work).unwrap();
    let mut kernels = Command::new(bin);
    kernels.arg("kernels").current_dir(&work).env("XDG_CACHE_HOME", "").env("HOME", &home);
    let _ = kernels.output().unwrap();
    assert_eq!(std::fs::read_dir(&work).unwrap().count(), 0, "the working folder got files");
    let model = dir.join("model");
    tiny_digits_vit(&model);
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(bin)
        .args(["predict", "--model", &model.display().to_string(), "--format", "json", &digit_pixels(0)])
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("writing the predictions") && !err.contains("panicked"), "{err}");
}
