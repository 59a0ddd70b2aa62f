//! Deep gradient compression's pass over a weight on the CPU: the gradient joins
//! the rank's momentum and velocity, and the entries of the velocity at or above a
//! threshold in magnitude are found, in one pass over the three arrays (torch's
//! operations take five). The front-end (`perseus.torch.dgc`) estimates the
//! threshold from a sample beforehand and adapts it when too many or too few pass.

/// How a gradient joins the momentum `u` and the velocity `v` (SGD's settings).
#[derive(Debug, Clone, Copy)]
pub struct Fold {
    /// SGD's momentum; 0: the gradient goes straight into `v` and `u` is untouched.
    pub momentum: f32,
    /// SGD's dampening: `u = momentum * u + (1 - dampening) * g`.
    pub dampening: f32,
    /// Nesterov: `v += g + momentum * u` (else `v += u`).
    pub nesterov: bool,
}

impl Fold {
    /// One element: updates `u` and `v` and returns the new `v`.
    #[inline(always)]
    fn apply(&self, g: f32, u: &mut f32, v: &mut f32) -> f32 {
        if self.momentum == 0.0 {
            *v += g;
        } else {
            *u = self.momentum * *u + (1.0 - self.dampening) * g;
            *v += if self.nesterov {
                g + self.momentum * *u
            } else {
                *u
            };
        }
        *v
    }
}

/// Elements a thread takes on at least: below this a second thread costs more than
/// it saves.
const PIECE: usize = 1 << 18;

/// Folds and tests one piece; `base` is the index of its first element.
fn piece(g: &[f32], u: &mut [f32], v: &mut [f32], fold: Fold, t: f32, base: usize) -> Vec<i64> {
    let mut passed = Vec::new();
    for (j, ((g, u), v)) in g.iter().zip(u.iter_mut()).zip(v.iter_mut()).enumerate() {
        if fold.apply(*g, u, v).abs() >= t {
            passed.push((base + j) as i64);
        }
    }
    passed
}

/// Folds `g` into `u` and `v` (all of one length) and writes, in increasing order,
/// the indices of the entries with `|v| >= threshold` into `out`, as many as fit.
/// Returns how many passed in all (more than `out.len()` when it overflowed). A NaN
/// never passes; `threshold = inf` only folds. Large arrays are split across the
/// machine's cores.
pub fn fold_select(
    g: &[f32],
    u: &mut [f32],
    v: &mut [f32],
    fold: Fold,
    threshold: f32,
    out: &mut [i64],
) -> usize {
    assert!(
        g.len() == u.len() && g.len() == v.len(),
        "g, u and v differ in length"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (g.len() / PIECE).clamp(1, cores);
    let size = g.len().div_ceil(threads).max(1);
    let pieces: Vec<Vec<i64>> = if threads == 1 {
        vec![piece(g, u, v, fold, threshold, 0)]
    } else {
        std::thread::scope(|scope| {
            let running: Vec<_> = g
                .chunks(size)
                .zip(u.chunks_mut(size))
                .zip(v.chunks_mut(size))
                .enumerate()
                .map(|(i, ((g, u), v))| {
                    scope.spawn(move || piece(g, u, v, fold, threshold, i * size))
                })
                .collect();
            running
                .into_iter()
                .map(|t| t.join().expect("a DGC thread panicked"))
                .collect()
        })
    };
    let mut at = 0;
    for passed in &pieces {
        let room = out.len().saturating_sub(at).min(passed.len());
        if room > 0 {
            out[at..at + room].copy_from_slice(&passed[..room]);
        }
        at += passed.len();
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(g: &[f32], u: &mut [f32], v: &mut [f32], f: Fold, t: f32) -> Vec<i64> {
        let mut passed = Vec::new();
        for i in 0..g.len() {
            if f.momentum == 0.0 {
                v[i] += g[i];
            } else {
                u[i] = f.momentum * u[i] + (1.0 - f.dampening) * g[i];
                v[i] += if f.nesterov {
                    g[i] + f.momentum * u[i]
                } else {
                    u[i]
                };
            }
            if v[i].abs() >= t {
                passed.push(i as i64);
            }
        }
        passed
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_the_element_loop_in_every_variant_and_across_pieces() {
        let n = 3 * PIECE + 123;
        for (momentum, dampening, nesterov) in
            [(0.0, 0.0, false), (0.9, 0.0, false), (0.9, 0.1, true)]
        {
            let f = Fold {
                momentum,
                dampening,
                nesterov,
            };
            let g = data(n, 1);
            let (mut u, mut v) = (data(n, 2), data(n, 3));
            let (mut ru, mut rv) = (u.clone(), v.clone());
            let want = reference(&g, &mut ru, &mut rv, f, 1.2);
            let mut out = vec![-1i64; want.len() + 5];
            let got = fold_select(&g, &mut u, &mut v, f, 1.2, &mut out);
            assert_eq!(got, want.len());
            assert_eq!(&out[..got], &want[..]);
            assert_eq!(u, ru);
            assert_eq!(v, rv);
        }
    }

    #[test]
    fn overflow_counts_all_and_keeps_the_first() {
        let n = 2 * PIECE;
        let g = vec![1.0f32; n];
        let (mut u, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut out = vec![0i64; 10];
        let f = Fold {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
        };
        assert_eq!(fold_select(&g, &mut u, &mut v, f, 0.5, &mut out), n);
        assert_eq!(out, (0..10).collect::<Vec<i64>>());
        assert_eq!(
            fold_select(&g, &mut u, &mut v, f, f32::INFINITY, &mut out),
            0
        );
        assert!(v.iter().all(|&x| x == 2.0), "folded twice");
        v[7] = f32::NAN;
        assert_eq!(fold_select(&g, &mut u, &mut v, f, 0.0, &mut []), n - 1);
    }
}
