"""Issue 25 item 5: a shard that holds more or fewer samples than its index.json records is an
error naming the shard, read by the main process or by loader workers; never a hang, never a
quietly shorter epoch (before: an index that under-counts the last shard trained on fewer samples, exit 0)."""

from __future__ import annotations

import json
import os

import pytest

from distribuuuu.data import shards
from distribuuuu.data.shards import tar
from tests.conftest import make_cfg
from tests.test_shard_reader import epoch_ids, id_opts, write_id_images


def _shards_with_count(tmp_path, delta: int) -> tuple[str, str]:
    """24 train samples in shards of 5; the index of the shard read last in epoch 0 is off by delta."""
    write_id_images(tmp_path / "src", "train", 24)
    write_id_images(tmp_path / "src", "val", 6)
    root = str(tmp_path / "sh")
    shards.write_shards(str(tmp_path / "src"), root, shard_samples=5, progress=False)
    folder = os.path.join(root, "train")
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    order = shards.plan.shard_order(len(index["shards"]), 3, 0)  # the seed the loader is given (epoch_ids)
    victim = index["shards"][int(order[-1])]
    victim["num_samples"] += delta
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(index, f)
    return root, os.path.join(folder, victim["name"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("delta", [-1, 1], ids=["index-under-counts", "index-over-counts"])
def test_a_shard_off_its_index_count_is_an_error_naming_it(tmp_path, workers, delta):
    root, victim = _shards_with_count(tmp_path, delta)
    cfg = make_cfg(id_opts(root, workers=workers, batch=4))
    with pytest.raises(tar.ShardError, match=rf"shard {victim} holds \d+ samples, but its index .* records"):
        epoch_ids(cfg, 0, 1, 0)
