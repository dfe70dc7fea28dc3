"""The conda envs of the workflow: they parse, every spec is a valid conda match spec (py-rattler)
or pip requirement, every rule names an env file that exists, and versions agree with pyproject.toml."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

rattler = pytest.importorskip("rattler")

REPO = Path(__file__).resolve().parents[1]
ENVS = sorted((REPO / "envs").glob("*.yaml"))
# conda-forge names that differ from the PyPI names in pyproject.toml
CONDA_TO_PYPI = {"pytorch": "torch", "matplotlib-base": "matplotlib", "lm_eval": "lm-eval"}
# Tools rather than Python dependencies: pip, and the C compiler the native CPU kernels are built with.
TOOLCHAIN = {"pip", "c-compiler"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_specs() -> dict[str, SpecifierSet]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [r for r in extra if not r.startswith("hybrid-llama")]
    out = {"python": SpecifierSet(project["requires-python"])}
    for line in reqs:
        req = Requirement(line)
        out[_norm(req.name)] = req.specifier
    return out


def env_specs(path: Path) -> list[tuple[str, str, str]]:
    """[(kind, name, version spec)] of an env file; kind is 'conda' or 'pip'."""
    env = yaml.safe_load(path.read_text())
    out = []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for line in dep["pip"]:
                req = Requirement(line)
                out.append(("pip", _norm(req.name), str(req.specifier)))
        else:
            spec = rattler.MatchSpec(dep)
            name = spec.name.normalized if hasattr(spec.name, "normalized") else str(dep).split()[0]
            out.append(("conda", name, spec.version or ""))
    return out


def test_envs_exist():
    assert {p.stem for p in ENVS} == {"weights", "train", "eval", "report"}


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.name)
def test_env_parses(path):
    env = yaml.safe_load(path.read_text())
    assert env["channels"] == ["conda-forge", "nodefaults"]
    specs = env_specs(path)
    assert specs, "no dependencies"
    names = [n for _, n, _ in specs]
    assert len(names) == len(set(names)), f"duplicate packages in {path.name}"
    assert "python" in names


def test_invalid_spec_is_rejected():
    """The check above can fail: rattler refuses a malformed spec."""
    with pytest.raises(Exception):  # noqa: B017 (rattler raises its own parse error types)
        rattler.MatchSpec("pytorch >>=2.4")


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.name)
def test_env_versions_match_pyproject(path):
    ours = pyproject_specs()
    for _kind, name, version in env_specs(path):
        pypi = _norm(CONDA_TO_PYPI.get(name, name))
        if pypi in TOOLCHAIN:
            continue
        assert pypi in ours, f"{path.name}: {name} is not a dependency in pyproject.toml"
        want = ours[pypi]
        got = SpecifierSet(version.replace(" ", "")) if version else SpecifierSet()
        assert got == want, f"{path.name}: {name} {version!r} != pyproject {str(want)!r}"


def test_every_rule_names_an_existing_env():
    rules_dir = REPO / "workflow" / "rules"
    seen = 0
    for smk in sorted(rules_dir.glob("*.smk")):
        for block in re.split(r"\n(?=rule \w+:)", smk.read_text())[1:]:
            name = re.match(r"rule (\w+):", block).group(1)
            m = re.search(r"\n    conda:\n        \"([^\"]+)\"", block)
            assert m, f"{smk.name}: rule {name} has no conda: directive"
            env = (rules_dir / m.group(1)).resolve()
            assert env.is_file() and env.parent == REPO / "envs", f"rule {name}: {m.group(1)}"
            seen += 1
    assert seen >= 15
