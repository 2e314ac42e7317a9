//! `report.html`: one self-contained page (inline SVG, no script, nothing fetched) that shows a
//! run as PipeTransformer's figures do: per epoch the frozen layers, `K`, `R`, `M`, throughput,
//! cache hit rate and accuracy; the loss curve; and the transitions on a timeline. Built from
//! `metrics.jsonl`, from the last fresh start on, so a resumed run's report covers all of it.

use super::config::RunConfig;
use crate::error::Result;
use crate::files::{io_error, write_atomic};
use crate::train::KeepBest;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// A pipeline's shape: frozen layers, `K`, `R`, `M`.
type Shape = (usize, usize, usize, usize);

/// One epoch's row: the shape at its start and end (they differ when the freeze rule ran
/// mid-epoch); its throughput and cache hits come from its steps ([`EpochWork`]).
#[derive(Clone, Debug, PartialEq)]
struct EpochRow {
    epoch: u64,
    start: Shape,
    end: Shape,
    /// The evaluation at the epoch's end (accuracy, loss); `None` for an epoch the log ends
    /// inside (a run stopped there, or still going).
    eval: Option<(f64, f64)>,
}

/// What an epoch's steps did, summed from their events. (An epoch's own event counts only the
/// steps of the process that ended it, not those before a stop and resume inside it.)
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct EpochWork {
    samples: f64,
    seconds: f64,
    /// Samples of the steps that looked their batch up in the cache, and the hits among them.
    looked_up: f64,
    hits: f64,
}

/// Adds epoch `epoch`'s row, from shape `start` to `end`, evaluated (`eval`) at its end or not
/// (the log ends inside it). A row the epoch already has (a run ended or stopped inside it,
/// then resumed) is replaced, keeping the shape the epoch started in.
fn push_row(rows: &mut Vec<EpochRow>, epoch: u64, start: Shape, end: Shape, eval: Option<(f64, f64)>) {
    let start = rows.pop_if(|last| last.epoch == epoch).map_or(start, |part| part.start);
    rows.push(EpochRow { epoch, start, end, eval });
}

/// Writes the report of the run logged in `metrics` to `out`.
pub fn write_report(metrics: &Path, out: &Path, config: &RunConfig) -> Result<()> {
    // Lossy: a line a hand edit left in another encoding is skipped like any unreadable line,
    // instead of costing the whole report at the end of a finished run.
    let bytes = std::fs::read(metrics).map_err(|e| io_error(metrics, e))?;
    let html = render(&String::from_utf8_lossy(&bytes), config);
    write_atomic(out, |w| std::io::Write::write_all(w, html.as_bytes()))
}

/// The events of the last fresh run (a resume continues it). A resume from step `s` replays
/// what was logged after its checkpoint: those events are dropped for the replay's, so every
/// step, evaluation and transition counts once. The cut is at the first event numbered past
/// `s`, whatever it is: a transition made in a step is logged before that step's event, and
/// the replay need not make it again (AutoPipe's choices follow measured times).
fn events(log: &str) -> Vec<Value> {
    let all: Vec<Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let start = all.iter().rposition(|e| e["event"] == "start" && e["resumed"] == false).unwrap_or(0);
    let mut kept: Vec<Value> = Vec::new();
    for e in &all[start..] {
        if e["event"] == "start" && e["resumed"] == true {
            let from = e["step"].as_u64().unwrap_or(0);
            let after = |x: &Value| x["step"].as_u64().is_some_and(|k| k > from);
            if let Some(cut) = kept.iter().position(after) {
                kept.truncate(cut);
            }
        }
        kept.push(e.clone());
    }
    kept
}

fn render(log: &str, config: &RunConfig) -> String {
    let events = events(log);
    // The shape the run started in, as its log says (a log of an older version has none: the
    // config's then, which a resume's flags may have changed).
    let started: Option<crate::pipeline::PipelineConfig> =
        events.first().filter(|e| e["event"] == "start").and_then(|e| serde_json::from_value(e["plan"].clone()).ok());
    let plan = started.unwrap_or_else(|| config.pipeline.resolve().unwrap_or_default().0);
    let (mut frozen, mut k, mut r, mut m) = (0, plan.pipeline_len, plan.replicas, plan.micro_batches);
    // The shape when the current epoch began, and whether no step has run since an epoch ended
    // (a transition then shapes the next epoch from its start).
    let mut began = (frozen, k, r, m);
    let mut between_epochs = true;
    let mut rows: Vec<EpochRow> = Vec::new();
    let mut losses: Vec<(f64, f64)> = Vec::new();
    let mut transitions: Vec<&Value> = Vec::new();
    let mut last_step = 0.0;
    // Every evaluation, inside epochs (`train.eval_every`) and at their ends, as (step, run
    // clock, accuracy, loss): the time-to-accuracy table. The clock adds the steps' times (a
    // transition inside an epoch runs within its step's), the evaluations' and the transitions'
    // between epochs (which run in no step).
    let mut evals: Vec<(f64, f64, f64, f64)> = Vec::new();
    let mut clock = 0.0;
    let mut inside_epochs = false;
    let mut work: std::collections::BTreeMap<u64, EpochWork> = Default::default();
    for e in &events {
        if e["event"] == "step" {
            clock += num(e, "seconds");
            let w = work.entry(e["epoch"].as_u64().unwrap_or(0)).or_default();
            w.samples += num(e, "samples");
            w.seconds += num(e, "seconds");
            if let Some(hits) = e["cache_hits"].as_f64() {
                w.looked_up += num(e, "samples");
                w.hits += hits;
            }
        }
        clock += num(e, "eval_seconds");
        if matches!(e["event"].as_str(), Some("eval" | "epoch")) {
            inside_epochs |= e["event"] == "eval";
            // An epoch's evaluation follows the epoch's last step.
            let step = e["step"].as_f64().unwrap_or(last_step);
            evals.push((step, clock, num(&e["eval"], "accuracy"), num(&e["eval"], "loss")));
        }
        let pair_after = |key: &str| e[key][1].as_u64().unwrap_or(0) as usize;
        match e["event"].as_str().unwrap_or("") {
            "step" => {
                between_epochs = false;
                last_step = e["step"].as_f64().unwrap_or(0.0);
                losses.push((last_step, e["loss"].as_f64().unwrap_or(f64::NAN)));
            }
            // A resume goes on in the plan it logs (another where it reshaped).
            "start" if e["resumed"] == true => {
                if let Ok(p) = serde_json::from_value::<crate::pipeline::PipelineConfig>(e["plan"].clone()) {
                    (k, r, m) = (p.pipeline_len, p.replicas, p.micro_batches);
                    if between_epochs {
                        began = (frozen, k, r, m);
                    }
                }
            }
            "transition" => {
                (frozen, k, r, m) = (
                    pair_after("frozen_layers"),
                    pair_after("pipeline_len"),
                    pair_after("replicas"),
                    pair_after("micro_batches"),
                );
                // Between epochs: no step since the epoch's last. A transition made in a step
                // (`after_step`, logged before that step's event) carries the next step's
                // number, and its time is inside that step's.
                if between_epochs && e["step"].as_f64() == Some(last_step) {
                    began = (frozen, k, r, m);
                    clock += num(e, "seconds");
                }
                transitions.push(e);
            }
            "epoch" => {
                let eval = (num(&e["eval"], "accuracy"), num(&e["eval"], "loss"));
                // A run that ended inside an epoch (`train.max_steps`) evaluated there; resumed
                // for more steps, it ends that epoch later: one row, the epoch's start shape,
                // the evaluation at its end.
                push_row(&mut rows, e["epoch"].as_u64().unwrap_or(0), began, (frozen, k, r, m), Some(eval));
                began = (frozen, k, r, m);
                between_epochs = true;
            }
            _ => {}
        }
    }
    // Steps after the last epoch's end (a run stopped inside an epoch): a row of their own,
    // without an evaluation.
    if !between_epochs && let Some(&epoch) = work.keys().next_back() {
        push_row(&mut rows, epoch, began, (frozen, k, r, m), None);
    }

    let mut html = String::new();
    let title = config.output.dir.display().to_string();
    let _ = write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>pipetransformer: {}</title><style>\
         body{{font-family:sans-serif;margin:2em;max-width:70em}} table{{border-collapse:collapse}} \
         td,th{{border:1px solid #ccc;padding:0.3em 0.6em;text-align:right}} th{{background:#f4f4f4}} \
         svg{{border:1px solid #ddd;margin:0.5em 0}}</style></head><body><h1>{}</h1>",
        esc(&title),
        esc(&title)
    );
    let _ = write!(
        html,
        "<p>{:?} on {}; freeze rule <b>{:?}</b>, AutoPipe {}, AutoDP {}, AutoCache {}.</p>",
        config.data.dataset,
        esc(&config
            .model
            .pretrained
            .as_ref()
            .map_or_else(|| "a new model".into(), |p| format!("{:?}", p.display().to_string()))),
        config.elastic.freeze,
        on(config.elastic.auto_pipe),
        on(config.elastic.auto_dp),
        on(config.elastic.cache)
    );
    // Every distinct device set the run (and its resumes) ran on, in order.
    let mut device_sets: Vec<String> = Vec::new();
    for e in events.iter().filter(|e| e["event"] == "start") {
        let names: Vec<&str> = e["devices"].as_array().into_iter().flatten().filter_map(|d| d.as_str()).collect();
        let set = names.join(", ");
        if !names.is_empty() && device_sets.last() != Some(&set) {
            device_sets.push(set);
        }
    }
    if !device_sets.is_empty() {
        let _ = write!(html, "<p>Devices: {}.</p>", esc(&device_sets.join("; then, resumed on ")));
    }
    let held = config.data.evaluated_on();
    let _ = write!(
        html,
        "<h2>Per epoch</h2><p>Shapes that changed during an epoch show as start → end.</p><table><tr><th>epoch</th><th>frozen layers</th><th>K</th><th>R</th><th>M</th><th>samples/s</th><th>cache hits (samples)</th><th>{held} accuracy</th><th>{held} loss</th></tr>"
    );
    let span = |a: usize, b: usize| if a == b { a.to_string() } else { format!("{a} → {b}") };
    for row in &rows {
        let w = work.get(&row.epoch).copied().unwrap_or_default();
        // The cache's hit rate from the steps' lookups; a log of an older version has them
        // only in the cache events after each epoch's (two where a resume ended it).
        let (hits, looked_up) = match w.looked_up > 0.0 {
            true => (w.hits, w.looked_up),
            false => events
                .iter()
                .filter(|e| e["event"] == "cache" && e["epoch"].as_u64() == Some(row.epoch))
                .fold((0.0, 0.0), |(h, n), e| (h + num(e, "hits"), n + num(e, "hits") + num(e, "misses"))),
        };
        let hits = match looked_up > 0.0 {
            true => format!("{:.0}%", 100.0 * hits / looked_up),
            false => "–".to_string(),
        };
        let eval = match row.eval {
            Some((accuracy, loss)) => format!("<td>{:.2}%</td><td>{loss:.4}</td>", 100.0 * accuracy),
            None => "<td colspan=\"2\">the log ends inside the epoch</td>".into(),
        };
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{hits}</td>{eval}</tr>",
            row.epoch,
            span(row.start.0, row.end.0),
            span(row.start.1, row.end.1),
            span(row.start.2, row.end.2),
            span(row.start.3, row.end.3),
            if w.seconds > 0.0 { w.samples / w.seconds } else { 0.0 },
        );
    }
    html.push_str("</table>");
    // The run's best evaluation (train.keep_best), and where it stopped early.
    let last = |kind: &str| events.iter().rev().find(|e| e["event"] == kind);
    if let Some(b) = last("best")
        && let Ok(metric) = serde_json::from_value::<KeepBest>(b["metric"].clone())
    {
        let _ = write!(
            html,
            "<p>Best {held} {}: <b>{}</b> at step {}; its weights are in <code>best/</code>.</p>",
            metric.name(),
            metric.show(num(b, "value")),
            num(b, "step")
        );
    }
    if let Some(stop) = last("early_stop") {
        let _ = write!(
            html,
            "<p>Stopped early at step {}: {} evaluations in a row without a better score \
             (train.early_stopping_patience).</p>",
            num(stop, "step"),
            num(stop, "evaluations")
        );
    }
    if inside_epochs {
        let _ = write!(
            html,
            "<h2>Evaluations</h2><p>Run clock: training steps, transitions and evaluations so far; loading is not counted.</p><table><tr><th>step</th><th>run clock</th><th>{held} accuracy</th><th>{held} loss</th></tr>"
        );
        for (step, clock, accuracy, loss) in &evals {
            let _ = write!(
                html,
                "<tr><td>{step:.0}</td><td>{clock:.1} s</td><td>{:.2}%</td><td>{loss:.4}</td></tr>",
                100.0 * accuracy
            );
        }
        html.push_str("</table>");
    }
    html.push_str("<h2>Training loss</h2>");
    html.push_str(&line_chart(&losses, &transitions, last_step));
    html.push_str("<h2>Transitions</h2>");
    html.push_str(&timeline(&transitions, last_step));
    html.push_str("<table><tr><th>step</th><th>epoch</th><th>frozen layers</th><th>K</th><th>R</th><th>M</th><th>stages</th><th>cache</th><th>took</th><th style=\"text-align:left\">why</th></tr>");
    for t in &transitions {
        // Every value from the file is escaped: a hand-edited log may hold markup anywhere.
        let pair = |key: &str| esc(&format!("{} → {}", t[key][0], t[key][1]));
        let stages = |key: &str| -> String {
            let each = t[key].as_array().map(|a| a.iter().map(|s| esc(&format!("{}..{}", s["start"], s["end"]))));
            each.map(|e| e.collect::<Vec<_>>().join(" | ")).unwrap_or_default()
        };
        // Before → after where they moved (a log of an older version has the new ones alone).
        let (before, after) = (stages("stages_before"), stages("stages"));
        let stages = if before.is_empty() || before == after { after } else { format!("{before} → {after}") };
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0} ms</td><td style=\"text-align:left\">{}</td></tr>",
            esc(&t["step"].to_string()),
            esc(&t["epoch"].to_string()),
            pair("frozen_layers"),
            pair("pipeline_len"),
            pair("replicas"),
            pair("micro_batches"),
            stages,
            on(t["cache"] == true),
            t["seconds"].as_f64().unwrap_or(0.0) * 1e3,
            esc(t["reason"].as_str().unwrap_or(""))
        );
    }
    html.push_str("</table></body></html>\n");
    html
}

/// A number of a logged event (0 when absent).
fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

fn on(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

const W: f64 = 800.0;
const H: f64 = 240.0;
const PAD: f64 = 40.0;

/// The loss by step as a polyline, with each transition as a vertical line.
fn line_chart(points: &[(f64, f64)], transitions: &[&Value], last: f64) -> String {
    let finite: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.1.is_finite()).collect();
    if finite.is_empty() {
        return "<p>no steps logged</p>".into();
    }
    let (lo, hi) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let span = (hi - lo).max(1e-9);
    let x = |s: f64| PAD + (W - 2.0 * PAD) * s / last.max(1.0);
    let y = |v: f64| H - PAD + (PAD - H + PAD) * (v - lo) / span;
    let mut svg =
        format!("<svg width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" xmlns=\"http://www.w3.org/2000/svg\">");
    for t in transitions {
        let sx = x(t["step"].as_f64().unwrap_or(0.0));
        let _ = write!(
            svg,
            "<line x1=\"{sx:.1}\" y1=\"{PAD}\" x2=\"{sx:.1}\" y2=\"{:.1}\" stroke=\"#e67\" stroke-dasharray=\"4\"/>",
            H - PAD
        );
    }
    let path: Vec<String> = finite.iter().map(|&(s, v)| format!("{:.1},{:.1}", x(s), y(v))).collect();
    let _ = write!(svg, "<polyline fill=\"none\" stroke=\"#247\" stroke-width=\"1\" points=\"{}\"/>", path.join(" "));
    let _ = write!(
        svg,
        "<text x=\"4\" y=\"{:.0}\" font-size=\"11\">{hi:.3}</text><text x=\"4\" y=\"{:.0}\" font-size=\"11\">{lo:.3}</text>\
         <text x=\"{:.0}\" y=\"{:.0}\" font-size=\"11\">step {last:.0}</text></svg>",
        PAD + 4.0,
        H - PAD,
        W - PAD - 50.0,
        H - 8.0
    );
    svg
}

/// Transitions on a step axis, labelled with what the pipeline became.
fn timeline(transitions: &[&Value], last: f64) -> String {
    let h = 90.0;
    let x = |s: f64| PAD + (W - 2.0 * PAD) * s / last.max(1.0);
    let mut svg =
        format!("<svg width=\"{W}\" height=\"{h}\" viewBox=\"0 0 {W} {h}\" xmlns=\"http://www.w3.org/2000/svg\">");
    let _ = write!(svg, "<line x1=\"{PAD}\" y1=\"60\" x2=\"{:.0}\" y2=\"60\" stroke=\"#555\"/>", W - PAD);
    for (i, t) in transitions.iter().enumerate() {
        let sx = x(t["step"].as_f64().unwrap_or(0.0));
        let label = format!(
            "{}L K{} R{} M{}",
            t["frozen_layers"][1], t["pipeline_len"][1], t["replicas"][1], t["micro_batches"][1]
        );
        let ty = if i % 2 == 0 { 30.0 } else { 48.0 };
        let _ = write!(
            svg,
            "<circle cx=\"{sx:.1}\" cy=\"60\" r=\"4\" fill=\"#e67\"/><text x=\"{sx:.1}\" y=\"{ty}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
            esc(&label)
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{PAD}\" y=\"80\" font-size=\"11\">step 0</text><text x=\"{:.0}\" y=\"80\" font-size=\"11\">step {last:.0}</text></svg>",
        W - PAD - 50.0
    );
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-epoch run on a two-stage pipeline of two micro-batches.
    fn two_stage_run() -> RunConfig {
        RunConfig::parse(
            "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 4\n[train]\nepochs = 2\nlr = 0.1\n[output]\ndir = \"runs/t\"\n[pipeline]\npipeline_len = 2\nmicro_batches = 2\n",
            "t",
            &[],
        )
        .unwrap()
    }

    /// A run checkpointed after step 1 that went on to step 2 and then died is resumed from
    /// step 1: its replayed step 2 and evaluation count once, with the replay's values.
    #[test]
    fn a_resume_replaces_what_was_logged_after_its_checkpoint() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0,"devices":["cpu:0 (F32, bf16 products, 1 thread)"]}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.9,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.8,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"eval","step":2,"epoch":0,"eval":{"loss":0.5,"accuracy":0.5,"count":8},"eval_seconds":1.0}"#,
            r#"{"event":"start","resumed":true,"step":1,"devices":["cpu:0 (F32, 1 thread)"]}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"eval","step":2,"epoch":0,"eval":{"loss":0.4,"accuracy":0.625,"count":8},"eval_seconds":1.0}"#,
        ]
        .join("\n");
        let steps: Vec<f64> = events(&log).iter().filter(|e| e["event"] == "step").map(|e| num(e, "loss")).collect();
        assert_eq!(steps, [0.9, 0.7]);
        let html = render(&log, &two_stage_run());
        // One evaluation at step 2, on a clock of two steps and one evaluation: 3 s.
        assert!(html.contains("<tr><td>2</td><td>3.0 s</td><td>62.50%</td>"), "{html}");
        assert!(!html.contains("50.00%"), "the evaluation before the resume is replaced");
        // The report says what computed it, and that the resume dropped the bf16 products.
        let devices = "Devices: cpu:0 (F32, bf16 products, 1 thread); then, resumed on cpu:0 (F32, 1 thread).";
        assert!(html.contains(devices), "{html}");
    }

    /// A run checkpointed after step 1 made a transition in step 2 (logged before that step's
    /// event), then died; resumed from step 1, its replay made none. The transition is not the
    /// run's: it is dropped with the step.
    #[test]
    fn a_transition_after_the_checkpoint_a_resume_goes_back_to_is_dropped() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0,"plan":{"pipeline_len":2,"replicas":1,"micro_batches":2}}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.9,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"transition","step":2,"epoch":0,"reason":"abandoned","frozen_layers":[0,1],"pipeline_len":[2,1],"replicas":[1,2],"micro_batches":[2,1],"stages":[{"start":0,"end":8}],"cache":false,"seconds":3.0}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.8,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"start","resumed":true,"step":1,"plan":{"pipeline_len":2,"replicas":1,"micro_batches":2}}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"epoch","epoch":0,"eval":{"loss":0.4,"accuracy":0.625,"count":8},"samples":4,"train_seconds":1.0,"eval_seconds":1.0}"#,
        ]
        .join("\n");
        assert!(!events(&log).iter().any(|e| e["event"] == "transition"));
        let html = render(&log, &two_stage_run());
        assert!(!html.contains("abandoned"), "{html}");
        // Epoch 0 ran at K = 2 throughout: 8 samples in its two steps' 2 s.
        let row = "<tr><td>0</td><td>0</td><td>2</td><td>1</td><td>2</td><td>4.0</td>";
        assert!(html.contains(row), "{html}");
    }

    /// A run stopped inside epoch 0 (a signal: no epoch event) and resumed: the epoch's event
    /// counts the resumed process's steps alone; the row counts all its steps, their samples
    /// per second and their cache lookups (4 of 8 samples served before the stop, 8 of 8
    /// after).
    #[test]
    fn an_epoch_a_stop_split_counts_all_its_steps() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0,"plan":{"pipeline_len":1,"replicas":2,"micro_batches":1}}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.9,"lr":0.1,"grad_norm":1.0,"samples":8,"seconds":2.0}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.8,"lr":0.1,"grad_norm":1.0,"samples":8,"seconds":1.0,"cache_hits":4}"#,
            r#"{"event":"start","resumed":true,"step":2,"plan":{"pipeline_len":1,"replicas":2,"micro_batches":1}}"#,
            r#"{"event":"step","step":3,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":8,"seconds":1.0,"cache_hits":8}"#,
            r#"{"event":"epoch","epoch":0,"eval":{"loss":0.4,"accuracy":0.625,"count":8},"samples":8,"train_seconds":1.0,"eval_seconds":1.0}"#,
            r#"{"event":"cache","epoch":0,"hits":8,"misses":0,"entries":8,"memory_bytes":64,"disk_bytes":0}"#,
        ]
        .join("\n");
        let html = render(&log, &two_stage_run());
        // 24 samples in 4 s; 12 hits of 16 lookups (the first step, before the freeze, looked
        // up nothing).
        let row = "<tr><td>0</td><td>0</td><td>1</td><td>2</td><td>1</td><td>6.0</td><td>75%</td><td>62.50%</td>";
        assert!(html.contains(row), "{html}");
        assert!(!html.contains("ends inside"), "{html}");
        // The report the stop wrote, before the resume: the epoch's steps so far, no evaluation.
        let stopped: Vec<&str> = log.lines().take(3).collect();
        let html = render(&stopped.join("\n"), &two_stage_run());
        let row = "<tr><td>0</td><td>0</td><td>1</td><td>2</td><td>1</td><td>5.3</td><td>50%</td>\
                   <td colspan=\"2\">the log ends inside the epoch</td></tr>";
        assert!(html.contains(row), "{html}");
    }

    #[test]
    fn markup_from_the_log_or_the_config_is_escaped() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.5}"#,
            r#"{"event":"transition","step":"<img src=x>","epoch":"<i>","reason":"r","frozen_layers":[0,"<script>alert(2)</script>"],"pipeline_len":[1,1],"replicas":[1,1],"micro_batches":[1,1],"stages":[{"start":"<b>x</b>","end":1}],"cache":false,"seconds":1}"#,
        ]
        .join("\n");
        let mut config = two_stage_run();
        config.model.pretrained = Some("w/<script>p</script>".into());
        let html = render(&log, &config);
        for raw in ["<script", "<img", "<b>x", "<i>"] {
            assert!(!html.contains(raw), "{raw} unescaped: {html}");
        }
        assert!(html.contains("&lt;script&gt;alert(2)") && html.contains("&lt;script&gt;p"), "{html}");
    }

    #[test]
    fn a_line_in_another_encoding_costs_only_that_line() {
        let dir = crate::files::Scratch::new("report");
        let metrics = dir.join("metrics.jsonl");
        let mut bytes = br#"{"event":"start","resumed":false,"step":0}"#.to_vec();
        bytes.extend_from_slice(b"\ncaf\xe9\n");
        bytes.extend_from_slice(
            br#"{"event":"step","step":1,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.5}"#,
        );
        std::fs::write(&metrics, bytes).unwrap();
        write_report(&metrics, &dir.join("report.html"), &two_stage_run()).unwrap();
        assert!(std::fs::read_to_string(dir.join("report.html")).unwrap().contains("<polyline"));
    }

    /// The first shape is the one the run's log says it started in, not the one the config
    /// asks for now (a resume's flags can ask for another, which never ran).
    #[test]
    fn the_first_shape_is_the_logged_one() {
        let log = |start: &str| {
            [
                start,
                r#"{"event":"step","step":1,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.5}"#,
                r#"{"event":"epoch","epoch":0,"eval":{"loss":0.6,"accuracy":0.75,"count":8},"samples":4,"train_seconds":0.5,"eval_seconds":0.1}"#,
            ]
            .join("\n")
        };
        let row = |k: usize, m: usize| format!("<tr><td>0</td><td>0</td><td>{k}</td><td>1</td><td>{m}</td>");
        let logged =
            r#"{"event":"start","resumed":false,"step":0,"plan":{"pipeline_len":3,"replicas":1,"micro_batches":4}}"#;
        let html = render(&log(logged), &two_stage_run());
        assert!(html.contains(&row(3, 4)), "{html}");
        // A resume that reshaped at the epoch's start: its plan from there on.
        let resumed =
            r#"{"event":"start","resumed":true,"step":0,"plan":{"pipeline_len":1,"replicas":2,"micro_batches":1}}"#;
        let html = render(&log(&[logged, resumed].join("\n")), &two_stage_run());
        assert!(html.contains("<tr><td>0</td><td>0</td><td>1</td><td>2</td><td>1</td>"), "{html}");
        // A log without it (an older version's): the config's.
        let html = render(&log(r#"{"event":"start","resumed":false,"step":0}"#), &two_stage_run());
        assert!(html.contains(&row(2, 2)), "{html}");
    }

    /// A run that ended inside epoch 0 (`train.max_steps`) evaluated there; resumed for more
    /// steps it ends the epoch: one row for the epoch, its shape at the start, the samples per
    /// second of all its steps, the cache's lookups of both parts, the evaluation at its end.
    #[test]
    fn an_epoch_a_resume_finished_is_one_row() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0,"plan":{"pipeline_len":2,"replicas":1,"micro_batches":2}}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"epoch","epoch":0,"eval":{"loss":0.6,"accuracy":0.5,"count":8},"samples":4,"train_seconds":1.0,"eval_seconds":0.1}"#,
            r#"{"event":"cache","epoch":0,"hits":0,"misses":4,"entries":4,"memory_bytes":64,"disk_bytes":0}"#,
            r#"{"event":"start","resumed":true,"step":1,"plan":{"pipeline_len":1,"replicas":2,"micro_batches":1}}"#,
            r#"{"event":"step","step":2,"epoch":0,"loss":0.6,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.25}"#,
            r#"{"event":"step","step":3,"epoch":0,"loss":0.5,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.25}"#,
            r#"{"event":"epoch","epoch":0,"eval":{"loss":0.4,"accuracy":0.875,"count":8},"samples":8,"train_seconds":0.5,"eval_seconds":0.1}"#,
            r#"{"event":"cache","epoch":0,"hits":8,"misses":0,"entries":4,"memory_bytes":64,"disk_bytes":0}"#,
        ]
        .join("\n");
        let html = render(&log, &two_stage_run());
        // 12 samples in 1.5 s; 8 hits of 12 lookups.
        let row =
            "<tr><td>0</td><td>0</td><td>2 → 1</td><td>1 → 2</td><td>2 → 1</td><td>8.0</td><td>67%</td><td>87.50%</td>";
        assert!(html.contains(row), "{html}");
        assert_eq!(html.matches("<tr><td>0</td>").count(), 1, "{html}");
    }

    #[test]
    fn the_report_shows_each_epoch_and_transition_from_the_last_fresh_start() {
        let log = [
            r#"{"event":"start","resumed":false,"step":0}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":9.0,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":1.0}"#,
            r#"{"event":"start","resumed":false,"step":0}"#,
            r#"{"event":"step","step":1,"epoch":0,"loss":0.7,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.5}"#,
            r#"{"event":"epoch","epoch":0,"eval":{"loss":0.6,"accuracy":0.75,"perplexity":1.8,"count":8},"samples":4,"train_seconds":0.5,"eval_seconds":0.1}"#,
            r#"{"event":"cache","epoch":0,"hits":0,"misses":1,"entries":4,"memory_bytes":64,"disk_bytes":0}"#,
            r#"{"event":"transition","step":1,"epoch":0,"reason":"Alpha <rule>","frozen_layers":[0,2],"frozen_units":5,"pipeline_len":[2,1],"replicas":[1,2],"micro_batches":[2,1],"stages_before":[{"start":0,"end":4},{"start":4,"end":8}],"stages":[{"start":0,"end":8}],"batches_per_step":1,"cache":true,"seconds":20.0}"#,
            r#"{"event":"start","resumed":true,"step":1}"#,
            // Made in step 2 (after it ran, before its event): inside that step's time.
            r#"{"event":"transition","step":2,"epoch":1,"reason":"mid-epoch","frozen_layers":[2,3],"frozen_units":7,"pipeline_len":[1,1],"replicas":[2,2],"micro_batches":[1,1],"stages":[{"start":0,"end":8}],"batches_per_step":1,"cache":true,"seconds":10.0}"#,
            r#"{"event":"step","step":2,"epoch":1,"loss":0.5,"lr":0.1,"grad_norm":1.0,"samples":4,"seconds":0.25}"#,
            r#"{"event":"eval","step":2,"epoch":1,"eval":{"loss":0.45,"accuracy":0.8125,"count":8},"eval_seconds":0.05}"#,
            r#"{"event":"epoch","epoch":1,"eval":{"loss":0.4,"accuracy":0.875,"perplexity":1.5,"count":8},"samples":4,"train_seconds":0.25,"eval_seconds":0.1}"#,
            // More entries than the epoch's lookups: the rate is of lookups (3 of 4), not entries.
            r#"{"event":"cache","epoch":1,"hits":3,"misses":1,"entries":10,"memory_bytes":64,"disk_bytes":0}"#,
        ]
        .join("\n");
        let html = render(&log, &two_stage_run());
        // Epoch 0 ran at K=2, M=2 with a cold cache; epoch 1 after the transition at K=1, R=2.
        assert!(
            html.contains(
                "<tr><td>0</td><td>0</td><td>2</td><td>1</td><td>2</td><td>8.0</td><td>0%</td><td>75.00%</td>"
            ),
            "{html}"
        );
        assert!(
            html.contains(
                "<tr><td>1</td><td>2 → 3</td><td>1</td><td>2</td><td>1</td><td>16.0</td><td>75%</td><td>87.50%</td>"
            ),
            "{html}"
        );
        assert!(html.contains("0 → 2") && html.contains("2 → 1") && html.contains("Alpha &lt;rule&gt;"));
        assert!(html.contains("2L K1 R2 M1"), "the timeline labels the new shape");
        assert!(html.contains("<td>0..4 | 4..8 → 0..8</td>"), "the stages before and after: {html}");
        assert!(html.contains("<td>0..8</td><td>on</td><td>10000 ms</td>"), "an older log's: {html}");
        // Evaluations on the run clock (steps + evaluations + transitions between epochs): 0.5 +
        // 0.1, then + 20 (the transition after epoch 0; the one inside epoch 1 is in its step's
        // time) + 0.25 + 0.05.
        assert!(html.contains("<tr><td>1</td><td>0.6 s</td><td>75.00%</td>"), "{html}");
        assert!(html.contains("<tr><td>2</td><td>20.9 s</td><td>81.25%</td><td>0.4500</td>"), "{html}");
        assert!(html.contains("<tr><td>2</td><td>21.0 s</td><td>87.50%</td>"), "{html}");
        assert!(!html.contains("9.000"), "the first run's steps are not in the report");
        assert!(!html.contains("<script") && !html.contains("src="), "nothing to fetch or run");
    }
}
