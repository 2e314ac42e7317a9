//! The device-compiler half of the kernel checks (DESIGN.md §3): every `kernels/*.cu` compiles
//! with NVRTC for sm_80 and sm_90, `ptxas -v` reports no spills, and the resource table in
//! `docs/KERNELS.md` is the one the current sources give. Needs the CUDA wheels
//! (`scripts/setup.sh cuda`); skipped without them, except under CI, where that is a failure.

use pipetransformer::device::kernels;

fn toolkit_present() -> bool {
    let present = kernels::nvrtc().is_ok() && kernels::cuda_home().join("cuda_nvcc/bin/ptxas").exists();
    if !present {
        assert!(std::env::var_os("CI").is_none(), "CI must run the kernel compile checks: run scripts/setup.sh cuda");
        eprintln!("skipped: NVRTC/ptxas not installed (scripts/setup.sh cuda)");
    }
    present
}

#[test]
fn every_kernel_compiles_without_spills_and_the_kernels_doc_is_current() {
    if !toolkit_present() {
        return;
    }
    let table = kernels::resource_table().expect("NVRTC + ptxas");
    for (kernel, _) in kernels::KERNELS {
        for arch in kernels::CHECKED_ARCHS {
            assert!(
                table.contains(&format!("| `{kernel}` | sm_{arch} |")),
                "{kernel} missing from the ptxas report for sm_{arch}"
            );
        }
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/KERNELS.md");
    let doc = std::fs::read_to_string(path).expect("docs/KERNELS.md");
    let fresh = kernels::with_table(&doc, &table).expect("markers");
    assert!(fresh == doc, "docs/KERNELS.md is stale: run `cargo run --release -- kernels --update docs/KERNELS.md`");
}

/// The `cuda` backend loads cubins built for the GPU's exact architecture (a driver older than
/// NVRTC refuses its PTX, not its cubins): every kernel file gives an ELF cubin holding each
/// of its kernels for sm_80 and sm_90, and for sm_70 and sm_75, which lack bf16 tensor cores
/// but must still run the f32 path.
#[test]
fn every_kernel_file_compiles_to_a_cubin_for_each_architecture() {
    if !toolkit_present() {
        return;
    }
    let files: std::collections::BTreeSet<&str> = kernels::KERNELS.iter().map(|(_, f)| *f).collect();
    for arch in [70, 75, 80, 90] {
        for file in &files {
            let cubin = kernels::compile_cubin(file, arch).unwrap_or_else(|e| panic!("{file} for sm_{arch}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{file} for sm_{arch}: not an ELF cubin");
            for (kernel, _) in kernels::KERNELS.iter().filter(|(_, f)| f == file) {
                let name = kernel.as_bytes();
                assert!(cubin.windows(name.len()).any(|w| w == name), "{kernel} missing from the sm_{arch} cubin");
            }
        }
    }
}
