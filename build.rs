//! Builds the `cuda-emu` backend: every `kernels/*.cu` compiled for the host with
//! `kernels/emu/cuda_emu.h` force-included, plus the emulator runtime, into a shared library
//! (and a second one with AddressSanitizer). The paths reach the crate as `PT_EMU_LIB` and
//! `PT_EMU_LIB_ASAN`. The `cuda` backend needs nothing here: NVRTC compiles the same sources at
//! run time.

use std::path::{Path, PathBuf};
use std::process::Command;

// (A module of its own so that tests/emulator.rs can test it: a build script has no tests.)
#[path = "kernels/emu/poison_shared.rs"]
mod poison_shared;
use poison_shared::poison_static_shared;

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CXX");

    let files: Vec<PathBuf> =
        std::fs::read_dir(&kernels).expect("kernels/ exists").filter_map(|e| e.ok().map(|e| e.path())).collect();
    let with = |ext: &str| -> Vec<PathBuf> {
        files.iter().filter(|p| p.extension().is_some_and(|x| x == ext)).cloned().collect()
    };
    let mut sources = with("cu");
    sources.sort();

    // One generated translation unit per kernel file: the file, then a registration per kernel.
    let gen_dir = out.join("emu");
    std::fs::create_dir_all(&gen_dir).expect("create OUT_DIR/emu");
    let mut units = vec![kernels.join("emu/emu_runtime.cpp")];
    // For the `cuda` backend: every source embedded, and which file defines which kernel.
    let mut table =
        String::from("/// `(file stem, source)` of every `kernels/*.cu`.\npub const SOURCES: &[(&str, &str)] = &[\n");
    let mut index = String::from(
        "/// `(kernel, file stem)` of every `extern \"C\"` kernel.\npub const KERNELS: &[(&str, &str)] = &[\n",
    );
    for src in &sources {
        let text = std::fs::read_to_string(src).expect("read kernel source");
        let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("kernel");
        table.push_str(&format!("    ({stem:?}, include_str!({:?})),\n", src.display().to_string()));
        // The file itself, each static `__shared__` declaration followed by its poisoning
        // (cuda_emu.h), `#line` keeping the compiler's messages on the file's own lines.
        let mut unit = format!("#line 1 {:?}\n{}\n", src.display().to_string(), poison_static_shared(&text, src, true));
        for (name, bound) in kernel_names(&text) {
            // The bound's expression as the file writes it (a macro of the file, or a number);
            // 0 where the kernel declares none.
            unit.push_str(&format!("PT_EMU_REGISTER({name}, {})\n", bound.as_deref().unwrap_or("0")));
            index.push_str(&format!("    ({name:?}, {stem:?}),\n"));
        }
        let path = gen_dir.join(format!("{stem}.cpp"));
        write_if_changed(&path, &unit);
        units.push(path);
    }

    // Headers are included, not rewritten: a static `__shared__` in one is refused.
    for header in with("cuh") {
        poison_static_shared(&std::fs::read_to_string(&header).expect("read kernel header"), &header, false);
    }
    table.push_str("];\n");
    index.push_str("];\n");
    let common = format!(
        "/// `kernels/common.cuh`.\npub const COMMON: &str = include_str!({:?});\n",
        kernels.join("common.cuh").display().to_string()
    );
    write_if_changed(&out.join("kernel_sources.rs"), &format!("{common}{table}{index}"));

    let header = kernels.join("emu/cuda_emu.h");
    let plain = out.join("libptkernels_emu.so");
    let asan = out.join("libptkernels_emu_asan.so");
    // The two builds are independent: run them side by side.
    std::thread::scope(|s| {
        let a = s.spawn(|| compile(&units, &header, &kernels, &plain, &["-O2"]));
        let b = s.spawn(|| {
            compile(&units, &header, &kernels, &asan, &["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"])
        });
        a.join().expect("emu build thread");
        b.join().expect("emu asan build thread");
    });
    println!("cargo:rustc-env=PT_EMU_LIB={}", plain.display());
    println!("cargo:rustc-env=PT_EMU_LIB_ASAN={}", asan.display());
}

/// Names of the `extern "C" __global__ void [__launch_bounds__(…)] NAME(` kernels in a source
/// file, each with its launch bound's first argument (the most threads a block may have).
fn kernel_names(text: &str) -> Vec<(String, Option<String>)> {
    let key = "extern \"C\" __global__ void ";
    text.match_indices(key)
        .filter_map(|(i, _)| {
            let mut rest = &text[i + key.len()..];
            let mut bound = None;
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__(") {
                let close = bounds.find(')')?;
                bound = bounds[..close].split(',').next().map(|b| b.trim().to_string());
                rest = bounds[close + 1..].trim_start();
            }
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
            Some((rest[..end].to_string(), bound)).filter(|(n, _)| !n.is_empty())
        })
        .collect()
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).expect("write generated source");
    }
}

/// Compiles `units` with `header` force-included into the shared library `lib`.
fn compile(units: &[PathBuf], header: &Path, include: &Path, lib: &Path, flags: &[&str]) {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = Command::new(&cxx);
    cmd.args(["-std=c++17", "-shared", "-fPIC", "-pthread", "-g1", "-w"])
        .args(flags)
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(lib);
    // Kernel units are `.cu` files read as C++; every unit sees the emulation header first.
    cmd.arg("-include").arg(header).args(["-x", "c++"]).args(units);
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}`: {e}"));
    assert!(status.success(), "building {} failed ({status})", lib.display());
}
