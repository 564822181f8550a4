"""Workers for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import copy

import torch


def train_reference(model, batches, steps: int, lr: float = 1e-2):
    """Single-process run of the unmodified model: losses per step and final parameters."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        out = model(*batches[step % len(batches)])
        loss = out if isinstance(out, torch.Tensor) else out.loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_parallel(rank, world, model, batches, steps, kw, lr=1e-2):
    import autopar
    from autopar.runtime import autoparallelize
    torch.manual_seed(0)
    pmodel = autoparallelize(copy.deepcopy(model), batches[0], verify=True, **kw)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(pmodel.train_step(*batches[step % len(batches)]).item())
        opt.step()
    state = pmodel.full_state_dict()
    collectives = [n.meta["autopar_collective"] for n in pmodel.gm.graph.nodes if "autopar_collective" in n.meta]
    return {"losses": losses, "state": state, "plan": pmodel.plan.to_json(), "collectives": collectives}
