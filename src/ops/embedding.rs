//! Embedding lookup (token, position, token-type tables) and its scatter-add backward.

use crate::error::{Result, check_len, data_error};
use crate::scalar::Float;
use rayon::prelude::*;

/// Elements one rayon task should at least move: below this, spawning costs more than copying.
const MIN_TASK_ELEMS: usize = 16 * 1024;

/// `out[n, :] (=|+=) table[ids[n], :]` for each of the `ids.len()` rows; `table` has `dim`
/// columns and `table.len() / dim` rows. Adds onto `out` when `accumulate` (word + position +
/// type embeddings sum into one buffer). An id past the table is an `Error::Data` naming it.
pub fn embedding_forward<T: Float>(
    out: &mut [T],
    ids: &[u32],
    table: &[T],
    dim: usize,
    accumulate: bool,
) -> Result<()> {
    const OP: &str = "embedding_forward";
    let rows = table_rows(OP, "table", table.len(), dim)?;
    check_len(OP, "out", out.len(), ids.len() * dim)?;
    check_ids(ids, rows)?;
    if dim == 0 {
        return Ok(());
    }
    let min_rows = (MIN_TASK_ELEMS / dim).max(1);
    out.par_chunks_mut(dim).zip(ids.par_iter()).with_min_len(min_rows).for_each(|(o, &id)| {
        let src = &table[id as usize * dim..(id as usize + 1) * dim];
        if accumulate {
            for (o, &s) in o.iter_mut().zip(src) {
                *o += s;
            }
        } else {
            o.copy_from_slice(src);
        }
    });
    Ok(())
}

/// `dtable[ids[n], :] += dout[n, :]`. Deterministic: each table row sums its contributions in
/// the order of `n`, whatever the thread count (no float atomics decide the result).
pub fn embedding_backward<T: Float>(dtable: &mut [T], ids: &[u32], dout: &[T], dim: usize) -> Result<()> {
    const OP: &str = "embedding_backward";
    let rows = table_rows(OP, "dtable", dtable.len(), dim)?;
    check_len(OP, "dout", dout.len(), ids.len() * dim)?;
    check_ids(ids, rows)?;
    if dim == 0 || ids.is_empty() {
        return Ok(());
    }
    // Bucket the positions by id with a stable counting sort: `order[start[v]..start[v + 1]]`
    // lists, in increasing n, the positions that read table row v. Each table row is then
    // owned by exactly one task, which adds its rows of `dout` in that order.
    let mut start = vec![0usize; rows + 1];
    for &id in ids {
        start[id as usize + 1] += 1;
    }
    for v in 0..rows {
        start[v + 1] += start[v];
    }
    let mut fill = start.clone();
    let mut order = vec![0usize; ids.len()];
    for (n, &id) in ids.iter().enumerate() {
        order[fill[id as usize]] = n;
        fill[id as usize] += 1;
    }
    // Table rows without contributions cost one comparison, so group many rows per task.
    let min_rows = (MIN_TASK_ELEMS / dim).max(64);
    dtable.par_chunks_mut(dim).enumerate().with_min_len(min_rows).for_each(|(v, row)| {
        for &n in &order[start[v]..start[v + 1]] {
            for (t, &d) in row.iter_mut().zip(&dout[n * dim..(n + 1) * dim]) {
                *t += d;
            }
        }
    });
    Ok(())
}

/// Rows of a table with `dim` columns, checking that its length is a whole number of rows.
pub(crate) fn table_rows(op: &'static str, arg: &'static str, len: usize, dim: usize) -> Result<usize> {
    let rows = len.checked_div(dim).unwrap_or(0);
    check_len(op, arg, len, rows * dim)?;
    Ok(rows)
}

/// Every id must index a row of a `rows`-row table; the first one that does not is reported.
pub(crate) fn check_ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= rows) {
        None => Ok(()),
        Some(n) => {
            let id = ids[n];
            Err(data_error(
                "token ids",
                format!("id {id} at position {n} is out of range for a table of {rows} rows (valid ids are 0..{rows})"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    /// Ids with repeats (so the scatter-add really sums), in random order.
    fn random_ids(rng: &mut Rng, n: usize, rows: usize) -> Vec<u32> {
        (0..n).map(|_| rng.below(rows as u64) as u32).collect()
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng::new(21);
        let (n, rows, dim) = (39, 11, 7);
        let ids = random_ids(&mut rng, n, rows);
        let table = rng.vec(rows * dim, 1.0);
        let base = rng.vec(n * dim, 1.0);
        for accumulate in [false, true] {
            let mut out = base.clone();
            embedding_forward(&mut out, &ids, &table, dim, accumulate).unwrap();
            let mut want = vec![0.0; n * dim];
            for i in 0..n {
                for j in 0..dim {
                    want[i * dim + j] =
                        table[ids[i] as usize * dim + j] + if accumulate { base[i * dim + j] } else { 0.0 };
                }
            }
            assert_eq!(rel_err(&out, &want), 0.0, "accumulate {accumulate}");
        }
    }

    /// Finite differences of `L = Σ out ⊙ R` w.r.t. the table.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(22);
        let (n, rows, dim) = (39, 13, 5);
        let ids = random_ids(&mut rng, n, rows);
        let mut table = rng.vec(rows * dim, 1.0);
        let r = rng.vec(n * dim, 1.0);
        let d0 = 0.75;
        let mut dtable = vec![d0; rows * dim];
        embedding_backward(&mut dtable, &ids, &r, dim).unwrap();
        let dtable: Vec<f64> = dtable.iter().map(|x| x - d0).collect();
        let numeric = numeric_gradient(&mut table, FD_STEP, |t| {
            let mut out = vec![0.0; n * dim];
            embedding_forward(&mut out, &ids, t, dim, false).unwrap();
            dot(&out, &r)
        });
        assert_grad("dtable", &dtable, &numeric);
    }

    #[test]
    fn backward_accumulates() {
        let mut rng = Rng::new(23);
        let (n, rows, dim) = (39, 9, 15);
        let ids = random_ids(&mut rng, n, rows);
        let dout = rng.vec(n * dim, 1.0);
        let mut dtable = vec![1.0; rows * dim];
        embedding_backward(&mut dtable, &ids, &dout, dim).unwrap();
        let once = dtable.clone();
        embedding_backward(&mut dtable, &ids, &dout, dim).unwrap();
        let want: Vec<f64> = once.iter().map(|x| 1.0 + 2.0 * (x - 1.0)).collect();
        assert!(rel_err(&dtable, &want) < 1e-14);
    }

    /// Bitwise-identical table gradients on 1 and 2 threads, with many repeated ids.
    #[test]
    fn backward_is_deterministic_across_thread_counts() {
        let mut rng = Rng::new(24);
        let (n, rows, dim) = (4099, 300, 64);
        let ids = random_ids(&mut rng, n, rows);
        let dout: Vec<f32> = rng.vec(n * dim, 1.0).into_iter().map(|x| x as f32).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut dtable = vec![0.125f32; rows * dim];
                embedding_backward(&mut dtable, &ids, &dout, dim).unwrap();
                dtable.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
            })
        };
        assert_eq!(run(1), run(2));
    }

    #[test]
    fn out_of_range_id_is_a_data_error() {
        let table = vec![0.0f32; 4 * 3];
        let mut out = vec![0.0f32; 3 * 3];
        let e = embedding_forward(&mut out, &[0, 4, 1], &table, 3, false).unwrap_err();
        assert!(matches!(e, Error::Data { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("id 4") && msg.contains("0..4"), "{msg}");
        let mut dtable = table.clone();
        let e = embedding_backward(&mut dtable, &[7, 0, 1], &out, 3).unwrap_err();
        assert!(matches!(e, Error::Data { .. }), "{e}");
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let table = vec![0.0f64; 4 * 3];
        let mut out = vec![0.0; 2 * 3 + 1];
        let e = embedding_forward(&mut out, &[0, 1], &table, 3, false).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "out", .. }), "{e}");
        assert!(e.to_string().contains("`out` has 7 elements, expected 6"), "{e}");
        let e = embedding_forward(&mut out[..6], &[0, 1], &table[..11], 3, false).unwrap_err();
        assert!(e.to_string().contains("`table`"), "{e}");
        let mut dtable = table.clone();
        let e = embedding_backward(&mut dtable, &[0, 1], &out, 3).unwrap_err();
        assert!(e.to_string().contains("`dout`"), "{e}");
    }
}
