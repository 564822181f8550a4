import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="module")
def gpt_case():
    """A tiny hand-written GPT (2 layers, 32 wide, seed 0) and its (ids, targets) example."""
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 16))
    return model, (ids, ids)
