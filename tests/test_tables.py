"""lab.experiments.tables: the one formatter of every table a notebook displays, and a static check that
the notebooks of chapters 1-8 display no table without it."""

import ast
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab.experiments.tables import DASH, Table, TableFormatError, cell, formatted, number, percent, show

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


# ---- the formatter -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, text", [
    (39.014767, "39.0"),          # tok/s: three significant digits, not six decimals
    (0.047323, "0.0473"),
    (1.02, "1.02"),
    (4453.2, "4,453"),            # no e-notation and no rounding away an integer digit (was 4.45e+03)
    (1024.0, "1,024"),
    (99.96, "100"),
    (-0.5, "-0.500"),
    (0.0, "0"),
    (3.8e-6, "3.80×10⁻⁶"),        # a rounding-sized difference: a power of ten
    (float("inf"), "∞"),
])
def test_floats_to_significant_digits(x, text):
    assert number(x) == text


def test_digits_per_call():
    assert number(3.8e-6, 2) == "3.8×10⁻⁶"
    assert number(0.123456, 5) == "0.12346"


@pytest.mark.parametrize("x, text", [(1193, "1,193"), (2085, "2,085"), (np.int64(1_000_000), "1,000,000"), (7, "7")])
def test_ints_with_thousands_separators(x, text):
    assert number(x) == text == cell(x)


def test_percentages_carry_the_sign():
    assert percent(0.123) == "12.3%"
    assert percent(0.00047323) == "0.0473%"
    assert cell(1.0, as_percent=True) == "100%"


def test_booleans_are_words():
    assert cell(True) == "yes" and cell(False) == "no"
    assert cell(np.bool_(True), words=("identical", "different")) == "identical"
    assert cell(np.bool_(False), words=("identical", "different")) == "different"


@pytest.mark.parametrize("missing", [float("nan"), None, np.nan, pd.NA])
def test_missing_values_are_a_dash(missing):
    assert cell(missing) == DASH


def test_a_transposed_count_column_reads_as_integers():
    # .T of rows mixing floats and ints turns the counts into floats (1024.0): they stay counts
    df = pd.DataFrame({L: {"hit (ms)": h, "tokens from cache": L} for L, h in ((64, 72.91), (1536, 140.2))}).T
    assert df["tokens from cache"].dtype == float
    out = formatted(df.rename_axis("prefix"))
    assert out["tokens from cache"].tolist() == ["64", "1,536"]
    assert out["hit (ms)"].tolist() == ["72.9", "140"]
    assert out.index.tolist() == ["64", "1,536"] and out.index.name == "prefix"


def test_per_column_options():
    df = pd.DataFrame({"same tokens": [True, False], "hit rate": [0.5, 0.0123], "|Δ logit|": [3.81e-6, 0.5],
                       "trials": [3, 20]})
    out = formatted(df, digits={"|Δ logit|": 2}, percent=["hit rate"],
                    words={"same tokens": ("identical", "different")}, formats={"trials": "{} of 20"})
    assert out.to_dict("list") == {"same tokens": ["identical", "different"], "hit rate": ["50.0%", "1.23%"],
                                   "|Δ logit|": ["3.8×10⁻⁶", "0.50"], "trials": ["3 of 20", "20 of 20"]}


def test_unknown_column_is_an_error():
    with pytest.raises(TableFormatError, match="no column 'share'"):
        formatted(pd.DataFrame({"a": [1]}), percent=["share"])


def test_a_dash_needs_a_note():
    df = pd.DataFrame({"bytes / bfloat16's": [2.0, 0.516, float("nan")]}, index=["float", "int8", "per_tensor_8"])
    with pytest.raises(TableFormatError, match="per_tensor_8 / bytes / bfloat16's"):
        show(df)
    t = show(df, note="— : the simulated per-tensor cache stores floats")
    assert isinstance(t, Table) and t.frame.iloc[:, 0].tolist() == ["2.00", "0.516", DASH]
    assert "simulated" in repr(t) and "simulated" in t._repr_html_()


def test_table_displays_as_html_and_text():
    t = show(pd.DataFrame({"tok/s": [39.014767]}, index=["lab"]), caption="throughput")
    html = t._repr_html_()
    assert "39.0" in html and "39.014767" not in html and "throughput" in html
    assert repr(t).splitlines()[0] == "throughput" and "39.0" in repr(t)


def test_multiindex_labels_are_formatted():
    df = pd.DataFrame({"ms": [1.5, 2.25]}, index=pd.MultiIndex.from_tuples([("smollm2", 1024), ("smollm2", 4096)],
                                                                           names=["model", "T"]))
    out = formatted(df)
    assert out.index.tolist() == [("smollm2", "1,024"), ("smollm2", "4,096")]
    assert out.index.names == ["model", "T"]


# ---- every notebook table goes through show() --------------------------------------------------------------

FRAME_MAKERS = {"DataFrame", "Series", "concat", "crosstab", "pivot_table"}
BYPASSES = {"style", "to_string", "to_markdown", "to_html"}  # ways to display a frame without show()


def _called(node) -> str | None:
    """The name a Call calls: show for show(...) and tables.show(...); None for other nodes."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _makes_frame(node, frames) -> bool:
    """Whether an expression builds or holds a DataFrame: a pd.DataFrame(...) call in it, or a name that was
    assigned one."""
    return any(_called(n) in FRAME_MAKERS or (isinstance(n, ast.Name) and n.id in frames) for n in ast.walk(node))


def _cells(source):
    """The code cells of a percent-format notebook: (first line, source)."""
    starts = [i for i, line in enumerate(source.splitlines()) if line.startswith("# %%")]
    lines = source.splitlines()
    for a, b in zip(starts, starts[1:] + [len(lines)], strict=True):
        if "[markdown]" not in lines[a]:
            yield a + 1, "\n".join(lines[a + 1:b])


def table_problems(source, name="notebook") -> list[str]:
    """Where a notebook displays a table that did not go through show(): the displayed value of a cell, an
    argument of display() or print(), a .style or .to_string() call, a frame built and never shown."""
    problems, frames, shown = [], {}, set()
    for first, code in _cells(source):
        tree = ast.parse(code)
        inside_show = {id(n) for call in ast.walk(tree) if _called(call) == "show" for n in ast.walk(call)}
        for node in ast.walk(tree):
            line = first + getattr(node, "lineno", 1)
            if isinstance(node, ast.Attribute) and node.attr in BYPASSES:
                problems.append(f"{name}:{line}: .{node.attr} displays a table without show()")
            if _called(node) in ("display", "print") and any(_makes_frame(a, frames) and _called(a) != "show"
                                                             for a in node.args):
                problems.append(f"{name}:{line}: {_called(node)}() of a table not formatted by show()")
            if _called(node) in FRAME_MAKERS and id(node) not in inside_show:
                assigned = [s for s in ast.walk(tree) if isinstance(s, ast.Assign)
                            and any(n is node for n in ast.walk(s.value))]
                if not assigned:
                    problems.append(f"{name}:{line}: a table built outside show()")
                for s in assigned:
                    frames.update({t.id: line for t in s.targets if isinstance(t, ast.Name)})
            if _called(node) == "show":
                shown |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and _makes_frame(last.value, frames) \
                and _called(last.value) not in ("show", "display", "print"):
            problems.append(f"{name}:{first + last.lineno}: the cell displays a table not formatted by show()")
    problems += [f"{name}:{line}: table {frame!r} is never shown through show()"
                 for frame, line in frames.items() if frame not in shown]
    return problems


def test_the_static_check_finds_each_bypass():
    bad = "\n".join(["# %%", "import pandas as pd", "pd.DataFrame({'a': [1]})",
                     "# %%", "display(pd.DataFrame({'a': [1]}).style.format('{:.3g}'))",
                     "# %%", "t = pd.DataFrame({'a': [1]})", "t",
                     "# %%", "u = pd.DataFrame({'a': [1]})", "print(u.to_string())"])
    found = "\n".join(table_problems(bad, "bad"))
    assert "bad:3: the cell displays a table" in found
    assert "bad:5: .style" in found and "bad:5: display() of a table" in found
    assert "bad:8: the cell displays a table" in found and "'t' is never shown" in found
    assert ".to_string" in found and "print() of a table" in found
    good = "\n".join(["# %%", "from lab.experiments.tables import show", "import pandas as pd",
                      "show(pd.DataFrame({'a': [1]}))", "# %%", "t = pd.DataFrame({'a': [1]})",
                      "t.loc[1] = 2", "display(show(t, caption='x'))"])
    assert table_problems(good, "good") == []


@pytest.mark.parametrize("notebook", sorted(p.name for p in NOTEBOOKS.glob("ch0[1-8]_*.py")))
def test_notebooks_show_every_table_through_show(notebook):
    source = (NOTEBOOKS / notebook).read_text()
    assert table_problems(source, notebook) == []
    if re.search(r"\bpd\.DataFrame\(", source):
        assert re.search(r"^from lab\.experiments\.tables import show\b", source, re.MULTILINE), \
            f"{notebook} builds tables: import show from lab.experiments.tables"
