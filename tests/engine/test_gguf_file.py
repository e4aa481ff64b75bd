"""Our GGUF header reader reads what gguf-py's reader does: every metadata type, plain and
quantized tensors (a file gguf-py writes), and the built-in model's file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from shared.engine import meta
from shared.engine.config import LLAMA_SHAPES
from shared.engine.gguf_file import GgufFile
from shared.engine.gguf_loader import resolve_gguf_path


def assert_reads_as_gguf_py(path: Path) -> GgufFile:
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items()
                           if not k.startswith("GGUF.")}  # gguf-py's header entries
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape) == (b.tensor_type, tuple(int(d) for d in b.shape))
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data)
    return ours


def test_every_metadata_type_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 64), dtype=np.float32)
    writer.add_tensor("f32", weights)
    writer.add_tensor("f16", weights.astype(np.float16))
    writer.add_tensor("vector", weights[0])
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        writer.add_tensor(kind.name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_reads_as_gguf_py(path)
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.strs"] == ["a", "", "ünï"]
    assert ours.fields["t.f32"] == pytest.approx(0.1)
    assert np.array_equal(ours.tensors[0].data, weights)
    assert ours.tensors[3].data.shape == (4, 68)  # two Q8_0 blocks of 34 bytes a row


def test_the_builtin_models_file_reads_as_gguf_py_reads_it() -> None:
    ours = assert_reads_as_gguf_py(resolve_gguf_path("smollm2-135m"))
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufFile(path)
    whole = resolve_gguf_path("smollm2-135m").read_bytes()[:1 << 16]
    path.write_bytes(whole[:5000])  # inside the tokenizer's strings
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GgufFile(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("general.alignment", 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a power of two"):
        GgufFile(path)


def test_the_smollm2_shape_is_the_built_in_models_shape() -> None:
    """`smollm2-135m-shape` stands in for the built-in GGUF where the file cannot go (a lent
    machine): its step times hold for the model only if the shapes are the same."""
    built_in = meta.read_config("smollm2-135m")
    shape = LLAMA_SHAPES["smollm2-135m-shape"]
    assert dataclasses.replace(shape, name=built_in.name) == dataclasses.replace(
        built_in, rms_norm_eps=shape.rms_norm_eps)
    assert shape.rms_norm_eps == pytest.approx(built_in.rms_norm_eps)
