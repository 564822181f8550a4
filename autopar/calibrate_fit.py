"""Fits of calibration timings (pure, tested on synthetic timings): alpha-beta per collective, lines.

`autopar.calibrate` measures; these turn its timings into the figures of a `HardwareSpec`.
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


def fit_alpha_beta(kind: str, samples: Sequence[tuple[int, float, float]]) -> LinkSpec:
    """Least-squares alpha (s) and beta (bytes/s) of `kind` from (n, B, seconds) samples.

    Relative error is minimised (rows weighted by 1/t), so 1 KiB messages fix alpha as much as
    64 MiB ones fix beta. Both stay physical: a negative alpha is clamped to 0 and refitted."""
    rows = [(*coefficients(kind, n), b, t) for n, b, t in samples if n > 1 and t > 0]
    if len(rows) < 2:
        raise InputError(f"fitting {kind} needs at least 2 timings over n > 1 devices, got {len(rows)}")
    hops = np.array([r[1] for r in rows])
    volume = np.array([r[0] * r[2] for r in rows])   # bw(n)·B
    t = np.array([r[3] for r in rows])
    w = 1.0 / t
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.stack([hops * w, volume * w], 1), t * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        inv_beta = float(np.sum(volume * w * t * w) / np.sum((volume * w) ** 2))
    if inv_beta <= 0:   # no bandwidth term visible (all messages tiny): latency only
        inv_beta = 1e-15
        alpha = float(np.sum(hops * w * t * w) / np.sum((hops * w) ** 2))
    return LinkSpec(bandwidth=1.0 / float(inv_beta), latency=float(alpha))


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of t = intercept + slope·x, both clamped to >= 0.

    Rows are weighted by 1/t (relative error), so the small sizes fix the intercept (a fixed
    per-call overhead) as much as the large ones fix the slope (seconds per byte or per item)."""
    rows = [(float(x), float(t)) for x, t in zip(xs, ts) if t > 0]
    if len({x for x, _ in rows}) < 2:
        raise InputError(f"a line fit needs timings at 2 or more distinct sizes, got {len(rows)}")
    x, t = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    w = 1.0 / t
    (intercept, slope), *_ = np.linalg.lstsq(np.stack([w, x * w], 1), t * w, rcond=None)
    if intercept < 0:
        return 0.0, max(0.0, float(np.sum(x * w * t * w) / np.sum((x * w) ** 2)))
    if slope < 0:
        return float(np.sum(w * t * w) / np.sum(w ** 2)), 0.0
    return float(intercept), float(slope)


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
