"""kernels.groups: each one-launch table equals the torch expressions it replaces, wrong counts included."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

from fp4lab.kernels import groups  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_DTYPES = st.sampled_from([torch.int32, torch.int64])
# wrong counts too (negative, summing past the rows or short of them: a bug upstream); G past one
# power of two of lanes (16, 64: 65 takes the 128-lane form) and a large one
_COUNTS = st.one_of(st.lists(st.integers(-30, 300), min_size=1, max_size=20),
                    st.integers(1, 300).flatmap(lambda g: st.lists(st.integers(-2, 90), min_size=g, max_size=g)))


def _edges(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What matmul built with torch ops before groups.edges."""
    ends = counts.to(torch.int64).clamp_min(0).cumsum(0).clamp_max(total)
    return torch.cat([ends.new_zeros(1), ends[:-1]]), ends


def _tiles(sizes: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, ...]:
    g = sizes.numel()
    starts, ends = _edges(sizes, rows)
    per = (ends - starts + bm - 1) // bm
    tiles_end = per.cumsum(0)
    t = torch.arange((rows + g * (bm - 1)) // bm)
    group = torch.searchsorted(tiles_end, t, right=True).clamp_max(g - 1)
    row = torch.where(t < tiles_end[-1], starts[group] + (t - tiles_end[group] + per[group]) * bm, ends[-1])
    return group.to(torch.int32), row.to(torch.int32), ends.to(torch.int32)


def _on_device(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@settings(max_examples=60, deadline=None)
@given(counts=_COUNTS, dtype=_DTYPES, total=st.one_of(st.none(), st.integers(0, 3000)))
def test_edges_and_segments_are_the_clamped_running_sums(counts, dtype, total):
    host = torch.tensor(counts, dtype=dtype)
    total = int(host.clamp_min(0).sum()) if total is None else total
    starts, ends = _edges(host, total)
    assert torch.equal(groups.edges(_on_device(counts, dtype), total).cpu(), torch.stack([starts, ends]))
    assert torch.equal(groups.segments(_on_device(counts, dtype), total).cpu(),
                       torch.stack([starts, ends - starts]).to(torch.int32))


@settings(max_examples=60, deadline=None)
@given(sizes=_COUNTS, dtype=_DTYPES, rows=st.one_of(st.none(), st.integers(1, 3000)),
       bm=st.sampled_from([16, 32, 128, 256]))
def test_a_tile_list_is_the_searchsorted_one(sizes, dtype, rows, bm):
    """Every tile's group and first row, the ends, for counts that split the rows and for wrong ones
    (clamped alike)."""
    host = torch.tensor(sizes, dtype=dtype)
    rows = max(1, int(host.clamp_min(0).sum())) if rows is None else rows
    made = groups.tiles(_on_device(sizes, dtype), rows, bm)
    for got, want in zip(made, _tiles(host, rows, bm)):
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), g=st.integers(1, 200), dtype=_DTYPES, with_rows=st.booleans())
def test_column_edges_are_the_running_sums_as_given(data, g, dtype, with_rows):
    """Unclamped, as the columns quantize built them: edges from 0, then each group's shift back to
    its unpadded rows and its row count."""
    widths = data.draw(st.lists(st.integers(-5, 200), min_size=g, max_size=g))
    rows = data.draw(st.lists(st.integers(-5, 200), min_size=g, max_size=g)) if with_rows else None
    w = torch.tensor(widths, dtype=torch.int64)
    edges, source = groups.column_edges(_on_device(widths, dtype), None if rows is None else _on_device(rows, dtype))
    assert edges.dtype == torch.int64 and torch.equal(edges.cpu(), torch.cat([w.new_zeros(1), w.cumsum(0)]))
    if rows is None:
        assert source is None
    else:
        r = torch.tensor(rows, dtype=torch.int64)
        assert torch.equal(source.cpu(), torch.cat([(w.cumsum(0) - w) - (r.cumsum(0) - r), r]))


def test_counts_of_any_stride_give_the_contiguous_tables():
    """A column of a wider tensor and an expanded one (the entry points take any 1-D counts) are
    read as their values, not as contiguous memory."""
    wide = _on_device([16, 999, 8, 999, 24, 999], torch.int64).view(3, 2)
    column, flat = wide[:, 0], _on_device([16, 8, 24], torch.int64)
    assert torch.equal(groups.edges(column, 48), groups.edges(flat, 48))
    assert torch.equal(groups.segments(column, 48), groups.segments(flat, 48))
    assert all(torch.equal(a, b) for a, b in zip(groups.tiles(column, 48, 16), groups.tiles(flat, 48, 16)))
    edges, source = groups.column_edges(column, column)
    assert torch.equal(edges, groups.column_edges(flat, flat)[0]) and torch.equal(source, groups.column_edges(flat, flat)[1])
    same = _on_device([16], torch.int64).expand(3)
    assert torch.equal(groups.edges(same, 48).cpu(), torch.tensor([[0, 16, 32], [16, 32, 48]]))
