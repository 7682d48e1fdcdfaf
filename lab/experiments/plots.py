"""What every figure of the book shares: a size that fits the book's column, and legible text.

    fig, ax = plots.figure()                  # one panel, as wide as the book's text column
    fig, (a, b) = plots.figure(ncols=2)       # two panels side by side, still column wide
    ...
    plots.finish(fig, path)                   # lay out; save a PNG at 120 dpi if path (legibility checked)

A saved PNG is shown in the book's column (lab/book/render.py, COLUMN_PX pixels wide) at its natural size
when it is narrower, scaled down when it is wider; finish() therefore narrows a wider figure to the column. It
then computes the scale at which the PNG is shown and refuses (FigureLegibilityError) to save a figure in which
a visible text (title, axis label, tick label, legend, annotation) would read smaller than MIN_PT points
in the book, whose tick labels collide, or with an axis that labels a single tick, from which no scale can
be read (check_legible). Importing this module sets matplotlib's defaults (rcParams) to sizes
that pass: text of 8.5 to 10 pt on a figure as wide as the column.
"""

import math

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.text import Text

from ..book.render import COLUMN_PX

DPI = 120                  # the PNGs' resolution
COLUMN_IN = COLUMN_PX / DPI  # a figure this wide (6.93 in) is shown at exactly its size in the column
MIN_PT = 8.0               # the smallest text a reader should have to read, at the size it is shown
OVERLAP_PT = 0.5           # tick labels may touch, not overlap by more than this (font boxes include leading)
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


def plain(v, _=None) -> str:
    """A tick value as a reader writes it: 1,024 and 0.5, never 10³ or 1e+03."""
    return f"{v:,.0f}" if abs(v) >= 1 and float(v).is_integer() else f"{v:,g}"


LOG_STEPS = ((1.0,), (1.0, 2.0, 5.0), tuple(float(k) for k in range(1, 10)))   # coarse to fine


def log_ticks(axis, steps=None):
    """Label a log axis (ax.xaxis or ax.yaxis, its data already plotted) in plain numbers at steps that give
    it at least two labels: every decade over more than three decades, 1-2-5 over more than 0.8 of one,
    1 to 9 below that (or the `steps` given, one of LOG_STEPS), evenly spaced round values where fewer than two
    of those fall inside the limits; the other ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.axes.get_xlim() if axis is axis.axes.xaxis else axis.axes.get_ylim())
    decades = math.log10(hi / lo)
    if steps is None:
        steps = LOG_STEPS[0] if decades > 3 else LOG_STEPS[1] if decades > 0.8 else LOG_STEPS[2]
    locator = LogLocator(base=10, subs=steps)
    if sum(lo <= t <= hi for t in locator.tick_values(lo, hi)) < 2:
        # a span narrower than two of the finest steps (0.93 to 1.4 holds 1 only): evenly spaced round values
        from matplotlib.ticker import FixedLocator, MaxNLocator

        locator = FixedLocator([t for t in MaxNLocator(nbins=4).tick_values(lo, hi) if lo <= t <= hi])
    axis.set_major_locator(locator)
    axis.set_major_formatter(FuncFormatter(plain))
    axis.set_minor_formatter(NullFormatter())


def tidy_log_axes(fig):
    """Relabel with log_ticks() every log axis of fig whose ticks matplotlib chose (not set_xticks) and that
    labels fewer than two ticks or labels that collide: the finest steps first, then coarser ones until none
    collide. Where a log axis lands depends on the data (a quick run's times may span less than a decade, a
    tiny model's errors a few units), and one label is no scale, two on top of each other none."""
    if not hasattr(fig.canvas, "get_renderer"):  # a figure a notebook has shown keeps a canvas that cannot draw
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    fig.canvas.draw()                               # the limits and the ticks as they will be saved
    renderer = fig.canvas.get_renderer()

    def fine(axis):
        labels = [t for side in tick_labels(axis) for t in side]
        boxes = [t.get_window_extent(renderer) for t in labels]
        return len({t.get_text() for t in labels}) >= 2 and not any(
            overlap_px(a, b) > OVERLAP_PT * fig.dpi / 72 for i, a in enumerate(boxes) for b in boxes[i + 1:])

    from matplotlib.ticker import FixedLocator

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):  # ticks a plot chose itself (set_xticks) are its own to fix
            if axis.get_scale() != "log" or isinstance(axis.get_major_locator(), FixedLocator) or fine(axis):
                continue
            for steps in reversed(LOG_STEPS):
                log_ticks(axis, steps)
                fig.canvas.draw()
                if fine(axis):
                    break


def spaced(values, factor=2.0) -> list:
    """The values to label on a log axis whose ticks sit at `values`: the largest, then downwards each one at
    least `factor` times below the last one kept (1,536 and 1,024 are too close to both carry a label)."""
    kept = []
    for v in sorted(values, reverse=True):
        if not kept or kept[-1] / v >= factor - 1e-9:
            kept.append(v)
    return sorted(kept)


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


def _axes_name(fig, ax) -> str:
    title = ax.get_title() or ax.get_ylabel() or ax.get_xlabel()
    return f"panel {fig.axes.index(ax) + 1}" + (f" ({title!r})" if title else "")


def tick_labels(axis) -> list[list[Text]]:
    """The tick labels axis draws, per side (label1: bottom or left; label2: top or right): visible, not
    empty, of the ticks inside the view. Axis._update_ticks() is how matplotlib's own draw() picks them."""
    ticks = axis._update_ticks()
    return [[t for t in (getattr(tick, side) for tick in ticks)
             if t.get_visible() and t.get_text().strip() and t.get_alpha() != 0] for side in ("label1", "label2")]


def overlap_px(a, b) -> float:
    """How far two boxes (matplotlib Bbox) overlap, in pixels: the smaller of their overlaps along x and along
    y; <= 0 when they do not touch."""
    return min(min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0))


def tick_problems(fig, overlap_pt=OVERLAP_PT) -> list[str]:
    """The axes of fig whose tick labels collide, and those that label exactly one tick, described. Two labels
    collide when their boxes overlap by more than overlap_pt points; the box of a rotated label is the
    upright box around it, so rotated labels collide when a reader cannot tell which tick each one names.
    An axis that labels no tick (hidden labels of a shared axis, an image without ticks) is left alone."""
    if not hasattr(fig.canvas, "get_renderer"):  # a figure a notebook has shown keeps a canvas that cannot draw
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)                        # becomes fig.canvas
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    tolerance = overlap_pt * fig.dpi / 72
    problems = []
    for ax in fig.axes:
        if not (ax.get_visible() and ax.axison):
            continue
        for letter, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if not axis.get_visible():
                continue
            sides = tick_labels(axis)
            shown = sorted({t.get_text() for side in sides for t in side})
            if len(shown) == 1:
                problems.append(f"{_axes_name(fig, ax)}: the {letter} axis labels one tick only ({shown[0]!r}); "
                                f"a scale needs at least two labelled ticks")
            for side in sides:
                boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in side]
                for i, (a, ca) in enumerate(boxes):
                    hits = [b for b, cb in boxes[i + 1:] if overlap_px(ca, cb) > tolerance]
                    problems += [f"{_axes_name(fig, ax)}: {letter} tick labels {a!r} and {b!r} overlap" for b in hits]
    return problems


def label_problems(fig, overlap_pt=OVERLAP_PT) -> list[str]:
    """The labels placed on the data of fig (ax.annotate, ax.text) that overlap each other, described."""
    fig.canvas.draw()
    renderer, tolerance, problems = fig.canvas.get_renderer(), overlap_pt * fig.dpi / 72, []
    for ax in fig.axes:
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts
                 if t.get_visible() and t.get_text().strip()]
        for i, (a, ca) in enumerate(boxes):
            problems += [f"{_axes_name(fig, ax)}: labels {a!r} and {b!r} overlap" for b, cb in boxes[i + 1:]
                         if overlap_px(ca, cb) > tolerance]
    return problems


def outside_problems(fig, tolerance_pt=OVERLAP_PT) -> list[str]:
    """The visible texts of fig (legends, labels, titles) that reach past the figure's edges, where the saved PNG
    cuts them off, described."""
    fig.canvas.draw()
    renderer, frame = fig.canvas.get_renderer(), fig.bbox
    slack = tolerance_pt * fig.dpi / 72
    axes = [a for ax in fig.axes for a in (ax.xaxis, ax.yaxis)]
    ticks = {id(t) for a in axes for tick in a.get_major_ticks() + a.get_minor_ticks()
             for t in (tick.label1, tick.label2)}
    drawn = {id(t) for a in axes for side in tick_labels(a) for t in side}        # the ticks inside the view
    out = []
    for text in _visible_texts(fig):
        if id(text) in ticks and id(text) not in drawn:
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < frame.x0 - slack or box.x1 > frame.x1 + slack or box.y0 < frame.y0 - slack \
                or box.y1 > frame.y1 + slack:
            label = text.get_text().strip().replace("\n", " ")
            out.append(f"{label[:40]!r} reaches past the figure's edge")
    return out


# where label_points tries a label, in points from its point: right, left, above, below, then the corners
LABEL_OFFSETS = ((5, -3, "left"), (-5, -3, "right"), (0, 6, "center"), (0, -13, "center"), (5, 5, "left"),
                 (-5, 5, "right"), (5, -12, "left"), (-5, -12, "right"), (8, -3, "left"), (-8, -3, "right"))


def label_points(ax, points, **text):
    """Label each (x, y, words) of `points` beside its point, at the first of LABEL_OFFSETS where it overlaps no
    label placed before it and stays inside the axes (else where it overlaps least). Lay the figure out first
    (fig.tight_layout()): the labels keep their offsets in points when it moves, and check_legible refuses a
    figure whose labels overlap."""
    fig = ax.figure
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer, frame = fig.canvas.get_renderer(), ax.get_window_extent()
    r = 4 * fig.dpi / 72                                    # a marker's half width, in pixels
    marks = [ax.transData.transform(xy) for line in ax.lines for xy in line.get_xydata()]
    placed = [matplotlib.transforms.Bbox([[px - r, py - r], [px + r, py + r]]) for px, py in marks]
    placed += [ax.get_legend().get_window_extent(renderer)] if ax.get_legend() else []
    for x, y, words in points:
        best = None
        for dx, dy, ha in LABEL_OFFSETS:
            label = ax.annotate(words, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, **text)
            box = label.get_window_extent(renderer)
            clash = sum(max(0.0, overlap_px(box, b)) for b in placed) + (
                0.0 if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) else 1.0)
            if best is None or clash < best[0]:
                if best is not None:
                    best[1].remove()
                best = (clash, label, box)
            else:
                label.remove()
            if clash == 0:
                break
        placed.append(best[2])


def check_legible(fig, name="figure", dpi=DPI, column_px=COLUMN_PX, min_pt=MIN_PT):
    """Raise FigureLegibilityError, naming the figure and the texts, if any visible text of fig would read
    under min_pt points where the book shows it, if tick labels or labels on the data overlap, or if an axis
    labels one tick."""
    ticks = tick_problems(fig)                     # first: it gives a shown figure a canvas that draws
    cut = outside_problems(fig)
    if cut:
        raise FigureLegibilityError(f"{name}: {'; '.join(cut[:4])}: the PNG would cut it off. Shorten it, put the "
                                    f"legend in fewer columns, or make the figure taller.")
    labels = label_problems(fig)
    if labels:
        raise FigureLegibilityError(f"{name}: {'; '.join(labels)}. Place them with plots.label_points, label "
                                    f"fewer points, or say in the legend what they are.")
    if ticks:
        raise FigureLegibilityError(f"{name}: {'; '.join(ticks)}. Label fewer ticks or shorter labels, or choose "
                                    f"the ticks (ax.set_xticks) so that at least two are labelled and none collide.")
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
    tidy_log_axes(fig)
    fig.tight_layout(**layout)
    if path:
        from pathlib import Path

        check_legible(fig, Path(path).name)
        fig.savefig(path, dpi=DPI)
    return fig
