import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
# Plans in tests price the `cpu` preset, not a profile of whichever machine runs them (measured at first use
# and cached: autopar/calibration/machine.py), so they are the same everywhere; tests/test_machine_profile.py
# switches it on where it is the subject. Set here, so spawned ranks and subprocesses inherit it.
os.environ["AUTOPAR_CALIBRATE"] = "0"


@pytest.fixture(scope="module")
def gpt_case():
    """A tiny hand-written GPT (2 layers, 32 wide, seed 0) and its (ids, targets) example."""
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 16))
    return model, (ids, ids)
