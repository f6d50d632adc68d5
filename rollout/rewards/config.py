"""``[[rewards]]`` and ``[reward_worker]``: reward sources beside the env's reward (torch-free).

    [[rewards]]                      # a Bradley-Terry reward model (palaestra train algorithm = "rm")
    kind = "classifier"
    path = "runs/rm/final-model"
    weight = 1.0

    [[rewards]]                      # an LLM judge with a rubric, over an OpenAI-compatible API
    kind = "judge"
    engine = "openai"
    url = "http://127.0.0.1:30000/v1"
    model = "judge"
    template = "Rate the answer from 0 to 10. ... {conversation} ... Reply 'Score: N'."
    weight = 0.1                     # a 0-10 score weighted down to 0-1

    [[rewards]]                      # the env's own reward (implicit when no [[rewards]] is given)
    kind = "env"

The episode's reward is the weighted sum of the parts; ``per = "turn"`` scores every assistant
turn (the conversation up to it) and lands in ``Sample.turn_rewards``; episode parts are added to
the last turn, so the turn rewards always sum to the reward.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from palaestra.config import Section
from palaestra.errors import PalaestraError

#: metric names `summarize` already writes under ``reward/``
RESERVED_NAMES = frozenset({"mean", "std", "total"})


class RewardError(PalaestraError, RuntimeError):
    """A reward source could not score an episode (the episode fails with this reason)."""


class RewardSourceConfig(Section):
    """One reward source of ``[[rewards]]``."""

    kind: Literal["classifier", "judge", "env"]
    """classifier: a sequence-classification reward model (one scalar); judge: a generative
    model asked with a rubric prompt, its score parsed from the reply; env: the env's reward."""
    name: str | None = None
    """Name of the part in metrics (``reward/<name>``) and samples (default: the kind)."""
    weight: float = 1.0
    """Multiplier of this part in the episode's reward."""
    per: Literal["episode", "turn"] = "episode"
    """Score the whole episode once, or every assistant turn (the conversation up to it)."""
    # ----- classifier
    path: str | None = None
    """classifier: a Hugging Face ``AutoModelForSequenceClassification`` checkpoint (with its
    tokenizer); judge with engine = "local": the judge's causal LM checkpoint."""
    device: str = "cpu"
    """Device of a model this process loads (classifier, or judge with engine = "local")."""
    max_length: int = Field(4096, ge=2)
    """classifier: longest rendered conversation in tokens (longer ones fail the episode)."""
    batch_size: int = Field(32, ge=1)
    """Conversations per forward pass (classifier) or requests in flight (judge)."""
    # ----- judge
    engine: Literal["local", "palaestra", "sglang", "openai"] = "openai"
    """judge: "local" embeds an engine on ``path``; "palaestra" / "sglang" talk to a running
    ``palaestra serve`` / SGLang server at ``url`` through its native /generate API (token ids,
    the prompt rendered with ``tokenizer``'s chat template); "openai" any OpenAI-compatible chat
    API at ``url`` (``palaestra serve``, SGLang's /v1, vLLM, a hosted API)."""
    url: str | None = None
    """judge: server URL (``http://host:port`` for palaestra/sglang, ``.../v1`` for openai)."""
    model: str = "default"
    """judge, openai: the model name sent to the API."""
    api_key_env: str | None = None
    """judge, openai: environment variable holding the API key (None: no key)."""
    tokenizer: str | None = None
    """judge, palaestra/sglang: tokenizer (path) whose chat template renders the prompt
    (default: ``path``)."""
    template: str | None = None
    """judge: the rubric prompt; ``{conversation}`` (the transcript), ``{prompt}`` (the first
    user message), ``{response}`` (the last assistant message) are filled in."""
    system: str | None = None
    """judge: an optional system message before the rubric."""
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """judge: regular expression whose first group is the score (the last match counts)."""
    min_score: float = 0.0
    """judge: lowest valid score (a parsed score outside [min_score, max_score] fails)."""
    max_score: float = 10.0
    """judge: highest valid score."""
    max_new_tokens: int = Field(256, ge=1)
    """judge: reply budget."""
    temperature: float = Field(0.0, ge=0.0)
    """judge: sampling temperature (0: greedy)."""

    @property
    def part_name(self) -> str:
        return self.name or self.kind

    @model_validator(mode="after")
    def _fields_of_kind(self) -> RewardSourceConfig:
        problems = []
        name = self.part_name
        if "/" in name or not name or name in RESERVED_NAMES:
            problems.append(f"name {name!r}: use a plain word without '/', not one of "
                            f"{sorted(RESERVED_NAMES)} (it becomes the metric reward/<name>)")
        if self.kind == "classifier" and not self.path:
            problems.append("kind = 'classifier' needs path (a sequence-classification "
                            "checkpoint, e.g. the final-model of an algorithm = 'rm' run)")
        if self.kind == "judge":
            if not self.template:
                problems.append("kind = 'judge' needs template (the rubric prompt, with "
                                "{conversation} or {prompt}/{response} in it)")
            if self.engine == "local" and not self.path:
                problems.append("judge engine = 'local' needs path (the judge's checkpoint)")
            if self.engine != "local" and not self.url:
                problems.append(f"judge engine = {self.engine!r} needs url")
            if self.engine in ("palaestra", "sglang") and not (self.tokenizer or self.path):
                problems.append(f"judge engine = {self.engine!r} sends token ids: set tokenizer "
                                "(or path) to the judge's tokenizer")
            if self.min_score >= self.max_score:
                problems.append(f"min_score ({self.min_score}) must be below max_score "
                                f"({self.max_score})")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RewardWorkerSection(Section):
    """Where the reward sources run and how long a score may take."""

    placement: Literal["auto", "inline", "actor"] = "auto"
    """inline: in the rollout workers' process (small models; with rollout.cluster = "local" one
    instance serves every worker); actor: one Ray actor that every worker sends its episodes to
    (its own device or CPU); auto: actor when rollout.cluster = "ray", else inline."""
    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs of the reward actor (set the sources' device to "cuda" then)."""
    num_cpus: float = Field(1.0, gt=0.0)
    """CPUs of the reward actor."""
    max_batch: int = Field(64, ge=1)
    """Episodes scored together (across workers' episodes finishing at about the same time)."""
    linger_s: float = Field(0.01, ge=0.0)
    """After the first episode arrives, wait this long for more to batch with it."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Longest one source may take for one batch (then it is retried)."""
    retries: int = Field(2, ge=0)
    """Retries of a failed or timed-out score before the episode fails."""
    retry_backoff_s: float = Field(0.5, ge=0.0)
    """Wait before a retry (doubled each time)."""


def check_sources(sources: list[RewardSourceConfig]) -> list[str]:
    """Problems across ``[[rewards]]`` entries (duplicate names)."""
    names = [s.part_name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        return [f"[[rewards]] names must be unique; {dup} appear more than once (set name = ...)"]
    return []


__all__ = ["RESERVED_NAMES", "RewardError", "RewardSourceConfig", "RewardWorkerSection",
           "check_sources"]
