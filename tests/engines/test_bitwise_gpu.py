"""Bitwise on-policy mode on CUDA (bfloat16, the Triton GEMM and row sum of
`palaestra.engines.bitwise.invariant_triton`): the CPU tests of ``test_bitwise.py`` on the GPU, on
the tiny model and on a wider one (four layers of 256). Skipped without CUDA; run on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_bitwise import decode_and_extend_equal_whole_forward, engine_equals_trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from palaestra.tiny_model import build_model

    return str(build_model(tmp_path_factory.mktemp("small") / "small", "small"))


def test_decode_and_prefix_extend_equal_a_whole_sequence_forward_on_cuda(model_dir,
                                                                          small_model_dir):
    for path in (model_dir, small_model_dir):
        decode_and_extend_equal_whole_forward(path, "cuda", torch.bfloat16)


def test_engine_logprobs_equal_trainer_logprobs_on_cuda(model_dir, small_model_dir):
    for path in (model_dir, small_model_dir):
        engine_equals_trainer(path, "cuda")
