"""
OpenMP's wait policy, chosen before torch loads, so that a chapter does not collapse on a busy machine.

torch runs its CPU operators on a team of OpenMP threads (GNU libgomp in the PyPI wheels), one per core.
A decode step of a small model is hundreds of short parallel operators, and between two of them libgomp
lets its threads *spin*, burning a core while they wait for the next one (by default for about 300,000
turns of a loop, GOMP_SPINCOUNT, before they sleep). On an idle machine that saves the microseconds of
waking a sleeping thread. When other programs want the same cores, a spinning thread takes a core from
the very threads it waits for, and an operator that needs all threads waits for the one the scheduler
parked. Chapter 3 measures a SmolLM2 decode step beside other torch programs, with the defaults and with
PASSIVE, and what PASSIVE costs on an idle machine (results key ch03.under_load).

OMP_WAIT_POLICY=PASSIVE makes waiting threads sleep at once. libgomp reads it once, when it loads,
which is when torch is imported; so `import lab` before torch (or transformers, which imports torch) sets
it, and the notebooks import `lab` first. A value already in the environment wins, and LAB_OMP_DEFAULT=1
leaves OpenMP's defaults alone (chapter 3's benchmark uses it to measure them). Child processes inherit
the environment, so the servers, workers and probes the experiments start get the same setting.
"""

import os
import sys

SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE"}  # what the lab runs torch with; chapter 3 measures the choice
KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")  # what a benchmark setting may change
TORCH_LOADED_FIRST = "torch" in sys.modules  # at `import lab`: then libgomp has read its settings already
USER_SET = frozenset(k for k in KEYS if k in os.environ)  # exported before `import lab`: they always win
WAIT_POLICIES = ("spin", "passive")


def configure() -> None:
    """Put SETTINGS into the environment where they are unset, unless LAB_OMP_DEFAULT=1."""
    if os.environ.get("LAB_OMP_DEFAULT", "").strip() not in ("1", "true", "yes"):
        for k, v in SETTINGS.items():
            os.environ.setdefault(k, v)


def peer_env(**extra) -> dict:
    """This process's environment for a peer system (llama.cpp, vLLM) started from it: without any OpenMP
    setting, so that the peer runs with its own defaults and its own thread flags, not the lab's
    PASSIVE (llama.cpp's decode falls to half under it), plus `extra`."""
    drop = KEYS + ("OMP_PROC_BIND", "OMP_PLACES")
    return {k: v for k, v in os.environ.items() if k not in drop} | {k: str(v) for k, v in extra.items()}


def for_engines(policy: str) -> None:
    """Set this process's environment for the engine processes it starts next (they inherit it): "spin",
    OpenMP's defaults, threads spinning between operators, the fastest when the engine owns its cores, as
    a server's engine does (chapter 8 measures both); or "passive", the notebooks' setting for a shared
    laptop. An OMP_WAIT_POLICY exported before `import lab` wins over either."""
    if policy not in WAIT_POLICIES:
        raise ValueError(f"wait policy {policy!r}: one of {', '.join(WAIT_POLICIES)}")
    if "OMP_WAIT_POLICY" in USER_SET:
        return
    if policy == "spin":
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ["LAB_OMP_DEFAULT"] = "1"     # so that the child's own `import lab` leaves the defaults alone
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.pop("LAB_OMP_DEFAULT", None)


def describe() -> str:
    """One line for a notebook's first cell: the OpenMP settings in effect in this process."""
    shown = ", ".join(f"{k}={os.environ[k]}" for k in KEYS if k in os.environ) or "OpenMP's defaults"
    if TORCH_LOADED_FIRST:
        return (f"{shown} in the environment, but torch was imported before lab, so this process runs "
                f"with whatever the environment held then; restart and import lab first")
    return f"OpenMP: {shown}"
