"""Data: where it comes from, how it is decoded, the per-sample recipe,
one rank's batches, the held-out split, and the checks before a run.

  sources/    what a TRAIN.DATASET / TEST.DATASET value names (one chooser),
              a reader per storage format: image folders, CIFAR pickles, the
              shipped and registered sources; `data export`
  shards/     tar shard sets: `data shard`, their index, and their stream
  decoding/   encoded images to pixels: on the CPU, or on the device
  transforms  the data recipe and per-sample transforms
  holdout     the part of the training data TRAIN.VAL_SPLIT holds out
  split_files that part as files: heldout.txt, and `data split`'s links
  loading/    from a split to batches: the pipelines (one chooser), samplers,
              the workers and batches, class balance
  checks/     the preflight, duplicates, train/val overlap

Typical use (the engine): ``check_datasets`` before the process group
starts, ``check_overlap`` once it is up, then the loaders on each rank;
``stop_workers`` when the run ends.
"""

from distribuuuu.data.checks import check_datasets, check_overlap
from distribuuuu.data.loading import build_test_loader, build_train_loader, build_val_loader
from distribuuuu.data.loading.batches import stop_workers
from distribuuuu.data.loading.items import build_dataset, take_unreadable, unreadable_so_far
from distribuuuu.data.shards.loader import require_same_plan, shard_plan
from distribuuuu.data.sources.builtin import TensorSource
from distribuuuu.data.sources.export import export
from distribuuuu.data.sources.registry import register_source, source_names, unregister_source

__all__ = [
    "check_datasets",
    "check_overlap",
    "build_train_loader",
    "build_val_loader",
    "build_test_loader",
    "build_dataset",
    "stop_workers",
    "take_unreadable",
    "unreadable_so_far",
    "shard_plan",
    "require_same_plan",
    "TensorSource",
    "export",
    "register_source",
    "unregister_source",
    "source_names",
]
