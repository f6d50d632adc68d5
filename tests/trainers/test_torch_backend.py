"""TorchBackend on a tiny random Qwen3 model (CPU): logprobs, packing, training, checkpoints."""

from __future__ import annotations

import itertools
import logging
import json
import math
from pathlib import Path

import pytest
import torch

from palaestra.errors import CheckpointError, ConfigError
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.trainers.torch_backend.optim import lr_multiplier

torch.set_num_threads(1)


def tiny_qwen3(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


def make_batch(seed: int = 1, n: int = 6, prompt: int = 3) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, rollout = [], [], [], []
    for i in range(n):
        length = 7 + (i * 5) % 14
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * prompt + [1.0] * (length - prompt))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(mask * -5.7)
    return TrainBatch(
        token_ids=ids, loss_mask=masks, advantages=adv, rollout_logprobs=rollout,
        group_ids=[f"p{i // 3}" for i in range(n)],
    )


def backend(model_dir: Path, **kwargs) -> TorchBackend:
    return TorchBackend(model_dir, TorchBackendConfig(device="cpu", **kwargs))


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def manual_logprobs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    logsm = torch.log_softmax(logits, -1)
    logp = torch.zeros(ids.shape[0])
    logp[1:] = logsm[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    ent = torch.zeros(ids.shape[0])
    ent[1:] = -(logsm.exp() * logsm).sum(-1)[:-1]
    return logp, ent


def params(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.model.named_parameters()}


def record_grads(b: TorchBackend) -> dict[str, torch.Tensor]:
    """Copy every gradient right before the optimizer applies it."""
    grads: dict[str, torch.Tensor] = {}

    def hook(optimizer, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in b.model.named_parameters()})

    b.optimizer.register_step_pre_hook(hook)
    return grads


# --------------------------------------------------------------------------- logprobs
def test_forward_logprobs_match_manual_log_softmax(model_dir):
    b = backend(model_dir, max_tokens_per_micro_batch=16)  # several packed micro-batches
    batch = make_batch()
    logps, ents = b.forward_logprobs_with_entropy(batch)
    reference = hf_model(model_dir)
    for ids, lp, ent in zip(batch.token_ids, logps, ents):
        want_lp, want_ent = manual_logprobs(reference, ids)
        assert lp.shape == ids.shape and lp.dtype == torch.float32
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert [t.tolist() for t in b.forward_logprobs(batch)] == [t.tolist() for t in logps]


def test_packed_equals_unpacked(model_dir):
    batch = make_batch(seed=2)
    packed = backend(model_dir, pack_sequences=True, forward_max_tokens_per_micro_batch=64)
    unpacked = backend(model_dir, pack_sequences=False, forward_max_tokens_per_micro_batch=48)
    single = backend(model_dir, pack_sequences=True, forward_max_tokens_per_micro_batch=1)
    a, b_, c = (x.forward_logprobs(batch) for x in (packed, unpacked, single))
    assert max(t.shape[0] for t in batch.token_ids) < 64 < batch.num_tokens  # really packed
    for x, y, z in zip(a, b_, c):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        torch.testing.assert_close(x, z, atol=1e-5, rtol=0)
    cfg = LossConfig.from_preset("grpo", entropy_coef=0.01)
    m_packed = packed.train_step(batch, cfg)
    m_unpacked = unpacked.train_step(batch, cfg)
    assert m_packed["loss"] == pytest.approx(m_unpacked["loss"], abs=1e-6)
    assert m_packed["grad_norm"] == pytest.approx(m_unpacked["grad_norm"], rel=1e-4)


# --------------------------------------------------------------------------- training
def test_gradient_accumulation_is_split_invariant(model_dir):
    batch = make_batch(seed=3)
    cfg = LossConfig.from_preset("grpo")  # seq-mean-token-mean: wrong if normalised per micro
    one = backend(model_dir, lr=1e-3, max_tokens_per_micro_batch=10_000)
    many = backend(model_dir, lr=1e-3, max_tokens_per_micro_batch=12)
    g1, g2 = record_grads(one), record_grads(many)
    m1, m2 = one.train_step(batch, cfg), many.train_step(batch, cfg)
    assert m1["num_micro_batches"] == 1 and m2["num_micro_batches"] >= 4
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-7, rtol=1e-4)
    p1, p2 = params(one), params(many)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], atol=1e-5, rtol=0)


def test_sft_steps_decrease_loss(model_dir):
    b = backend(model_dir, lr=1e-2, max_tokens_per_micro_batch=32)
    batch = make_batch(seed=4)
    cfg = LossConfig.from_preset("sft")
    losses = [b.train_step(batch, cfg)["loss"] for _ in range(5)]
    assert losses[0] == pytest.approx(math.log(300), abs=0.3)  # random init: ~uniform
    assert all(x > y for x, y in itertools.pairwise(losses)), losses
    assert b.step == 5


def test_ppo_steps_decrease_surrogate_and_clip(model_dir):
    b = backend(model_dir, lr=3e-4)
    batch = make_batch(seed=5)
    batch = batch.replace(old_logprobs=b.forward_logprobs(batch))
    cfg = LossConfig.from_preset("dapo", tis_cap=2.0)
    metrics = [b.train_step(batch, cfg) for _ in range(4)]
    losses = [m["loss"] for m in metrics]
    assert all(x > y for x, y in itertools.pairwise(losses)), losses
    assert metrics[0]["actor/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert metrics[0]["actor/clip_frac"] == 0.0 and metrics[-1]["actor/clip_frac"] > 0.0


def test_reference_model_and_kl(model_dir):
    b = backend(model_dir, lr=1e-2, ref_model=True)
    batch = make_batch(seed=6)
    before = b.forward_logprobs(batch)
    ref = b.forward_logprobs(batch, ref=True)
    for x, y in zip(before, ref):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    cfg = LossConfig.from_preset("grpo", kl_coef=0.1)
    first = b.train_step(batch, cfg)  # ref logprobs computed by the backend's ref model
    second = b.train_step(batch, cfg)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7) and second["actor/kl"] > 1e-6
    for x, y in zip(ref, b.forward_logprobs(batch, ref=True)):
        torch.testing.assert_close(x, y, atol=0, rtol=0)  # the reference stays frozen
    with pytest.raises(ConfigError, match="reference model"):
        backend(model_dir).forward_logprobs(batch, ref=True)


def test_dpo_starts_at_log2_and_improves(model_dir):
    b = backend(model_dir, lr=1e-2, ref_model=True, max_tokens_per_micro_batch=24)
    base = make_batch(seed=7, n=4)
    batch = TrainBatch(token_ids=base.token_ids, loss_mask=base.loss_mask, paired=True)
    batch = batch.replace(ref_logprobs=b.forward_logprobs(batch, ref=True))
    cfg = LossConfig.from_preset("dpo", dpo_beta=0.5)
    metrics = [b.train_step(batch, cfg) for _ in range(3)]
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["dpo/reward_accuracy"] == 1.0
    with pytest.raises(ConfigError, match="paired"):
        b.train_step(base.replace(ref_logprobs=base.loss_mask), cfg)


def test_critic_values_and_value_loss(model_dir, capfd, caplog):
    with caplog.at_level(logging.INFO):
        critic = backend(model_dir, critic=True, lr=3e-4)
    # the fresh value head is the design, not news: no load report of its "MISSING" keys
    assert "MISSING" not in "".join(capfd.readouterr()) + caplog.text
    batch = make_batch(seed=8)
    values = critic.forward_values(batch)
    assert [v.shape for v in values] == [t.shape for t in batch.token_ids]
    assert all(float(v[0]) == 0.0 for v in values)
    batch = batch.replace(old_values=values, returns=[m * 1.0 for m in batch.loss_mask])
    cfg = LossConfig.from_preset("ppo", value_clip=None)
    losses = [critic.train_step(batch, cfg)["critic/value_loss"] for _ in range(4)]
    assert all(x > y for x, y in itertools.pairwise(losses)), losses
    with pytest.raises(ConfigError, match="critic"):
        critic.forward_logprobs(batch)


def test_gradient_checkpointing_gives_same_step(model_dir):
    batch = make_batch(seed=9)
    cfg = LossConfig.from_preset("grpo")
    plain = backend(model_dir, lr=1e-3).train_step(batch, cfg)
    checkpointed = backend(model_dir, lr=1e-3, gradient_checkpointing=True)
    model = checkpointed.model
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    ckpt = checkpointed.train_step(batch, cfg)
    assert plain["loss"] == pytest.approx(ckpt["loss"], abs=1e-7)
    assert plain["grad_norm"] == pytest.approx(ckpt["grad_norm"], rel=1e-5)


def test_lr_warmup_and_cosine():
    cfg = TorchBackendConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6,
                             min_lr_ratio=0.1)
    got = [lr_multiplier(k, cfg) for k in range(7)]
    # warm-up 1/2, 2/2 ; cosine over 4 steps from 1 down to 0.1
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1]
    assert got == pytest.approx(expected)
    with pytest.raises(ValueError, match="total_steps"):
        TorchBackendConfig(lr_schedule="linear")


def test_train_step_reports_scheduled_lr(model_dir):
    b = backend(model_dir, lr=1e-3, warmup_steps=4)
    batch = make_batch(seed=10)
    lrs = [b.train_step(batch, LossConfig.from_preset("sft"))["lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4])


# ------------------------------------------------------------------ weights and checkpoints
def test_save_load_roundtrip_gives_identical_next_step(model_dir, tmp_path):
    cfg = LossConfig.from_preset("dapo", kl_coef=0.05)
    batch1, batch2 = make_batch(seed=11), make_batch(seed=12)
    a = backend(model_dir, lr=1e-2, warmup_steps=3, ref_model=True)
    a.train_step(batch1, cfg)
    a.train_step(batch1, cfg)
    a.save(tmp_path / "ckpt", extra={"data_position": 17})
    expected = a.train_step(batch2, cfg)

    b = backend(model_dir, lr=1e-2, warmup_steps=3, ref_model=True)
    state = b.load(tmp_path / "ckpt")
    assert b.step == 2 and state["data_position"] == 17
    got = b.train_step(batch2, cfg)
    for key in ("loss", "grad_norm", "lr", "actor/kl"):
        assert got[key] == expected[key], key
    pa, pb = params(a), params(b)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=0, rtol=0)

    (tmp_path / "ckpt" / "backend_state.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete"):
        b.load(tmp_path / "ckpt")


def test_export_hf_loads_with_transformers(model_dir, tmp_path):
    b = backend(model_dir, lr=1e-2)
    batch = make_batch(seed=13)
    b.train_step(batch, LossConfig.from_preset("sft"))
    out = b.export_hf(tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    loaded = hf_model(out)
    ids = batch.token_ids[0][None]
    b.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, b.model(input_ids=ids).logits,
                                   atol=0, rtol=0)
    base = hf_model(model_dir)
    with torch.no_grad():
        assert not torch.equal(base(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_state_dict_for_engines_has_hf_names(model_dir):
    b = backend(model_dir, lr=1e-2)
    b.train_step(make_batch(seed=14), LossConfig.from_preset("sft"))
    sd = b.state_dict_for_engines()
    engine_model = hf_model(model_dir)
    assert set(sd) == set(engine_model.state_dict())
    engine_model.load_state_dict(sd, strict=True)
    for name, p in b.model.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), atol=0, rtol=0)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]  # tied: one tensor
    b.train_step(make_batch(seed=15), LossConfig.from_preset("sft"))
    assert not torch.equal(sd["model.norm.weight"], b.model.model.norm.weight)  # a snapshot
    half = b.state_dict_for_engines(dtype=torch.bfloat16)
    assert half["model.norm.weight"].dtype == torch.bfloat16
    buckets = list(b.iter_engine_weight_buckets(bucket_bytes=40_000))
    assert len(buckets) > 1
    assert [n for bucket in buckets for n, _ in bucket] == list(sd)


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        TorchBackend(tmp_path, TorchBackendConfig(device="cpu"))


def test_public_api_is_pinned():
    import inspect

    from palaestra.trainers.torch_backend import backend, config

    assert backend.TorchBackend is TorchBackend and "TorchBackend" in backend.__all__
    assert config.TorchBackendConfig is TorchBackendConfig
    sig = {name: str(inspect.signature(getattr(TorchBackend, name))) for name in (
        "__init__", "forward_logprobs", "forward_logprobs_with_entropy", "forward_values",
        "train_step", "state_dict_for_engines", "iter_engine_weight_buckets", "save", "load",
        "export_hf",
    )}
    assert sig == {
        "__init__": "(self, model_path: 'str | Path', config: 'TorchBackendConfig | None' = None)"
                    " -> 'None'",
        "forward_logprobs": "(self, batch: 'TrainBatch', *, ref: 'bool' = False)"
                            " -> 'list[torch.Tensor]'",
        "forward_logprobs_with_entropy": "(self, batch: 'TrainBatch', *, ref: 'bool' = False)"
                                         " -> 'tuple[list[torch.Tensor], list[torch.Tensor]]'",
        "forward_values": "(self, batch: 'TrainBatch') -> 'list[torch.Tensor]'",
        "train_step": "(self, batch: 'TrainBatch', loss_cfg: 'LossConfig', *, "
                      "loss_weights: 'Sequence[torch.Tensor] | None' = None)"
                      " -> 'dict[str, float]'",
        "state_dict_for_engines": "(self, *, dtype: 'torch.dtype | None' = None, "
                                  "device: 'str | torch.device' = 'cpu')"
                                  " -> 'dict[str, torch.Tensor]'",
        "iter_engine_weight_buckets": "(self, bucket_bytes: 'int' = 536870912, *, "
                                      "dtype: 'torch.dtype | None' = None, "
                                      "device: 'str | torch.device' = 'cpu', "
                                      "every_rank: 'bool' = False)"
                                      " -> 'Iterator[list[tuple[str, torch.Tensor]]]'",
        "save": "(self, directory: 'str | Path', *, extra: 'dict[str, Any] | None' = None)"
                " -> 'Path'",
        "load": "(self, directory: 'str | Path') -> 'dict[str, Any]'",
        "export_hf": "(self, directory: 'str | Path', *, dtype: 'torch.dtype | None' = None)"
                     " -> 'Path'",
    }
