"""``algorithm = "rm"``: a Bradley-Terry reward model trained on preference pairs.

    palaestra train configs/rm_train.toml          # -> <out>/final-model, eval.jsonl accuracy

Data: ``offline.dataset``, the DPO format (JSONL rows ``{"prompt": [...], "chosen": [...],
"rejected": [...]}``, message lists); its last ``eval.num_tasks`` rows are held out and never
trained on. Model: ``model.path`` loaded as ``AutoModelForSequenceClassification`` with one label
(a causal LM checkpoint gets a fresh score head on its last non-pad token). Loss:
``-log sigmoid(r(chosen) - r(rejected))``. Each pair is rendered by
`palaestra.rollout.rewards.render` -- the same rendering the classifier reward source scores
episodes with. Evaluation (``eval.jsonl``, stages ``init``, ``step-N`` every ``eval.interval``
steps, ``rm``): held-out pair accuracy (r(chosen) > r(rejected); also written as
``success_rate``, the key every stage of eval.jsonl has), mean margin and loss. The export,
``<out>/final-model``, is a Hugging Face sequence-classification checkpoint with its tokenizer:
``[[rewards]] kind = "classifier", path = "<out>/final-model"`` loads it. Checkpoints every
``checkpoint.interval`` steps resume a killed run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig
from palaestra.run.run_dir import RunDir

if TYPE_CHECKING:
    import torch

    from palaestra.contracts import Tokenizer

Pair = tuple[list[int], list[int]]


def load_pairs(cfg: TrainConfig, tokenizer: Tokenizer) -> tuple[list[Pair], list[Pair]]:
    """Token ids of (chosen, rejected) for the training pairs and the held-out tail."""
    from palaestra.rollout.rewards.render import render_ids
    from palaestra.run.phases.offline import _load_jsonl

    rows = _load_jsonl(str(cfg.offline.dataset))
    held = cfg.eval.num_tasks
    if len(rows) <= held:
        raise ConfigError(f"offline.dataset has {len(rows)} pairs; eval.num_tasks = {held} of "
                          "them are held out, which leaves none to train on: lower "
                          "eval.num_tasks or add pairs")
    pairs = []
    for i, row in enumerate(rows):
        missing = {"prompt", "chosen", "rejected"} - set(row)
        if missing:
            raise ConfigError(f"preference pair {i} lacks {sorted(missing)}")
        prompt = list(row["prompt"])
        pairs.append((render_ids(tokenizer, prompt + list(row["chosen"])),
                      render_ids(tokenizer, prompt + list(row["rejected"]))))
    return pairs[: len(pairs) - held], pairs[len(pairs) - held:]


def scores(model: torch.nn.Module, batch: list[list[int]], pad_id: int, device: str) -> Any:
    """The model's scalar per sequence (a float tensor, with gradients when enabled)."""
    from palaestra.rollout.rewards.render import pad_right

    ids, mask = pad_right(batch, pad_id)
    return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float()


def bt_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> Any:
    """Bradley-Terry: ``-log sigmoid(r_c - r_r)``, averaged over the pairs."""
    import torch.nn.functional as F

    return -F.logsigmoid(chosen - rejected).mean()


def evaluate_pairs(model: torch.nn.Module, pairs: list[Pair], pad_id: int, device: str,
                   batch_size: int = 32) -> dict[str, float]:
    """Held-out accuracy (chosen scored above rejected), mean margin and loss."""
    import torch

    if not pairs:
        return {"accuracy": 0.0, "margin_mean": 0.0, "loss": 0.0, "pairs": 0.0}
    was_training = model.training
    model.eval()
    margins = []
    with torch.inference_mode():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            r = scores(model, [c for c, _ in chunk] + [rj for _, rj in chunk], pad_id, device)
            margins.append(r[: len(chunk)] - r[len(chunk):])
    model.train(was_training)
    m = torch.cat(margins)
    return {"accuracy": float((m > 0).float().mean()), "margin_mean": float(m.mean()),
            "loss": float(-torch.nn.functional.logsigmoid(m).mean()), "pairs": float(len(pairs))}


def _device(cfg: TrainConfig) -> str:
    device = cfg.trainer.torch.device
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(model_path: Path, device: str, seed: int) -> tuple[Any, Any]:
    """(model, tokenizer): ``model_path`` as a one-label sequence classifier, pad id set."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    torch.manual_seed(seed)  # the fresh score head
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" is the point here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=1, torch_dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError(f"the tokenizer at {model_path} has neither a pad nor an eos token; "
                          "a sequence classifier needs one to find each sequence's last token")
    model.config.pad_token_id = int(pad)
    return model.to(device), tokenizer


def train_reward_model(cfg: TrainConfig, run: RunDir, model_path: Path) -> Path:
    """Train, evaluate and export the reward model; returns ``<out>/final-model``."""
    import numpy as np
    import torch

    from palaestra.run.phases.offline import _bar, _batch_indices

    device = _device(cfg)
    model, tokenizer = load_model(model_path, device, cfg.seed)
    pad = int(model.config.pad_token_id)
    train, held = load_pairs(cfg, tokenizer)
    print(f"[rm] {len(train)} training pairs, {len(held)} held out; {model_path} on {device}",
          flush=True)
    opt_cfg = cfg.trainer.torch
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=opt_cfg.adam_betas,
                                  eps=opt_cfg.adam_eps, weight_decay=opt_cfg.weight_decay)
    start = 0
    latest = run.latest_checkpoint("rm") if cfg.checkpoint.resume else None
    if latest is not None:
        state = torch.load(latest / "rm_state.pt", map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        run.truncate_metrics_after("rm", start - 1)
        print(f"resumed rm from {latest.name} (step {start})", flush=True)
    if not run.has_eval("init"):
        _log_eval(run, model, held, pad, device, "init", None)
    model.train()
    steps, size = cfg.trainer.steps, cfg.offline.batch_size
    bar = _bar(cfg, steps, start, "rm")
    for step in range(start, steps):
        idx = _batch_indices(len(train), size, step, cfg.seed)
        batch = [train[i] for i in idx]
        r = scores(model, [c for c, _ in batch] + [rj for _, rj in batch], pad, device)
        chosen, rejected = r[: len(batch)], r[len(batch):]
        loss = bt_loss(chosen, rejected)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), opt_cfg.max_grad_norm or float("inf"))
        if torch.isfinite(grad_norm):
            optimizer.step()
        margin = (chosen - rejected).detach()
        record = {"step": step, "global_step": step, "phase": "rm", "reward_mean": None,
                  "loss": loss.item(), "train/loss": loss.item(),
                  "train/accuracy": float((margin > 0).float().mean()),
                  "train/margin_mean": float(margin.mean()), "train/grad_norm": float(grad_norm)}
        run.log_metrics(record)
        if bar is not None:
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{record['train/accuracy']:.2f}")
            bar.update(1)
        done = step + 1
        if cfg.eval.interval and done % cfg.eval.interval == 0 and done < steps:
            _log_eval(run, model, held, pad, device, f"step-{done}", done)
        if done % cfg.checkpoint.interval == 0 or done == steps:
            directory = run.checkpoint_dir("rm", done)
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": done, "rng": np.random.get_state()}, directory / "rm_state.pt")
            run.mark_complete(directory)
            run.write_state({"phase": "rm", "step": done})
            run.prune_checkpoints("rm", cfg.checkpoint.keep_last)
    if bar is not None:
        bar.close()
    final = _log_eval(run, model, held, pad, device, "rm", steps) \
        if not run.has_eval("rm", step=steps) else None
    out = run.root / "final-model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if final is not None:
        (out / "reward_model.json").write_text(json.dumps(
            {"held_out_pairs": len(held), "held_out_accuracy": final["accuracy"],
             "trained_steps": steps, "dataset": str(cfg.offline.dataset)}, indent=2))
    run.write_state({"phase": "done", "step": steps})
    return out


def _log_eval(run: RunDir, model: torch.nn.Module, held: list[Pair], pad: int, device: str, stage: str,
              step: int | None) -> dict[str, float]:
    t = time.perf_counter()
    metrics = evaluate_pairs(model, held, pad, device)
    record: dict[str, Any] = {"stage": stage, "success_rate": metrics["accuracy"], **metrics,
                              "time_s": round(time.perf_counter() - t, 2)}
    if step is not None:
        record["step"] = step
    run.log_eval(record)
    print(f"[eval {stage}] held-out pair accuracy {metrics['accuracy']:.3f} on "
          f"{int(metrics['pairs'])} pairs (margin {metrics['margin_mean']:.2f})", flush=True)
    return metrics


__all__ = ["bt_loss", "evaluate_pairs", "load_model", "load_pairs", "scores",
           "train_reward_model"]
