"""Hugging Face model directories: the engine serves the built-in model saved as safetensors
exactly as it serves the GGUF, each supported architecture (random weights made here by
transformers) exactly as transformers runs it, and a bad checkpoint gets a message naming its
problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from distserve.cli import main as distserve
from shared.engine.config import EngineConfig, served_name
from shared.engine.engine import Engine
from shared.engine.hf_checkpoint import CheckpointError
from shared.engine.loader import LoadedModel, load
from shared.engine.meta import read_meta
from shared.engine.request import SamplingParams
from tests.engine.conftest import NEW_TOKENS, PROMPTS
from tests.model_dirs import (
    ARCHITECTURES,
    EOT,
    THINK,
    THINK_ID,
    hf_greedy,
    linked_with,
    write_gguf,
    write_random,
)

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
# token ids of varied lengths (the random models share SmolLM2's vocabulary)
IDS = [[(i * 7919 + j * 104729) % 49000 + 100 for j in range(5 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def random_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random")
    # qwen2 in shards of 2 MB: an index and at least two files
    return {arch: write_random(root / arch, arch, shard_kb=2000 if arch == "qwen2" else 0)
            for arch in ARCHITECTURES}


def greedy(loaded: LoadedModel, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(device="cpu"), loaded)
    return [r.output_ids for r in
            engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))]


def test_the_gguf_saved_as_a_directory_generates_the_same_tokens(
        smollm2_dir: Path, loaded: LoadedModel) -> None:
    from_dir = load(str(smollm2_dir), 0, CPU, torch.float32)
    gguf_tok, dir_tok = loaded[1], from_dir[1]
    assert gguf_tok is not None and dir_tok is not None
    assert dir_tok.eos_ids == gguf_tok.eos_ids and dir_tok.eos_token == "<|im_end|>"
    chats = [dir_tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert chats == [gguf_tok.apply_chat_template([{"role": "user", "content": p}])
                     for p in PROMPTS]
    ids = [dir_tok.encode(c) for c in chats]
    assert ids == [gguf_tok.encode(c) for c in chats]
    expected = greedy(loaded, ids, NEW_TOKENS)
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # real, varied continuations
    assert greedy(from_dir, ids, NEW_TOKENS) == expected
    assert from_dir[0].config.name == served_name(str(smollm2_dir)) == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architecture_generates_what_transformers_does(
        arch: str, random_dirs: dict[str, Path]) -> None:
    directory = random_dirs[arch]
    model, _ = loaded = load(str(directory), 0, CPU, torch.float32)
    assert model.config.architecture == arch
    if arch == "qwen2":
        assert len(list(directory.glob("*.safetensors"))) >= 2
        assert model.config.qkv_bias and model.config.tie_embeddings
    if arch == "qwen3":
        assert model.config.qk_norm and model.config.head_dim == 32
    if arch == "llama":
        assert model.config.rope_scaling is not None
    expected = hf_greedy(directory, IDS, 16)
    assert len({tuple(t) for t in expected}) == len(IDS)
    assert greedy(loaded, IDS, 16) == expected


def test_bf16_checkpoints_load_cast_to_the_engine_dtype(random_dirs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(str(random_dirs["mistral"]),
                                                 dtype=torch.bfloat16)
    model.save_pretrained(directory)
    shutil.copy(random_dirs["mistral"] / "tokenizer.json", directory)
    loaded, _ = load(str(directory), 0, CPU, torch.float32)
    assert loaded.embed.dtype == torch.float32
    assert torch.equal(loaded.embed, model.model.embed_tokens.weight.float())


def broken(source: Path, tmp_path: Path) -> Path:
    directory = tmp_path / source.name
    shutil.copytree(source, directory)
    return directory


def edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def test_bad_checkpoints_get_a_message_naming_the_problem(
        random_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases: dict[str, Path] = {}
    cases["architecture GPT2LMHeadModel is not supported"] = d = \
        broken(random_dirs["llama"], tmp_path / "arch")
    edit_config(d, architectures=["GPT2LMHeadModel"])
    cases["has no tokenizer.json"] = d = broken(random_dirs["llama"], tmp_path / "tok")
    (d / "tokenizer.json").unlink()
    cases["model-00002-of-00002.safetensors named in model.safetensors.index.json is missing"] \
        = d = broken(random_dirs["qwen2"], tmp_path / "shard")
    (d / "model-00002-of-00002.safetensors").unlink()
    cases["quantized checkpoints (gptq) are not supported"] = d = \
        broken(random_dirs["llama"], tmp_path / "quant")
    edit_config(d, quantization_config={"quant_method": "gptq", "bits": 4})
    cases["attention_bias (a bias on every attention projection) is not supported"] = d = \
        broken(random_dirs["llama"], tmp_path / "bias")
    edit_config(d, attention_bias=True)
    cases["config.json lacks 'hidden_size'"] = d = broken(random_dirs["llama"], tmp_path / "key")
    config = json.loads((d / "config.json").read_text())
    del config["hidden_size"]
    (d / "config.json").write_text(json.dumps(config))
    cases["is not a readable safetensors file"] = d = broken(random_dirs["mistral"],
                                                             tmp_path / "lfs")
    (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    cases["has no config.json"] = d = broken(random_dirs["llama"], tmp_path / "config")
    (d / "config.json").unlink()
    cases["RoPE scaling 'yarn' is not supported"] = d = broken(random_dirs["llama"],
                                                              tmp_path / "yarn")
    edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    # a weight stored as int8: the engine computes in floating point only
    cases["is I8; only F32, F16 and BF16 weights are supported"] = d = \
        broken(random_dirs["mistral"], tmp_path / "int8")
    from safetensors.torch import load_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cases["lacks 1 weight(s)"] = d = broken(random_dirs["mistral"], tmp_path / "missing")
    del tensors["model.norm.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    for message, directory in cases.items():
        with pytest.raises(CheckpointError) as error:
            read_meta(str(directory))
            load(str(directory), 0, CPU, torch.float32)
        assert message in str(error.value), (message, str(error.value))
        # the CLI: the message and exit code 2, never a traceback
        with pytest.raises(SystemExit) as exit_:
            distserve(["generate", "hello", "--model", str(directory), "--max-tokens", "2"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_files_generate_what_transformers_does(
        arch: str, random_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A Qwen model written as GGUF (F32) generates the tokens transformers does on the
    directory it was written from, and for qwen2 on the GGUF itself too (transformers' own
    GGUF reader; its qwen3 reader ignores a head size other than hidden / heads)."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(random_dirs[arch], tmp_path / f"{arch}.gguf", arch)
    model, tokenizer = loaded = load(str(path), 0, CPU, torch.float32)
    assert model.config.architecture == arch and tokenizer is not None
    assert (model.config.qkv_bias, model.config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    ours = greedy(loaded, IDS, 16)
    assert ours == hf_greedy(random_dirs[arch], IDS, 16)
    if arch == "qwen2":
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32)
        assert ours == [hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                    do_sample=False, pad_token_id=0,
                                    eos_token_id=None)[0, len(ids):].tolist() for ids in IDS]
    # the GGUF's user-defined token is one id, shown when decoding; its end-of-turn id stops a
    # generation; raw text starts with its BOS
    think = tokenizer.encode(f"a {THINK} b")
    assert THINK_ID in think and tokenizer.decode(think) == f"a {THINK} b"
    assert tokenizer.eos_ids == {2, EOT}
    assert tokenizer.encode("hi", add_special_tokens=True) == [1, *tokenizer.encode("hi")]
    # the qwen2 pre-tokenizer's regex: line breaks apart from the next line's indent (GPT-2's
    # keeps one space with them: "\n\n ", " c")
    assert [tokenizer.decode([i]) for i in tokenizer.encode("a  b\n\n  c")][-3:] == \
        ["\n\n", " ", " c"]


def test_every_eos_id_of_generation_config_ends_a_generation(smollm2_dir: Path,
                                                             tmp_path: Path) -> None:
    """generation_config.json may list several EOS ids (Llama 3 lists two): each ends it."""
    ids = [1, 4093, 1848, 314]  # any prompt
    loaded = load(str(smollm2_dir), 0, CPU, torch.float32)
    (free,) = greedy(loaded, [ids], 6)
    stop = next(i for i in range(1, 6) if free[i] not in free[:i])  # first new token after one
    directory = linked_with(smollm2_dir, tmp_path / "eos", {
        "generation_config.json": json.dumps({"eos_token_id": [2, free[stop]]})})
    model, tokenizer = load(str(directory), 0, CPU, torch.float32)
    assert tokenizer is not None and tokenizer.eos_ids == {2, free[stop]}
    engine = Engine(EngineConfig(device="cpu"), (model, tokenizer))
    (request,) = engine.generate([ids], SamplingParams(max_tokens=6))
    assert request.output_ids == free[:stop + 1] and request.finish_reason == "stop"
