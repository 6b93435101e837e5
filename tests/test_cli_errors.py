"""Bad input: exit status 2, one clear message, no traceback, no process left behind.

The mistakes are found before any process group or child process starts, so most tests run the
command in this process (tests.conftest.cli_main, through distribuuuu.cli.main); the e2e ones
prove the same of the installed command and of the spawner.
"""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, check, cli_main, distribuuuu, env, run


def _user_error(proc, *fragments):
    check(proc, 2)
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr  # one message, however many processes were asked for
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_unknown_key():
    _user_error(cli_main("train", "--cfg", TINY, "MODEL.ARHC", "resnet18"),
                "unknown config key MODEL.ARHC (did you mean MODEL.ARCH?)")


def test_wrong_type():
    _user_error(cli_main("train", "--cfg", TINY, "TRAIN.BATCH_SIZE", "big"),
                "TRAIN.BATCH_SIZE", "expects an int", "'big'")


def test_missing_config_file():
    _user_error(cli_main("train", "--cfg", "no/such.yaml"), "no/such.yaml", "does not exist")


def test_missing_dataset_folder(tmp_path):
    _user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", str(tmp_path / "imagenet")),
                "TRAIN.DATASET", str(tmp_path / "imagenet"))


def test_empty_class_folder(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        os.makedirs(tmp_path / "train" / cls)
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "cat" / "a.png")
    _user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", str(tmp_path)), "dog")


def test_unknown_arch():
    _user_error(cli_main("train", "--cfg", TINY, "MODEL.ARCH", "resnt18"),
                "MODEL.ARCH", "resnet18")


def test_missing_weights_file(tmp_path):
    _user_error(cli_main("eval", "--cfg", TINY, "MODEL.WEIGHTS", str(tmp_path / "w.pth")),
                "MODEL.WEIGHTS", "w.pth")


def test_world_size_larger_than_the_data():
    """Refused by the spawner's parent, before any child starts."""
    _user_error(cli_main("train", "--nproc-per-node", "3", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "2"),
                "world size 3")


def test_bad_nproc_and_odd_override_list():
    _user_error(cli_main("train", "--nproc-per-node", "zero", "--cfg", TINY), "--nproc-per-node")
    _user_error(cli_main("train", "--cfg", TINY, "TRAIN.BATCH_SIZE"), "KEY VALUE pairs")


# ---------------------------------------------------------------------------------------------
# End to end: the installed command and the spawner
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_installed_command_exits_2_with_one_message():
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
    _user_error(run([command, "train", "--cfg", TINY, "MODEL.ARHC", "resnet18"], timeout=120),
                "unknown config key MODEL.ARHC (did you mean MODEL.ARCH?)")


@pytest.mark.e2e
def test_unknown_arch_with_spawned_processes_fails_once_and_cleanly():
    _user_error(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "MODEL.ARCH", "nosuchnet"),
                "MODEL.ARCH")


@pytest.mark.e2e
def test_a_bad_key_is_refused_before_torch_is_imported():
    """`train MODEL.ARHC x` answers in a fraction of a second: the config is read before the engine
    (and torch, ~5 s of imports on a small machine) is imported."""
    code = ("import sys\nfrom distribuuuu import cli\nstatus = cli.main(['train', 'MODEL.ARHC', 'x'])\n"
            "print(status, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert "did you mean MODEL.ARCH?" in proc.stderr
