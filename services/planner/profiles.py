"""Latency profiles: files of fitted coefficients that the planner reads.

Two formats are read:
- ours (`"format": "distserve-profile/1"`), written by `distserve profile`;
- the DistServe artifact's `{model: {tp: {"prefill": [...], "decoding_smallbs": [...], ...}}}`
  (e.g. the published A100 profiles), with `max_num_tokens.csv` beside it for KV capacity.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.planner.latency import Contention, LatencyModel, PhaseCoefficients
from services.planner.models import ModelSpec, UnknownModelError, model_spec
from services.planner.noise import Noise

log = logging.getLogger(__name__)

FORMAT = "distserve-profile/1"
ARTIFACT_STAGE_OVERHEAD_MS = 1.0  # the artifact's "+ pp" per-stage overhead


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Profile:
    model: ModelSpec
    device: str
    device_memory_bytes: int
    by_tp: dict[int, PhaseCoefficients]
    l_m: int  # prefill batch token budget: the prompt length that saturates the device
    max_decode_batch: int = 2048  # decode batches are bounded by KV memory, not a count
    stage_overhead_ms: float = 0.0
    kv_capacity: dict[tuple[int, int], int] = field(default_factory=dict)  # (tp, pp) -> tokens
    fit: dict[str, float] = field(default_factory=dict)
    host: str = ""  # the CPU a CPU profile was measured on ('': not recorded)
    dtype: str = ""  # the compute dtype it was measured in ('': not recorded, the model's)
    # how its steps slow beside the host's other devices (measured; none recorded: 1.0)
    contention: Contention = field(default_factory=Contention)
    # (tp, pp > 1) -> coefficients measured on that pipeline as the engine runs it: a
    # prompt batch's latency through every stage, a decode round (LatencyModel.rounds)
    pipelines: dict[tuple[int, int], PhaseCoefficients] = field(default_factory=dict)
    # how its steps' times scatter around the model's (measured on a stack's steps: a
    # profile fitted to them, `bench compare`'s live one; a file's: none, each step as fitted)
    noise: Noise = field(default_factory=Noise)

    def latency(self, tp: int, pp: int) -> LatencyModel:
        """The model of an instance of `tp` x `pp`: measured on that pipeline where the
        profile has it, else the paper's division of the tp coefficients over the stages."""
        measured = self.pipelines.get((tp, pp)) if pp > 1 else None
        if measured is not None:
            if measured.prefill_cached is None and tp in self.by_tp:
                # a pipeline measures no chunks over cached tokens (a step of it is one of
                # several micro-batches): their attention is the same work, over its stages
                measured = dataclasses.replace(measured,
                                               prefill_cached=self.by_tp[tp].prefill_cached)
            return LatencyModel(measured, pp, self.stage_overhead_ms, self.contention,
                                rounds=True)
        return LatencyModel(self.by_tp[tp], pp, self.stage_overhead_ms, self.contention)

    @property
    def tps(self) -> list[int]:
        return sorted(self.by_tp)


def saturation_length(co: PhaseCoefficients, share: float = 0.9, limit: int = 16384) -> int:
    """L_m: the shortest prompt whose prefill throughput (tokens/ms) reaches `share` of the
    best any single prompt up to `limit` reaches."""
    a, b, c = co.prefill
    lengths = range(16, limit + 1, 16)
    rates = [n / (a + b * n + c * n * n) for n in lengths]
    best = max(rates)
    return next(n for n, r in zip(lengths, rates, strict=True) if r >= share * best)


def _coefficients(entry: Any, where: str) -> PhaseCoefficients:
    """The coefficients of one entry of a file (`where` names it in an error)."""
    if not isinstance(entry, dict):
        raise ProfileError(f"{where} is not an object of coefficients")
    for key in ("prefill", "decoding_smallbs", "decoding_largebs"):
        value = entry.get(key)
        if not (isinstance(value, list) and len(value) == 3
                and all(isinstance(x, int | float) for x in value)):
            raise ProfileError(f"{where}: {key} must be a list of 3 numbers, got {value!r}")
    threshold = entry.get("decoding_large_small_bs_threshold", 1 << 30)
    share = entry.get("prefill_stage_share", 0.0)
    cached = entry.get("prefill_cached")
    if not (isinstance(threshold, int | float) and isinstance(share, int | float)
            and (cached is None or (isinstance(cached, int | float) and cached >= 0))):
        raise ProfileError(f"{where}: decoding_large_small_bs_threshold and "
                           "prefill_stage_share must be numbers, prefill_cached one >= 0")
    return PhaseCoefficients(
        prefill=tuple(entry["prefill"]),
        decode_small=tuple(entry["decoding_smallbs"]),
        decode_large=tuple(entry["decoding_largebs"]),
        decode_threshold=int(threshold),
        prefill_stage=float(share),
        prefill_cached=None if cached is None else float(cached),
    )


def _by_tp(configs: Any, where: str) -> dict[int, PhaseCoefficients]:
    if not isinstance(configs, dict) or not configs:
        raise ProfileError(f"{where} must be a non-empty object {{tp: coefficients}}")
    if not all(isinstance(tp, str) and tp.isdigit() for tp in configs):
        raise ProfileError(f"{where} has keys {sorted(configs)}: expected tp numbers")
    return {int(tp): _coefficients(entry, f"{where} tp {tp}") for tp, entry in configs.items()}


def _entry(co: PhaseCoefficients) -> dict[str, Any]:
    return {"prefill": list(co.prefill), "decoding_smallbs": list(co.decode_small),
            "decoding_largebs": list(co.decode_large),
            "decoding_large_small_bs_threshold": co.decode_threshold,
            **({"prefill_stage_share": co.prefill_stage} if co.prefill_stage else {}),
            **({} if co.prefill_cached is None else {"prefill_cached": co.prefill_cached})}


def _read_capacity(path: Path, model: str) -> dict[tuple[int, int], int]:
    if not path.exists():
        return {}
    with path.open() as f:
        try:
            return {(int(r["tp"]), int(r["pp"])): int(r["max_num_tokens"])
                    for r in csv.DictReader(f) if r["model"] == model}
        except (KeyError, TypeError, ValueError):
            raise ProfileError(f"{path}: not a capacity table (columns model, tp, pp, "
                               "max_num_tokens, numbers in the last three)") from None


NOT_A_PROFILE = ("not a latency profile: expected an object with \"format\": "
                 f"\"{FORMAT}\" (as distserve profile writes) or the DistServe artifact's "
                 "{model: {tp: {\"prefill\": [...], \"decoding_smallbs\": [...], ...}}}")
OURS_REQUIRED = ("device", "device_memory_bytes", "l_m", "configs")


def _read_json(path: Path) -> Any:
    if path.is_dir():
        raise ProfileError(f"{path} is a directory, not a profile file")
    if not path.exists():
        raise ProfileError(f"profile {path} does not exist")
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON (line {e.lineno} column {e.colno}: "
                           f"{e.msg})") from None


def _is_artifact(data: Any) -> bool:
    """Whether `data` has the shape {model: {tp: ...}} of the DistServe artifact's files."""
    return isinstance(data, dict) and bool(data) and all(
        isinstance(tps, dict) and tps and all(tp.isdigit() for tp in tps)
        for tps in data.values())


def load_profile(path: str | Path, model: str | None = None,
                 device_memory_gb: float = 80.0) -> Profile:
    """Read a profile file; `model` picks one model out of an artifact file. ProfileError
    where the file is missing or is not a profile of either format."""
    path = Path(path)
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return _load_ours(path, data)
    if not _is_artifact(data):
        raise ProfileError(f"{path}: {NOT_A_PROFILE}")
    if model is None:
        if len(data) != 1:
            raise ProfileError(f"{path} holds several models {sorted(data)}: pick one with "
                               "--model")
        model = next(iter(data))
    if model not in data:
        raise ProfileError(f"{path} has no profile for model {model!r}: it has {sorted(data)}")
    by_tp = _by_tp(data[model], f"{path}: model {model}")
    try:
        l_m = saturation_length(by_tp[min(by_tp)])
    except (ArithmeticError, StopIteration, ValueError):  # zero, negative or NaN times
        raise ProfileError(f"{path}: model {model}: its prefill coefficients give no "
                           "positive prefill time") from None
    return Profile(
        model=_known_model(path, model), device=path.stem, device_memory_bytes=int(
            device_memory_gb * 2**30), by_tp=by_tp, l_m=l_m,
        stage_overhead_ms=ARTIFACT_STAGE_OVERHEAD_MS,
        kv_capacity=_read_capacity(path.with_name("max_num_tokens.csv"), model))


def _known_model(path: Path, name: str) -> ModelSpec:
    try:
        return model_spec(name)
    except UnknownModelError as e:
        raise ProfileError(f"{path}: {e}") from None


def _load_ours(path: Path, data: dict[str, Any]) -> Profile:
    missing = [k for k in OURS_REQUIRED if k not in data]
    if "model" not in data and "model_spec" not in data:
        missing.insert(0, "model")
    if missing:
        raise ProfileError(f"{path}: a {FORMAT} profile without {', '.join(missing)}")
    by_tp = _by_tp(data["configs"], f"{path}: configs")
    pipelines = _pipelines(path, data.get("pipelines", []))
    spec = _model_of(path, data)
    try:
        return Profile(
            model=spec, device=str(data["device"]),
            device_memory_bytes=int(data["device_memory_bytes"]), by_tp=by_tp,
            l_m=int(data["l_m"]), max_decode_batch=int(data.get("max_decode_batch", 256)),
            stage_overhead_ms=float(data.get("stage_overhead_ms", 0.0)),
            fit={k: float(v) for k, v in data.get("fit", {}).items()},
            host=str(data.get("host", "")), dtype=str(data.get("dtype", "")),
            contention=Contention(**{k: float(v)
                                     for k, v in data.get("contention", {}).items()}),
            pipelines=pipelines)
    except (AttributeError, TypeError, ValueError) as e:  # a field of the wrong type
        raise ProfileError(f"{path}: a field of the wrong type: {e}") from None


def _model_of(path: Path, data: dict[str, Any]) -> ModelSpec:
    """The model's shape, where the file carries it: any model profiled here (a Hugging Face
    directory too), not only the ones the planner knows by name."""
    if "model_spec" not in data:
        return _known_model(path, data["model"])
    try:
        return ModelSpec(**data["model_spec"])
    except TypeError as e:
        raise ProfileError(f"{path}: model_spec is not a model's shape: {e}") from None


def _pipelines(path: Path, entries: Any) -> dict[tuple[int, int], PhaseCoefficients]:
    if not (isinstance(entries, list) and all(
            isinstance(e, dict) and isinstance(e.get("tp"), int)
            and isinstance(e.get("pp"), int) for e in entries)):
        raise ProfileError(f"{path}: pipelines must be a list of objects with numbers tp and "
                           "pp and their coefficients")
    return {(e["tp"], e["pp"]): _coefficients(e, f"{path}: pipeline tp {e['tp']} pp {e['pp']}")
            for e in entries}


def save_profile(profile: Profile, path: str | Path) -> None:
    data = {
        "format": FORMAT, "model": profile.model.name,
        "model_spec": dataclasses.asdict(profile.model), "device": profile.device,
        "device_memory_bytes": profile.device_memory_bytes, "l_m": profile.l_m,
        "max_decode_batch": profile.max_decode_batch,
        "stage_overhead_ms": profile.stage_overhead_ms,
        "configs": {str(tp): _entry(co) for tp, co in sorted(profile.by_tp.items())},
        "fit": profile.fit,
        **({"host": profile.host} if profile.host else {}),
        **({"dtype": profile.dtype} if profile.dtype else {}),
        **({"contention": dataclasses.asdict(profile.contention)}
           if not profile.contention.none else {}),
        **({"pipelines": [{"tp": tp, "pp": pp, **_entry(co)}
                          for (tp, pp), co in sorted(profile.pipelines.items())]}
           if profile.pipelines else {}),
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def kv_capacity_tokens(profile: Profile, tp: int, pp: int, memory_use: float = 0.9) -> int:
    """KV-cache token slots of an instance with tp*pp devices, after the weights; 0 when the
    weights alone do not fit. A published capacity table, when present, is authoritative."""
    if profile.kv_capacity:
        return profile.kv_capacity.get((tp, pp), 0)
    spec = profile.model
    free = memory_use * profile.device_memory_bytes * tp * pp - spec.weight_bytes
    return max(0, math.floor(free / spec.kv_bytes_per_token))


SHIPPED_PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def shipped_cpu_profile(threads: int, host: str = "") -> Path:
    """The profile this project measured for the default model with `threads` torch
    threads per worker, in float32: the one measured on a CPU like `host` where one ships
    (profiles/smollm2-135m-cpu-<n>thread(s)-<cpu>.json, its `host` field equal to `host`),
    else the generic profiles/smollm2-135m-cpu-<n>thread(s).json."""
    stem = f"smollm2-135m-cpu-{threads}thread{'s' if threads > 1 else ''}"
    if host:
        for path in sorted(SHIPPED_PROFILES.glob(f"{stem}-*.json")):
            data = json.loads(path.read_text())
            if data.get("host") == host and data.get("dtype", "float32") == "float32":
                return path
    return SHIPPED_PROFILES / f"{stem}.json"


def with_prefill_of(decoder: Profile, prefiller: Profile) -> Profile:
    """The profile of a disaggregated stack on CPUs whose prefill instances run as `prefiller`
    was measured (e.g. in bfloat16: `distserve profile --dtype bfloat16`) and its decode
    instances as `decoder`: the prefill coefficients, L_m and the prefill steps' contention
    of the one, the decode's and everything else of the other (KV capacity included: the
    decode instances hold the KV). Every tp and measured pipeline of `decoder` stays; a
    shape `prefiller` did not measure keeps `decoder`'s prefill (priced as the other dtype).
    A prefill instance only prefills and a decode instance only decodes, so each step is
    priced as its dtype runs it; the contention factors were each measured beside a
    neighbour in the profile's own dtype. A colocated worker runs one dtype for both phases:
    price it with either profile, never this one. On a GPU an instance keeps its KV in the
    dtype it computes in, so the two could not hand KV over: refused."""
    if (prefiller.model.name, prefiller.model.num_layers) != (decoder.model.name,
                                                              decoder.model.num_layers):
        raise ProfileError(f"the prefill profile is of {prefiller.model.name}, the other of "
                           f"{decoder.model.name}: one model serves both phases")
    if not (decoder.device.startswith("cpu") and prefiller.device.startswith("cpu")):
        raise ProfileError("a prefill instance in another dtype hands its KV on only between "
                           "CPU instances (a CPU keeps KV in float32 whatever it computes in; "
                           f"a GPU in its own dtype): these profiles are of {decoder.device} "
                           f"and {prefiller.device}")
    if not set(decoder.by_tp) & set(prefiller.by_tp):
        raise ProfileError(f"the prefill profile measured tp {prefiller.tps}, the other tp "
                           f"{decoder.tps}: none in common")

    def mixed(decode: PhaseCoefficients, prefill: PhaseCoefficients | None) -> PhaseCoefficients:
        if prefill is None:
            return decode
        return dataclasses.replace(decode, prefill=prefill.prefill,
                                   prefill_stage=prefill.prefill_stage,
                                   prefill_cached=prefill.prefill_cached)

    contention = dataclasses.replace(
        decoder.contention, prefill_by_decode=prefiller.contention.prefill_by_decode,
        prefill_by_prefill=prefiller.contention.prefill_by_prefill)
    return dataclasses.replace(
        decoder, by_tp={tp: mixed(co, prefiller.by_tp.get(tp))
                        for tp, co in decoder.by_tp.items()},
        pipelines={key: mixed(co, prefiller.pipelines.get(key))
                   for key, co in decoder.pipelines.items()},
        l_m=prefiller.l_m, contention=contention)


def measured_elsewhere(profile: Profile, host: str) -> str | None:
    """Why `profile` may price this machine's steps wrong (its CPU is another, or it does not
    say which), or None where it was measured on a CPU like `host`."""
    if not profile.device.startswith("cpu"):
        return None
    if not profile.host:
        return f"the profile {profile.device} does not say which CPU it was measured on"
    if profile.host != host:
        return f"the profile was measured on {profile.host}, this machine is {host}"
    return None


def planner_profile(path: str, threads: int, host: str = "") -> Profile:
    """The profile the online planner plans on (and the profiler calibrates): the file
    DS_PLANNER_PROFILE names, else the shipped one for DS_THREADS threads per worker,
    measured on a CPU like `host` where the project has one."""
    return load_profile(path or shipped_cpu_profile(threads, host))


def load_prefill_profile(path: str | Path, profile: Profile, model: str | None = None
                         ) -> Profile:
    """The profile at `path`, measured in the prefill instances' dtype (`distserve profile
    --dtype bfloat16`), to price a disaggregated stack's prefill instances over `profile`
    (`with_prefill_of`); ProfileError where it cannot: it does not say its dtype, or is of
    another model, a GPU's, or of no tp `profile` has. `model` picks one out of an artifact
    file."""
    prefiller = load_profile(path, model)
    if not prefiller.dtype:
        raise ProfileError(f"{path} does not say the dtype it was measured in (written before "
                           "profiles did): measure it again with distserve profile --dtype")
    with_prefill_of(profile, prefiller)  # refuses another model, a GPU, no tp in common
    return prefiller


def unmeasured_prefill_shapes(profile: Profile, prefiller: Profile) -> list[str]:
    """The tps and pipelines of `profile` that `prefiller` did not measure: `with_prefill_of`
    prices their prefills in `profile`'s dtype."""
    return [f"tp {tp}" for tp in profile.tps if tp not in prefiller.by_tp] + \
        [f"tp {tp} x pp {pp}" for tp, pp in profile.pipelines if (tp, pp) not in
         prefiller.pipelines]


def prefill_profile_or_none(path: str, profile: Profile) -> Profile | None:
    """The profile DS_PLANNER_PREFILL_PROFILE names (`load_prefill_profile`), or None where it
    names none or one that cannot price the prefill instances (said: they are priced on
    `profile` then, as the planner and the profiler both fall back to), with the shapes it
    lacks said too."""
    if not path:
        return None
    try:
        prefiller = load_prefill_profile(path, profile)
    except (ProfileError, OSError, ValueError) as e:
        log.warning("DS_PLANNER_PREFILL_PROFILE %s cannot price the prefill instances (%s): "
                    "pricing them on the planner's profile", path, e)
        return None
    if lacking := unmeasured_prefill_shapes(profile, prefiller):
        # `profile` is a CPU's (with_prefill_of refuses others): float32 where it says none
        log.warning("%s has no %s: prefill instances of those are priced in %s", path,
                    ", ".join(lacking), profile.dtype or "float32")
    return prefiller
