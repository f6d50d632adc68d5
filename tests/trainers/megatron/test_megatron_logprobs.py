"""Vocab-parallel logprobs and entropy: single rank vs log_softmax, two gloo ranks vs one."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from palaestra.trainers.megatron.logprobs import shifted_token_logprobs, vocab_parallel_logprobs


def _reference(logits: torch.Tensor, labels: torch.Tensor, vocab: int):
    logp = torch.log_softmax(logits[..., :vocab].double(), -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def test_single_rank_matches_log_softmax_and_drops_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 13, generator=g) * 4
    logits[..., 11:] = 50.0  # padded vocabulary columns must not count
    labels = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=11, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, labels, 11)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_bf16_logits_are_upcast():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 7, 50, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 7), generator=g)
    lp, _ = vocab_parallel_logprobs(logits, labels)
    ref, _ = _reference(logits.float(), labels, 50)
    assert torch.allclose(lp.double(), ref, atol=1e-5)


def test_shifted_alignment_and_gradient():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 6, 9, generator=g, requires_grad=True)
    ids = torch.randint(0, 9, (1, 6), generator=g)
    lp, ent = shifted_token_logprobs(logits, ids, with_entropy=True)
    assert lp.shape == ids.shape and lp[0, 0] == 0 and ent[0, 0] == 0
    expected = torch.log_softmax(logits[0, 2], -1)[ids[0, 3]]
    assert torch.allclose(lp[0, 3], expected)
    lp.sum().backward()
    assert logits.grad[0, -1].abs().sum() == 0  # the last logit predicts nothing
    ref = torch.autograd.grad(torch.log_softmax(logits[0, :-1], -1).gather(
        -1, ids[0, 1:, None]).sum(), logits)[0]
    assert torch.allclose(logits.grad, ref, atol=1e-6)


def _worker(rank: int, port: int, logits: torch.Tensor, labels: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        width = logits.shape[-1] // 2
        local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(local, labels, vocab_size=13, vocab_start=rank * width,
                                          tp_group=dist.group.WORLD, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        out[rank] = (lp.detach(), ent.detach(), local.grad)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_tensor_parallel_ranks_match_one_rank():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 14, generator=g) * 3  # 13 real tokens + 1 padding column
    labels = torch.randint(0, 13, (2, 4), generator=g)
    manager = mp.Manager()
    out = manager.dict()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, logits, labels, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    full = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(full, labels, vocab_size=13, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    for rank in range(2):
        r_lp, r_ent, r_grad = out[rank]
        assert torch.allclose(r_lp, lp.detach(), atol=1e-5)
        assert torch.allclose(r_ent, ent.detach(), atol=1e-5)
        assert torch.allclose(r_grad, full.grad[..., rank * 7 : (rank + 1) * 7], atol=1e-5)
