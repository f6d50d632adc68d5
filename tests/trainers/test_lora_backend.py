"""LoRA on the torch backend (peft, CPU): adapter-only gradients and optimizer state, the
adapter-disabled reference, exact resume, peft/merged export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from palaestra.errors import ConfigError
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.trainers.torch_backend.lora import LoraSettings

torch.set_num_threads(1)


def tiny_llama_like(path: Path) -> Path:
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
    return tiny_llama_like(tmp_path_factory.mktemp("lora_qwen3"))


def lora_backend(model_dir: Path, **kwargs) -> TorchBackend:
    lora = kwargs.pop("lora", LoraSettings(rank=4, alpha=8.0))
    return TorchBackend(model_dir, TorchBackendConfig(device="cpu", lr=1e-2, lora=lora,
                                                      ref_model=True, **kwargs))


def rl_batch(seed: int = 1):
    from palaestra.trainers.batching import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, rollout = [], [], [], []
    for i in range(4):
        length = 9 + 3 * i
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(mask * -5.7)
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv, rollout_logprobs=rollout,
                      group_ids=["a", "a", "b", "b"])


def kl_loss() -> LossConfig:
    return LossConfig(preset="grpo", kl_coef=0.1, kl_mode="loss")


def test_only_the_adapter_trains_and_sits_in_the_optimizer(model_dir: Path) -> None:
    b = lora_backend(model_dir)
    trainable = {n for n, p in b.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all seven projections of both layers carry an adapter ("all-linear")
    assert len(trainable) == 2 * 7 * 2
    in_optim = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    assert in_optim == {id(p) for n, p in b.model.named_parameters() if n in trainable}
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    b.train_step(rl_batch(), kl_loss())
    b.train_step(rl_batch(2), kl_loss())
    changed = {n for n, p in b.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)  # B starts at 0 and must have moved
    assert set(b.optimizer.state) == {p for n, p in b.model.named_parameters() if n in trainable}


def test_reference_is_the_model_without_its_adapter(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    b = lora_backend(model_dir)
    assert b.ref_model is None  # no second copy
    batch = rl_batch()
    for _ in range(2):
        b.train_step(batch, kl_loss())
    ref = b.forward_logprobs(batch, ref=True)
    pol = b.forward_logprobs(batch)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, r, p in zip(batch.token_ids, ref, pol):
            logsm = torch.log_softmax(base(input_ids=ids[None]).logits[0].float(), -1)
            want = torch.zeros(len(ids))
            want[1:] = logsm[:-1].gather(-1, ids[1:, None]).squeeze(-1)
            torch.testing.assert_close(r, want, atol=1e-5, rtol=0)
            assert (p - r).abs().max() > 1e-4  # the adapter is on in the policy's forward
    metrics = b.train_step(batch, kl_loss())
    assert metrics["actor/kl"] > 0  # the KL term saw a reference different from the policy


def test_resume_is_exact_and_checkpoint_holds_only_the_adapter(model_dir: Path,
                                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = lora_backend(model_dir)
    a.train_step(rl_batch(1), kl_loss())
    a.save(tmp_path / "ck")
    saved = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)
    a.train_step(rl_batch(2), kl_loss())
    a.train_step(rl_batch(3), kl_loss())
    b = lora_backend(model_dir, seed=7)
    b.load(tmp_path / "ck")
    assert b.step == 1
    b.train_step(rl_batch(2), kl_loss())
    b.train_step(rl_batch(3), kl_loss())
    pa = dict(a.model.named_parameters())
    for n, p in b.model.named_parameters():
        assert torch.equal(p, pa[n]), n


def test_export_loads_with_peft_and_merged_matches(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    b = lora_backend(model_dir)
    for s in (1, 2):
        b.train_step(rl_batch(s), kl_loss())
    b.export_adapter(tmp_path / "adapter")
    b.export_hf(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                  dtype=torch.float32).eval()
    ids = rl_batch().token_ids[2][None]
    want = b.forward_logprobs(rl_batch())[2]
    with torch.no_grad():
        for model in (loaded, merged):
            logsm = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            got = logsm[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(got, want[1:], atol=1e-5, rtol=0)
    # the engines' snapshot of the merged weights equals the exported model's
    sd = b.state_dict_for_engines()
    assert not any("lora" in k or "base_layer" in k for k in sd)
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"],
                       merged.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_bad_target_modules_is_refused_at_load_time(model_dir: Path) -> None:
    import tomllib

    from palaestra.run.config import TrainConfig

    config = Path(__file__).parents[2] / "configs" / "quickstart_lora.toml"
    raw = tomllib.loads(config.read_text())
    cfg = TrainConfig.model_validate(raw)
    assert cfg.trainer.torch.lora is not None and cfg.trainer.torch.lora.rank == 16
    raw["trainer"]["torch"]["lora"]["target_modules"] = ["qkv"]
    with pytest.raises(ValueError, match="target_modules"):
        TrainConfig.model_validate(raw)
    with pytest.raises(ConfigError, match="export_hf"):
        TorchBackend(model_dir, TorchBackendConfig(device="cpu")).export_adapter("/nonexistent")
