"""Read a Hugging Face model directory: `config.json`, the weights in `*.safetensors` (one file
or shards named by `model.safetensors.index.json`), the tokenizer (`tokenizer.json`), its chat
template (`tokenizer_config.json` or `chat_template.jinja`) and the EOS ids
(`generation_config.json`). Weights are read lazily from the memory-mapped files, one tensor
at a time, so loading holds one copy of the model, not two."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from shared.engine.config import ModelConfig, RopeScaling
from shared.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:  # torch is loaded by reading a tensor (safetensors' "pt"), not to read the
    import torch  # config or the tokenizer: the gateway and the planner do only that

# architecture in config.json -> the Llama-family variant the engine runs it as
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
WEIGHT_DTYPES = {"F32", "F16", "BF16"}
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A model directory the engine cannot serve; the message names the problem."""


def is_model_dir(model: str) -> bool:
    return Path(model).is_dir()


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _rope(raw: dict[str, Any], max_context: int) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling: transformers 5 writes `rope_parameters` (with the base
    inside), older checkpoints `rope_theta` and `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(params["factor"]), float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings", max_context)))
    raise CheckpointError(f"RoPE scaling {kind!r} is not supported (default, linear, llama3)")


def read_config(directory: Path, name: str) -> ModelConfig:
    try:
        return _config(directory, name)
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json lacks {e}") from e
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{directory}/config.json holds a value of the wrong kind: {e}") \
            from e


def _config(directory: Path, name: str) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a Hugging Face model "
                              "directory")
    raw = _json(path)
    architectures = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{directory}: architecture {', '.join(architectures) or '?'} is "
                              f"not supported ({', '.join(ARCHITECTURES)})")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{directory}: quantized checkpoints ({method}) are not supported; "
                              "use a bf16, fp16 or fp32 checkpoint")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias"):
        raise CheckpointError(f"{directory}: only SiLU MLPs without bias are supported")
    if arch != "qwen2" and raw.get("attention_bias"):  # a bias on O too, which we lack
        raise CheckpointError(f"{directory}: attention_bias (a bias on every attention "
                              "projection) is not supported")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    max_context = int(raw.get("max_position_embeddings", 4096))
    theta, scaling = _rope(raw, max_context)
    # transformers' MistralConfig windows at 4096 where config.json does not say
    window = raw.get("sliding_window", 4096 if arch == "mistral" else None)
    if window and raw.get("use_sliding_window", arch == "mistral") and window < max_context:
        max_context = int(window)  # within the window, attention is full attention
    return ModelConfig(
        name=name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=max_context,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        architecture=arch,
    )


def engine_name(hf: str) -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `layers.3.q_proj` (None: not a weight the
    engine uses, such as a stored rotary table)."""
    parts = hf.removeprefix("model.").split(".")
    if parts[0] in ("embed_tokens", "norm", "lm_head") and parts[-1] == "weight":
        return parts[0]
    if parts[0] != "layers" or len(parts) < 4:
        return None
    layer, module, kind = parts[1], parts[-2], parts[-1]
    if kind == "bias" and module in ("q_proj", "k_proj", "v_proj"):
        return f"layers.{layer}.{module[0]}_bias"
    if kind == "weight" and module != "rotary_emb":
        return f"layers.{layer}.{module}"
    return None


def _shards(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the file that holds it."""
    index = directory / INDEX
    if index.is_file():
        files: dict[str, Path] = {}
        for tensor, file in _json(index).get("weight_map", {}).items():
            path = directory / file
            if not path.is_file():
                raise CheckpointError(f"{directory}: shard {file} named in {INDEX} is missing")
            files[tensor] = path
        return files
    single = directory / "model.safetensors"
    if not single.is_file():
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        raise CheckpointError(f"{directory}: no model.safetensors and no {INDEX}" +
                              (f" (found {', '.join(found)})" if found else ""))
    with _opened(single) as f:
        return dict.fromkeys(f.keys(), single)


def _opened(path: Path) -> Any:
    """The safetensors file open, or a CheckpointError where it is not one (a truncated
    download, a Git LFS pointer)."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


class CheckpointWeights(Mapping[str, "torch.Tensor"]):
    """The engine's weight names over the safetensors files: a tensor is read from its
    memory-mapped file when asked for, in the file's dtype."""

    def __init__(self, directory: Path) -> None:
        self._where = {name: (path, hf) for hf, path in _shards(directory).items()
                       if (name := engine_name(hf)) is not None}

    def __getitem__(self, name: str) -> torch.Tensor:
        path, hf = self._where[name]
        # a handle per tensor: the file's pages are mapped only while the tensor lives, so a
        # load holds one tensor of the checkpoint at a time, not all it has read
        with _opened(path) as handle:
            try:
                dtype = handle.get_slice(hf).get_dtype()
                tensor: torch.Tensor = handle.get_tensor(hf)
            except SafetensorError as e:
                raise CheckpointError(f"{path.name}: tensor {hf} cannot be read: {e}") from e
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {hf} is {dtype}; only F32, F16 and "
                                  "BF16 weights are supported")
        return tensor  # in the file's dtype: the model casts it as it places it

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def expected_weights(config: ModelConfig) -> list[str]:
    names = ["embed_tokens", "norm"] + ([] if config.tie_embeddings else ["lm_head"])
    per_layer = ["input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj"]
    per_layer += ["q_bias", "k_bias", "v_bias"] if config.qkv_bias else []
    per_layer += ["q_norm", "k_norm"] if config.qk_norm else []
    return names + [f"layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer]


def read_weights(directory: Path, config: ModelConfig) -> tuple[ModelConfig, CheckpointWeights]:
    """The weights, and the config corrected where the files say more than config.json (a
    checkpoint without `lm_head` ties it to the embeddings)."""
    weights = CheckpointWeights(directory)
    if "lm_head" not in weights:
        config = dataclasses.replace(config, tie_embeddings=True)
    missing = [n for n in expected_weights(config) if n not in weights]
    if missing:
        raise CheckpointError(f"{directory}: the checkpoint lacks {len(missing)} weight(s) a "
                              f"{config.architecture} model needs, e.g. {missing[0]}")
    return config, weights


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as its text or as {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def read_tokenizer(directory: Path) -> TextTokenizer:
    """The tokenizer with its chat template, BOS and EOS text, and every id that ends a
    generation (generation_config.json's, config.json's and the EOS token's)."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no tokenizer.json (the engine reads the fast "
                              "tokenizer's file; a tokenizer.model alone is not supported)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception on a malformed file
        raise CheckpointError(f"{file} cannot be read: {e}") from e
    config_file = directory / "tokenizer_config.json"
    config = _json(config_file) if config_file.is_file() else {}
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    stop: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            stop += _ids(_json(directory / name).get("eos_token_id"))
    eos_id = None if eos is None else tokenizer.token_to_id(eos)
    if eos_id is not None:
        stop.insert(0, eos_id)
    if eos is None and stop:
        eos = tokenizer.id_to_token(stop[0])
    return TextTokenizer(tokenizer, chat_template=_chat_template(directory, config),
                         bos_token=bos, eos_token=eos, eos_ids=list(dict.fromkeys(stop)))
