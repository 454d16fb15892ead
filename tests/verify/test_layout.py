"""check_layout: fp4lab's swizzle passes on odd shapes; planted remap bugs are caught and located."""

import pytest
import torch

from fp4lab.formats import swizzle_scales, swizzled_offset, unswizzle_scales
from fp4lab.formats.layout import _padded
from fp4lab.verify import check_layout, describe_offset

ROWS, COLS = (1, 31, 130, 257), (1, 3, 4, 7)


def _remap(perm):
    """A swizzle built from the [Rp/128, 4, 32, Kp/4, 4] view with the given permutation."""
    def remap(scales):
        rows, cols = scales.shape
        rp, kp = _padded(rows, cols)
        padded = torch.zeros(rp, kp, dtype=torch.uint8)
        padded[:rows, :cols] = scales.view(torch.uint8)
        return padded.reshape(rp // 128, 4, 32, kp // 4, 4).permute(*perm).reshape(-1)
    return remap


def test_fp4lab_layout_passes():
    result = check_layout(rows=ROWS, cols=COLS)
    assert result.ok and result.rung is None, str(result)
    assert result.details["shapes"].split() == [f"{r}x{c}" for r in ROWS for c in COLS]
    assert check_layout(swizzle_scales, inverse=unswizzle_scales, rows=300, cols=9).ok  # 2700 positions: 2 digits


def test_describe_offset_matches_numerics_examples():
    # docs/numerics.md "Scale-factor layout": with Kp = 8, (m=5, k=2) -> 82 and (5, 5) -> 593
    assert swizzled_offset(5, 2, 8) == 82 and swizzled_offset(5, 5, 8) == 593
    assert describe_offset(82, 8) == dict(offset=82, row_tile=0, col_group=0, row_in_slab=5, slab=0,
                                          col_in_group=2, row=5, col=2)
    assert describe_offset(593, 8)["row"] == 5 and describe_offset(593, 8)["col"] == 5
    assert describe_offset(swizzled_offset(200, 6, 7), 7)["row"] == 200


def test_swapped_32_row_interleave_is_located():
    result = check_layout(_remap((0, 3, 1, 2, 4)), rows=ROWS, cols=COLS)
    assert not result.ok and result.rung == "placement"
    first = result.details["first"][0]
    assert first["expected_offset"] != first["actual_offsets"][0]
    # the byte of row m lands where the slab and the row inside it trade places
    assert first["actual"]["slab"] == first["expected"]["row_in_slab"] % 4
    assert "belongs at offset" in result.message and "misplaced" in result.message


def test_transposed_4_column_group_is_located():
    result = check_layout(_remap((0, 3, 2, 4, 1)), rows=(130,), cols=(7,))
    assert not result.ok and result.rung == "placement"
    first = result.details["first"][0]
    assert first["source"] == (0, 1)  # (0, 0) stays put; (0, 1) moves to where slab 1 goes
    assert first["expected"]["col_in_group"] == 1 and first["actual"]["slab"] == 1
    assert first["actual"]["col_in_group"] == 0


def test_nonzero_padding_is_caught():
    def edge_padded(scales):
        rows, cols = scales.shape
        rp, kp = _padded(rows, cols)
        full = torch.nn.functional.pad(scales.view(torch.uint8)[None, None].float(), (0, kp - cols, 0, rp - rows),
                                       mode="replicate")[0, 0].to(torch.uint8)
        return swizzle_scales(full)[: rp * kp] if rows % 128 or cols % 4 else swizzle_scales(scales)
    result = check_layout(edge_padded, rows=(130,), cols=(3,))
    assert not result.ok and result.rung == "padding"
    assert "must be 0" in result.message and result.details["bad_padding"] > 0


def test_wrong_padding_size_is_caught():
    def pads_to_32_rows(scales):
        rows, cols = scales.shape
        rp, kp = -(-rows // 32) * 32, -(-cols // 4) * 4
        padded = torch.zeros(rp, kp, dtype=torch.uint8)
        padded[:rows, :cols] = scales
        return padded.reshape(-1)
    result = check_layout(pads_to_32_rows, rows=(31,), cols=(4,))
    assert result.rung == "size" and result.details == dict(rows=31, cols=4, expected_size=512, got_size=128)


def test_broken_inverse_is_caught():
    def transposed_inverse(buffer, rows, cols):
        return unswizzle_scales(buffer, rows, cols).T.contiguous().reshape(rows, cols)
    result = check_layout(inverse=transposed_inverse, rows=(5,), cols=(3,))
    assert result.rung == "inverse" and "unswizzle put source" in result.message


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        check_layout(rows=(0,))
    with pytest.raises(TypeError, match="one-byte"):
        check_layout(lambda s: s.float(), rows=4, cols=4)
