//! Matrix products on the CPU through the `gemm` crate: plain, transposed (by strides) and batched.
//! Every other op that multiplies matrices (linear, attention, the tied LM head) goes through here.

use crate::scalar::Float;
use gemm::Parallelism;

/// A read-only strided view of a row-major or transposed matrix inside a slice.
#[derive(Clone, Copy)]
pub struct MatRef<'a, T> {
    /// The backing elements.
    pub data: &'a [T],
    /// Distance between consecutive rows, in elements.
    pub row_stride: usize,
    /// Distance between consecutive columns, in elements.
    pub col_stride: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A contiguous row-major matrix with `cols` columns.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Self { data, row_stride: cols, col_stride: 1 }
    }
    /// A row-major matrix whose rows are `row_stride` apart (a column slice of a wider matrix).
    pub fn strided(data: &'a [T], row_stride: usize) -> Self {
        Self { data, row_stride, col_stride: 1 }
    }
    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        Self { data: self.data, row_stride: self.col_stride, col_stride: self.row_stride }
    }
    /// Whether a `rows × cols` view stays inside its slice: the index one past the last
    /// element it touches, computed without wrapping (a stride near `usize::MAX` must not wrap
    /// to a small extent that passes), is at most the slice's length.
    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|r| (cols - 1).checked_mul(self.col_stride).and_then(|c| r.checked_add(c)));
        last.is_some_and(|last| last < self.data.len())
    }
}

/// Checks that C (`m × n`, row-major with row stride `ldc`) fits its buffer of `len` and that
/// its rows do not overlap (threads would write the same elements). `what` names the caller.
pub(crate) fn check_c(what: &str, len: usize, ldc: usize, m: usize, n: usize) {
    if m == 0 || n == 0 {
        return;
    }
    let extent = (m - 1).checked_mul(ldc).and_then(|r| r.checked_add(n));
    assert!(extent.is_some_and(|e| e <= len), "{what}: C view exceeds its buffer");
    assert!(m <= 1 || ldc >= n, "{what}: C rows overlap (row stride {ldc} < {n} columns)");
}

/// Below this many multiply-adds a product runs on the calling thread: spawning costs more.
const PARALLEL_MIN_WORK: usize = 48 * 48 * 48;

/// `C[m×n] = A[m×k]·B[k×n]` (or `C += A·B` when `accumulate`), `C` row-major with row stride
/// `c_row_stride`. Runs on the current rayon pool when the product is large enough.
///
/// Panics if a view reaches past its slice: callers size buffers from checked shapes, so that
/// is an internal bug, and the check is what keeps the `unsafe` call below sound.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    let par = if m * n * k >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    matmul_with(c, c_row_stride, a, b, m, n, k, accumulate, par)
}

/// [`matmul`] with the parallelism chosen by the caller (e.g. `None` inside a parallel loop).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    par: Parallelism,
) {
    check_c("matmul", c.len(), c_row_stride, m, n);
    assert!(a.fits(m, k), "matmul: A view exceeds its buffer");
    assert!(b.fits(k, n), "matmul: B view exceeds its buffer");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                c[r * c_row_stride..r * c_row_stride + n].fill(T::ZERO);
            }
        }
        return;
    }
    // SAFETY: the three asserts above bound every element gemm reads or writes; `c` is
    // borrowed mutably, so it cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_row_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

/// The obvious triple loop, in f64: the reference [`matmul`] is tested against.
pub fn matmul_reference<T: Float>(a: MatRef<T>, b: MatRef<T>, m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                s += a.data[i * a.row_stride + p * a.col_stride].to_f64()
                    * b.data[p * b.row_stride + j * b.col_stride].to_f64();
            }
            c[i * n + j] = s;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Rng, rel_err};

    /// A stride so large that `(rows − 1)·stride` wraps to a small number is refused, not
    /// handed to gemm (which would read far outside the slice).
    #[test]
    #[should_panic(expected = "matmul: A view exceeds its buffer")]
    fn a_wrapping_stride_is_refused() {
        let (a, b, mut c) = (vec![1.0f32; 4], vec![1.0f32; 4], vec![0.0f32; 4]);
        let wrapping = MatRef { data: &a, row_stride: 1 << (usize::BITS - 1), col_stride: 1 };
        matmul(&mut c, 1, wrapping, MatRef::rows(&b, 1), 3, 1, 1, false);
    }

    /// C rows that overlap would have threads write the same elements.
    #[test]
    #[should_panic(expected = "matmul: C rows overlap")]
    fn overlapping_c_rows_are_refused() {
        let (a, b, mut c) = (vec![1.0f32; 4], vec![1.0f32; 8], vec![0.0f32; 8]);
        matmul(&mut c, 2, MatRef::rows(&a, 1), MatRef::rows(&b, 4), 2, 4, 1, false);
    }

    /// gemm against the triple loop, every transpose combination, odd sizes, both dtypes.
    /// Tolerance: 1e-12 relative in f64, 1e-5 in f32 (k ≤ 300 terms of rounding).
    #[test]
    fn matmul_matches_reference_all_transposes() {
        let mut rng = Rng::new(1);
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (13, 1, 9), (64, 65, 63), (130, 97, 300)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a64 = rng.vec(m * k, 1.0);
                let b64 = rng.vec(k * n, 1.0);
                let a = if ta { MatRef::rows(&a64, m).t() } else { MatRef::rows(&a64, k) };
                let b = if tb { MatRef::rows(&b64, k).t() } else { MatRef::rows(&b64, n) };
                let want = matmul_reference(a, b, m, n, k);
                let mut c = vec![0.5; m * n];
                matmul(&mut c, n, a, b, m, n, k, false);
                assert!(rel_err(&c, &want) < 1e-12, "f64 {m}x{n}x{k} {ta} {tb}");
                // Accumulate mode adds onto what is there.
                let mut c2 = vec![1.0; m * n];
                matmul(&mut c2, n, a, b, m, n, k, true);
                let want2: Vec<f64> = want.iter().map(|x| x + 1.0).collect();
                assert!(rel_err(&c2, &want2) < 1e-12);

                let a32: Vec<f32> = a64.iter().map(|&x| x as f32).collect();
                let b32: Vec<f32> = b64.iter().map(|&x| x as f32).collect();
                let a = MatRef { data: &a32[..], row_stride: a.row_stride, col_stride: a.col_stride };
                let b = MatRef { data: &b32[..], row_stride: b.row_stride, col_stride: b.col_stride };
                let mut c = vec![0.0f32; m * n];
                matmul(&mut c, n, a, b, m, n, k, false);
                let want = matmul_reference(a, b, m, n, k);
                assert!(rel_err(&c, &want) < 1e-5, "f32 {m}x{n}x{k}");
            }
        }
    }
}
