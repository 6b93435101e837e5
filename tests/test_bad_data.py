"""Bad image files in an ImageFolder tree: converted when possible, else skipped, named and counted."""

import io
import os

import pytest
from PIL import Image

from tests.conftest import TINY, check, distribuuuu, read_metrics

pytestmark = pytest.mark.e2e  # every test here starts processes


def _jpeg_bytes(mode="RGB", size=(12, 12)):
    buf = io.BytesIO()
    Image.new(mode, size, color=(90, 20, 200) if mode == "RGB" else (10, 80, 30, 0)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def messy_tree(tmp_path):
    """2 classes x 8 files; 3 files can't be decoded, 4 need converting. Sorted names keep the
    bad files apart, so that each is met exactly once per epoch."""
    root = tmp_path / "messy"
    for split in ("train", "val"):
        for cls, color in (("ants", (200, 30, 30)), ("bees", (30, 30, 200))):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (12, 12), color).save(d / f"{i}0_good.png")
    ants, bees = root / "train" / "ants", root / "train" / "bees"
    os.remove(ants / "10_good.png")
    (ants / "11_truncated.jpg").write_bytes(_jpeg_bytes()[:60])
    os.remove(ants / "30_good.png")
    (ants / "31_empty.jpg").write_bytes(b"")
    os.remove(bees / "10_good.png")
    (bees / "11_text.jpg").write_text("this is not an image\n")
    # Convertible: CMYK JPEG, PNG named .JPEG, grayscale, RGBA.
    os.remove(ants / "50_good.png")
    (ants / "51_cmyk.jpg").write_bytes(_jpeg_bytes("CMYK"))
    os.remove(bees / "30_good.png")
    Image.new("RGB", (12, 12), (30, 30, 200)).save(bees / "31_png_named.JPEG", "PNG")
    os.remove(bees / "50_good.png")
    Image.new("L", (12, 12), 40).save(bees / "51_gray.png")
    os.remove(bees / "70_good.png")
    Image.new("RGBA", (12, 12), (30, 30, 200, 128)).save(bees / "71_rgba.png")
    (bees / "README.txt").write_text("not an image extension: ignored by ImageFolder\n")
    return str(root)


def _args(tree, out, *extra):
    return ["train", "--cfg", TINY, "TRAIN.DATASET", tree, "TEST.DATASET", tree, "MODEL.NUM_CLASSES", "2",
            "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "12", "TEST.IM_SIZE", "12", "TRAIN.BATCH_SIZE", "4",
            "OPTIM.MAX_EPOCH", "2", "OUT_DIR", out, *extra]


def test_unreadable_images_are_skipped_named_and_counted(messy_tree, tmp_path):
    out = str(tmp_path / "run")
    proc = check(distribuuuu(*_args(messy_tree, out)))
    log = open(os.path.join(out, "log.txt")).read() + proc.stderr
    for name in ("11_truncated.jpg", "31_empty.jpg", "11_text.jpg"):
        assert name in log, name
    for name in ("51_cmyk.jpg", "31_png_named.JPEG", "51_gray.png", "71_rgba.png"):
        assert name not in log, name  # converted, not skipped
    train = [m for m in read_metrics(out) if m["split"] == "train"]
    assert [m["bad_images"] for m in train] == [3, 3]  # every epoch meets each bad file once
    assert all(m["n"] == 16 for m in train)  # batch sizes kept: a good sample stood in
    assert "3 unreadable training images skipped" in log


def test_fail_mode_stops_at_the_first_bad_file(messy_tree, tmp_path):
    out = str(tmp_path / "run")
    proc = distribuuuu(*_args(messy_tree, out, "TRAIN.BAD_IMAGES", "fail"))
    assert proc.returncode == 1
    assert "cannot decode image" in proc.stderr and "TRAIN.BAD_IMAGES skip" in proc.stderr
