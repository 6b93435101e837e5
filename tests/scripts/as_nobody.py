"""Run the `distribuuuu` command line as the unprivileged user nobody (uid and gid 65534).

For tests that need a folder the command cannot write to while the suite runs as root, for whom
permission bits stop nothing. The framework and its libraries are imported first, as the starting
user, because the Python installation may sit in a folder nobody cannot read (/root); then the
process gives up root for good and runs the command.
"""

import os
import sys

import torchvision  # noqa: F401 - loaded while the files are readable

import distribuuuu.api
import distribuuuu.cli
import distribuuuu.config
import distribuuuu.data
import distribuuuu.engine
import distribuuuu.launch.spawn
import distribuuuu.models
import distribuuuu.run_folder

NOBODY = 65534

if __name__ == "__main__":
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    status = distribuuuu.cli.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the exit handlers of a library imported as root (wandb's temporary folders, through
    # timm) would fail to remove what root made, and print a traceback onto the one line under test.
    os._exit(status)
