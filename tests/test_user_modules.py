"""User code without forking: IMPORTS / --import bring the user's modules into every process before
the model is built, so that a timm model registered there is found by MODEL.ARCH, and so is a plain
function registered with distribuuuu.models.register_model (#27): its checkpoint records the file,
so that predict and load_model work from another folder, and say so clearly when the file is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch.nn as nn

from distribuuuu import cli, config, models
from distribuuuu.errors import UserError
from tests.conftest import TINY, check, env, make_cfg, read_metrics, write_image_tree

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


# ---------------------------------------------------------------------------------------------
# register_model: a plain def my_net(num_classes, in_chans) -> nn.Module (#27)
# ---------------------------------------------------------------------------------------------
PLAIN_SOURCE = textwrap.dedent('''
    import torch.nn as nn

    from distribuuuu.models import register_model


    @register_model
    def {name}(num_classes, in_chans):
        return nn.Sequential(nn.Conv2d(in_chans, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(8, num_classes))
''')


def test_register_model_takes_a_plain_function_by_its_name_or_another():
    def h2_sized(num_classes, in_chans, img_size):  # img_size: given when the function takes it
        return nn.Sequential(nn.Flatten(), nn.Linear(in_chans * img_size * img_size, num_classes))

    assert models.register_model(h2_sized) is h2_sized
    models.register_model("h2_other_name")(h2_sized)
    assert models.resolve_arch("h2_sized") == ("user", "h2_sized")
    for arch in ("h2_sized", "h2_other_name"):
        cfg = make_cfg("MODEL.ARCH", arch, "MODEL.NUM_CLASSES", "5", "MODEL.IN_CHANS", "1", "TRAIN.IM_SIZE", "6",
                       "TRAIN.TOPK", "1")
        model = models.build_model(cfg)
        assert model[1].in_features == 36 and model[1].out_features == 5
    assert models.user_model_file("h2_sized") == os.path.abspath(__file__)


def test_register_model_refuses_a_taken_name_and_a_result_that_is_no_module():
    with pytest.raises(ValueError, match="'resnet_tiny' is an alias of distribuuuu"):
        models.register_model("resnet_tiny")(lambda num_classes, in_chans: nn.Identity())

    def h2_taken(num_classes, in_chans):
        return nn.Identity()

    def other(num_classes, in_chans):
        return "not a module"

    models.register_model(h2_taken)
    with pytest.raises(ValueError, match="'h2_taken' is already registered by"):
        models.register_model("h2_taken")(other)
    models.register_model("h2_no_module")(other)
    cfg = make_cfg("MODEL.ARCH", "h2_no_module", "MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "1")
    with pytest.raises(UserError, match="returned str, not a torch.nn.Module"):
        models.build_model(cfg)


def _user_command(args: list[str], cwd) -> subprocess.CompletedProcess:
    """The installed `distribuuuu` command, run from cwd, with nothing of the checkout on PYTHONPATH."""
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    return subprocess.run([command, *args], cwd=cwd, env=_plain_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
def test_a_plain_function_in_the_users_file_trains_and_predicts_from_another_folder(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_image_tree(str(project / "pets"), "train", {"cat": 4, "dog": 4, "owl": 4}, size=(8, 8))
    write_image_tree(str(project / "pets"), "val", {"cat": 2, "dog": 2, "owl": 2}, size=(8, 8))
    (project / "my_models.py").write_text(PLAIN_SOURCE.replace("{name}", "h2_plain_net"))
    check(_user_command(["train", "--import", "my_models.py", "MODEL.ARCH", "h2_plain_net", "TRAIN.DATASET", "pets",
                         "TRAIN.IM_SIZE", "8", "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0",
                         "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "TRAIN.WORKERS", "0", "NUM_THREADS", "1",
                         "DEVICE", "cpu", "OUT_DIR", "run"], project))
    stored = config.load_config(str(project / "run" / "config.yaml"))
    assert stored.IMPORTS == [str(project / "my_models.py")]  # an absolute path: found from any folder
    ckpt, image = str(project / "run" / "checkpoints" / "last.pth"), str(project / "pets" / "val" / "dog" / "0.png")
    proc = check(_user_command(["predict", "--checkpoint", ckpt, image, "--topk", "3"], elsewhere))
    assert image in proc.stdout and all(f". {c} " in proc.stdout for c in ("cat", "dog", "owl")), proc.stdout
    code = f"from distribuuuu.api import load_model\nm = load_model({ckpt!r})\nprint(type(m.model).__name__, m.classes)"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=_plain_env(), capture_output=True,
                            text=True, timeout=120)
    assert loaded.stdout.strip() == "Sequential ['cat', 'dog', 'owl']", loaded.stderr[-2000:]
    # The file gone: one clear line naming it, exit 2, no traceback.
    os.rename(project / "my_models.py", project / "my_models.py.bak")
    proc = _user_command(["predict", "--checkpoint", ckpt, image], elsewhere)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"the run imported {project / 'my_models.py'}" in errors[0] and "that file is gone" in errors[0]
    assert "MODEL.ARCH 'h2_plain_net'" in errors[0] and "--import FILE" in errors[0]


def _plain_env() -> dict[str, str]:
    e = env()
    e.pop("PYTHONPATH", None)
    return e


@pytest.mark.e2e
def test_a_function_registered_in_the_running_script_trains_through_the_api(tmp_path):
    """The script itself registers the model and calls train: its file is not added to IMPORTS (that
    imported the script again, which registered the name twice and stopped the run)."""
    script = tmp_path / "my_train.py"
    script.write_text(PLAIN_SOURCE.replace("{name}", "h2_script_net") + textwrap.dedent(f'''
        from distribuuuu import config, train

        cfg = config.load_config({TINY!r}, ["OUT_DIR", "run", "MODEL.ARCH", "h2_script_net", "MODEL.SMALL_STEM",
                                            "False", "OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "32"])
        print("IMPORTS", cfg.IMPORTS)
        train(cfg)
    '''))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_plain_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTS []" in proc.stdout and os.path.isfile(tmp_path / "run" / "checkpoints" / "last.pth")
