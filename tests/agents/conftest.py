"""Fixtures of the agent tests: the tiny Qwen-style tokenizer (trained once per session), a
Llama-3-style variant of it, and a scripted "engine" that turns text into a `Generation`."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest

from palaestra.engine import Generation

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]

# A Llama-3.1-style template written for these tests: tools in the first user message, custom
# tool calls rendered as {"name": ..., "parameters": <tojson>}, tool results as "ipython", and,
# like Meta's template, an error for more than one tool call in a message.
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}"
    "{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}{{ system }}<|eot_id|>"
    "{% for m in rest %}"
    "{% if m['role'] == 'user' and tools and loop.first %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its "
    'proper arguments that best answers the given prompt.\n\nRespond in the format {"name": '
    'function name, "parameters": dictionary of argument name and its value}.\n\n'
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{{ m['content'] | trim }}<|eot_id|>"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% if m['tool_calls'] | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{% set fn = m['tool_calls'][0]['function'] %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ fn[\'name\'] }}", "parameters": {{ fn[\'arguments\'] | tojson }}}<|eot_id|>'
    "{% elif m['role'] in ['tool', 'ipython'] %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="session")
def calculator_tools():
    """The real OpenAI tool schemas of the calculator env."""
    from palaestra.envs.calculator import CalculatorEnv

    return CalculatorEnv().tool_schemas()


@pytest.fixture(scope="session")
def tokenizer():
    from palaestra.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def llama_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(path)
    return path


Sampler = Callable[..., Generation]


@pytest.fixture
def sample_text(tokenizer) -> Sampler:
    """Script one generation: ``text`` tokenized on its own (+ the end token), fixed logprobs."""
    return make_sampler(tokenizer, "<|im_end|>")


@pytest.fixture
def sample_llama(llama_tokenizer) -> Sampler:
    return make_sampler(llama_tokenizer, "<|eot_id|>")


def make_sampler(tok, end_token: str) -> Sampler:
    end_id = tok.convert_tokens_to_ids(end_token)

    def sample(
        text: str,
        *,
        version: int = 0,
        end: bool = True,
        end_id: int = end_id,
        finish_reason: str | None = None,
    ) -> Generation:
        ids = list(tok.encode(text, add_special_tokens=False)) + ([end_id] if end else [])
        logprobs = tuple(-0.01 * (i + 1) - 0.001 * version for i in range(len(ids)))
        reason = finish_reason or ("stop" if end else "length")
        return Generation(tuple(ids), logprobs, reason, weight_version=version)

    return sample
