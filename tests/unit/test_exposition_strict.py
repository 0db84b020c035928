"""The strict exposition reader the metrics tests use: it refuses what promtool refuses."""

from __future__ import annotations

from tests.helpers.exposition import strict_problems

GOOD = """# HELP a Things.
# TYPE a counter
a_total 1
# HELP b Now.
# TYPE b gauge
b{x="1"} 2
# HELP c Sizes.
# TYPE c histogram
c_bucket{le="1.0"} 1
c_bucket{le="+Inf"} 1
c_sum 1
c_count 1
"""


def test_a_valid_exposition_has_no_problems() -> None:
    assert strict_problems(GOOD) == []


def test_a_name_that_is_both_a_gauge_and_a_histogram_is_refused() -> None:
    text = GOOD + "# HELP c Sequences now.\n# TYPE c gauge\nc 3\n"
    problems = strict_problems(text)
    assert any("second HELP for c" in p for p in problems) and any("second TYPE for c" in p for p in problems)


def test_samples_outside_their_family_or_of_no_family_are_refused() -> None:
    assert any("outside its family" in p for p in strict_problems(GOOD + "a_total 2\n"))
    assert any("of no declared family" in p for p in strict_problems(GOOD + "zzz 2\n"))


def test_a_family_declared_twice_or_a_second_help_line_is_refused() -> None:
    """Two families of one name and one type (what two collectors yielding the same family give), and
    a family with two HELP lines: both are refused."""
    twice = GOOD + '# HELP b Now.\n# TYPE b gauge\nb{x="2"} 3\n'
    assert any("second TYPE for b" in p for p in strict_problems(twice))
    assert any("second HELP for b" in p for p in strict_problems(twice))
    second_help = GOOD.replace("# HELP a Things.\n", "# HELP a Things.\n# HELP a Things.\n")
    assert [p for p in strict_problems(second_help) if "second HELP for a" in p]
