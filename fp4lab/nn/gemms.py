"""The three GEMMs of an FP4 linear layer, written once: for one weight, and for a group of them.

Shape legend: S rows (tokens; an MoE's routed slots sorted by expert), K features in, N
features out, G groups (1 for a dense layer, E experts for an MoE projection).

    forward   fprop  y_g  = x_g @ W_g^T      x along K, W along K (16x16 tiles for NVIDIA's recipe)
    backward  dgrad  dx_g = dy_g @ W_g       dy along N, W along N (the columnwise copy)
              wgrad  dW_g = dy_g^T @ x_g     dy and x along S (tokens), rotated when asked

Group g is rows ``sizes[g]`` of x, times ``weight[g]``, under its own ``Call`` (its layer name,
hence its seeds and tensor scales): a grouped projection makes exactly the operands a loop of
dense layers would. Every operand is quantized from the high-precision tensor
(quant.quantize_operand), never from another quantized copy (TE's rowwise / columnwise scheme);
when fprop's and dgrad's weight operands are the same 16x16 RTNE tiles, dgrad multiplies
fprop's block values transposed instead of quantizing W again (the same values, tested). A
dense layer's x (fprop's and wgrad's copies) and dy (dgrad's and wgrad's) each give both of their
copies from one read where the kernel covers them (``Call.operand_pair``: the same bytes); x's
wgrad copy is then kept for the backward in place of x. A dithered weight is dithered once per
call and both GEMMs quantize it (its seed, like the others, from the SeedTable when there is one). For wgrad the token axis
is zero-padded to a multiple of 32 (zero rows add nothing to dy^T x); each group's wgrad
contracts over the group's own rows.

The seam ``_multiply`` takes one operand pair per group: a grouped projection's FP4 pairs go to
kernels.grouped_values_mm (all experts in one launch on the Triton backend); anything else runs
quant.run_gemm per pair (kernels.values_mm for two FP4 operands). Groups without rows are skipped
(their weight gradient is zero). A grouped projection's operands are quantized for all experts
at once where that gives the same bytes as one call per expert (no dither or statistics):
fprop's x and W and dgrad's dy along their rows without rotation
(kernels.quantize_grouped_values), wgrad's dy and x along their tokens, padded per expert and
rotated as the recipe says (kernels.quantize_grouped_columns), and then every expert's wgrad is
one launch (kernels.contraction_grouped_values_mm).

Where every GEMM takes that grouped path or stays BF16 on torch._grouped_mm
(``counts_stay_on_device``), a grouped call may be given its counts as a device tensor, the
routing's own: nothing reads them on the host, every launch is sized for any split of the rows
(empty groups cost no work and get a zero gradient), and seeds that draw come from the
SeedTable's slots, so a CUDA graph captures an FP4 MoE step. The bits are those of the same
counts as a list (tested).

``QuantContext`` is the small mutable state a trainer shares with every FP4 layer of a model:
the step ``tick`` (seeds stochastic rounding, random signs and dither, so a resumed run replays
exactly), the training ``progress`` (for ``bf16_after``), and operand statistics collection.

``gemms_forward`` and ``gemms_backward`` are the two halves, shared by the autograd function here
and the custom ops of nn.ops (what torch.compile traces).

Public: ``QuantContext``, ``Call``, ``make_call``, ``layer_calls``, ``call_at``, ``layer_key``, ``compute_dtype``,
``gemms_forward``, ``gemms_backward``, ``fp4_gemms``, ``counts_stay_on_device``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import kernels
from ..formats import Rounding
from ..kernels import BlockValues, GroupedValues, TransposedGroups
from ..kernels.host import env
from .quant import (Rotation, derive_seed, derive_seeds, dither, fuses_rotation, gemm_dtype, operand_knobs, quantize_operand,
                    rotation_for, run_gemm)
from .recipe import BF16_GEMM, GEMMS, HadamardMode, Recipe, recipe_rule
from .seeds import SeedTable

WGRAD_ROW_MULTIPLE = 32  # lcm of the block sizes (16, 32) and Hadamard sizes (16, 32)


@dataclass
class QuantContext:
    """State shared by a model's FP4 layers; the trainer advances it."""

    tick: int = 0
    """Micro-batch counter (step * accumulation + micro): seeds every random choice."""
    progress: float = 0.0
    """Fraction of training done, in [0, 1]: selects ``Recipe.at_progress``."""
    collect: bool = False
    """Record quant_stats of every quantized operand into ``stats`` (costs a sync per operand)."""
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """'<layer>.<gemm>.<a|b>' -> formats.quant_stats of that operand, from the last call."""
    forward_bf16: bool = False
    """Run every GEMM in BF16 whatever the recipe says (eager calls; meant for no-grad evaluation):
    the trainer's last evaluation of an FP4 run scores its weights served in BF16 too, which
    separates what FP4 did to the weights from what an FP4 forward costs at inference."""
    rank: int = 0
    """Data-parallel rank. Ranks > 0 fold it into every seed: with one stream on all ranks, the
    stochastic-rounding noise of their gradient shards would be correlated, and DDP's average
    would not shrink it as a single GPU's larger batch does. Rank 0 keeps single-GPU seeds."""
    seeds: SeedTable | None = field(default=None, repr=False, compare=False)
    """Where the dense layers' kernels read their seeds (nn.seeds): with a table, every seed of a
    step is a slot of one device buffer that setting ``tick`` refills, so a CUDA graph of the step
    replays with each step's own bits; None: seeds are kernel arguments."""
    traced_ops: bool = field(default=True, repr=False, compare=False)
    """Compiled, whether dense FP4 layers may take the traced ops, whose kernel launches Inductor
    makes (nn.ops.traceable says where they can). nn.swap.quantize_model sets it False for a model
    with grouped experts: its compiled forward may break into a frame per block (routing read on
    the host), and a traced layer drawing seeds is compiled per layer key, so past dynamo's
    recompile limit the later blocks would run eagerly; the opaque ops share one compilation."""
    kept_calls: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The layers' Calls where they do not change with the tick (``layer_calls``): made once per layer
    and recipe in force, not at every step."""
    clock: torch.Tensor = field(init=False, repr=False, compare=False)
    """[tick, progress] as a float64 CPU tensor, kept equal to the two fields: what the custom ops
    read, so a compiled model sees a tensor that changes rather than Python numbers to guard on
    (and recompile for) at every step. Exact for ticks below 2**53."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "clock", torch.tensor([float(self.tick), float(self.progress)], dtype=torch.float64))

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in ("tick", "progress") and "clock" in self.__dict__:
            self.clock[0 if name == "tick" else 1] = float(value)
        if name in ("tick", "seeds") and self.__dict__.get("seeds") is not None:
            self.seeds.fill(self.tick)


@dataclass(frozen=True)
class Call:
    """What one layer's call needs: the recipe in force, the seeds' root, where stats go."""

    recipe: Recipe
    name: str
    root: int | None  # derive_seed(recipe.seed, layer, tick[, rank]); None with a SeedTable (never read)
    stats: dict[str, dict[str, float]] | None
    layer: int = 0
    rank: int = 0
    seeds: SeedTable | None = field(default=None, compare=False)

    def seed_spec(self, gemm: str, side: str) -> tuple[int, int, int, int, int]:
        """What names this call's seed (gemm, side) in a SeedTable."""
        return self.recipe.seed, self.layer, self.rank, GEMMS.index(gemm), ord(side)

    def seed(self, gemm: str, side: str) -> int | torch.Tensor:
        """derive_seed(root, gemm, side): an int, or its slot in the context's SeedTable."""
        if self.seeds is not None:
            return self.seeds.seed(*self.seed_spec(gemm, side))
        if capturing():
            raise RuntimeError(f"{self.name or 'an FP4 layer'}: an int seed would be frozen into the CUDA graph "
                               "being captured, repeating one step's random bits at every replay (give the "
                               "QuantContext a SeedTable)")
        return derive_seed(self.root, GEMMS.index(gemm), ord(side))

    def rounding_seed(self, gemm: str, side: str) -> int | torch.Tensor:
        """The seed operand ``side`` of ``gemm`` rounds with: Call.seed where it rounds
        stochastically; 0 where nearest-even rounding draws nothing (no seed derived, no table
        slot spent: the quantizers ignore it)."""
        return self.seed(gemm, side) if getattr(self.recipe.gemm(gemm), side).rounding is Rounding.STOCHASTIC else 0

    def rotation(self, gemm: str) -> Rotation | None:
        """The Hadamard rotation of ``gemm``'s operands at this call (its random signs re-drawn per call)."""
        spec = self.recipe.gemm(gemm)
        step_seed = self.seed(gemm, "h") if spec.hadamard is HadamardMode.RANDOM else 0  # the only user
        return rotation_for(spec, self.recipe.seed, step_seed)

    def operand(self, t: torch.Tensor, axis: int, gemm: str, side: str, *, codes: bool = False):
        """t quantized (and rotated) as ``gemm``'s operand ``side`` says (quant.quantize_operand)."""
        return quantize_operand(t, axis, getattr(self.recipe.gemm(gemm), side), seed=self.rounding_seed(gemm, side),
                                rotation=self.rotation(gemm), stats=self.stats, key=f"{self.name}.{gemm}.{side}",
                                codes=codes)

    def operand_pair(self, t: torch.Tensor, rows: tuple[str, str], columns: tuple[str, str],
                     partners: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                     ) -> tuple[BlockValues, BlockValues] | None:
        """t [M, K]'s two copies, one read serving both (kernels.quantize_values_pair): the operand
        (gemm, side) ``rows`` along K, and ``columns`` along the tokens (t zero-padded to a multiple
        of 32 rows, as wgrad pads): the bytes of the two Call.operand calls. None where the pair
        does not apply (statistics, dither, 16x16 blocks, a rotated rows copy, a rotation the
        quantizer does not fuse, two formats) and the caller quantizes each on its own; also None
        under FP4LAB_PAIR=0, one copy at a time by choice (the same bytes: a fallback, not a recipe).
        ``partners``: each copy's GEMM partner's tensor scale, where known (kernels.quantize_values_pair)."""
        if (self.stats is not None or env("FP4LAB_PAIR", "1").lower() in ("0", "false", "off", "no")
                or not pair_applies(self.recipe, t, rows, columns)):
            return None
        (gr, sr), (gc, sc) = rows, columns
        op_r, op_c = getattr(self.recipe.gemm(gr), sr), getattr(self.recipe.gemm(gc), sc)
        rotation = self.rotation(gc)
        return kernels.quantize_values_pair(
            t, op_r.format, rows=dict(rounding=op_r.rounding, seed=self.rounding_seed(gr, sr), **operand_knobs(op_r)),
            columns=dict(rounding=op_c.rounding, seed=self.rounding_seed(gc, sc), **operand_knobs(op_c, rotation)),
            columns_len=t.shape[0] + (-t.shape[0] % WGRAD_ROW_MULTIPLE), partners=partners)

    def weight_source(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight fprop and dgrad quantize: dithered once per call when the recipe asks."""
        spec = self.recipe.fprop.b
        if not spec.dither:
            return weight
        return dither(weight, spec, self.seed("fprop", "d"))  # (Call.seed refuses an int seed under capture)

    def dgrad_reuses_fprop_weight(self) -> bool:
        """fprop's and dgrad's weight operands are the same 16x16 RTNE tiles of the same tensor, so
        dgrad can multiply fprop's block values transposed instead of quantizing W again (operand
        statistics want dgrad's own quantization recorded)."""
        return self.stats is None and _weight_tiles_shared(self.recipe)


def pair_applies(recipe: Recipe, t: torch.Tensor, rows: tuple[str, str], columns: tuple[str, str]) -> bool:
    """Call.operand_pair's rule, from the recipe and t's rank alone (no seeds drawn, no
    environment read): both copies quantized in one format, 1-row blocks, no dither, the rows copy
    unrotated and the columns copy's rotation one its quantizer fuses."""
    return t.dim() == 2 and _pair_rule(recipe, rows, columns)


@recipe_rule
def _pair_rule(recipe: Recipe, rows: tuple[str, str], columns: tuple[str, str]) -> bool:
    """pair_applies for a matrix."""
    (gr, sr), (gc, sc) = rows, columns
    op_r, op_c = getattr(recipe.gemm(gr), sr), getattr(recipe.gemm(gc), sc)
    rotation = rotation_for(recipe.gemm(gc), recipe.seed, 0)  # its size and signs' rule (the seed decides neither)
    return (op_r.quantized and op_c.quantized and op_r.format is op_c.format
            and not (op_r.block2d or op_c.block2d or op_r.dither or op_c.dither or recipe.gemm(gr).rotated)
            and (rotation is None or fuses_rotation(op_c, rotation)))


def keeps_x_wgrad(recipe: Recipe, x: torch.Tensor, grouped: bool, keep_x: bool) -> bool:
    """Whether a dense layer's forward under ``recipe`` (at any progress) makes wgrad's copy of x
    for its backward: fprop and wgrad emulated, the two copies of x pairing (pair_applies), a
    recipe that stays itself all run (no ``bf16_after``). What the custom ops decide their outputs
    by before running (nn.ops): from the recipe and the arguments alone, so a compiled graph's plan
    holds whatever the environment says later (FP4LAB_PAIR=0 makes the copy apart, the same bytes:
    x_wgrad_operand)."""
    return (keep_x and not grouped and recipe.bf16_after is None and recipe.fprop.emulated and recipe.wgrad.emulated
            and pair_applies(recipe, x, ("fprop", "a"), ("wgrad", "b")))


def keeps_w_values(recipe: Recipe, grouped: bool, keep_w: bool, *, every_group_live: bool = True,
                   n: int = 16) -> bool:
    """Whether a layer's forward under ``recipe`` (at any progress) hands its backward fprop's
    weight block values for dgrad to multiply transposed (Call.dgrad_reuses_fprop_weight's rule,
    without statistics: the custom ops collect none), decided, as keeps_x_wgrad is, from the
    recipe and the arguments alone. A grouped layer's are every expert's tiles from one launch
    (_fprop_weights_at_once), made where every expert has rows (``every_group_live``: device
    counts, or host sizes none of them 0), the weight is undithered and its ``n`` rows a group
    are whole 16-row tiles."""
    if not (keep_w and recipe.bf16_after is None and recipe.fprop.emulated and recipe.dgrad.emulated
            and _weight_tiles_shared(recipe)):
        return False
    return not grouped or (every_group_live and n % 16 == 0 and recipe.fprop.b.quantized
                           and not recipe.fprop.b.dither)


@recipe_rule
def _weight_tiles_shared(recipe: Recipe) -> bool:
    """fprop's and dgrad's weight operands are the same 16x16 RTNE tiles of the same tensor."""
    f, d = recipe.fprop, recipe.dgrad
    return (f.b == d.b and f.b.block2d and f.b.rounding is Rounding.RTNE and not f.rotated and not d.rotated
            and d.a.quantized)


@recipe_rule
def kernels_only(recipe: Recipe) -> bool:
    """Whether every GEMM of ``recipe`` is an FP4 x FP4 product whose operands fp4lab's kernels make
    alone: both sides quantized, no dither, any rotation fused into the quantize. A traced op's
    body (nn.ops) then holds no torch arithmetic for Inductor to lower its own way (a BF16 matmul,
    a dither's or an unfused rotation's float math, which it may fuse and round differently), so
    its bits are the eager path's."""
    for g in GEMMS:
        spec = recipe.gemm(g)
        rotation = rotation_for(spec, recipe.seed, 0)
        for op in (spec.a, spec.b):
            if not op.quantized or op.dither or (rotation is not None and not fuses_rotation(op, rotation)):
                return False
    return True


@recipe_rule
def draws_seeds(recipe: Recipe) -> bool:
    """Whether any GEMM of ``recipe`` draws a seed (Call.seed): stochastic rounding, a dithered
    weight, or random Hadamard signs re-drawn per call."""
    return any(op.rounding is Rounding.STOCHASTIC or op.dither or recipe.gemm(g).hadamard is HadamardMode.RANDOM
               for g in GEMMS for op in (recipe.gemm(g).a, recipe.gemm(g).b))


def w_values_shape(weight: torch.Tensor) -> tuple[int, int]:
    """The stored shape of a [N, K] weight's 16x16-tiled block values, both axes padded to 16; of a
    [G, N, K] one's (every expert's, N a multiple of 16), the experts' tiles stacked: [G N, K padded]."""
    n, k = weight.shape[-2:]
    return math.prod(weight.shape[:-2]) * (n + (-n % 16)), k + (-k % 16)


def x_wgrad_operand(x: torch.Tensor, call: Call) -> BlockValues:
    """wgrad's copy of a dense layer's x made on its own: what the pair's columns copy holds."""
    return call.operand(_pad_rows(x), 0, "wgrad", "b")


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this stream: int seeds made now would be frozen
    into it (nn.seeds is the capturable form)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _group_seeds(calls: list[Call], gemm: str, side: str) -> list[int] | torch.Tensor:
    """[c.seed(gemm, side) for c in calls]: derived for every group in one array pass, or with a
    SeedTable the groups' slots as one device tensor (what a captured grouped launch reads); a
    layer's kept Calls (layer_calls) keep those slots, looked up once."""
    table = calls[0].seeds
    if table is None:
        return derive_seeds([c.root for c in calls], GEMMS.index(gemm), ord(side))
    kept = getattr(calls, "slots", None)
    if kept is None:
        return table.seeds([c.seed_spec(gemm, side) for c in calls])
    slots = kept.get((gemm, side))
    if slots is None:
        slots = kept[(gemm, side)] = [table.slot(*c.seed_spec(gemm, side)) for c in calls]
    return table.at_slots(slots)


def _drawn_seeds(calls: list[Call], gemm: str, side: str, op) -> list[int] | torch.Tensor:
    """_group_seeds where the operand draws (stochastic rounding), else zeros: what the kernels
    read for a rounding that draws nothing (and no table slot is spent on it)."""
    return _group_seeds(calls, gemm, side) if op.rounding is Rounding.STOCHASTIC else [0] * len(calls)


def _group_rotation_seeds(calls: list[Call], gemm: str) -> list[int]:
    """[c.rotation(gemm).seed for c in calls] where ``gemm`` rotates: per-call random signs
    re-drawn for every group at once; any other rotation's seed is the recipe's, shared."""
    if calls[0].recipe.gemm(gemm).hadamard is HadamardMode.RANDOM:
        return _group_seeds(calls, gemm, "h")
    return [calls[0].rotation(gemm).seed] * len(calls)


@torch.compiler.assume_constant_result  # a constant per layer: torch.compile folds it instead of tracing crc32
def layer_key(name: str) -> int:
    """A stable integer per module name: seeds differ per layer and survive reordering."""
    return zlib.crc32(name.encode())


def make_call(recipe: Recipe, name: str, context: QuantContext) -> Call:
    """The Call of layer ``name`` at the context's tick (the recipe in force at its progress;
    every GEMM in BF16 under ``context.forward_bf16``)."""
    call = call_at(recipe, layer_key(name), context.tick, context.progress, context.rank, name=name,
                   stats=context.stats if context.collect else None, seeds=context.seeds)
    if context.forward_bf16:  # an evaluation: no backward follows, so every GEMM goes BF16 (the
        # recipe's own checks tie dgrad's dithered weight to fprop's)
        call = dataclasses.replace(call, recipe=dataclasses.replace(call.recipe, **{g: BF16_GEMM for g in GEMMS}))
    return call


_KEPT_CALLS = 1024  # layers x recipes in force a context keeps Calls for (a model has a few hundred)


def layer_calls(recipe: Recipe, names: list[str], context: QuantContext) -> list[Call]:
    """[make_call(recipe, n, context) for n in names], the Calls of a layer's groups (one for a
    dense layer, one per expert). Where every seed is a slot of the context's SeedTable, a Call
    holds nothing that changes with the tick (the table refills its slots), so the list is made
    once per layer and recipe in force and kept on the context: an MoE projection's 64 experts
    would otherwise cost 64 Calls, names hashed and seeds derived, at every step. Their ``root``
    is None there (a seed taken from it would be a bug, and fails loudly)."""
    seeds = context.seeds
    if seeds is None or context.collect or context.forward_bf16:
        return [make_call(recipe, n, context) for n in names]
    key = (tuple(names), id(recipe), recipe.switched_at(context.progress), context.rank)
    kept = context.kept_calls.get(key)
    if kept is None or kept[0] is not recipe or kept[1] is not seeds:  # (ids of freed objects reused)
        # bounded: a caller making a new recipe object at every call (the functional API) would
        # otherwise add an entry a call, and entries of a replaced table would keep it alive
        if len(context.kept_calls) >= _KEPT_CALLS or any(k[1] is not seeds for k in context.kept_calls.values()):
            context.kept_calls.clear()
        in_force = recipe.at_progress(context.progress)
        made = _KeptCalls(Call(recipe=in_force, name=n, root=None, stats=None, layer=layer_key(n), rank=context.rank,
                               seeds=seeds) for n in names)
        kept = context.kept_calls[key] = (recipe, seeds, made)
    return kept[2]


class _KeptCalls(list):
    """layer_calls' kept Calls, and the SeedTable slots of each operand their groups draw from,
    (gemm, side) -> a slot per group (_group_seeds): a slot never moves once drawn, so a grouped
    launch's seeds are the slots read off the table's current buffer, without 64 lookups a step."""

    def __init__(self, calls) -> None:
        super().__init__(calls)
        self.slots: dict[tuple[str, str], list[int]] = {}


def call_at(recipe: Recipe, layer: int, tick: int, progress: float, rank: int, *, name: str = "",
            stats: dict[str, dict[str, float]] | None = None, seeds: SeedTable | None = None) -> Call:
    """The Call of the layer keyed ``layer`` at ``tick`` and ``progress``, on data-parallel ``rank``
    (its seeds drawn from ``seeds`` where given)."""
    parts = (recipe.seed, layer, tick) + ((rank,) if rank else ())
    return Call(recipe=recipe.at_progress(progress), name=name, root=derive_seed(*parts), stats=stats, layer=layer,
                rank=rank, seeds=seeds)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in: autocast's when it is on for x's device, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % WGRAD_ROW_MULTIPLE
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _all_at_once(t: torch.Tensor, rows: list[int] | torch.Tensor, calls: list[Call], gemm: str, side: str
                 ) -> GroupedValues | None:
    """Every group's operand ``side`` of ``gemm`` from t's rows (``rows`` each: ints, or counts on
    the device) in one grouped quantize, where that is the same as one Call.operand per group:
    quantized along the rows, no rotation, dither or statistics (else None: the caller quantizes
    per group)."""
    if not len(rows) or t.shape[1] == 0 or not _groupable(calls[0], gemm, side, rows):
        return None
    op = getattr(calls[0].recipe.gemm(gemm), side)
    return kernels.quantize_grouped_values(t, op.format, rows, _drawn_seeds(calls, gemm, side, op),
                                           rounding=op.rounding, pad=True, **operand_knobs(op))


def _groupable(call: Call, gemm: str, side: str, rows: list[int] | torch.Tensor | None = None) -> bool:
    """_all_at_once's rule: the operand quantized along its rows for every group in one launch
    (16x16 tiles only where every group is whole tiles: never on device counts, unread)."""
    spec = call.recipe.gemm(gemm)
    op = getattr(spec, side)
    tiles_fit = not op.block2d or (rows is not None and not isinstance(rows, torch.Tensor)
                                   and not any(n % 16 for n in rows))
    return op.quantized and not spec.rotated and not op.dither and call.stats is None and tiles_fit


def _fprop_weights_at_once(weight: torch.Tensor, calls: list[Call]) -> GroupedValues | None:
    """fprop's weight operand of every expert ([G, N, K], each with rows) in one grouped quantize,
    where _all_at_once allows it (else None)."""
    if len(calls) != weight.shape[0]:  # an expert without rows: the per-expert path
        return None
    return _all_at_once(weight.reshape(-1, weight.shape[2]), [weight.shape[1]] * len(calls), calls, "fprop", "b")


def _wgrad_all_at_once(dy: torch.Tensor, x: torch.Tensor, rows: list[int], calls: list[Call]
                       ) -> tuple[GroupedValues, GroupedValues] | None:
    """Every group's wgrad operands (dy_g and x_g along their tokens, each padded to a multiple of
    32 as the per-group path pads them) in one grouped quantize per side, where that is the same
    as Call.operand per group: both sides FP4 in 1-row blocks, any rotation fused into the
    quantize, no statistics (else None)."""
    if not len(rows) or dy.shape[1] == 0 or x.shape[1] == 0 or dy.dtype != x.dtype \
            or not _wgrad_groupable(calls[0], dy.dtype):
        return None
    spec, rotation = calls[0].recipe.wgrad, calls[0].rotation("wgrad")
    m = WGRAD_ROW_MULTIPLE
    widths = (rows + m - 1) // m * m if isinstance(rows, torch.Tensor) else [n + (-n % m) for n in rows]
    h_seeds = _group_rotation_seeds(calls, "wgrad") if rotation is not None else None
    # read in place from the routed rows, each expert's padding as zeros (no padded copy first)
    a, b = (kernels.quantize_grouped_columns(
        t, op.format, widths, _drawn_seeds(calls, "wgrad", side, op), rows=rows,
        hadamard=None if rotation is None else rotation.signs, hadamard_seeds=h_seeds, rounding=op.rounding,
        **operand_knobs(op)) for t, side, op in ((dy, "a", spec.a), (x, "b", spec.b)))
    return a, b


def _wgrad_groupable(call: Call, dtype: torch.dtype) -> bool:
    """_wgrad_all_at_once's rule: both sides FP4 in 1-row blocks, undithered, any rotation fused
    into the grouped quantize (which rotates float32 and bf16), no statistics. (Whether it fuses
    does not depend on the signs' seed: none is drawn here, so the rule runs under capture too.)"""
    spec = call.recipe.wgrad
    rotation = rotation_for(spec, call.recipe.seed, 0)
    fused = dtype in (torch.float32, torch.bfloat16)
    return call.stats is None and all(
        op.quantized and not op.block2d and not op.dither
        and (rotation is None or fused and fuses_rotation(op, rotation)) for op in (spec.a, spec.b))


def _tensor_scale(ops: list | GroupedValues | None) -> torch.Tensor | None:
    """The tensor scale of a dense GEMM's one FP4 operand (a pair's partner), else None."""
    if isinstance(ops, list) and len(ops) == 1 and isinstance(ops[0], BlockValues):
        return ops[0].tensor_scale
    return None


def _listed(ops: list | GroupedValues | TransposedGroups) -> list:
    if isinstance(ops, TransposedGroups):
        ops = ops.copied()
    return ops.groups() if isinstance(ops, GroupedValues) else ops


def _multiply(a: list | GroupedValues, a_axis: int, b: list | GroupedValues, b_axis: int, grouped: bool,
              shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """The seam: rows of pair g = A_g @ B_g^T, stacked -> ``shape`` in like's dtype."""
    if not isinstance(a, GroupedValues) and not a:
        return like.new_zeros(shape)
    fp4 = all(isinstance(ops, (GroupedValues, TransposedGroups)) or all(isinstance(v, BlockValues) for v in ops)
              for ops in (a, b))
    if grouped and fp4:  # all experts in one launch
        return kernels.grouped_values_mm(a, b, out_dtype=gemm_dtype(like.dtype)).to(like.dtype)
    a, b = _listed(a), _listed(b)
    out = [run_gemm(va, a_axis, vb, b_axis, like.dtype) for va, vb in zip(a, b)]
    return out[0] if len(out) == 1 else torch.cat(out)


def gemms_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | torch.Tensor,
                  calls: list[Call], grouped: bool, *, keep: bool = False, keep_x: bool = False
                  ) -> tuple[torch.Tensor, dict]:
    """fprop -> (y, what backward may reuse: with ``keep``, dithered weights and fprop's weight
    operands when dgrad can multiply them transposed; with ``keep_x`` (a weight gradient follows),
    wgrad's copy of a dense layer's x, made in the same read as fprop's: ``x_wgrad``). ``sizes``
    as a device tensor (grouped, where counts_stay_on_device allows it): never read on the host."""
    # x: [S, K], weight: [G, N, K], bias: [N] | None (dense only) -> y: [S, N]
    live = _live(sizes, grouped)
    live_calls = calls if len(live) == len(calls) else [calls[g] for g in live]  # (kept: layer_calls)
    xs = _split(x, sizes, live, grouped)
    w_src = None  # each group's weight as fprop quantizes it (_weight_sources), made where used
    fprop = calls[0].recipe.fprop
    saved = {}
    # ---- fprop: y = x @ W^T, contraction over K
    w_fprop = None
    if fprop.emulated:
        # every expert's weights at once where all have rows (the weight as it is: a dithered one is refused)
        w_fprop = grouped and _fprop_weights_at_once(weight, live_calls)
        if not w_fprop:
            w_src = _weight_sources(weight, calls, live)
            w_fprop = [calls[g].operand(w, 1, "fprop", "b") for g, w in zip(live, w_src)]
        a = grouped and _all_at_once(x, _rows(sizes, live), live_calls, "fprop", "a")
        if not grouped and keep_x and calls[0].recipe.wgrad.emulated:
            pair = calls[0].operand_pair(x, ("fprop", "a"), ("wgrad", "b"), (_tensor_scale(w_fprop), None))
            if pair is not None:
                a, saved["x_wgrad"] = [pair[0]], pair[1]
        a = a or [calls[g].operand(xg, 1, "fprop", "a") for g, xg in zip(live, xs)]
        y = _multiply(a, 1, w_fprop, 1, grouped, (x.shape[0], weight.shape[1]), x)
        y = y if bias is None else y + bias
    elif grouped and _bf16_grouped(x, weight, calls):
        y = torch._grouped_mm(x.contiguous(), weight.contiguous().transpose(-2, -1), offs=_offsets(sizes, x.device))
    elif grouped:
        w_src = _weight_sources(weight, calls, live)
        y = torch.cat([F.linear(xg, w) for xg, w in zip(xs, w_src)]) if live else x.new_zeros(
            x.shape[0], weight.shape[1])
    else:
        w_src = _weight_sources(weight, calls, live)
        y = F.linear(x, w_src[0], bias)
    if keep:  # dithered copies (else weight[g] itself)
        saved["w_src"] = (w_src or _weight_sources(weight, calls, live)) if fprop.b.dither else None
        reuse = w_fprop is not None and calls[0].dgrad_reuses_fprop_weight()
        saved["w_values"] = w_fprop if reuse else None
    return y, saved


def _weight_sources(weight: torch.Tensor, calls: list[Call], live: list[int]) -> list[torch.Tensor]:
    """Each live group's weight as fprop and dgrad quantize it (Call.weight_source: dithered where
    the recipe asks). Made only where a per-group path reads them: a grouped launch takes the
    [G, N, K] weight whole, and 64 experts' views cost 64 torch calls, forward and backward."""
    return [calls[g].weight_source(weight[g]) for g in live]


def gemms_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, sizes: list[int], calls: list[Call],
                   grouped: bool, *, need_dx: bool, need_dw: bool, saved: dict | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dgrad and wgrad -> (dx [S, K] or None, dW [G, N, K] or None); ``saved`` is what
    gemms_forward kept (without it, dithered weights are made again from their seeds)."""
    saved = saved or {}
    live = _live(sizes, grouped)
    live_calls = calls if len(live) == len(calls) else [calls[g] for g in live]  # (kept: layer_calls)
    w_src = saved.get("w_src")  # (None: made where used, _weight_sources)
    w_values = saved.get("w_values")
    if w_values is None and need_dx and grouped and calls[0].dgrad_reuses_fprop_weight():
        # nothing kept (a caller that saved nothing; nn.ops keeps them where every expert has rows):
        # fprop's tiles of every expert made again in one launch and transposed, rather than each
        # expert's weight quantized along N on its own
        w_values = _fprop_weights_at_once(weight, live_calls)
    rows = _rows(sizes, live)
    xs, dys = _split(x, sizes, live, grouped), _split(dy, sizes, live, grouped)
    dgrad, wgrad = calls[0].recipe.dgrad, calls[0].recipe.wgrad
    offs = _offsets(sizes, dy.device) if grouped and _bf16_grouped(dy, weight, calls) else None
    dx = dw = w_ops = None
    if need_dx and dgrad.emulated:  # (before dy's copies: dgrad's alpha is written with them)
        k = weight.shape[2]
        if isinstance(w_values, GroupedValues):  # every expert's tiles, read transposed in place
            w_ops = TransposedGroups(w_values, k)
        elif w_values is not None:
            w_ops = [v.transposed(k) for v in w_values]
        else:
            w_src = w_src or _weight_sources(weight, calls, live)
            w_ops = [calls[g].operand(w, 0, "dgrad", "b") for g, w in zip(live, w_src)]
    # a dense layer quantizing dy for both dgrad and wgrad reads it once for both copies
    dy_pair = (not grouped and need_dx and need_dw and dgrad.emulated and wgrad.emulated
               and calls[0].operand_pair(dy, ("dgrad", "a"), ("wgrad", "a"),
                                         (_tensor_scale(w_ops), _tensor_scale([saved.get("x_wgrad")])))
               or None)
    # ---- dgrad: dx = dy @ W, contraction over N
    if need_dx:
        if dgrad.emulated:
            a = [dy_pair[0]] if dy_pair else grouped and _all_at_once(dy, rows, live_calls, "dgrad", "a")
            a = a or [calls[g].operand(dyg, 1, "dgrad", "a") for g, dyg in zip(live, dys)]
            dx = _multiply(a, 1, w_ops, 0, grouped, tuple(x.shape), dy)
        elif offs is not None:  # the kernel takes row- or column-major strides only
            dx = torch._grouped_mm(dy.contiguous(), weight.contiguous(), offs=offs)
        else:
            dx = torch.cat([dyg.mm(weight[g]) for g, dyg in zip(live, dys)]) if live else torch.zeros_like(x)
    # ---- wgrad: dW = dy^T @ x, contraction over the group's tokens
    if need_dw and offs is not None and not wgrad.emulated:
        # one launch for every expert, its contraction split at the groups' row offsets
        dw = torch._grouped_mm(dy.contiguous().t(), x.contiguous(), offs=offs)
        # an expert without rows gets an exact zero gradient, whatever the kernel leaves
        if isinstance(sizes, torch.Tensor):
            dw.masked_fill_((sizes == 0)[:, None, None], 0)
        else:
            for g, n in enumerate(sizes):
                if not n:
                    dw[g].zero_()
    elif need_dw and grouped and (pair := _wgrad_all_at_once(dy, x, rows, live_calls)) is not None:
        # one launch for every expert, each contracting its own (padded) tokens
        dw_live = kernels.contraction_grouped_values_mm(*pair, out_dtype=gemm_dtype(dy.dtype)).to(dy.dtype)
        if len(live) == weight.shape[0] and dw_live.dtype == weight.dtype:
            dw = dw_live
        else:
            dw = torch.zeros_like(weight)
            dw[live] = dw_live.to(weight.dtype)
    elif need_dw:
        dw = torch.zeros_like(weight) if grouped else None
        for g, dyg, xg in zip(live, dys, xs):
            if wgrad.emulated:  # (a dense layer's copies may come from the reads that served fprop and dgrad)
                a = dy_pair[1] if dy_pair else calls[g].operand(_pad_rows(dyg), 0, "wgrad", "a")
                b = saved.get("x_wgrad") or x_wgrad_operand(xg, calls[g])
                dw_g = run_gemm(a, 0, b, 0, dy.dtype)
            else:
                dw_g = dyg.t().mm(xg)
            if grouped:
                dw[g] = dw_g
            else:
                dw = dw_g[None]
    return dx, dw


def _bf16_grouped(a: torch.Tensor, weight: torch.Tensor, calls: list[Call]) -> bool:
    """A grouped GEMM left in BF16 runs as one torch._grouped_mm (the MoE baseline as users run it)
    where that kernel runs: CUDA sm_90+, BF16 operands whose rows are 16-byte aligned, and the fast
    backend; the reference backend keeps the per-expert loop, bit for bit what a loop of dense
    layers computes. The undithered weight only (a dithered one is per-expert work anyway)."""
    return a.dtype == weight.dtype and _bf16_grouped_runs(calls[0].recipe, a.device, a.dtype, *weight.shape[-2:])


def _bf16_grouped_runs(recipe: Recipe, device: torch.device, dtype: torch.dtype, n: int, k: int) -> bool:
    """_bf16_grouped's rule for a weight [G, n, k] on ``device`` in ``dtype``."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and not recipe.fprop.b.dither and n % 8 == 0 and k % 8 == 0
            and torch.cuda.get_device_capability(device) >= (9, 0) and kernels.uses_triton(device))


def counts_stay_on_device(recipe: Recipe, device: torch.device, dtype: torch.dtype, n: int, k: int, *,
                          collect: bool = False) -> bool:
    """Whether a grouped call under ``recipe`` (the one in force: Recipe.at_progress) with weights
    [G, n, k] can take its groups' counts as a device tensor, never read on the host (what a CUDA
    graph captures): the Triton kernels run, and each GEMM either stays BF16 on one
    torch._grouped_mm or quantizes every group's activations in one launch (the all-at-once
    rules; weights may go expert by expert). Operand statistics are read on the host: never."""
    if collect or not kernels.uses_triton(device):
        return False
    probe = Call(recipe=recipe, name="", root=0, stats=None)
    bf16 = _bf16_grouped_runs(recipe, device, dtype, n, k)
    both = {g: recipe.gemm(g).a.quantized and recipe.gemm(g).b.quantized for g in GEMMS}  # (grouped_values_mm)
    return ((both["fprop"] and _groupable(probe, "fprop", "a") if recipe.fprop.emulated else bf16)
            and (both["dgrad"] and _groupable(probe, "dgrad", "a") if recipe.dgrad.emulated else bf16)
            and (_wgrad_groupable(probe, dtype) if recipe.wgrad.emulated else bf16))


def _offsets(sizes: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Groups' end rows, as torch._grouped_mm takes them (int32 cumulative counts)."""
    counts = sizes if isinstance(sizes, torch.Tensor) else torch.tensor(sizes, dtype=torch.int64)
    return counts.cumsum(0).to(device=device, dtype=torch.int32)


def _live(sizes: list[int] | torch.Tensor, grouped: bool) -> list[int]:
    """The groups with rows (a dense layer's one group always counts); every group where the
    counts stay on the device (an empty one costs nothing and gets a zero gradient)."""
    if isinstance(sizes, torch.Tensor):
        return list(range(len(sizes)))
    return [g for g, rows in enumerate(sizes) if rows or not grouped]


def _rows(sizes: list[int] | torch.Tensor, live: list[int]) -> list[int] | torch.Tensor:
    """The live groups' rows: host ints, or the device counts themselves (every group is live)."""
    return sizes if isinstance(sizes, torch.Tensor) else [sizes[g] for g in live]


def _split(t: torch.Tensor, sizes: list[int] | torch.Tensor, live: list[int], grouped: bool) -> list[torch.Tensor]:
    """t's rows per live group, for the paths that work group by group; device counts have none
    (counts_stay_on_device admits only calls that never take them)."""
    if not grouped:
        return [t]
    if isinstance(sizes, torch.Tensor):
        return _NoSplit()
    return list(t.split([sizes[g] for g in live]))


class _NoSplit(list):
    """What _split gives for device counts: any use is a bug in counts_stay_on_device's rule."""

    def __iter__(self):
        raise RuntimeError("a grouped call with device counts took a per-group path: counts_stay_on_device "
                           "admitted a recipe it cannot run")


class _FP4GemmsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                calls: list[Call], grouped: bool, training: bool):
        # a dense layer's x [..., K] and weight [N, K] are flattened to [S, K] and [1, N, K] here, where
        # no autograd node records it (three view nodes a layer otherwise: each an engine step in backward)
        ctx.shapes = (x.shape, weight.shape)
        x, weight = x.reshape(-1, x.shape[-1]), (weight if weight.dim() == 3 else weight[None])
        # (grad mode is off inside forward, and needs_input_grad ignores it: the caller says)
        y, ctx.saved = gemms_forward(x, weight, bias, sizes, calls, grouped, keep=ctx.needs_input_grad[0],
                                     keep_x=training and ctx.needs_input_grad[1])
        # wgrad's copy of x goes through save_for_backward like x would (freed after the backward,
        # seen by checkpointing and offload hooks); with it kept, backward needs only x's shape
        xw = ctx.saved.pop("x_wgrad", None)
        ctx.save_for_backward(x if xw is None else None, weight, *(() if xw is None else (xw.values, xw.tensor_scale)))
        ctx.x_wgrad = None if xw is None else (xw.rows, xw.format)
        ctx.x_like = None if xw is None else torch.empty(x.shape, dtype=x.dtype, device="meta")  # (x's shape)
        ctx.sizes, ctx.calls, ctx.grouped, ctx.has_bias = sizes, calls, grouped, bias is not None
        # (detached: a view made here would be an output autograd forbids modifying in place, and
        # a residual add or an in-place activation after the layer does just that)
        return y.reshape(*ctx.shapes[0][:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, *xw = ctx.saved_tensors
        saved = ctx.saved  # (a local dict: nothing of this backward stays on ctx)
        if ctx.x_wgrad is not None:
            x, saved = ctx.x_like, {**saved, "x_wgrad": BlockValues(xw[0], xw[1], *ctx.x_wgrad)}
        dy = dy.reshape(-1, dy.shape[-1])
        dx, dw = gemms_backward(dy, x, weight, ctx.sizes, ctx.calls, ctx.grouped, need_dx=ctx.needs_input_grad[0],
                                need_dw=ctx.needs_input_grad[1], saved=saved)
        x_shape, w_shape = ctx.shapes
        dx = None if dx is None else dx.reshape(x_shape)
        dw = None if dw is None else dw.reshape(w_shape)
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


def fp4_gemms(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
              calls: list[Call], *, grouped: bool) -> torch.Tensor:
    """x: [S, K], weight: [G, N, K] (G = 1 unless ``grouped``), bias: [N] | None, all in the
    compute dtype -> y: [S, N]: group g's ``sizes[g]`` rows times weight[g]^T, the three GEMMs
    under ``calls[g]`` (see the module doc). The recipe in force is calls[0]'s for every group.
    A dense call may also give x as [..., K] and weight as [N, K] (y is then [..., N]): flattened
    inside the autograd function, so no view of them enters the autograd graph."""
    sizes = sizes if isinstance(sizes, torch.Tensor) else list(sizes)
    calls = calls if isinstance(calls, _KeptCalls) else list(calls)  # (kept ones keep their slots: _group_seeds)
    return _FP4GemmsFn.apply(x, weight, bias, sizes, calls, grouped, torch.is_grad_enabled())
