//! A run's output folder (`output.dir`): the files a run writes there, where a run that starts
//! over sets an earlier run's aside, and what a start may find there (a checkpoint it would
//! overwrite, a trace in the way, launched processes that disagree on their settings).

use super::config::RunConfig;
use crate::comm::process_group::ProcessGroup;
use crate::error::{Result, config_error, internal};
use crate::files;
use std::path::{Path, PathBuf};

/// Where a run of `config` keeps its checkpoint.
pub fn checkpoint_path(config: &RunConfig) -> PathBuf {
    config.output.dir.join(CHECKPOINT.0)
}

/// A run's log in its folder, and where a run that starts over sets an earlier run's aside.
pub(super) const LOG: (&str, &str) = ("metrics.jsonl", "metrics.previous.jsonl");

/// A run's checkpoint in its folder, and where a run that starts over sets an earlier run's
/// aside.
pub(super) const CHECKPOINT: (&str, &str) = ("checkpoint.ckpt", "checkpoint.previous.ckpt");

/// The run's other files in its folder, where a run that starts over sets an earlier run's
/// aside (all that would otherwise describe the earlier run beside the new log), and whether
/// each is a folder.
pub(super) const SET_ASIDE: [(&str, &str, bool); 5] = [
    (CHECKPOINT.0, CHECKPOINT.1, false),
    (SUMMARY, "summary.previous.json", false),
    ("report.html", "report.previous.html", false),
    (MODEL, "model.previous", true),
    (BEST, "best.previous", true),
];

/// The run's files in `dir` but its log, each with where a run that starts over sets it aside.
pub(super) fn set_aside_pairs(dir: &Path) -> Vec<(PathBuf, PathBuf)> {
    SET_ASIDE.iter().map(|(from, to, _)| (dir.join(from), dir.join(to))).collect()
}

/// What a run of `config` that starts over will do with the earlier run's files in its folder
/// at its first step: each set aside under its `.previous` name (replacing, and so losing,
/// those a run before set aside: named), or, for an earlier run that left a log but no
/// checkpoint beside a run set aside before, its log replaced. `None` where the folder holds
/// no earlier run.
pub fn start_over_note(config: &RunConfig) -> Option<String> {
    let dir = &config.output.dir;
    let log = dir.join(LOG.0);
    let moves = super::metrics_log::moves_aside(&log, dir.join(LOG.1), &set_aside_pairs(dir));
    let name = |p: &Path| p.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if moves.is_empty() {
        return log.metadata().is_ok_and(|m| m.len() > 0).then(|| {
            format!(
                "{} holds a log without a checkpoint (a run that stopped or failed before its first): this run's \
                 log replaces it at its first step; the run set aside before ({}) stays as it is",
                dir.display(),
                CHECKPOINT.1
            )
        });
    }
    let lost: Vec<String> = moves.iter().filter(|(_, to)| to.exists()).map(|(_, to)| name(to)).collect();
    let from: Vec<String> = moves.iter().map(|(from, _)| name(from)).collect();
    let replacing = match lost.is_empty() {
        true => String::new(),
        false => format!(", replacing those a run before set aside ({}), which are lost", lost.join(", ")),
    };
    Some(format!(
        "the earlier run's files in {} ({}) move aside under .previous names at this run's first step{replacing}",
        dir.display(),
        from.join(", ")
    ))
}

/// A run's summary, written once it reached its end.
const SUMMARY: &str = "summary.json";

/// The folders of a run's exports: its last weights, and its best evaluation's (`train.keep_best`).
pub(super) const MODEL: &str = "model";
pub(super) const BEST: &str = "best";

/// The export a checkpoint in a run's folder goes with: `model/` beside a run's
/// `checkpoint.ckpt` (or a checkpoint of any other name), and beside the checkpoint a run that
/// started over set aside, the export set aside with it (`model.previous/`), whose config,
/// labels and reader are that run's.
pub(super) fn export_beside(checkpoint: &Path) -> PathBuf {
    let dir = checkpoint.parent().unwrap_or(Path::new("."));
    let set_aside = checkpoint.file_name().is_some_and(|name| name == CHECKPOINT.1);
    let aside = SET_ASIDE.iter().find(|(own, ..)| *own == MODEL).map_or(MODEL, |&(_, aside, _)| aside);
    dir.join(if set_aside { aside } else { MODEL })
}

/// The files the run writes in its folder, each its own or set aside, and whether a folder.
fn written() -> impl Iterator<Item = (&'static str, bool)> {
    let log = [(LOG.0, LOG.1, false)];
    log.into_iter().chain(SET_ASIDE).flat_map(|(own, aside, folder)| [(own, folder), (aside, folder)])
}

/// A path in the run's folder `dir` that holds the other kind of thing than the run writes
/// there (a file named `model`, a folder named `summary.json`): said before training, not when
/// the first checkpoint or the export fails.
fn in_the_way(dir: &Path) -> Option<String> {
    written().find_map(|(name, folder)| {
        let path = dir.join(name);
        (path.exists() && path.is_dir() != folder).then(|| {
            let (is, wants) = if folder { ("a file", "its exported model's folder") } else { ("a folder", "a file") };
            format!("{} is {is}, where the run writes {wants}: move it out of the way", path.display())
        })
    })
}

/// Where a run that started over set an earlier run's checkpoint aside in `dir`: how to resume
/// that one instead (empty where there is none).
pub(super) fn set_aside_note(dir: &Path) -> String {
    if !dir.join(CHECKPOINT.1).exists() {
        return String::new();
    }
    let pairs = std::iter::once((LOG.0, LOG.1)).chain(SET_ASIDE.iter().map(|&(own, aside, _)| (own, aside)));
    let names: Vec<String> =
        pairs.filter(|(_, aside)| dir.join(aside).exists()).map(|(own, aside)| format!("{aside} → {own}")).collect();
    format!(
        "; {} there is an earlier run's, set aside with its other files when a run started over in this folder: to \
         resume that run, move each back to its own name ({}), the log and model too, so it goes on under its own",
        CHECKPOINT.1,
        names.join(", ")
    )
}

/// Why a Chrome trace written to `trace` when the run ends would overwrite a file the run
/// needs or any other file: the run's config file (`config_file`), its `output.dir` itself or
/// one of the files it writes there (its checkpoint, log, summary, report, exported model, the
/// earlier run's set aside, its lock), or an existing file that is not a Chrome trace (a
/// dataset, another run's checkpoint: the trace replaces only a trace). (The cache's spill
/// files have names of their own, unlinked at once: a trace beside them is safe.) `None` when
/// the path is free for it.
pub fn trace_in_the_way(config: &RunConfig, trace: &Path, config_file: &Path) -> Option<String> {
    run_file_at(config, trace, config_file).or_else(|| not_a_trace(trace))
}

/// Why a trace at `trace` would replace one of the run's own files or its folder.
fn run_file_at(config: &RunConfig, trace: &Path, config_file: &Path) -> Option<String> {
    // (Resolved through the folders that exist, `runs/x/../x/summary.json` being the
    // summary; the rest, not made yet, as written.)
    let resolved = |p: &Path| -> Option<std::path::PathBuf> {
        let p = std::path::absolute(p).ok()?;
        let known = p.ancestors().find_map(|a| Some((a, std::fs::canonicalize(a).ok()?)))?;
        let mut path = known.1;
        for part in p.strip_prefix(known.0).ok()?.components() {
            match part {
                std::path::Component::ParentDir => _ = path.pop(),
                std::path::Component::Normal(name) => path.push(name),
                _ => {}
            }
        }
        Some(path)
    };
    let at = resolved(trace)?;
    if resolved(config_file).is_some_and(|c| c == at) {
        return Some("is the run's config file (--config); name another file for the trace".into());
    }
    let dir = resolved(&config.output.dir)?;
    if at == dir {
        return Some(format!(
            "is the run's output folder (output.dir); name a file for the trace, such as {}",
            config.output.dir.join("trace.json").display()
        ));
    }
    let name = at.strip_prefix(&dir).ok()?.components().next()?.as_os_str().to_str()?.to_string();
    // (Besides its files, the folder's lock and the export's staging folder, emptied by each
    // export.)
    let staging = [MODEL, BEST].map(crate::weights::export::staging_name);
    let taken = written().any(|(written, _)| written == name) || name == files::LOCK_FILE || staging.contains(&name);
    taken.then(|| {
        format!(
            "is where the run writes its own {name} (output.dir {}); name another file for the trace",
            config.output.dir.display()
        )
    })
}

/// Why an existing file at `path` is not one a trace may replace: anything but an empty file
/// or a Chrome trace (a JSON object whose first key, within its first 4 KiB, is
/// `traceEvents` or `displayTimeUnit`, as this engine and most tracers write them).
fn not_a_trace(path: &Path) -> Option<String> {
    use std::io::Read;
    let file = std::fs::File::open(path).ok().filter(|f| f.metadata().is_ok_and(|m| m.is_file()))?;
    let mut head = Vec::new();
    file.take(4096).read_to_end(&mut head).ok()?;
    let text = String::from_utf8_lossy(&head);
    let body = text.trim_start().strip_prefix('{').map(str::trim_start);
    let trace = head.is_empty()
        || body.is_some_and(|b| b.starts_with("\"traceEvents\"") || b.starts_with("\"displayTimeUnit\""));
    (!trace).then(|| {
        "is an existing file that is not a Chrome trace, which the trace would replace; name a new file, or move \
         that one away first"
            .to_string()
    })
}

/// The first of an earlier run's results in `dir` that a run starting over would replace or set
/// aside (its summary, exported model or best evaluation's weights), where that run's
/// checkpoint is not there beside them (removed to save space, say): `None` where there is a
/// checkpoint, or none of them. (A run that failed before its first checkpoint leaves its log
/// and report, drawn from it, which a retry may replace: neither is a result.)
fn finished_without_checkpoint(dir: &Path) -> Option<&'static str> {
    if dir.join(CHECKPOINT.0).exists() {
        return None;
    }
    [SUMMARY, MODEL, BEST].into_iter().find(|own| dir.join(own).exists())
}

/// Whether a run of `config` may start in its `output.dir`: one that neither resumes nor starts
/// over (`fresh`) is refused where a checkpoint is already there, or an earlier run's other
/// files without one, before anything is built, so an earlier run's files are not overwritten
/// by mistake. In a launched run (`group`) rank 0,
/// which writes the files, decides and every process hears it at once: none goes on alone into
/// a collective the others have left. There, too, every process must have been given the
/// same settings (but for [`PER_NODE_SETTINGS`]): nodes launched with other `--set` flags would
/// otherwise train apart while their losses, all-reduced, looked as one; and every process
/// resuming must find the checkpoint (each reads its own `output.dir`).
///
/// Errors: an [`Error::Config`](crate::Error::Config) on `output.dir` naming the checkpoint and the two ways on
/// (`--resume`, `--fresh`), or an earlier run's results without one, a file where the folder goes, a file or folder where the run writes
/// the other kind (`in_the_way`), or no checkpoint to resume; on
/// ranks above 0 it says rank 0 refused; on the first setting that differs, naming the ranks and every setting that
/// differs; on `output.dir`, the ranks that find no checkpoint to resume; a collective's
/// failure.
pub fn check_start(config: &RunConfig, resume: bool, fresh: bool, group: Option<&ProcessGroup>) -> Result<()> {
    let (ckpt, dir) = (checkpoint_path(config), &config.output.dir);
    let rank = group.map_or(0, |g| g.rank());
    let why = if dir.exists() && !dir.is_dir() {
        Some(format!("{} is a file, not a folder: name a folder for the run's files", dir.display()))
    } else if let Some(why) = in_the_way(dir) {
        Some(why)
    } else if !resume && !fresh && ckpt.exists() {
        Some(format!(
            "{} already holds a checkpoint ({}): pass --resume to continue that run or --fresh to start over",
            dir.display(),
            ckpt.file_name().unwrap_or_default().to_string_lossy()
        ))
    } else if let Some(name) = finished_without_checkpoint(dir).filter(|_| !resume && !fresh) {
        Some(format!(
            "{} holds an earlier run's {name} but no checkpoint: pass --fresh to start over in it (what it holds is \
             set aside or replaced), or name another output.dir",
            dir.display()
        ))
    } else if rank == 0 {
        // The process that writes the run's files: told now, not after the build.
        files::check_folder_writable(dir).err().map(|e| e.to_string())
    } else {
        None
    };
    let Some(group) = group else {
        if let Some(why) = why {
            return Err(config_error("output.dir", why));
        }
        if resume && !ckpt.exists() {
            // Said before the data and model are built, not after.
            let writer = files::folder_writer(dir).map_or_else(String::new, |w| {
                format!(" yet: another run ({w}) is writing to this folder and has not taken its first checkpoint")
            });
            return Err(config_error(
                "output.dir",
                format!("no checkpoint to resume from at {}{writer}{}", ckpt.display(), set_aside_note(dir)),
            ));
        }
        return Ok(());
    };
    // Each process's answers in one gather: rank 0's refusal, whether it resumes and finds
    // no checkpoint to, then its settings' fingerprints.
    const HEAD: usize = 3;
    let settings = shared_settings(config)?;
    let refused = u64::from(rank == 0 && why.is_some());
    let missing = u64::from(resume && !ckpt.exists());
    let head = [refused, u64::from(resume), missing];
    let mine: Vec<u64> = head.into_iter().chain(settings.iter().map(|(_, print)| *print)).collect();
    let all = group.all_gather_u64(&mine)?;
    if all[0][0] != 0 {
        let why = why.unwrap_or_else(|| "its output.dir is in the way".into());
        return Err(config_error(
            "output.dir",
            if rank == 0 { why } else { format!("rank 0 refused to start: {why}") },
        ));
    }
    let mut differing: Vec<(usize, Vec<&str>)> = Vec::new();
    for (r, theirs) in all.iter().enumerate().skip(1) {
        if theirs.len() != all[0].len() {
            return Err(config_error(
                "launch",
                format!(
                    "rank {r} runs another build of pipetransformer than rank 0: launch the same program on every node"
                ),
            ));
        }
        if theirs[1] != all[0][1] {
            let (zero, them) = if all[0][1] != 0 { ("resumes", "starts afresh") } else { ("starts afresh", "resumes") };
            return Err(config_error(
                "--resume",
                format!("rank 0 {zero} and rank {r} {them}: give every process of a launched run the same flags"),
            ));
        }
        let keys: Vec<&str> = settings
            .iter()
            .zip(&theirs[HEAD..])
            .zip(&all[0][HEAD..])
            .filter(|((_, a), b)| a != b)
            .map(|((s, _), _)| s.0.as_str())
            .collect();
        if !keys.is_empty() {
            differing.push((r, keys));
        }
    }
    if let Some((_, keys)) = differing.first() {
        let ranks: Vec<String> = differing.iter().map(|(r, keys)| format!("rank {r}: {}", keys.join(", "))).collect();
        let per_node = PER_NODE_SETTINGS.join(", ");
        return Err(config_error(
            keys[0],
            format!(
                "settings differ from rank 0's ({}): give every process of a launched run the same config and --set \
                 flags (only {per_node} may differ between nodes)",
                ranks.join("; ")
            ),
        ));
    }
    let missing: Vec<usize> = (0..all.len()).filter(|&r| all[r][2] != 0).collect();
    if !missing.is_empty() {
        return Err(config_error(
            "output.dir",
            format!(
                "{} {missing:?} {} no checkpoint to resume at {}: every process of a launched run reads \
                 it from its own output.dir, which must therefore be a folder all nodes share{}",
                if missing.len() == 1 { "rank" } else { "ranks" },
                if missing.len() == 1 { "finds" } else { "find" },
                ckpt.display(),
                set_aside_note(dir)
            ),
        ));
    }
    Ok(())
}

/// Settings each node of a launched run may give its own way: where its files are, its
/// threads and its console.
pub const PER_NODE_SETTINGS: [&str; 6] =
    ["model.pretrained", "data.dir", "output.dir", "output.threads", "output.progress_every", "elastic.cache_dir"];

/// Every setting of `config` the processes of a launched run must share (`section.key`, by
/// name), each with a fingerprint of its value.
pub(super) fn shared_settings(config: &RunConfig) -> Result<Vec<(String, u64)>> {
    let value = serde_json::to_value(config).map_err(|e| internal("the run's settings", e.to_string()))?;
    let sections = value.as_object().into_iter().flatten();
    let keys = sections.flat_map(|(section, v)| {
        v.as_object().into_iter().flatten().map(move |(key, v)| (format!("{section}.{key}"), v))
    });
    keys.filter(|(key, _)| !PER_NODE_SETTINGS.contains(&key.as_str()))
        .map(|(key, v)| Ok((key, crate::rng::fnv1a(v.to_string().as_bytes(), crate::rng::FNV_OFFSET))))
        .collect()
}

#[cfg(test)]
mod tests {
    /// A trace is refused over the run's config and the files it writes in its folder, the
    /// lock and the export's staging folder among them; elsewhere it is free.
    #[test]
    fn a_trace_is_refused_where_the_run_writes() {
        let scratch = crate::files::Scratch::new("trace-in-the-way");
        let config = |sets: &[&str]| {
            let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            sets.push(format!("output.dir={:?}", scratch.join("run").display().to_string()));
            let text = "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n";
            super::RunConfig::parse(text, "test", &sets).unwrap()
        };
        let file = scratch.join("run.toml");
        let refused = |c: &super::RunConfig, trace: &str| super::trace_in_the_way(c, &scratch.join(trace), &file);
        let plain = config(&[]);
        for own in ["run/.lock", "run/.model.staging/x.json", "run/model.previous", "run/metrics.previous.jsonl"] {
            assert!(refused(&plain, own).is_some_and(|w| w.contains("is where the run writes its own")), "{own}");
        }
        assert!(refused(&plain, "run.toml").is_some_and(|w| w.contains("config file")));
        assert!(refused(&plain, "run").is_some_and(|w| w.contains("is the run's output folder")));
        // An existing file is replaced only where it is a trace (or empty): never a dataset.
        std::fs::write(scratch.join("data.tsv"), "pos\tgood\n").unwrap();
        assert!(refused(&plain, "data.tsv").is_some_and(|w| w.contains("not a Chrome trace")));
        for (name, text) in [("old.json", "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[]}"), ("empty.json", "")] {
            std::fs::write(scratch.join(name), text).unwrap();
            assert_eq!(refused(&plain, name), None, "{name}");
        }
        // The cache's spill files have names of their own: a trace in its folder is free.
        let cached = config(&["elastic.cache=true"]);
        for free in ["run/cache/t.json", "elsewhere/t.json", "run/trace.json"] {
            assert_eq!(refused(&plain, free), None, "{free}");
            assert_eq!(refused(&cached, free), None, "{free}");
        }
    }

    /// What a run that starts over does to the earlier runs' files is said before it trains:
    /// nothing in an empty folder; the earlier run's files moved aside; those a run before
    /// set aside named as lost where they are replaced; a log without a checkpoint beside a
    /// run set aside before named as replaced, that run kept.
    #[test]
    fn a_run_that_starts_over_says_what_it_moves_and_loses() {
        let scratch = crate::files::Scratch::new("start-over-note");
        let config = super::RunConfig::parse(
            "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n",
            "test",
            &[format!("output.dir={:?}", scratch.display().to_string())],
        )
        .unwrap();
        assert_eq!(super::start_over_note(&config), None);
        let put = |name: &str| std::fs::write(scratch.join(name), b"x").unwrap();
        put("metrics.jsonl");
        put("checkpoint.ckpt");
        let note = super::start_over_note(&config).unwrap();
        assert!(note.contains("(checkpoint.ckpt, metrics.jsonl) move aside under .previous names"), "{note}");
        assert!(!note.contains("lost"), "{note}");
        put("checkpoint.previous.ckpt");
        put("metrics.previous.jsonl");
        let note = super::start_over_note(&config).unwrap();
        assert!(note.ends_with("(checkpoint.previous.ckpt, metrics.previous.jsonl), which are lost"), "{note}");
        std::fs::remove_file(scratch.join("checkpoint.ckpt")).unwrap();
        let note = super::start_over_note(&config).unwrap();
        assert!(note.contains("holds a log without a checkpoint") && note.contains("log replaces it"), "{note}");
    }

    /// A folder with a checkpoint is refused unless the run resumes or starts over; an empty
    /// one starts. (A launched run's ranks hearing rank 0 refuse: tests/cli.rs.)
    #[test]
    fn a_checkpoint_in_the_way_is_refused_unless_resuming_or_starting_over() {
        let scratch = crate::files::Scratch::new("check-start");
        let config = super::RunConfig::parse(
            "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n",
            "test",
            &[format!("output.dir={:?}", scratch.display().to_string())],
        )
        .unwrap();
        assert!(super::check_start(&config, false, false, None).is_ok(), "nothing there yet");
        std::fs::write(super::checkpoint_path(&config), b"an earlier run").unwrap();
        let e = super::check_start(&config, false, false, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("already holds a checkpoint (checkpoint.ckpt)"), "{e}");
        assert!(e.contains("--resume") && e.contains("--fresh") && !e.contains("rank 0"), "{e}");
        assert!(
            super::check_start(&config, true, false, None).is_ok()
                && super::check_start(&config, false, true, None).is_ok()
        );
        // Resuming where no checkpoint is: said before anything is built.
        std::fs::remove_file(super::checkpoint_path(&config)).unwrap();
        let e = super::check_start(&config, true, false, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("no checkpoint to resume from at"), "{e}");
        assert!(!e.contains("another run"), "{e}");
        // ...where a run that has not checkpointed yet writes, it says so.
        let lock = crate::files::lock_folder(&scratch).unwrap();
        let e = super::check_start(&config, true, false, None).unwrap_err().to_string();
        let writer = format!("another run (process {}) is writing to this folder", std::process::id());
        assert!(e.contains("no checkpoint to resume from at") && e.contains(&writer), "{e}");
        drop(lock);
        std::fs::remove_file(scratch.join(crate::files::LOCK_FILE)).unwrap();
        // An earlier run's export without its checkpoint (removed to save space) is refused
        // too, unless the run starts over.
        std::fs::create_dir(scratch.join("model")).unwrap();
        let e = super::check_start(&config, false, false, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("holds an earlier run's model but no checkpoint"), "{e}");
        assert!(e.contains("--fresh"), "{e}");
        assert!(super::check_start(&config, false, true, None).is_ok());
        std::fs::write(super::checkpoint_path(&config), b"an earlier run").unwrap();
        let e = super::check_start(&config, false, false, None).unwrap_err().to_string();
        assert!(e.contains("already holds a checkpoint"), "{e}");
        std::fs::remove_dir(scratch.join("model")).unwrap();
        // A file where the folder goes is named as such, resuming or not.
        let file = super::RunConfig {
            output: super::super::OutputSection { dir: super::checkpoint_path(&config), ..config.output.clone() },
            ..config.clone()
        };
        for (resume, fresh) in [(false, false), (true, false), (false, true)] {
            let e = super::check_start(&file, resume, fresh, None).unwrap_err().to_string();
            assert!(e.contains("output.dir") && e.contains("checkpoint.ckpt is a file, not a folder"), "{e}");
        }
        // A folder that cannot take files, or cannot be made (sysfs takes no new files, for
        // root too): said before anything is built. One yet to be made where it can be is
        // fine, and is not made by the check.
        let at = |dir: &str| super::RunConfig {
            output: super::super::OutputSection { dir: dir.into(), ..config.output.clone() },
            ..config.clone()
        };
        let e = super::check_start(&at("/sys/pt-run/deeper"), false, true, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("cannot be made: /sys does not take new files"), "{e}");
        let e = super::check_start(&at("/sys"), false, true, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("/sys: cannot write in it"), "{e}");
        let later = scratch.join("later/run");
        assert!(super::check_start(&at(later.to_str().unwrap()), false, false, None).is_ok());
        assert!(!scratch.join("later").exists() && std::fs::read_dir(&*scratch).unwrap().count() == 1);
    }

    /// In a launched run every process must be given the same settings but where its files
    /// are, must agree on resuming, and must each find the checkpoint it resumes; each
    /// refusal names the ranks and what differs, on every process.
    #[test]
    fn launched_processes_must_agree_on_settings_and_resuming() {
        let scratch = crate::files::Scratch::new("check-start-group");
        let config = |sets: &[&str]| {
            let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            sets.push(format!("output.dir={:?}", scratch.display().to_string()));
            super::RunConfig::parse(
                "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n",
                "test",
                &sets,
            )
            .unwrap()
        };
        let group = crate::comm::process_group::tests::group(3, std::time::Duration::from_secs(20));
        let on_all = |configs: [&super::RunConfig; 3], resume: [bool; 3]| -> Vec<String> {
            std::thread::scope(|s| {
                let runs: Vec<_> = (0..3)
                    .map(|r| {
                        let (config, g) = (configs[r], &group[r]);
                        s.spawn(move || {
                            super::check_start(config, resume[r], false, Some(g)).err().map(|e| e.to_string())
                        })
                    })
                    .collect();
                runs.into_iter().map(|h| h.join().unwrap().unwrap_or_default()).collect()
            })
        };
        let same = config(&[]);
        // Where files are, and threads, are each node's own.
        let own = config(&["output.threads=1", "data.dir=\"elsewhere\""]);
        assert_eq!(on_all([&same, &own, &same], [false; 3]), ["", "", ""]);
        let apart = config(&["train.lr=0.5", "data.batch_size=4"]);
        let apart_too = config(&["train.lr=0.5"]);
        for e in on_all([&same, &apart, &apart_too], [false; 3]) {
            assert!(
                e.contains("train.lr") && e.contains("(rank 1: data.batch_size, train.lr; rank 2: train.lr)"),
                "{e}"
            );
        }
        for e in on_all([&same, &same, &same], [true, false, true]) {
            assert!(e.contains("--resume") && e.contains("rank 0 resumes and rank 1 starts afresh"), "{e}");
        }
        // No checkpoint anywhere: every rank resuming is named.
        for e in on_all([&same, &same, &same], [true; 3]) {
            assert!(e.contains("ranks [0, 1, 2] find no checkpoint to resume") && e.contains("all nodes share"), "{e}");
        }
    }
}
