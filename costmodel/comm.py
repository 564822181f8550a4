"""Communication cost: alpha-beta time of each ring collective, symbolic to print, fast to price.

Each collective over n devices on a link with per-hop latency alpha (s) and bus bandwidth beta
(bytes/s) costs `bw(n)·B/β + hops(n)·α`, where B is:

| kind           | B is the size of            | bw(n)      | hops(n)  |
|----------------|-----------------------------|------------|----------|
| all_reduce     | the full (summed) tensor    | 2(n-1)/n   | 2(n-1)   |
| all_gather     | the gathered output         | (n-1)/n    | n-1      |
| reduce_scatter | the (unscattered) input     | (n-1)/n    | n-1      |
| all_to_all     | the local buffer            | (n-1)/n    | n-1      |
| send_recv      | the message                 | 1          | 1        |

`FORMULAS` holds these as sympy expressions (printed in plans); `collective_time` evaluates
coefficients derived from them once per (kind, n) and then does plain float arithmetic, because the
planner prices millions of collectives. Any collective over n == 1 devices costs 0 s.
"""
from __future__ import annotations

from functools import lru_cache

import sympy as sp

from .hardware import COLLECTIVE_KINDS, HardwareSpec, LinkSpec
from .memory import format_bytes, format_seconds

# Python names differ from the printed symbols so that function arguments never shadow them.
SYM_N, SYM_B, SYM_ALPHA, SYM_BETA = sp.symbols("n B alpha beta", positive=True)
_n, _B, _a, _b = SYM_N, SYM_B, SYM_ALPHA, SYM_BETA

FORMULAS: dict[str, sp.Expr] = {
    "all_reduce": 2 * (_n - 1) / _n * _B / _b + 2 * (_n - 1) * _a,
    "all_gather": (_n - 1) / _n * _B / _b + (_n - 1) * _a,
    "reduce_scatter": (_n - 1) / _n * _B / _b + (_n - 1) * _a,
    "all_to_all": (_n - 1) / _n * _B / _b + (_n - 1) * _a,
    "send_recv": _B / _b + _a,
}
assert tuple(FORMULAS) == COLLECTIVE_KINDS


def _split(expr: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """Write `expr` as bw(n)·B/β + hops(n)·α and return (bw, hops); the model must be affine."""
    bw = sp.factor(sp.diff(expr, _B) * _b)
    hops = sp.factor(sp.diff(expr, _a))
    assert sp.expand(expr - (bw * _B / _b + hops * _a)) == 0, expr
    assert not ({_B, _a, _b} & (bw.free_symbols | hops.free_symbols)), expr
    return bw, hops


_COEFFS: dict[str, tuple[sp.Expr, sp.Expr]] = {kind: _split(e) for kind, e in FORMULAS.items()}
_COEFF_FNS = {kind: (sp.lambdify(_n, bw, "math"), sp.lambdify(_n, hops, "math"))
              for kind, (bw, hops) in _COEFFS.items()}


def formula(kind: str) -> sp.Expr:
    """The sympy expression of a collective's time in symbols n, B, alpha, beta."""
    _check_kind(kind)
    return FORMULAS[kind]


def _check_kind(kind: str) -> None:
    if kind not in FORMULAS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {list(FORMULAS)}")


@lru_cache(maxsize=None)
def _factors(kind: str, num_devices: int) -> tuple[float, float]:
    """(bw(n), hops(n)) as floats; cached because the planner asks for few distinct (kind, n)."""
    _check_kind(kind)
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"a collective needs n >= 1 devices, got {num_devices!r}")
    if num_devices == 1:
        return 0.0, 0.0
    bw_fn, hops_fn = _COEFF_FNS[kind]
    return float(bw_fn(num_devices)), float(hops_fn(num_devices))


def coefficients(kind: str, num_devices: int) -> tuple[float, float]:
    """(bw(n), hops(n)) of `kind` over n devices: t = bw·B/β + hops·α (calibration fits these)."""
    return _factors(kind, num_devices)


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for one collective of `kind` over `n` devices moving a B = `nbytes` tensor."""
    bw, hops = _factors(kind, n)
    return bw * nbytes / link.bandwidth + hops * link.latency


def hardware_collective_time(kind: str, nbytes: float, n: int, hw: HardwareSpec,
                             link_kind: str) -> float:
    """`collective_time` on hw's "intra"/"inter" link, using a calibrated fit for `kind` if any."""
    return collective_time(kind, nbytes, n, hw.link(link_kind, kind))


def collective_bytes_moved(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device puts on the wire: the bandwidth term times beta, e.g. 2(n-1)/n·B."""
    return _factors(kind, n)[0] * nbytes


def _text(expr: sp.Expr) -> str:
    return str(expr).replace("*", "·").replace(" - ", "-").replace(" + ", "+")


def _term(coeff: sp.Expr, rest: str) -> str:
    if coeff == 1:
        return rest
    return f"({_text(coeff)})·{rest}" if isinstance(coeff, sp.Add) else f"{_text(coeff)}·{rest}"


def explain(kind: str, nbytes: float, n: int, link: LinkSpec) -> str:
    """One line with the formula, the numbers put in and the result.

    e.g. "all_reduce: 2·(n-1)/n·B/β + 2·(n-1)·α = 3/2·4.19 MB / 450 GB/s + 6·5.00 µs = 44.0 µs"
    """
    _check_kind(kind)
    seconds = collective_time(kind, nbytes, n, link)
    bw, hops = _COEFFS[kind]
    symbolic = f"{_term(bw, 'B/β')} + {_term(hops, 'α')}"
    if n == 1:
        return f"{kind}: {symbolic} = 0 s (n = 1)"
    bw_n, hops_n = bw.subs(_n, n), hops.subs(_n, n)
    numbers = (f"{_term(bw_n, format_bytes(nbytes))} / {format_bytes(link.bandwidth)}/s"
               f" + {_term(hops_n, format_seconds(link.latency))}")
    return f"{kind}: {symbolic} = {numbers} = {format_seconds(seconds)}"

