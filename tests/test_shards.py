"""`distribuuuu data shard`: WebDataset-layout tar shards + index.json, deterministic,
the original encoded bytes, read back by the webdataset package; finding a shard set from TRAIN.DATASET."""

from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import webdataset
from PIL import Image

from distribuuuu.data import shards
from distribuuuu.data.shards import index
from distribuuuu.errors import UserError
from tests.conftest import check, cli_main, env


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    """A dataset root with train/ (3 classes x 7 JPEGs of different sizes) and val/ (3 x 2)."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for split, n in (("train", 7), ("val", 2)):
        for c in ("ant", "bee", "cat"):
            os.makedirs(root / split / c)
            for i in range(n):
                size = (16 + 3 * i, 12 + 2 * i)
                Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(
                    root / split / c / f"{i}.jpg", quality=80)
    return root


def _members(tar_path):
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read(), m.mtime, m.uid, m.uname) for m in tar.getmembers()]


def test_layout_counts_and_the_original_bytes(jpeg_root, tmp_path):
    written = shards.write_shards(str(jpeg_root), str(tmp_path / "out"), shard_samples=4, progress=False)
    assert [p.parent.name for p in written] == ["train", "val"]
    index = json.loads(written[0].read_text())
    assert index["format"] == shards.FORMAT and index["classes"] == ["ant", "bee", "cat"]
    assert index["num_samples"] == 21 and [s["num_samples"] for s in index["shards"]] == [4, 4, 4, 4, 4, 1]
    originals = {p.read_bytes(): c for c in ("ant", "bee", "cat") for p in (jpeg_root / "train" / c).iterdir()}
    seen, per_shard_labels = [], []
    for s in index["shards"]:
        path = written[0].parent / s["name"]
        assert os.path.getsize(path) == s["bytes"]
        members = _members(path)
        assert len(members) == 2 * s["num_samples"]
        assert all(mtime == 0 and uid == 0 and uname == "" for _, _, mtime, uid, uname in members)
        for (img_name, blob, *_), (cls_name, label, *_) in zip(members[::2], members[1::2]):
            key = img_name.split(".")[0]
            assert img_name == f"{key}.jpg" and cls_name == f"{key}.cls"
            assert originals[blob] == index["classes"][int(label)]  # the file's own bytes, not re-encoded
            seen.append(blob)
        per_shard_labels.append({int(m[1]) for m in members[1::2]})
    assert sorted(seen) == sorted(originals)  # every image once
    # Shuffled once before writing: the first shard is not one class (folders list class by class).
    assert len(per_shard_labels[0]) > 1


def test_same_input_and_seed_give_the_same_bytes_another_seed_another_order(jpeg_root, tmp_path):
    a, b, c = (shards.write_shards(str(jpeg_root / "train"), str(tmp_path / d), shard_samples=5, seed=s,
                                   progress=False)[0].parent for d, s in (("a", 0), ("b", 0), ("c", 1)))
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and len(names) == 1 + 5  # index + ceil(21 / 5) shards
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert (a / "train-000000.tar").read_bytes() != (c / "train-000000.tar").read_bytes()


def test_shard_size_in_bytes_is_respected(jpeg_root, tmp_path):
    limit = 30000
    split = shards.write_shards(str(jpeg_root / "train"), str(tmp_path / "o"), shard_bytes=limit,
                                progress=False)[0]
    index = json.loads(split.read_text())
    assert len(index["shards"]) >= 2 and sum(s["num_samples"] for s in index["shards"]) == 21
    # Members fill at most `limit` bytes; tar adds its end-of-archive blocks and pads the file to whole
    # 10,240-byte records.
    padded = -(-(limit + 1024) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE
    assert all(s["bytes"] <= padded for s in index["shards"])


def test_webdataset_reads_the_shards_with_the_same_keys_and_labels(jpeg_root, tmp_path):
    split = shards.write_shards(str(jpeg_root), str(tmp_path / "o"), shard_samples=4, progress=False)[0].parent
    names = [s["name"] for s in json.loads((split / "index.json").read_text())["shards"]]
    urls = [str(split / n) for n in names]
    ours = [(m[0].split(".")[0], int(m[1])) for u in urls for m in _members(u)[1::2]]
    theirs = [(s["__key__"], int(s["cls"])) for s in webdataset.WebDataset(urls, shardshuffle=False)]
    assert theirs == ours and len(theirs) == 21
    decoded = next(iter(webdataset.WebDataset(urls[:1], shardshuffle=False).decode("pil")))
    assert decoded["jpg"].size[0] >= 16


def test_mnist5k_becomes_png_shards(tmp_path):
    written = shards.write_shards("mnist5k", str(tmp_path / "m"), shard_samples=1500, progress=False)
    counts = {p.parent.name: json.loads(p.read_text())["num_samples"] for p in written}
    assert counts == {"train": 4000, "val": 1000}
    first = _members(written[1].parent / "val-000000.tar")
    image = Image.open(io.BytesIO(first[0][1]))
    assert first[0][0].endswith(".png") and image.size == (28, 28) and image.mode == "L"
    labels = collections.Counter(int(m[1]) for m in first[1::2])
    assert set(labels) == set(range(10))


def test_every_form_of_dataset_names_the_set_and_a_bad_one_is_a_user_error(jpeg_root, tmp_path):
    out = tmp_path / "o"
    shards.write_shards(str(jpeg_root), str(out), shard_samples=4, progress=False)
    train = out / "train"
    forms = [str(out), str(train), str(train / "index.json"), str(train / "train-{000000..000005}.tar")]
    for form in forms:
        assert index.is_shard_set(form)
        s = shards.load_shard_set(form, "train", "TRAIN")
        assert s.num_samples == 21 and len(s.shards) == 6 and s.classes == ["ant", "bee", "cat"]
    assert shards.load_shard_set(str(out), "val", "TEST").num_samples == 6
    assert len(shards.load_shard_set(str(train / "train-{000001..000002}.tar"), "train", "TRAIN").shards) == 2
    assert not index.is_shard_set(str(jpeg_root))
    with pytest.raises(UserError, match="without split 'test'.*its splits: train, val"):
        shards.load_shard_set(str(out), "test", "TEST")
    with pytest.raises(UserError, match=r"shard train-000006.tar is not in .*\(4 of 6 unknown\)"):
        shards.load_shard_set(str(train / "train-{000004..000009}.tar"), "train", "TRAIN")
    with open(train / "train-000002.tar", "r+b") as f:  # a truncated shard is found before any read
        f.truncate(1000)
    with pytest.raises(UserError, match="train-000002.tar is 1000 bytes but its index records"):
        shards.load_shard_set(str(out), "train", "TRAIN")
    os.remove(train / "index.json")
    with pytest.raises(UserError, match="no index.json beside the tars"):
        shards.load_shard_set(str(train / "train-{000000..000001}.tar"), "train", "TRAIN")


@pytest.mark.parametrize("args, message", [
    (["nope", "DEST"], "SRC 'nope' is neither a folder nor a built-in source"),
    (["mnist5k", "DEST", "--shard-size", "lots"], "--shard-size 'lots' is not a size"),
    (["mnist5k", "DEST", "--shard-size", "0"], "--shard-size must be positive"),
])
def test_bad_input_exits_2_with_one_message(tmp_path, args, message):
    res = check(cli_main("data", "shard", *args, cwd=str(tmp_path)), 2)
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize("text, size", [("256MB", 256 * 2**20), ("64M", 64 * 2**20), ("1G", 2**30),
                                        ("500K", 500 * 2**10), ("1000", 1000), ("1.5KiB", 1536)])
def test_sizes(text, size):
    assert shards.parse_size(text) == size


@pytest.mark.e2e
def test_installed_command_shards_a_folder_from_outside_the_repo(jpeg_root, tmp_path):
    cmd = [sys.executable, "-m", "distribuuuu", "data", "shard", str(jpeg_root), "shards", "--shard-size", "8K"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("wrote 21 images of 3 classes to ") and "shards/train" in lines[0]
    assert lines[1].startswith("wrote 6 images of 3 classes to ") and "shards/val" in lines[1]
    again = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr  # nothing overwritten
