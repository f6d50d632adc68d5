"""Scripted policies and faulty envs for rollout tests and benchmarks (picklable, so they reach
Ray workers, which import this module by name).

- `CalculatorPolicy`: a `ScriptedEngine` script for ``palaestra/Calculator-v0`` that reads the
  question from the input ids, calls the calculator tool ``n_calls`` times, then answers, right
  with probability ``p_correct`` (drawn from the request's seeded RNG, so groups have reward
  variance and a seeded run is reproducible).
- `FlakyCalculatorEnv` (``palaestra-test/FlakyCalculator-v0``): the calculator env whose steps
  raise with probability ``fail_rate`` and hang with probability ``hang_rate``, decided by a hash
  of (episode seed, turn) so the same episode fails the same way every time.
- `scripted_router`: a `Router` over canned calculator engines (the benchmark's instant engine).
- `serve_processes`: real ``palaestra serve`` processes of a model on loopback, healthy, stopped
  on exit (the servers of tests that need some).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.envs.base import StepResult
from palaestra.envs.calculator import CalculatorEnv, _format_number, evaluate_arithmetic
from palaestra.types import Message

if TYPE_CHECKING:
    from palaestra.engines.clients.server_process import ServerProcess

FLAKY_ENV_ID = "palaestra-test/FlakyCalculator-v0"
FLAKY_ENTRY = f"palaestra.rollout.testing:{FLAKY_ENV_ID}"
_QUESTION = re.compile(r"What is ([0-9+\-*/() ]+)\?")


def _tokenizer(path: str) -> Any:
    from palaestra.agents import load_tokenizer

    return load_tokenizer(path)


class CalculatorPolicy:
    """Script for ``ScriptedEngine``: tool call(s), then an answer that is right at random."""

    def __init__(self, tokenizer_path: str, *, p_correct: float = 0.5, n_calls: int = 1) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.p_correct = p_correct
        self.n_calls = n_calls
        self._tok: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, input_ids: Sequence[int], rng: random.Random) -> list[int]:
        tok = self._tok = self._tok or _tokenizer(self.tokenizer_path)
        marker = tok.convert_tokens_to_ids("<tool_response>")
        end = tok.convert_tokens_to_ids("<|im_end|>")
        text = tok.decode(list(input_ids), skip_special_tokens=False)
        found = _QUESTION.findall(text)
        expression = found[-1].strip() if found else "1 + 1"
        if list(input_ids).count(marker) < self.n_calls:
            call = {"name": "calculator", "arguments": {"expression": expression}}
            reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            value = evaluate_arithmetic(expression)
            if rng.random() >= self.p_correct:
                value += 1
            reply = f"The answer is <answer>{_format_number(value)}</answer>"
        return [*tok.encode(reply, add_special_tokens=False), end]


def canned_calculator_turns(tokenizer_path: str) -> tuple[list[int], list[int], int]:
    """(tool-call ids, answer ids, ``<tool_response>`` id) for `ScriptedEngine.by_marker`."""
    tok = _tokenizer(tokenizer_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    answer = "The answer is <answer>42</answer>"
    return (
        [*tok.encode(call, add_special_tokens=False), end],
        [*tok.encode(answer, add_special_tokens=False), end],
        tok.convert_tokens_to_ids("<tool_response>"),
    )


def scripted_router(tokenizer_path: str, n_engines: int = 2, latency_s: float = 0.0) -> Any:
    """A `Router` over ``n_engines`` canned calculator engines (tool call, then "42")."""
    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.scripted import ScriptedEngine

    call, answer, marker = canned_calculator_turns(tokenizer_path)
    engines = [
        ScriptedEngine.by_marker([call, answer], marker, latency_s=latency_s, name=f"scripted-{i}")
        for i in range(n_engines)
    ]
    return Router(engines, health_interval_s=0)


@contextlib.contextmanager
def serve_processes(model: str | Path, count: int, log_dir: str | Path, *,
                    extra: Sequence[str] = ("--threads", "1"),
                    env: Mapping[str, str] | None = None,
                    timeout_s: float = 120.0) -> Iterator[list[ServerProcess]]:
    """``count`` CPU ``palaestra serve`` processes of ``model`` (logs ``serve-<i>.log`` in
    ``log_dir``), started together and healthy on entry, stopped on exit (a synchronous caller:
    a test fixture)."""
    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.server_process import wait_all_ready

    procs = [serve_process(model, device="cpu", extra=extra, env=env,
                           log_path=Path(log_dir) / f"serve-{i}.log") for i in range(count)]
    try:
        asyncio.run(wait_all_ready(procs, timeout_s))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


class FlakyCalculatorEnv(CalculatorEnv):
    """The calculator env with steps that raise or hang, deterministically per (seed, turn)."""

    def __init__(self, *, fail_rate: float = 0.1, hang_rate: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_rate = fail_rate
        self.hang_rate = hang_rate
        self.episode_seed = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.episode_seed = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def _draw(self) -> float:
        digest = hashlib.sha1(f"{self.episode_seed}:{self.turn}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    async def aon_action(self, action: Message) -> StepResult:
        x = self._draw()
        if x < self.fail_rate:
            raise RuntimeError(f"flaky env failed on turn {self.turn}")
        if x < self.fail_rate + self.hang_rate:
            await asyncio.sleep(3600)
        return await super().aon_action(action)


#: registered by `palaestra.envs.registry.lookup` when a task names ``FLAKY_ENTRY``
PALAESTRA_ENVS = {FLAKY_ENV_ID: "palaestra.rollout.testing:FlakyCalculatorEnv"}

__all__ = [
    "FLAKY_ENTRY",
    "FLAKY_ENV_ID",
    "CalculatorPolicy",
    "FlakyCalculatorEnv",
    "canned_calculator_turns",
    "scripted_router",
    "serve_processes",
]
