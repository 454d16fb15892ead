"""What an FP4 training run quantizes, and how: the recipe, as plain data.

A linear layer runs three GEMMs, each written C = A @ B^T with both operands quantized along
the contraction axis (fp4lab.formats.gemm's convention)::

    fprop  y  = x @ W^T     A = x  [M, K]   B = W   [N, K]     contraction K (features in)
    dgrad  dx = dy @ W      A = dy [M, N]   B = W^T [K, N]     contraction N (features out)
    wgrad  dW = dy^T @ x    A = dy^T [N, M] B = x^T [K, M]     contraction M (tokens)

A ``Recipe`` holds one ``GemmSpec`` per GEMM; a ``GemmSpec`` holds one ``Operand`` per side (its
format, rounding, blocks) and the GEMM's Hadamard rotation, applied to both operands along the
contraction axis so that it cancels (docs/numerics.md "Hadamard transforms"). Layer selection (which
modules are swapped at all: name patterns, and the first / last transformer blocks kept in BF16,
as counts or as fractions of the model's depth, ``Recipe.bf16_blocks``), the late switch to BF16,
and the embedding / logit gains complete it. The gains are a training change, not a quantization
change (under AdamW an embedding gain g acts as a g-times larger embedding learning rate and
initial scale), so every recipe, BF16 included, may set them, and a comparison of an FP4 arm
with gains against BF16 must give the BF16 arm the same gains. Recipes are frozen, load from
TOML or JSON (``load_recipe``), print into receipts (``recipe.to_dict()``), and a study arm is
a recipe plus dotted overrides
(``recipe.override({"wgrad.hadamard": "deterministic"})``).

Presets (functions returning a Recipe): ``bf16``, ``nvfp4`` (NVIDIA's recipe, arXiv
2509.25149), ``nvfp4_four_over_six`` (the same with Four Over Six scales), ``nvfp4_plain``, ``mxfp4``, ``mxfp4_rceil``, ``mxfp4_hadamard``, and the
per-GEMM progression of the AMD MXFP4 study: ``fprop``, ``fprop_dgrad``, ``fprop_dgrad_wgrad``.

Public: ``HadamardMode``, ``Bf16Scope``, ``Operand``, ``GemmSpec``, ``Recipe``, ``recipe_rule``,
``PRESETS``, ``preset``, ``load_recipe``, ``dotted_keys``, ``NVIDIA_KEEP`` and the preset
functions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..formats.types import Choice, Format, MXScaleMode, NVFP4Profile, Rounding
from ..typecheck import field_types, fits, type_name

GEMMS = ("fprop", "dgrad", "wgrad")


def recipe_rule(rule: Callable[..., Any]) -> Callable[..., Any]:
    """``rule(recipe, *keys)``, a pure function of a recipe and hashable keys, remembered per recipe
    object: recipes are frozen, and a rule asked at every layer call of every step (what the
    layers' forward and backward decide from the recipe) need not be worked out again. Keyed by
    the recipe's identity (hashing a recipe walks every field); the cache holds its recipes, so an
    identity is never reused while remembered, and is emptied when it grows past a few hundred
    entries (recipes made per call, as ``at_progress`` makes after ``bf16_after``)."""
    cache: dict[tuple, tuple[Any, Any]] = {}

    @functools.wraps(rule)
    def remembered(recipe, *keys):
        key = (id(recipe), *keys)
        hit = cache.get(key)
        if hit is not None and hit[0] is recipe:
            return hit[1]
        if len(cache) >= 512:
            cache.clear()
        value = rule(recipe, *keys)
        cache[key] = (recipe, value)
        return value
    return remembered


class HadamardMode(Choice):
    NONE = "none"
    """No rotation."""
    DETERMINISTIC = "deterministic"
    """The plain Sylvester Hadamard (all signs +1): stabilised MXFP4 Wgrad on MI355X."""
    FIXED = "fixed"
    """One sign vector for every layer and step: TE's vector at size 16, a vector drawn once
    from the recipe seed at size 32."""
    RANDOM = "random"
    """Signs re-drawn per layer and per step (micro-batch) from the recipe seed."""


class Bf16Scope(Choice):
    ALL = "all"
    """After ``bf16_after``, all three GEMMs run in BF16."""
    FORWARD = "forward"
    """After ``bf16_after``, only fprop runs in BF16 (cut the 12B gap from 1.5% to 0.5%)."""
    BACKWARD = "backward"
    """After ``bf16_after``, dgrad and wgrad run in BF16 and fprop stays FP4: a cooldown with exact
    gradients whose model still runs in FP4 at inference (fp4lab's idea, gap-closers study)."""


@dataclass(frozen=True, kw_only=True)
class Operand:
    """How one GEMM operand is quantized."""

    format: Format = Format.BF16
    """bf16 (not quantized: the operand enters the GEMM in the compute dtype), nvfp4 or mxfp4."""
    rounding: Rounding = Rounding.RTNE
    """rtne, or stochastic (seeded per layer, step and GEMM: runs replay exactly)."""
    block2d: bool = False
    """16x16 tiles (NVFP4 weights only): the weight and its transpose quantize alike."""
    profile: NVFP4Profile = NVFP4Profile.TE
    """Whose NVFP4 numerics (te or torchao); ignored for other formats."""
    mx_mode: MXScaleMode = MXScaleMode.FLOOR
    """MXFP4 scale exponent rule (floor, ceil, even, rceil); ignored for other formats."""
    dither: float = 0.0
    """Weights only: before RTNE, add seeded uniform noise of +-dither/2 units of the block's
    scale (redrawn every step) so that updates smaller than half a code step can still move
    codes ("stiction"). 0 disables it; 1 spans one code step for values below 2 units."""

    def __post_init__(self) -> None:
        for name, kind in (("format", Format), ("rounding", Rounding), ("profile", NVFP4Profile),
                           ("mx_mode", MXScaleMode)):
            object.__setattr__(self, name, kind.parse(getattr(self, name)))
        self.quantized  # (worked out here, once: see below)
        if self.block2d and not (self.quantized and (16, 16) in self.format.spec.blocks):
            raise ValueError(f"block2d (16x16 tiles) is an NVFP4 weight option, not {self.format}")
        if not 0.0 <= self.dither <= 4.0:
            raise ValueError(f"dither is an amplitude in [0, 4] block-scale units, got {self.dither}")
        if self.dither and self.rounding is not Rounding.RTNE:
            raise ValueError("dither goes with rtne rounding (stochastic rounding already dithers)")
        if self.dither and not self.quantized:  # refused here, not at the first step
            raise ValueError(f"dither is in units of an FP4 block scale: a {self.format} operand has none")

    # (cached_property: asked several times a layer call; written to the instance's dict, which
    # a frozen dataclass allows, and outside its fields, so equality, hashing and receipts ignore it;
    # __post_init__ reads it, so it is in the dict before any trace: on Python 3.11 the property's
    # first read takes a lock, which torch.compile cannot trace)
    @functools.cached_property
    def quantized(self) -> bool:
        return self.format.quantized


@dataclass(frozen=True, kw_only=True)
class GemmSpec:
    """One GEMM C = A @ B^T: operand A (x or dy), operand B (W, W^T or x^T), and its rotation."""

    a: Operand = field(default_factory=Operand)
    b: Operand = field(default_factory=Operand)
    hadamard: HadamardMode = HadamardMode.NONE
    """Rotation of both operands along the contraction axis (cancels in the product)."""
    hadamard_size: int = 16
    """16 (NVFP4 blocks, TE) or 32 (MXFP4 blocks, Quartet)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hadamard", HadamardMode.parse(self.hadamard))
        if self.hadamard_size not in (16, 32):
            raise ValueError(f"hadamard_size must be 16 or 32, got {self.hadamard_size}")
        if self.a.quantized and self.b.quantized and self.a.format is not self.b.format:
            raise ValueError(f"a GEMM's FP4 operands must share a format, got {self.a.format} and {self.b.format}")
        self.quantized, self.rotated, self.emulated  # (worked out here, once: Operand.quantized says why)

    @functools.cached_property  # (as Operand.quantized)
    def quantized(self) -> bool:
        return self.a.quantized or self.b.quantized

    @functools.cached_property
    def rotated(self) -> bool:
        return self.hadamard is not HadamardMode.NONE

    @functools.cached_property
    def emulated(self) -> bool:
        """Whether this GEMM runs other than in plain BF16: an FP4 operand or a rotation."""
        return self.quantized or self.rotated


BF16_GEMM = GemmSpec()


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Per-GEMM quantization plus layer selection; every field prints into receipts."""

    name: str = "custom"
    fprop: GemmSpec = BF16_GEMM
    dgrad: GemmSpec = BF16_GEMM
    wgrad: GemmSpec = BF16_GEMM
    keep_first: int = 0
    """The first N transformer blocks' linears stay BF16 (NVIDIA: 2 of 62 at 12B); 0 when
    ``keep_fraction`` is set."""
    keep_last: int = 0
    """The last M transformer blocks' linears stay BF16 (NVIDIA: 8 of 62 at 12B); 0 when
    ``keep_fraction`` is set."""
    keep_fraction: tuple[float, float] | None = None
    """(first, last) fractions of the model's transformer blocks kept in BF16, resolved against
    the model's depth when the recipe is applied (``bf16_blocks``); when set it replaces
    keep_first / keep_last, which must then be 0. None: the counts apply."""
    keep_bf16: tuple[str, ...] = ("lm_head", "*router*")
    """fnmatch patterns of module names never swapped (embeddings and norms are not linears)."""
    bf16_after: float | None = None
    """Fraction of training after which ``bf16_scope`` GEMMs switch to BF16 (None: never)."""
    bf16_scope: Bf16Scope = Bf16Scope.ALL
    embed_gain: float = 1.0
    """Multiplies token embeddings (the MoE speedrun's NVFP4 runs used 10.667). A training
    change, not a quantization change, allowed on every recipe: under AdamW it acts as a
    10.7x embedding learning rate and initial scale. An FP4 arm with a gain is compared
    against a BF16 arm with the same gain."""
    logits_gain: float = 1.0
    """Multiplies the LM head's logits (the MoE speedrun's NVFP4 runs used 0.125): a training
    change like ``embed_gain`` (an inverse softmax temperature), allowed on every recipe."""
    seed: int = 0
    """Root of every stochastic-rounding, dither and random-sign seed."""

    def __post_init__(self) -> None:
        for name in GEMMS:
            if not isinstance(getattr(self, name), GemmSpec):
                raise TypeError(f"{name} must be a GemmSpec, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        object.__setattr__(self, "bf16_scope", Bf16Scope.parse(self.bf16_scope))
        object.__setattr__(self, "keep_fraction", _keep_fraction(self.keep_fraction))
        if self.keep_first < 0 or self.keep_last < 0:
            raise ValueError(f"keep_first / keep_last must be >= 0, got {self.keep_first}, {self.keep_last}")
        if self.keep_fraction is not None and (self.keep_first, self.keep_last) != (0, 0):
            raise ValueError(f"keep_fraction {self.keep_fraction} replaces keep_first / keep_last, got "
                             f"{self.keep_first}, {self.keep_last} as well; set one or the other")
        if self.bf16_after is not None and not 0.0 <= self.bf16_after <= 1.0:
            raise ValueError(f"bf16_after is a fraction of training in [0, 1], got {self.bf16_after}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for gemm in GEMMS:
            if getattr(self, gemm).a.dither:
                raise ValueError(f"{gemm}.a: dither applies to weights only")
        if self.dgrad.b.quantized and self.dgrad.b.dither != self.fprop.b.dither:
            raise ValueError("dgrad.b.dither must equal fprop.b.dither: both GEMMs quantize one dithered weight")
        if self.wgrad.b.dither:
            raise ValueError("wgrad.b is the activation x^T: dither applies to weights only")

    def gemm(self, name: str) -> GemmSpec:
        if name not in GEMMS:
            raise ValueError(f"unknown GEMM {name!r}; expected one of {GEMMS}")
        return getattr(self, name)

    def uses(self, fmt: Format) -> bool:
        return any(op.format is fmt for g in GEMMS for op in (getattr(self, g).a, getattr(self, g).b))

    @property
    def quantized(self) -> bool:
        return any(getattr(self, g).emulated for g in GEMMS)

    def bf16_blocks(self, n_blocks: int) -> tuple[int, int]:
        """(first, last): how many of a model's ``n_blocks`` transformer blocks keep BF16
        linears at the input end and at the output end. Counts (keep_first, keep_last) are
        clamped to the model, each block counted once. Fractions (f, l) = keep_fraction round
        half up, the total first so that the two parts add up to the rounded whole, and never
        keep every block:

            total = min(floor(n (f + l) + 1/2), max(n - 1, 0))
            first = min(floor(n f + 1/2), total),   last = total - first

        NVIDIA's (2/62, 8/62) (the ``nvfp4`` preset) by depth n::

            n      1-3     4-8     12      16      24      32      48      62
            BF16   (0, 0)  (0, 1)  (0, 2)  (1, 2)  (1, 3)  (1, 4)  (2, 6)  (2, 8)
        """
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        if self.keep_fraction is None:
            first = min(self.keep_first, n_blocks)
            return first, min(self.keep_last, n_blocks - first)
        f_first, f_last = self.keep_fraction
        total = min(_round_half_up(n_blocks * (f_first + f_last)), max(n_blocks - 1, 0))
        first = min(_round_half_up(n_blocks * f_first), total)
        return first, total - first

    def switched_at(self, progress: float) -> bool:
        """Whether ``progress`` is past the late switch to BF16 (``bf16_after``)."""
        return self.bf16_after is not None and progress >= self.bf16_after

    def at_progress(self, progress: float) -> "Recipe":
        """The recipe in force at ``progress`` (fraction of training done): BF16 GEMMs after
        ``bf16_after`` per ``bf16_scope``."""
        if not self.switched_at(progress):
            return self
        gemms = {Bf16Scope.ALL: GEMMS, Bf16Scope.FORWARD: ("fprop",),
                 Bf16Scope.BACKWARD: ("dgrad", "wgrad")}[self.bf16_scope]
        return dataclasses.replace(self, **{g: BF16_GEMM for g in gemms})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/TOML data (enums as their names); ``Recipe.from_dict`` inverts it."""
        return _plain(dataclasses.asdict(self))

    def to_toml(self) -> str:
        """The recipe as a TOML file ``load_recipe`` reads back (None fields omitted)."""
        return _toml(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        """Strict: unknown keys are errors (a typo must not silently fall back to a default)."""
        _check_fields(cls, data, "")
        kwargs = dict(data)
        for gemm in GEMMS:
            if gemm in kwargs:
                spec = dict(kwargs[gemm])
                _check_fields(GemmSpec, spec, f"{gemm}.")
                for side in ("a", "b"):
                    if side in spec:
                        _check_fields(Operand, spec[side], f"{gemm}.{side}.")
                        spec[side] = _build(Operand, spec[side], f"{gemm}.{side}")
                kwargs[gemm] = _build(GemmSpec, spec, gemm)
        return _build(cls, kwargs, "")

    def override(self, changes: dict[str, Any]) -> "Recipe":
        """A copy with dotted keys replaced: {"wgrad.hadamard": "random", "keep_last": 2}.

        The BF16 blocks have one source of truth: overriding keep_first or keep_last (and not
        keep_fraction) switches to counts, clearing keep_fraction (a count not given keeps its
        value, 0 under a fraction); overriding keep_fraction with fractions (and no count)
        zeroes the counts. So {"keep_first": 0, "keep_last": 0} removes the BF16 blocks of any
        recipe, the ``nvfp4`` preset's fractions included."""
        data = self.to_dict()
        data.update(_keep_switch(changes))
        for key, value in changes.items():
            node, *path = data, *key.split(".")
            for part in path[:-1]:
                if not isinstance(node, dict) or part not in node:
                    raise ValueError(f"unknown recipe key {key!r}")
                node = node[part]
            if not isinstance(node, dict) or path[-1] not in node:
                raise ValueError(f"unknown recipe key {key!r}")
            node[path[-1]] = value
        return Recipe.from_dict(data)

    def describe(self) -> str:
        """One line per GEMM, e.g. 'wgrad: dy nvfp4/stochastic  x nvfp4/rtne  hadamard fixed/16'."""
        names = {"fprop": ("x", "W"), "dgrad": ("dy", "W"), "wgrad": ("dy", "x")}
        lines = [f"recipe {self.name}"]
        for gemm in GEMMS:
            spec = getattr(self, gemm)
            sides = "  ".join(f"{n} {_describe_operand(op)}" for n, op in zip(names[gemm], (spec.a, spec.b)))
            rot = f"  hadamard {spec.hadamard}/{spec.hadamard_size}" if spec.rotated else ""
            lines.append(f"  {gemm}: {sides}{rot}")
        return "\n".join(lines)


def _keep_fraction(value: Any) -> tuple[float, float] | None:
    """None, or a valid (first, last) pair of floats (a TOML/JSON list becomes a tuple)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"keep_fraction is a (first, last) pair of fractions, got {value!r}")
    first, last = (float(f) for f in value)
    if not (0.0 <= first < 1.0 and 0.0 <= last < 1.0 and first + last < 1.0):
        raise ValueError(f"keep_fraction fractions must lie in [0, 1) and sum below 1, got {value!r}")
    return first, last


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def _keep_switch(changes: dict[str, Any]) -> dict[str, Any]:
    """What else an override of the BF16-block keys resets (Recipe.override)."""
    counts = {"keep_first", "keep_last"} & set(changes)
    if counts and "keep_fraction" not in changes:
        return {"keep_fraction": None}
    if not counts and changes.get("keep_fraction") is not None:
        return {"keep_first": 0, "keep_last": 0}
    return {}


def _describe_operand(op: Operand) -> str:
    if not op.quantized:
        return "bf16"
    extra = "/16x16" if op.block2d else ""
    extra += f"/{op.mx_mode}" if op.format is Format.MXFP4 else ""
    extra += f"/dither{op.dither:g}" if op.dither else ""
    return f"{op.format}/{op.rounding}{extra}"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, Choice) else value


def _toml(data: dict[str, Any], prefix: str = "") -> str:
    # JSON's scalar spellings are valid TOML for the strings, numbers, bools and lists used here
    lines = [f"[{prefix[:-1]}]"] if prefix else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    tables = [_toml(v, f"{prefix}{k}.") for k, v in data.items() if isinstance(v, dict)]
    return "\n".join(lines + [""] + tables)


def _check_fields(cls: type, data: dict[str, Any], where: str) -> None:
    """Known keys with values of the right type, else an error naming the dotted key."""
    if not isinstance(data, dict):
        raise TypeError(f"{where.rstrip('.') or 'recipe'} must be a table/object, got {type(data).__name__}")
    hints = field_types(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise ValueError(f"unknown recipe key(s) {sorted(where + k for k in unknown)}; expected some of "
                         f"{sorted(where + k for k in hints)}")
    for key, value in data.items():
        if fits(value, hints[key]) is False:
            raise TypeError(f"{where}{key} must be {type_name(hints[key])}, got {value!r}")


def _build(cls: type, kwargs: dict[str, Any], where: str):
    """cls(**kwargs), its value errors prefixed with the dotted key of the table."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if not where or str(e).startswith(where):
            raise
        raise type(e)(f"{where}: {e}") from None


def load_recipe(source: str | Path) -> Recipe:
    """A preset name, or a .toml / .json file holding Recipe.to_dict()'s fields (optionally with
    ``base = "<preset>"`` to start from a preset and override dotted keys)."""
    if isinstance(source, str) and source in PRESETS:
        return preset(source)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no recipe file {str(path)!r} and no preset of that name "
                                f"(presets: {', '.join(PRESETS)})")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"recipe file {path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}") from None
    try:
        base = data.pop("base", None)
        if base is None:
            return Recipe.from_dict(data)
        return preset(base).override(dotted_keys(data))
    except (TypeError, ValueError) as e:
        raise type(e)(f"recipe file {path}: {e}") from None


def dotted_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables -> one level of dotted keys: {"wgrad": {"hadamard": x}} -> {"wgrad.hadamard": x}."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ---- presets ---------------------------------------------------------------------------------

def _fp4(fmt: Format, mx_mode: MXScaleMode = MXScaleMode.FLOOR, **kw: Any) -> Operand:
    return Operand(format=fmt, mx_mode=mx_mode, **kw)


def bf16() -> Recipe:
    """Every GEMM in BF16: the baseline arm."""
    return Recipe(name="bf16")


NVIDIA_KEEP = (2 / 62, 8 / 62)
"""NVIDIA's BF16 blocks at 12B: the first 2 and the last 8 of 62 (16%, weighted to the output)."""


def nvfp4(*, keep_first: int | None = None, keep_last: int | None = None) -> Recipe:
    """NVIDIA's NVFP4 recipe (arXiv 2509.25149; TE NVFP4BlockScaling): x and W RTNE (W in 16x16
    tiles), dy stochastic, the 16-point RHT with TE's signs on both Wgrad operands. NVIDIA kept
    the first 2 and last 8 of 62 blocks in BF16; the preset keeps the same fractions of the
    model's depth (keep_fraction = NVIDIA_KEEP; Recipe.bf16_blocks: d6 (0, 1), d12 (0, 2),
    d16 (1, 2)), so the share of BF16 blocks does not grow as the model shrinks. Passing
    keep_first and/or keep_last keeps those counts instead (an unset one is 0; no fraction)."""
    x, w = _fp4(Format.NVFP4), _fp4(Format.NVFP4, block2d=True)
    dy = _fp4(Format.NVFP4, rounding=Rounding.STOCHASTIC)
    counts = keep_first is not None or keep_last is not None
    keep = (dict(keep_first=keep_first or 0, keep_last=keep_last or 0) if counts
            else dict(keep_fraction=NVIDIA_KEEP))
    return Recipe(name="nvfp4", fprop=GemmSpec(a=x, b=w), dgrad=GemmSpec(a=dy, b=w),
                  wgrad=GemmSpec(a=dy, b=x, hadamard=HadamardMode.FIXED), **keep)


def nvfp4_four_over_six() -> Recipe:
    """NVIDIA's recipe with Four Over Six block scales (arXiv 2512.02010) on every FP4 operand:
    each block (16x16 tile for W) scaled to 6 or to 4, whichever rounds it with less error
    (NVFP4Profile.FOUR_OVER_SIX; the choice is made on round-to-nearest errors, dy included)."""
    def four_six(op: Operand) -> Operand:
        return dataclasses.replace(op, profile=NVFP4Profile.FOUR_OVER_SIX)
    base = nvfp4()
    return dataclasses.replace(base, name="nvfp4_four_over_six", **{
        g: dataclasses.replace(base.gemm(g), a=four_six(base.gemm(g).a), b=four_six(base.gemm(g).b)) for g in GEMMS})


def nvfp4_plain() -> Recipe:
    """NVFP4 everywhere, 1x16 blocks, RTNE, no Hadamard, no BF16 layers: the naive recipe."""
    g = GemmSpec(a=_fp4(Format.NVFP4), b=_fp4(Format.NVFP4))
    return Recipe(name="nvfp4_plain", fprop=g, dgrad=g, wgrad=g)


def _mx_all(name: str, mode: MXScaleMode, wgrad_hadamard: HadamardMode = HadamardMode.NONE) -> Recipe:
    g = GemmSpec(a=_fp4(Format.MXFP4, mode), b=_fp4(Format.MXFP4, mode))
    wg = dataclasses.replace(g, hadamard=wgrad_hadamard, hadamard_size=32)
    return Recipe(name=name, fprop=g, dgrad=g, wgrad=wg)


def mxfp4() -> Recipe:
    """MXFP4 (OCP floor scales) on all three GEMMs, RTNE, no Hadamard."""
    return _mx_all("mxfp4", MXScaleMode.FLOOR)


def mxfp4_rceil() -> Recipe:
    """MXFP4 with rceil scales (ceil(log2(amax / 6)): never clips) on all three GEMMs."""
    return _mx_all("mxfp4_rceil", MXScaleMode.RCEIL)


def mxfp4_hadamard() -> Recipe:
    """MXFP4 floor on all GEMMs with a deterministic 32-point Hadamard on Wgrad (the AMD fix)."""
    return _mx_all("mxfp4_hadamard", MXScaleMode.FLOOR, HadamardMode.DETERMINISTIC)


def _progression(name: str, gemms: tuple[str, ...], fmt: str | Format) -> Recipe:
    fmt = Format.parse(fmt)
    g = GemmSpec(a=_fp4(fmt), b=_fp4(fmt))
    return Recipe(name=f"{name}_{fmt}" if fmt is not Format.MXFP4 else name, **{k: g for k in gemms})


def fprop(fmt: str | Format = Format.MXFP4) -> Recipe:
    """Only the forward GEMM quantized (the AMD study's first step), RTNE."""
    return _progression("fprop", ("fprop",), fmt)


def fprop_dgrad(fmt: str | Format = Format.MXFP4) -> Recipe:
    """Forward and input-gradient GEMMs quantized."""
    return _progression("fprop_dgrad", ("fprop", "dgrad"), fmt)


def fprop_dgrad_wgrad(fmt: str | Format = Format.MXFP4) -> Recipe:
    """All three GEMMs quantized: Wgrad quantization was the main cause of degradation."""
    return _progression("fprop_dgrad_wgrad", GEMMS, fmt)


PRESETS: dict[str, Callable[[], Recipe]] = {
    "bf16": bf16, "nvfp4": nvfp4, "nvfp4_four_over_six": nvfp4_four_over_six, "nvfp4_plain": nvfp4_plain,
    "mxfp4": mxfp4,
    "mxfp4_rceil": mxfp4_rceil, "mxfp4_hadamard": mxfp4_hadamard, "fprop": fprop,
    "fprop_dgrad": fprop_dgrad, "fprop_dgrad_wgrad": fprop_dgrad_wgrad,
}


def preset(name: str) -> Recipe:
    """The named preset's recipe (see PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown recipe preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]()
