"""lab.experiments.plots refuses figures whose tick labels collide or that label a single tick (the check
finish() runs before it saves a figure), and the figures the chapters draw pass it."""

import matplotlib
import pytest

matplotlib.use("Agg")

from lab.experiments import plots  # noqa: E402

PREFIXES = [32, 64, 128, 256, 512, 1024, 1536]  # chapter 6's cached prefixes, full mode


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plots.plt.close("all")


def _log_x(ax, labels_at, rotation=0):
    ax.plot(PREFIXES, [0.1 * L + 70 for L in PREFIXES], "o-")
    ax.set_xscale("log")
    ax.set_xticks(labels_at, [f"{L:,}" for L in labels_at], rotation=rotation)
    ax.minorticks_off()


def test_colliding_tick_labels_are_refused(tmp_path):
    # chapter 6's first time-to-first-token figure: 1,024 and 1,536 side by side on a log axis, rotated 45°
    fig, axes = plots.figure(ncols=2)
    for ax in axes:
        _log_x(ax, PREFIXES, rotation=45)
    problems = plots.tick_problems(fig)
    assert problems and all("'1,024' and '1,536' overlap" in p for p in problems), problems
    assert len(problems) == 2 and problems[0].startswith("panel 1") and problems[1].startswith("panel 2")
    with pytest.raises(plots.FigureLegibilityError, match=r"ttft\.png: panel 1: x tick labels '1,024' and '1,536'"):
        plots.finish(fig, tmp_path / "ttft.png")
    assert not (tmp_path / "ttft.png").exists()


def test_spaced_tick_labels_pass(tmp_path):
    fig, axes = plots.figure(ncols=2)
    for ax in axes:
        _log_x(ax, PREFIXES[::2])  # 32, 128, 512, 1,536: room between every pair
    assert plots.tick_problems(fig) == []
    plots.finish(fig, tmp_path / "ok.png")
    assert (tmp_path / "ok.png").stat().st_size > 0


def test_an_axis_with_one_labelled_tick_is_refused(tmp_path):
    # a log axis over less than a decade, its minor labels switched off: only "10³" is labelled
    fig, ax = plots.figure()
    ax.plot([64, 256, 1024], [700, 1500, 4000], "o-")
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    problems = plots.tick_problems(fig)
    assert len(problems) == 1 and "the y axis labels one tick only ('$\\\\mathdefault{10^{3}}$')" in problems[0]
    with pytest.raises(plots.FigureLegibilityError, match="labels one tick only"):
        plots.check_legible(fig, "one.png")
    plots.log_ticks(ax.yaxis)  # 1-2-5 ticks in plain numbers: 1,000 and 2,000 besides (finish() does this)
    assert plots.tick_problems(fig) == []


def test_hidden_and_absent_tick_labels_are_left_alone(tmp_path):
    fig, (a, b) = plots.figure(ncols=2, sharey=True)  # b's y labels hidden by sharey
    for ax in (a, b):
        ax.plot([0, 1], [0, 1])
    im = plots.figure()[1]
    im.imshow([[0, 1], [1, 0]])
    im.set_xticks([])
    im.set_yticks([])
    assert plots.tick_problems(fig) == [] and plots.tick_problems(im.figure) == []


def test_crowded_y_labels_collide():
    fig, ax = plots.figure(height=1.2)
    ax.plot([0, 1], [0, 1])
    ax.set_yticks([i / 20 for i in range(21)])
    assert any("y tick labels" in p and "overlap" in p for p in plots.tick_problems(fig))


def test_a_figure_a_notebook_has_shown_is_checked(tmp_path):
    # the inline backend leaves a shown figure a FigureCanvasBase, which has no renderer
    from matplotlib.backend_bases import FigureCanvasBase

    fig, axes = plots.figure(ncols=2)
    for ax in axes:
        _log_x(ax, PREFIXES, rotation=45)
    FigureCanvasBase(fig)
    with pytest.raises(plots.FigureLegibilityError, match="'1,024' and '1,536' overlap"):
        plots.finish(fig, tmp_path / "shown.png")


@pytest.mark.parametrize("prefixes", [None, (64, 256, 1024)])  # the book's run; quick mode's prefixes
def test_chapter6_ttft_figure_passes(prefixes):
    """Chapter 6's figure, drawn from the committed results (ttft_times reads them back), and from quick
    mode's three prefixes: before, 1,024 and 1,536 collided and quick mode's log axis labelled one tick."""
    from lab.experiments import ch06_prefix as ch06
    from lab.results import COMMITTED, read

    times = ch06.ttft_times(read(COMMITTED)["sections"]["ch06"]["values"])
    assert sorted(times)[:2] == [32, 64] and all(t["hit"]["median"] < t["miss"]["median"] for t in times.values())
    fig = ch06.plot_ttft(times if prefixes is None else {L: times[L] for L in prefixes})
    assert plots.tick_problems(fig) == [] and plots.too_small(fig) == []
    assert plots.spaced([32, 64, 128, 256, 512, 1024, 1536]) == [32, 64, 128, 256, 512, 1536]


@pytest.mark.parametrize("contexts", [None, (16, 64, 256)])  # the book's run; quick mode's contexts
def test_chapter1_step_time_figure_passes(contexts):
    """Chapter 1's figure from the committed results and from quick mode's contexts, whose 50 to 500 ms
    left the log axis one labelled tick ('100') when only powers of ten were labelled."""
    from lab.experiments import ch01_recompute as ch01
    from lab.results import COMMITTED, read

    times = ch01.recorded_step_times(read(COMMITTED)["sections"]["ch01"]["values"])
    assert set(times) == {"gpt2-random", "smollm2"} and all(16 in by_T for by_T in times.values())
    if contexts is not None:
        times = {name: {T: by_T[T] for T in contexts if T in by_T} for name, by_T in times.items()}
    fig = ch01.plot_step_times(times)
    assert plots.tick_problems(fig) == [] and plots.too_small(fig) == []


@pytest.mark.parametrize("span", [(0.93, 1.4), (1.1, 1.9), (0.97, 1.02)])
def test_log_ticks_labels_a_span_narrower_than_two_steps(span):
    """A tiny model's step times (two contexts, about a millisecond each) can span less than the gap between
    two of 1, 2, ..., 9: log_ticks then labels evenly spaced round values inside the limits, two at least."""
    fig, ax = plots.plt.subplots(figsize=(5, 3))
    ax.plot([8, 16], span)
    ax.set(xscale="log", yscale="log")
    plots.log_ticks(ax.yaxis)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    shown = [t for side in plots.tick_labels(ax.yaxis) for t in side]
    assert len({t.get_text() for t in shown}) >= 2
    assert all(lo <= float(t.get_text()) <= hi for t in shown)
    assert not [p for p in plots.tick_problems(fig) if "y axis" in p]


def test_finish_labels_a_log_axis_the_data_left_with_one_label(tmp_path):
    """Where a log axis lands depends on the data: a quick run's step times span less than a decade and the
    default labels would leave one ("100"); finish() labels such an axis in plain numbers before checking."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plots.plt.subplots(figsize=(5, 3))
    ax.plot([1, 2048], [60, 130])
    ax.set(xscale="log", yscale="log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    assert any("labels one tick only" in p for p in plots.tick_problems(fig))
    plots.finish(fig, tmp_path / "short.png")                      # no FigureLegibilityError
    assert len({t.get_text() for side in plots.tick_labels(ax.yaxis) for t in side}) >= 2
    plots.plt.close(fig)


def test_finish_relabels_colliding_labels_matplotlib_chose(tmp_path):
    """A log axis over a few units labels its minor ticks (2×10⁰, 3×10⁰, ...), which collide in a narrow
    panel, as chapter 4's figure did on the tiny model's errors; finish() relabels such an axis in plain
    numbers at coarser steps. Ticks a plot set itself are left alone (test_colliding_tick_labels_are_refused)."""
    fig, axes = plots.figure(ncols=3)
    for ax in axes:
        ax.plot([1.6, 4.8], [0, 1], "o")
        ax.set_xscale("log")
    plots.finish(fig, tmp_path / "minor.png")                      # no FigureLegibilityError
    assert plots.tick_problems(fig) == []
    assert all(len({t.get_text() for side in plots.tick_labels(ax.xaxis) for t in side}) >= 2 for ax in axes)


def test_labels_on_the_data_that_overlap_are_refused(tmp_path):
    # chapter 10's first KL figure: "1 KV head", "every 2" and "every 3" written over one another
    fig, ax = plots.figure()
    ax.plot([0.33, 0.5, 0.34], [6.3, 8.9, 6.4], "o")
    ax.set(xlim=(0.1, 1), ylim=(1, 20))
    for x, y, words in [(0.33, 6.3, "1 KV head"), (0.5, 8.9, "share by 2"), (0.34, 6.4, "share by 3")]:
        ax.annotate(words, (x, y), textcoords="offset points", xytext=(5, 3))
    assert any("'1 KV head' and 'share by 3' overlap" in p for p in plots.label_problems(fig))
    with pytest.raises(plots.FigureLegibilityError, match="labels '1 KV head' and 'share by 3' overlap"):
        plots.finish(fig, tmp_path / "kl.png")


def test_label_points_places_close_labels_apart(tmp_path):
    """Three labels for points a few pixels apart, and a legend: label_points finds a place for each."""
    fig, ax = plots.figure()
    ax.plot([0.33, 0.5, 0.34], [6.3, 8.9, 6.4], "o", label="points")
    ax.set(xlim=(0.1, 1), ylim=(1, 20))
    ax.legend(loc="upper left")
    fig.tight_layout()
    plots.label_points(ax, [(0.33, 6.3, "1 KV head"), (0.5, 8.9, "share by 2"), (0.34, 6.4, "share by 3")])
    assert len(ax.texts) == 3 and plots.label_problems(fig) == []
    plots.finish(fig, tmp_path / "kl.png")                       # the whole check passes, and the PNG is saved
    assert (tmp_path / "kl.png").exists()


def test_a_legend_the_png_would_cut_off_is_refused(tmp_path):
    # chapter 11's first routers figure: six long entries in two columns, wider than the figure
    fig, ax = plots.figure(height=4.2)
    for i in range(6):
        ax.plot([2, 4], [i, i + 1], label=f"KV-aware (Dynamo's cost), measured (2 workers, a smaller trace) {i}")
    ax.legend(ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    assert plots.outside_problems(fig)
    with pytest.raises(plots.FigureLegibilityError, match="reaches past the figure's edge"):
        plots.finish(fig, tmp_path / "routers.png")
    assert not (tmp_path / "routers.png").exists()
