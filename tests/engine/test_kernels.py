"""The compiled kernels: a build killed half-way does not leave later processes waiting on
its lock; a build is never loaded on a CPU lacking the instructions it was built for; the
float matmul over panels computes x @ W^T at every remainder of its tiles; a layer's fused
small operations compute what torch's do; the AVX2 and the portable builds compute what the
torch reference does."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.kernels import OWN_HEADER, SOURCES, build_name, cpu_flags, source_text

LOAD = """
from torch.utils.cpp_extension import _get_build_directory
from shared.engine.kernels import cpu_kernels
print(cpu_kernels() is not None)
"""


@pytest.mark.timeout(900)
def test_a_stale_build_lock_is_removed_not_waited_on() -> None:
    from torch.utils.cpp_extension import _get_build_directory

    name = build_name(platform.machine(), "native", cpu_flags())
    subprocess.run([sys.executable, "-c", LOAD], check=True, timeout=800)  # built, cached
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()  # what a builder killed mid-build leaves behind
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300)  # torch alone would wait on it for ever
    assert done.stdout.strip() == "True", done.stderr
    assert "left by a build that was killed" in done.stderr
    assert not lock.exists()


AVX512_HOST = {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


def test_a_native_build_is_named_by_the_cpu_it_was_built_on() -> None:
    on_avx512 = build_name("x86_64", "native", AVX512_HOST)
    assert build_name("x86_64", "native", sorted(AVX512_HOST)) == on_avx512  # order aside
    # an AVX2-only CPU (AMD EPYC of some hosts here) must build its own, not load this one
    assert build_name("x86_64", "native", AVX512_HOST - {"avx512f", "avx512bw", "avx512vl"}) \
        != on_avx512
    assert build_name("x86_64", "native", AVX512_HOST | {"amx_tile"}) != on_avx512
    assert build_name("aarch64", "native", AVX512_HOST) != on_avx512
    # a named target runs on any CPU that has it: one build, whatever CPU built it
    assert build_name("x86_64", "x86-64-v3", AVX512_HOST) == \
        build_name("x86_64", "x86-64-v3", {"avx2"}) == "distserve_kernels_x86_64_x86_64_v3"
    assert cpu_flags() or platform.system() != "Linux"


def test_the_build_needs_no_path_so_every_checkout_shares_it() -> None:
    """vec.h's text goes first and the sources' #include of it goes: no include path among
    the build's arguments (torch's cache key), which made two checkouts rebuild in turn. The
    sources include the ATen headers they use, not <torch/extension.h>."""
    header, *rest = [source_text(source) for source in SOURCES]
    assert SOURCES[0].name == "vec.h" and header == SOURCES[0].read_text().rstrip("\n")
    for source, text in zip(SOURCES[1:], rest, strict=True):
        assert OWN_HEADER in source.read_text() and OWN_HEADER not in text
        assert "#include <ATen/core/Tensor.h>" in text  # the ATen headers it uses stay
        assert "torch/extension.h" not in text  # the whole C++ frontend: most of a build


def test_every_kernel_variant_the_tuning_benchmark_names_still_applies() -> None:
    """benchmarks/kernel_variants.py changes constants in the sources by their text: each
    text must occur exactly once, or the variant would silently be the base."""
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "kernel_variants.py"
    spec = importlib.util.spec_from_file_location("kernel_variants", path)
    assert spec is not None and spec.loader is not None
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    base, march = variants.variant_texts("base")
    assert march == "native"
    for name, changes in variants.VARIANTS.items():
        texts, _ = variants.variant_texts(name)
        assert (texts != base) == bool(changes), name
        if name in variants.AVX512_ONLY:  # its AVX2 build would be the base
            with pytest.raises(ValueError, match="AVX-512 tile only"):
                variants.variant_texts(f"{name}_avx2")
        else:
            assert variants.variant_texts(f"{name}_avx2") == (texts, "x86-64-v3")
    with pytest.raises(ValueError, match="no variant 'kc7'"):
        variants.variant_texts("kc7")
    variants.VARIANTS["broken"] = [("K_CHUNK = 7;", "K_CHUNK = 8;")]
    with pytest.raises(ValueError, match="occurs 0 times"):
        variants.variant_texts("broken")


CHECK = """
import json, torch
from shared.engine.kernels import cpu_kernels
from shared.engine.panels import PanelMatrix
from shared.engine.quant import QuantizedPanels, matmul, quantize
k = cpu_kernels()
gen = torch.Generator().manual_seed(0)
errors = {}
blocks, bs, kv_heads, dim = 64, 16, 3, 64
kc, vc = (torch.randn(blocks, bs, kv_heads, dim, generator=gen) for _ in range(2))
for batch, ctx in ((1, 200), (5, 37)):
    q = torch.randn(batch, 9, dim, generator=gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:-(-ctx // bs)]
                          for _ in range(batch)])
    out = k.paged_decode_attention(q, kc, vc, tables, torch.full((batch,), ctx), dim ** -0.5)
    keys, values = (c[tables].flatten(1, 2)[:, :ctx].transpose(1, 2) for c in (kc, vc))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, kv_heads, 3, dim), keys, values).reshape(batch, 9, dim)
    errors[f"attention b{batch}"] = (out - ref).abs().max().item()
w = torch.randn(67, 96, generator=gen)
for bits in (8, 4):
    m = quantize(w, bits)  # 67 columns: a part panel
    for rows in (1, 3, 9):  # AVX2's tile of rows is 2, AVX-512's 8
        x = torch.randn(rows, 96, generator=gen)
        out = matmul(x, QuantizedPanels.pack(m))
        errors[f"int{bits} m{rows}"] = (out - x @ m.dequantize().T).abs().max().item()
for n, width in ((67, 96), (100, 600)):  # a part panel; K past a chunk
    w = torch.randn(n, width, generator=gen)
    for rows in (1, 7, 70):  # a part register tile; a part block of rows
        x = torch.randn(rows, width, generator=gen)
        ref = x @ w.T
        out = PanelMatrix.pack(w[:n // 3], w[n // 3:]).matmul(x)  # two parts
        errors[f"float {n}x{width} m{rows}"] = ((out - ref).abs().max() / ref.abs().max()).item()
x, w = torch.randn(5, 100, generator=gen), torch.randn(100, generator=gen)  # past a vector
errors["rms_norm"] = (k.rms_norm(x, w, 1e-5) - torch.nn.functional.rms_norm(
    x, (100,), w, 1e-5)).abs().max().item()
gate_up = 4 * torch.randn(3, 2 * 37, generator=gen)
gate, up = gate_up.chunk(2, dim=-1)
errors["silu_mul"] = (k.silu_mul(gate_up) - torch.nn.functional.silu(gate) * up).abs().max().item()
angles = torch.randn(50, 20, generator=gen).repeat(1, 2)
qk, positions = torch.randn(6, 3, 40, generator=gen), torch.randint(0, 50, (6,), generator=gen)
cos, sin = angles.cos(), angles.sin()
rotated = torch.cat((-qk[..., 20:], qk[..., :20]), -1)
ref = qk * cos[positions, None] + rotated * sin[positions, None]
k.rope(qk, cos, sin, positions)
errors["rope"] = (qk - ref).abs().max().item()
print(json.dumps(errors))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; SSE2 only
@pytest.mark.timeout(900)
def test_the_avx2_and_portable_builds_compute_what_torch_does(march: str) -> None:
    """What a CPU without AVX-512 runs (the AVX2 intrinsics; the loops the compiler
    vectorises), built and checked on this one."""
    env = os.environ | {"DS_KERNEL_MARCH": march}
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          env=env, timeout=800)
    assert done.returncode == 0, done.stderr
    errors = json.loads(done.stdout.splitlines()[-1])
    assert len(errors) == 17
    assert all(error < 1e-4 for error in errors.values()), errors


@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 40])  # across a task of rows (16)
def test_the_layer_ops_compute_what_torch_does(tokens: int) -> None:
    """RMSNorm, SiLU(gate) * up and RoPE, one call each; RoPE in place on Q and K as a view of
    the fused QKV output (rows strided), its V untouched."""
    import torch
    import torch.nn.functional as F

    from shared.engine.kernels import cpu_kernels
    from shared.engine.model import _rotate_half

    k = cpu_kernels()
    assert k is not None
    gen = torch.Generator().manual_seed(tokens)
    for hidden in (576, 100):  # whole vectors; a remainder past them
        x, w = torch.randn(tokens, hidden, generator=gen), torch.randn(hidden, generator=gen)
        torch.testing.assert_close(k.rms_norm(x, w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5))
    for inner in (1536, 37):
        gate_up = 4 * torch.randn(tokens, 2 * inner, generator=gen)
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(k.silu_mul(gate_up), F.silu(gate) * up)
    qk40 = torch.randn(tokens, 3, 40, generator=gen)  # half a head: 20, past a vector
    angles40 = torch.randn(50, 20, generator=gen).repeat(1, 2)
    at = torch.randint(0, 50, (tokens,), generator=gen)
    expected40 = (qk40 * angles40.cos()[at, None]
                  + _rotate_half(qk40) * angles40.sin()[at, None])
    k.rope(qk40, angles40.cos(), angles40.sin(), at)
    torch.testing.assert_close(qk40, expected40)
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64, generator=gen)
    qk, v = qkv[:, : 12 * 64].view(-1, 12, 64), qkv[:, 12 * 64 :].clone()
    angles = torch.randn(100, 32, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    expected = qk * cos[positions, None] + _rotate_half(qk) * sin[positions, None]
    k.rope(qk, cos, sin, positions)
    torch.testing.assert_close(qk, expected)
    assert torch.equal(qkv[:, 12 * 64 :], v)
    if tokens:
        with pytest.raises(RuntimeError, match="past the RoPE tables"):
            k.rope(qk, cos, sin, torch.full((tokens,), 100))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 200])
def test_the_float_matmul_over_panels_is_x_times_w_transposed(rows: int) -> None:
    """Rows of x around the register tile (AVX-512: 8, AVX2: 6), the rows read from two
    panels side by side (AVX-512: up to 4, AVX2: 3; a thread's odd panel alone) and a task's
    block (8 tiles); output columns not a whole panel; an input longer than a chunk (512)
    and not a multiple of a vector."""
    import torch

    from shared.engine.panels import PanelMatrix

    gen = torch.Generator().manual_seed(rows)
    for n, width in ((1, 16), (50, 40), (131, 1100), (500, 100)):
        w = torch.randn(n, width, generator=gen)
        x = torch.randn(rows, width, generator=gen)
        packed = PanelMatrix.pack(w[: n // 2], w[n // 2 : n - 1], w[n - 1 :])  # Q, K, V
        assert packed.shape == (n, width)
        torch.testing.assert_close(packed.matmul(x), x @ w.T, rtol=1e-4, atol=1e-4)
        # a row's sums run in one order whatever shares its batch: the same bits alone
        assert torch.equal(packed.matmul(x[-1:]), packed.matmul(x)[-1:])
        ids = torch.randint(0, n, (rows,), generator=gen)
        assert torch.equal(packed.rows(ids), w[ids])  # a tied embedding's lookup
