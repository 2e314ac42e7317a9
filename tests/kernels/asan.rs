//! The whole kernel suite again with the emulated kernels built under AddressSanitizer: this
//! test re-runs its own binary (minus itself) with `libasan` preloaded and `PT_EMU_LIBRARY` naming
//! the instrumented library, so any out-of-bounds read or write of a kernel aborts that run.

use std::process::Command;

#[test]
fn kernel_suite_passes_under_address_sanitizer() {
    if std::env::var_os("PT_EMU_LIBRARY").is_some() || std::env::var("PT_TEST_DEVICE").as_deref() == Ok("cuda") {
        return; // already the instrumented run, or not on the emulator at all
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx).arg("-print-file-name=libasan.so").output().expect("run the C++ compiler");
    let libasan = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(libasan.starts_with('/'), "{cxx} does not know where libasan.so is (got `{libasan}`)");
    let run = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--skip", "asan::", "--test-threads", "2"])
        .env("LD_PRELOAD", &libasan)
        .env("PT_EMU_LIBRARY", pipetransformer::device::emu::LIBRARY_ASAN)
        // Rust's own allocations are not ours to audit, and the process exits without freeing.
        .env("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")
        .output()
        .expect("re-run the kernel tests");
    let log = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "kernel tests under AddressSanitizer failed:\n{log}");
    // The instrumented library really was the one loaded, and the suite really ran.
    assert!(
        log.contains("test result: ok") && !log.contains("running 0 tests"),
        "no test ran under AddressSanitizer:\n{log}"
    );
}
