import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (HF fp32 model, directory it was saved to with save_pretrained)."""
    from hf_models import build_hf_model

    out = {}
    for i, fam in enumerate(FAMILIES):
        model = build_hf_model(fam, seed=100 + i)
        path = tmp_path_factory.mktemp(fam)
        model.save_pretrained(path)
        out[fam] = (model, path)
    return out
