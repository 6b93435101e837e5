"""Bad input: exit status 2, one clear message, no traceback, no process left behind.

The mistakes are found before any process group or child process starts, so most tests run the
command in this process (tests.conftest.cli_main, through distribuuuu.cli.main); the e2e ones
prove the same of the installed command and of the spawner.
"""

import os
import shlex
import subprocess
import sys

import pytest

from distribuuuu.errors import UserError
from tests.conftest import (
    ROOT,
    TINY,
    check,
    cli_main,
    distribuuuu,
    env,
    process_state_restored,
    read_metrics,
    run,
    write_image,
)


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
# The command line as people type it (#27)
# ---------------------------------------------------------------------------------------------
SMALL = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "32", "TEST.SYNTHETIC_SAMPLES", "16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of synthetic_tiny, trained in this process."""
    out = tmp_path_factory.mktemp("cli") / "run"
    with process_state_restored():
        check(cli_main("train", "--cfg", TINY, "OUT_DIR", str(out), *SMALL))
    return str(out / "checkpoints" / "last.pth")


def _eval_line(proc) -> str:
    """The [eval] line's numbers, without its timestamp and its duration (which vary)."""
    line = next(line.split("] ", 1)[-1] for line in proc.stdout.splitlines() if "[eval]" in line)
    return line.rsplit(" | ", 1)[0]


def test_eval_predict_and_export_take_checkpoint_as_model_weights(trained, tmp_path):
    by_option = check(cli_main("eval", "--checkpoint", trained))
    by_key = check(cli_main("eval", "MODEL.WEIGHTS", trained))
    assert "top-1" in _eval_line(by_option) and _eval_line(by_option) == _eval_line(by_key)
    write_image(str(tmp_path / "x.png"), (16, 16), "RGB", seed=0)
    proc = check(cli_main("predict", "--checkpoint", trained, str(tmp_path / "x.png"), "--topk", "2"))
    assert proc.stdout.splitlines()[0] == str(tmp_path / "x.png") and "  2. " in proc.stdout
    check(cli_main("export", "--checkpoint", trained, "--out", str(tmp_path / "ex")))
    assert {"model.torchscript.pt", "model.safetensors"} <= set(os.listdir(tmp_path / "ex"))
    _user_error(cli_main("eval", "--checkpoint", trained, "MODEL.WEIGHTS", str(tmp_path / "other.pth")),
                "--checkpoint", "MODEL.WEIGHTS", "name two files")
    for command in ("eval", "export"):  # a bare checkpoint word: the option it meant
        _user_error(cli_main(command, trained), f"distribuuuu {command} --checkpoint {trained}")
    _user_error(cli_main("predict", trained, str(tmp_path / "x.png")), f"pass it as --checkpoint {trained}")


def test_eval_without_a_checkpoint_says_that_first(tmp_path):
    """Before the data, the model or the sizes: what eval is missing is the checkpoint."""
    _user_error(cli_main("eval", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), "TEST.DATASET",
                         str(tmp_path / "nowhere"), "MODEL.ARCH", "nosuchnet"),
                "eval needs a checkpoint: give --checkpoint PATH (or MODEL.WEIGHTS PATH)", "holds no best.pth")
    write_image(str(tmp_path / "x.png"), (16, 16), "RGB", seed=0)
    _user_error(cli_main("predict", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), str(tmp_path / "x.png")),
                "predict needs trained weights: give --checkpoint PATH")


def test_options_after_the_key_value_pairs_are_options(tmp_path):
    # --nproc-per-node after the pairs reaches the spawner's parent (which refuses 3 processes for 2 samples).
    _user_error(cli_main("train", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "2", "--nproc-per-node", "3"),
                "world size 3")
    proc = check(cli_main("config", "OPTIM.BASE_LR", "0.3", "--cfg", TINY, "TRAIN.IM_SIZE", "-8"), 2)
    assert "TRAIN.IM_SIZE must be positive" in proc.stderr  # "-8" stays a value, not an option
    proc = check(cli_main("config", "OPTIM.BASE_LR", "0.3", "--cfg", TINY))
    assert "ARCH: resnet_tiny" in proc.stdout and "BASE_LR: 0.3" in proc.stdout


def test_every_option_without_a_value_is_known_to_the_reordering():
    """options_first moves an option with the next word as its value unless it is one of FLAGS: an
    option added without a value, and not listed there, would swallow the word after it."""
    import argparse

    from distribuuuu import cli, cli_help

    def flags(parser: argparse.ArgumentParser) -> set[str]:
        found = set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found |= {f for sub in action.choices.values() for f in flags(sub)}
            elif action.option_strings and action.nargs == 0:
                found |= set(action.option_strings)
        return found

    assert flags(cli.build_parser()) - {"--version"} <= cli_help.FLAGS


def test_the_parser_of_a_command_holds_its_own_options_only():
    """`distribuuuu train ...` builds train's options alone; every command is still listed (`--help`)."""
    import argparse

    from distribuuuu import cli, cli_help

    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    for chosen in ("train", "data"):
        built = {name: len(p._actions) > 1 for name, p in commands(cli.build_parser(chosen)).items()}  # 1: -h
        assert list(built) == list(cli_help.COMMANDS) and {n for n, b in built.items() if b} == {chosen}
    assert set(commands(commands(cli.build_parser("data"))["data"])) == set(cli_help.DATA_COMMANDS)


@pytest.mark.parametrize("command", ["train", "eval", "config", "predict", "export", "bench", "plot", "data",
                                     "data export", "data shard"])
def test_each_subcommands_help_ends_with_examples_that_parse(command):
    from distribuuuu import cli

    proc = check(cli_main(*command.split(), "--help"))
    head, _, examples = proc.stdout.rpartition("\nexamples:\n")
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("distribuuuu ")]
    assert head and any(line.startswith(f"distribuuuu {command} ") for line in lines), proc.stdout
    for line in lines:
        try:
            cli.build_parser().parse_args(cli.arrange(shlex.split(line, comments=True)[1:]))
        except SystemExit:
            pytest.fail(f"the example `{line}` does not parse")


def test_config_explain_prints_a_keys_comment_type_and_default():
    from distribuuuu.config import get_defaults

    defaults = get_defaults()
    with open(os.path.join(ROOT, "distribuuuu", "config", "defaults.py"), encoding="utf-8") as f:
        source = f.read()
    for key, kind, value in (("OPTIM.BASE_LR", "float", defaults.OPTIM.BASE_LR),
                             ("MODEL.WEIGHTS", "str or None", None), ("MODEL.PRETRAINED", "bool or str", False)):
        proc = check(cli_main("config", "--explain", key))
        first, comment = proc.stdout.splitlines()
        assert first == f"{key}  ({kind}, default {value!r})"
        assert comment.strip() and comment.strip()[:40] in source  # the comment above the key in defaults.py
    _user_error(cli_main("config", "--explain", "MODEL.WEIGTHS"), "unknown config key MODEL.WEIGTHS",
                "did you mean MODEL.WEIGHTS?")


# ---------------------------------------------------------------------------------------------
# End to end: the installed command and the spawner
# ---------------------------------------------------------------------------------------------


class _Writes:
    """A stderr that keeps each write() apart, as two processes sharing one stderr see them."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("raised, line", [
    (KeyboardInterrupt(), "stopped by SIGINT\n"),
    (UserError("no such folder"), "error: no such folder\n"),
], ids=["stop", "error"])
def test_each_ranks_last_line_is_one_write(monkeypatch, raised, line):
    """The ranks of a spawned job share stderr: a line written as text and then newline came out as
    `stopped by SIGTERM (rank 1)stopped by SIGTERM` in CI."""
    from distribuuuu import cli

    def fails():
        raise raised

    fake = _Writes()
    monkeypatch.setattr(sys, "stderr", fake)
    cli._guarded(fails)
    assert fake.writes == [line]


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
def test_nproc_per_node_after_the_pairs_starts_the_processes(tmp_path):
    """The installed command with `--nproc-per-node 2` typed last: two ranks train (#27)."""
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    proc = check(run([command, "train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), *SMALL,
                      "--nproc-per-node", "2"], timeout=240))
    assert "world size 2" in proc.stdout and read_metrics(str(tmp_path / "run"))


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
