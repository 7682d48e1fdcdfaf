"""What every table a notebook displays shares: numbers a reader can read at a glance.

    from lab.experiments.tables import show
    show(df)                                            # the last expression of a cell: displayed
    display(show(df, percent=["hit rate"], words={"same tokens": ("identical", "different")}))
    show(df, digits={"|Δ logit|": 2}, note="— : the float cache has no codes to count")

show(df) returns a Table: the frame with every cell written as text, as the notebook displays it (HTML in
Jupyter, plain text in a terminal), with an optional caption above it and a note below it. Cells:

- integers, and float columns that hold only whole numbers (a transposed table turns counts into floats),
  with thousands separators: 1,193;
- other floats to `digits` significant digits (3 unless told), never in e-notation between 0.001 and the
  integers: 39.0, 0.0473, 4,453; smaller magnitudes as 3.8×10⁻⁶;
- the columns named in `percent`, which hold fractions, as percentages with their sign: 0.123 -> 12.3%;
- booleans as words: yes/no, or the pair `words` gives (for all columns, or per column);
- a missing value (None, NaN) as "—". A dash needs its reason: show() refuses a table with a dash and
  no `note`.

Units belong in the column headers ("TTFT (ms)"), which show() leaves as they are. The rules in one
place: a notebook never formats a table's numbers itself (tests/test_tables.py checks the notebooks).
"""

import html
import math
import numbers
from dataclasses import dataclass

import numpy as np
import pandas as pd

DASH = "—"                    # a missing value, explained in the table's note
DIGITS = 3                    # significant digits of a measured float
SMALL = 1e-3                  # below this magnitude a float is written as a power of ten
WORDS = ("yes", "no")         # how a boolean reads unless told otherwise
_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


class TableFormatError(ValueError):
    """A table that cannot be shown as asked: a dash without a note, a column named that the table lacks."""


def is_missing(x) -> bool:
    if x is None or x is pd.NA or x is pd.NaT:
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isnan(x)


def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))                              # numpy's bool is no bool subclass


def _is_whole(x) -> bool:
    """An int, or a finite float with no fraction (1193.0): a count, whatever its dtype."""
    if _is_bool(x) or not isinstance(x, numbers.Real):
        return False
    return isinstance(x, numbers.Integral) or (math.isfinite(x) and float(x).is_integer())


def number(x, digits=DIGITS) -> str:
    """A float to `digits` significant digits, with thousands separators, never rounding away a digit of
    its integer part: 39.0, 0.0473, 1.02, 4,453, 3.8×10⁻⁶ (magnitudes below SMALL); an int: 1,193."""
    if isinstance(x, numbers.Integral) and not _is_bool(x):
        return f"{int(x):,}"
    x = float(x)
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    if abs(x) < 10 ** (digits - 1):
        x = float(f"{x:.{digits - 1}e}")                  # rounded to `digits` significant digits first
    if abs(x) >= 10 ** (digits - 1):                      # every digit of the integer part, none after it
        return f"{x:,.0f}"
    exponent = math.floor(math.log10(abs(x)))
    if abs(x) < SMALL:
        mantissa = f"{x / 10 ** exponent:.{max(digits - 1, 0)}f}"
        return f"{mantissa}×10{str(exponent).translate(_SUPERSCRIPT)}"
    decimals = max(digits - 1 - exponent, 0)
    return f"{x:,.{decimals}f}"


def percent(x, digits=DIGITS) -> str:
    """A fraction as a percentage: 0.123 -> "12.3%", 0.00047323 -> "0.0473%"."""
    return f"{number(100 * float(x), digits)}%"


def cell(x, digits=DIGITS, words=WORDS, as_percent=False, whole=False) -> str:
    """One value as a table shows it (see the module's docstring); whole: the column holds only counts."""
    if is_missing(x):
        return DASH
    if _is_bool(x):
        return words[0] if x else words[1]
    if isinstance(x, numbers.Real):
        if as_percent:
            return percent(x, digits)
        return f"{round(x):,}" if whole and _is_whole(x) else number(x, digits)
    return str(x)


def _per_column(option, column, default):
    """An option given once for every column, or as {column: value}."""
    if isinstance(option, dict):
        return option.get(column, default)
    return default if option is None else option


def _labels(index: pd.Index) -> pd.Index:
    """Index or column labels as text: numbers with separators, booleans as words."""
    def label(x):
        if isinstance(x, tuple):
            return tuple(label(v) for v in x)
        return cell(x, whole=_is_whole(x)) if isinstance(x, numbers.Real) else x
    labels = [label(x) for x in index]
    if isinstance(index, pd.MultiIndex):
        return pd.MultiIndex.from_tuples(labels, names=index.names)
    return pd.Index(labels, name=index.name, dtype=object)


def formatted(df, digits=None, percent=(), words=None, formats=None) -> pd.DataFrame:
    """df with every cell (and every index and column label) as text, by the rules of the module's
    docstring. digits: significant digits, one for all columns or {column: digits}; percent: the columns
    holding fractions; words: (if true, if false) for all columns or {column: (..., ...)}; formats:
    {column: format string or function} for a column no rule fits (e.g. "{:.0f} of 20")."""
    if isinstance(df, pd.Series):
        df = df.to_frame()
    named = set(percent) | set(digits if isinstance(digits, dict) else ()) | \
        set(words if isinstance(words, dict) else ()) | set(formats or ())
    if unknown := [c for c in named if c not in df.columns]:
        raise TableFormatError(f"no column {', '.join(map(repr, unknown))} in the table "
                               f"(columns: {', '.join(map(str, df.columns))})")
    out = pd.DataFrame(index=_labels(df.index), columns=_labels(df.columns), dtype=object)
    for j, column in enumerate(df.columns):
        values = df.iloc[:, j].tolist()
        fmt = (formats or {}).get(column)
        present = [x for x in values if not is_missing(x)]
        whole = bool(present) and all(_is_whole(x) for x in present)
        out.iloc[:, j] = [
            DASH if is_missing(x) else
            (fmt.format(x) if isinstance(fmt, str) else fmt(x)) if fmt is not None else
            cell(x, _per_column(digits, column, DIGITS), _per_column(words, column, WORDS), column in percent, whole)
            for x in values]
    return out


@dataclass
class Table:
    """A formatted table, as a notebook displays it: the cells as text, a caption above, a note below."""
    frame: pd.DataFrame
    caption: str | None = None
    note: str | None = None

    def _repr_html_(self) -> str:
        styler = self.frame.style
        if self.caption:
            styler = styler.set_caption(html.escape(self.caption))
        note = f'<p style="font-size: 0.9em; margin-top: 0.3em">{html.escape(self.note)}</p>' if self.note else ""
        return styler.to_html() + note

    def __repr__(self) -> str:
        parts = [self.caption] if self.caption else []
        parts.append(self.frame.to_string())
        if self.note:
            parts.append(self.note)
        return "\n".join(parts)


def show(df, caption=None, note=None, digits=None, percent=(), words=None, formats=None) -> Table:
    """df formatted for a reader (see formatted()), with a caption and a note; returns a Table, which a
    notebook displays as a cell's last expression or with display(). A table with a missing value ("—")
    must say why in `note`."""
    frame = formatted(df, digits, percent, words, formats)
    dashes = (frame == DASH).to_numpy()
    if note is None and dashes.any():
        rows, columns = dashes.nonzero()
        where = "; ".join(f"{frame.index[r]} / {frame.columns[c]}" for r, c in zip(rows[:3], columns[:3], strict=True))
        raise TableFormatError(f"the table has no value at {where}: shown as {DASH}, it needs a note saying why "
                               f"(show(..., note=...)), or compute the value")
    return Table(frame, caption, note)
