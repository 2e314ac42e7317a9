//! The CUDA kernel sources (`kernels/*.cu`, embedded at build time) and their compilation for a
//! real GPU: NVRTC from the CUDA wheels `scripts/setup.sh` installs under `tools/cuda` (or
//! `PT_CUDA_HOME`), PTX cached on disk by source hash and architecture, and `ptxas -v`
//! resource reports (registers, spills, shared memory, stack) for `docs/KERNELS.md`.
//!
//! NVRTC is loaded through cudarc. cudarc finds libraries by file name only, so the wheel's
//! `libnvrtc.so.12` is opened first by full path with `RTLD_GLOBAL`: cudarc's later
//! `dlopen("libnvrtc.so.12")` then returns the library already loaded.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
}
pub use embedded::{KERNELS, SOURCES};

/// Architectures every kernel is compiled and checked for: A100 (sm_80) and H100/H200 (sm_90).
pub const CHECKED_ARCHS: [u32; 2] = [80, 90];

/// The source of `kernels/<file>.cu` with `common.cuh` inlined, as NVRTC compiles it (NVRTC
/// gets no file system view of `kernels/`, only the CUDA headers' include paths).
pub fn source(file: &str) -> Result<String> {
    let (_, text) = SOURCES
        .iter()
        .find(|(stem, _)| *stem == file)
        .ok_or_else(|| Error::Device { what: "kernels".into(), message: format!("no kernel file `{file}.cu`") })?;
    Ok(text.replace("#include \"common.cuh\"", embedded::COMMON))
}

/// The file (stem) that defines `kernel`.
pub fn file_of(kernel: &str) -> Result<&'static str> {
    KERNELS
        .iter()
        .find(|(k, _)| *k == kernel)
        .map(|(_, f)| *f)
        .ok_or_else(|| Error::Device { what: "kernels".into(), message: format!("no kernel named `{kernel}`") })
}

/// Where the CUDA wheels are unpacked: `PT_CUDA_HOME` (empty: unset), else `tools/cuda` in the
/// source tree.
pub fn cuda_home() -> PathBuf {
    std::env::var_os("PT_CUDA_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/cuda"))
}

/// How to install the CUDA wheels, and where `PT_CUDA_HOME` pointed when it chose the folder.
fn install_hint() -> String {
    match std::env::var_os("PT_CUDA_HOME").filter(|v| !v.is_empty()) {
        Some(home) => format!(
            "PT_CUDA_HOME={} names the folder: point it at where scripts/setup.sh cuda unpacked the wheels, or unset it",
            home.to_string_lossy()
        ),
        None => "run scripts/setup.sh cuda, or set PT_CUDA_HOME".into(),
    }
}

/// Loads NVRTC once; the error says where it was looked for and how to install it.
pub fn nvrtc() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = cuda_home().join("cuda_nvrtc/lib/libnvrtc.so.12");
            // SAFETY: loading NVRTC runs its initialisers only; the handle is leaked on purpose so
            // the library stays loaded for cudarc.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(&path),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            };
            match lib {
                Ok(lib) => {
                    std::mem::forget(lib);
                    Ok(())
                }
                // A system-wide NVRTC (a CUDA toolkit on the library path) serves as well.
                // SAFETY: checks for the library without using it.
                Err(_) if unsafe { cudarc::nvrtc::sys::is_culib_present() } => Ok(()),
                Err(e) => Err(format!("NVRTC not found at {} ({e}); {}", path.display(), install_hint())),
            }
        })
        .clone()
        .map_err(|message| Error::Device { what: "nvrtc".into(), message })
}

/// Include paths for `<cuda_bf16.h>` and `<mma.h>`.
fn include_paths() -> Vec<String> {
    let home = cuda_home();
    ["cuda_runtime/include", "cuda_nvcc/include"].iter().map(|d| home.join(d).display().to_string()).collect()
}

/// `compute_80`-style architecture names, as NVRTC wants them (`&'static str`).
fn compute_arch(arch: u32) -> Result<&'static str> {
    Ok(match arch {
        70 => "compute_70",
        75 => "compute_75",
        80 => "compute_80",
        86 => "compute_86",
        89 => "compute_89",
        90 => "compute_90",
        100 => "compute_100",
        120 => "compute_120",
        _ => {
            return Err(Error::Device {
                what: "nvrtc".into(),
                message: format!("compute capability {}.{} is not supported", arch / 10, arch % 10),
            });
        }
    })
}

/// PTX of `kernels/<file>.cu` for `compute_<arch>`, from the disk cache when the same source was
/// compiled before for the same architecture.
pub fn compile_ptx(file: &str, arch: u32) -> Result<String> {
    let src = source(file)?;
    let key = crate::rng::fnv1a(format!("{arch}\0{src}").as_bytes(), crate::rng::FNV_OFFSET);
    let cache = cache_dir().join(format!("{file}-sm{arch}-{key:016x}.ptx"));
    if let Ok(ptx) = std::fs::read_to_string(&cache) {
        return Ok(ptx);
    }
    nvrtc()?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(compute_arch(arch)?),
        include_paths: include_paths(),
        options: vec!["--std=c++17".into(), "-default-device".into()],
        name: Some(format!("{file}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts)
        .map_err(|e| Error::Device { what: format!("nvrtc: kernels/{file}.cu for sm_{arch}"), message: e.to_string() })?
        .to_src();
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(cache.parent().unwrap_or(Path::new("."))).is_ok() {
        let _ = crate::files::write_atomic(&cache, |w| std::io::Write::write_all(w, ptx.as_bytes()));
    }
    Ok(ptx)
}

/// A cubin (the GPU's own machine code) of `kernels/<file>.cu` for exactly `sm_<arch>`, from
/// the disk cache when the same source was compiled before. A driver loads a cubin for its
/// GPU whatever CUDA version it supports, while PTX from NVRTC 12.9 is refused by drivers older
/// than CUDA 12.9; so the `cuda` backend loads cubins, and PTX only when `PT_KERNELS=ptx` asks.
pub fn compile_cubin(file: &str, arch: u32) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src = source(file)?;
    let key = crate::rng::fnv1a(format!("cubin\0{arch}\0{src}").as_bytes(), crate::rng::FNV_OFFSET);
    let cache = cache_dir().join(format!("{file}-sm{arch}-{key:016x}.cubin"));
    if let Ok(cubin) = std::fs::read(&cache) {
        return Ok(cubin);
    }
    compute_arch(arch)?;
    nvrtc()?;
    let failed = |message: String| Error::Device { what: format!("nvrtc: kernels/{file}.cu for sm_{arch}"), message };
    let c_src = std::ffi::CString::new(src).map_err(|e| failed(e.to_string()))?;
    let name = std::ffi::CString::new(format!("{file}.cu")).map_err(|e| failed(e.to_string()))?;
    let prog = result::create_program(&c_src, Some(&name)).map_err(|e| failed(format!("{e:?}")))?;
    let mut options = vec![format!("--gpu-architecture=sm_{arch}"), "--std=c++17".into(), "-default-device".into()];
    options.extend(include_paths().into_iter().map(|p| format!("--include-path={p}")));
    // SAFETY: `prog` is a live program until destroyed at the end; the buffers are sized by NVRTC.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options).map_err(|e| {
            let log = result::get_program_log(prog)
                .map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            failed(format!("{e:?}: {log}"))
        });
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| failed(format!("cubin size: {e:?}")))?;
            let mut bytes = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast())
                .result()
                .map_err(|e| failed(format!("cubin: {e:?}")))?;
            Ok(bytes)
        });
        let _ = result::destroy_program(prog);
        cubin
    }?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(cache.parent().unwrap_or(Path::new("."))).is_ok() {
        let _ = crate::files::write_atomic(&cache, |w| std::io::Write::write_all(w, &out));
    }
    Ok(out)
}

/// Whether the `cuda` backend should load PTX instead of cubins (`PT_KERNELS=ptx`; `cubin` or
/// unset: cubins): for a driver newer than NVRTC that knows an architecture NVRTC cannot target.
pub fn load_ptx() -> Result<bool> {
    kernel_format(std::env::var("PT_KERNELS").ok().as_deref())
}

fn kernel_format(value: Option<&str>) -> Result<bool> {
    match value.map(str::to_ascii_lowercase).as_deref() {
        None | Some("cubin") => Ok(false),
        Some("ptx") => Ok(true),
        Some(other) => {
            Err(Error::Config { field: "PT_KERNELS".into(), message: format!("`{other}`; expected ptx or cubin") })
        }
    }
}

/// `$XDG_CACHE_HOME/pipetransformer/kernels` (or `~/.cache/...`, or the temp dir).
fn cache_dir() -> PathBuf {
    // An empty or relative value is no value (the XDG base directory rules): it would put the
    // cache in whatever folder the command runs in.
    let absolute = |name: &str| std::env::var_os(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let base = absolute("XDG_CACHE_HOME")
        .or_else(|| absolute("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("pipetransformer/kernels")
}

/// What `ptxas -v` reports for one kernel on one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resources {
    /// Kernel name.
    pub kernel: String,
    /// `sm_XY`'s XY.
    pub arch: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory, bytes.
    pub shared: u32,
    /// Stack frame, bytes.
    pub stack: u32,
    /// Spill stores + spill loads, bytes.
    pub spills: u32,
}

/// Assembles `kernels/<file>.cu` for `sm_<arch>` with `ptxas -v` and returns each kernel's
/// resources.
pub fn ptxas_resources(file: &str, arch: u32) -> Result<Vec<Resources>> {
    let ptx = compile_ptx(file, arch)?;
    // A folder of its own per call (calls run at once in tests), removed when ptxas succeeds
    // and kept where it failed: its log names lines of the PTX there.
    let dir = crate::files::Scratch::create("ptxas")?;
    let result = run_ptxas(&dir, file, arch, &ptx);
    if result.is_err() {
        dir.keep();
    }
    result
}

/// [`ptxas_resources`] with the PTX written into `dir`.
fn run_ptxas(dir: &Path, file: &str, arch: u32, ptx: &str) -> Result<Vec<Resources>> {
    let input = dir.join(format!("{file}-sm{arch}.ptx"));
    std::fs::write(&input, ptx).map_err(|source| crate::files::io_error(&input, source))?;
    let ptxas = cuda_home().join("cuda_nvcc/bin/ptxas");
    let out = std::process::Command::new(&ptxas)
        .arg(format!("-arch=sm_{arch}"))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(dir.join(format!("{file}-sm{arch}.cubin")))
        .output()
        .map_err(|e| Error::Device {
            what: "ptxas".into(),
            message: format!("cannot run {} ({e}); {}", ptxas.display(), install_hint()),
        })?;
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(Error::Device { what: format!("ptxas: kernels/{file}.cu for sm_{arch}"), message: log });
    }
    Ok(parse_ptxas(&log, arch))
}

/// Parses `ptxas -v` output: per function, the "Compiling entry function", "N bytes stack
/// frame, N bytes spill stores, N bytes spill loads" and "Used N registers, ... N bytes smem"
/// lines.
fn parse_ptxas(log: &str, arch: u32) -> Vec<Resources> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find_map(|part| {
                let part = part.trim();
                let (n, rest) = part.split_once(' ')?;
                rest.trim_start().starts_with(unit).then(|| n.parse().ok()).flatten()
            })
            .unwrap_or(0)
    };
    let mut out: Vec<Resources> = Vec::new();
    for line in log.lines() {
        let info = line.trim_start_matches("ptxas info").trim_start().trim_start_matches(':').trim();
        if let Some(rest) = info.strip_prefix("Compiling entry function '") {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Resources { kernel, arch, registers: 0, shared: 0, stack: 0, spills: 0 });
        } else if let Some(r) = out.last_mut() {
            if info.contains("bytes stack frame") {
                r.stack = number_before(info, "bytes stack frame");
                r.spills = number_before(info, "bytes spill stores") + number_before(info, "bytes spill loads");
            } else if let Some(used) = info.strip_prefix("Used ") {
                r.registers = used.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
                r.shared = number_before(info, "bytes smem");
            }
        }
    }
    out
}

/// The markers around the generated table in `docs/KERNELS.md`.
pub const TABLE_BEGIN: &str = "<!-- ptxas table: generated by `pipetransformer kernels --update docs/KERNELS.md` -->";
/// See [`TABLE_BEGIN`].
pub const TABLE_END: &str = "<!-- end of ptxas table -->";

/// Every kernel's resources on every checked architecture, as a markdown table; an error names
/// any kernel that spills.
pub fn resource_table() -> Result<String> {
    let mut rows = Vec::new();
    for (file, _) in SOURCES {
        for arch in CHECKED_ARCHS {
            rows.extend(ptxas_resources(file, arch)?.into_iter().map(|r| (file.to_string(), r)));
        }
    }
    let spilling: Vec<String> = rows
        .iter()
        .filter(|(_, r)| r.spills > 0)
        .map(|(_, r)| format!("{} (sm_{}, {} bytes)", r.kernel, r.arch, r.spills))
        .collect();
    if !spilling.is_empty() {
        return Err(Error::Device {
            what: "ptxas".into(),
            message: format!("kernels spill registers: {}", spilling.join(", ")),
        });
    }
    rows.sort_by(|a, b| (&a.0, &a.1.kernel, a.1.arch).cmp(&(&b.0, &b.1.kernel, b.1.arch)));
    let mut table = String::from(
        "| file | kernel | arch | registers | static shared (B) | stack (B) | spills (B) |\n|---|---|---|---|---|---|---|\n",
    );
    for (file, r) in rows {
        table.push_str(&format!(
            "| {file}.cu | `{}` | sm_{} | {} | {} | {} | {} |\n",
            r.kernel, r.arch, r.registers, r.shared, r.stack, r.spills
        ));
    }
    Ok(table)
}

/// `doc` with the text between [`TABLE_BEGIN`] and [`TABLE_END`] replaced by `table`.
pub fn with_table(doc: &str, table: &str) -> Result<String> {
    let missing = || Error::Data {
        what: "the document to update".into(),
        message: format!("the markers `{TABLE_BEGIN}` and `{TABLE_END}` that bound the table are missing"),
    };
    let start = doc.find(TABLE_BEGIN).ok_or_else(missing)? + TABLE_BEGIN.len();
    let end = doc[start..].find(TABLE_END).ok_or_else(missing)? + start;
    Ok(format!("{}\n{table}{}", &doc[..start], &doc[end..]))
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_kernel_format_is_cubin_unless_ptx_is_asked_and_nothing_else_is_taken() {
        assert!(!kernel_format(None).unwrap() && !kernel_format(Some("cubin")).unwrap());
        assert!(kernel_format(Some("PTX")).unwrap());
        let e = kernel_format(Some("sass")).unwrap_err().to_string();
        assert!(e.contains("PT_KERNELS") && e.contains("sass"), "{e}");
    }

    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_80'\n\
                   ptxas info    : Function properties for k\n\
                   \x20   16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 40 registers, used 1 barriers, 4352 bytes smem, 368 bytes cmem[0]\n";
        let r = parse_ptxas(log, 80);
        assert_eq!(
            r,
            vec![Resources { kernel: "k".into(), arch: 80, registers: 40, shared: 4352, stack: 16, spills: 12 }]
        );
    }

    #[test]
    fn with_table_replaces_only_the_generated_part() {
        let doc = format!("# K\n{TABLE_BEGIN}\nold\n{TABLE_END}\ntail\n");
        assert_eq!(with_table(&doc, "new\n").unwrap(), format!("# K\n{TABLE_BEGIN}\nnew\n{TABLE_END}\ntail\n"));
        assert!(with_table("no markers", "x").is_err());
    }

    #[test]
    fn every_kernel_file_inlines_the_common_header() {
        for (file, _) in SOURCES {
            let src = source(file).unwrap();
            assert!(!src.contains("#include \"common.cuh\""), "{file}");
        }
    }
}
