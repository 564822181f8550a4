"""Sharding rules: for one ATen op on ONE mesh axis, the placements it can run under.

`registry` holds the types (`OpCall`, `AxisStrategy`) and the op -> rule table; each other module is
one family of ops and registers its rules when imported, which importing this package does. The
invariant every rule promises, and how multi-axis strategies are formed from them, is written in
`registry`'s docstring.
"""
from autopar.sharding.rules import conv, creation, matmul, misc, moe, nn, pointwise, reduction, shape  # noqa: F401
from autopar.sharding.rules.registry import (
                                             IN_OP_COLLECTIVES,
                                             AxisStrategy,
                                             OpCall,
                                             TInfo,
                                             find_rule,
                                             in_op_collectives,
                                             normalize_dim,
                                             register,
)

__all__ = ["AxisStrategy", "IN_OP_COLLECTIVES", "OpCall", "TInfo", "find_rule", "in_op_collectives", "normalize_dim",
           "register"]
