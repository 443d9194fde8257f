"""Decreasing hazard: checkpoint more often right after a restart, less later.

With per-node Weibull failures of shape k < 1 (fitted from the cluster's history), a node that
has just failed and come back is more likely to fail again soon, and a node of unknown age that
has been seen to survive for a while is less likely to fail than the average. For a job on n
nodes, a time a after the restart that followed a failure, the failed node is fresh and the
other n-1 were at unknown (stationary) ages when it restarted, so the job's cumulative hazard is

    H(a) = (a / s)^k + (n - 1) * He(a),    He(a) = -log Q(1/k, (a / s)^k),

with r the per-node rate, s = 1 / (r * Gamma(1 + 1/k)) the Weibull scale and Q the regularized
upper incomplete gamma function (He is the cumulative hazard of a stationary renewal process's
residual life: its density is S(x) r). On a fresh start (no failure known) all n nodes are of
unknown age: H(a) = n * He(a). For k = 1 both reduce to n * r * a.

The first-order optimal interval under a time-varying hazard is tau = sqrt(2*Tb / h), with h the
mean hazard over the interval: :meth:`JobHazard.next_interval` solves tau = f(Tb, 1 / h(a, tau)),
h(a, tau) = (H(a+tau) - H(a)) / tau, by fixed-point iteration, with f Daly's higher-order
formula (Young's sqrt(2 Tb M) to first order), so that where the hazard is flat the plan is
Daly's. From 8 nodes up the (n-1)*r term dominates and it is.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class JobHazard:
    per_node_rate: float
    shape: float
    nodes: int
    fresh_node: bool = True          # a node came back from a failure at age 0
    # The share of failures that roll back to a checkpoint (1 - the survivors' save coverage):
    # covered failures are a random thinning, so the hazard that matters scales by it.
    rollback_fraction: float = 1.0

    @property
    def scale_s(self) -> float:
        return 1.0 / (self.per_node_rate * math.gamma(1.0 + 1.0 / self.shape))

    def cumulative(self, age_s: float) -> float:
        """H(age) since the restart; the fresh node's Weibull term plus the others' constant rate."""
        a = max(age_s, 0.0)
        x = (a / self.scale_s) ** self.shape
        from scipy.special import gammaincc  # not at import: a training rank's start pays for it
        q = float(gammaincc(1.0 / self.shape, x))
        residual = -math.log(max(q, 1e-300))
        h = x + (self.nodes - 1) * residual if self.fresh_node else self.nodes * residual
        return h * self.rollback_fraction if self.rollback_fraction != 1.0 else h

    def mean_rate(self, age_s: float, span_s: float) -> float:
        return (self.cumulative(age_s + span_s) - self.cumulative(age_s)) / span_s

    def next_interval(self, age_s: float, ckpt_s: float, guess_s: float, lo_s: float,
                      hi_s: float, interval_fn: Callable[[float, float], float] | None = None
                      ) -> float:
        """``interval_fn(ckpt_s, mtbf_s)``: the constant-rate rule (default Young's)."""
        fn = interval_fn or (lambda c, m: math.sqrt(2.0 * c * m))
        tau = min(max(guess_s, lo_s), hi_s)
        for _ in range(8):
            new = fn(ckpt_s, 1.0 / self.mean_rate(age_s, tau))
            new = min(max(new, lo_s), hi_s)
            if abs(new - tau) < 1e-3 * tau:
                tau = new
                break
            tau = new
        return tau
