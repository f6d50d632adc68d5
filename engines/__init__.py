"""Generation engines: token ids in, token ids + logprobs out (the `Engine` protocol is core's,
`palaestra.engine`).

- `LocalEngine` (embedded; CPU or CUDA): own generation loop, continuous batching, prefix reuse,
  exact logprobs, in-process weight updates. ``palaestra serve`` puts it behind SGLang's native
  HTTP API and an OpenAI-compatible API.
- `SGLangEngine` / `SGLangClient`: SGLang servers (launched or attached) over that native API.
- `Router`: least-outstanding routing with sticky sessions and failover over several engines.
- `OpenAIEngine`: API models at the message level, for evaluation (not token-exact).

Importing this package is light: the engines load torch, transformers or aiohttp when built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from palaestra.engine import (
    Engine,
    EngineUnavailableError,
    Generation,
    SamplingParams,
)

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.engines.local.local import (
        LocalEngine as LocalEngine,
    )
    from palaestra.engines.local.request import (
        StreamChunk as StreamChunk,
    )
    from palaestra.engines.clients.openai_engine import (
        OpenAIEngine as OpenAIEngine,
    )
    from palaestra.engines.clients.router import (
        Router as Router,
    )
    from palaestra.engines.local.sampling import (
        token_logprobs as token_logprobs,
    )
    from palaestra.engines.clients.scripted import (
        ScriptedEngine as ScriptedEngine,
    )
    from palaestra.engines.clients.sglang import (
        SGLangClient as SGLangClient,
    )
    from palaestra.engines.clients.sglang import (
        SGLangEngine as SGLangEngine,
    )
    from palaestra.engines.clients.sglang import (
        SGLangServerConfig as SGLangServerConfig,
    )

_LAZY = {
    "LocalEngine": "palaestra.engines.local.local",
    "StreamChunk": "palaestra.engines.local.request",
    "SGLangClient": "palaestra.engines.clients.sglang",
    "SGLangEngine": "palaestra.engines.clients.sglang",
    "SGLangServerConfig": "palaestra.engines.clients.sglang",
    "Router": "palaestra.engines.clients.router",
    "OpenAIEngine": "palaestra.engines.clients.openai_engine",
    "token_logprobs": "palaestra.engines.local.sampling",
    "ScriptedEngine": "palaestra.engines.clients.scripted",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["Engine", "EngineUnavailableError", "Generation", "SamplingParams", *sorted(_LAZY)]
