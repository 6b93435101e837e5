"""The config system: baseline YAMLs, overrides, validation messages, run-folder dumps."""

import glob
import os

import pytest
import yaml

from distribuuuu import config, inferred
from distribuuuu.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINES = ["resnet18", "resnet50", "botnet50", "efficientnet_b0", "regnetx_160", "regnety_160", "regnety_320"]


@pytest.mark.parametrize("arch", BASELINES)
def test_baseline_configs_load_unchanged(arch):
    path = os.path.join(ROOT, "config", f"{arch}.yaml")
    cfg = inferred.resolve(config.load_config(path))
    assert cfg.MODEL.ARCH == arch
    assert cfg.OUT_DIR == f"./{arch}"
    big = arch.startswith(("efficientnet", "regnet"))
    assert (cfg.OPTIM.BASE_LR, cfg.TRAIN.BATCH_SIZE) == ((0.4, 64) if big else (0.2, 32))
    assert cfg.OPTIM.WEIGHT_DECAY == (1e-5 if arch == "efficientnet_b0" else 5e-5)
    # Every key the file states loads with its value: the defaults that now follow the data (#27:
    # NUM_CLASSES 0, TEST.DATASET '', TEST.IM_SIZE 0, WORKERS -1, WARMUP_EPOCHS a float) leave them as stated.
    stated = _flat_yaml(yaml.safe_load(open(path)))
    flat = config.flatten(cfg)
    assert {k: flat[k] for k in stated} == stated
    assert (flat["MODEL.NUM_CLASSES"], flat["TEST.IM_SIZE"], flat["TRAIN.WORKERS"], flat["TRAIN.TOPK"]) == (1000, 256, 4, 5)
    assert flat["OPTIM.WARMUP_EPOCHS"] == 5 and flat["TEST.DATASET"] == "./data/ILSVRC/"
    # Every key it does not state is at its default, but those decided here: no ILSVRC folder here, so the
    # former 3 channels (224 px is stated), NUM_THREADS from the free cores, and TRAIN.PATIENCE 0 (the
    # epochs are stated).
    assert set(config.diff_from_defaults(cfg)) <= set(stated) | {"MODEL.IN_CHANS", "NUM_THREADS", "TRAIN.PATIENCE"}
    assert (cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE) == (3, 224)


def _flat_yaml(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        out.update(_flat_yaml(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_every_shipped_config_validates():
    paths = glob.glob(os.path.join(ROOT, "config", "*.yaml"))
    assert len(paths) >= len(BASELINES) + 1
    for path in paths:
        config.load_config(path)


def test_every_key_has_a_comment():
    source = open(os.path.join(ROOT, "distribuuuu", "config", "defaults.py")).read().splitlines()
    for i, line in enumerate(source):
        if line.startswith("_C.") and " = " in line and "CN()" not in line:
            assert source[i - 1].lstrip().startswith("#"), f"no comment above: {line}"


def test_overrides_parse_as_python_literals():
    cfg = config.load_config(None, ["OPTIM.STEPS", "[0, 30, 60]", "OPTIM.LR_POLICY", "steps", "OPTIM.MAX_EPOCH", "90",
                                    "TRAIN.BATCH_SIZE", "7", "OPTIM.BASE_LR", "1", "MODEL.SYNCBN", "True",
                                    "TRAIN.DATASET", "/some/path", "RNG_SEED", "5", "MODEL.WEIGHTS", "None"])
    assert cfg.OPTIM.STEPS == [0, 30, 60]
    assert cfg.TRAIN.BATCH_SIZE == 7
    assert cfg.OPTIM.BASE_LR == 1.0 and isinstance(cfg.OPTIM.BASE_LR, float)
    assert cfg.MODEL.SYNCBN is True
    assert cfg.TRAIN.DATASET == "/some/path"
    assert cfg.RNG_SEED == 5 and cfg.MODEL.WEIGHTS is None
    assert cfg.is_frozen()


def test_later_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("TRAIN:\n  BATCH_SIZE: 16\nOPTIM:\n  BASE_LR: 0.5\n")
    cfg = config.load_config(str(path), ["TRAIN.BATCH_SIZE", "8"])
    assert (cfg.TRAIN.BATCH_SIZE, cfg.OPTIM.BASE_LR) == (8, 0.5)


@pytest.mark.parametrize("opts, message", [
    (["MODEL.ARHC", "resnet18"], "unknown config key MODEL.ARHC (did you mean MODEL.ARCH?)"),
    (["TRAIN.BATCH_SIZE", "abc"], "config key TRAIN.BATCH_SIZE expects an int, got 'abc'"),
    (["TRAIN.BATCH_SIZE", "2.5"], "config key TRAIN.BATCH_SIZE expects an int, got 2.5"),
    (["MODEL.SYNCBN", "1"], "config key MODEL.SYNCBN expects a bool, got 1"),
    (["TRAIN.BATCH_SIZE"], "KEY VALUE pairs"),
    (["TRAIN.WORKERS", "-2"], "TRAIN.WORKERS must be >= 0, or -1 for what the cores allow, got -2"),
    (["TRAIN.BATCH_SIZE", "0"], "TRAIN.BATCH_SIZE must be positive, got 0"),
    (["TRAIN.IM_SIZE", "-8"], "TRAIN.IM_SIZE must be >= 0"),
    (["OPTIM.LR_POLICY", "exp"], "OPTIM.LR_POLICY must be one of cos, steps, linear, constant, got 'exp'"),
    (["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[30, 60]"], "OPTIM.STEPS must start at 0"),
    (["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 60, 30]"], "strictly increasing"),
    (["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 200]", "OPTIM.MAX_EPOCH", "100"], "below OPTIM.MAX_EPOCH"),
    (["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 20]"], "must be given with the 'steps' policy"),
    (["OPTIM.NESTEROV", "True", "OPTIM.MOMENTUM", "0.0"], "OPTIM.NESTEROV True needs OPTIM.MOMENTUM > 0"),
    (["DEVICE", "tpu"], "DEVICE must be one of auto, cpu, cuda"),
    (["OPTIM.MIN_LR", "2.0"], "OPTIM.MIN_LR is a fraction"),
    (["IMPORTS", "[1]"], "IMPORTS holds module names or .py file paths (e.g. ['mypkg.models']), got [1]"),
    (["IMPORTS", "mypkg"], "config key IMPORTS expects a list, got 'mypkg'"),
])
def test_bad_values_are_user_errors_with_clear_messages(opts, message):
    with pytest.raises(UserError) as err:
        config.load_config(None, opts)
    assert message in str(err.value)


def test_bad_file_key_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("TRAIN:\n  BATCH_SIZ: 16\n")
    with pytest.raises(UserError, match=r"unknown config key TRAIN.BATCH_SIZ \(did you mean TRAIN.BATCH_SIZE\?\) in config file"):
        config.load_config(str(path))
    with pytest.raises(UserError, match="does not exist"):
        config.load_config(str(tmp_path / "missing.yaml"))


def test_load_config_leaves_the_keys_the_data_decides_to_inferred_resolve(tmp_path):
    """load_config reads no data: the unset keys stay unset until the caller resolves them (api.py, the CLI)."""
    for name in ("a", "b"):
        (tmp_path / "data" / "train" / name).mkdir(parents=True)
    cfg = config.load_config(None, ["TRAIN.DATASET", str(tmp_path / "data"), "TRAIN.IM_SIZE", "32"])
    unset = (cfg.MODEL.NUM_CLASSES, cfg.TEST.DATASET, cfg.TEST.IM_SIZE, cfg.TRAIN.WORKERS)
    assert unset == (0, "", 0, -1) and inferred.decisions(cfg) == []
    resolved = inferred.resolve(cfg, 1)
    assert (resolved.MODEL.NUM_CLASSES, resolved.TEST.DATASET, resolved.TEST.IM_SIZE) == (2, str(tmp_path / "data"), 36)
    assert resolved.TRAIN.WORKERS >= 0 and resolved.is_frozen() and cfg.MODEL.NUM_CLASSES == 0


def test_run_folder_gets_full_config_and_diff(tmp_path):
    """The texts RunFolder.write_record writes as config.yaml and config_diff.yaml."""
    from distribuuuu.run_folder import records

    cfg = inferred.resolve(config.load_config(None, ["MODEL.ARCH", "resnet50", "OUT_DIR", str(tmp_path)]))
    (tmp_path / "config.yaml").write_text(cfg.dump())
    full = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert full["MODEL"]["ARCH"] == "resnet50" and full["TRAIN"]["BATCH_SIZE"] == 32
    diff = yaml.safe_load(records.config_diff(cfg))
    # What was given, and the values decided from the data (#27): the stored config holds the values used.
    decided = {f.key for f in inferred.decisions(cfg) if f.origin != "config"} & set(config.flatten(cfg))
    # TEST.IM_SIZE: "eval size"; channels and size: the former defaults, no folder of images read here
    assert set(_flat_yaml(diff)) == {"MODEL.ARCH", "OUT_DIR", "TEST.IM_SIZE", "MODEL.IN_CHANS", "TRAIN.IM_SIZE"} | decided
    assert (diff["MODEL"]["ARCH"], diff["OUT_DIR"]) == ("resnet50", str(tmp_path))
    assert "MODEL.NUM_CLASSES" in decided and full["MODEL"]["NUM_CLASSES"] == 1000  # ImageNet's path: not here
    # The dumped file loads back to the same config.
    assert config.load_config(str(tmp_path / "config.yaml")) == cfg


def test_yaml_exponent_numbers_are_floats_where_the_key_is_a_float(tmp_path):
    """YAML 1.1 reads 1e-3 (no dot) as text; a float key takes it as the number (#27)."""
    path = tmp_path / "lr.yaml"
    path.write_text("OPTIM:\n  BASE_LR: 1e-3\n  WEIGHT_DECAY: 5E-5\n  MOMENTUM: +9.5e-1\n")
    cfg = config.load_config(str(path))
    assert (cfg.OPTIM.BASE_LR, cfg.OPTIM.WEIGHT_DECAY, cfg.OPTIM.MOMENTUM) == (1e-3, 5e-5, 0.95)
    path.write_text("OPTIM:\n  BASE_LR: 1e-3x\n")
    with pytest.raises(UserError, match="OPTIM.BASE_LR expects a float, got '1e-3x'"):
        config.load_config(str(path))
    path.write_text("OUT_DIR: 1e-3\n")  # a text key keeps the text
    assert config.load_config(str(path)).OUT_DIR == "1e-3"
