"""Image decoding on the training device (TRAIN.IMAGE_DECODE gpu): JPEGs
decoded a batch at a time; auto: gpu on CUDA when the CPU cannot keep up
with the model (docs/performance.md, 6a and 6b: how, and what ran on a
GPU).

The loader workers do all but the decode (DeviceDecode: the fast path's
crop and flip draws, the encoded bytes passed on; a file the device
would refuse takes the fast path there, so TRAIN.BAD_IMAGES treats it as
today); collate_encoded keeps the bytes as a list; the main process
(DecodedBatches) decodes each batch with one
torchvision.io.decode_jpeg(list, device=...) call when the loop asks for
it, overlapping the previous step's queued kernels, then crops, resizes,
flips and normalizes on the device. DEVICE cpu runs the same path with
libjpeg-turbo: how the tests run it. The decoder never runs in a loader
worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchvision.io as tio
from torch.utils.data import DataLoader
from torchvision.transforms import RandomResizedCrop, v2
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.data import transforms
from distribuuuu.data.decoding import cpu
from distribuuuu.data.loading.batches import NormalizedBatches
from distribuuuu.data.loading.items import ImageDataset, UnreadableImage
from distribuuuu.data.loading.pipeline import LoaderPipeline, Place
from distribuuuu.launch import comm

log = logging.getLogger("distribuuuu")

DEVICE_FRAMES = (0xC0, 0xC1)  # baseline and extended sequential Huffman-coded JPEG frames
JPEG_END = b"\xff\xd9"
# The box of an item finished in the worker, and of evaluation items.
NO_BOX = torch.zeros(5, dtype=torch.int64)


def device_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG the device decodes: sequential, 8 bits,
    1 or 3 channels, whole (its end marker last); None for any other
    file, which the worker decodes itself."""
    if data[:3] != cpu.JPEG_MAGIC or not data.endswith(JPEG_END):
        return None
    frame = cpu.jpeg_frame(data)
    if frame is None or frame[0] not in DEVICE_FRAMES or frame[1] != 8 or frame[4] not in (1, 3):
        return None
    return frame[2], frame[3]


class DeviceDecode:
    """The fast path's recipe (fast: a cpu.FastTrainDecode or
    FastEvalDecode) cut after the crop draw: the worker half (__call__)
    and the device half (finish). Picklable, for workers started by
    spawn."""

    def __init__(self, fast: cpu.FastTrainDecode | cpu.FastEvalDecode) -> None:
        self.fast, self.train = fast, isinstance(fast, cpu.FastTrainDecode)
        self.read_mode = tio.ImageReadMode.GRAY if fast.mode == "L" else tio.ImageReadMode.RGB

    def __call__(self, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """(the encoded JPEG as uint8 [N], its box [top, left, height,
        width, flip]); a file the device would refuse: (the fast path's
        uint8 crop [C, S, S], NO_BOX)."""
        size = device_size(data)
        if size is None:
            return self.fast(data), NO_BOX
        box = NO_BOX
        if self.train:  # FastTrainDecode's draws in its order: the crop, then the flip
            shape_only = torch.empty(1, dtype=torch.uint8).expand(1, size[1], size[0])
            scale, ratio = self.fast.scale, self.fast.ratio
            top, left, h, w = RandomResizedCrop.get_params(shape_only, scale, ratio)
            box = torch.tensor([top, left, h, w, int(torch.rand(1) < self.fast.flip)])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), box

    def finish(self, image: torch.Tensor, box: list[int]) -> torch.Tensor:
        """A decoded uint8 [C, H, W] image -> float [C, S, S] in 0-255,
        on its device: the fast path's geometry on float pixels (the
        fast path rounds to uint8 after resizing;
        tests/test_gpu_decode.py bounds the difference)."""
        fast = self.fast
        if not self.train:
            resized = v2.functional.resize(
                image.float(),
                fast.resize_to,
                interpolation=fast.recipe.mode,
                antialias=fast.recipe.antialias,
            )
            return v2.functional.center_crop(resized, [fast.crop, fast.crop])
        top, left, h, w, flip = box
        crop = image[None, :, top : top + h, left : left + w].float()
        out = torch.nn.functional.interpolate(
            crop, size=(fast.size, fast.size), **fast.interpolate
        )[0]
        return out.flip(-1) if flip else out


def encoded_images(items: list[tuple]) -> tuple[list, torch.Tensor, list[int]]:
    """A batch of DeviceDecode items, (data, box) or (data, box, index)
    -> (the data as a list: their lengths differ, the boxes stacked, the
    items' indices: -1 where they have none, a shard's records)."""
    datas, boxes = [item[0] for item in items], torch.stack([item[1] for item in items])
    return datas, boxes, [item[2] if len(item) > 2 else -1 for item in items]


def collate_encoded(items: list[Any]) -> Any:
    """An image split's (DeviceDecode item, label) pairs -> (encoded_images,
    labels), leaving out an evaluation set's unreadable items (None) as
    batches.collate_readable does; None when none is left."""
    kept = [item for item in items if item is not None]
    if not kept:
        return None
    return encoded_images([image for image, _ in kept]), torch.tensor([y for _, y in kept])


class NumberedImages(ImageDataset):
    """An ImageDataset whose items carry their index: the main process
    names an image that the device cannot decode."""

    def item(self, i: int) -> tuple[Any, int]:
        image, label = super().item(i)
        return (*image, i), label


class DecodedBatches(NormalizedBatches):
    """NormalizedBatches (the same loader, device, normalization and
    erasing) whose loader yields encoded batches (collate_encoded): each
    decoded on the device and made to images there (module docstring).
    unreadable(index, error) is told of an image neither decoder reads."""

    def __init__(
        self,
        batches: NormalizedBatches,
        decode: DeviceDecode,
        unreadable: Callable[[int, Exception], None],
    ) -> None:
        self.loader, self.device = batches.loader, batches.device
        self.normalize, self.erase = batches.normalize, batches.erase
        self.decode, self.unreadable = decode, unreadable
        # CUDA: the batch is made on a side stream, which the decoder
        # allocates from. torchvision's CUDA decode writes its outputs
        # from a stream of its own without waiting for the current one,
        # and nvJPEG's hardware decoder ignores stream order: a block
        # freed on the current stream while kernels queued there still
        # read it can be overwritten (pytorch/vision#9606). Draining the
        # side stream before each call leaves nothing queued on it;
        # blocks used by other streams are guarded by record_stream.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for (datas, boxes, ids), target in self.loader:
            with torch.cuda.stream(self.stream):  # no stream (None) on the CPU
                batch, kept = self.pixels(datas, boxes.tolist(), ids)
                if batch is None:  # evaluation: not one readable image in the batch
                    continue
                batch = self.normalize(batch)
                if self.erase is not None:
                    batch = self.erase(batch)
            if self.stream is not None:
                # CUDA: the step's kernels start once the batch is made,
                # and its memory is not reused before they have read it.
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_stream(self.stream)
                batch.record_stream(consumer)
            yield batch, target[kept].to(self.device, non_blocking=True)

    def pixels(
        self, datas: list[torch.Tensor], boxes: list[list[int]], ids: list[int]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """(float [B, C, S, S] in 0-255 on the device, the batch
        positions they come from): an unreadable image is replaced by a
        readable one of the batch in training, left out in evaluation."""
        decoded = iter(self.decoded([data for data in datas if data.dim() == 1]))
        made: dict[int, torch.Tensor] = {}
        for i, (data, box) in enumerate(zip(datas, boxes)):
            if data.dim() == 3:  # finished in the worker: a file the device refuses
                made[i] = data.to(self.device, non_blocking=True).float()
                continue
            image = next(decoded)
            if isinstance(image, Exception):
                self.unreadable(ids[i], image)
            else:
                made[i] = self.decode.finish(image, box)
        kept = list(made)
        if self.decode.train and len(kept) < len(datas):
            if not kept:
                raise UnreadableImage(f"all {len(datas)} images of a training batch are unreadable")
            kept = [kept[i % len(kept)] for i in range(len(datas))]
        if not kept:
            return None, kept
        # clamp: bicubic overshoots, where the fast path's uint8 saturates
        return torch.stack([made[i] for i in kept]).clamp_(0, 255), kept

    def decoded(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """Each JPEG as uint8 [C, H, W] on the device, in one call; when
        it fails (it returns all or nothing) the batch is decoded on the
        CPU image by image (libjpeg-turbo, then PIL): the error where
        neither reads it."""
        if not jpegs:
            return []
        if self.stream is not None:
            self.stream.synchronize()  # nothing queued where the decoder allocates
        try:
            with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs (cpu.decode)
                warnings.simplefilter("ignore", DeprecationWarning)
                return tio.decode_jpeg(jpegs, mode=self.decode.read_mode, device=self.device)
        except RuntimeError:
            return [self._decoded_on_cpu(bytes(jpeg.numpy())) for jpeg in jpegs]

    def _decoded_on_cpu(self, data: bytes) -> torch.Tensor | Exception:
        try:
            return cpu.decode(data, self.decode.fast.mode).to(self.device)
        except cpu.DECODE_ERRORS as e:
            return e


class DeviceDecodePipeline(LoaderPipeline):
    """An image split under TRAIN.IMAGE_DECODE gpu (or auto where CUDA
    is): the LoaderPipeline with DeviceDecode as the items' decoder,
    collate_encoded, and DecodedBatches. When auto keeps the fast path,
    exactly the LoaderPipeline."""

    decode: DeviceDecode | None = None

    def train_loader(self, part: str | None, place: Place) -> Any:
        return self.decoded(super().train_loader(part, place))

    def eval_loader(self, part: str | None, place: Place) -> Any:
        return self.decoded(super().eval_loader(part, place))

    def items(self, train: bool, part: str | None, place: Place) -> tuple[Any, Any, bool]:
        dataset, sampler, fast = super().items(train, part, place)
        self.whole = whole = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part's split)
        step = max(1, len(whole) // AUTO_SAMPLES)

        def sample() -> list[bytes]:
            return [whole.files.read(i) for i in range(0, len(whole), step)[:AUTO_SAMPLES]]

        if decodes_on_device(self.cfg, place, sample):
            self.decode = DeviceDecode(whole.decode)
            whole.decode, whole.__class__ = self.decode, NumberedImages
        return dataset, sampler, fast

    def data_loader(self, *args: Any, **kwargs: Any) -> DataLoader:
        if self.decode is not None:
            kwargs["collate_fn"] = collate_encoded
        return super().data_loader(*args, **kwargs)

    def decoded(self, batches: Any) -> Any:
        if self.decode is None:
            return batches
        return DecodedBatches(batches, self.decode, self.whole.note_unreadable)


# ---------------------------------------------------------------------------------------------
# TRAIN.IMAGE_DECODE auto
# ---------------------------------------------------------------------------------------------
AUTO_SAMPLES = 32  # images whose fast-path decode times the CPU
AUTO_STEPS = 3  # timed training steps of the model (after one to warm up)
# auto's decision, once per process for the train, val and test loaders
_decided: dict[tuple, bool] = {}


def decodes_on_device(cfg: CfgNode, place: Place, sample: Callable[[], list[bytes]]) -> bool:
    """Whether the JPEGs are decoded on the device: TRAIN.IMAGE_DECODE
    gpu; auto on a CUDA device when auto_choice says so (rank 0
    measures, with sample()'s images, and tells the others)."""
    device = place.device
    if cfg.TRAIN.IMAGE_DECODE != "auto" or device.type != "cuda":
        return cfg.TRAIN.IMAGE_DECODE == "gpu"
    t = cfg.TRAIN
    key = (t.DATASET, cfg.MODEL.ARCH, t.IM_SIZE, t.BATCH_SIZE, t.AMP, t.CHANNELS_LAST, t.WORKERS)
    key += (str(device),)
    if key not in _decided:
        # building and timing the model draws random numbers
        with torch.random.fork_rng(devices=[device]):
            decision = auto_choice(cfg, device, sample()) if place.rank == 0 else None
        if place.world_size > 1:
            decision = comm.broadcast_object(decision)
        on_device, why = decision
        if place.rank == 0:
            log.info("TRAIN.IMAGE_DECODE auto: %s", why)
        _decided[key] = on_device
    return _decided[key]


def auto_choice(cfg: CfgNode, device: torch.device, samples: list[bytes]) -> tuple[bool, str]:
    """(decode on the device?, why): the fast path's CPU rate per worker
    x the workers, against the model's."""
    if cfg.TRAIN.AUTO_AUGMENT != "none":
        return (
            False,
            "fast, since TRAIN.AUTO_AUGMENT's policies run in the workers, on decoded images",
        )
    mode = "L" if cfg.MODEL.IN_CHANS == 1 else "RGB"
    per_worker = cpu_rate(
        cpu.FastTrainDecode(cfg.TRAIN.IM_SIZE, mode, transforms.recipe_of(cfg)), samples
    )
    workers = max(1, cfg.TRAIN.WORKERS)
    try:
        model = model_rate(cfg, device)
    except torch.OutOfMemoryError:
        return (
            False,
            f"fast, since a batch of {cfg.TRAIN.BATCH_SIZE} does not fit {device} to time the "
            "model",
        )
    feed = per_worker * workers
    rates = (
        f"{workers} workers x {per_worker:.0f} img/s decoded on the CPU = {feed:.0f} img/s, "
        f"{cfg.MODEL.ARCH} trains at {model:.0f} img/s on {device} (batch {cfg.TRAIN.BATCH_SIZE}, "
        f"AMP {cfg.TRAIN.AMP})"
    )
    return (
        (True, f"gpu, since the CPU cannot keep up: {rates}")
        if feed < model
        else (False, f"fast, since the CPU keeps up: {rates}")
    )


def cpu_rate(decode: Callable[[bytes], Any], samples: list[bytes]) -> float:
    """Images per second that one loader worker (one thread) turns into
    crops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for data in samples:
            with contextlib.suppress(*cpu.DECODE_ERRORS):
                decode(data)
        return len(samples) / max(time.perf_counter() - start, 1e-9)
    finally:
        torch.set_num_threads(threads)


def model_rate(cfg: CfgNode, device: torch.device) -> float:
    """Images per second of MODEL.ARCH's forward and backward on a
    random batch of TRAIN.BATCH_SIZE at TRAIN.IM_SIZE on device, with
    TRAIN.AMP and TRAIN.CHANNELS_LAST (no optimizer, no compilation):
    what the loader must feed."""
    layout = torch.channels_last if cfg.TRAIN.CHANNELS_LAST else torch.contiguous_format
    model = models.build_model(cfg, with_weights=False).to(device, memory_format=layout)
    size, batch = cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE
    x = torch.randn(batch, cfg.MODEL.IN_CHANS, size, size, device=device).contiguous(
        memory_format=layout
    )
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.TRAIN.AMP)
    seconds = []
    for _ in range(1 + AUTO_STEPS):  # the first warms up
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            model(x).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return AUTO_STEPS * batch / sum(seconds[1:])
