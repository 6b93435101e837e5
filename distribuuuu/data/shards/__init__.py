"""Sharded tar datasets in the WebDataset layout (issue #17).

write.py: `distribuuuu data shard SRC DEST` (deterministic shards + index.json); index.py: finding and
checking a shard set named by TRAIN.DATASET / TEST.DATASET. Training from shards (the reader) is not
in yet: docs/data-at-scale.md says what is planned.
"""

from distribuuuu.data.shards.index import ShardSet, expand_braces, is_shard_set, load_shard_set
from distribuuuu.data.shards.write import FORMAT, INDEX, parse_size, write_shards

__all__ = ["FORMAT", "INDEX", "ShardSet", "expand_braces", "is_shard_set", "load_shard_set", "parse_size",
           "write_shards"]
