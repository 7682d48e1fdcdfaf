"""What every figure of the book shares: a size that fits the book's column, and legible text.

    fig, ax = plots.figure()                  # one panel, as wide as the book's text column
    fig, (a, b) = plots.figure(ncols=2)       # two panels side by side, still column wide
    ...
    plots.finish(fig, path)                   # lay out; save a PNG at 120 dpi if path (legibility checked)

A saved PNG is shown in the book's column (lab/book.py, COLUMN_PX pixels wide) at its natural size when it
is narrower, scaled down when it is wider; finish() therefore narrows a wider figure to the column. It then
computes the scale at which the PNG is shown and refuses (FigureLegibilityError) to save a figure in which
a visible text (title, axis label, tick label, legend, annotation) would read smaller than MIN_PT points
in the book (check_legible). Importing this module sets matplotlib's defaults (rcParams) to sizes
that pass: text of 8.5 to 10 pt on a figure as wide as the column.
"""

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.text import Text

from ..book import COLUMN_PX

DPI = 120                  # the PNGs' resolution
COLUMN_IN = COLUMN_PX / DPI  # a figure this wide (6.93 in) is shown at exactly its size in the column
MIN_PT = 8.0               # the smallest text a reader should have to read, at the size it is shown
PANEL_HEIGHT_IN = 3.4      # the height of one row of panels, by default

STYLE = {
    "figure.figsize": (COLUMN_IN, PANEL_HEIGHT_IN),
    "savefig.dpi": DPI,
    "font.size": 9.5,
    "axes.titlesize": 10,
    "axes.labelsize": 9.5,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 8.5,
    "legend.title_fontsize": 9,
    "figure.titlesize": 10.5,
    "axes.grid": False,
}
matplotlib.rcParams.update(STYLE)


class FigureLegibilityError(ValueError):
    """A figure whose text would be too small to read at the book's column width."""


def figure(ncols=1, nrows=1, height=None, **subplots):
    """plt.subplots(nrows, ncols) as wide as the book's column; height in inches (PANEL_HEIGHT_IN per row
    by default). Two panels side by side is the most the column holds legibly."""
    height = height if height is not None else PANEL_HEIGHT_IN * nrows
    return plt.subplots(nrows, ncols, figsize=(COLUMN_IN, height), **subplots)


def shown_scale(fig, dpi=DPI, column_px=COLUMN_PX) -> float:
    """How much the book's column shrinks the saved PNG: column width / PNG width, at most 1."""
    return min(1.0, column_px / (fig.get_figwidth() * dpi))


def _visible_texts(fig):
    """The texts a reader sees: visible, not empty, not transparent, inside no hidden artist (a hidden
    legend, an axes turned off); those of titles, labels, ticks, legends and annotations included."""
    def walk(artist):
        if not artist.get_visible():
            return
        if isinstance(artist, Text):
            if artist.get_text().strip() and artist.get_alpha() != 0:
                yield artist
            return
        for child in artist.get_children():
            if isinstance(artist, Axes) and not artist.axison and isinstance(child, Axis):
                continue
            yield from walk(child)

    fig.canvas.draw()  # tick labels get their text when drawn
    yield from walk(fig)


def too_small(fig, dpi=DPI, column_px=COLUMN_PX, min_pt=MIN_PT) -> list[str]:
    """The visible texts of fig that would read under min_pt points in the book's column, described."""
    scale = shown_scale(fig, dpi, column_px)
    small = []
    for text in _visible_texts(fig):
        shown = text.get_fontsize() * scale
        if shown < min_pt - 1e-9:
            label = text.get_text().strip().replace("\n", " ")
            label = label if len(label) <= 40 else label[:37] + "..."
            small.append((shown, f"{label!r} ({text.get_fontsize():g} pt -> {shown:.1f} pt)"))
    return [described for _, described in sorted(small, key=lambda s: s[0])]  # the smallest first


def check_legible(fig, name="figure", dpi=DPI, column_px=COLUMN_PX, min_pt=MIN_PT):
    """Raise FigureLegibilityError, naming the figure and the texts, if any visible text of fig would read
    under min_pt points where the book shows it."""
    small = too_small(fig, dpi, column_px, min_pt)
    if small:
        scale = shown_scale(fig, dpi, column_px)
        shown = (f"at {fig.get_figwidth():.1f} in wide ({fig.get_figwidth() * dpi:.0f} px) the book's "
                 f"{column_px}-px column shows it at {scale:.0%} of its size"
                 if scale < 1 else "it is shown at its full size")
        more = f" and {len(small) - 8} more" if len(small) > 8 else ""
        raise FigureLegibilityError(
            f"{name}: text too small to read in the book ({shown}; at least {min_pt:g} pt needed): "
            f"{', '.join(small[:8])}{more}. "
            + (f"Make the figure at most {column_px / dpi:.2f} in wide (plots.figure()) or its text at least "
               f"{min_pt / scale:.1f} pt." if scale < 1 else
               f"Leave the font sizes to plots.STYLE, or set them to at least {min_pt:g} pt."))


def finish(fig, path=None, **layout):
    """Fit fig to the book's column, tight_layout(**layout), then, if path, check that its text is legible
    in the book and savefig(path) at DPI; returns the figure (notebooks show it).

    A figure wider than the column is narrowed to it (its height kept): the book would shrink its PNG to
    the column anyway, and its text with it.
    """
    if fig.get_figwidth() > COLUMN_IN + 1e-6:
        fig.set_figwidth(COLUMN_IN)
    fig.tight_layout(**layout)
    if path:
        from pathlib import Path

        check_legible(fig, Path(path).name)
        fig.savefig(path, dpi=DPI)
    return fig
