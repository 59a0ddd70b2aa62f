//! The Bayesian optimisation behind autotuning: a Gaussian process over
//! points of the unit cube (each knob scaled to [0, 1]) with a
//! squared-exponential kernel, fitted to scores scaled to zero mean and unit
//! variance, and the expected improvement of a candidate over the best score.

/// A point: each coordinate one knob, scaled to [0, 1].
pub type Point = [f64; 3];

/// Distance over which two settings' scores are still alike.
const LENGTH_SCALE: f64 = 0.3;
/// How much better than the best a candidate must promise to be worth trying.
const EXPLORATION: f64 = 0.01;

fn kernel(a: &Point, b: &Point) -> f64 {
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    (-d2 / (2.0 * LENGTH_SCALE * LENGTH_SCALE)).exp()
}

/// A Gaussian process fitted to observed scores.
pub struct Gp {
    xs: Vec<Point>,
    /// Lower Cholesky factor of the kernel matrix plus noise, row-major.
    chol: Vec<Vec<f64>>,
    /// (K + noise I)^-1 y, y scaled.
    alpha: Vec<f64>,
    mean: f64,
    scale: f64,
}

impl Gp {
    /// Fits the process to scores `ys` observed at `xs` (at least one);
    /// `noise` is added to the kernel's diagonal.
    pub fn fit(xs: &[Point], ys: &[f64], noise: f64) -> Gp {
        let n = xs.len();
        let mean = ys.iter().sum::<f64>() / n as f64;
        let var = ys.iter().map(|y| (y - mean) * (y - mean)).sum::<f64>() / n as f64;
        let scale = if var > 0.0 { var.sqrt() } else { 1.0 };
        let y: Vec<f64> = ys.iter().map(|v| (v - mean) / scale).collect();
        let mut k = vec![vec![0.0; n]; n];
        for i in 0..n {
            for j in 0..n {
                k[i][j] = kernel(&xs[i], &xs[j]) + if i == j { noise } else { 0.0 };
            }
        }
        let chol = cholesky(&k);
        let alpha = solve_upper(&chol, &solve_lower(&chol, &y));
        Gp {
            xs: xs.to_vec(),
            chol,
            alpha,
            mean,
            scale,
        }
    }

    /// Posterior mean and standard deviation at `x`, in the scores' units.
    pub fn predict(&self, x: &Point) -> (f64, f64) {
        let ks: Vec<f64> = self.xs.iter().map(|xi| kernel(x, xi)).collect();
        let mu: f64 = ks.iter().zip(&self.alpha).map(|(a, b)| a * b).sum();
        let v = solve_lower(&self.chol, &ks);
        let var = (1.0 - v.iter().map(|x| x * x).sum::<f64>()).max(1e-12);
        (self.mean + mu * self.scale, var.sqrt() * self.scale)
    }

    /// The expected amount by which a score at `x` beats `best`.
    pub fn expected_improvement(&self, x: &Point, best: f64) -> f64 {
        let (mu, sigma) = self.predict(x);
        let gain = mu - best - EXPLORATION * self.scale;
        let z = gain / sigma;
        gain * normal_cdf(z) + sigma * normal_pdf(z)
    }
}

/// Lower-triangular `l` with `l lᵀ = a` (`a` symmetric positive definite).
fn cholesky(a: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = a.len();
    let mut l = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i][k] * l[j][k]).sum();
            if i == j {
                l[i][j] = (a[i][i] - s).max(1e-12).sqrt();
            } else {
                l[i][j] = (a[i][j] - s) / l[j][j];
            }
        }
    }
    l
}

/// Solves `l x = b` for lower-triangular `l`.
fn solve_lower(l: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let mut x = vec![0.0; b.len()];
    for i in 0..b.len() {
        let s: f64 = (0..i).map(|k| l[i][k] * x[k]).sum();
        x[i] = (b[i] - s) / l[i][i];
    }
    x
}

/// Solves `lᵀ x = b` for lower-triangular `l`.
fn solve_upper(l: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let n = b.len();
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| l[k][i] * x[k]).sum();
        x[i] = (b[i] - s) / l[i][i];
    }
    x
}

fn normal_pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Φ(z), through erf's rational approximation (Abramowitz and Stegun 7.1.26,
/// absolute error below 1.5e-7).
fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_normal_cdf_matches_known_values() {
        for (z, p) in [
            (0.0, 0.5),
            (1.0, 0.841_344_7),
            (-1.96, 0.024_997_9),
            (3.0, 0.998_650_1),
        ] {
            assert!((normal_cdf(z) - p).abs() < 1e-6, "{z}: {}", normal_cdf(z));
        }
    }

    #[test]
    fn with_little_noise_the_process_passes_through_its_points() {
        let xs = [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 1.0, 1.0]];
        let ys = [3.0, 7.0, 5.0];
        let gp = Gp::fit(&xs, &ys, 1e-6);
        for (x, y) in xs.iter().zip(ys) {
            let (mu, sigma) = gp.predict(x);
            assert!((mu - y).abs() < 1e-3, "{mu} != {y}");
            assert!(sigma < 1e-2, "{sigma}");
        }
        // Far from every point: the prior (the scores' mean, their spread).
        let (mu, sigma) = gp.predict(&[10.0, 10.0, 10.0]);
        assert!((mu - 5.0).abs() < 1e-6 && (sigma - 1.632_993).abs() < 1e-3);
    }

    #[test]
    fn improvement_is_expected_where_scores_rise_and_where_nothing_is_known() {
        let xs = [[0.0, 0.0, 0.0], [0.2, 0.0, 0.0], [0.4, 0.0, 0.0]];
        let gp = Gp::fit(&xs, &[1.0, 2.0, 3.0], 0.01);
        let best = 3.0;
        let uphill = gp.expected_improvement(&[0.55, 0.0, 0.0], best);
        let downhill = gp.expected_improvement(&[0.0, 0.0, 0.0], best);
        assert!(uphill > downhill * 100.0, "{uphill} {downhill}");
        assert!(gp.expected_improvement(&[0.2, 1.0, 0.0], best) > downhill);
    }
}
