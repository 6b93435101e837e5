"""Under torchrun: one epoch of the real train loader and the real val loader of a shard set, as
`distribuuuu train` builds them (data.build_train_loader / build_val_loader, TRAIN.WORKERS workers),
and every sample's id written to OUT/ids.rank<R>.json. The images carry their id in two pixels
(tests/test_shard_reader.py writes them), read back exactly through a crop of the whole image.

    torchrun --nproc-per-node 2 tests/scripts/shard_keys.py OUT KEY VALUE ...
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from distribuuuu import data
from distribuuuu.config import load_config


def ids(images: torch.Tensor) -> list[int]:
    pixels = (images[:, 0, 0, :2] * 255).round().long()  # MEAN 0, STD 1: the uint8 values / 255
    return (pixels[:, 0] * 256 + pixels[:, 1]).tolist()


def main(out: str, opts: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(None, opts)
    device = torch.device("cpu")
    train = data.build_train_loader(cfg, rank, world, device)
    record = {"steps": len(train), "train": [], "val": []}
    for epoch in (0, 1):
        train.sampler.set_epoch(epoch)
        record["train"].append([ids(images) for images, _ in train])
    record["val"] = [i for images, _ in data.build_val_loader(cfg, rank, world, device) for i in ids(images)]
    with open(os.path.join(out, f"ids.rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
