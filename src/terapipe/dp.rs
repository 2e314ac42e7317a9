//! The planner's inner problem: for one cap `t_max` on the slice time, the cheapest way (least
//! summed slice time) to cut a batch into micro-batches and each micro-batch into token slices
//! whose times are all at most the cap, under the memory constraint if there is one.
//!
//! Positions are grid units. The token DP runs over suffixes (`R(i)` = cheapest cover of units
//! `i..N`, whose first slice has context `i`), so following the first-slice choices from 0
//! rebuilds the plan, and "the smallest first slice among equals" makes the result the
//! lexicographically smallest slicing among those with the same (time, slice count).

use super::latency::LatencyModel;
use crate::error::{Result, config_error};
use rayon::prelude::*;

/// Every admissible slice of one micro-batch size, grouped by start position and sorted by time
/// within a start, so that a cap admits a prefix of each group: one DP costs `O(N + admitted)`,
/// not `O(N²)`.
pub(crate) struct Table {
    /// Sequences per micro-batch.
    pub(crate) batch: usize,
    units: usize,
    offsets: Vec<usize>,
    times: Vec<f64>,
    lens: Vec<u32>,
    /// The least possible largest slice time over all slicings (`∞` when none exists): caps
    /// below it are infeasible.
    pub(crate) bottleneck: f64,
}

impl Table {
    /// The table of micro-batch size `batch` over `units` grid units. Errors on a time that is
    /// negative or not finite.
    pub(crate) fn build(latency: &LatencyModel, batch: usize, units: usize, parallel: bool) -> Result<Table> {
        let step = latency.grid().step;
        let row = |i: usize| -> Result<Vec<(f64, u32)>> {
            let mut v = Vec::with_capacity(units - i);
            for k in 1..=units - i {
                let t = latency.time_units(batch, k, i);
                if !t.is_finite() || t < 0.0 {
                    return Err(config_error(
                        "terapipe.latency",
                        format!(
                            "t(batch {batch}, length {}, context {}) = {t}: the planner needs finite, non-negative \
                             slice times",
                            k * step,
                            i * step
                        ),
                    ));
                }
                v.push((t, k as u32));
            }
            v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            Ok(v)
        };
        let rows: Vec<Vec<(f64, u32)>> = if parallel {
            (0..units).into_par_iter().map(row).collect::<Result<_>>()?
        } else {
            (0..units).map(row).collect::<Result<_>>()?
        };
        let mut table = Table {
            batch,
            units,
            offsets: Vec::with_capacity(units + 1),
            times: Vec::with_capacity(rows.iter().map(Vec::len).sum()),
            lens: Vec::new(),
            bottleneck: f64::INFINITY,
        };
        table.offsets.push(0);
        for r in rows {
            table.times.extend(r.iter().map(|e| e.0));
            table.lens.extend(r.iter().map(|e| e.1));
            table.offsets.push(table.times.len());
        }
        table.bottleneck = table.minimax();
        Ok(table)
    }

    fn slices(&self, start: usize) -> (&[f64], &[u32]) {
        let r = self.offsets[start]..self.offsets[start + 1];
        (&self.times[r.clone()], &self.lens[r])
    }

    /// Every admissible slice time (the candidate caps).
    pub(crate) fn times(&self) -> &[f64] {
        &self.times
    }

    /// `M(i) = min over first slices of max(t, M(i + k))`: the smallest cap with a cover.
    fn minimax(&self) -> f64 {
        let n = self.units;
        let mut m = vec![f64::INFINITY; n + 1];
        m[n] = 0.0;
        for i in (0..n).rev() {
            let (times, lens) = self.slices(i);
            for (&t, &k) in times.iter().zip(lens) {
                if t >= m[i] {
                    break; // sorted: no later slice can lower the max
                }
                m[i] = m[i].min(t.max(m[i + k as usize]));
            }
        }
        m[0]
    }
}

/// One micro-batch's slicing: slice lengths in grid units, their summed and largest time.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Path {
    pub(crate) sigma: f64,
    pub(crate) max: f64,
    pub(crate) lens: Vec<u32>,
}

/// The cheapest slicing under `cap`, ties broken by fewer slices, then the smallest first
/// slice; `None` when no slicing fits under the cap.
pub(crate) fn min_sum(table: &Table, cap: f64) -> Option<Path> {
    let n = table.units;
    let mut sigma = vec![f64::INFINITY; n + 1];
    let mut count = vec![u32::MAX; n + 1];
    let mut first = vec![0u32; n + 1];
    sigma[n] = 0.0;
    count[n] = 0;
    for i in (0..n).rev() {
        let (times, lens) = table.slices(i);
        let (mut bs, mut bc, mut bk) = (f64::INFINITY, u32::MAX, u32::MAX);
        for (&t, &k) in times.iter().zip(lens) {
            if t > cap {
                break;
            }
            let j = i + k as usize;
            if count[j] == u32::MAX {
                continue;
            }
            let (s, c) = (t + sigma[j], count[j] + 1);
            if s < bs || (s == bs && (c, k) < (bc, bk)) {
                (bs, bc, bk) = (s, c, k);
            }
        }
        (sigma[i], count[i], first[i]) = (bs, bc, bk);
    }
    if count[0] == u32::MAX {
        return None;
    }
    let (mut i, mut lens, mut max) = (0, Vec::new(), 0.0f64);
    while i < n {
        let k = first[i];
        max = max.max(slice_time(table, i, k));
        lens.push(k);
        i += k as usize;
    }
    Some(Path { sigma: sigma[0], max, lens })
}

fn slice_time(table: &Table, start: usize, len: u32) -> f64 {
    let (times, lens) = table.slices(start);
    // The group is sorted by time, not length: a linear search, only while rebuilding a path.
    lens.iter().position(|&k| k == len).map_or(f64::NAN, |p| times[p])
}

/// A partial plan in a resource-constrained DP: summed and largest time, resource used, slice
/// count, and how to rebuild it (its first piece, the index of the rest in the next frontier,
/// and a payload the caller threads through).
#[derive(Clone, Copy, Debug)]
struct Label {
    sigma: f64,
    max: f64,
    res: u64,
    count: u32,
    piece: u32,
    next: u32,
    aux: u32,
}

impl Label {
    const EMPTY: Label = Label { sigma: 0.0, max: 0.0, res: 0, count: 0, piece: 0, next: 0, aux: 0 };
}

/// Keeps the Pareto-optimal labels in (sigma, res): sorted by res ascending, sigma strictly
/// decreasing; among equal (sigma, res) the one with fewer slices, then the smaller first piece.
fn pareto(mut v: Vec<Label>) -> Vec<Label> {
    v.sort_by(|a, b| {
        a.res.cmp(&b.res).then(a.sigma.total_cmp(&b.sigma)).then(a.count.cmp(&b.count)).then(a.piece.cmp(&b.piece))
    });
    let mut out: Vec<Label> = Vec::new();
    for l in v {
        if out.last().is_none_or(|last| l.sigma < last.sigma) {
            out.push(l);
        }
    }
    out
}

/// The Pareto frontier (summed time vs. resource) of the slicings of one micro-batch under a
/// cap whose resource, `Σ cost(len)` over the slices, stays within a budget.
pub(crate) struct Frontier {
    per_start: Vec<Vec<Label>>,
}

impl Frontier {
    /// `prefix_min(i)` is a lower bound on the resource that covering units `0..i` needs, so
    /// suffixes that cannot fit are dropped early; `drop(i, sigma, res)` drops suffixes from `i`
    /// that cannot lead to a plan as good as the best so far. `drop` must not look at anything
    /// the Pareto filter ignores (a suffix's largest slice, say): a dropped label may be the one
    /// that dominated, and so removed, a label that would have been kept.
    pub(crate) fn build(
        table: &Table,
        cap: f64,
        cost: impl Fn(u32) -> u64,
        budget: u64,
        prefix_min: impl Fn(usize) -> u64,
        drop: impl Fn(usize, f64, u64) -> bool,
    ) -> Frontier {
        let n = table.units;
        let mut per_start: Vec<Vec<Label>> = vec![Vec::new(); n + 1];
        per_start[n].push(Label::EMPTY);
        let mut cand = Vec::new();
        for i in (0..n).rev() {
            let (times, lens) = table.slices(i);
            let room = budget.saturating_sub(prefix_min(i));
            for (&t, &k) in times.iter().zip(lens) {
                if t > cap {
                    break;
                }
                let c = cost(k);
                for (idx, rest) in per_start[i + k as usize].iter().enumerate() {
                    let res = rest.res + c;
                    if res > room {
                        break; // the frontier is sorted by res
                    }
                    let (sigma, max) = (t + rest.sigma, t.max(rest.max));
                    if drop(i, sigma, res) {
                        continue;
                    }
                    cand.push(Label { sigma, max, res, count: rest.count + 1, piece: k, next: idx as u32, aux: 0 });
                }
            }
            per_start[i] = pareto(std::mem::take(&mut cand));
        }
        Frontier { per_start }
    }

    fn roots(&self) -> &[Label] {
        &self.per_start[0]
    }

    fn path(&self, root: usize) -> Path {
        let mut l = self.per_start[0][root];
        let (sigma, max) = (l.sigma, l.max);
        let (mut i, mut lens) = (0usize, Vec::new());
        while l.count > 0 {
            lens.push(l.piece);
            i += l.piece as usize;
            l = self.per_start[i][l.next as usize];
        }
        Path { sigma, max, lens }
    }
}

/// The memory constraint as the DP sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Constraint {
    /// None.
    Free,
    /// `Σ over the resident micro-batches of b·Σ k²` (grid units²) at most `budget`; the
    /// activation bytes are affine in it (module `memory`: `L²/2 + Σ l²/2`).
    Squares { budget: u64 },
}

/// The inner problem: tables per micro-batch size, the weight of the largest slice, the
/// constraint.
pub(crate) struct Problem {
    pub(crate) tables: Vec<Table>,
    /// The objective is `Σ t + lag · max t`: `K − 1`, or `(K − 1) / M` when `M` micro-batches
    /// share the one slicing solved for (their step is `M` times this objective).
    pub(crate) lag: f64,
    pub(crate) batch: usize,
    pub(crate) units: usize,
    pub(crate) constraint: Constraint,
    pub(crate) parallel: bool,
}

/// A whole plan: micro-batches (size, slice lengths in units) in canonical order, and its cost.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Outcome {
    pub(crate) step: f64,
    pub(crate) max: f64,
    pub(crate) count: usize,
    pub(crate) micro: Vec<(usize, Vec<u32>)>,
}

impl Outcome {
    /// The planner's total order: smaller objective, then smaller largest slice, then fewer
    /// slices, then micro-batches compared lexicographically (size, then slice lengths).
    pub(crate) fn cmp(&self, other: &Outcome) -> std::cmp::Ordering {
        self.step
            .total_cmp(&other.step)
            .then(self.max.total_cmp(&other.max))
            .then(self.count.cmp(&other.count))
            .then_with(|| self.micro.cmp(&other.micro))
    }
}

/// What one cap gives: the least summed time (`∞` when nothing fits), which bounds every larger
/// slicing from below, and the best plan found. `overflow`: the solve gave up at its work limit;
/// `min_sigma` is then only the Lagrangian lower bound, and no plan under the cap was searched.
#[derive(Clone, Debug)]
pub(crate) struct Eval {
    pub(crate) min_sigma: f64,
    pub(crate) best: Option<Outcome>,
    pub(crate) overflow: bool,
}

impl Eval {
    const NOTHING: Eval = Eval { min_sigma: f64::INFINITY, best: None, overflow: false };
}

impl Problem {
    fn outcome(&self, sigma: f64, parts: Vec<(usize, Path)>) -> Outcome {
        let max = parts.iter().map(|p| p.1.max).fold(0.0, f64::max);
        let count = parts.iter().map(|p| p.1.lens.len()).sum();
        let mut micro: Vec<(usize, Vec<u32>)> = parts.into_iter().map(|(b, p)| (b, p.lens)).collect();
        // Micro-batches are independent (no context crosses them), so their order is not part
        // of the plan: sort them for a canonical form.
        micro.sort();
        Outcome { step: sigma + self.lag * max, max, count, micro }
    }

    fn map<T: Send>(&self, n: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
        if self.parallel { (0..n).into_par_iter().map(f).collect() } else { (0..n).map(f).collect() }
    }

    /// Solves the inner problem for slices of at most `cap` seconds. `bound` is the best
    /// objective so far: partial plans that cannot reach it are dropped from the constrained
    /// DPs. That never loses a plan that could match it, so `min_sigma` is still a lower bound
    /// on the summed time of every such plan under `cap` (what the search prunes with).
    ///
    /// `floor` is a slice time every plan that matters here has (the lowest cap of the range
    /// being searched: plans with smaller slices are another range's business). Pruning uses it,
    /// never a partial plan's own largest slice, because the Pareto filter ignores that (see
    /// [`Frontier::build`]); so `min_sigma` bounds every plan under `cap` with a slice of at
    /// least `floor` that could match `bound`.
    pub(crate) fn evaluate(&self, cap: f64, bound: f64, floor: f64) -> Eval {
        self.solve(cap, bound, floor, false)
    }

    /// The uncapped solve, which the search needs for a lower bound on the summed time (and
    /// takes a plan from if there is one). Exact, except under a GPipe limit that the plain
    /// optimum breaks: there the Lagrangian bound stands in, with no plan, because without a
    /// cap the frontiers are at their widest, and the capped solves that follow find the plans.
    pub(crate) fn evaluate_uncapped(&self, bound: f64) -> Eval {
        self.solve(f64::INFINITY, bound, 0.0, true)
    }

    fn solve(&self, cap: f64, bound: f64, floor: f64, bound_only: bool) -> Eval {
        let per_size: Vec<Option<Path>> = self.map(self.tables.len(), |bi| {
            let table = &self.tables[bi];
            if table.bottleneck > cap { None } else { min_sum(table, cap) }
        });
        // Least summed time of `r` sequences' micro-batches, memory ignored: a lower bound.
        let (least, sizes) = split_batch(self.batch, &per_size);
        let Some(sizes) = sizes else {
            return Eval::NOTHING;
        };
        let sigma = least[self.batch];
        let parts: Vec<(usize, Path)> =
            sizes.into_iter().filter_map(|b| per_size[b - 1].clone().map(|p| (b, p))).collect();
        if let Constraint::Squares { budget } = self.constraint {
            let used: u64 = parts.iter().map(|(b, p)| *b as u64 * squares(p)).sum();
            if used > budget {
                if bound_only {
                    let Some(dual) = self.dual(cap, budget) else {
                        return Eval::NOTHING;
                    };
                    return Eval { min_sigma: dual.value(self.batch, budget), best: None, overflow: false };
                }
                return self.evaluate_squares(cap, budget, bound, floor, &least);
            }
        }
        Eval { min_sigma: sigma, best: Some(self.outcome(sigma, parts)), overflow: false }
    }

    /// GPipe under a memory limit the unconstrained optimum breaks: Pareto frontiers (time vs.
    /// `Σ k²`) per micro-batch size, pruned with the Lagrangian bound, combined over batch
    /// splits; of the plans that fit, the least summed time is the bound and the best objective
    /// the plan.
    fn evaluate_squares(&self, cap: f64, budget: u64, bound: f64, floor: f64, least: &[f64]) -> Eval {
        let (n, batch, lag) = (self.units as u64, self.batch, self.lag);
        let Some(dual) = self.dual(cap, budget) else {
            return Eval::NOTHING;
        };
        // Whether no plan containing a part (summed time `sigma`, resource `res`) can match the
        // bound, when the rest of such a plan sums to at least `rest0` (memory ignored) and to
        // at least `rest_priced − λ·(budget − res)` (Lagrangian: memory priced at λ), and
        // `lagged` is (K − 1) × a slice time every such plan has.
        let hopeless = |sigma: f64, lagged: f64, res: u64, rest0: f64, rest_priced: f64| {
            let l = dual.lambda;
            let room = l * (budget as f64 - res as f64);
            let priced = sigma + (rest_priced - room) + lagged;
            // The priced bound subtracts large terms: keep a margin for their rounding.
            let margin = 1e-10 * (rest_priced.abs() + room.abs());
            beyond(sigma + rest0 + lagged, bound) || priced > bound * (1.0 + 1e-12) + margin
        };
        let lagged_all = lag * self.tables.iter().map(|t| t.bottleneck).fold(f64::INFINITY, f64::min).max(floor);
        let fronts: Vec<Option<Frontier>> = self.map(self.tables.len(), |bi| {
            let table = &self.tables[bi];
            let b = table.batch as u64;
            // The other micro-batches need at least N each (Σ k² ≥ Σ k).
            let own = budget.checked_sub((batch as u64 - b) * n)? / b;
            if table.bottleneck > cap || own < n {
                return None;
            }
            let prefix = prefix_priced(table, cap, 0.0);
            let priced = prefix_priced(table, cap, dual.lambda * b as f64);
            let (rest0, rest_priced) = (least[batch - table.batch], dual.least[batch - table.batch]);
            let lagged = lag * table.bottleneck.max(floor);
            let drop = |i: usize, sigma: f64, res: u64| {
                hopeless(sigma, lagged, b * res, prefix[i] + rest0, priced[i] + rest_priced)
            };
            Some(Frontier::build(table, cap, |k| (k as u64) * (k as u64), own, |i| i as u64, drop))
        });
        // g[r] for r < batch: Pareto labels (time, Σ b·Q) over splits of r sequences: piece =
        // the last micro-batch's size, next = the rest's index in g[r − piece], aux = the root
        // index of that micro-batch's slicing in its frontier. These are Minkowski sums,
        // |g[r − b]| × |f_b| pairs each: the one part whose cost is not polynomial in practice,
        // hence the work limit.
        let mut g: Vec<Vec<Label>> = vec![vec![Label::EMPTY]];
        let mut pairs = 0usize;
        for r in 1..batch {
            let mut cand = Vec::new();
            for b in 1..=r {
                let Some(f) = &fronts[b - 1] else { continue };
                pairs += g[r - b].len() * f.roots().len();
                if pairs > PAIR_LIMIT {
                    return Eval { min_sigma: dual.value(batch, budget), best: None, overflow: true };
                }
                for (pi, p) in g[r - b].iter().enumerate() {
                    for (fi, fl) in f.roots().iter().enumerate() {
                        let res = p.res + b as u64 * fl.res;
                        let (sigma, max) = (fl.sigma + p.sigma, fl.max.max(p.max));
                        if res + (batch - r) as u64 * n > budget
                            || hopeless(sigma, lagged_all, res, least[batch - r], dual.least[batch - r])
                        {
                            continue;
                        }
                        cand.push(Label {
                            sigma,
                            max,
                            res,
                            count: p.count + fl.count,
                            piece: b as u32,
                            next: pi as u32,
                            aux: fi as u32,
                        });
                    }
                }
            }
            g.push(pareto(cand));
        }
        // The last micro-batch, of each size b and each slicing in its frontier, with the
        // cheapest rest that fits beside it: a two-pointer walk, both lists being sorted by
        // resource with time falling. Linear, where a last Minkowski sum would be quadratic.
        let mut min_sigma = f64::INFINITY;
        struct Pick {
            key: (f64, f64, u32), // objective, largest slice, slices
            sigma: f64,
            size: usize,
            root: usize,
            rest: usize,
        }
        let mut pick: Option<Pick> = None;
        for b in 1..=batch {
            let (Some(f), rest) = (&fronts[b - 1], &g[batch - b]) else { continue };
            let mut fit = 0; // rest labels with resource within the room left
            for (fi, fl) in f.roots().iter().enumerate().rev() {
                let Some(room) = budget.checked_sub(b as u64 * fl.res) else { continue };
                while fit < rest.len() && rest[fit].res <= room {
                    fit += 1;
                }
                let Some(p) = fit.checked_sub(1).map(|i| (i, rest[i])) else { continue };
                let (sigma, max) = (fl.sigma + p.1.sigma, fl.max.max(p.1.max));
                min_sigma = min_sigma.min(sigma);
                let key = (sigma + lag * max, max, fl.count + p.1.count);
                let better = pick.as_ref().is_none_or(|c| {
                    key.0.total_cmp(&c.key.0).then(key.1.total_cmp(&c.key.1)).then(key.2.cmp(&c.key.2)).is_lt()
                });
                if better {
                    pick = Some(Pick { key, sigma, size: b, root: fi, rest: p.0 });
                }
            }
        }
        let best = pick.and_then(|c| {
            let mut parts = vec![(c.size, fronts[c.size - 1].as_ref()?.path(c.root))];
            let (mut r, mut idx) = (batch - c.size, c.rest);
            while r > 0 {
                let l = g[r][idx];
                let b = l.piece as usize;
                parts.push((b, fronts[b - 1].as_ref()?.path(l.aux as usize)));
                (r, idx) = (r - b, l.next as usize);
            }
            Some(self.outcome(c.sigma, parts))
        });
        Eval { min_sigma, best, overflow: false }
    }
}

/// Label pairs one solve may combine across micro-batches under a GPipe limit (about half a
/// GB of labels at worst). Past it the solve gives up: the search retries the candidate in a
/// narrower range (tighter pruning) and reports an error if a single candidate still needs more,
/// rather than run for many minutes or exhaust memory.
const PAIR_LIMIT: usize = 10_000_000;

impl Problem {
    /// A plan without search, to prune with from the start: the best of the plans that cut every
    /// sequence into equal slices of `k` units (the last one shorter), with micro-batches of
    /// one sequence or of the whole batch, over every `k`, that meet the memory rule.
    pub(crate) fn seed(&self) -> Option<Outcome> {
        let n = self.units;
        let mut best: Option<Outcome> = None;
        for b in [1, self.batch] {
            let table = &self.tables[b - 1];
            let copies = self.batch / b;
            for k in 1..=n {
                let lens: Vec<u32> = (0..n).step_by(k).map(|i| k.min(n - i) as u32).collect();
                let (mut start, mut sigma, mut max) = (0, 0.0, 0.0f64);
                for &l in &lens {
                    let t = slice_time(table, start, l);
                    sigma += t;
                    max = max.max(t);
                    start += l as usize;
                }
                let path = Path { sigma, max, lens };
                let fits = match self.constraint {
                    Constraint::Free => true,
                    Constraint::Squares { budget } => self.batch as u64 * squares(&path) <= budget,
                };
                if !fits || !sigma.is_finite() {
                    continue;
                }
                let total = (0..copies).fold(0.0, |acc, _| acc + sigma);
                let o = self.outcome(total, vec![(b, path); copies]);
                if best.as_ref().is_none_or(|cur| o.cmp(cur).is_lt()) {
                    best = Some(o);
                }
            }
        }
        best
    }
}

/// `Σ k²` of a slicing (grid units²).
pub(crate) fn squares(p: &Path) -> u64 {
    p.lens.iter().map(|&k| (k as u64) * (k as u64)).sum()
}

/// The cheapest split of `batch` sequences into micro-batch sizes, each costing its
/// `per_size` slicing: `G(r) = min_b f[b] + G(r − b)`, ties by fewer slices, then the smaller
/// first size. Returns `G(r)` for every `r` (`∞` where no split exists) and the sizes of the
/// best split of all `batch`.
fn split_batch(batch: usize, per_size: &[Option<Path>]) -> (Vec<f64>, Option<Vec<usize>>) {
    let mut g = vec![(f64::INFINITY, usize::MAX, 0usize); batch + 1];
    g[0] = (0.0, 0, 0);
    for r in 1..=batch {
        for b in 1..=r {
            let (Some(p), (gs, gc, _)) = (&per_size[b - 1], g[r - b]) else { continue };
            if gc == usize::MAX {
                continue;
            }
            let cand = (p.sigma + gs, p.lens.len() + gc, b);
            let cur = g[r];
            if cand.0 < cur.0 || (cand.0 == cur.0 && (cand.1, cand.2) < (cur.1, cur.2)) {
                g[r] = cand;
            }
        }
    }
    let least = g.iter().map(|e| e.0).collect();
    if g[batch].1 == usize::MAX {
        return (least, None);
    }
    let (mut r, mut sizes) = (batch, Vec::new());
    while r > 0 {
        sizes.push(g[r].2);
        r -= g[r].2;
    }
    (least, Some(sizes))
}

/// `P(i)`: the least `Σ (t + price·k²)` of a cover of units `0..i` under `cap` (no memory
/// rule): what any plan spends before a suffix starting at `i`, with its `Σ k²` priced.
fn prefix_priced(table: &Table, cap: f64, price: f64) -> Vec<f64> {
    let n = table.units;
    let mut p = vec![f64::INFINITY; n + 1];
    p[0] = 0.0;
    for j in 0..n {
        if !p[j].is_finite() {
            continue;
        }
        let (times, lens) = table.slices(j);
        for (&t, &k) in times.iter().zip(lens) {
            if t > cap {
                break;
            }
            let via = p[j] + (t + price * (k as f64) * (k as f64));
            let e = &mut p[j + k as usize];
            *e = e.min(via);
        }
    }
    p
}

/// The least `Σ (t + price·k²)` of a whole cover under `cap`, and the `Σ k²` of the cover that
/// reaches it (the smallest among equals); `None` when nothing fits under the cap.
fn priced_cover(table: &Table, cap: f64, price: f64) -> Option<(f64, u64)> {
    let n = table.units;
    let mut best = vec![(f64::INFINITY, u64::MAX); n + 1];
    best[n] = (0.0, 0);
    for i in (0..n).rev() {
        let (times, lens) = table.slices(i);
        for (&t, &k) in times.iter().zip(lens) {
            if t > cap {
                break;
            }
            let (rv, rq) = best[i + k as usize];
            if rq == u64::MAX {
                continue;
            }
            let q = (k as u64) * (k as u64);
            let cand = ((t + price * q as f64) + rv, q + rq);
            if cand.0 < best[i].0 || (cand.0 == best[i].0 && cand.1 < best[i].1) {
                best[i] = cand;
            }
        }
    }
    (best[0].1 != u64::MAX).then_some(best[0])
}

/// A Lagrange multiplier for the GPipe memory budget and what it gives: `least[r]` is the
/// least `Σ t + λ·Σ b·Σ k²` over plans of `r` sequences, so `least[r] − λ·(budget − used)`
/// bounds the summed time of any `r` sequences that must fit in what `used` leaves.
struct Dual {
    lambda: f64,
    least: Vec<f64>,
}

impl Dual {
    /// `least[batch] − λ·budget`: a lower bound on the summed time of every plan that fits.
    fn value(&self, batch: usize, budget: u64) -> f64 {
        self.least[batch] - self.lambda * budget as f64
    }
}

impl Problem {
    /// `least[r]` at price λ, and the resource `Σ b·Σ k²` of the plan reaching `least[batch]`
    /// (`u64::MAX` when no plan fits under `cap`).
    fn priced_split(&self, cap: f64, lambda: f64) -> (Vec<f64>, u64) {
        let covers: Vec<Option<(f64, u64)>> = self.map(self.tables.len(), |bi| {
            let t = &self.tables[bi];
            if t.bottleneck > cap { None } else { priced_cover(t, cap, lambda * t.batch as f64) }
        });
        let mut g = vec![(f64::INFINITY, u64::MAX); self.batch + 1];
        g[0] = (0.0, 0);
        for r in 1..=self.batch {
            for b in 1..=r {
                let (Some((v, q)), (gv, gq)) = (covers[b - 1], g[r - b]) else { continue };
                if gq == u64::MAX {
                    continue;
                }
                let cand = (v + gv, b as u64 * q + gq);
                if cand.0 < g[r].0 || (cand.0 == g[r].0 && cand.1 < g[r].1) {
                    g[r] = cand;
                }
            }
        }
        (g.iter().map(|e| e.0).collect(), g[self.batch].1)
    }

    /// A multiplier that (nearly) maximises the dual `least_λ[batch] − λ·budget`: geometric
    /// bisection for the price at which the priced optimum's resource crosses the budget. Any
    /// λ ≥ 0 gives valid bounds; a good one gives tight ones. `None` when even the plan with
    /// the least resource under `cap` exceeds the budget (no plan fits).
    fn dual(&self, cap: f64, budget: u64) -> Option<Dual> {
        let (least0, used0) = self.priced_split(cap, 0.0);
        if used0 == u64::MAX {
            return None;
        }
        if used0 <= budget {
            return Some(Dual { lambda: 0.0, least: least0 });
        }
        let dual_value = |least: &[f64], lambda: f64| Dual { lambda, least: least.to_vec() }.value(self.batch, budget);
        // A price above any difference in summed time per unit of resource: the priced optimum
        // then has the least resource there is.
        let most = self.tables.iter().flat_map(|t| t.times().iter().copied().filter(|&x| x <= cap)).fold(0.0, f64::max);
        let top = 2.0 * (self.batch * self.units) as f64 * most + 1.0;
        let (least_top, used_top) = self.priced_split(cap, top);
        if used_top > budget {
            return None;
        }
        let (mut lo, mut hi) = (top * 1e-15, top);
        let (mut best_lambda, mut best) = (top, least_top);
        for _ in 0..24 {
            let mid = (lo * hi).sqrt();
            let (least, used) = self.priced_split(cap, mid);
            if dual_value(&least, mid) > dual_value(&best, best_lambda) {
                (best_lambda, best) = (mid, least);
            }
            if used > budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(Dual { lambda: best_lambda, least: best })
    }
}

/// Whether a partial plan whose completions cost at least `at_least` can be dropped against
/// the best plan so far. The slack keeps plans that tie with `bound` up to rounding (the sum in
/// `at_least` is associated differently from a whole plan's), so ties are still decided by the
/// total order.
fn beyond(at_least: f64, bound: f64) -> bool {
    at_least > bound * (1.0 + 1e-12)
}
