"""The checks of the data before a run trains, each a UserError (exit 2)
naming what is wrong: the preflight (preflight.py, before any process
group), each image once (duplicates.py), and evaluation images that are
training images (overlap.py, once the group is up)."""

from distribuuuu.data.checks.overlap import check_overlap
from distribuuuu.data.checks.preflight import check_datasets

__all__ = ["check_datasets", "check_overlap"]
