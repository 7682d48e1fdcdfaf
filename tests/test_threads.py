"""lab.threads: `import lab` chooses OpenMP's wait policy before torch loads; lab.contention runs each
setting in a process of its own and reports what it ran with. (The timings themselves are a benchmark,
chapter 3's, never asserted here.)"""

import os
import subprocess
import sys

import pytest

from lab import contention, threads
from lab.results import REPO_ROOT

SHOW = "import os, lab; print(os.environ.get('OMP_WAIT_POLICY')); print(lab.threads.describe())"


def run(code, **env):
    base = {k: v for k, v in os.environ.items() if k not in threads.KEYS + ("LAB_OMP_DEFAULT",)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=base | env, timeout=120, check=True)
    return done.stdout.splitlines()


def test_import_lab_sets_the_wait_policy_before_torch():
    policy, said = run(SHOW)
    assert policy == "PASSIVE" and said == "OpenMP: OMP_WAIT_POLICY=PASSIVE"


def test_a_setting_in_the_environment_wins_and_the_defaults_can_be_kept():
    assert run(SHOW, OMP_WAIT_POLICY="ACTIVE")[0] == "ACTIVE"
    assert run(SHOW, LAB_OMP_DEFAULT="1") == ["None", "OpenMP: OpenMP's defaults"]


def test_torch_imported_first_is_said_plainly():
    (_, said) = run("import os, torch, lab; print(os.environ.get('OMP_WAIT_POLICY')); "
                    "print(lab.threads.describe())")
    assert "torch was imported before lab" in said and "import lab first" in said


def test_a_benchmark_setting_replaces_every_openmp_key():
    env = contention.environment({"GOMP_SPINCOUNT": "10000"})
    assert env["GOMP_SPINCOUNT"] == "10000" and env["LAB_OMP_DEFAULT"] == "1"
    assert "OMP_WAIT_POLICY" not in env and "OMP_NUM_THREADS" not in env
    assert contention.environment({})["LAB_OMP_DEFAULT"] == "1"


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_the_worker_runs_with_the_setting_it_was_given():
    r = contention.worker({"OMP_NUM_THREADS": "1"}, context=4, reps=1, warmup=0)
    assert r["openmp"] == {"OMP_NUM_THREADS": "1"} and r["threads"] == 1 and r["median"] > 0
    assert contention.worker({}, context=4, reps=1, warmup=0)["openmp"] == {}


def test_hogs_are_stopped():
    with contention.Hogs(2) as hogs:
        assert all(p.poll() is None for p in hogs.procs)
    assert all(p.poll() is not None for p in hogs.procs)


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_compare_runs_every_setting_under_every_load_in_rounds():
    r = contention.compare({"one_thread": {"OMP_NUM_THREADS": "1"}}, loads=(0, 1), rounds=2, context=4, reps=1,
                           warmup=0, progress=False)
    assert list(r) == ["one_thread"] and list(r["one_thread"]) == [0, 1]
    for x in r["one_thread"].values():
        assert len(x["rounds"]) == 2 and x["threads"] == 1 and min(x["rounds"]) <= x["median"] <= max(x["rounds"])


def test_chapter_3_records_what_compare_returns():
    """ch03's results entries for a compare()-shaped run (numbers made up; the arithmetic is the oracle)."""
    from lab.experiments.ch03_savings import load_values

    run = lambda *ms: {n: dict(median=m, rounds=[m], threads=2) for n, m in zip((0, 1, 4), ms, strict=True)}
    v = load_values({"default": run(0.02, 0.05, 0.8), "lab": run(0.04, 0.05, 0.2)})
    assert v["default"]["busy_ms"]["value"] == 800 and v["default"]["busy_slowdown"]["value"] == 40
    assert v["lab"]["one_ms"]["value"] == 50 and v["lab"]["setting"]["value"] == "OMP_WAIT_POLICY=PASSIVE"
    assert v["idle_cost"]["value"] == 2 and v["busy_gain"]["value"] == 4 and v["busy_programs"]["value"] == 4


ENGINE = ("import os, sys; from lab import threads; threads.for_engines(sys.argv[1]); import subprocess; "
          "print(subprocess.run([sys.executable, '-c', \"import os, lab; print(os.environ.get('OMP_WAIT_POLICY'))\"],"
          " capture_output=True, text=True, check=True).stdout.strip())")


@pytest.mark.parametrize("policy, child", [("spin", "None"), ("passive", "PASSIVE")])
def test_a_server_starts_its_engine_processes_with_the_policy_it_chose(policy, child):
    """`python -m lab.serve --wait-policy` (default spin): the engine processes it starts, which import lab
    themselves, run with OpenMP's defaults or with PASSIVE; an OMP_WAIT_POLICY exported first wins."""
    assert run(ENGINE.replace("sys.argv[1]", repr(policy))) == [child]
    assert run(ENGINE.replace("sys.argv[1]", repr(policy)), OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE"]
    with pytest.raises(ValueError, match="one of spin, passive"):
        threads.for_engines("busy")


def test_a_lab_server_is_started_as_a_user_starts_it(monkeypatch):
    """lab_server's environment holds none of this process's OpenMP settings (nor LAB_OMP_DEFAULT=1, which
    `make results` sets), and no --threads unless asked."""
    from lab.serve import process

    seen = {}
    monkeypatch.setattr(process, "server_process", lambda command, env, port, timeout_s: seen.update(c=command, e=env))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("LAB_OMP_DEFAULT", "1")
    process.lab_server(cores=None, wait_policy="passive")
    assert not set(seen["e"]) & set(threads.KEYS + ("LAB_OMP_DEFAULT",))
    assert "--threads" not in seen["c"] and seen["c"][-2:] == ["--wait-policy", "passive"]
    process.lab_server(cores=None, threads=2)
    assert seen["c"][-2:] == ["--threads", "2"]
