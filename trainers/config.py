"""``TrainConfig``: the typed config tree of ``palaestra train`` (TOML + dotted overrides).

Torch-free: the command validates the whole file (every problem at once) before importing torch:
the field types and ranges here, the checks across fields and against the env registry and the
data files in `palaestra.trainers.config_checks` (run by ``TrainConfig``'s validator).
The sections map onto the builders of the loop: ``model`` (checkpoint or a tiny model built
locally), ``env``/``data`` (tasks), ``agent`` (renderer family), ``rollout`` (groups, sampling,
workers, sync/async), ``engine`` (embedded or SGLang servers), ``warmup`` (SFT warm start on
demonstrations), ``trainer`` (backend, optimiser, loss), ``eval``, ``checkpoint``, ``logging``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from palaestra.benchmarks.training import EvalConfig as BenchmarkEvalConfig
from palaestra.config import ConfigProblems, Section
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.megatron.config import MegatronBackendConfig
from palaestra.trainers.services import ServicesSection
from palaestra.trainers.torch_backend.config import TorchBackendConfig


class ModelSection(Section):
    path: str = "{out}/model"
    """Hugging Face checkpoint directory of the policy (``{out}`` is the run directory)."""
    init_size: str | None = None
    """If set and ``path`` holds no model, build a local Qwen3 model of this size there
    (``palaestra init-model``: micro, tiny, small, 10m)."""
    init_seed: int = 0
    """Seed of the locally built model and tokenizer."""


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


class AgentSection(Section):
    family: str = "qwen"
    """Renderer and tool-call parser family: qwen, llama3, search_r1, python."""
    max_context: int = Field(2048, ge=2)
    """Context limit of an episode in tokens (past it the episode ends as truncated)."""
    tools_in_prompt: bool = True
    """Render the env's tool schemas into the system prompt (False: the env's own prompt
    describes them, which keeps prompts short for tiny models)."""
    drift_rate: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of episodes checked for token drift against a full re-render."""
    strict_drift: bool = False
    """Raise on token drift instead of counting it."""


class RolloutSection(Section):
    batch_size: int = Field(16, ge=1)
    """Groups (prompts) per training step."""
    group_size: int = Field(8, ge=1)
    """Episodes per prompt (group baselines such as GRPO's need 2 or more)."""
    max_new_tokens: int = Field(256, ge=1)
    """Token budget of one assistant turn."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (the trainer divides logits by it to match)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    max_turns: int | None = Field(None, ge=1)
    """Cap on assistant turns per episode (None: the env's own limit)."""
    cluster: Literal["ray", "local"] = "ray"
    """Rollout workers as Ray actors, or in-process asyncio workers ("local")."""
    ray_address: str | None = None
    """Address of an existing Ray cluster (None: start a local one)."""
    num_workers: int = Field(2, ge=1)
    """Rollout workers."""
    max_concurrency: int = Field(256, ge=1)
    """Episodes in flight over all workers."""
    mode: Literal["sync", "async"] = "sync"
    """sync: rollout then train; async: rollout of step k+1 overlaps training of step k."""
    max_staleness: int = Field(1, ge=0)
    """Oldest policy version a trained token may have, counted back from the newest."""
    filters: list[str] = Field(default_factory=list)
    """Group filters, e.g. ["nonzero_variance"] (dynamic sampling)."""
    max_failure_rate: float = Field(0.5, ge=0.0, le=1.0)
    """Failed episodes above this fraction fail the step."""
    over_sampling: float = Field(1.0, ge=1.0)
    """Groups started per missing group (>1 when filters drop many groups)."""


class EngineSection(Section):
    kind: Literal["local", "sglang"] = "local"
    """Embedded engine in the trainer process, or SGLang servers."""
    urls: list[str] = Field(default_factory=list)
    """SGLang server URLs to attach to (kind = "sglang")."""
    launch: Literal["none", "sglang", "palaestra"] = "none"
    """Start the servers of this run (kind = "sglang"), stopped when it ends: "sglang" runs
    ``python -m sglang.launch_server``, "palaestra" runs ``palaestra serve`` (the embedded engine
    in its own process), one per group of ``launch_tp`` GPUs of ``launch_gpus`` (one CPU server
    when that list is empty); they come in addition to ``urls``."""
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
    weight_sync: Literal["auto", "in_process", "distributed", "disk", "tensor"] = "auto"
    """How new weights reach the engines after each step. in_process: the embedded engine's
    tensors are overwritten; distributed: SGLang's weight-update group (NCCL broadcast, or gloo);
    disk: safetensors in ``sync_dir`` + /update_weights_from_disk; tensor: base64 safetensors
    over HTTP (palaestra serve only). auto: in_process for the embedded engine; for SGLang
    servers distributed over NCCL when CUDA is here, else disk."""
    sync_backend: Literal["nccl", "gloo"] = "nccl"
    """Collective of the distributed sync ("gloo" moves CPU tensors, e.g. to a CPU server)."""
    sync_master_address: str = "127.0.0.1"
    """This trainer's address as the servers reach it (rendezvous of the weight-update group)."""
    sync_master_port: int = Field(0, ge=0, le=65535)
    """Port of that rendezvous (0: any free port)."""
    sync_bucket_mb: int = Field(512, ge=1)
    """Size of one transfer bucket (a tensor larger than this goes alone)."""
    sync_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast floating weights to this dtype on the way (None: as trained), e.g. bfloat16 for
    SGLang servers in bf16."""
    sync_timeout_s: float = Field(600.0, gt=0.0)
    """How long forming the weight-update group and each broadcast may take."""
    sync_dir: str = "{out}/engine-weights"
    """Disk sync: a folder the servers can read ({out} is the run directory)."""


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
    """Optimizer steps per rollout batch (more than one makes PPO clipping matter)."""
    torch: TorchBackendConfig = Field(default_factory=TorchBackendConfig)
    """PyTorch backend settings (device, dtype, lr, micro-batching, ...)."""
    megatron: MegatronBackendConfig = Field(default_factory=MegatronBackendConfig)
    """Megatron-core backend settings (tp, pp, ep, dtype, lr, ...), for backend = "megatron"."""
    loss: LossConfig = Field(default_factory=lambda: LossConfig(preset="grpo"))
    """The objective (preset and coefficients)."""


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
    """Show a progress bar."""


class TrainConfig(Section):
    """The whole run."""

    algorithm: Literal["rl", "sft", "dpo"] = "rl"
    """RL from env rewards, or offline SFT / DPO on a dataset."""
    out: str = "runs/train"
    """Run directory (config.json, metrics.jsonl, eval.jsonl, checkpoints/, curves.png)."""
    seed: int = 0
    """Global seed."""
    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection = Field(default_factory=EnvSection)
    data: DataSection = Field(default_factory=DataSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    offline: OfflineSection = Field(default_factory=OfflineSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    benchmark_eval: BenchmarkEvalConfig = Field(default_factory=BenchmarkEvalConfig)
    """Benchmarks (``palaestra eval`` registry) evaluated every ``interval`` RL steps."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    services: ServicesSection = Field(default_factory=ServicesSection)
    """Processes the run starts beside itself (a retrieval server), stopped when it ends."""
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> TrainConfig:
        from palaestra.trainers.config_checks import config_problems, launch_problems

        problems = config_problems(self)
        if (info.context or {}).get("launch"):  # a run starts on this machine (not a dry run)
            problems += launch_problems(self)
        if problems:
            raise ConfigProblems(problems)
        return self
