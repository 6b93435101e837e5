"""A user's dataset source: a module named by IMPORTS registers it with register_source, and
TRAIN.DATASET / TEST.DATASET find it by name (in process: cli.main, no new interpreter)."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap

import pytest
import torch

from distribuuuu.config import user_modules
from distribuuuu.data import TensorSource, register_source, source_names, unregister_source
from distribuuuu.data.sources import registry
from distribuuuu.errors import UserError
from tests.conftest import TINY, cli_main, read_metrics

# 4 classes of 8x8 RGB images: class c is bright in quadrant c, noise elsewhere (learnable in an epoch).
SOURCE = textwrap.dedent('''
    import functools

    import torch
    from torch.utils.data import Dataset

    from distribuuuu.data import TensorSource, register_source

    SIZES = {"train": 64, "val": 32}


    @functools.lru_cache(maxsize=None)
    def _tensors(split):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = SIZES[split]
        labels = torch.arange(n) % 4
        images = torch.randint(0, 96, (n, 3, 8, 8), generator=g, dtype=torch.uint8)
        for i, c in enumerate(labels.tolist()):
            r, k = divmod(c, 2)
            images[i, :, 4 * r:4 * r + 4, 4 * k:4 * k + 4] += 150
        return images, labels


    @register_source("{name}", splits=("train", "val"))
    def tiny(split, cfg, key):
        images, labels = _tensors(split)
        # No flips: a mirrored quadrant is another class.
        return TensorSource(images, labels, ["a", "b", "c", "d"], stats=((0.35,), (0.3,)), pad=1)


    class Ready(Dataset):
        """Items already normalized floats, as the synthetic source gives them."""

        def __init__(self, split):
            images, self.labels = _tensors(split)
            self.images = images.float() / 255 - 0.35
            self.classes = ["a", "b", "c", "d"]

        @property
        def targets(self):
            return self.labels.tolist()

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return self.images[i], int(self.labels[i])


    register_source("{name}_ready", lambda split, cfg, key: Ready(split))


    class Normalized(Ready):
        """Items normalized with a mean and std of its own, stated when registered (#27)."""

        def __init__(self, split):
            super().__init__(split)
            self.images = (self.images + 0.35 - 0.4) / 0.2


    register_source("{name}_stated", lambda split, cfg, key: Normalized(split), classes=["a", "b", "c", "d"],
                    stats=((0.4, 0.4, 0.4), (0.2, 0.2, 0.2)))
    register_source("{name}_misnamed", lambda split, cfg, key: Ready(split), classes=["w", "x", "y", "z"])
''')

_count = itertools.count()


@pytest.fixture
def user_source(tmp_path, monkeypatch):
    """(module name, source name) of a fresh module in tmp_path; forgotten again afterwards, so that
    every test imports (and registers) its own."""
    n = next(_count)
    module, name = f"h6_user_sources_{n}", f"h6_tiny_{n}"
    (tmp_path / f"{module}.py").write_text(SOURCE.replace("{name}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, name
    for source in (name, f"{name}_ready", f"{name}_stated", f"{name}_misnamed"):
        unregister_source(source)
    user_modules._imported.pop(module, None)
    sys.modules.pop(module, None)


def _train(module: str, train: str, test: str, out, *opts: str):
    return cli_main("train", "--cfg", TINY, "IMPORTS", f"['{module}']", "TRAIN.DATASET", train,
                    "TEST.DATASET", test, "TEST.SPLIT", "val", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
                    "MODEL.NUM_CLASSES", "4", "OPTIM.MAX_EPOCH", "2", "OPTIM.BASE_LR", "0.1",
                    "TRAIN.BATCH_SIZE", "16", "OUT_DIR", str(out), *opts)


def _records(out, split: str) -> list[dict]:
    return [m for m in read_metrics(str(out)) if m["split"] == split]


@pytest.mark.parametrize("pipeline", ["auto", "loader"])  # auto: in memory, as mnist5k
def test_a_registered_tensor_source_trains_evaluates_and_resumes(user_source, tmp_path, pipeline):
    module, name = user_source
    out = tmp_path / "run"
    proc = _train(module, name, name, out, "TRAIN.DATA_PIPELINE", pipeline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, val = _records(out, "train"), _records(out, "val")
    assert [m["n"] for m in train] == [64, 64]  # every image of the source, each epoch
    assert [m["n"] for m in val] == [32, 32]  # exact evaluation: the val split's 32, no more
    assert val[-1]["top1"] > 50, val  # learnable: far above the 25% of chance
    # The same folder, one epoch more: resumed (TRAIN.AUTO_RESUME), the data checked the same.
    proc = _train(module, name, name, out, "TRAIN.DATA_PIPELINE", pipeline, "OPTIM.MAX_EPOCH", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(m["epoch"], m["n"]) for m in _records(out, "train")] == [(1, 64), (2, 64), (3, 64)]


def test_a_registered_dataset_and_val_split(user_source, tmp_path):
    """A Dataset of ready tensors (read as synthetic is), with TRAIN.VAL_SPLIT holding out 16."""
    module, name = user_source
    out = tmp_path / "run"
    proc = _train(module, f"{name}_ready", f"{name}_ready", out, "TRAIN.VAL_SPLIT", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["n"] for m in _records(out, "train")] == [48, 48]
    assert [m["n"] for m in _records(out, "val")] == [16, 16]
    # It states no normalization: the card can only record [0, 1] pixels, and the run says so (#27).
    assert f"TRAIN.DATASET '{name}_ready' states no normalization" in proc.stdout + proc.stderr


def test_a_source_states_classes_and_normalization_that_inference_applies(user_source, tmp_path):
    """#27: the card records the stated classes and (mean, std); load_model's transform and predict
    prepare an image with them (they used to take pixels in [0, 1], silently)."""
    from PIL import Image

    from distribuuuu.api import load_model

    module, name = user_source
    proc = cli_main("config", "--cfg", TINY, "IMPORTS", f"['{module}']", "TRAIN.DATASET", f"{name}_stated",
                    "MODEL.NUM_CLASSES", "0", "TRAIN.TOPK", "1")
    assert proc.returncode == 0 and "NUM_CLASSES: 4" in proc.stdout, proc.stderr  # from the stated names
    out = tmp_path / "run"
    proc = _train(module, f"{name}_stated", f"{name}_stated", out, "TRAIN.VAL_SPLIT", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "states no normalization" not in proc.stdout + proc.stderr
    ckpt = str(out / "checkpoints" / "last.pth")
    loaded = load_model(ckpt)
    assert loaded.classes == ["a", "b", "c", "d"]
    assert (loaded.card.mean, loaded.card.std) == ([0.4] * 3, [0.2] * 3)
    pixels = torch.randint(0, 256, (8, 8, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(tmp_path / "x.png")
    x = loaded.transform(Image.open(tmp_path / "x.png"))
    assert torch.allclose(x, (pixels.permute(2, 0, 1).float() / 255 - 0.4) / 0.2, atol=1e-5)
    proc = cli_main("predict", "--checkpoint", ckpt, str(tmp_path / "x.png"), "--topk", "4",
                    "--output", str(tmp_path / "p.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "p.json").read_text())[0]
    with torch.no_grad():
        probs = (loaded.model(x[None]) / loaded.card.temperature).softmax(1)[0]  # calibrated
    assert row["probs"] == pytest.approx([probs[loaded.classes.index(c)].item() for c in row["classes"]], abs=1e-5)


def test_stated_classes_that_the_data_does_not_have_are_a_user_error(user_source, tmp_path):
    module, name = user_source
    proc = _train(module, f"{name}_misnamed", f"{name}_misnamed", tmp_path / "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "returned the classes ['a', 'b', 'c', 'd']..., but register_source stated ['w', 'x', 'y', 'z']" in proc.stderr


def test_an_unknown_name_exits_2_listing_the_registered_sources(user_source, tmp_path):
    module, name = user_source
    proc = _train(module, "h6_no_such_source", name, tmp_path / "run")
    assert proc.returncode == 2
    assert "or a built-in source: mnist5k, synthetic" in proc.stderr
    assert f"registered sources: {name}, {name}_ready" in proc.stderr


def test_a_split_the_source_lacks_exits_2_naming_its_splits(user_source, tmp_path):
    module, name = user_source
    proc = _train(module, name, name, tmp_path / "run", "TEST.SPLIT", "test")
    assert proc.returncode == 2
    assert f"TEST.SPLIT is 'test', but the {name} source has the splits train, val" in proc.stderr


def test_registering_a_taken_name_is_an_error(tmp_path, monkeypatch):
    def build(split, cfg, key):
        raise AssertionError("never built")

    with pytest.raises(ValueError, match="'mnist5k' is a built-in source"):
        register_source("mnist5k", build)
    register_source("h6_twice", build)
    try:
        with pytest.raises(ValueError, match=r"'h6_twice' is already registered \(by .*build\)"):
            register_source("h6_twice")(build)
        assert source_names()[:2] == ["mnist5k", "synthetic"] and "h6_twice" in source_names()
    finally:
        unregister_source("h6_twice")
    assert "h6_twice" not in source_names()
    # Through IMPORTS: the module's import fails, which is a user error (exit status 2).
    (tmp_path / "h6_taken.py").write_text("from distribuuuu.data import register_source\n"
                                          "register_source('synthetic', lambda split, cfg, key: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    proc = cli_main("config", "--cfg", TINY, "IMPORTS", "['h6_taken']")
    assert proc.returncode == 2
    assert "register_source: the dataset source 'synthetic' is a built-in source" in proc.stderr


def test_a_builder_that_returns_bad_tensors_is_a_user_error(tmp_path):
    from distribuuuu import config

    cfg = config.get_defaults()
    cfg.TRAIN.DATASET = "h6_bad"
    register_source("h6_bad", lambda split, cfg, key: TensorSource(torch.zeros(4, 3, 8, 8), torch.zeros(4),
                                                                   ["a"], ((0.5,), (0.2,))))
    try:
        with pytest.raises(UserError, match="images must be a uint8 tensor"):
            registry.build_source(cfg, "TRAIN")
    finally:
        unregister_source("h6_bad")
