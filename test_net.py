"""Distribuuuu-compatible evaluation entry point; the same as `distribuuuu eval`.

    python test_net.py --cfg config/resnet18.yaml MODEL.WEIGHTS runs/r18/checkpoints/best.pth
"""

import sys

from distribuuuu.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
