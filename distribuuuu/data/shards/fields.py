"""Which members of a tar sample are its image and its label.

A sample is a run of tar members sharing a key (tar.py); its fields are
the rest of each name (``jpg``, ``cls``, ``json``). The image is the
member named by the image field, or else the first of the usual image
extensions (tar.IMAGE_EXTS). The label is the text of a member (``cls``
by default: the class index as ASCII, webdataset's convention) or a key
of the sample's JSON member (``json:label``). Label values are class
indices (whole numbers) or class names, which the index's class list
maps to indices.

The index.json of a shard set records the fields it was made with
(`distribuuuu data index --image-field / --label-field`); shards of
`distribuuuu data shard` record none and read the defaults.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from distribuuuu.data.shards.tar import IMAGE_EXTS

DEFAULT_LABEL = "cls"
JSON_PREFIX = "json:"


class MissingField(ValueError):
    """A sample without its image or its label (a ValueError: an
    unreadable record to the reader, counted under TRAIN.BAD_IMAGES)."""


def parse_label_field(text: str) -> tuple[str, str]:
    """'cls' -> ('cls', ''); 'json:label' -> ('json', 'label'): the
    member holding the label, and the JSON key inside it ('' for the
    member's whole text)."""
    if text.startswith(JSON_PREFIX):
        return "json", text[len(JSON_PREFIX) :]
    return text.lower().lstrip("."), ""


class SampleFields:
    """A sample's image bytes and label index, read from its fields
    (module docstring). classes: the class names when the labels are
    names (None: the labels are class indices)."""

    def __init__(
        self, image: str = "", label: str = DEFAULT_LABEL, classes: list[str] | None = None
    ) -> None:
        self.image_field, self.label_field = image.lower().lstrip("."), label or DEFAULT_LABEL
        self.member, self.json_key = parse_label_field(self.label_field)
        self.by_name = None if classes is None else {c: i for i, c in enumerate(classes)}

    def read(self, fields: Mapping[str, bytes]) -> tuple[bytes, int]:
        """(the image's encoded bytes, the label index); MissingField
        when either is not there."""
        return self.image(fields), self.label(fields)

    def image(self, fields: Mapping[str, bytes]) -> bytes:
        return fields[self.image_name(fields)]

    def image_name(self, fields: Mapping[str, object]) -> str:
        """The field holding the image (the names alone are looked at)."""
        if self.image_field in fields:
            return self.image_field
        found = None if self.image_field else next((e for e in IMAGE_EXTS if e in fields), None)
        if found is None:
            wanted = f".{self.image_field}" if self.image_field else "image"
            raise MissingField(f"no {wanted} member (it has {_listed(fields)})")
        return found

    def label(self, fields: Mapping[str, bytes]) -> int:
        if self.by_name is None and not self.json_key and self.member in fields:
            return int(fields[self.member])  # the default: '.cls' holds the index
        value = self.value(fields)
        if self.by_name is None:
            return int(value)
        index = self.by_name.get(value)
        if index is None:
            raise MissingField(f"label {value!r} is not one of the {len(self.by_name)} classes")
        return index

    def value(self, fields: Mapping[str, bytes]) -> str:
        """The label as text: the member's text, or the JSON key's value
        (a whole number or a name)."""
        data = fields.get(self.member)
        if data is None:
            raise MissingField(f"no label: no .{self.member} member (it has {_listed(fields)})")
        if not self.json_key:
            return data.decode("utf-8", "replace").strip()
        record = json.loads(data)
        if not isinstance(record, dict) or self.json_key not in record:
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else "not an object"
            raise MissingField(f"no label: its .json has no key {self.json_key!r} ({keys})")
        value = record[self.json_key]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise MissingField(f"label {value!r} of .json key {self.json_key!r} is not a class")
        return str(value).strip()


def _listed(fields: Mapping[str, object]) -> str:
    return ", ".join(f".{f}" for f in sorted(fields)) or "no members"
