"""Distribuuuu-compatible training entry point; the same as `distribuuuu train`.

    python train_net.py --cfg config/resnet18.yaml OUT_DIR runs/r18 [KEY VALUE ...]
    torchrun --nproc_per_node=2 train_net.py --cfg ...
    srun -n 8 python train_net.py --cfg ...
"""

import sys

from distribuuuu.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
