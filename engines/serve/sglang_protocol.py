"""SGLang's native HTTP schemas, as field tables, and checks of request bodies against them.

Read off SGLang's own source (``python/sglang/srt/managers/io_struct.py`` at commit
``001067fffe33427bee0ed2f007fb7551a1d76b44`` and ``python/sglang/srt/entrypoints/http_server.py``
at ``0025436eab0556737d615b36a4dd3e1e26e82f3d``, sglang 0.5.x): every request dataclass / msgspec
struct with its fields, and the keys the tokenizer manager puts into a ``/generate`` response.
`palaestra serve` validates bodies with `check_body`; `SGLangClient` only sends these fields; the
tests check both sides against these tables. Unknown keys are ignored, as SGLang's pydantic
models ignore them; known keys with a wrong JSON type are a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from palaestra.errors import ConfigError

SGLANG_IO_STRUCT_COMMIT = "001067fffe33427bee0ed2f007fb7551a1d76b44"
SGLANG_HTTP_SERVER_COMMIT = "0025436eab0556737d615b36a4dd3e1e26e82f3d"

# JSON type tags: "str", "int", "float" (int accepted), "bool", "list", "dict", "any"; a field is
# a tuple of accepted tags ("null" = None allowed).
FieldSpec = tuple[str, ...]

#: GenerateReqInput (dataclass; FastAPI body of /generate).
GENERATE_REQ_INPUT: dict[str, FieldSpec] = {
    "rid": ("str", "list", "null"),
    "session_id": ("str", "null"),
    "text": ("str", "list", "null"),
    "input_ids": ("list", "null"),
    "input_embeds": ("list", "null"),
    "image_data": ("any",), "video_data": ("any",), "audio_data": ("any",),
    "mm_hashes": ("list", "null"), "mm_content_hashes": ("list", "null"),
    "use_audio_in_video": ("bool",), "video_config": ("dict", "null"),
    "sampling_params": ("dict", "list", "null"),
    "return_logprob": ("bool", "list", "null"),
    "logprob_start_len": ("int", "list", "null"),
    "top_logprobs_num": ("int", "list", "null"),
    "token_ids_logprob": ("list", "null"),
    "return_sampling_mask": ("bool", "list", "null"),
    "return_text_in_logprobs": ("bool",),
    "return_flat_raw_top_logprobs": ("bool",), "return_flat_raw_top_logprobs_b64": ("bool",),
    "stream": ("bool",),
    "log_metrics": ("bool",),
    "return_hidden_states": ("bool", "str", "list"),
    "return_routed_experts": ("bool",), "routed_experts_start_len": ("int",),
    "return_indexer_topk": ("bool",),
    "modalities": ("list", "null"),
    "session_params": ("dict", "null"),
    "lora_path": ("str", "list", "null"), "lora_id": ("str", "list", "null"),
    "custom_logit_processor": ("str", "list", "null"),
    "positional_embed_overrides": ("any",),
    "bootstrap_host": ("any",), "bootstrap_port": ("any",), "bootstrap_room": ("any",),
    "bootstrap_pair_key": ("any",), "decode_tp_size": ("any",),
    "routed_dp_rank": ("int", "null"), "data_parallel_rank": ("int", "null"),
    "disagg_prefill_dp_rank": ("int", "null"), "kv_router_hint": ("dict", "null"),
    "routing_key": ("str", "null"), "conversation_id": ("str", "null"),
    "http_worker_ipc": ("str", "null"),
    "background": ("bool",), "require_reasoning": ("bool",),
    "max_thinking_tokens": ("int", "null"), "priority": ("int", "null"),
    "extra_key": ("str", "list", "null"), "no_logs": ("bool",),
    "custom_labels": ("dict", "null"), "return_bytes": ("bool",), "return_entropy": ("bool",),
    "return_prompt_token_ids": ("bool",), "external_trace_header": ("dict", "null"),
    "received_time": ("float", "null"), "need_wait_for_mm_inputs": ("bool", "null"),
    "num_items_assigned": ("dict", "null"), "encoder_urls": ("list", "null"),
    "max_dynamic_patch": ("int", "null"), "min_dynamic_patch": ("int", "null"),
    "image_max_dynamic_patch": ("int", "null"), "video_max_dynamic_patch": ("int", "null"),
    "images_config": ("dict", "null"), "multi_item_delimiter_indices": ("list", "null"),
    "cache_salt": ("str", "list", "null"),
}

#: SamplingParams (msgspec struct; the ``sampling_params`` object).
SAMPLING_PARAMS: dict[str, FieldSpec] = {
    "max_new_tokens": ("int", "null"), "stop": ("str", "list", "null"),
    "stop_token_ids": ("list", "null"), "stop_regex": ("str", "list", "null"),
    "temperature": ("float", "null"), "top_p": ("float", "null"), "top_k": ("int", "null"),
    "min_p": ("float", "null"), "frequency_penalty": ("float", "null"),
    "presence_penalty": ("float", "null"), "repetition_penalty": ("float", "null"),
    "min_new_tokens": ("int", "null"), "n": ("int", "null"), "json_schema": ("str", "null"),
    "regex": ("str", "null"), "ebnf": ("str", "null"), "structural_tag": ("str", "null"),
    "ignore_eos": ("bool", "null"), "skip_special_tokens": ("bool", "null"),
    "spaces_between_special_tokens": ("bool", "null"), "no_stop_trim": ("bool", "null"),
    "custom_params": ("dict", "null"), "stream_interval": ("int", "null"),
    "logit_bias": ("dict", "null"), "sampling_seed": ("int", "null"),
}

_BASE_REQ: dict[str, FieldSpec] = {"rid": ("str", "null"), "http_worker_ipc": ("str", "null")}

UPDATE_WEIGHT_FROM_DISK_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "model_path": ("str",), "load_format": ("str", "null"),
    "abort_all_requests": ("bool",), "weight_version": ("str", "null"), "is_async": ("bool",),
    "torch_empty_cache": ("bool",), "keep_pause": ("bool",), "recapture_cuda_graph": ("bool",),
    "token_step": ("int",), "flush_cache": ("bool",), "manifest": ("dict", "null"),
}
UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "serialized_named_tensors": ("list",), "load_format": ("str", "null"),
    "flush_cache": ("bool",), "abort_all_requests": ("bool",),
    "weight_version": ("str", "null"), "disable_draft_model": ("bool", "null"),
    "torch_empty_cache": ("bool",),
}
UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "names": ("list",), "dtypes": ("list",), "shapes": ("list",),
    "group_name": ("str",), "flush_cache": ("bool",), "abort_all_requests": ("bool",),
    "weight_version": ("str", "null"), "load_format": ("str", "null"),
    "torch_empty_cache": ("bool",),
}
INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "master_address": ("str",), "master_port": ("int",), "rank_offset": ("int",),
    "world_size": ("int",), "group_name": ("str",), "backend": ("str",),
}
GET_WEIGHTS_BY_NAME_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "name": ("str",), "truncate_size": ("int",),
}
DESTROY_WEIGHTS_UPDATE_GROUP_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "group_name": ("str",),
}
ABORT_REQ: dict[str, FieldSpec] = {
    **_BASE_REQ, "abort_all": ("bool",), "finished_reason": ("dict", "null"),
    "abort_message": ("str", "null"), "weight_versions": ("any",),
}
PAUSE_GENERATION_REQ_INPUT: dict[str, FieldSpec] = {**_BASE_REQ, "mode": ("str",)}
CONTINUE_GENERATION_REQ_INPUT: dict[str, FieldSpec] = {**_BASE_REQ, "torch_empty_cache": ("bool",)}
RELEASE_MEMORY_OCCUPATION_REQ_INPUT: dict[str, FieldSpec] = {**_BASE_REQ, "tags": ("list", "null")}
RESUME_MEMORY_OCCUPATION_REQ_INPUT: dict[str, FieldSpec] = {**_BASE_REQ, "tags": ("list", "null")}
UPDATE_WEIGHT_VERSION_REQ_INPUT: dict[str, FieldSpec] = {
    **_BASE_REQ, "new_version": ("str",), "abort_all_requests": ("bool",),
}

#: Required fields (no default in io_struct).
REQUIRED: dict[str, tuple[str, ...]] = {
    "UpdateWeightFromDiskReqInput": ("model_path",),
    "UpdateWeightsFromTensorReqInput": ("serialized_named_tensors",),
    "UpdateWeightsFromDistributedReqInput": ("names", "dtypes", "shapes"),
    "InitWeightsUpdateGroupReqInput": ("master_address", "master_port", "rank_offset",
                                       "world_size"),
    "UpdateWeightVersionReqInput": ("new_version",),
    "GetWeightsByNameReqInput": ("name",),
}

#: Keys of ``meta_info`` in a /generate response (tokenizer_manager._handle_batch_output and
#: _handle_abort_req, plus logprob_ops for return_logprob).
GENERATE_META_INFO_KEYS = frozenset({
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "total_retractions", "reasoning_tokens", "completion_tokens", "cached_tokens",
    "cached_tokens_details", "e2e_latency", "output_token_logprobs", "input_token_logprobs",
    "output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
    "input_token_ids_logprobs", "hidden_states", "dp_rank", "num_running_reqs",
    "num_waiting_reqs", "routed_experts",
})
#: Top-level keys of a non-streaming /generate response (BatchStrOutput branch).
GENERATE_RESPONSE_KEYS = frozenset({"text", "output_ids", "meta_info"})
#: Keys of SGLang's ``/model_info`` answer (``/get_model_info`` is its deprecated alias), read off
#: current SGLang's http_server.py (2026): the SGLang router reads ``model_type`` and
#: ``architectures`` from it when a worker registers.
MODEL_INFO_KEYS = frozenset({
    "model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "has_image_understanding", "has_audio_understanding", "model_type",
    "architectures",
})
#: Keys of ``/server_info`` (alias ``/get_server_info``) that SGLang's clients read: SGLang answers
#: its whole ``ServerArgs`` plus the scheduler's info; the router (``sglang-router``) parses
#: these from it when a worker registers.
SERVER_INFO_KEYS = frozenset({
    "model_path", "tokenizer_path", "served_model_name", "host", "port", "tp_size", "dp_size",
    "max_running_requests", "max_prefill_tokens", "context_length", "weight_version",
    "skip_tokenizer_init", "internal_states", "version",
})
#: Keys of one entry (one data-parallel rank) of ``/get_load``'s list, the load the SGLang router
#: polls from its workers.
LOAD_KEYS = frozenset({"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                       "num_pending_tokens", "ts_tic"})
#: finish_reason objects (schedule_batch.FINISH_*.to_json()).
FINISH_REASON_TYPES = {"stop": ("matched",), "length": ("length",), "abort": ("message",)}

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,),
    "dict": (dict,), "null": (type(None),),
}


def _type_ok(value: Any, spec: FieldSpec) -> bool:
    if "any" in spec:
        return True
    for tag in spec:
        types = _PY_TYPES[tag]
        if isinstance(value, bool) and tag in ("int", "float"):
            continue  # JSON true is not a number
        if isinstance(value, types):
            return True
    return False


def check_body(body: object, fields: Mapping[str, FieldSpec], name: str) -> dict[str, Any]:
    """Validate a JSON body against an io_struct field table; returns it as a dict.

    Raises `ConfigError` listing every problem (missing required fields, wrong JSON types).
    """
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError(f"{name}: the request body must be a JSON object")
    problems = [f"missing required field {f!r}" for f in REQUIRED.get(name, ()) if f not in body]
    for key, value in body.items():
        spec = fields.get(key)
        if spec is not None and not _type_ok(value, spec):
            problems.append(f"{key!r} must be {' or '.join(spec)}, got {type(value).__name__}")
    if problems:
        raise ConfigError(f"invalid {name}: " + "; ".join(problems))
    return body


__all__ = [
    "ABORT_REQ",
    "FINISH_REASON_TYPES",
    "GENERATE_META_INFO_KEYS",
    "GENERATE_REQ_INPUT",
    "GENERATE_RESPONSE_KEYS",
    "GET_WEIGHTS_BY_NAME_REQ_INPUT",
    "INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT",
    "LOAD_KEYS",
    "MODEL_INFO_KEYS",
    "SAMPLING_PARAMS",
    "SERVER_INFO_KEYS",
    "SGLANG_HTTP_SERVER_COMMIT",
    "SGLANG_IO_STRUCT_COMMIT",
    "UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT",
    "UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT",
    "UPDATE_WEIGHT_FROM_DISK_REQ_INPUT",
    "check_body",
]
