"""`SGLangClient`: one SGLang-compatible server (SGLang or `palaestra serve`) over SGLang's
native HTTP API.

``/generate`` with ``input_ids`` and ``return_logprob`` (the token ids and logprobs come back in
``meta_info.output_token_logprobs``), the weight-update, pause/continue, abort, flush and memory
endpoints, with timeouts and retries with exponential backoff. A connection error or a 5xx after
the retries raises `EngineUnavailableError` (a router then tries another server); a 4xx raises
`EngineError` with the server's message.

Tensors for ``/update_weights_from_tensor``: SGLang expects ``MultiprocessingSerializer``
payloads (CUDA IPC or shared-memory handles, same host; written by `ipc_payload` without sglang
installed) — ``tensor_format="sglang"``; `palaestra serve` takes those and base64 safetensors —
``tensor_format="safetensors"`` (the default). `IpcWeightSender` sends buckets of handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palaestra.engine import EngineUnavailableError, Generation, SamplingParams
from palaestra.errors import ConfigError, EngineError
from palaestra.trace_ranges import span

if TYPE_CHECKING:
    import aiohttp

_RETRY_STATUS = frozenset({500, 502, 503, 504})


def _version_of(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class SGLangClient:
    """An `Engine` over one SGLang-compatible server URL."""

    def __init__(self, url: str, *, request_timeout_s: float | None = 3600.0,
                 connect_timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.25,
                 tensor_format: str = "safetensors", tp_size: int = 1,
                 routed_experts: tuple[int, int] | None = None) -> None:
        """``routed_experts=(num_layers, top_k)`` of an MoE model: ask for SGLang's
        ``return_routed_experts`` (the server needs ``--enable-return-routed-experts``) and
        hand them back as ``Generation.meta["routed_experts"]`` ``[positions, layers, top_k]``."""
        if tensor_format not in ("safetensors", "sglang"):
            raise ConfigError("tensor_format must be 'safetensors' or 'sglang'")
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.tensor_format = tensor_format
        self.tp_size = tp_size
        self.routed_experts = routed_experts
        self._version = 0
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._rids: dict[str, str] = {}  # caller's request id -> rid of the attempt in flight
        self._legacy_info = False  # the server knows /get_model_info, not /model_info

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    @property
    def weight_version(self) -> int:
        return self._version

    # -------------------------------------------------------------------------------- HTTP
    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s,
                                            sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
            self._session_loop = loop
        return self._session

    async def request(self, method: str, path: str, payload: Any = None, *,
                      retries: int | None = None, timeout_s: float | None = None) -> Any:
        """One call with retries; returns the decoded JSON (or text) of a 2xx answer."""
        import aiohttp

        attempts = 1 + (self.retries if retries is None else retries)
        last: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                kw: dict[str, Any] = {}
                if payload is not None:
                    kw["json"] = payload
                if timeout_s is not None:
                    kw["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
                async with self._client().request(method, self.url + path, **kw) as resp:
                    body = await resp.read()
                    if resp.status in _RETRY_STATUS:
                        last = EngineUnavailableError(
                            f"{self.url}{path} answered {resp.status}: {_message(body)}")
                        continue
                    if resp.status >= 400:
                        raise EngineError(
                            f"{self.url}{path} rejected the request ({resp.status}): "
                            f"{_message(body)}")
                    if not body:
                        return None
                    if resp.content_type == "application/json":
                        import json

                        return json.loads(body)
                    return body.decode(errors="replace")
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                last = exc
        raise EngineUnavailableError(
            f"{self.url}{path} failed after {attempts} attempt(s): "
            f"{type(last).__name__}: {last}; is the server running?"
        ) from last

    # ----------------------------------------------------------------------------- protocol
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       request_id: str | None = None, session_id: str | None = None,
                       lora: str | None = None) -> Generation:
        """``lora`` names an adapter loaded with `load_lora_adapter` (SGLang's ``lora_path``)."""
        ids = [int(t) for t in input_ids]
        base = request_id or f"sgl-{time.monotonic_ns():x}"
        last: BaseException | None = None
        for attempt in range(1 + self.retries):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            rid = base if attempt == 0 else f"{base}-retry{attempt}"
            self._rids[base] = rid
            payload = {"input_ids": ids, "sampling_params": sampling.to_sglang(),
                       "return_logprob": True, "rid": rid}
            if self.routed_experts is not None:
                payload["return_routed_experts"] = True
            if lora is not None:
                payload["lora_path"] = lora
            try:
                with span("http_serialization"):  # the round trip (finer causes win inside)
                    out = await self.request("POST", "/generate", payload, retries=0)
            except EngineUnavailableError as exc:
                last = exc
                continue
            finally:
                self._rids.pop(base, None)
            return self._parse_generation(out, len(ids))
        raise EngineUnavailableError(f"{self.url} failed to generate: {last}") from last

    def _parse_generation(self, out: Any, prompt_len: int) -> Generation:
        try:
            meta = out["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            token_ids = out.get("output_ids")
            if token_ids is None:
                token_ids = [int(p[1]) for p in pairs]
            logprobs = [float(p[0]) for p in pairs]
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type") if isinstance(finish, dict) else str(finish)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(f"{self.url}/generate answered an invalid payload: {exc!r}") from exc
        if len(logprobs) != len(token_ids) or reason not in ("stop", "length", "abort"):
            raise EngineError(
                f"{self.url}/generate answered {len(token_ids)} tokens, {len(logprobs)} logprobs "
                f"and finish_reason {finish!r}; expected one logprob per token"
            )
        version = _version_of(meta.get("weight_version"), self._version)
        extra: dict[str, Any] = {}
        if self.routed_experts is not None and meta.get("routed_experts") is not None:
            from palaestra.engines.local.moe import decode_routed_experts

            extra["routed_experts"] = decode_routed_experts(meta["routed_experts"],
                                                            *self.routed_experts)
        return Generation(
            token_ids=tuple(int(t) for t in token_ids), logprobs=tuple(logprobs),
            finish_reason=reason, weight_version=version,
            prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            meta={"id": meta.get("id"), "finish_reason": finish, "engine": self.url,
                  "e2e_latency": meta.get("e2e_latency"), **extra},
        )

    async def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]] | None
                             = None, *, path: str | None = None, version: int | None = None) -> None:
        if (state_dict is None) == (path is None):
            raise EngineError("update_weights takes exactly one of state_dict or path")
        new = self._version + 1 if version is None else int(version)
        if path is not None:
            out = await self.request("POST", "/update_weights_from_disk", {
                "model_path": str(path), "weight_version": str(new), "flush_cache": True})
        else:
            payload = self._serialize(state_dict)  # type: ignore[arg-type]
            out = await self.request("POST", "/update_weights_from_tensor", {
                "serialized_named_tensors": [payload] * self.tp_size, "load_format": None,
                "flush_cache": True, "weight_version": str(new)})
        if not (isinstance(out, dict) and out.get("success")):
            raise EngineError(f"{self.url} did not update its weights: {out}")
        self._version = new

    def _serialize(self, named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
        if self.tensor_format == "safetensors":
            from palaestra.engines.weights.tensor_payload import encode_named_tensors

            return encode_named_tensors(named)
        from palaestra.engines.weights.ipc_payload import encode_ipc_named_tensors

        # the handles stay valid while the tensors live: this call awaits the answer, and the
        # caller's state dict holds the CUDA tensors (CPU ones are shared copies, kept by torch
        # until the server let go of its mapping)
        payload, _ = encode_ipc_named_tensors(named.items() if isinstance(named, Mapping)
                                              else named)
        return payload

    async def update_weights_from_tensor(self, payload: str, *, version: int,
                                         flush_cache: bool = False,
                                         load_format: str | None = None,
                                         timeout_s: float | None = None) -> dict[str, Any]:
        """One ``/update_weights_from_tensor`` bucket: ``payload`` (one serialised entry) for
        every TP rank, generation not aborted (the caller paused it); SGLang's answer."""
        out = await self.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [payload] * self.tp_size, "load_format": load_format,
            "flush_cache": flush_cache, "abort_all_requests": False,
            "weight_version": str(version)}, retries=0, timeout_s=timeout_s)
        if isinstance(out, dict) and out.get("success"):
            self._version = int(version)
        return out  # type: ignore[no-any-return]

    # ------------------------------------------------------ weight-update groups (NCCL / gloo)
    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False
                                ) -> dict[str, str]:
        """``/load_lora_adapter``: serve the peft folder ``path`` (on the server's disk) as
        ``name``; returns the server's loaded adapters (name -> path)."""
        out = await self.request("POST", "/load_lora_adapter",
                                 {"lora_name": name, "lora_path": str(path), "pinned": pinned},
                                 retries=0)
        return self._lora_result(out, f"load LoRA adapter {name!r}")

    async def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """``/unload_lora_adapter``; returns the adapters still loaded."""
        out = await self.request("POST", "/unload_lora_adapter", {"lora_name": name}, retries=0)
        return self._lora_result(out, f"unload LoRA adapter {name!r}")

    def _lora_result(self, out: Any, what: str) -> dict[str, str]:
        if not (isinstance(out, dict) and out.get("success")):
            raise EngineError(f"{self.url} could not {what}: "
                              f"{out.get('error_message') if isinstance(out, dict) else out}")
        loaded = out.get("loaded_adapters") or {}
        return {str(k): str(v.get("lora_path", v) if isinstance(v, dict) else v)
                for k, v in loaded.items()}

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str = "nccl", timeout_s: float = 600.0
                                        ) -> dict[str, Any]:
        """Ask the server to join a weight-update group (answers once the group formed)."""
        return await self.request("POST", "/init_weights_update_group", {  # type: ignore[no-any-return]
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, retries=0, timeout_s=timeout_s)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              version: int, flush_cache: bool = False,
                                              timeout_s: float = 600.0) -> dict[str, Any]:
        """Announce one bucket; the caller broadcasts its tensors (in this order) meanwhile."""
        out = await self.request("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": str(version)}, retries=0, timeout_s=timeout_s)
        if isinstance(out, dict) and out.get("success"):
            self._version = int(version)
        return out  # type: ignore[no-any-return]

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self.request("POST", "/destroy_weights_update_group",  # type: ignore[no-any-return]
                                  {"group_name": group_name}, retries=0)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of a weight (HF name), for checks."""
        return await self.request("GET", "/get_weights_by_name",  # type: ignore[no-any-return]
                                  {"name": name, "truncate_size": truncate_size})

    async def flush_cache_quietly(self) -> bool:
        """Flush the prefix cache; False when the server declined (requests still running)."""
        try:
            await self.request("POST", "/flush_cache", retries=0)
        except EngineError:
            return False
        return True

    async def pause(self, mode: str = "in_place") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        if request_ids is None:
            await self.request("POST", "/abort_request", {"abort_all": True})
            return
        for rid in request_ids:
            await self.request("POST", "/abort_request", {"rid": self._rids.get(rid, rid)})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.request("POST", "/release_memory_occupation",
                           {"tags": list(tags) if tags else None})

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation",
                           {"tags": list(tags) if tags else None})

    async def get_model_info(self) -> dict[str, Any]:
        out = await self._info("model_info")
        if isinstance(out, dict):
            self._version = _version_of(out.get("weight_version"), self._version)
        return out  # type: ignore[no-any-return]

    async def get_server_info(self) -> dict[str, Any]:
        return await self._info("server_info")  # type: ignore[no-any-return]

    async def _info(self, name: str) -> Any:
        """``GET /<name>`` (current SGLang's name; its ``/get_<name>`` is deprecated there), or
        ``/get_<name>`` from a server that answers 404 to it (SGLang before the rename)."""
        if not self._legacy_info:
            try:
                return await self.request("GET", f"/{name}")
            except EngineUnavailableError:
                raise
            except EngineError as exc:
                if "(404)" not in str(exc):
                    raise
                self._legacy_info = True
        return await self.request("GET", f"/get_{name}")

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", retries=0, timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            with contextlib.suppress(RuntimeError):  # a session of a closed loop
                await self._session.close()
        self._session = None


def _message(body: bytes) -> str:
    import json

    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(data.get("message", data))
    return str(data)[:500]


__all__ = ["SGLangClient"]
