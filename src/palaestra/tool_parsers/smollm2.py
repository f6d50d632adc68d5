"""SmolLM2-Instruct tool calls: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

SmolLM2-Instruct was tuned on function-calling data (APIGen) in one format, the one its model card
documents: the system turn lists the tools as a JSON array inside ``<tools></tools>`` after a
fixed instruction, and the model answers with a JSON *array* of calls inside one ``<tool_call>``
block (``[]`` when no call is needed). The chat template shipped with the model (its GGUF and its
tokenizer) renders no tools, so `SMOLLM2_TOOLS_TEMPLATE` is the ChatML template extended with that
system turn; tool results go back as a user turn inside ``<tool_response>``.

The parser keeps the whole text as the message content, and the template renders structured
calls only for a message whose content holds none (demonstrations), so a re-render of a sampled
turn is the text the model wrote, token for token. It also accepts one bare object instead of an
array (Hermes style), which small models often write. Anything it cannot decode becomes a call
with ``parse_error`` set, which the env answers with an error observation.
"""

from __future__ import annotations

import json

from palaestra.tool_parsers.common import guess_name, split_reasoning, tag_blocks
from palaestra.types import Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

#: the instruction SmolLM2-Instruct's function-calling data put in the system turn (model card)
TOOLS_INSTRUCTION = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions.\nBased on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose.\nIf none of the functions can be used, point it out and refuse to "
    "answer.\nIf the given question lacks the parameters required by the function, also point it "
    "out.\n\nYou have access to the following tools:\n<tools>"
)
TOOLS_FORMAT = (
    "</tools>\n\nThe output MUST strictly adhere to the following format, and NO other text MUST "
    "be included.\nThe example format is as follows. Please make sure the parameter type is "
    "correct. If no function call is needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": '
    '"value2"}},\n... (more tool calls as required)\n]</tool_call>'
)

SMOLLM2_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n" + TOOLS_INSTRUCTION.replace("\n", "{{ '\\n' }}") + "["
    "{% for t in tools %}{{ (t['function'] if t['function'] is defined else t) | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]"
    + TOOLS_FORMAT.replace("\n", "{{ '\\n' }}") +
    "{% if messages and messages[0]['role'] == 'system' %}{{ '\\n\\n' }}"
    "{{ messages[0]['content'] }}{% endif %}<|im_end|>{{ '\\n' }}"
    "{% elif messages and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first and tools %}"
    "{% elif m['role'] == 'tool' %}"
    "<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m['content'] }}{{ '\\n' }}"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}"
    "<|im_start|>assistant{{ '\\n' }}{{ content }}"
    # structured calls (demonstrations, API messages) in the model's array form; a sampled turn
    # already holds its calls in the text and is rendered as written
    "{% if m.get('tool_calls') and '<tool_call>' not in content %}<tool_call>["
    "{% for tc in m['tool_calls'] %}{% set fn = tc['function'] if tc['function'] is defined "
    "else tc %}{\"name\": \"{{ fn['name'] }}\", \"arguments\": {% if fn['arguments'] is string %}"
    "{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</tool_call>{% endif %}"
    "<|im_end|>{{ '\\n' }}"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] or '' }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


class SmolLM2Parser:
    """Parser of SmolLM2-Instruct's tool-call format (a JSON array in ``<tool_call>``)."""

    name = "smollm2"

    def parse(self, text: str) -> Message:
        reasoning, body = split_reasoning(text)
        calls: list[ToolCall] = []
        for inner, closed in tag_blocks(body, TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
            calls.extend(_decode_block(inner, closed, len(calls)))
        return Message(
            role="assistant", content=body.strip(), tool_calls=tuple(calls),
            reasoning_content=reasoning,
        )


def _error(raw: str, index: int, why: str) -> ToolCall:
    return ToolCall(name=guess_name(raw), arguments=raw, id=f"call_{index}", parse_error=why)


def _decode_block(inner: str, closed: bool, first: int) -> list[ToolCall]:
    raw = inner.strip()
    if not closed:
        return [_error(raw, first, f"unclosed {TOOL_CALL_OPEN} tag: end the calls with "
                                   f"{TOOL_CALL_CLOSE}")]
    try:
        value = json.loads(raw)
    except ValueError as exc:
        return [_error(raw, first, f"invalid JSON in {TOOL_CALL_OPEN}: {exc}; write a JSON list "
                                   'of {"name": ..., "arguments": {...}} objects')]
    items = value if isinstance(value, list) else [value]
    calls = []
    for offset, item in enumerate(items):
        index = first + offset
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            calls.append(_error(json.dumps(item), index, 'each call must be an object with a "name" '
                                'string: {"name": ..., "arguments": {...}}'))
            continue
        args = item.get("arguments", item.get("parameters", {}))
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(ToolCall(name=item["name"], arguments=arguments, id=f"call_{index}"))
    return calls


__all__ = [
    "SMOLLM2_TOOLS_TEMPLATE",
    "TOOLS_FORMAT",
    "TOOLS_INSTRUCTION",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "SmolLM2Parser",
]
