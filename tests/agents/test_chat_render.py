"""The rollout's own render and encode paths equal the tokenizer's: `render_chat` gives the text
``apply_chat_template`` gives, and `TokenCodec` (piecewise, cached) the ids ``encode`` gives."""

from __future__ import annotations

import copy
import random

import pytest

from palaestra.agents.chat_render import plain_tools, render_chat
from palaestra.agents.codec import TokenCodec
from palaestra.agents.renderers import get_renderer
from palaestra.types import Message, ToolCall


def _conversations() -> list[list[Message]]:
    call = ToolCall("calculator", '{"expression": "6 * 7"}', id="call_0_0")
    return [
        [Message("user", "What is 6 * 7?")],
        [Message("system", "Be brief."), Message("user", "Hi  there\n\n")],
        [Message("system", "Use tools."), Message("user", "What is 6 * 7?"),
         Message("assistant", "", tool_calls=(call,)),
         Message("tool", "42", tool_call_id="call_0_0", name="calculator"),
         Message("assistant", "It is <answer>42</answer>.")],
        [Message("user", "Think."), Message("assistant", "Done.", reasoning_content="6*7=42"),
         Message("user", "Again?")],
    ]


@pytest.mark.parametrize("family", ["qwen", "llama3"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", [None, False])
def test_render_chat_equals_apply_chat_template(family, with_tools, thinking, tokenizer,
                                                llama_tokenizer, calculator_tools):
    tok = tokenizer if family == "qwen" else llama_tokenizer
    renderer = get_renderer(family)
    tools = [dict(t) for t in calculator_tools] if with_tools else None
    extra = {} if thinking is None else {"enable_thinking": thinking}
    for conversation in _conversations():
        if family == "llama3" and any(m.reasoning_content for m in conversation):
            continue
        data = renderer.template_messages(conversation)
        for prompt in (False, True):
            fast = render_chat(tok, data, tools=tools, add_generation_prompt=prompt,
                               chat_template=None, template_kwargs=extra)
            slow = tok.apply_chat_template(copy.deepcopy(data), tools=tools, tokenize=False,
                                           add_generation_prompt=prompt, **extra)
            assert fast is not None
            assert fast == slow
            # an agent's tools, converted once per episode, render the same
            once = render_chat(tok, data, tools=plain_tools(tools) if tools else None,
                               add_generation_prompt=prompt, chat_template=None,
                               template_kwargs=extra)
            assert once == slow


def test_render_chat_declines_what_it_does_not_render(tokenizer):
    data = [{"role": "user", "content": "hi"}]
    assert render_chat(object(), data, tools=None, add_generation_prompt=True,
                       chat_template=None, template_kwargs={}) is None
    assert render_chat(tokenizer, [], tools=None, add_generation_prompt=True,
                       chat_template=None, template_kwargs={}) is None
    assert render_chat(tokenizer, data, tools=[len], add_generation_prompt=True,  # a callable
                       chat_template=None, template_kwargs={}) is None


def _texts(tok) -> list[str]:
    specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>"]
    pieces = ["system\nYou are careful.", " What is 12 * (3 + 4)?", "\n\n", "  ", "42",
              "héllo wörld ✓", "\t tabs\tand  spaces ", "<answer>7</answer>", "", "x"]
    rng = random.Random(0)
    out = [tok.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}],
                                   tokenize=False, add_generation_prompt=True)]
    for _ in range(300):
        out.append("".join(rng.choice(pieces + specials) for _ in range(rng.randint(1, 9))))
    return out


def test_codec_equals_encode_and_caches_pieces(tokenizer):
    codec = TokenCodec(tokenizer)
    assert codec.piecewise
    for _ in range(2):  # the second round reads the cached pieces
        for text in _texts(tokenizer):
            assert codec.encode(text) == tokenizer.encode(text, add_special_tokens=False), text
    ids = codec.encode("<|im_start|>user\nhi<|im_end|>")
    assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False)


def test_codec_follows_tokens_added_later(tokenizer):
    tok = copy.deepcopy(tokenizer)
    codec = TokenCodec(tok)
    text = "say <|newtok|> now"
    assert codec.encode(text) == tok.encode(text, add_special_tokens=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|newtok|>"]})
    assert codec.encode(text) == tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|newtok|>") in codec.encode(text)


def test_codec_encodes_position_dependent_tokenizers_whole():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"▁a": 0, "a": 1, "▁": 2, "<s>": 3, "[UNK]": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # SentencePiece-style: "▁" before the first word only
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, additional_special_tokens=["<s>"])
    codec = TokenCodec(tok)
    assert not codec.piecewise
    for text in ("a<s>a", "a a<s> a", "<s>a"):
        assert codec.encode(text) == tok.encode(text, add_special_tokens=False)
