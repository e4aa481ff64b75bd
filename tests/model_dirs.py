"""Hugging Face model directories made in the tests (nothing can be downloaded here): the
built-in SmolLM2 GGUF saved as safetensors with its tokenizer and chat template, and small
random-weight models of each architecture the engine serves, saved by transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shared.engine.gguf_loader import resolve_gguf_path
from shared.engine.meta import read_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 49152  # SmolLM2's: the random models share its tokenizer
# the GGUFs' user-defined token (in place of the control token <empty_output>, which no merge
# uses) and end-of-turn id
THINK, THINK_ID, EOT = "<think>", 16, 5
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             initializer_range=0.2)  # large weights: logits far apart, no greedy ties
ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Llama 3.1-style: RoPE scaled (the band blended within this small context), untied head
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
                  tie_word_embeddings=False),
    "mistral": dict(sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),  # Q/K/V bias
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),  # per-head Q/K norm, wider heads
}


def write_smollm2(directory: Path) -> Path:
    """The built-in GGUF as a Hugging Face directory: a GGUF-loaded model refuses
    save_pretrained, so its state dict goes into a model built from its config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_gguf_path("smollm2-135m")
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if hasattr(model.config, "quantization_config"):  # the weights saved are fp32, not GGUF's
        del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(directory)
    return directory


def linked_with(source: Path, directory: Path, files: dict[str, str]) -> Path:
    """`directory` made of `source`'s files, linked, except `files` (name: text), written:
    a model directory that differs in a file or two, without copying its weights."""
    directory.mkdir()
    for file in source.iterdir():
        if file.name not in files:
            (directory / file.name).symlink_to(file)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def write_random(directory: Path, arch: str, shard_kb: int = 0, tokenizer: Path | None = None,
                 **shape: Any) -> Path:
    """A small random-weight model of `arch`, saved by transformers (in shards of `shard_kb`
    KB when given), with SmolLM2's tokenizer (the GGUF's, or a copy of its `tokenizer.json`
    where the GGUF is not at hand); `shape` overrides the config's sizes."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    torch.manual_seed(0)
    config = config_class(**(SMALL | ARCHITECTURES[arch] | shape))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:  # not transformers' ones and zeros: the test must see
        attention = layer.self_attn  # them applied
        if arch == "qwen3":
            attention.q_norm.weight.data.uniform_(0.5, 1.5)
            attention.k_norm.weight.data.uniform_(0.5, 1.5)
        if arch == "qwen2":
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
                projection.bias.data.uniform_(-1.0, 1.0)
    model.save_pretrained(directory, max_shard_size=f"{shard_kb}KB" if shard_kb else "5GB")
    if tokenizer is None:
        read_tokenizer("smollm2-135m")._tokenizer.save(str(directory / "tokenizer.json"))
    else:
        shutil.copyfile(tokenizer, directory / "tokenizer.json")
    return directory


def hf_greedy(directory: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.requires_grad_(False)
    out = []
    for ids in prompts:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
        out.append(generated[0, len(ids):].tolist())
    return out


def write_gguf(source: Path, path: Path, arch: str) -> Path:
    """A random `write_random` model of a Qwen architecture as a GGUF file, named as
    llama.cpp's own gguf-py maps Hugging Face tensors (Qwen's Q/K rows are not permuted), F32,
    with SmolLM2's vocabulary under the `qwen2` pre-tokenizer, its token 16 a user-defined
    `<think>` (as Qwen3's), an end-of-turn id besides EOS and a BOS added to raw text."""
    import gguf
    from transformers import AutoModelForCausalLM

    from shared.engine.gguf_loader import (
        CONTROL_TOKEN_TYPE,
        USER_DEFINED_TOKEN_TYPE,
        read_gguf_tokenizer,
    )

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = read_gguf_tokenizer("smollm2-135m")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    names = [THINK if i == THINK_ID else t for i, t in enumerate(tokens.tokens)]
    writer.add_token_list(names)
    writer.add_token_types([USER_DEFINED_TOKEN_TYPE if i == THINK_ID else CONTROL_TOKEN_TYPE
                            if t in tokens.special_tokens else 1 for i, t in enumerate(names)])
    writer.add_token_merges(tokens.merges)
    writer.add_eos_token_id(tokens.eos_id)
    writer.add_eot_token_id(EOT)
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(True)
    if tokens.chat_template:
        writer.add_chat_template(tokens.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
