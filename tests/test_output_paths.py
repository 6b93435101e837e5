"""Issue 25 items 6 and 8: output paths are checked before any work, and a folder given where a
file belongs is named as a folder: exit 2, one line, no traceback (in this process: no run starts)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, cli_main


def _one_line_refusal(result, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "taken.txt"
    path.write_text("not a folder\n")
    return path


def test_export_out_that_is_a_file(a_file):
    _one_line_refusal(cli_main("export", "--out", str(a_file), "--cfg", TINY, "MODEL.WEIGHTS", "none.pth"),
                      "--out", str(a_file), "is a file")


def test_plot_out_that_is_a_file(tmp_path, a_file):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 1, "split": "train", "loss": 1.0, "top1": 50.0}\n')
    _one_line_refusal(cli_main("plot", str(run), "--out", str(a_file)), "--out", str(a_file), "is a file")


def test_predict_output_under_a_file(tmp_path, a_file):
    image = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    target = a_file / "preds.csv"
    _one_line_refusal(cli_main("predict", "--cfg", TINY, "MODEL.WEIGHTS", str(a_file), str(image),
                               "--output", str(target)), "--output", str(a_file), "is a file")


@pytest.mark.parametrize("command", ["train", "eval", "export"])
def test_a_folder_as_model_weights_is_named_a_folder(tmp_path, command):
    """Before: "MODEL.WEIGHTS ... does not exist" for a folder that does."""
    result = cli_main(command, "--cfg", TINY, "OUT_DIR", str(tmp_path / "out"), "MODEL.WEIGHTS", str(tmp_path))
    _one_line_refusal(result, "MODEL.WEIGHTS", "is a folder", "best.pth")
