"""The Qwen-style chat template of palaestra's local models (written for this project).

It follows the Qwen3 conventions: ``<|im_start|>role\\n...<|im_end|>``, tools listed in the system
turn inside ``<tools>``, calls as ``<tool_call>{json}</tool_call>``, tool results grouped in a user
turn inside ``<tool_response>``, and reasoning in ``<think>`` blocks, which (as in Qwen3) are dropped
from assistant turns that precede the last user query: re-rendering a conversation therefore
differs from the tokens the model actually produced, which is what the drift check detects.
"""

QWEN_STYLE_TEMPLATE = (
    # Rendered by transformers with trim_blocks: a newline right after a block tag is dropped,
    # so every newline that follows a tag is written as {{ '\n' }}.
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages and messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] in ['user', 'system'] %}"
    "<|im_start|>{{ m['role'] }}{{ '\n' }}{{ m['content'] }}<|im_end|>{{ '\n' }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}"
    "{% set reasoning = m.get('reasoning_content') or '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}"
    "{% endif %}"
    "<|im_start|>assistant{{ '\n' }}"
    "{% if reasoning and loop.index0 > ns.last_query %}"
    "<think>{{ '\n' }}{{ reasoning }}{{ '\n' }}</think>{{ '\n\n' }}"
    "{% endif %}"
    "{{ content }}"
    "{% for tc in m.get('tool_calls') or [] %}"
    "{% set fn = tc['function'] if tc['function'] is defined else tc %}"
    "{% if (loop.first and content) or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>{{ '\n' }}{\"name\": \"{{ fn['name'] }}\", \"arguments\": "
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "}{{ '\n' }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ '\n' }}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>{{ '\n' }}{{ m['content'] }}{{ '\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant{{ '\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{% endif %}"
    "{% endif %}"
)

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
