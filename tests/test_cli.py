"""The command line: bad input ends with exit status 2 and one clear message (no traceback, no
process left behind, nothing written); the options as people type them; --help and its examples.

The mistakes are found before any process group or child process starts, so most tests run the
command in this process (tests.conftest.cli_main, through distribuuuu.cli.main); the e2e ones
prove the same of the installed command and of the spawner.
"""

import argparse
import codecs
import os
import re
import shlex
import subprocess
import sys
import zipfile

import pytest
import timm
import torch

from distribuuuu import cli, cli_help
from distribuuuu.errors import UserError
from tests.conftest import (
    ROOT,
    TINY,
    check,
    check_user_error,
    cli_main,
    distribuuuu,
    env,
    process_state_restored,
    read_metrics,
    run,
    write_image,
)

FAST = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16"]


# ---------------------------------------------------------------------------------------------
# Mistakes in the config, its keys and the data
# ---------------------------------------------------------------------------------------------
def test_unknown_key():
    check_user_error(cli_main("train", "--cfg", TINY, "MODEL.ARHC", "resnet18"),
                     "unknown config key MODEL.ARHC (did you mean MODEL.ARCH?)")


def test_wrong_type():
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.BATCH_SIZE", "big"),
                     "TRAIN.BATCH_SIZE", "expects an int", "'big'")


def test_missing_config_file():
    check_user_error(cli_main("train", "--cfg", "no/such.yaml"), "no/such.yaml", "does not exist")


def test_missing_dataset_folder(tmp_path):
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", str(tmp_path / "imagenet")),
                     "TRAIN.DATASET", str(tmp_path / "imagenet"))


def test_empty_class_folder(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        os.makedirs(tmp_path / "train" / cls)
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "cat" / "a.png")
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", str(tmp_path)), "dog")


def test_unknown_arch():
    check_user_error(cli_main("train", "--cfg", TINY, "MODEL.ARCH", "resnt18"),
                     "MODEL.ARCH", "resnet18")


def test_missing_weights_file(tmp_path):
    check_user_error(cli_main("eval", "--cfg", TINY, "MODEL.WEIGHTS", str(tmp_path / "w.pth")),
                     "MODEL.WEIGHTS", "w.pth")


def test_world_size_larger_than_the_data():
    """Refused by the spawner's parent, before any child starts."""
    check_user_error(cli_main("train", "--nproc-per-node", "3", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "2"),
                     "world size 3")


def test_bad_nproc_and_odd_override_list():
    check_user_error(cli_main("train", "--nproc-per-node", "zero", "--cfg", TINY), "--nproc-per-node")
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.BATCH_SIZE"), "KEY VALUE pairs")


# ---------------------------------------------------------------------------------------------
# --cfg that is not UTF-8 YAML text
# ---------------------------------------------------------------------------------------------
def test_a_binary_cfg_says_it_is_not_utf8_yaml(tmp_path):
    bad = tmp_path / "weights.yaml"
    bad.write_bytes(b"\x00\x01\x02\xff\xfe binary junk")
    msg = check_user_error(cli_main("train", "--cfg", str(bad), "OUT_DIR", str(tmp_path / "run")))
    assert "is not UTF-8 YAML text" in msg and "binary data" in msg and "config/resnet18.yaml" in msg
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_passed_as_cfg_is_named_as_such(tmp_path):
    ckpt = tmp_path / "last.pth"
    torch.save({"model": {"w": torch.arange(300, dtype=torch.float32)}}, ckpt)  # a real zip archive
    assert zipfile.is_zipfile(ckpt)
    msg = check_user_error(cli_main("config", "--cfg", str(ckpt)))
    assert "is not UTF-8 YAML text" in msg and "a zip archive (a PyTorch checkpoint?)" in msg


def test_a_utf16_cfg_with_a_bom_is_read_as_text(tmp_path):
    """What PowerShell's `>` and Windows editors write: decoded, the same config as the UTF-8 file."""
    text = open(TINY, encoding="utf-8").read().replace("BATCH_SIZE: 16           # per process",
                                                       "BATCH_SIZE: 8  # per process, été")
    assert "BATCH_SIZE: 8" in text
    wide = tmp_path / "tiny16.yaml"
    wide.write_bytes(codecs.BOM_UTF16_LE + text.encode("utf-16-le"))
    out = check(cli_main("config", "--cfg", str(wide))).stdout
    assert "  BATCH_SIZE: 8\n" in out and "ARCH: resnet_tiny" in out


def test_a_utf16_cfg_without_bom_is_refused_with_what_it_looks_like(tmp_path):
    wide = tmp_path / "tiny16.yaml"
    wide.write_bytes(open(TINY, encoding="utf-8").read().encode("utf-16-le"))  # valid UTF-8, with NULs
    msg = check_user_error(cli_main("config", "--cfg", str(wide)))
    assert "UTF-16 text without a byte-order mark" in msg and "save it as UTF-8" in msg


def test_a_folder_as_cfg(tmp_path):
    assert "is a folder" in check_user_error(cli_main("config", "--cfg", str(tmp_path)))


# ---------------------------------------------------------------------------------------------
# CFG_DEST, the timm tag, the image size
# ---------------------------------------------------------------------------------------------
def test_cfg_dest_that_is_a_folder_in_out_dir(tmp_path):
    out = tmp_path / "run"
    (out / "configs").mkdir(parents=True)
    msg = check_user_error(cli_main("train", "--cfg", TINY, "OUT_DIR", str(out), "CFG_DEST", "configs", *FAST))
    assert "CFG_DEST 'configs' is an existing folder in OUT_DIR" in msg and "config.yaml" in msg
    assert sorted(os.listdir(out)) == ["configs"]  # nothing written


@pytest.mark.parametrize("dest", ["log.txt", "checkpoints", "sub/config.yaml", ".."])
def test_cfg_dest_that_would_replace_a_run_file_or_leave_out_dir(tmp_path, dest):
    msg = check_user_error(cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), "CFG_DEST", dest))
    assert f"CFG_DEST {dest!r}" in msg


def test_unknown_timm_pretrained_tag_lists_the_known_ones(tmp_path):
    msg = check_user_error(cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"),
                               "MODEL.ARCH", "resnet18.bogus_tag", "MODEL.SMALL_STEM", "False"))
    known = [n.split(".", 1)[1] for n in timm.models.get_arch_pretrained_cfgs("resnet18")]
    assert "no pretrained tag 'bogus_tag' for resnet18" in msg and known
    assert all(tag in msg for tag in known), msg
    # A real tag passes the check (the model is built without downloading anything).
    check(cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "ok"), "MODEL.ARCH", "resnet18.tv_in1k",
                   "OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "16", "TEST.SYNTHETIC_SAMPLES", "16",
                   "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"))


@pytest.mark.parametrize("command,key", [("train", "TRAIN"), ("eval", "TEST")])
def test_an_image_size_that_cannot_fit_in_memory(tmp_path, command, key):
    """TRAIN.IM_SIZE 200000: one batch of 16 is 7 TiB of float32; refused before any allocation
    (it used to end in `DefaultCPUAllocator: can't allocate memory` with a traceback)."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 16 * 3 * 200000 ** 2 * 4 > host  # the premise: no CI host has 7 TiB
    weights = []
    if command == "eval":  # eval first asks for a checkpoint (#27): one that exists, the size is checked before it is read
        torch.save({}, tmp_path / "w.pth")
        weights = ["--checkpoint", str(tmp_path / "w.pth")]
    msg = check_user_error(cli_main(command, "--cfg", TINY, *weights, "OUT_DIR", str(tmp_path / "run"),
                               f"{key}.IM_SIZE", "200000"))
    assert f"{key}.BATCH_SIZE 16 images of 3x200000x200000" in msg and "7.0 TiB" in msg
    assert "this host's" in msg and f"lower {key}.IM_SIZE" in msg


# ---------------------------------------------------------------------------------------------
# Output paths: checked before any work; a folder where a file belongs is named a folder
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "taken.txt"
    path.write_text("not a folder\n")
    return path


def test_export_out_that_is_a_file(a_file):
    check_user_error(cli_main("export", "--out", str(a_file), "--cfg", TINY, "MODEL.WEIGHTS", "none.pth"),
                     "--out", str(a_file), "is a file")


def test_plot_out_that_is_a_file(tmp_path, a_file):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 1, "split": "train", "loss": 1.0, "top1": 50.0}\n')
    check_user_error(cli_main("plot", str(run), "--out", str(a_file)), "--out", str(a_file), "is a file")


def test_predict_output_under_a_file(tmp_path, a_file):
    image = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    target = a_file / "preds.csv"
    refused = cli_main("predict", "--cfg", TINY, "MODEL.WEIGHTS", str(a_file), str(image), "--output", str(target))
    check_user_error(refused, "--output", str(a_file), "is a file")


@pytest.mark.parametrize("command", ["train", "eval", "export"])
def test_a_folder_as_model_weights_is_named_a_folder(tmp_path, command):
    """Before: "MODEL.WEIGHTS ... does not exist" for a folder that does."""
    result = cli_main(command, "--cfg", TINY, "OUT_DIR", str(tmp_path / "out"), "MODEL.WEIGHTS", str(tmp_path))
    check_user_error(result, "MODEL.WEIGHTS", "is a folder", "best.pth")


# ---------------------------------------------------------------------------------------------
# The command line as people type it
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
    assert {"model.pt2", "model.safetensors"} <= set(os.listdir(tmp_path / "ex"))
    check_user_error(cli_main("eval", "--checkpoint", trained, "MODEL.WEIGHTS", str(tmp_path / "other.pth")),
                     "--checkpoint", "MODEL.WEIGHTS", "name two files")
    for command in ("eval", "export"):  # a bare checkpoint word: the option it meant
        check_user_error(cli_main(command, trained), f"distribuuuu {command} --checkpoint {trained}")
    check_user_error(cli_main("predict", trained, str(tmp_path / "x.png")), f"pass it as --checkpoint {trained}")


def test_eval_without_a_checkpoint_says_that_first(tmp_path):
    """Before the data, the model or the sizes: what eval is missing is the checkpoint."""
    check_user_error(cli_main("eval", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), "TEST.DATASET",
                         str(tmp_path / "nowhere"), "MODEL.ARCH", "nosuchnet"),
                     "eval needs a checkpoint: give --checkpoint PATH (or MODEL.WEIGHTS PATH)", "holds no best.pth")
    write_image(str(tmp_path / "x.png"), (16, 16), "RGB", seed=0)
    check_user_error(cli_main("predict", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), str(tmp_path / "x.png")),
                     "predict needs trained weights: give --checkpoint PATH")


def test_options_after_the_key_value_pairs_are_options(tmp_path):
    # --nproc-per-node after the pairs reaches the spawner's parent (which refuses 3 processes for 2 samples).
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "2", "--nproc-per-node", "3"),
                     "world size 3")
    proc = check(cli_main("config", "OPTIM.BASE_LR", "0.3", "--cfg", TINY, "TRAIN.IM_SIZE", "-8"), 2)
    assert "TRAIN.IM_SIZE must be >= 0" in proc.stderr  # "-8" stays a value, not an option
    proc = check(cli_main("config", "OPTIM.BASE_LR", "0.3", "--cfg", TINY))
    assert "ARCH: resnet_tiny" in proc.stdout and "BASE_LR: 0.3" in proc.stdout


def test_every_option_without_a_value_is_known_to_the_reordering():
    """options_first moves an option with the next word as its value unless it is one of FLAGS: an
    option added without a value, and not listed there, would swallow the word after it."""
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
    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    for chosen in ("train", "data"):
        built = {name: len(p._actions) > 1 for name, p in commands(cli.build_parser(chosen)).items()}  # 1: -h
        assert list(built) == list(cli_help.COMMANDS) and {n for n, b in built.items() if b} == {chosen}
    assert set(commands(commands(cli.build_parser("data"))["data"])) == set(cli_help.DATA_COMMANDS)


# ---------------------------------------------------------------------------------------------
# --help
# ---------------------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every command that has its own options, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subparsers(sub, (*path, name))


def test_help_of_every_subcommand_shows_its_options_and_defaults():
    commands = list(_subparsers(cli.build_parser()))
    assert {words for words, _ in commands} >= {("train",), ("eval",), ("config",), ("plot",), ("bench",),
                                                 ("predict",), ("export",), ("data", "export")}
    for words, parser in commands:
        proc = cli_main(*words, "--help")
        assert proc.returncode == 0, (words, proc.stderr)
        text = " ".join(proc.stdout.split())  # argparse wraps lines
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                        argparse._SubParsersAction)):
                continue
            name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
            assert name in text, (words, name)
            if action.option_strings:  # every option says its default, in numbers or in words
                help_text = " ".join(cli._HelpFormatter("x")._get_help_string(action).split())
                assert re.search(r"default", help_text), (words, name, help_text)
                if action.default is not None and "%(default)" in help_text:
                    assert f"(default: {action.default})" in text, (words, name)


@pytest.mark.parametrize("command", ["train", "eval", "config", "predict", "export", "bench", "plot", "data",
                                     "data export", "data shard", "data index"])
def test_each_subcommands_help_ends_with_examples_that_parse(command):
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
    check_user_error(cli_main("config", "--explain", "MODEL.WEIGTHS"), "unknown config key MODEL.WEIGTHS",
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
    def fails():
        raise raised

    fake = _Writes()
    monkeypatch.setattr(sys, "stderr", fake)
    cli._guarded(fails)
    assert fake.writes == [line]


@pytest.mark.e2e
def test_the_installed_command_exits_2_with_one_message():
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
    check_user_error(run([command, "train", "--cfg", TINY, "MODEL.ARHC", "resnet18"], timeout=120),
                     "unknown config key MODEL.ARHC (did you mean MODEL.ARCH?)")


@pytest.mark.e2e
def test_unknown_arch_with_spawned_processes_fails_once_and_cleanly():
    check_user_error(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "MODEL.ARCH", "nosuchnet"),
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


@pytest.mark.e2e
def test_a_mistake_before_the_spawner_starts_is_one_message(tmp_path):
    """The same checks in a real `distribuuuu train --nproc-per-node 2`: refused in the parent,
    once, before any process starts."""
    proc = distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"),
                       "TRAIN.IM_SIZE", "200000", timeout=120)
    check_user_error(proc, "TRAIN.IM_SIZE")
    assert "[spawn]" not in proc.stdout
