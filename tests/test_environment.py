"""environment.yml pins exactly what pyproject.toml pins ([project].dependencies and the [dev] extra)."""

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,]+)$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: Jinja2, jinja_2 and jinja2 are one project


def pins(requirements) -> dict:
    out = {}
    for req in requirements:
        m = PIN.match(req.strip())
        assert m, f"not an exact pin: {req!r}"
        name = normalise(m.group(1))
        assert out.get(name, m.group(2)) == m.group(2), f"{name} pinned twice with different versions"
        out[name] = m.group(2)
    return out


def pyproject_pins() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return pins(project["dependencies"] + project["optional-dependencies"]["dev"])


def pip_lines(text: str) -> list:
    """The `- item` lines under `- pip:` in environment.yml (a line parser that needs no PyYAML)."""
    lines, inside, indent = [], False, None
    for raw in text.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        depth = len(line) - len(line.lstrip())
        if re.match(r"^\s*-\s*pip:\s*$", line):
            inside, indent = True, depth
            continue
        if inside:
            if depth <= indent:
                break
            lines.append(re.sub(r"^\s*-\s*", "", line))
    return lines


@pytest.fixture(scope="module")
def environment_text():
    return (ROOT / "environment.yml").read_text()


def test_environment_yml_pins_equal_pyproject(environment_text):
    items = pip_lines(environment_text)
    assert "-e ." in items  # the lab package itself, editable
    env = pins(i for i in items if i != "-e .")
    expected = pyproject_pins()
    assert set(env) == set(expected), (set(env) ^ set(expected))
    assert env == expected
    assert "torch" in env and "pytest" in env  # both groups are really there


def test_environment_yml_structure(environment_text):
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(environment_text)
    assert doc["name"] == "inference-lab"
    assert doc["channels"] == ["conda-forge"]
    assert "python=3.11" in doc["dependencies"] and "pip" in doc["dependencies"]
    (pip,) = [d["pip"] for d in doc["dependencies"] if isinstance(d, dict)]
    assert pip == pip_lines(environment_text)  # the line parser reads what YAML reads


def test_line_parser_stops_at_the_end_of_the_pip_list():
    text = "dependencies:\n  - pip\n  - pip:\n      - a==1  # why\n      - -e .\n  - b=2\nother:\n  - c\n"
    assert pip_lines(text) == ["a==1", "-e ."]


def test_pins_rejects_ranges():
    with pytest.raises(AssertionError, match="exact pin"):
        pins(["torch>=2.0"])
    assert pins(["Jinja2==3.1.6", "tqdm==4.70.1"]) == {"jinja2": "3.1.6", "tqdm": "4.70.1"}


def test_book_and_reader_packages_are_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    main = pins(project["dependencies"])
    extras = project["optional-dependencies"]
    # the book renders offline: math to MathML, code through Pygments; notebooks show DataFrames
    assert {"latex2mathml", "pygments", "pandas", "markdown"} <= set(main)
    # tqdm.auto draws widgets in Jupyter ("IProgress not found" without ipywidgets), in the lab and under nbval
    lab, dev = pins(extras["lab"]), pins(extras["dev"])
    assert "ipywidgets" in lab and lab["ipywidgets"] == dev["ipywidgets"]
    assert "nbclient" in dev  # lab.experiments.notebooks times the notebooks with it
    assert lab["jupytext"] == dev["jupytext"]
