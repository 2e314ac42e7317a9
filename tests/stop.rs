//! A stop asked for (Ctrl-C, SIGTERM) before a run's first step: the stop flag is the
//! process's, so this test has a test binary of its own.

mod common;

use pipetransformer::Error;

/// A run that starts over in a folder holding an earlier run, stopped before its first step
/// (the signal came while the job was built), ends as interrupted and writes nothing: the
/// earlier run's log and checkpoint stay byte for byte, and nothing is set aside.
#[test]
fn a_fresh_run_stopped_before_its_first_step_writes_nothing() {
    let dir = pipetransformer::testing::Scratch::new("stop-before-first-step");
    let Some(config) = common::earlier_run(&dir) else { return };
    let before = common::run_files(&dir);
    let mut fresh = common::cpu_job(&config, 1, 1);
    pipetransformer::train::request_stop();
    let mut steps = 0;
    let err = fresh.run(&mut |e| steps += matches!(e, pipetransformer::train::Event::Step { .. }) as usize);
    assert!(matches!(err, Err(Error::Interrupted { step: Some(0), .. })), "{err:?}");
    assert_eq!(steps, 0);
    assert!(common::run_files(&dir) == before, "the earlier run's files were changed");
    for aside in common::SET_ASIDE {
        assert!(!dir.join(aside).exists(), "{aside} was set aside");
    }
    // The request withdrawn, the same process trains again (a library's caller that goes on
    // after a stopped run).
    pipetransformer::train::clear_stop();
    let mut again = common::cpu_job(&config, 1, 1);
    let mut steps = 0;
    let done = again.run(&mut |e| steps += matches!(e, pipetransformer::train::Event::Step { .. }) as usize);
    assert!(done.is_ok() && steps > 0, "{done:?}");
}
