//! The host emulator of our CUDA subset (`kernels/emu/`), through its self-test kernels
//! (`kernels/emu_selftest.cu`): block reductions, a missing barrier caught by the thread-order
//! seeds, every shuffle and vote, partial warps, atomics across blocks and OS threads, static and
//! dynamic shared memory poisoned for every block, wmma, bf16 rounding, and launches that can never complete reported as errors.

#[path = "../kernels/emu/poison_shared.rs"]
mod poison_shared;

use pipetransformer::device::emu::EmuRuntime;
use pipetransformer::device::gpu::{Arg, DevPtr, LaunchConfig, Runtime};
use std::sync::Arc;

/// Raw device memory of the emulator, freed on drop.
struct Raw {
    rt: Arc<EmuRuntime>,
    ptr: DevPtr,
    bytes: usize,
}

impl Raw {
    fn new(rt: &Arc<EmuRuntime>, bytes: &[u8]) -> Raw {
        let ptr = rt.alloc(bytes.len()).unwrap();
        rt.copy_to_device(ptr, bytes).unwrap();
        Raw { rt: rt.clone(), ptr, bytes: bytes.len() }
    }
    fn zeros(rt: &Arc<EmuRuntime>, bytes: usize) -> Raw {
        Raw::new(rt, &vec![0u8; bytes])
    }
    fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes];
        self.rt.copy_to_host(&mut out, self.ptr).unwrap();
        out
    }
    fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: allocated by this runtime, not used after.
        unsafe { self.rt.free(self.ptr, self.bytes) };
    }
}

fn rt(seed: u64, threads: usize) -> Arc<EmuRuntime> {
    Arc::new(EmuRuntime::new(0, seed, threads).unwrap())
}

fn launch(rt: &Arc<EmuRuntime>, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> pipetransformer::Result<()> {
    pipetransformer::device::GpuDevice::new(rt.clone(), pipetransformer::device::Precision::F32, false)
        .launch(kernel, cfg, args)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}
fn as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn as_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn block_reduction_with_shared_memory_and_shuffles() {
    let (rows, n) = (64usize, 1000usize);
    let x: Vec<f32> = (0..rows * n).map(|k| ((k / n * 7 + k % n * 13) % 97) as f32 - 40.0).collect();
    for seed in [0, 1, 2] {
        let rt = rt(seed, 2);
        let (xb, sums, maxes) = (Raw::new(&rt, &f32s(&x)), Raw::zeros(&rt, rows * 4), Raw::zeros(&rt, rows * 4));
        launch(
            &rt,
            "emu_test_block_reduce",
            LaunchConfig::linear(rows as u32, 256),
            &[xb.arg(), sums.arg(), maxes.arg(), Arg::I32(n as i32)],
        )
        .unwrap();
        for (r, (s, m)) in as_f32(&sums.read()).into_iter().zip(as_f32(&maxes.read())).enumerate() {
            let row = &x[r * n..(r + 1) * n];
            assert_eq!(s, row.iter().sum::<f32>(), "seed {seed} row {r}");
            assert_eq!(m, row.iter().copied().fold(f32::MIN, f32::max));
        }
    }
}

#[test]
fn a_missing_barrier_gives_wrong_answers_that_depend_on_the_seed() {
    let n = 256usize;
    let x: Vec<f32> = (0..n).map(|t| t as f32 + 1.0).collect();
    let run = |kernel: &str, seed: u64| {
        let rt = rt(seed, 1);
        let (xb, out) = (Raw::new(&rt, &f32s(&x)), Raw::zeros(&rt, n * 4));
        launch(&rt, kernel, LaunchConfig::linear(1, n as u32), &[xb.arg(), out.arg()]).unwrap();
        as_f32(&out.read())
    };
    let want: Vec<f32> = (0..n).map(|t| x[(t + 1) % n]).collect();
    for seed in [0, 1, 2, 3] {
        assert_eq!(run("emu_test_shared_synced", seed), want, "synced, seed {seed}");
    }
    let (a, b) = (run("emu_test_shared_race", 1), run("emu_test_shared_race", 2));
    assert_ne!(a, want, "the race went unnoticed with seed 1");
    assert_ne!(b, want, "the race went unnoticed with seed 2");
    assert_ne!(a, b, "two seeds gave the same interleaving");
}

#[test]
fn shuffles_and_votes() {
    let input: Vec<i32> = (0..64).map(|t| (t * 37 + 11) % 101 + 1).collect();
    for seed in [1, 2] {
        let rt = rt(seed, 1);
        let inb = Raw::new(&rt, &input.iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<_>>());
        let out = Raw::zeros(&rt, 15 * 64 * 4);
        launch(&rt, "emu_test_warp_ops", LaunchConfig::linear(1, 64), &[inb.arg(), out.arg()]).unwrap();
        let got: Vec<i32> = as_u32(&out.read()).into_iter().map(|v| v as i32).collect();
        for t in 0..64usize {
            let l = t % 32;
            let at = |lane: usize| input[t - l + lane];
            let ballot =
                |lanes: std::ops::Range<usize>| lanes.filter(|&k| at(k) & 1 == 1).fold(0u32, |b, k| b | 1 << k) as i32;
            let want = [
                at((l * 7 + 3) & 31),
                if l >= 3 { at(l - 3) } else { at(l) },
                if l + 5 < 32 { at(l + 5) } else { at(l) },
                at(l ^ 9),
                at(l & !7),
                if (l & 7) + 2 < 8 { at(l + 2) } else { at(l) },
                ballot(0..32),
                (0..32).any(|k| at(k) == 7) as i32,
                (0..32).all(|k| at(k) > 0) as i32,
                at(l ^ 16),
                if l >= 1 { at(l - 1) } else { at(l) },
                if l < 31 { at(l + 1) } else { at(l) },
                at(l ^ 1),
                if l < 16 { ballot(0..16) } else { ballot(16..32) },
                at(31 - l),
            ];
            for (k, w) in want.iter().enumerate() {
                assert_eq!(got[k * 64 + t], *w, "seed {seed}, column {k}, thread {t}");
            }
        }
    }
}

#[test]
fn a_partial_last_warp_leaves_missing_lanes_out() {
    let rt = rt(1, 1);
    let out = Raw::zeros(&rt, 96 * 4);
    launch(&rt, "emu_test_partial_warp", LaunchConfig::linear(1, 48), &[out.arg()]).unwrap();
    let got = as_u32(&out.read());
    for t in 0..48 {
        assert_eq!(got[t], if t < 32 { 0xffff_ffff } else { 0x0000_ffff }, "thread {t}");
        assert_eq!(got[48 + t], (t ^ 8) as u32, "thread {t}");
    }
}

/// A grid-stride loop over the largest `int` count: every thread visits its ⌈(n − t)/stride⌉
/// elements and no index wraps negative on the last step (it did for the threads within a
/// stride of 2³¹).
#[test]
fn a_grid_stride_loop_reaches_2_pow_31_without_wrapping() {
    let rt = rt(1, 2);
    let (blocks, threads) = (4u32, 1024u32);
    let stride = (blocks * threads) as u64;
    let n = i32::MAX as u64;
    let counts = Raw::zeros(&rt, (stride * 4) as usize);
    let cap = n.div_ceil(stride) as u32;
    let args = [counts.arg(), Arg::I32(i32::MAX), Arg::U32(cap)];
    launch(&rt, "emu_test_grid_stride", LaunchConfig::linear(blocks, threads), &args).unwrap();
    for (t, &c) in as_u32(&counts.read()).iter().enumerate() {
        assert_eq!(u64::from(c), (n - t as u64).div_ceil(stride), "thread {t}");
    }
}

/// The same for a block-stride loop (mean pooling's backward walks a sequence's `seq·dim`
/// elements with one block): no index wraps negative within a block of 2³¹.
#[test]
fn a_block_stride_loop_reaches_2_pow_31_without_wrapping() {
    let rt = rt(1, 1);
    let threads = 1024u32;
    let n = i32::MAX as u64;
    let counts = Raw::zeros(&rt, threads as usize * 4);
    let cap = n.div_ceil(u64::from(threads)) as u32;
    let args = [counts.arg(), Arg::I32(i32::MAX), Arg::U32(cap)];
    launch(&rt, "emu_test_block_stride", LaunchConfig::linear(1, threads), &args).unwrap();
    for (t, &c) in as_u32(&counts.read()).iter().enumerate() {
        assert_eq!(u64::from(c), (n - t as u64).div_ceil(u64::from(threads)), "thread {t}");
    }
}

/// Every block loop whose bound is a product (`seq * dim`, `T * hd`: sizes that can near 2³¹)
/// steps through `BLOCK_STRIDE`, which the test above checks; `+= blockDim.x` wraps there. A
/// loop bounded by one dimension (a row of `dim`, a vocabulary) cannot come near 2³¹.
#[test]
fn block_loops_over_a_product_use_block_stride() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        for (n, line) in source.lines().enumerate() {
            let bound = line.split_once("; ").and_then(|(_, rest)| rest.split_once(';')).map(|(cond, _)| cond);
            if line.contains("+= blockDim.x") && bound.is_some_and(|b| b.contains('*')) {
                panic!("{}:{}: a block loop over a product steps by += blockDim.x: {line}", path.display(), n + 1);
            }
        }
    }
}

#[test]
fn atomics_are_atomic_across_blocks_and_os_threads() {
    for threads in [1, 2] {
        let rt = rt(3, threads);
        let (blocks, per) = (64u32, 128u32);
        let g = (blocks * per) as i64;
        let (f, d, i, u, ull) =
            (Raw::zeros(&rt, 4), Raw::zeros(&rt, 8), Raw::zeros(&rt, 32), Raw::zeros(&rt, 4), Raw::zeros(&rt, 8));
        launch(
            &rt,
            "emu_test_atomics",
            LaunchConfig::linear(blocks, per),
            &[f.arg(), d.arg(), i.arg(), u.arg(), ull.arg()],
        )
        .unwrap();
        assert_eq!(as_f32(&f.read())[0], g as f32);
        let db = d.read();
        assert_eq!(f64::from_ne_bytes(db[..8].try_into().unwrap()), g as f64 / 2.0);
        let iv: Vec<i64> = as_u32(&i.read()).into_iter().map(|v| v as i32 as i64).collect();
        assert_eq!(&iv[..4], &[g * (g - 1) / 2, g - 1, -(g - 1), -g], "threads {threads}");
        assert!(1 <= iv[4] && iv[4] <= g);
        assert_eq!(&iv[5..], &[1, 1, blocks as i64]);
        assert_eq!(as_u32(&u.read())[0] as i64, 2 * g);
        assert_eq!(u64::from_ne_bytes(ull.read()[..8].try_into().unwrap()), (g as u64) << 32);
    }
}

#[test]
fn dynamic_shared_memory_is_per_block_and_poisoned() {
    let rt = rt(1, 1);
    let n = 200usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let (xb, out) = (Raw::new(&rt, &f32s(&x)), Raw::zeros(&rt, (n + 1) * 4));
    let cfg = LaunchConfig::linear(3, 128).with_shared((n + 1) * 4);
    launch(&rt, "emu_test_dynamic_shared", cfg, &[xb.arg(), out.arg(), Arg::I32(n as i32)]).unwrap();
    let got = as_f32(&out.read());
    for i in 0..n {
        assert_eq!(got[i], x[n - 1 - i]);
    }
    assert_eq!(got[n].to_bits(), 0xffff_ffff, "unwritten shared memory is not NaN-poisoned");
}

/// Static shared memory starts each block as poison (all bits set), as dynamic shared memory
/// does: not zero, and not what the block before it on the same OS thread left there.
#[test]
fn static_shared_memory_is_poisoned_for_every_block() {
    for (seed, threads) in [(0, 1), (1, 1), (2, 2)] {
        let rt = rt(seed, threads);
        let blocks = 6;
        let out = Raw::zeros(&rt, blocks * 2 * 4);
        launch(&rt, "emu_test_static_shared", LaunchConfig::linear(blocks as u32, 64), &[out.arg()]).unwrap();
        let got = as_f32(&out.read());
        for b in 0..blocks {
            assert_eq!(got[2 * b], b as f32, "seed {seed}");
            let unwritten = if b % 2 == 0 { 7.0f32.to_bits() } else { 0xffff_ffff };
            assert_eq!(got[2 * b + 1].to_bits(), unwritten, "block {b}, seed {seed}, {threads} thread(s)");
        }
    }
}

/// build.rs's rewrite puts the poisoning right after each static declaration's `;` (a comment
/// after it stays after it), leaves comments and `extern` declarations alone, and fails the
/// build naming the line for every declaration it could not poison.
#[test]
fn the_build_poisons_every_static_shared_declaration_or_refuses_it() {
    use poison_shared::poison_static_shared;
    let path = std::path::Path::new("k.cu");
    let rewrite = |text: &str| poison_static_shared(text, path, true);
    assert_eq!(
        rewrite("  __shared__ float x[32];  // per warp\n__shared__ Pair p; /* one */\n"),
        "  __shared__ float x[32]; PT_EMU_POISON_SHARED(x);  // per warp\n\
         __shared__ Pair p; PT_EMU_POISON_SHARED(p); /* one */\n"
    );
    let untouched = "// a __shared__ buffer\n/* the __shared__\n * __shared__ float no[2];\n */ int a; // é·\n";
    assert_eq!(rewrite(untouched), untouched);
    let refused = |text: &str, poison: bool| {
        std::panic::catch_unwind(|| poison_static_shared(text, path, poison))
            .err()
            .and_then(|e| e.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    };
    for (text, line, why) in [
        ("int a;\n__shared__ float a[2]; __shared__ float b[2];\n", 2, "two __shared__ declarations on one line"),
        ("#define M __shared__ float m[2]; \\\n", 1, "a __shared__ declaration inside a macro"),
        (
            "__shared__ float x __attribute__((aligned(16)));\n",
            1,
            "a __shared__ declaration with more than a type, a name and sizes",
        ),
        ("__shared__ float a[2], b[2];\n", 1, "a __shared__ declaration with more than a type, a name and sizes"),
        ("__shared__ float\n    a[2];\n", 1, "a __shared__ declaration that does not end on its line"),
        ("extern __shared__ float dyn[];\n", 1, "`extern __shared__` has no host equivalent"),
    ] {
        let message = refused(text, true);
        assert!(message.starts_with(&format!("k.cu:{line}: {why}")), "{text:?}: {message}");
    }
    // A header is not rewritten: a static declaration there is refused, the CUDA branch of
    // DYNAMIC_SHARED is not.
    let dynamic = "#define DYN(T, n) \\\n    extern __shared__ unsigned char s_[]; \\\n";
    assert_eq!(poison_static_shared(dynamic, path, false), dynamic);
    assert!(refused("__shared__ float h[4];\n", false).starts_with("k.cu:1: a header declares static shared memory"));
}

#[test]
fn wmma_multiplies_bf16_tiles_in_f32() {
    let rt = rt(2, 1);
    let bf = |v: f32| half::bf16::from_f32(v).to_bits().to_ne_bytes();
    let a: Vec<f32> = (0..256).map(|i| ((i * 5) % 7) as f32 - 3.0).collect(); // a[m*16+k] = A[m][k]
    let b: Vec<f32> = (0..256).map(|i| ((i * 3) % 5) as f32 * 0.5 - 1.0).collect(); // b[n*16+k] = B[k][n]
    let c: Vec<f32> = (0..256).map(|i| (i % 11) as f32).collect();
    let (ab, bb) = (
        Raw::new(&rt, &a.iter().flat_map(|&v| bf(v)).collect::<Vec<_>>()),
        Raw::new(&rt, &b.iter().flat_map(|&v| bf(v)).collect::<Vec<_>>()),
    );
    let (cb, db) = (Raw::new(&rt, &f32s(&c)), Raw::zeros(&rt, 256 * 4));
    launch(&rt, "emu_test_wmma", LaunchConfig::linear(1, 32), &[ab.arg(), bb.arg(), cb.arg(), db.arg()]).unwrap();
    let d = as_f32(&db.read());
    for m in 0..16 {
        for n in 0..16 {
            let dot: f32 = (0..16).map(|k| a[m * 16 + k] * b[n * 16 + k]).sum();
            assert_eq!(d[n * 16 + m], 1.0 + c[m * 16 + n] + dot, "({m},{n})");
        }
    }
}

#[test]
fn bf16_rounds_to_nearest_even() {
    let cases: [(u32, u16); 19] = [
        (0x3f80_0000, 0x3f80),
        (0x3f80_8000, 0x3f80),
        (0x3f81_8000, 0x3f82),
        (0x3f80_c000, 0x3f81),
        (0x3f80_4000, 0x3f80),
        (0x7fc0_0000, 0x7fff),
        (0xffc0_0001, 0x7fff),
        (0x7f80_0001, 0x7fff),
        (0x7f80_0000, 0x7f80),
        (0xff80_0000, 0xff80),
        (0x7f7f_ffff, 0x7f80),
        (0x7f7f_0000, 0x7f7f),
        (0x0000_0001, 0x0000),
        (0x0000_8000, 0x0000),
        (0x0001_8000, 0x0002),
        (0xbfc0_0000, 0xbfc0),
        (0x8000_0000, 0x8000),
        (0x4049_0fdb, 0x4049),
        (0xc2f7_8000, 0xc2f8),
    ];
    let rt = rt(1, 1);
    let x: Vec<f32> = cases.iter().map(|&(bits, _)| f32::from_bits(bits)).collect();
    let n = x.len();
    let (xb, y, back) = (Raw::new(&rt, &f32s(&x)), Raw::zeros(&rt, n * 2), Raw::zeros(&rt, n * 4));
    launch(&rt, "emu_test_bf16", LaunchConfig::linear(1, 32), &[xb.arg(), y.arg(), back.arg(), Arg::I32(n as i32)])
        .unwrap();
    let got: Vec<u16> = y.read().chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect();
    let back = as_u32(&back.read());
    for (i, &(input, want)) in cases.iter().enumerate() {
        assert_eq!(got[i], want, "{input:08x}");
        assert_eq!(back[i], (want as u32) << 16);
    }
}

#[test]
fn launches_that_can_never_complete_are_errors_naming_the_threads() {
    let rt = rt(1, 1);
    let out = Raw::zeros(&rt, 128 * 4);
    let e = launch(&rt, "emu_test_early_exit", LaunchConfig::linear(2, 64), &[out.arg()]).unwrap_err().to_string();
    assert!(e.contains("__syncthreads can never complete") && e.contains("threads that exited: 32-63"), "{e}");
    let e = launch(&rt, "emu_test_exited_lane", LaunchConfig::linear(1, 32), &[out.arg()]).unwrap_err().to_string();
    assert!(e.contains("warp collective can never complete") && e.contains("threads that exited: 31"), "{e}");
    let e = launch(&rt, "no_such_kernel", LaunchConfig::linear(1, 32), &[]).unwrap_err().to_string();
    assert!(e.contains("no_such_kernel"), "{e}");
    let e = launch(&rt, "emu_test_partial_warp", LaunchConfig::linear(1, 2048), &[out.arg()]).unwrap_err().to_string();
    assert!(e.contains("1024"), "{e}");
    // The same OS thread still runs good launches afterwards.
    launch(&rt, "emu_test_partial_warp", LaunchConfig::linear(1, 48), &[out.arg()]).unwrap();
}

/// Blocks run in an order drawn from the seed (seed 0: by index), each exactly once, on one OS
/// thread or several: a kernel whose result depends on which block runs first shows it.
#[test]
fn blocks_run_once_each_in_an_order_the_seed_draws() {
    let blocks = 97u32;
    let order = |seed: u64, threads: usize| {
        let rt = rt(seed, threads);
        let (order, next) = (Raw::zeros(&rt, blocks as usize * 4), Raw::zeros(&rt, 4));
        launch(&rt, "emu_test_block_order", LaunchConfig::linear(blocks, 32), &[order.arg(), next.arg()]).unwrap();
        as_u32(&order.read())
    };
    assert_eq!(order(0, 1), (0..blocks).collect::<Vec<_>>());
    let orders: Vec<Vec<u32>> = (1..4).map(|seed| order(seed, 1)).collect();
    for o in &orders {
        let mut sorted = o.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..blocks).collect::<Vec<_>>(), "every block once");
        assert_ne!(o, &(0..blocks).collect::<Vec<_>>(), "not the index order");
    }
    assert!(orders[0] != orders[1] && orders[1] != orders[2], "another seed, another order");
    assert_eq!(order(2, 1), orders[1], "the same seed, the same order");
    let mut two = order(2, 2);
    two.sort_unstable();
    assert_eq!(two, (0..blocks).collect::<Vec<_>>(), "two OS threads: every block once");
}

/// A block larger than the kernel's `__launch_bounds__` is refused, as the GPU refuses it.
#[test]
fn a_block_past_the_kernels_launch_bounds_is_refused() {
    let rt = rt(0, 1);
    let out = Raw::zeros(&rt, 128 * 4);
    launch(&rt, "emu_test_bounded", LaunchConfig::linear(1, 64), &[out.arg()]).unwrap();
    let err = launch(&rt, "emu_test_bounded", LaunchConfig::linear(1, 128), &[out.arg()]).unwrap_err().to_string();
    assert!(err.contains("block (128,1,1) has 128 threads, more than its __launch_bounds__(64)"), "{err}");
}
