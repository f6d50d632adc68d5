"""Build the evaluated policy from ``--engine local|sglang|openai`` and check it can be reached.

- ``local``: ``--model PATH`` of a Hugging Face checkpoint, run by the embedded `LocalEngine`.
- ``sglang``: ``--model URL[,URL...]`` of running SGLang (or ``palaestra serve``) servers, behind
  the router; the tokenizer is ``--tokenizer`` or the server's own (``/get_model_info``).
- ``openai``: ``--model NAME`` at ``--base-url`` (default ``$OPENAI_BASE_URL`` or OpenAI's),
  with the key from the variable ``--api-key-env`` names (default ``OPENAI_API_KEY``); a loopback
  server needs no key.

Every problem found here (unreachable server, missing key, missing checkpoint) is raised before any
episode starts, with what to do about it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from palaestra.errors import ConfigError, EngineError

ENGINES = ("local", "sglang", "openai")
#: fields of SGLang's /get_model_info that may give the context length
_CONTEXT_KEYS = ("max_context_length", "context_length")
DEFAULT_OPENAI_URL = "https://api.openai.com/v1"


@dataclass(frozen=True)
class BackendOptions:
    """The engine-related flags of `palaestra eval`."""

    engine: str
    model: str
    tokenizer: str | None = None
    family: str = "qwen"
    max_context: int = 4096
    enable_thinking: bool | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    rpm: float | None = None
    retries: int = 6
    timeout_s: float = 600.0
    device: str | None = None
    model_name: str | None = None  # the name samples are keyed by (default: from --model)


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127.")


def _get_json(url: str, timeout_s: float = 10.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read().decode() or "null")
    except urllib.error.HTTPError as exc:
        raise EngineError(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineError(
            f"cannot reach {url} ({reason}); start the server (SGLang, or `palaestra serve "
            "--model PATH --port N`) or fix --model"
        ) from None


def _local(opts: BackendOptions) -> Any:
    from palaestra.agents import load_tokenizer
    from palaestra.benchmarks.policies import TokenPolicy
    from palaestra.engines.local.local import LocalEngine

    path = Path(opts.model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model {opts.model!r} is not a model folder (no config.json); pass a Hugging Face "
            "checkpoint directory (`palaestra init-model` writes a tiny one)"
        )
    kwargs: dict[str, Any] = {}
    if opts.device:
        kwargs["device"] = opts.device
    engine = LocalEngine(str(path), **kwargs)
    tokenizer = load_tokenizer(opts.tokenizer or str(path))
    return TokenPolicy(
        engine,
        tokenizer,
        model=opts.model_name or str(path.resolve()),
        family=opts.family,
        # an episode never asks for more context than the model has (it ends as truncated)
        max_context=min(opts.max_context, int(getattr(engine, "max_model_len", opts.max_context))),
        enable_thinking=opts.enable_thinking,
        owns_engine=True,
    )


def _sglang(opts: BackendOptions) -> Any:
    urls = [u.strip().rstrip("/") for u in opts.model.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise ConfigError(
            f"--engine sglang needs --model http://HOST:PORT (comma-separated for several), got "
            f"{opts.model!r}"
        )
    infos = [_get_json(f"{u}/get_model_info") for u in urls]  # reachable, before any work

    from palaestra.agents import load_tokenizer
    from palaestra.benchmarks.policies import RetryingEngine, TokenPolicy
    from palaestra.engines.clients.sglang import SGLangEngine

    paths = {str((i or {}).get("model_path", "")) for i in infos}
    tokenizer_path = opts.tokenizer or str((infos[0] or {}).get("tokenizer_path") or "") or next(
        iter(paths)
    )
    if not tokenizer_path:
        raise ConfigError(
            "the server did not say where its tokenizer is; pass --tokenizer PATH (the model folder)"
        )
    # one server: a client; several: SGLang's sticky least-load router with failover
    engine = RetryingEngine(SGLangEngine(urls), retries=opts.retries, rpm=opts.rpm, name=urls[0])
    limits = [int(i[k]) for i in infos for k in _CONTEXT_KEYS if isinstance((i or {}).get(k), int)]
    max_context = min([opts.max_context, *limits])
    name = opts.model_name or (next(iter(paths)) if len(paths) == 1 and "" not in paths else opts.model)
    return TokenPolicy(
        engine,
        load_tokenizer(tokenizer_path),
        model=name,
        family=opts.family,
        max_context=max_context,
        enable_thinking=opts.enable_thinking,
        owns_engine=True,
    )


def _openai(opts: BackendOptions) -> Any:
    from palaestra.benchmarks.openai_chat import OpenAIChat
    from palaestra.benchmarks.policies import ChatPolicy

    base_url = (opts.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_OPENAI_URL).rstrip("/")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must be an http(s) URL, got {base_url!r}")
    key = os.environ.get(opts.api_key_env, "")
    if not key:
        if not _is_loopback(base_url):
            raise ConfigError(
                f"no API key for {base_url}: set the environment variable {opts.api_key_env} "
                "(or name another one with --api-key-env)"
            )
        key = "EMPTY"  # local servers (palaestra serve, vLLM, SGLang) accept any key
    chat = OpenAIChat(base_url, opts.model, key, timeout_s=opts.timeout_s, retries=opts.retries, rpm=opts.rpm)
    return ChatPolicy(chat, model=opts.model_name or opts.model)


def build_policy(opts: BackendOptions) -> Any:
    """The policy for these options; raises `ConfigError`/`EngineError` with the fix."""
    if opts.engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {ENGINES}, got {opts.engine!r}")
    return {"local": _local, "sglang": _sglang, "openai": _openai}[opts.engine](opts)


__all__ = ["ENGINES", "BackendOptions", "build_policy"]
