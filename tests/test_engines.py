"""The engines that own the processes: Ray Train (a real local cluster), Kubernetes (the processes its
operators start, with exactly the environment they set), SkyPilot (its task's torchrun line).

The Ray cases share one local cluster (ray.init(num_cpus=2): about 5 s to start, then about 25 s
for each TorchTrainer's first worker group): the straight run, and the run whose rank 0 is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from distribuuuu.engine import HookBase
from distribuuuu.errors import UserError
from distribuuuu.launch import launcher
from tests.conftest import (
    ROOT,
    TINY,
    check,
    distribuuuu,
    env,
    free_port,
    make_cfg,
    read_metrics,
    write_image_tree,
)

# Ray's own deprecations, raised as it imports ray.data: not ours to act on
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
EXAMPLES = os.path.join(ROOT, "examples")
MEASURED = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")  # how fast and how big, not what was learnt


def _numbers(out) -> list[dict]:
    """metrics.jsonl's rows without their measurements of the machine."""
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in read_metrics(str(out))]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """90 images of 2 classes, 8 px: 81 to train on, 9 held out (odd: 2 ranks must not pad it)."""
    folder = tmp_path_factory.mktemp("engines") / "images"
    write_image_tree(str(folder), "", {"a": 50, "b": 40}, size=(8, 8))
    return str(folder)


def _held_out(run) -> int:
    """How many images the run folder's heldout.txt lists."""
    return len((run / "heldout.txt").read_text().splitlines())


def _opts(images: str, out, *more: str) -> list[str]:
    return ["TRAIN.DATASET", images, "TEST.DATASET", "", "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8",
            "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4", "OUT_DIR", str(out), *more]


# ---------------------------------------------------------------------------------------------
# Who started us: Ray's variables beside DISTRIBUUUU_LAUNCHER, and a PyTorchJob pod's
# ---------------------------------------------------------------------------------------------
# What Ray Train 2.60 sets in worker 1 of 2 on one node (ray/train/torch/config.py:
# _set_torch_distributed_env_vars and on_start), with distribuuuu.ray_train's variable.
RAY_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "44421", "DISTRIBUUUU_LAUNCHER": "ray"}


def pytorchjob_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What the training-operator v1.9.0 sets in the pod of replica `rank` of a PyTorchJob with a
    Master and world_size - 1 Workers, nprocPerNode left at its default "auto"
    (pkg/controller.v1/pytorch/envvar.go setPodEnv, master.go; pytorch_defaults.go), with
    MASTER_ADDR this machine's instead of the Master's service name."""
    return {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
            "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto",
            "PET_NNODES": str(world_size)}


def test_ray_train_workers_are_detected_as_ray():
    info = launcher.detect(RAY_ENV, ["default_worker.py"])
    assert info == launcher.LaunchInfo("ray", 1, 1, 2, 2, 0, "192.0.2.2", 44421)


def test_a_pytorchjob_pod_is_one_process_per_node():
    info = launcher.detect(pytorchjob_env(1, 2, 23456), ["train_net.py"])
    assert info == launcher.LaunchInfo("one-per-node", 1, 0, 2, 1, 1, "127.0.0.1", 23456)


@pytest.mark.parametrize("env, name", [
    ({**pytorchjob_env(1, 2, 23456), "LOCAL_WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE=2, but LOCAL_RANK is not"),
    ({k: v for k, v in pytorchjob_env(1, 2, 23456).items() if k != "MASTER_PORT"}, "MASTER_ADDR/MASTER_PORT"),
    ({**pytorchjob_env(1, 2, 23456), "RANK": "2"}, "RANK=2"),
    ({k: v for k, v in RAY_ENV.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set"),
])
def test_what_cannot_be_one_process_per_node_is_refused(env, name):
    with pytest.raises(UserError, match=name):
        launcher.detect(env, ["train_net.py"])


def test_a_group_that_exists_is_adopted_and_left_to_its_maker(one_thread):
    import torch.distributed as dist

    from distribuuuu.launch import comm

    cfg = make_cfg(base=TINY)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    made = dist.group.WORLD
    with comm.session(cfg, launcher.LaunchInfo("ray", 0, 0, 1, 1, 0, "127.0.0.1", 0)) as ctx:
        assert (ctx.launcher, ctx.backend) == ("ray", "gloo")
    assert dist.group.WORLD is made  # still there: Ray destroys it, not the run
    with pytest.raises(UserError, match="rank 0 of 1, but ray says RANK=1 of WORLD_SIZE=2"):
        comm.setup(cfg, launcher.LaunchInfo("ray", 1, 1, 2, 2, 0, "127.0.0.1", 0))
    errors = []  # Ray calls the training function in a thread of its own: no signal reaches it
    thread = threading.Thread(target=lambda: _setup_or_error(cfg, errors))
    thread.start()
    thread.join()
    assert "set TRAIN.PREEMPT_SIGNALS []" in str(errors[0])
    comm.teardown()
    assert dist.is_initialized()
    dist.destroy_process_group()


def _setup_or_error(cfg, errors: list) -> None:
    from distribuuuu.launch import comm

    try:
        comm.setup(cfg, launcher.LaunchInfo("ray", 0, 0, 1, 1, 0, "127.0.0.1", 0))
    except UserError as e:
        errors.append(e)


# ---------------------------------------------------------------------------------------------
# Kubernetes: the processes each operator starts, here, with the environment it sets
# ---------------------------------------------------------------------------------------------
def _manifest(name: str) -> list[dict]:
    with open(os.path.join(EXAMPLES, "kubernetes", name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _start_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Start every (argv, extra environment) at once, as the pods start; wait for all."""
    procs = [subprocess.Popen(argv, cwd=ROOT, env={**env(), **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv, extra in commands]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]


@pytest.mark.e2e
def test_a_pytorchjob_trains_in_one_process_per_pod_and_evaluates_exactly(images, tmp_path):
    (job,) = _manifest("pytorchjob.yaml")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    command = container["command"][:container["command"].index("--cfg")]  # python -m distribuuuu train
    assert command[0] == "python"
    argv = [sys.executable, *command[1:], "--cfg", TINY, *_opts(images, tmp_path / "run", "OPTIM.MAX_EPOCH", "1")]
    port = free_port()
    pods = _start_all([(argv, pytorchjob_env(rank, 2, port)) for rank in (0, 1)])
    for rank, pod in enumerate(pods):
        check(pod)
        assert (f"[dist] rank {rank}/2 | local rank 0/1 | node {rank} | master 127.0.0.1:{port} | device cpu "
                "| backend gloo | launcher one-per-node") in pod.stdout, pod.stdout[-3000:]
    val = _numbers(tmp_path / "run")[-1]
    assert val["split"] == "val" and val["n"] == _held_out(tmp_path / "run") == 10  # 5 of a, 5 of b

    # The same checkpoint evaluated by one process: the 2-rank evaluation counted each image once
    check(distribuuuu("eval", "--cfg", TINY, *_opts(images, tmp_path / "run"),
                      "--checkpoint", str(tmp_path / "run" / "checkpoints" / "last.pth")))
    with open(tmp_path / "run" / "eval.jsonl") as f:
        alone = json.loads(f.read().splitlines()[-1])
    assert (alone["top1"], alone["n"]) == (val["top1"], val["n"])
    with open(tmp_path / "run" / "env.json") as f:
        assert json.load(f)["launcher"] == "one-per-node"


@pytest.mark.e2e
def test_a_trainjob_runs_torchrun_from_the_pet_variables(images, tmp_path):
    (job,) = _manifest("trainjob.yaml")
    trainer = job["spec"]["trainer"]
    assert trainer["command"][0] == "torchrun" and (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 1)
    argv = [sys.executable, "-m", "torch.distributed.run", *trainer["command"][1:], "--cfg", TINY,
            *_opts(images, tmp_path / "run", "OPTIM.MAX_EPOCH", "1")]
    port = free_port()
    # Kubeflow Trainer v2.3.0's torch plugin (pkg/runtime/framework/plugins/torch/torch.go,
    # EnforceMLPolicy): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index),
    # PET_MASTER_ADDR (node 0's pod), PET_MASTER_PORT (29500 there; a free port here)
    nodes = _start_all([(argv, {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node),
                                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}) for node in (0, 1)])
    for node, pod in enumerate(nodes):
        check(pod)
        assert f"| local rank 0/1 | node {node} | master 127.0.0.1:{port} " in pod.stdout, pod.stdout[-3000:]
        assert "| launcher torchrun" in pod.stdout
    rows = _numbers(tmp_path / "run")
    assert [(r["epoch"], r["split"]) for r in rows] == [(1, "train"), (1, "val")]
    assert rows[-1]["n"] == _held_out(tmp_path / "run") == 10


def _unknown_keys(doc, schema, path: str = "") -> list[str]:
    """The keys of doc that schema does not name: a dict lists the keys (each with its own schema),
    a one-item list is a list of that, ANY takes whatever is there (a map of names, a value)."""
    if schema is ANY:
        return []
    if isinstance(schema, list):
        return [k for i, item in enumerate(doc) for k in _unknown_keys(item, schema[0], f"{path}[{i}]")]
    if not isinstance(doc, dict):
        return [f"{path}: {doc!r} where keys belong"]
    return [k for key, value in doc.items()
            for k in ([f"{path}.{key}"] if key not in schema else _unknown_keys(value, schema[key], f"{path}.{key}"))]


ANY = object()
# The fields of Kubernetes' core/v1 types that the manifests use (k8s.io/api/core/v1/types.go)
META = {"name": ANY, "namespace": ANY, "labels": ANY, "annotations": ANY}
RESOURCES = {"requests": ANY, "limits": ANY}
CONTAINER = {"name": ANY, "image": ANY, "command": ANY, "args": ANY, "env": [{"name": ANY, "value": ANY}],
             "ports": [{"name": ANY, "containerPort": ANY, "protocol": ANY}], "resources": RESOURCES,
             "volumeMounts": [{"name": ANY, "mountPath": ANY, "readOnly": ANY}]}
VOLUME = {"name": ANY, "persistentVolumeClaim": {"claimName": ANY, "readOnly": ANY}}
POD_TEMPLATE = {"metadata": META, "spec": {"containers": [CONTAINER], "volumes": [VOLUME]}}
# training-operator v1.9.0: pkg/apis/kubeflow.org/v1/pytorch_types.go (PyTorchJobSpec) and
# common_types.go (RunPolicy, ReplicaSpec)
PYTORCHJOB = {"apiVersion": ANY, "kind": ANY, "metadata": META, "spec": {
    "runPolicy": {"cleanPodPolicy": ANY, "ttlSecondsAfterFinished": ANY, "activeDeadlineSeconds": ANY,
                  "backoffLimit": ANY, "suspend": ANY},
    "nprocPerNode": ANY,
    "pytorchReplicaSpecs": {role: {"replicas": ANY, "restartPolicy": ANY, "template": POD_TEMPLATE}
                            for role in ("Master", "Worker")}}}
# Kubeflow Trainer v2.3.0: pkg/apis/trainer/v1alpha1/trainjob_types.go (TrainJobSpec, Trainer,
# RuntimePatch down to ContainerPatch)
PATCHED_POD = {"spec": {"volumes": [VOLUME], "containers": [{"name": ANY, "volumeMounts": CONTAINER["volumeMounts"]}]}}
TRAINJOB = {"apiVersion": ANY, "kind": ANY, "metadata": META, "spec": {
    "runtimeRef": {"name": ANY, "apiGroup": ANY, "kind": ANY},
    "trainer": {"image": ANY, "command": ANY, "args": ANY, "env": CONTAINER["env"], "numNodes": ANY,
                "numProcPerNode": ANY, "resourcesPerNode": RESOURCES},
    "runtimePatches": [{"manager": ANY, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": ANY, "template": {"spec": {"template": PATCHED_POD}}}]}}}}]}}
PVC = {"apiVersion": ANY, "kind": ANY, "metadata": META,
       "spec": {"accessModes": ANY, "resources": RESOURCES, "storageClassName": ANY}}


@pytest.mark.parametrize("name, kinds", [
    ("pytorchjob.yaml", {("kubeflow.org/v1", "PyTorchJob"): PYTORCHJOB}),
    ("trainjob.yaml", {("trainer.kubeflow.org/v1alpha1", "TrainJob"): TRAINJOB}),
    ("runs-pvc.yaml", {("v1", "PersistentVolumeClaim"): PVC}),
])
def test_the_manifests_name_only_keys_their_operators_define(name, kinds):
    for doc in _manifest(name):
        schema = kinds[(doc["apiVersion"], doc["kind"])]
        assert _unknown_keys(doc, schema) == [], name


def test_a_key_no_operator_defines_is_found():
    (job,) = _manifest("pytorchjob.yaml")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    job["spec"]["elasticPolicy"] = {}
    assert sorted(_unknown_keys(job, PYTORCHJOB)) == [
        ".spec.elasticPolicy", ".spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].volumeMount"]


def test_the_manifests_share_one_run_folder_claim():
    (pvc,) = _manifest("runs-pvc.yaml")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, on any node, sees OUT_DIR
    (job,) = _manifest("pytorchjob.yaml")
    (train,) = _manifest("trainjob.yaml")
    pods = [spec["template"]["spec"] for spec in job["spec"]["pytorchReplicaSpecs"].values()]
    pods += [r["template"]["spec"]["template"]["spec"] for patch in train["spec"]["runtimePatches"]
             for r in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    for pod in pods:
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/runs"


# ---------------------------------------------------------------------------------------------
# SkyPilot: the task's run section, as SkyPilot runs it on the head node
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_skypilot_task_runs_torchrun_from_the_skypilot_variables(tmp_path):
    with open(os.path.join(EXAMPLES, "skypilot", "train.yaml")) as f:
        task = yaml.safe_load(f)
    # The fields of a task YAML (docs.skypilot.co, reference/yaml-spec)
    assert set(task) <= {"name", "workdir", "num_nodes", "resources", "envs", "file_mounts", "setup", "run"}
    assert task["num_nodes"] == 2 and task["file_mounts"]["/runs"]["mode"] == "MOUNT_CACHED"
    assert task["envs"]["OUT_DIR"].startswith("/runs/")
    # One node of 2 processes; the task's envs as `sky launch --env` would override them
    sky = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1\n", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "0", **task["envs"], "CFG": TINY, "OUT_DIR": str(tmp_path / "run"),
           "PORT": str(free_port()), "OPTS": "OPTIM.MAX_EPOCH 1"}
    e = {**env(), **{k: str(v) for k, v in sky.items()}}
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e["PATH"]  # torchrun and python of this venv
    done = check(subprocess.run(["bash", "-c", task["run"]], cwd=ROOT, env=e, capture_output=True, text=True,
                                timeout=240))
    out = done.stdout + done.stderr
    assert "| local rank 1/2 | node 0 | master 127.0.0.1:" in out and "| launcher torchrun" in out, out[-3000:]
    assert [(r["epoch"], r["split"]) for r in read_metrics(str(tmp_path / "run"))] == [(1, "train"), (1, "val")]


# ---------------------------------------------------------------------------------------------
# Ray Train: a local cluster, TorchTrainer with 2 CPU workers
# ---------------------------------------------------------------------------------------------
RAY_OPTS = ("OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_STEPS", "3")  # step checkpoints: a kill resumes mid-epoch


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of 2 CPUs for the module; its workers import this checkout (tests too)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()


def _fit(images: str, out, storage, hooks=(), max_failures: int = 0):
    """distribuuuu.ray_train.train_loop under a TorchTrainer of 2 CPU workers: Ray's Result."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from distribuuuu import ray_train

    config = {"cfg": TINY, "opts": _opts(images, out, *RAY_OPTS), "hooks": list(hooks)}
    trainer = TorchTrainer(ray_train.train_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name=os.path.basename(out), storage_path=str(storage),
                                                failure_config=FailureConfig(max_failures=max_failures)))
    return trainer.fit()


@pytest.fixture(scope="module")
def torchrun_run(images, tmp_path_factory):
    """The same config under torchrun, 2 processes: the rows a Ray run must equal."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    check(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "train_net.py", "--cfg", TINY, *_opts(images, out, *RAY_OPTS)],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    return out


@pytest.mark.e2e
def test_ray_train_runs_distribuuuu_as_torchrun_does(ray_cluster, images, torchrun_run, tmp_path):
    result = _fit(images, tmp_path / "ray", tmp_path / "storage")
    assert result.error is None
    rows = _numbers(tmp_path / "ray")
    assert rows == _numbers(torchrun_run)
    assert [(r["epoch"], r["split"]) for r in rows] == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]
    # Ray's result: the last epoch's records, and a checkpoint that points at the run folder
    assert (result.metrics["epoch"], result.metrics["val_top1"], result.metrics["val_n"]) == (2, rows[-1]["top1"], 10)
    assert result.metrics["train_loss"] == rows[-2]["loss"]
    with open(os.path.join(result.checkpoint.path, "distribuuuu.json")) as f:
        assert json.load(f) == {"out_dir": str(tmp_path / "ray"), "epoch": 2,
                                "checkpoint": str(tmp_path / "ray" / "checkpoints" / "last.pth")}
    with open(tmp_path / "ray" / "env.json") as f:
        assert json.load(f)["launcher"] == "ray"
    assert not (tmp_path / "ray" / "run.lock").exists()


class WaitForSigkill(HookBase):
    """Once, at optimizer step `step` of rank `rank`: write this worker's pid to pid_file, then wait
    there for the test's SIGKILL (a later start of the run finds the file and goes on)."""

    def __init__(self, rank: int, step: int, pid_file: str) -> None:
        self.rank, self.step, self.pid_file = rank, step, pid_file

    def after_step(self, trainer, step, printed) -> None:
        here = (trainer.ctx.rank, trainer.state.global_step) == (self.rank, self.step)
        if not here or not step.last or os.path.exists(self.pid_file):
            return
        with open(self.pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(self.pid_file + ".tmp", self.pid_file)
        time.sleep(120)


def _kill_when_written(pid_file, killed: list[int]) -> None:
    deadline = time.monotonic() + 200
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(pid_file):
        with open(pid_file) as f:
            killed.append(int(f.read()))
        os.kill(killed[0], signal.SIGKILL)


@pytest.mark.e2e
def test_a_worker_killed_mid_epoch_is_restarted_by_ray_and_resumes_step_exactly(ray_cluster, images, torchrun_run,
                                                                               tmp_path):
    # 11 optimizer steps an epoch (81 images, 2 x 4 a step): step 16 is mid-epoch 2, one past the
    # step checkpoint of step 15. Rank 0 holds the run lock and writes the records.
    pid_file, killed = str(tmp_path / "rank0.pid"), []
    killer = threading.Thread(target=_kill_when_written, args=(pid_file, killed), daemon=True)
    killer.start()
    result = _fit(images, tmp_path / "ray", tmp_path / "storage", [WaitForSigkill(0, 16, pid_file)], max_failures=1)
    killer.join(timeout=5)
    assert killed, "the worker never reached step 16"
    assert result.error is None  # Ray restarted the group once and the run finished
    assert _numbers(tmp_path / "ray") == _numbers(torchrun_run)  # nothing trained twice, nothing lost
    log = (tmp_path / "ray" / "log.txt").read_text()
    assert f"took over {tmp_path / 'ray' / 'run.lock'}, left by a run that is no longer running: pid {killed[0]}" in log
    assert "resumed from" in log and "into epoch 2, step 15" in log, log[-3000:]
    assert result.metrics["epoch"] == 2
