"""User code without forking: IMPORTS / --import bring the user's modules into every process before
the model is built, so that a timm model registered there is found by MODEL.ARCH."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from distribuuuu import cli, config
from tests.conftest import TINY, env, read_metrics

# A tiny timm-registered model: a conv, global pooling and a linear head.
MODEL_SOURCE = textwrap.dedent('''
    import torch.nn as nn
    from timm.models import register_model


    class Tiny(nn.Module):
        def __init__(self, num_classes=1000, in_chans=3, **kwargs):
            super().__init__()
            self.conv = nn.Conv2d(in_chans, 8, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, num_classes)

        def forward(self, x):
            return self.fc(self.pool(self.conv(x).relu()).flatten(1))


    @register_model
    def {name}(pretrained=False, **kwargs):
        return Tiny(**kwargs)
''')


def _write_model(folder, module: str, arch: str) -> str:
    path = folder / f"{module}.py"
    path.write_text(MODEL_SOURCE.replace("{name}", arch))
    return str(path)


def _train_opts(out_dir) -> list[str]:
    return ["OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(out_dir), "TRAIN.SYNTHETIC_SAMPLES", "32",
            "TEST.SYNTHETIC_SAMPLES", "16", "MODEL.SMALL_STEM", "False"]


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """tmp_path on sys.path and PYTHONPATH, as a user's project folder would be."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_an_imported_module_registers_the_model_that_trains_in_process(on_path):
    _write_model(on_path, "h3_user_models", "h3_user_tiny")
    status = cli.main(["train", "--cfg", TINY, "MODEL.ARCH", "h3_user_tiny",
                       "IMPORTS", "['h3_user_models']", *_train_opts(on_path / "run")])
    assert status == 0
    assert os.path.isfile(on_path / "run" / "checkpoints" / "last.pth")
    assert read_metrics(str(on_path / "run"))  # it trained and recorded
    saved = config.load_config(str(on_path / "run" / "config.yaml"))
    assert saved.IMPORTS == ["h3_user_models"]


def test_a_py_file_path_and_the_import_flag(tmp_path):
    path = _write_model(tmp_path, "h3_user_file", "h3_user_file_tiny")
    status = cli.main(["train", "--cfg", TINY, "--import", path, "MODEL.ARCH", "h3_user_file_tiny",
                       *_train_opts(tmp_path / "run")])
    assert status == 0
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "last.pth")


def test_the_import_flag_adds_to_imports():
    assert config.with_imports(None, ["IMPORTS", "['a']", "X", "1"], ["b"]) == ["IMPORTS", "['a', 'b']", "X", "1"]
    assert config.with_imports(None, ["X", "1"], ["b", "b"]) == ["IMPORTS", "['b']", "X", "1"]
    assert config.with_imports(None, ["X", "1"], []) == ["X", "1"]


@pytest.mark.parametrize("entry, expected", [
    ("h3_no_such_module", "IMPORTS: cannot import 'h3_no_such_module' (ModuleNotFoundError: No module named "
                          "'h3_no_such_module')"),
    ("/nowhere/h3_missing.py", "IMPORTS: cannot import '/nowhere/h3_missing.py' (FileNotFoundError"),
])
def test_a_module_that_cannot_be_imported_exits_2_naming_it(entry, expected, capsys):
    status = cli.main(["config", "--cfg", TINY, "--import", entry])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err


def test_a_module_that_raises_on_import_is_a_user_error(tmp_path, capsys):
    bad = tmp_path / "h3_broken.py"
    bad.write_text("raise RuntimeError('no GPU driver here')\n")
    assert cli.main(["config", "--cfg", TINY, "IMPORTS", f"['{bad}']"]) == 2
    assert "(RuntimeError: no GPU driver here)" in capsys.readouterr().err
    assert "h3_broken" not in sys.modules


@pytest.mark.e2e
def test_spawned_workers_import_the_module_too(tmp_path):
    """The installed command, two processes from the spawner, the module found from the cwd."""
    _write_model(tmp_path, "h3_spawn_models", "h3_spawn_tiny")
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    e = env()
    e.pop("PYTHONPATH", None)  # found through the current folder, as a user's project would be
    proc = subprocess.run([command, "train", "--cfg", TINY, "--nproc-per-node", "2", "--import", "h3_spawn_models",
                           "MODEL.ARCH", "h3_spawn_tiny", *_train_opts(tmp_path / "run")],
                          cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "last.pth")
