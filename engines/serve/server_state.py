"""What the handlers of `palaestra serve` share: `ServerState` (the engine, its tokenizer, the
options, the tokenizer thread, the requests in flight) and the JSON body and response helpers
every route module uses (`http_server` for SGLang's API, `openai_api`, `completions_api`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from palaestra.errors import ConfigError
from palaestra.engines.serve.serve_guard import ServeOptions
from palaestra.engines.serve.serve_requests import (
    BadRequest,
    ServeLimits,
)

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.contracts import Tokenizer
    from palaestra.engines.local.local import LocalEngine

T = TypeVar("T")


@dataclass
class ServerState:
    """What the handlers share: the engine, its tokenizer, the served model's names, the options,
    the tokenizer thread and the count of requests in flight (for a graceful shutdown)."""

    engine: LocalEngine
    tokenizer: Tokenizer
    model_name: str
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    options: ServeOptions = field(default_factory=ServeOptions)
    started: float = field(default_factory=time.time)
    weight_label: str | None = None  # a non-numeric /update_weight_version label
    weight_groups: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (group, device)
    draining: bool = False  # SIGTERM came: new requests are refused with 503
    aborting: bool = False  # the grace period ended: in-flight requests were aborted
    inflight: int = 0
    streaming: set[int] = field(default_factory=set)  # ids of requests whose stream has begun
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _idle: asyncio.Event | None = None
    _cpu: asyncio.Semaphore | None = None
    _chars_per_token: int | None = None

    @property
    def weight_version(self) -> str:
        return self.weight_label or str(self.engine.weight_version)

    @property
    def limits(self) -> ServeLimits:
        return self.options.limits

    @property
    def context(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab(self) -> int:
        return int(self.engine.decoder.config.vocab_size)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer thread: tokenizing, rendering, detokenizing and parsing
        big bodies never hold up the event loop (``/health`` stays fast)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="palaestra-serve-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def call(self, heavy: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: on the tokenizer thread when ``heavy``, else here.

        Small work stays on the event loop on purpose: a thread hop makes the loop wait for the
        GIL at each of its socket calls while the worker runs (the GIL convoy), which costs more
        than the microseconds of a small request. Big bodies and long outputs go to the thread.
        """
        if heavy:
            return await self.run(fn, *args)
        return fn(*args)

    async def compute(self, heavy: bool, fn: Callable[..., T], *args: Any) -> T:
        """`call` within one of a few CPU slots: a burst of requests is validated and answered
        a few at a time, so each turn of the event loop stays short and ``/health`` (which takes
        no slot) is answered between them instead of after the whole burst."""
        if self._cpu is None:
            self._cpu = asyncio.Semaphore(CPU_SLOTS)
        async with self._cpu:
            return await self.call(heavy, fn, *args)

    def warm_up(self) -> None:
        """First-use costs paid before serving (the vocabulary scan, the template's compile),
        not by the first request on the event loop."""
        self._chars_per_token = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        if getattr(self.tokenizer, "chat_template", None):
            with contextlib.suppress(Exception):  # a template may refuse a lone user message
                self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                   add_generation_prompt=True, tokenize=False)

    def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "text"
               ) -> list[int]:
        """Token ids of ``text``, refused unread when it cannot fit the context."""
        if self._chars_per_token is None:  # no token decodes to more characters than this
            self._chars_per_token = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        if len(text) > self.context * self._chars_per_token:
            raise BadRequest(f"the {param} has {len(text)} characters, more than the context of "
                             f"{self.context} tokens can hold.", param, "context_length_exceeded")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def track(self, delta: int) -> None:
        if self._idle is None:
            self._idle = asyncio.Event()
        self.inflight += delta
        if self.inflight == 0:
            self._idle.set()
        else:
            self._idle.clear()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight finished within ``timeout_s``."""
        if self.inflight == 0:
            return True
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


SHUTDOWN_MESSAGE = "the server is shutting down; retry on another server"
HEAVY_BODY_BYTES = 1 << 16  # bodies above this are parsed and validated on the tokenizer thread
HEAVY_TOKENS = 4096  # outputs above this many tokens are detokenized there
CPU_SLOTS = 8  # requests validated or answered in one turn of the event loop


def heavy_body(request: web.Request) -> bool:
    """Whether the body is big enough to be parsed and validated off the event loop."""
    size = request.content_length
    return size > HEAVY_BODY_BYTES if size is not None else request.can_read_body


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    """SGLang's ErrorResponse body."""
    from aiohttp import web

    body = {"object": "error", "message": message, "type": HTTPStatus(status).phrase,
            "param": param, "code": status}
    return web.json_response(body, status=status)


def json_bytes(payload: bytes, status: int = 200) -> web.Response:
    """A JSON response from bytes serialised on the tokenizer thread."""
    from aiohttp import web

    return web.Response(body=payload, status=status, content_type="application/json")


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"the request body is not valid JSON: {name} is not a JSON number")


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"the request body is not valid JSON: {exc}") from exc


async def read_json(request: web.Request, state: ServerState) -> Any:
    """The JSON body within the route's size limit (big bodies are parsed off the event loop)."""
    from palaestra.engines.serve.serve_guard import read_body

    if not request.can_read_body:
        return None
    raw = await read_body(request, state.options.body_limit(request.path))
    if not raw.strip():
        return None
    return await state.call(len(raw) > HEAVY_BODY_BYTES, _loads, raw)
