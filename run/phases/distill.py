"""On-policy distillation in the RL loop: ``[distill]``, its load-time checks, the teacher's
step.

The student samples as in any RL step; the backend scores every sampled token with the teacher
(`TorchBackend.forward_teacher_logprobs`: batched no-grad forwards, the teacher on the
trainer's device) and `trainers.algorithms.distill.distill_advantages` turns the per-token
reverse KL into advantages (optionally mixed with the env reward's). Torch-free at import:
`DistillSection` is part of `RunSettings`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.config import Problem
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from palaestra.contracts import TrainerBackend
    from palaestra.run.sections import RunSettings
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.ppo.step import Critic
    from palaestra.trainers.update import Learner


def teacher_path(cfg: RunSettings) -> Path | None:
    t = cfg.distill.teacher
    return None if t is None else cfg.in_run(t)


def distill_problems(cfg: RunSettings) -> list[Problem]:
    """Why ``[distill]`` cannot run (empty without a teacher): the backend, the teacher folder,
    and its vocabulary against the student's when the student's folder exists already (else
    `check_teacher` runs once the run has built it, before any work)."""
    d, path = cfg.distill, teacher_path(cfg)
    if path is None:
        return []
    out: list[Problem] = []
    if cfg.algorithm != "rl":
        out.append(Problem(("algorithm", "distill.teacher"), (
            f"distill.teacher distils during RL steps; algorithm = {cfg.algorithm!r} has none: "
            "set algorithm = \"rl\" or drop [distill]")))
    if cfg.trainer.backend != "torch":
        out.append(Problem(("trainer.backend", "distill.teacher"), (
            f"distill.teacher: trainer.backend = {cfg.trainer.backend!r} cannot score with a "
            "teacher (only the torch backend loads one): set --trainer.backend torch")))
    if cfg.placement is not None:
        out.append(Problem(("placement", "distill.teacher"), (
            "distill.teacher: a trainer group ([placement]) does not load a teacher on its "
            "ranks; distil in one trainer process (drop [placement])")))
    if cfg.trainer.loss.advantage_estimator == "gae":
        out.append(Problem(("trainer.loss", "distill.teacher"), (
            "distill.teacher with GAE (PPO's critic): the distillation advantages are per "
            "token and need no critic; use --trainer.loss.preset grpo")))
    if d.coef == 0 and d.reward_coef == 0:
        out.append(Problem(("distill.coef", "distill.reward_coef"), (
            "distill.coef and distill.reward_coef are both 0: nothing would be trained; set "
            "--distill.coef 1")))
    student = cfg.in_run(cfg.model.path)
    try:
        check_teacher(path, student if (student / "config.json").is_file() else None)
    except ConfigError as e:
        out.append(Problem(("distill.teacher",), str(e)))
    return out


def check_teacher(teacher: Path, student: Path | None) -> None:
    """Raise `ConfigError` when ``teacher`` is not a model folder, or (``student`` given) when
    its vocabulary differs from the student's: the teacher scores the student's token ids, so
    both must mean the same thing by each id."""
    if not (teacher / "config.json").is_file():
        raise ConfigError(
            f"distill.teacher = {str(teacher)!r}: no Hugging Face model there (no config.json); "
            "point it at a model folder, e.g. the quickstart's runs/quickstart/final-model "
            "(palaestra train configs/quickstart.toml)")
    if student is None:
        return
    t_vocab, s_vocab = _vocab_size(teacher), _vocab_size(student)
    if t_vocab != s_vocab:
        raise ConfigError(
            f"distill.teacher {str(teacher)!r} has vocab_size {t_vocab}, the student "
            f"{str(student)!r} {s_vocab}: the teacher must share the student's tokenizer")
    t_tok, s_tok = _token_ids(teacher), _token_ids(student)
    if t_tok is not None and s_tok is not None and t_tok != s_tok:
        differ = sorted(k for k in set(t_tok) ^ set(s_tok))[:3] or sorted(
            k for k in t_tok if t_tok[k] != s_tok[k])[:3]
        raise ConfigError(
            f"distill.teacher {str(teacher)!r} and the student {str(student)!r} have different "
            f"tokenizers (e.g. {differ}): the teacher must share the student's tokenizer")


def _vocab_size(model: Path) -> int | None:
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    size = text.get("vocab_size")
    return None if size is None else int(size)


def _token_ids(model: Path) -> dict[str, int] | None:
    """token -> id of ``tokenizer.json`` (its vocabulary and added tokens), None without."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())  # the tokenizer file: JSON as it came
    raw = data.get("model", {}).get("vocab") or {}
    # unigram models list [[piece, score], ...]: the id is the position, not the score
    vocab = ({piece: i for i, (piece, _) in enumerate(raw)} if isinstance(raw, list)
             else dict(raw))
    vocab.update({t["content"]: int(t["id"]) for t in data.get("added_tokens", [])})
    return vocab


def build_learner(cfg: RunSettings, backend: TrainerBackend[TrainBatch, LossConfig],
                  critic: Critic | None) -> Learner:
    """The RL update of ``cfg``: PPO with a critic, else the critic-free update, with the
    ``[distill]`` teacher loaded into the (torch) backend, which then scores with it."""
    from palaestra.trainers.update import Distillation, PolicyUpdate, PPOUpdate

    if critic is not None:  # values, GAE, epochs of critic and actor updates
        return PPOUpdate(cfg, backend, critic)
    distill = None
    path = teacher_path(cfg)
    if path is not None:
        from palaestra.trainers.torch_backend.backend import TorchBackend

        if not isinstance(backend, TorchBackend):  # refused at load (distill_problems); a guard
            raise ConfigError(f"distill.teacher needs the torch backend in this process, not "
                              f"{type(backend).__name__}")
        backend.load_teacher(path)
        distill = Distillation(backend, coef=cfg.distill.coef,
                               reward_coef=cfg.distill.reward_coef)
    return PolicyUpdate(backend, cfg.trainer.loss, updates_per_batch=cfg.trainer.updates_per_batch,
                        distill=distill)


__all__ = ["build_learner", "check_teacher", "distill_problems",
           "teacher_path"]
