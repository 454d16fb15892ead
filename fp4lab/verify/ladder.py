"""The exact rungs of check_gemm: operands whose every output is known exactly, each built to
expose one class of bug, with a diagnosis that names the row, block, element or scale position.

Every rung compares the candidate with formats.scaled_mm bit for bit: all values below are
exact in fp32, whatever the summation order. E2M1 code 2 is 1.0, code 3 is 1.5; "one" is the
scale byte of 1.0 (E4M3 0x38, UE8M0 127); bl is the block length (16 or 32), nb = K / bl.

    uniform          every code 1.5, every scale 1, alpha 1: C = 2.25 K everywhere. Catches
                     a broken K loop (the diagnosis says how many products were summed).
    alpha            the same with alpha = 0.375: alpha missing, applied twice, or inverted.
    identity         A row i holds a single 1.0 at column c_i (passes walk every column), B
                     holds values that differ from their neighbours c ^ 1 and c +- bl, so
                     C[i, j] = B[j, c_i]. The diagnosis tries rules that must explain every
                     output of the pass: element c ^ 1 read (nibble order swapped in one
                     operand), else one constant shift c + d (d = +-bl: block off by one).
    one_hot          A row i is zero except block b_i = i % nb (all 1.0); B's block b holds
                     1 + b % bl ones, so C[i, j] = 1 + b_i % bl names the block of B that met
                     A's block (a constant shift over all rows is reported); 0 means A's block
                     was read from elsewhere.
    scale_positions  pass p: A row i is one-hot at block (i + p) % nb, every A scale byte
                     encodes its position (digits of r * nb + b), B is all ones: C[i, :] is
                     bl times the one scale read for (i, (i + p) % nb). nb passes probe every
                     position; a wrong one is decoded back to the position (and swizzled offset)
                     whose byte was read. Then the same for B's scales.

Public: ``Ladder``, ``RUNGS``, ``ContractError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..formats import Format, ScaleLayout, decode_e2m1, swizzled_offset
from .layout import describe_offset

ONE, ONE_HALF = 2, 3  # E2M1 codes of 1.0 and 1.5
DIGIT_BASE = 120  # position digits per scale byte: E4M3 bytes 1..120, UE8M0 bytes 67..186
ALPHA = 0.375


class ContractError(Exception):
    """The candidate raised, or returned something that is not a [m, n] float32 tensor."""


@dataclass(frozen=True)
class Case:
    a: torch.Tensor  # [m, k] uint8, one E2M1 code per element
    sa: torch.Tensor  # [m, nb] uint8 scale bytes
    b: torch.Tensor  # [n, k]
    sb: torch.Tensor  # [n, nb]
    alpha: float = 1.0


Run = Callable[[Case], tuple[torch.Tensor, torch.Tensor]]  # case -> (expected, got), [m, n] fp32
Failure = tuple[str, dict] | None


@dataclass(frozen=True)
class Ladder:
    fmt: Format
    layout: ScaleLayout
    m: int
    n: int
    k: int

    @property
    def bl(self) -> int:
        return self.fmt.spec.block_len

    @property
    def nb(self) -> int:
        return self.k // self.bl

    @property
    def one(self) -> int:
        return self.fmt.spec.scale_one_byte

    def scale_value(self, byte: int) -> float:
        t = torch.tensor([byte], dtype=torch.uint8)
        return float(self.fmt.spec.decode_scale(t))

    def byte_of(self, value: float) -> int | None:
        """The positive scale byte that decodes to ``value`` exactly, if any."""
        return _positive_bytes(self.fmt).get(value)

    def full(self, rows: int, code: int) -> torch.Tensor:
        return torch.full((rows, self.k), code, dtype=torch.uint8)

    def scales(self, rows: int, byte: int | None = None) -> torch.Tensor:
        return torch.full((rows, self.nb), self.one if byte is None else byte, dtype=torch.uint8)

    def where(self, r: int, b: int) -> str:
        """Where scale (r, b) lives in the candidate's layout."""
        if self.layout is ScaleLayout.PLAIN:
            return f"plain index {r * self.nb + b}"
        return f"swizzled offset {swizzled_offset(r, b, self.nb)}"


@lru_cache(maxsize=None)
def _positive_bytes(fmt: Format) -> dict[float, int]:
    """Scale value -> byte for every positive finite scale (E4M3 0x01..0x7E, UE8M0 0..254)."""
    values = fmt.spec.decode_scale(torch.arange(256, dtype=torch.uint8)).tolist()
    return {float(v): b for b, v in enumerate(values) if 0 < v < float("inf")}  # NaN compares False


def _first_bad(exp: torch.Tensor, got: torch.Tensor) -> tuple[int, int, int, float, float] | None:
    bad = ~(got == exp)
    if not bad.any():
        return None
    i, j = (int(v) for v in bad.nonzero()[0])
    return int(bad.sum()), i, j, float(exp[i, j]), float(got[i, j])


def uniform(ld: Ladder, run: Run) -> Failure:
    exp, got = run(Case(ld.full(ld.m, ONE_HALF), ld.scales(ld.m), ld.full(ld.n, ONE_HALF), ld.scales(ld.n)))
    bad = _first_bad(exp, got)
    if bad is None:
        return None
    count, i, j, e, g = bad
    summed = g / 2.25
    why = f"i.e. {summed:g} of the K = {ld.k} products were summed"
    if math.isfinite(summed) and summed < ld.k and summed == int(summed) and (ld.k - summed) % ld.bl == 0:
        why += (f": {int(ld.k - summed) // ld.bl} whole block(s) missing (a skipped K tile, or a scale read "
                f"from padding)")
    return (f"every code 1.5, scale 1, alpha 1: C must be 2.25 * K = {e:g} everywhere; {count} of "
            f"{ld.m * ld.n} outputs differ, first C[{i}, {j}] = {g:g}, {why}",
            dict(row=i, col=j, expected=e, got=g, wrong_outputs=count))


def alpha(ld: Ladder, run: Run) -> Failure:
    exp, got = run(Case(ld.full(ld.m, ONE_HALF), ld.scales(ld.m), ld.full(ld.n, ONE_HALF), ld.scales(ld.n), ALPHA))
    bad = _first_bad(exp, got)
    if bad is None:
        return None
    count, i, j, e, g = bad
    plain = e / ALPHA
    why = {plain: "alpha was not applied", e * ALPHA: "alpha was applied twice",
           plain / ALPHA: "C was divided by alpha"}.get(g, f"got {g / e:g} x the expected value")
    return (f"uniform operands with alpha = {ALPHA}: C must be {e:g}, C[{i}, {j}] = {g:g}: {why}",
            dict(row=i, col=j, expected=e, got=g, alpha=ALPHA, without_alpha=plain, wrong_outputs=count))


def _pattern_codes(ld: Ladder) -> torch.Tensor:
    """B [n, k]: magnitude 1 + (c + 4 * (c // bl)) % 7 (differs from c ^ 1 and c +- bl), odd rows negative."""
    c = torch.arange(ld.k)
    mag = 1 + (c + 4 * (c // ld.bl)) % 7
    sign = (torch.arange(ld.n)[:, None] % 2) * 8
    return (mag[None, :] | sign).to(torch.uint8)


def _shift_explains(got: torch.Tensor, index: torch.Tensor, limit: int, row: int,
                    value: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """The smallest shift d (1, -1, 2, -2, ...) such that ``value(index + d)`` ([m, n]) equals ``got``
    on every row whose shifted index stays in [0, limit) (at least half the rows). ``value(idx)``
    maps [r] indices to [r, n] outputs; the shifts are first screened on row ``row``."""
    c0 = int(index[row])
    shifts = torch.tensor([d for d in range(-c0, limit - c0) if d], dtype=torch.int64)
    if shifts.numel() == 0:
        return None
    fits = (value(c0 + shifts) == got[row]).all(-1)
    for d in sorted(shifts[fits].tolist(), key=lambda x: (abs(x), x < 0)):
        ok = (index + d >= 0) & (index + d < limit)
        if 2 * int(ok.sum()) >= index.numel() and \
                torch.equal(value((index + d).clamp(0, limit - 1))[ok], got[ok]):
            return d
    return None


def identity(ld: Ladder, run: Run) -> Failure:
    b = _pattern_codes(ld)
    b_values = decode_e2m1(b)  # [n, k]
    rows = torch.arange(ld.m)
    for p in range(math.ceil(ld.k / ld.m)):
        col = (rows + p * ld.m) % ld.k
        a = torch.zeros(ld.m, ld.k, dtype=torch.uint8)
        a[rows, col] = ONE
        exp, got = run(Case(a, ld.scales(ld.m), b, ld.scales(ld.n)))
        bad = _first_bad(exp, got)
        if bad is None:
            continue
        count, i, j, e, g = bad
        c = int(col[i])
        where = f"byte {c // 2}, {'low' if c % 2 == 0 else 'high'} nibble"
        details = dict(row=i, col=j, element=c, expected=e, got=g, wrong_outputs=count)
        read = lambda cols: b_values[:, cols].T  # noqa: E731  [m, n]: C if A's 1.0 sat at cols
        if torch.equal(read(col ^ 1), got):
            why = (f"every output read the other nibble of its byte (element c ^ 1): the nibble order is "
                   f"swapped in one operand (element 2i belongs in the low nibble)")
        elif (d := _shift_explains(got, col, ld.k, i, read)) is not None:
            details["element_shift"] = d
            blocks = f" = {d // ld.bl:+d} block(s)" if d % ld.bl == 0 else ""
            why = f"every output read element c {d:+d}{blocks}: element or block index off by {d:+d}"
        elif g == 0:
            why = "A's 1.0 met a zero: A's codes were not read at their columns"
        else:
            why = "no consistent element shift explains the outputs"
        return (f"C[{i}, {j}] must be B[{j}, {c}] = {e:g} (A row {i} is 1.0 at element {c}, {where}), "
                f"got {g:g}: {why}; {count} outputs differ", details)
    return None


def one_hot(ld: Ladder, run: Run) -> Failure:
    b = torch.zeros(ld.n, ld.k, dtype=torch.uint8)
    for blk in range(ld.nb):
        b[:, blk * ld.bl: blk * ld.bl + 1 + blk % ld.bl] = ONE
    rows = torch.arange(ld.m)
    for p in range(math.ceil(ld.nb / ld.m)):
        blocks = (rows + p * ld.m) % ld.nb
        a = torch.zeros(ld.m, ld.nb, ld.bl, dtype=torch.uint8)
        a[rows, blocks] = ONE
        exp, got = run(Case(a.reshape(ld.m, ld.k), ld.scales(ld.m), b, ld.scales(ld.n)))
        bad = _first_bad(exp, got)
        if bad is None:
            continue
        count, i, j, e, g = bad
        blk = int(blocks[i])
        details = dict(row=i, col=j, block=blk, expected=e, got=g, wrong_outputs=count)
        block_sum = lambda idx: (1 + idx % ld.bl).float()[:, None].expand(-1, ld.n)  # noqa: E731
        if g == 0:
            why = f"A's block {blk} was never paired with B: A's codes were read from another block"
        elif (d := _shift_explains(got, blocks, ld.nb, i, block_sum)) is not None:
            details["block_shift"] = d
            why = f"every row's nonzero A block met B's block {d:+d} away: code block index off by {d:+d}"
        else:
            why = "no consistent block shift explains the outputs"
        return (f"A row {i} is zero except block {blk}, so C[{i}, {j}] must be B's block-{blk} sum "
                f"{e:g}, got {g:g}: {why}; {count} outputs differ", details)
    return None


def _position_bytes(ld: Ladder, rows: int, digit: int) -> torch.Tensor:
    pos = torch.arange(rows * ld.nb).reshape(rows, ld.nb)
    first = 1 if ld.fmt is Format.NVFP4 else 67
    return (first + (pos // DIGIT_BASE ** digit) % DIGIT_BASE).to(torch.uint8)


def _probe_case(ld: Ladder, side: str, p: int, digit: int) -> Case:
    rows = ld.m if side == "A" else ld.n
    hot = torch.zeros(rows, ld.nb, ld.bl, dtype=torch.uint8)
    hot[torch.arange(rows), (torch.arange(rows) + p) % ld.nb] = ONE
    hot = hot.reshape(rows, ld.k)
    coded = _position_bytes(ld, rows, digit)
    if side == "A":
        return Case(hot, coded, ld.full(ld.n, ONE), ld.scales(ld.n))
    return Case(ld.full(ld.m, ONE), ld.scales(ld.m), hot, coded)


def scale_positions(ld: Ladder, run: Run) -> Failure:
    for side in ("A", "B"):
        rows = ld.m if side == "A" else ld.n
        digits = max(1, math.ceil(math.log(rows * ld.nb, DIGIT_BASE)))
        for p in range(ld.nb):
            exp, got = run(_probe_case(ld, side, p, 0))
            bad = _first_bad(exp, got)
            if bad is not None:
                return _locate(ld, run, side, p, digits, bad)
    return None


def _locate(ld: Ladder, run: Run, side: str, p: int, digits: int, bad) -> Failure:
    """Decode, for every probed row of pass p, the position whose scale byte the candidate read."""
    count, i, j, e, g = bad
    r = i if side == "A" else j
    rows = ld.m if side == "A" else ld.n
    b = (r + p) % ld.nb
    want = int(_position_bytes(ld, rows, 0)[r, b])
    details = dict(operand=side, row=r, block=b, where=ld.where(r, b), expected_byte=want,
                   expected=e, got=g, wrong_outputs=count)
    if ld.layout is ScaleLayout.SWIZZLED:
        details["expected_offset"] = describe_offset(swizzled_offset(r, b, ld.nb), ld.nb)
    head = (f"{side}'s scale at (row {r}, block {b}) [{ld.where(r, b)}] must be byte 0x{want:02x} "
            f"({ld.scale_value(want):g}), so C[{i}, {j}] = {e:g}; got {g:g}")
    read = torch.zeros(rows, dtype=torch.int64)  # position read for each probed row, -1: undecodable
    first = 1 if ld.fmt is Format.NVFP4 else 67
    for digit in range(digits):
        out = run(_probe_case(ld, side, p, digit))[1]
        values = out[:, j] if side == "A" else out[i, :]
        byte = torch.tensor([ld.byte_of(float(v) / ld.bl) or -1 for v in values])
        ok = (byte >= first) & (byte < first + DIGIT_BASE)
        read = torch.where(ok & (read >= 0), read + (byte - first) * DIGIT_BASE ** digit, -1)
    read = torch.where(read < rows * ld.nb, read, -1)
    if read[r] < 0:
        what = "0: a zero byte (padding, or outside the matrix)" if g == 0 else f"{g / ld.bl:g}"
        return (f"{head}: the scale used decodes to {what}, which is no byte of {side}'s scale matrix", details)
    r2, b2 = divmod(int(read[r]), ld.nb)
    details.update(got_byte=ld.byte_of(g / ld.bl), read_row=r2, read_block=b2, read_where=ld.where(r2, b2))
    if ld.layout is ScaleLayout.SWIZZLED:
        details["read_offset"] = describe_offset(swizzled_offset(r2, b2, ld.nb), ld.nb)
    return (f"{head}, the byte of (row {r2}, block {b2}) [{ld.where(r2, b2)}]: "
            f"{_pattern(ld, rows, p, read)}", details)


def _pattern(ld: Ladder, rows: int, p: int, read: torch.Tensor) -> str:
    """Name the remap if one rule explains every probed row of the pass."""
    r = torch.arange(rows)
    b = (r + p) % ld.nb
    r2, b2 = read // ld.nb, read % ld.nb
    wrong = read != r * ld.nb + b
    known = read >= 0
    if bool((r2 == r)[known].all()):
        shifts = ((b2 - b) % ld.nb)[wrong & known].unique()
        if shifts.numel() == 1:
            d = int(shifts)
            d = d - ld.nb if d > ld.nb // 2 else d
            return f"same row, block index off by {d:+d} (mod {ld.nb}) on {int(wrong.sum())} probed rows"
    if ld.layout is ScaleLayout.PLAIN and bool((read == b * rows + r)[known].all()):
        return "the plain [rows, K/block] scales were read column-major (transposed)"
    if bool((b2 == b)[known].all()):
        return "same block, wrong row: the row index is remapped"
    return f"a remap of {int(wrong.sum())} of {rows} probed rows (see the offsets in the details)"


RUNGS: tuple[tuple[str, Callable[[Ladder, Run], Failure]], ...] = (
    ("uniform", uniform), ("alpha", alpha), ("identity", identity), ("one_hot", one_hot),
    ("scale_positions", scale_positions))
