"""Unit tests of the small pieces: top-k counting, the LR schedule, checkpoint files."""

import math
import os

import pytest
import torch

from distribuuuu import optim
from distribuuuu.engine import rng
from distribuuuu.engine.evaluation import Counter, topk_hits
from distribuuuu.errors import UserError
from distribuuuu.run_folder import RunFolder
from distribuuuu.weights import load_checkpoint
from tests.conftest import TINY, make_cfg


def test_topk_hits_counts_and_clips_k_to_the_number_of_classes():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    target = torch.tensor([1, 1, 0, 2])
    assert topk_hits(logits, target, (1, 2)).tolist() == [1, 2]
    assert topk_hits(logits, target, (1, 5)).tolist() == [1, 4]  # k=5 > 3 classes: everything


def test_counter_means_and_percentages():
    c = Counter(torch.device("cpu"), topk=2)
    c.update(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([0]), torch.tensor(1.0))
    c.update(torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]), torch.tensor([1, 0]), torch.tensor(4.0))
    r = c.reduce().result()  # no process group: reduce is the identity
    assert r["n"] == 3
    assert r["loss"] == pytest.approx((1.0 + 2 * 4.0) / 3)
    assert r["top1"] == pytest.approx(100 / 3) and r["topk_acc"] == pytest.approx(200 / 3)
    assert math.isnan(Counter(torch.device("cpu"), 2).result()["top1"])


def test_cosine_schedule_with_warmup():
    cfg = make_cfg("OPTIM.MAX_EPOCH", "10", "OPTIM.WARMUP_EPOCHS", "2", "OPTIM.WARMUP_FACTOR", "0.1",
                   "OPTIM.MIN_LR", "0.01")
    # The decay runs over the 8 epochs after the warmup (#27: every run reaches its peak LR).
    cos = lambda e: 0.99 * 0.5 * (1 + math.cos(math.pi * (e - 2) / 8)) + 0.01  # noqa: E731
    factor = optim.Schedule(cfg, 1.0)
    assert factor(0.0) == pytest.approx(0.1)  # warmup starts at WARMUP_FACTOR
    assert factor(1.0) == pytest.approx(0.55)  # halfway through warmup
    assert factor(2.0) == pytest.approx(1.0)  # warmup over: the peak itself
    assert factor(6.0) == pytest.approx(cos(6.0))
    assert factor(10.0) == pytest.approx(0.01)  # ends at MIN_LR
    # Monotone after warmup.
    values = [factor(2 + i / 10) for i in range(80)]
    assert values == sorted(values, reverse=True)


def test_steps_schedule_and_linear_scaling():
    cfg = make_cfg("OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 3, 6]", "OPTIM.LR_MULT", "0.1",
                   "OPTIM.MAX_EPOCH", "9", "OPTIM.WARMUP_EPOCHS", "0",
                   "OPTIM.LR_SCALING", "linear", "OPTIM.BASE_LR", "0.1")
    factor = optim.Schedule(cfg, 1.0)
    assert [factor(e) for e in (0, 2.99, 3, 5.5, 6, 8.9)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01])
    assert optim.peak_lr(cfg, 256) == pytest.approx(0.2)  # 0.1 x 256 / 128
    plain = make_cfg("OPTIM.BASE_LR", "0.1")
    assert optim.peak_lr(plain, 256) == pytest.approx(0.1)


def _state(epoch):
    return {"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch}


def _folder(out, keep=3):
    """The run folder out, as a run with TRAIN.CKPT_KEEP keep sees it."""
    return RunFolder(make_cfg({"OUT_DIR": out, "TRAIN.CKPT_KEEP": keep}))


def test_checkpoints_keep_k_and_last_best(tmp_path):
    out = str(tmp_path)
    for epoch in range(1, 6):
        _folder(out, keep=2).save(_state(epoch), is_best=(epoch == 2))
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert names == ["best.pth", "epoch_0004.pth", "epoch_0005.pth", "last.pth"]
    assert load_checkpoint(os.path.join(out, "checkpoints", "best.pth"))["epoch"] == 2
    ckpt, path = _folder(out).latest()
    assert ckpt["epoch"] == 5 and path.endswith("last.pth")


def test_a_corrupt_last_checkpoint_falls_back_to_an_older_one(tmp_path, caplog):
    out = str(tmp_path)
    for epoch in (1, 2):
        _folder(out).save(_state(epoch), is_best=False)
    last = os.path.join(out, "checkpoints", "last.pth")
    os.remove(last)
    with open(last, "wb") as f:
        f.write(b"not a checkpoint")
    with open(os.path.join(out, "checkpoints", "epoch_0002.pth"), "r+b") as f:
        f.truncate(20)
    ckpt, path = _folder(out).latest()
    assert ckpt["epoch"] == 1 and path.endswith("epoch_0001.pth")
    assert "skipping unreadable checkpoint" in caplog.text


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    out = str(tmp_path)
    _folder(out).save(_state(1), is_best=False)

    class Exploding:
        def __reduce__(self):
            raise OSError("disk full")

    with pytest.raises(OSError):
        _folder(out).save({"model": {}, "epoch": 2, "boom": Exploding()}, is_best=False)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["epoch_0001.pth", "last.pth"]
    assert _folder(out).latest()[0]["epoch"] == 1


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": _RunsCode()}, path)
    with pytest.raises(UserError, match="refused to load checkpoint"):
        load_checkpoint(str(path))


def test_rng_state_round_trip():
    state = rng.rng_state()
    a = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    rng.set_rng_state(state)
    b = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated"])
def test_a_stop_signal_mid_write_is_a_stop_not_a_write_error(tmp_path, monkeypatch, stop):
    """Ctrl-C / SIGTERM raised inside torch.save's writes: torch's zip writer then fails closing
    ("unexpected pos"), which was reported as a failed checkpoint write (a traceback, in CI). The
    stop must come out, the previous checkpoint stay, and no temporary file be left."""
    from distribuuuu.launch.signals import Terminated

    stop = Terminated if stop == "Terminated" else stop
    out = str(tmp_path)
    _folder(out).save(_state(1), is_best=False)
    real_save = torch.save

    class Interrupting:  # a file whose writes are cut by the signal after 3 KB
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 3000:
                raise stop()
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, Interrupting(f)))
    big = {**_state(2), "model": {"w": torch.zeros(10_000)}}
    with pytest.raises(stop):
        _folder(out).save(big, is_best=False)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["epoch_0001.pth", "last.pth"]
    assert _folder(out).latest()[0]["epoch"] == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group
@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated", None])
def test_a_sharded_checkpoint_write_ends_as_a_stop_or_one_clear_error(tmp_path, monkeypatch, stop):
    """torch.distributed.checkpoint collects every failure, a Ctrl-C included, into a
    CheckpointException, a BaseException that the CLI neither reported nor treated as a stop (a raw
    traceback, exit 1). A stop inside its writes (here: in fsync) comes out as the stop; any other
    failure (here: the folder's parent is a file) as an OSError naming the folder."""
    from distribuuuu.launch.signals import Terminated
    from distribuuuu.strategies import fsdp

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # momentum buffers: optimizer state to write
    if stop is None:
        (tmp_path / "a_file").write_text("")
        folder = str(tmp_path / "a_file" / "epoch_0001.dcp")
        with pytest.raises(OSError, match="writing the sharded checkpoint .*epoch_0001.dcp failed"):
            fsdp.save_sharded(model, optimizer, folder)
        return
    stop = Terminated if stop == "Terminated" else stop

    def interrupted_fsync(fd: int) -> None:
        raise stop()

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    with pytest.raises(stop):
        fsdp.save_sharded(model, optimizer, str(tmp_path / "epoch_0001.dcp"))
    assert not (tmp_path / "epoch_0001.dcp").exists()  # the half-written folder is gone


# ---- Each strategy states its own rules (strategies/), asked before any process starts -------------
@pytest.mark.parametrize("opts, world, message", [
    (["DIST.STRATEGY", "fsdp", "TRAIN.EMA_DECAY", "0.9"], 2, "TRAIN.EMA_DECAY needs whole parameters"),
    (["DIST.STRATEGY", "fsdp", "TRAIN.AMP", "fp16"], 2, "fsdp supports TRAIN.AMP off or bf16"),
    (["DIST.STRATEGY", "fsdp", "TRAIN.FREEZE_BACKBONE_EPOCHS", "1"], 2, "not fsdp (its shards"),
    (["DIST.STRATEGY", "ddp", "DIST.CPU_OFFLOAD", "True"], 2, "DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp"),
    (["DIST.STRATEGY", "dp"], 2, "dp is ONE process driving all local GPUs, but 2 processes"),
])
def test_a_strategy_refuses_what_it_cannot_train(opts, world, message):
    from distribuuuu import strategies

    cfg = make_cfg(*opts, base=TINY)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world)


def test_what_a_strategy_allows_passes_its_check_and_dp_alone_stays_dp():
    from distribuuuu import strategies

    for opts, world in ((["DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True"], 2), (["DIST.STRATEGY", "dp"], 1),
                        (["DIST.STRATEGY", "zero1", "TRAIN.EMA_DECAY", "0.9"], 2)):
        cfg = make_cfg(*opts, base=TINY)
        strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world)
    assert [strategies.resolve(n, False) for n in ("ddp", "fsdp", "dp")] == ["single", "single", "dp"]
    assert [strategies.resolve(n, True) for n in ("ddp", "zero1", "fsdp")] == ["ddp", "zero1", "fsdp"]


def test_every_strategy_the_config_allows_is_in_the_registry():
    """DIST.STRATEGY's choices (config/validate.py) are the registry: ddp, the default, is built into
    strategies/__init__.py (no module of its name); strategy_class imports the module of any other."""
    import importlib.util

    from distribuuuu import strategies
    from distribuuuu.config.validate import STRATEGIES

    assert set(strategies.BUILT_IN) == {"ddp"} and importlib.util.find_spec("distribuuuu.strategies.ddp") is None
    for name in (*STRATEGIES, "single"):
        cls = strategies.strategy_class(name)
        module = "distribuuuu.strategies" if name in strategies.BUILT_IN else f"distribuuuu.strategies.{name}"
        assert issubclass(cls, strategies.Strategy) and cls.name == name and cls.__module__ == module


def test_an_older_metrics_file_reads_with_todays_field_names(tmp_path):
    """metrics.jsonl's top-k field was named "top5" (it held top-TRAIN.TOPK): readers accept it as "topk_acc"."""
    from distribuuuu.run_folder.metrics_files import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1, "split": "val", "top1": 40.0, "top5": 70.0, "topk": 2, "n": 5}\n'
                    '{"epoch": 2, "split": "val", "top1": 50.0, "topk_acc": 80.0, "topk": 2, "n": 5}\n')
    old, new = read_jsonl(str(path))
    assert old == {"epoch": 1, "split": "val", "top1": 40.0, "topk_acc": 70.0, "topk": 2, "n": 5}
    assert new["topk_acc"] == 80.0 and "top5" not in new
