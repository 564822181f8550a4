"""Fits of calibration timings (pure, tested on synthetic timings): alpha-beta per collective, lines.

`autopar.calibration.measure` measures; these turn its timings into the figures of a `HardwareSpec`.
Each (link kind, collective) is fitted to the alpha-beta formula of `costmodel.comm`, which is
linear in alpha and 1/beta:

    t(n, B) = hops(n)·α + bw(n)·B·(1/β)      (least squares, weighted by 1/t: relative error)

and per-op overheads and rates to a line, t(x) = o + x·(1/W) (`fit_line`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.costmodel.comm import coefficients
from autopar.costmodel.hardware import COLLECTIVE_KINDS, LINK_KINDS, LinkSpec
from autopar.errors import InputError


@dataclass(frozen=True)
class Sample:
    """One measured collective: `kind` over `n` devices on a `link_kind` link, B bytes, seconds."""

    kind: str
    link_kind: str
    n: int
    nbytes: float
    seconds: float


HUBER_K = 1.345   # Huber's tuning constant: 95% efficiency when the errors are normal


def _robust_weights(design: np.ndarray, t: np.ndarray, iters: int = 20) -> np.ndarray:
    """Row weights for fitting t ~ design @ c in relative error, robust to outliers: iteratively
    reweighted least squares with Huber's loss, scale from the median absolute relative residual.
    A timing far off the line (taken in a spell of load from elsewhere) would otherwise tilt both
    coefficients: one 4 MiB all-reduce at 3x its time prices 16 MiB 13% high."""
    base = 1.0 / t
    weights = base
    coef = None
    for _ in range(iters):
        new, *_ = np.linalg.lstsq(design * weights[:, None], t * weights, rcond=None)
        if coef is not None and np.allclose(new, coef, rtol=1e-9, atol=0.0):
            break
        coef = new
        rel = np.abs(design @ coef - t) / t
        scale = 1.4826 * float(np.median(rel))
        if scale <= 1e-12:   # (near) exact: nothing to weigh down
            break
        u = rel / (HUBER_K * scale)
        weights = base * np.sqrt(np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1.0)))
    return weights


def _fit_two(first: np.ndarray, second: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(a, b) of t = a·first + b·second in robust relative error, both clamped to >= 0: a negative
    one is set to 0 and the other refitted alone (same row weights)."""
    design = np.stack([first, second], 1)
    w = _robust_weights(design, t)
    (a, b), *_ = np.linalg.lstsq(design * w[:, None], t * w, rcond=None)
    if a < 0:
        return 0.0, max(0.0, float(np.sum(second * w * t * w) / np.sum((second * w) ** 2)))
    if b < 0:
        return max(0.0, float(np.sum(first * w * t * w) / np.sum((first * w) ** 2))), 0.0
    return float(a), float(b)


def fit_alpha_beta(kind: str, samples: Sequence[tuple[int, float, float]]) -> LinkSpec:
    """Least-squares alpha (s) and beta (bytes/s) of `kind` from (n, B, seconds) samples.

    Relative error is minimised (rows weighted by 1/t), so 1 KiB messages fix alpha as much as
    64 MiB ones fix beta, and outlying timings are weighed down (Huber, `_robust_weights`). Both
    stay physical: a negative alpha is clamped to 0 and beta refitted."""
    rows = [(*coefficients(kind, n), b, t) for n, b, t in samples if n > 1 and t > 0]
    if len(rows) < 2:
        raise InputError(f"fitting {kind} needs at least 2 timings over n > 1 devices, got {len(rows)}")
    hops = np.array([r[1] for r in rows])
    volume = np.array([r[0] * r[2] for r in rows])   # bw(n)·B
    t = np.array([r[3] for r in rows])
    alpha, inv_beta = _fit_two(hops, volume, t)
    if inv_beta <= 0:   # no bandwidth term visible (all messages tiny): latency only
        return LinkSpec(bandwidth=1e15, latency=alpha)
    return LinkSpec(bandwidth=1.0 / inv_beta, latency=alpha)


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of t = intercept + slope·x, both clamped to >= 0.

    Rows are weighted by 1/t (relative error), so the small sizes fix the intercept (a fixed
    per-call overhead) as much as the large ones fix the slope (seconds per byte or per item);
    outlying timings are weighed down as in `fit_alpha_beta`."""
    rows = [(float(x), float(t)) for x, t in zip(xs, ts) if t > 0]
    if len({x for x, _ in rows}) < 2:
        raise InputError(f"a line fit needs timings at 2 or more distinct sizes, got {len(rows)}")
    x, t = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    return _fit_two(np.ones_like(x), x, t)


def fit_links(samples: Sequence[Sample]) -> dict[str, dict[str, LinkSpec]]:
    """Per link kind and collective kind, the alpha-beta fit of its samples."""
    out: dict[str, dict[str, LinkSpec]] = {}
    for link_kind in LINK_KINDS:
        for kind in COLLECTIVE_KINDS:
            rows = [(s.n, s.nbytes, s.seconds) for s in samples
                    if s.link_kind == link_kind and s.kind == kind]
            if len(rows) >= 2:
                out.setdefault(link_kind, {})[kind] = fit_alpha_beta(kind, rows)
    return out
