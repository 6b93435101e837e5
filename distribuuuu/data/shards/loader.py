"""The train / val / test loaders of a shard set (TRAIN.DATASET or
TEST.DATASET naming one).

The images go through the folder pipeline's recipe (transforms.py): with
TRAIN.IMAGE_DECODE fast the records are decoded and cropped to uint8 in
the workers (images.FastTrainDecode / FastEvalDecode) and normalized per
batch on the device (batches.NormalizedBatches); with 'gpu' (or auto's
choice on CUDA) the workers crop the encoded JPEGs, which the main
process decodes on the device (data/decoding/device.py); with 'pil',
torchvision's per-sample PIL recipe. The loader has what the engine uses
of every train loader: len() (batches left this epoch), .dataset,
.sampler.set_epoch(epoch, start), and `epoch_steps`, the steps of a
whole epoch, which the trainer takes instead of len(dataset) // global
batch: the shard plan runs every sample once, in equal step counts on
every rank (plan.py), dropping none. ShardPipeline is this pipeline's
face on the seam (data/loading/pipeline.py): a shard set is read this way
whatever TRAIN.DATA_PIPELINE says (memory refuses it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.data import sources
from distribuuuu.data.decoding.cpu import FastEvalDecode, FastTrainDecode, open_image
from distribuuuu.data.decoding.device import (
    AUTO_SAMPLES,
    DecodedBatches,
    DeviceDecode,
    decodes_on_device,
    encoded_images,
)
from distribuuuu.data.loading.batches import (
    NormalizedBatches,
    quiet_worker,
    stop_loader_workers,
    track_workers,
)
from distribuuuu.data.loading.items import UnreadableImage
from distribuuuu.data.loading.pipeline import Pipeline, Place
from distribuuuu.data.shards import tar
from distribuuuu.data.shards.fields import MissingField
from distribuuuu.data.shards.index import ShardSet, load_shard_set
from distribuuuu.data.shards.reader import ShardDataset, describe_plan
from distribuuuu.data.transforms import augment_policy, folder_transform, image_stats, recipe_of
from distribuuuu.errors import UserError


class ShardLoader:
    """A DataLoader over a ShardDataset, with the engine's loader
    interface (module docstring)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.dataset = loader, loader.dataset

    @property
    def sampler(self) -> ShardDataset:
        return self.dataset  # set_epoch and seed live on the dataset (in memory its workers share)

    @property
    def epoch_steps(self) -> int:
        return self.dataset.steps()

    def shard_plan(self) -> dict[str, Any]:
        return describe_plan(self.dataset)

    def __len__(self) -> int:
        return self.dataset.steps() - self.dataset.start_step

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.loader
        except (tar.ShardError, UnreadableImage) as e:  # from a worker: its message only
            stop_loader_workers(self.loader)  # now, not when the garbage collector frees it
            raise type(e)(_original_message(str(e))) from None


def _original_message(text: str) -> str:
    """A worker's exception as the DataLoader re-raises it ('Caught X in
    DataLoader worker process 0. Original Traceback ... X: message') ->
    message."""
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _decoder(cfg: CfgNode, train: bool) -> tuple[Callable[[bytes], torch.Tensor], bool]:
    """(bytes -> image tensor, whether the images are uint8 to be
    normalized per batch)."""
    size, recipe = cfg.TRAIN.IM_SIZE, recipe_of(cfg)
    mode = "L" if cfg.MODEL.IN_CHANS == 1 else "RGB"
    policy = augment_policy(cfg) if train else None
    if cfg.TRAIN.IMAGE_DECODE != "pil":
        crop = (
            FastTrainDecode(size, mode, recipe)
            if train
            else FastEvalDecode(recipe.eval_resize(size, cfg.TEST.IM_SIZE), size, mode, recipe)
        )
        return (v2.Compose([crop, policy]) if policy is not None else crop), True
    tf = folder_transform(
        train,
        size,
        cfg.TEST.IM_SIZE,
        cfg.MODEL.IN_CHANS,
        policy=policy,
        erase=cfg.TRAIN.RANDOM_ERASE if train else 0.0,
        recipe=recipe,
    )
    return v2.Compose([functools.partial(open_image, mode=mode), *tf.transforms]), False


def _label_map(cfg: CfgNode, key: str, shard_set: ShardSet) -> list[int] | None:
    """TEST shards' labels in the TRAIN shards' numbering (a val split
    may lack classes), by class name."""
    if key == "TRAIN" or sources.kind_of(cfg, "TRAIN") != "shards":
        return None
    train = load_shard_set(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, "TRAIN").classes
    if train == shard_set.classes:
        return None
    position = {name: i for i, name in enumerate(train)}
    extra = [c for c in shard_set.classes if c not in position]
    if extra:
        raise UserError(
            f"TEST.DATASET has classes that the training shards lack: {', '.join(extra[:5])}; val "
            "classes must be a subset of the train classes"
        )
    return [position[c] for c in shard_set.classes]


def build_shard_loader(cfg: CfgNode, key: str, train: bool, place: Place, seed: int) -> Any:
    """The loader of the shard set cfg[key].DATASET names: training
    batches (train) or exact evaluation."""
    group, device = cfg[key], place.device
    shard_set = load_shard_set(
        group.DATASET, group.SPLIT, key, cfg.TRAIN.IMAGE_FIELD, cfg.TRAIN.LABEL_FIELD
    )
    decode, batched = _decoder(cfg, train)
    on_device = batched and decodes_on_device(cfg, place, lambda: _first_images(shard_set))
    if on_device:
        decode = DeviceDecode(decode)
    dataset = ShardDataset(
        shard_set,
        decode,
        rank=place.rank,
        world_size=place.world_size,
        train=train,
        seed=seed,
        batch_size=cfg.TRAIN.BATCH_SIZE if train else cfg.TEST.BATCH_SIZE,
        accum=cfg.TRAIN.ACCUM_STEPS if train else 1,
        workers=cfg.TRAIN.WORKERS,
        shuffle_block=cfg.TRAIN.SHARD_SHUFFLE,
        bad_images=cfg.TRAIN.BAD_IMAGES,
        label_map=_label_map(cfg, key, shard_set),
        collate_images=encoded_images if on_device else default_collate,
    )
    # Batches come whole from the workers (batch_size=None), which live
    # as long as the loader and leave stop signals to the main process.
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=cfg.TRAIN.WORKERS,
        persistent_workers=cfg.TRAIN.WORKERS > 0,
        worker_init_fn=quiet_worker,
        pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
    )
    loader = ShardLoader(track_workers(loader))
    if not batched:
        return loader
    erase = cfg.TRAIN.RANDOM_ERASE if train else 0.0
    batches = NormalizedBatches(loader, image_stats(cfg), device, erase)
    if not on_device:
        return batches
    return DecodedBatches(batches, decode, lambda i, e: dataset.note_unreadable("a record", e))


def _first_images(shard_set: ShardSet) -> list[bytes]:
    """The image bytes of the first shard's first records: what
    TRAIN.IMAGE_DECODE auto times the CPU on."""
    found: list[bytes] = []
    for _, fields in tar.samples(shard_set.shards[0].path):
        with contextlib.suppress(MissingField):
            found.append(shard_set.fields.image(fields))
        if len(found) == AUTO_SAMPLES:
            break
    return found


class ShardPipeline(Pipeline):
    """A shard set, whatever TRAIN.DATA_PIPELINE says. part is always
    None: check_datasets refuses TRAIN.VAL_SPLIT with shards."""

    def train_loader(self, part: str | None, place: Place) -> Any:
        return build_shard_loader(self.cfg, self.key, True, place, self.cfg.RNG_SEED or 0)

    def eval_loader(self, part: str | None, place: Place) -> Any:
        return build_shard_loader(self.cfg, self.key, False, place, 0)


def shard_plan(loader: Any) -> dict[str, Any] | None:
    """What decides the batches of a shard set's epoch (kept in
    checkpoints); None for other data."""
    plan = getattr(loader, "shard_plan", None)
    return plan() if plan is not None else None


def require_same_plan(loader: Any, samples_in_epoch: int, ckpt: dict[str, Any], path: str) -> None:
    """A mid-epoch position on shards means particular batches: refuse
    to resume it under another plan."""
    now, then = shard_plan(loader), ckpt.get("shard_plan")
    if now is None or samples_in_epoch == 0 or then == now:
        return
    changed = "unknown"
    if then:
        changed = ", ".join(f"{k} {then.get(k)} -> {v}" for k, v in now.items() if then.get(k) != v)
    raise UserError(
        f"{path} stopped {samples_in_epoch} samples into an epoch of a shard set, whose batches "
        "depend on the world size, TRAIN.WORKERS, BATCH_SIZE, ACCUM_STEPS and SHARD_SHUFFLE "
        f"({changed}); resume with the values it was written with, then change them at an "
        "epoch end"
    )
