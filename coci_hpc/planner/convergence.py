"""Convergence model: fit loss(t) to observed (training time, loss) pairs.

Two shapes, fitted by nonlinear least squares on the loss itself (as the COCI paper does):

* ``exp``:        loss(t) = exp(theta1 * t + theta2)
* ``exp_floor``:  loss(t) = exp(theta1 * t + theta2) + c     (i.e. a*exp(theta1*t) + c, a = e^theta2)

The better one is picked by residual, penalised for the floor's extra parameter (AICc), so a
floor is only taken when the data ask for it. Bad input never raises: :func:`fit_curve` returns a
:class:`FitOutcome` whose ``reason`` says why no usable fit exists, and callers fall back.
``t`` is training time in seconds (checkpoint stalls excluded); ``theta1`` is per second.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_POINTS = 6
MIN_R2 = 0.3          # below this the curve explains too little of the loss variation to plan on
DRIFT_TOL = 0.05      # max |log-loss| difference over the look-ahead that triggers a re-plan


@dataclass(frozen=True)
class CurveFit:
    """A fitted convergence curve. ``floor`` is 0 for the pure exponential."""

    kind: str
    theta1: float
    theta2: float
    floor: float
    rss: float
    r2: float
    n: int

    def loss(self, t: float | np.ndarray) -> float | np.ndarray:
        return np.exp(self.theta1 * np.asarray(t, dtype=float) + self.theta2) + self.floor

    def rate(self, t: float | np.ndarray) -> float | np.ndarray:
        """|dloss/dt| at t (loss units per second)."""
        return np.abs(self.theta1) * np.exp(self.theta1 * np.asarray(t, dtype=float) + self.theta2)

    def time_at_loss(self, target: float) -> float:
        """Training time when the fitted curve reaches ``target``; inf if it never does."""
        excess = target - self.floor
        if excess <= 0:
            return math.inf
        return (math.log(excess) - self.theta2) / self.theta1

    def describe(self) -> str:
        a = math.exp(self.theta2)
        if self.kind == "exp":
            return (f"loss(t) = exp({self.theta1:.4g}*t + {self.theta2:.4g})  "
                    f"[t in s, R^2={self.r2:.3f}, n={self.n}]")
        return (f"loss(t) = {a:.4g}*exp({self.theta1:.4g}*t) + {self.floor:.4g}  "
                f"[t in s, R^2={self.r2:.3f}, n={self.n}]")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "theta1": self.theta1, "theta2": self.theta2,
                "floor": self.floor, "rss": self.rss, "r2": self.r2, "n": self.n}

    @classmethod
    def from_dict(cls, d: dict) -> CurveFit:
        return cls(kind=str(d["kind"]), theta1=float(d["theta1"]), theta2=float(d["theta2"]),
                   floor=float(d["floor"]), rss=float(d["rss"]), r2=float(d["r2"]), n=int(d["n"]))


@dataclass(frozen=True)
class FitOutcome:
    """Either a usable ``fit`` or ``fit is None`` with a ``reason`` (callers fall back)."""

    fit: CurveFit | None
    reason: str | None = None
    candidates: dict = field(default_factory=dict)   # kind -> {"rss", "aicc"}
    n_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.fit is not None

    def to_dict(self) -> dict:
        return {"fit": None if self.fit is None else self.fit.to_dict(), "reason": self.reason,
                "candidates": self.candidates, "n_dropped": self.n_dropped}

    @classmethod
    def from_dict(cls, d: dict) -> FitOutcome:
        return cls(fit=None if d.get("fit") is None else CurveFit.from_dict(d["fit"]),
                   reason=d.get("reason"), candidates=dict(d.get("candidates") or {}),
                   n_dropped=int(d.get("n_dropped", 0)))


def _aicc(rss: float, n: int, k: int) -> float:
    rss = max(rss, 1e-300)
    penalty = 2 * k + (2 * k * (k + 1)) / (n - k - 1) if n - k - 1 > 0 else math.inf
    return n * math.log(rss / n) + penalty


def fit_curve(times: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray, *, min_points: int = MIN_POINTS,
              min_r2: float = MIN_R2) -> FitOutcome:
    """Fit both shapes and return the better one, or a fallback outcome with a reason."""
    t = np.asarray(times, dtype=float).ravel()
    y = np.asarray(losses, dtype=float).ravel()
    if t.shape != y.shape:
        return FitOutcome(None, f"times and losses differ in length ({t.size} vs {y.size})")
    good = np.isfinite(t) & np.isfinite(y) & (y > 0)
    dropped = int(t.size - good.sum())
    if t.size and dropped > t.size / 2:
        return FitOutcome(None, f"{dropped} of {t.size} samples are NaN/inf/non-positive",
                          n_dropped=dropped)
    t, y = t[good], y[good]
    if np.unique(t).size < min_points:
        return FitOutcome(None, f"too few samples to fit: {np.unique(t).size} distinct times, "
                          f"need {min_points}", n_dropped=dropped)
    order = np.argsort(t, kind="stable")
    t, y = t[order], y[order]
    t0, span = float(t[0]), float(t[-1] - t[0])
    # Work on a normalised time axis for conditioning; parameters are converted back below.
    tau = (t - t0) / span
    n = t.size

    logy = np.log(y)
    A = np.vstack([tau, np.ones_like(tau)]).T
    (b1, b0), res, *_ = np.linalg.lstsq(A, logy, rcond=None)
    resid = logy - (b1 * tau + b0)
    se_b1 = math.sqrt(float(resid @ resid) / max(n - 2, 1) / float(((tau - tau.mean()) ** 2).sum()))
    if not b1 + 2 * se_b1 < 0:
        return FitOutcome(None, "loss is not decreasing over the samples (log-loss slope "
                          f"{b1 / span:.3g}/s, +2se not below 0): non-monotone or flat",
                          n_dropped=dropped)

    # Here, not at import: scipy.optimize costs every training rank ~1 s at each (re)start.
    from scipy.optimize import OptimizeWarning, curve_fit

    tss = float(((y - y.mean()) ** 2).sum())
    cands: dict[str, tuple[float, float, float, float]] = {}   # kind -> (k, logamp, floor, rss)

    def f_exp(x, k, c0):
        return np.exp(k * x + c0)

    try:
        with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            (k, c0), _ = curve_fit(f_exp, tau, y, p0=(b1, b0), maxfev=5000)
        rss = float(((f_exp(tau, k, c0) - y) ** 2).sum())
        if math.isfinite(rss) and k < 0:
            cands["exp"] = (k, c0, 0.0, rss)
    except (RuntimeError, ValueError, FloatingPointError):
        pass

    def f_floor(x, k, c0, c):
        return np.exp(k * x + c0) + c

    ymin = float(y.min())
    best = None
    for frac in (0.0, 0.5, 0.9):
        c_init = frac * ymin
        z = np.log(np.maximum(y - c_init, 1e-12 * ymin))
        (k_i, c0_i), *_ = np.linalg.lstsq(A, z, rcond=None)
        k_i = min(k_i, -1e-6)
        try:
            with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", OptimizeWarning)
                p, _ = curve_fit(f_floor, tau, y, p0=(k_i, c0_i, c_init),
                                 bounds=([-1e4, -50.0, 0.0], [-1e-9, 50.0, ymin]), maxfev=5000)
        except (RuntimeError, ValueError, FloatingPointError):
            continue
        rss = float(((f_floor(tau, *p) - y) ** 2).sum())
        if math.isfinite(rss) and (best is None or rss < best[3]):
            best = (p[0], p[1], p[2], rss)
    if best is not None:
        cands["exp_floor"] = best

    if not cands:
        return FitOutcome(None, "nonlinear least squares did not converge for either shape",
                          n_dropped=dropped)
    info = {kind: {"rss": v[3], "aicc": _aicc(v[3], n, 2 if kind == "exp" else 3)}
            for kind, v in cands.items()}
    kind = min(info, key=lambda kk: info[kk]["aicc"])
    k, c0, floor, rss = cands[kind]
    r2 = 1.0 - rss / tss if tss > 0 else 0.0
    if r2 < min_r2:
        return FitOutcome(None, f"too noisy: best fit ({kind}) explains R^2={r2:.2f} < {min_r2} "
                          "of the loss variation", candidates=info, n_dropped=dropped)
    theta1 = k / span
    theta2 = c0 - k * t0 / span            # shift back from tau to absolute t
    fit = CurveFit(kind=kind, theta1=float(theta1), theta2=float(theta2), floor=float(floor),
                   rss=rss, r2=float(r2), n=int(n))
    return FitOutcome(fit, None, candidates=info, n_dropped=dropped)


def drift(old: CurveFit | None, new: CurveFit | None, t_from: float, t_to: float) -> float:
    """Largest |log loss_new - log loss_old| over [t_from, t_to]; inf when one side is missing
    or the shape changed. Generalises the paper's |d theta1|, |d theta2| thresholds to both shapes."""
    if old is None or new is None:
        return 0.0 if old is new else math.inf
    if old.kind != new.kind:
        return math.inf
    grid = np.linspace(t_from, max(t_to, t_from), 64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        d = np.abs(np.log(new.loss(grid)) - np.log(old.loss(grid)))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else math.inf


# The online refit runs on the training thread: fitting at most this many points keeps each refit
# a few milliseconds however long the job has run (a fit over 3000 raw samples took ~115 ms).
FIT_POINTS = 256


def binned(times, losses, n: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``n`` points: consecutive samples averaged in equal-count bins (NaN losses skipped).

    When more than half the losses are NaN the raw samples are returned, so ``fit_curve`` still
    reports that as its fallback reason instead of fitting the few finite bins.
    """
    t = np.asarray(times, dtype=float)
    y = np.asarray(losses, dtype=float)
    finite = np.isfinite(y)
    if t.size <= n or finite.mean() < 0.5:
        return t, y
    starts = np.linspace(0, t.size, n + 1).astype(int)[:-1]
    counts = np.diff(np.append(starts, t.size))
    bt = np.add.reduceat(t, starts) / counts
    k = np.add.reduceat(finite.astype(float), starts)
    sums = np.add.reduceat(np.where(finite, y, 0.0), starts)
    by = np.full(starts.size, np.nan)
    np.divide(sums, k, out=by, where=k > 0)
    return bt, by


class ConvergenceTracker:
    """Online refit every ``refit_every`` samples; flags ``replan_needed`` when the curve drifts.

    The state is a JSON-able dict (:meth:`to_state` / :meth:`from_state`) so a checkpoint can carry it.
    """

    def __init__(self, *, refit_every: int = 50, drift_tol: float = DRIFT_TOL,
                 min_points: int = MIN_POINTS, max_samples: int = 4096) -> None:
        if refit_every < 1:
            raise ValueError("refit_every must be >= 1")
        self.refit_every = int(refit_every)
        self.drift_tol = float(drift_tol)
        self.min_points = int(min_points)
        self.max_samples = int(max_samples)
        self.samples: list[tuple[int, float, float]] = []
        self.outcome: FitOutcome = FitOutcome(None, "no samples yet")
        self.replan_needed = False
        self.last_drift = 0.0
        self._since_refit = 0

    @property
    def fit(self) -> CurveFit | None:
        return self.outcome.fit

    def add(self, step: int, time_s: float, loss: float) -> bool:
        """Record one sample; returns True when this call refitted the curve."""
        self.samples.append((int(step), float(time_s), float(loss)))
        if len(self.samples) > self.max_samples:
            # Thin the older half so memory stays bounded while the recent curve stays dense.
            half = len(self.samples) // 2
            self.samples = self.samples[:half:2] + self.samples[half:]
        self._since_refit += 1
        # Refit on schedule, plus once as soon as there are enough points for a first fit.
        due = (self._since_refit >= self.refit_every
               or (not self.outcome.ok and len(self.samples) == self.min_points))
        if not due:
            return False
        self.refit()
        return True

    def refit(self) -> FitOutcome:
        self._since_refit = 0
        _, ts, ls = zip(*self.samples) if self.samples else ((), (), ())
        new = fit_curve(*binned(ts, ls, FIT_POINTS), min_points=self.min_points)
        t_now = max(ts) if ts else 0.0
        span = t_now - (min(ts) if ts else 0.0)
        d = drift(self.outcome.fit, new.fit, t_now, t_now + max(span, 1.0))
        self.last_drift = d
        if d > self.drift_tol:
            self.replan_needed = True
        self.outcome = new
        return new

    def acknowledge(self) -> None:
        """The caller re-planned; clear the flag."""
        self.replan_needed = False

    def to_state(self) -> dict:
        return {"version": 1, "refit_every": self.refit_every, "drift_tol": self.drift_tol,
                "min_points": self.min_points, "max_samples": self.max_samples,
                "samples": [[s, t, (l if math.isfinite(l) else None)] for s, t, l in self.samples],
                "outcome": self.outcome.to_dict(), "replan_needed": self.replan_needed,
                "since_refit": self._since_refit}

    @classmethod
    def from_state(cls, state: dict) -> ConvergenceTracker:
        tr = cls(refit_every=state["refit_every"], drift_tol=state["drift_tol"],
                 min_points=state["min_points"], max_samples=state.get("max_samples", 4096))
        tr.samples = [(int(s), float(t), math.nan if l is None else float(l))
                      for s, t, l in state["samples"]]
        tr.outcome = FitOutcome.from_dict(state["outcome"])
        tr.replan_needed = bool(state.get("replan_needed", False))
        tr._since_refit = int(state.get("since_refit", 0))
        return tr
