//! Finding and opening libnccl. cudarc looks NCCL up by bare file names (`libnccl.so`,
//! `libnccl.so.{12,11,10,9,1}`), none of which is the name the library ships under:
//! `libnccl.so.2`, in PyPI's `nvidia-nccl-cu12` and Debian's `libnccl2`. So a GPU run never
//! found it and fell back to the host ring without a word. We open it ourselves, from the
//! first of [`candidates`] that loads, and resolve the few entry points the engine calls.
//! Return codes are read as plain integers (an unknown code from a newer NCCL must not become
//! an invalid Rust enum).

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclUniqueId};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// NCCL's `ncclFloat32`.
pub const FLOAT32: c_int = 7;
/// NCCL's `ncclSum`.
pub const SUM: c_int = 0;
/// NCCL's `ncclInProgress`: a nonblocking communicator's call has been queued and goes on in
/// the background (NCCL's `ncclCommGetAsyncError` says how it ends).
pub const IN_PROGRESS: c_int = 7;

type Code = c_int;

/// An opened libnccl: where it came from, its version, its entry points.
pub struct NcclLib {
    /// The file (or bare name, resolved by the dynamic linker) it was opened from.
    pub path: PathBuf,
    /// `ncclGetVersion`'s code, e.g. 23203 for 2.32.3.
    pub version: i32,
    pub(super) get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Code,
    pub(super) comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Code,
    pub(super) comm_init_all: unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> Code,
    pub(super) comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Code,
    pub(super) comm_abort: unsafe extern "C" fn(ncclComm_t) -> Code,
    pub(super) group_start: unsafe extern "C" fn() -> Code,
    pub(super) group_end: unsafe extern "C" fn() -> Code,
    #[allow(clippy::type_complexity)]
    pub(super) all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, cudaStream_t) -> Code,
    #[allow(clippy::type_complexity)]
    pub(super) broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, cudaStream_t) -> Code,
    get_error_string: unsafe extern "C" fn(Code) -> *const c_char,
    /// NCCL ≥ 2.14's nonblocking communicators, `None` in an older library.
    pub(super) nonblocking: Option<Nonblocking>,
    /// Kept open for the process's life: the function pointers above point into it.
    _lib: libloading::Library,
}

impl NcclLib {
    /// The version as `major.minor.patch` (NCCL ≥ 2.9 codes it as `major·10000 + minor·100 + patch`).
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    }

    /// `Ok` for `ncclSuccess`, else NCCL's own description of `code`.
    pub fn check(&self, what: &str, code: Code) -> crate::Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { (self.get_error_string)(code) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated and static (see above).
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(crate::Error::Device { what: format!("nccl: {what}"), message: format!("{text} (code {code})") })
    }
}

/// The entry points of nonblocking communicators (NCCL ≥ 2.14): an init that returns at once
/// and is asked how it is going, so that a wait for a peer that never comes can end.
#[derive(Clone, Copy)]
pub(super) struct Nonblocking {
    pub(super) comm_init_rank_config:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut InitConfig) -> Code,
    /// The communicator's state: [`IN_PROGRESS`] while queued work goes on, then success or
    /// the error it ended with.
    pub(super) get_async_error: unsafe extern "C" fn(ncclComm_t, *mut Code) -> Code,
}

/// The head of NCCL's `ncclConfig_t` as version 2.14 defined it, `cgaClusterSize` (2.17's
/// first field) spelt out where the padding would be. NCCL copies `size` bytes of a config and
/// gives every field its version predates the default, so this head is a whole config to any
/// NCCL from 2.14 on; only `blocking` is set.
#[repr(C)]
pub(super) struct InitConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
}

impl InitConfig {
    /// A nonblocking communicator, everything else NCCL's default.
    pub(super) fn nonblocking() -> Self {
        InitConfig {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef, // NCCL_API_MAGIC: "made by NCCL_CONFIG_INITIALIZER"
            version: 21400,     // NCCL_VERSION(2, 14, 0)
            blocking: 0,
            cga_cluster_size: c_int::MIN, // NCCL_CONFIG_UNDEF_INT (reset anyway: version < 2.17)
        }
    }
}

/// Where to look, in order: `PT_NCCL_LIB` alone when set (`env`); else the wheel the setup
/// step unpacks (`scripts/setup.sh nccl`: `<cuda_home>/nccl/lib/libnccl.so.2`), then the
/// dynamic linker's search path by name (Debian's `libnccl2`, a CUDA toolkit, `LD_LIBRARY_PATH`).
pub fn candidates(env: Option<PathBuf>, cuda_home: &Path) -> Vec<PathBuf> {
    match env {
        Some(path) => vec![path],
        None => {
            vec![cuda_home.join("nccl/lib/libnccl.so.2"), PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]
        }
    }
}

/// Opens the first of `paths` that loads and has every entry point; the error names each
/// path tried and why it failed.
pub fn load(paths: &[PathBuf]) -> Result<NcclLib, String> {
    let mut tried = Vec::new();
    for path in paths {
        match open(path) {
            Ok(lib) => return Ok(lib),
            Err(why) => tried.push(format!("{}: {why}", path.display())),
        }
    }
    Err(format!("libnccl not found (tried {})", tried.join("; ")))
}

fn open(path: &Path) -> Result<NcclLib, String> {
    // SAFETY: loading runs the library's initialisers; libnccl's only set up its own state.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    // SAFETY: each symbol is looked up by its C name and given NCCL's C signature (nccl.h).
    unsafe {
        fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
            // SAFETY: the caller names a symbol whose C type is `T`.
            unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("no `{name}`: {e}"))
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> Code = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != 0 {
            return Err("ncclGetVersion failed".into());
        }
        Ok(NcclLib {
            path: path.to_path_buf(),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            comm_init_all: sym(&lib, "ncclCommInitAll")?,
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            broadcast: sym(&lib, "ncclBroadcast")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            nonblocking: match version >= 21400 {
                true => sym(&lib, "ncclCommInitRankConfig")
                    .and_then(|init| Ok((init, sym(&lib, "ncclCommGetAsyncError")?)))
                    .ok()
                    .map(|(comm_init_rank_config, get_async_error)| Nonblocking {
                        comm_init_rank_config,
                        get_async_error,
                    }),
                false => None,
            },
            _lib: lib,
        })
    }
}

/// This process's libnccl, opened once from [`candidates`]; the error says where it was
/// looked for (the run then sums gradients over the host ring, and says so).
pub fn nccl() -> Result<&'static NcclLib, &'static str> {
    static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let env = std::env::var_os("PT_NCCL_LIB").map(PathBuf::from);
        load(&candidates(env, &crate::device::kernels::cuda_home()))
    })
    .as_ref()
    .map_err(String::as_str)
}

/// Builds the C `source` of a stand-in libnccl as `<dir>/<file>` with the system C compiler
/// (the one Rust links with); `None` where there is none, which CI does not accept.
#[cfg(test)]
pub(super) fn build_fake(dir: &Path, file: &str, source: &str) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let (src, lib) = (dir.join(format!("{file}.c")), dir.join(file));
    std::fs::write(&src, source).unwrap();
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .is_ok_and(|s| s.success());
    assert!(built || std::env::var_os("CI").is_none(), "CI needs a C compiler to build a fake libnccl");
    built.then_some(lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in libnccl.so.2 with every entry point the engine resolves: version 2.32.3, a
    /// unique id of bytes 0..128, and `ncclCommInitRank` failing with code 5.
    const FAKE: &str = r#"
        #include <string.h>
        typedef struct { char internal[128]; } id_t;
        int ncclGetVersion(int *v) { *v = 23203; return 0; }
        int ncclGetUniqueId(id_t *id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)i; return 0; }
        int ncclCommInitRank(void **c, int n, id_t id, int r) { return 5; }
        int ncclCommInitAll(void **c, int n, const int *d) { return 5; }
        int ncclCommDestroy(void *c) { return 0; }
        int ncclCommAbort(void *c) { return 0; }
        int ncclGroupStart(void) { return 0; }
        int ncclGroupEnd(void) { return 0; }
        int ncclAllReduce(const void *s, void *r, unsigned long n, int t, int o, void *c, void *st) { return 5; }
        int ncclBroadcast(const void *s, void *r, unsigned long n, int t, int root, void *c, void *st) { return 5; }
        const char *ncclGetErrorString(int code) { return code == 5 ? "invalid usage (fake)" : "other"; }
    "#;

    /// Builds `FAKE` as `<dir>/libnccl.so.2`.
    fn fake_nccl(dir: &Path) -> Option<PathBuf> {
        build_fake(dir, "libnccl.so.2", FAKE)
    }

    #[test]
    fn libnccl_so_2_is_found_where_the_wheel_puts_it_and_its_errors_are_nccls_words() {
        let home = crate::testing::Scratch::new("fake-nccl");
        let Some(_) = fake_nccl(&home.join("nccl/lib")) else { return };
        let lib = load(&candidates(None, &home)).unwrap();
        assert_eq!(lib.path, home.join("nccl/lib/libnccl.so.2"));
        assert_eq!(lib.version_string(), "2.32.3");
        assert!(lib.nonblocking.is_none(), "no ncclCommInitRankConfig in the fake: blocking inits");
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: the fake writes 128 bytes into `id`.
        lib.check("unique id", unsafe { (lib.get_unique_id)(&mut id) }).unwrap();
        assert_eq!(id.internal[127], 127);
        let e = lib.check("init", 5).unwrap_err().to_string();
        assert!(e.contains("nccl: init") && e.contains("invalid usage (fake)") && e.contains("code 5"), "{e}");
        // PT_NCCL_LIB alone is tried when set.
        let only = candidates(Some(home.join("elsewhere.so")), &home);
        assert_eq!(only, [home.join("elsewhere.so")]);
    }

    #[test]
    fn without_libnccl_the_error_lists_every_place_tried() {
        let home = crate::files::Scratch::new("no-nccl");
        let paths = candidates(None, &home);
        assert_eq!(paths.last().unwrap(), Path::new("libnccl.so"));
        // Only the absent wheel path: the bare names may exist on a GPU machine.
        let e = load(&paths[..1]).err().unwrap();
        assert!(e.contains("libnccl not found") && e.contains(&paths[0].display().to_string()), "{e}");
        // A library without NCCL's entry points is refused by name.
        let Some(fake) = fake_nccl(&home) else { return };
        let libc = PathBuf::from("libc.so.6");
        let e = load(&[libc]).err().unwrap();
        assert!(e.contains("no `ncclGetVersion`"), "{e}");
        assert!(load(&[home.join("absent.so"), fake]).is_ok(), "the next candidate is tried");
    }

    #[test]
    fn the_installed_libnccl_opens_and_reports_its_version() {
        // Present after `scripts/setup.sh nccl` (or with PT_NCCL_LIB); the real library needs
        // no GPU to load and name its version.
        if let Ok(lib) = nccl() {
            assert!(lib.version >= 20000, "{}: version code {}", lib.path.display(), lib.version);
            println!("{} from {}", lib.version_string(), lib.path.display());
            // Spanning groups are made of nonblocking communicators wherever NCCL has them.
            assert_eq!(
                lib.nonblocking.is_some(),
                lib.version >= 21400,
                "{}: version code {}",
                lib.path.display(),
                lib.version
            );
        }
    }
}
