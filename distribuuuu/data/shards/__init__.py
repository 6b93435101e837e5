"""Sharded tar datasets in the WebDataset layout (issue #17).

write.py: `distribuuuu data shard SRC DEST` (deterministic shards +
index.json); external.py: `distribuuuu data index DIR` (the index.json
of tars that other tools wrote); index.py: finding and checking a shard
set named by TRAIN.DATASET / TEST.DATASET; fields.py: which members of
a sample are its image and label; plan.py: which samples each rank and
loader worker reads in an epoch; tar.py: reading a shard's samples;
reader.py: ShardDataset, one rank's batches; loader.py: the train / eval
loaders of a shard set; sample.py: a sample of its images for the
recipe (docs/data-at-scale.md, docs/data-formats.md).
"""

from distribuuuu.data.shards.index import FORMAT, INDEX, ShardSet, expand_braces, load_shard_set
from distribuuuu.data.shards.write import parse_size, write_shards

__all__ = [
    "FORMAT",
    "INDEX",
    "ShardSet",
    "expand_braces",
    "load_shard_set",
    "parse_size",
    "write_shards",
]
