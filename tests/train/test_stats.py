"""Paired statistics: the Student-t quantile against the textbook table, intervals and verdicts by hand."""

from __future__ import annotations

import math

import pytest

from fp4lab.train.stats import CONTRADICTED, NOT_RESOLVED, REPRODUCED, combine, interval, t_quantile, verdict

# two-sided 95% critical values t_{0.975, df} (any statistics textbook's table)
TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042, 120: 1.980}


@pytest.mark.parametrize("df, value", TABLE.items())
def test_t_quantile_matches_the_table(df, value):
    assert round(t_quantile(0.975, df), 3) == value
    assert t_quantile(0.025, df) == pytest.approx(-t_quantile(0.975, df))


def test_t_quantile_tends_to_the_normal_and_refuses_nonsense():
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-5)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-12)
    for p, df in ((0.0, 3), (1.0, 3), (0.9, 0)):
        with pytest.raises(ValueError):
            t_quantile(p, df)


def test_interval_by_hand():
    # d = 0.04, 0.05, 0.06: mean 0.05, sd 0.01, half = 4.303 * 0.01 / sqrt(3) = 0.024843
    iv = interval({2: 0.06, 0: 0.04, 1: 0.05}, base_mean=2.5)
    assert iv.seeds == (0, 1, 2) and iv.values == (0.04, 0.05, 0.06)
    assert iv.mean == pytest.approx(0.05) and iv.half == pytest.approx(4.302653 * 0.01 / math.sqrt(3), rel=1e-6)
    assert iv.pct(iv.mean) == pytest.approx(2.0)
    assert "+0.0500 [+0.0252, +0.0748] (+2.00% [+1.01, +2.99])" == iv.text()
    one = interval({0: 0.1})
    assert one.n == 1 and one.half == math.inf and "no interval" in one.text()
    with pytest.raises(ValueError, match="non-finite"):
        interval({0: 0.1, 1: math.inf})
    with pytest.raises(ValueError, match="share no seed"):
        interval({})


@pytest.mark.parametrize("values, direction, expected", [
    ({0: 0.05, 1: 0.06, 2: 0.04}, +1, REPRODUCED),
    ({0: 0.05, 1: 0.06, 2: 0.04}, -1, CONTRADICTED),
    ({0: 0.05, 1: -0.04, 2: 0.01}, +1, NOT_RESOLVED),   # the interval covers 0
    ({0: -0.02, 1: -0.03, 2: -0.025}, -1, REPRODUCED),
    ({0: 0.5}, +1, NOT_RESOLVED),                        # one seed: no interval, nothing resolved
])
def test_verdict_reads_the_interval(values, direction, expected):
    assert verdict(interval(values), direction) == expected


def test_combine_needs_every_part():
    assert combine([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert combine([REPRODUCED, NOT_RESOLVED]) == NOT_RESOLVED
    assert combine([REPRODUCED, CONTRADICTED]) == CONTRADICTED
    assert combine([]) == NOT_RESOLVED


def test_seeds_to_resolve_by_hand():
    from fp4lab.train.stats import interval, seeds_to_resolve
    iv = interval({0: 0.01, 1: 0.03, 2: 0.02})  # mean 0.02, sd 0.01
    # half-width t(0.975, n-1) * 0.01 / sqrt(n) < 0.02: n = 3 gives 4.303 * 0.00577 = 0.0248 (no);
    # n = 4 gives 3.182 * 0.005 = 0.0159 (yes)
    assert seeds_to_resolve(iv) == 4
    # a claimed effect of 0.005: t * 0.01 / sqrt(n) < 0.005 first at n = 18 (2.110 * 0.01 / 4.243 = 0.00497)
    assert seeds_to_resolve(iv, effect=0.005) == 18
    assert seeds_to_resolve(iv, effect=1e-6) is None  # more than 100 seeds
    assert seeds_to_resolve(interval({0: 0.5})) is None  # one seed: no spread known


def test_resolution_lines_give_the_seeds_a_claimed_effect_needs():
    from fp4lab.train.report import resolution_lines
    from fp4lab.train.stats import interval
    iv = interval({0: 0.01, 1: 0.03, 2: 0.02})  # mean 0.02, sd 0.01, half-width 0.0248 (above)
    rows = {line.split(" | ")[0]: line for line in resolution_lines(
        {"a - b": iv, "c - b": iv, "d - b": iv}, {"a - b": 0.005, "c - b": -0.03})}
    assert rows["| a - b"].endswith("| 4 | +0.0050: 18 |")  # 18 seeds for the claim's 0.005 (above)
    assert rows["| c - b"].endswith("| 4 | -0.0300: resolvable |")  # 0.0248 < 0.03 already at 3 seeds
    assert rows["| d - b"].endswith("| 4 | - |")  # no claimed effect for this gap
    assert "claim's effect" in resolution_lines({"a - b": iv}, {"a - b": 0.005})[3]
    assert "claim's effect" not in "".join(resolution_lines({"a - b": iv}))  # no column without effects


def test_a_study_refuses_an_effect_of_unknown_arms():
    from fp4lab.studies.catalog import STUDIES
    from dataclasses import replace
    with pytest.raises(ValueError, match="not an 'arm - base' pair"):
        replace(STUDIES["gains"], effects={"embed - nowhere": 0.1})
    assert set(STUDIES["gains"].effects) <= {f"{a} - {b}" for a, b in STUDIES["gains"].comparisons}
