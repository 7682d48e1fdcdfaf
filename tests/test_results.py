"""lab.results: the results file is merged by section, written atomically, validated, and never clobbered."""

import json
import os
import tempfile
import threading

import jsonschema
import pytest

from lab import results
from lab.results import (
    COMMITTED,
    ResultsError,
    ResultsKeyError,
    format_value,
    get,
    leaf_keys,
    not_run,
    read,
    validate,
    value,
    write_section,
)


@pytest.fixture(scope="module")
def prov():
    return results.provenance(mode="quick", manifest="sha256:test")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    """Each test starts in the default mode (quick) with no override, whatever the shell that ran pytest set."""
    for name in ("LAB_QUICK", "LAB_FULL", "LAB_RESULTS"):
        monkeypatch.delenv(name, raising=False)


def ch01_values():
    return {
        "positions": {"uncached": value(1040, "positions"), "cached": value(64, "positions")},
        "speedup": value(24.1, "x", spread=0.4, n=7),
        "gpu_step": not_run("needs a CUDA GPU; this machine has none", unit="ms"),
    }


def test_schema_is_a_valid_draft_2020_12_schema():
    schema = json.loads(results.SCHEMA.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_provenance_has_the_required_keys(prov):
    for key in ("date", "git", "machine", "gpu", "versions", "manifest", "mode"):
        assert key in prov, key
    assert prov["date"].endswith("+00:00")  # UTC
    assert set(prov["git"]) == {"commit", "dirty"}
    for key in ("arch", "processor", "os", "cpu_count", "torch_threads"):
        assert key in prov["machine"], key
    assert set(prov["versions"]) >= {"python", "torch", "transformers"}
    assert prov["manifest"] == "sha256:test" and prov["mode"] == "quick"
    assert results.provenance(seed=0)["seed"] == 0  # extra keys are recorded


def test_provenance_mode_follows_quick(monkeypatch):
    assert results.provenance()["mode"] == "quick"  # the default
    monkeypatch.setenv("LAB_FULL", "1")
    assert results.provenance()["mode"] == "full"
    monkeypatch.setenv("LAB_FULL", "0")
    monkeypatch.setenv("LAB_QUICK", "1")
    assert results.provenance()["mode"] == "quick"


def test_round_trip(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    doc = read(path)
    assert doc["schema_version"] == 1
    assert doc["sections"]["ch01"]["values"] == ch01_values()
    assert doc["sections"]["ch01"]["provenance"] == prov
    assert get("ch01.positions.uncached", path) == {"value": 1040, "unit": "positions"}
    assert get("ch01.speedup", path)["spread"] == 0.4


def test_written_document_validates(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    doc = json.loads(path.read_text())  # the file itself, read without lab.results.read
    validate(doc)                       # raises ResultsError if the written file broke the schema
    assert doc["sections"]["ch01"]["values"] == ch01_values()


def test_value_converts_numpy_and_torch_scalars():
    torch = pytest.importorskip("torch")
    leaf = value(torch.tensor(2.5), "ms", spread=torch.tensor([0.1, 0.2]))
    assert leaf == {"value": 2.5, "unit": "ms", "spread": pytest.approx([0.1, 0.2])}
    assert type(leaf["value"]) is float
    json.dumps(leaf)


def test_merge_by_section_keeps_the_other_section(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    write_section("ch02", {"bytes": value(36864, "B")}, prov, path=path)
    write_section("ch01", {"positions": {"uncached": value(2000, "positions")}}, prov, path=path)
    doc = read(path)
    assert list(doc["sections"]) == ["ch01", "ch02"]
    assert doc["sections"]["ch02"]["values"] == {"bytes": value(36864, "B")}
    # a section is replaced whole: the old ch01 keys are gone
    assert leaf_keys(doc) == ["ch01.positions.uncached", "ch02.bytes"]
    assert get("ch01.positions.uncached", path)["value"] == 2000


def test_update_section_sets_one_key_and_keeps_the_rest(tmp_path, prov):
    """One part of a chapter measured again alone (ch07's llama.cpp part): its key is replaced, the section's
    other values, figures and provenance stay, and the part's provenance is added beside it."""
    path = tmp_path / "results.json"
    figure = {"speedup": {"path": results.FIGURES / "speedup.png", "caption": "cached vs uncached"}}
    write_section("ch01", ch01_values(), prov, path=path, figures=figure)
    write_section("ch02", {"bytes": value(36864, "B")}, prov, path=path)
    before = read(path)["sections"]["ch01"]
    results.update_section("ch01", "speedup", {"peer": value(3.0, "x")}, {"peer": {"version": "1.0"}}, path=path)
    doc = read(path)
    after = doc["sections"]["ch01"]
    assert after["values"] == before["values"] | {"speedup": {"peer": value(3.0, "x")}}
    assert after["figures"] == before["figures"]
    assert after["provenance"] == before["provenance"] | {"peer": {"version": "1.0"}}
    assert doc["sections"]["ch02"]["values"] == {"bytes": value(36864, "B")}
    with pytest.raises(ResultsError, match="no section 'ch09'"):
        results.update_section("ch09", "x", value(1, None), path=path)
    with pytest.raises(ResultsError, match="does not fit the schema"):
        results.update_section("ch01", "bad", {"value": 1}, path=path)
    assert read(path) == doc


def test_concurrent_writers_lose_no_section(tmp_path, prov):
    # flock locks belong to an open file description, so threads that each open the lock file exclude
    # each other exactly as processes would.
    path = tmp_path / "results.json"
    n = 12
    start = threading.Barrier(n)
    errors = []

    def writer(i):
        try:
            start.wait()
            write_section(f"ch{i:02d}", {"x": value(i, None)}, prov, path=path)
        except Exception as e:  # surfaced below; a thread's exception would vanish otherwise
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(read(path)["sections"]) == [f"ch{i:02d}" for i in range(n)]


def test_figures_are_recorded_relative_to_the_repo_or_absolute(tmp_path, prov):
    path = tmp_path / "results.json"
    inside = results.FIGURES / "speedup.png"
    outside = tmp_path / "figures" / "speedup.png"
    write_section("ch01", ch01_values(), prov, path=path, figures={
        "speedup": {"path": inside, "caption": "cached vs uncached"},
        "quick": {"path": outside, "caption": "a quick-mode figure"},
    })
    figures = read(path)["sections"]["ch01"]["figures"]
    assert figures["speedup"] == {"path": "results/figures/speedup.png", "caption": "cached vs uncached"}
    assert figures["quick"]["path"] == str(outside.resolve())


def leftovers(directory):
    """Files a write may leave behind besides the results file and its lock."""
    return sorted(p.name for p in directory.iterdir() if p.name not in ("results.json", "results.json.lock"))


def test_atomic_write_leaves_no_temporary_file(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    write_section("ch02", {"bytes": value(1, "B")}, prov, path=path)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fail", ["fsync", "replace"])
def test_crash_mid_write_keeps_the_old_file(tmp_path, prov, monkeypatch, fail):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(f"simulated crash in os.{fail}")

    monkeypatch.setattr(os, fail, crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_section("ch02", {"bytes": value(1, "B")}, prov, path=path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []
    assert list(read(path)["sections"]) == ["ch01"]


def test_invalid_values_are_refused_before_the_disk_is_touched(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    before = path.read_bytes()
    with pytest.raises(ResultsError, match="unit"):
        write_section("ch02", {"bytes": {"value": 1}}, prov, path=path)
    with pytest.raises(ResultsError, match="NaN|nan|Out of range"):
        write_section("ch02", {"ratio": value(float("nan"), "x")}, prov, path=path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("content", ["half", "empty", "not-the-schema"])
def test_corrupt_file_is_refused_by_read_and_write(tmp_path, prov, content):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    text = path.read_text()
    corrupt = {"half": text[: len(text) // 2], "empty": "", "not-the-schema": '{"sections": []}'}[content]
    path.write_text(corrupt)

    for attempt in (lambda: read(path), lambda: write_section("ch02", {}, prov, path=path)):
        with pytest.raises(ResultsError) as e:
            attempt()
        message = str(e.value)
        assert str(path) in message
        assert "make results" in message and "git checkout results/results.json" in message
    assert path.read_text() == corrupt  # never overwritten


def test_corrupt_json_message_gives_the_position(tmp_path):
    path = tmp_path / "results.json"
    path.write_text('{"schema_version": 1,\n "sections": {')
    with pytest.raises(ResultsError, match=r"line 2, column"):
        read(path)


def test_schema_violation_message_names_the_place(tmp_path, prov):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc_with({"a": {"b": {"value": 1}}}, prov)))
    with pytest.raises(ResultsError, match=r"sections\.ch01\.values\.a\.b.*'unit' is a required property"):
        read(path)


def doc_with(values, prov):
    return {"schema_version": 1, "sections": {"ch01": {"provenance": prov, "values": values}}}


def test_schema_rejects_a_leaf_without_unit(prov):
    with pytest.raises(ResultsError, match="unit"):
        validate(doc_with({"x": {"value": 3}}, prov))


def test_schema_rejects_not_run_without_reason(prov):
    with pytest.raises(ResultsError, match="reason"):
        validate(doc_with({"x": {"value": "NOT_RUN", "unit": "ms"}}, prov))
    validate(doc_with({"x": not_run("needs a GPU", "ms")}, prov))


def test_schema_accepts_every_kind_of_value_and_nothing_else(prov):
    good = {"int": value(3, "B"), "float": value(2.5, "ms"), "text": value("fp32", None),
            "flag": value(True, None), "series": value([1, 2.5, 3], "ms")}
    validate(doc_with(good, prov))
    for bad in ({"value": {"nested": 1}, "unit": "ms"}, {"value": ["a"], "unit": None},
                {"value": None, "unit": "ms"}, {"value": 1, "unit": 3}):
        with pytest.raises(ResultsError):
            validate(doc_with({"x": bad}, prov))


def test_schema_rejects_dotted_keys_and_missing_provenance(prov):
    with pytest.raises(ResultsError):
        validate(doc_with({"a.b": value(1, None)}, prov))  # get() could never reach it
    incomplete = {k: v for k, v in prov.items() if k != "machine"}
    with pytest.raises(ResultsError, match="machine"):
        validate(doc_with({"x": value(1, None)}, incomplete))


def test_get_missing_key_lists_a_close_match(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    with pytest.raises(ResultsKeyError) as e:
        get("ch01.positions.uncahced", path)
    message = str(e.value)
    assert "ch01.positions.uncached" in message and str(path) in message
    assert not message.startswith(("'", '"'))  # readable, not KeyError's quoted repr
    assert isinstance(e.value, KeyError) and isinstance(e.value, ResultsError)


def test_get_unknown_section_lists_the_sections(tmp_path, prov):
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), prov, path=path)
    write_section("ch02", {"bytes": value(1, "B")}, prov, path=path)
    with pytest.raises(ResultsKeyError, match="sections available: ch01, ch02"):
        get("zz99.something.else.entirely", path)
    with pytest.raises(ResultsKeyError, match="group, not a value"):
        get("ch01.positions", path)
    with pytest.raises(ResultsKeyError, match="make results"):
        get("ch01.x", tmp_path / "missing.json")


def test_read_of_a_missing_file_is_empty(tmp_path):
    assert read(tmp_path / "nothing.json") == {"schema_version": 1, "sections": {}}


@pytest.mark.parametrize("env", [{}, {"LAB_QUICK": "1"}, {"LAB_FULL": "0"}, {"LAB_QUICK": "0"}])
def test_quick_is_the_default_and_only_lab_full_selects_full(monkeypatch, env):
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    assert results.quick()
    assert results.results_path() != COMMITTED


def test_lab_full_and_lab_quick_together_are_refused(monkeypatch):
    monkeypatch.setenv("LAB_FULL", "1")
    monkeypatch.setenv("LAB_QUICK", "1")
    with pytest.raises(ResultsError, match="LAB_FULL=1 and LAB_QUICK=1"):
        results.quick()


def test_quick_mode_never_writes_the_committed_file(tmp_path, monkeypatch, prov):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = COMMITTED.read_bytes() if COMMITTED.exists() else None
    assert results.quick()  # the default: nothing set
    assert results.results_path() != COMMITTED
    assert results.results_path() == tmp_path / "lab-quick" / "results.json"
    assert results.figures_dir() == tmp_path / "lab-quick" / "figures" and results.figures_dir().is_dir()
    write_section("ch01", ch01_values(), prov)  # default path
    assert (tmp_path / "lab-quick" / "results.json").exists()
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before


def test_results_path_in_full_mode_and_with_override(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_FULL", "1")
    assert not results.quick()
    assert results.results_path() == COMMITTED
    assert results.figures_dir() == results.FIGURES
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "r.json"))
    assert results.results_path() == tmp_path / "r.json"  # in full mode
    monkeypatch.delenv("LAB_FULL")
    monkeypatch.setenv("LAB_QUICK", "yes")
    assert results.results_path() == tmp_path / "r.json"  # and in quick mode


@pytest.mark.parametrize("leaf, spec, expected", [
    (value(1040, "positions"), "", "1,040 positions"),
    (value(24.1, "x"), "", "24.1×"),
    (value(95.2, "%"), "", "95.2%"),
    (value(3.14159, "ms"), ".1f", "3.1 ms"),
    (value(0.0123, "s"), "", "0.0123 s"),
    (value(6e-5, "s"), "", "6.0e-05 s"),
    (value(1234.56, "tokens/s"), "", "1,235 tokens/s"),
    (value(2.5e9, "B"), "", "2.50e+09 B"),
    (value(12, None), "", "12"),
    (value([1, 2, 3], "ms"), "", "1, 2, 3 ms"),
    (value("float32", None), "", "float32"),
    (not_run("needs a CUDA GPU", "ms"), "", "not run (needs a CUDA GPU)"),
    (not_run("needs a CUDA GPU", "ms"), ".1f", "not run (needs a CUDA GPU)"),
    # |number: the value alone, the format spec still applied
    (value(48, "steps"), "|number", "48"),
    (value(1040, "positions"), "|number", "1,040"),
    (value(46.8321, "perplexity"), ".1f|number", "46.8"),
    (value(21.24, "x"), ".1f|number", "21.2"),
    (value(95.24, "%"), " .1f | number ", "95.2"),
    (value([1.25, 2.5], "ms"), ".1f|number", "1.2, 2.5"),
    (not_run("needs a CUDA GPU", "ms"), "|number", "not run (needs a CUDA GPU)"),
    # |bool:A/B: a boolean as a word
    (value(True, None), "|bool:identical/different", "identical"),
    (value(False, None), "|bool:identical/different", "different"),
    (value(False, None), "|bool: yes / no ", "no"),
    (value([True, False], None), "|bool:on/off", "on, off"),
    (value(True, None), "", "true"),  # lab.book.render refuses this in prose; the README table may show it
    # one of a plural word unit reads in the singular; 1.0, abbreviations and other words do not change
    (value(1, "requests"), "", "1 request"),
    (value(1, "entries"), "", "1 entry"),
    (value(1, "ms"), "", "1 ms"),
    (value(1, "tok/s"), "", "1 tok/s"),
    (value(1.0, "requests"), "", "1.00 requests"),
    (value(2, "requests"), "", "2 requests"),
    (value(1, "class"), "", "1 class"),
])
def test_format_value(leaf, spec, expected):
    assert format_value(leaf, spec) == expected


@pytest.mark.parametrize("leaf, spec, match", [
    (value(True, None), "|bool:identical", "two words"),
    (value(True, None), "|bool:/different", "two words"),
    (value(3, "ms"), "|bool:yes/no", "applies to a boolean"),
    (value(True, None), "|number", "boolean"),
    (value(True, None), ".1f", "boolean"),
    (value(3, "ms"), "|words", "unknown"),
])
def test_format_value_refuses(leaf, spec, match):
    with pytest.raises(ValueError, match=match):
        format_value(leaf, spec)


def test_committed_results_file_fits_the_schema():
    if not COMMITTED.exists():
        pytest.skip("results/results.json is not committed yet")
    doc = read(COMMITTED)  # raises ResultsError unless the file is valid JSON that fits the schema
    assert {"ch01", "ch02", "ch03", "ch04", "ch05"} <= set(doc["sections"])
    assert all(s["provenance"]["mode"] == "full" for s in doc["sections"].values())


def test_notebook_timings_are_recorded_in_quick_mode(tmp_path, monkeypatch):
    """lab.experiments.notebooks runs a notebook in a fresh kernel, in quick mode with a temporary results
    file, and records its wall time in the results file it was given (the committed one is never touched)."""
    pytest.importorskip("nbclient")
    from lab.experiments import notebooks

    monkeypatch.setenv("LAB_FULL", "1")  # as under `make results`: the notebook must still run in quick mode
    before = COMMITTED.read_bytes() if COMMITTED.exists() else None
    (tmp_path / "ch99_tiny.py").write_text(
        "# %% [markdown]\n# A tiny notebook.\n\n"
        "# %%\nimport os\nfrom lab import results\n\n"
        "# %%\nassert results.quick() and os.environ['LAB_QUICK'] == '1'\n"
        f"assert str(results.results_path()) != {str(COMMITTED)!r}\n")
    (tmp_path / "ch98_broken.py").write_text("# %%\nraise RuntimeError('a broken cell')\n")
    path = tmp_path / "results.json"
    write_section("ch01", ch01_values(), results.provenance(), path=path)
    notebooks.time_notebooks([tmp_path / "ch99_tiny.py", tmp_path / "ch98_broken.py"], path=path, limit=300)
    doc = read(path)
    values = doc["sections"]["notebooks"]["values"]
    assert values["limit"] == {**value(300, "s"), "note": values["limit"]["note"]}
    tiny = values["seconds"]["ch99_tiny"]
    assert tiny["unit"] == "s" and 0 < tiny["value"] < 300
    assert values["within_limit"]["ch99_tiny"]["value"] is True
    broken = values["seconds"]["ch98_broken"]
    assert broken["value"] == "NOT_RUN" and "a broken cell" in broken["reason"]
    assert values["all_within_limit"]["value"] is False
    assert doc["sections"]["notebooks"]["provenance"]["mode"] == "full"
    assert doc["sections"]["notebooks"]["provenance"]["notebook_mode"] == "quick"
    assert "ch01" in doc["sections"]  # the other sections stay
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before


# -----------------------------------------------------------------------------
# a clean campaign: full mode measures committed code, and every section says where it stands


def test_full_mode_refuses_a_dirty_tree_unless_told(monkeypatch, tmp_path):
    monkeypatch.setenv("LAB_FULL", "1")
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    monkeypatch.setattr(results, "_git", lambda: {"commit": "abc1234", "dirty": True})
    with pytest.raises(ResultsError, match="uncommitted changes.*LAB_ALLOW_DIRTY=1"):
        results.require_clean()
    prov = results.provenance()
    assert "work_in_progress" not in prov
    with pytest.raises(ResultsError, match="uncommitted changes"):  # and again when it writes
        write_section("ch01", ch01_values(), prov)
    with pytest.raises(ResultsError, match="uncommitted changes"):
        results.update_section("ch01", "speedup", value(2.0, "x"))
    assert not (tmp_path / "results.json").exists()
    monkeypatch.setenv("LAB_ALLOW_DIRTY", "1")
    results.require_clean()
    prov = results.provenance()
    assert prov["work_in_progress"] is True
    write_section("ch01", ch01_values(), prov)
    assert read()["sections"]["ch01"]["provenance"]["work_in_progress"] is True


def test_a_clean_tree_and_quick_mode_and_explicit_paths_are_not_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(results, "_git", lambda: {"commit": "abc1234", "dirty": True})
    results.require_clean()  # quick mode: a reader's run on a tree they edit
    monkeypatch.setenv("LAB_FULL", "1")
    write_section("ch01", ch01_values(), results.provenance(), path=tmp_path / "r.json")  # a test's own file
    monkeypatch.setattr(results, "_git", lambda: {"commit": "abc1234", "dirty": False})
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    results.require_clean()
    prov = results.provenance()
    assert "work_in_progress" not in prov
    write_section("ch01", ch01_values(), prov)


def test_provenance_records_the_wall_time_since_the_clock_started(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(results.time, "monotonic", lambda: now[0])
    results.start_clock()
    now[0] = 142.5
    assert results.provenance(mode="quick")["wall_seconds"] == 42.5


def test_campaign_status_flags_dirty_sections_and_commits_off_this_history(prov):
    from lab import campaign

    head = campaign._git("rev-parse", "--short", "HEAD").stdout.strip()
    if not head:
        pytest.skip("not a git checkout")

    def section(commit, dirty, **extra):
        return {"provenance": {**prov, "git": {"commit": commit, "dirty": dirty}, **extra},
                "values": {"x": value(1, "x")}}

    doc = {"schema_version": 1, "sections": {
        "ch01": section(head, False), "ch02": section(head, True), "ch03": section("0123abc", False),
        "ch04": section(head, False, work_in_progress=True), "ch05_gpu": section("unknown", None)}}
    rows = {r["section"]: r for r in campaign.status(doc)}
    assert rows["ch01"]["ancestor"] is True and rows["ch01"]["changed"] is False
    assert rows["ch03"]["ancestor"] is False
    found = campaign.problems(doc)
    assert not any(p.startswith("ch01:") for p in found)
    for name in ("ch02", "ch03", "ch04", "ch05_gpu"):
        assert any(p.startswith(f"{name}:") for p in found), (name, found)
    assert "lab/experiments/gpu.py" in campaign.sources("ch05_gpu")
    assert "lab/experiments/ch02_build.py" in campaign.sources("ch02")
    assert "notebooks" in campaign.sources("notebooks")


def test_campaign_tells_a_change_of_docstrings_and_comments_from_a_change_of_code():
    from lab import campaign

    old = 'def f(x):\n    """Add one."""\n    return x + 1  # one more\n'
    assert campaign.same_code(old, old.replace("Add one.", "Add one to x.").replace("# one more", "# plus one"))
    assert not campaign.same_code(old, old.replace("x + 1", "x + 2"))
    assert not campaign.same_code(old, old.replace('"""Add one."""', 'y = "Add one."'))  # no longer a docstring
    assert campaign.same_code(None, None) and not campaign.same_code(old, None)


def test_campaign_sources_are_what_a_section_runs():
    """A section's sources follow its experiment's imports, the modules it starts by name and the scripts beside
    a module that it runs: chapter 8 runs the fused step and starts the server, chapter 11 also the disaggregated
    workers, which chapter 1 never reaches."""
    from lab import campaign

    ch01, ch07, ch08, ch11 = (set(campaign.sources(s)) for s in ("ch01", "ch07", "ch08", "ch11"))
    assert {"lab/experiments/ch08_serving.py", "lab/kernels/step.py", "lab/serve/__main__.py"} <= ch08
    assert "lab/peers/kvpress_run.py" in ch07                   # run as a script beside compare_kvpress.py
    assert "lab/serve/disagg.py" in ch11 and "lab/serve/disagg.py" not in ch01
    assert {"lab/__init__.py", "lab/cache/__init__.py", "lab/experiments/ch01_recompute.py"} <= ch01
    assert not any(f.startswith("lab/exercises/") for f in ch01 | ch08 | ch11)


def test_campaign_reaches_the_definitions_a_section_can_call(tmp_path, monkeypatch):
    """reached: a name imported from a module, named on it or named by a reached definition of the same file
    is reached; one nothing names is not, unless decorated; a program, or a module passed around as a value,
    is reached as a whole."""
    from lab import campaign

    files = {"__init__.py": "",
             "a.py": "def f():\n    return g()\ndef g():\n    return 1\ndef h():\n    return 2\nX = 3\n",
             "b.py": "from .a import f\nfrom . import c\ndef run():\n    return f() + c.k()\n",
             "c.py": "def k():\n    return 1\ndef unused():\n    pass\n@register\ndef hook():\n    pass\n",
             "d.py": "from . import a as mod\nFAMILIES = {'a': mod}\n"}
    (tmp_path / "lab").mkdir()
    for name, text in files.items():
        (tmp_path / "lab" / name).write_text(text)
    monkeypatch.setattr(campaign, "REPO_ROOT", tmp_path)
    lab = {name: tmp_path / "lab" / name for name in files}
    used = campaign.reached({lab[n] for n in ("__init__.py", "a.py", "b.py", "c.py")}, {lab["b.py"]})
    assert used[lab["a.py"]] == {"f", "g"} and used[lab["c.py"]] == {"k", "hook"}
    assert campaign.ALL in used[lab["b.py"]]
    assert campaign.ALL in campaign.reached(set(lab.values()), {lab["b.py"]})[lab["a.py"]]   # d passes a around


def test_campaign_counts_a_change_only_where_a_section_reaches_it(monkeypatch):
    """The commit that gave compare_servers its warm-up (4083ff6) changed lab/loadgen.py: chapter 8 runs
    compare_servers, chapter 3 imports only loadgen.random_prompts (through step_cost), so, that commit
    against its parent, chapter 8's code changed and chapter 3's did not."""
    from lab import campaign

    git = campaign._git
    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false" or \
            git("cat-file", "-e", "4083ff6^{commit}").returncode:
        pytest.skip("not a full git checkout of this history")
    at = lambda a: "4083ff6" if a == "HEAD" else a.replace("HEAD:", "4083ff6:", 1)   # that commit as HEAD
    monkeypatch.setattr(campaign, "_git", lambda *args: git(*map(at, args)))
    assert campaign.changed_since("4083ff6~1", "ch08") is True
    assert campaign.changed_since("4083ff6~1", "ch03") is False


def test_committed_results_were_measured_on_committed_code():
    """Every section of the committed results.json was measured on a clean tree, at a commit of this history, and
    not as work in progress: what `make results-status` reports as problems."""
    from lab import campaign

    if not results.COMMITTED.exists():
        pytest.skip("no committed results.json yet")
    if campaign._git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git checkout: the commits the sections name may be missing from it")
    assert campaign.problems(results.read(results.COMMITTED)) == []
