"""Fixtures of the engine tests: one tiny Qwen3 model + tokenizer built per session (no downloads),
its transformers twin as the reference, and helpers to run LocalEngines and servers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from palaestra.tiny_model import build_model

    return str(build_model(tmp_path_factory.mktemp("engine-model") / "tiny", "tiny"))


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """The same architecture and tokenizer with different random weights (for updates)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("engine-model-2") / "tiny-v2"
    shutil.copytree(model_dir, out)
    state = load_file(f"{model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(123)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v.clone()
           for k, v in state.items()}
    save_file(new, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="session")
def hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
async def engine(model_dir: str):
    from palaestra.engines.local.local import LocalEngine

    eng = LocalEngine(model_dir, max_running=64)
    yield eng
    await eng.close()
