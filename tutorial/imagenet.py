"""
ImageNet-style training: step 6 of the ladder, the previous steps put together.

Images come from folders, DIR/train/<class>/*.jpeg and DIR/val/<class>/*.jpeg (ImageNet's
layout, read by torchvision's ImageFolder). The script runs under torchrun / torch.distributed
.launch or under srun, and rank 0 saves a checkpoint that every rank then loads back.
Compare: `diff -u tutorial/mnmc_ddp_slurm.py tutorial/imagenet.py`.

    torchrun --nproc-per-node 8 tutorial/imagenet.py --data /data/ILSVRC --arch resnet18 --batch-size 32
    srun -N 2 --ntasks-per-node 8 --gres gpu:8 python -u tutorial/imagenet.py --data /data/ILSVRC --arch resnet50
    # on a CPU, the MNIST digits as an ImageFolder tree (distribuuuu data export mnist5k data/mnist5k):
    torchrun --nproc-per-node 2 tutorial/imagenet.py --data data/mnist5k --im-size 28
"""
import argparse
import os
import re
import subprocess

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP

REF_BATCH = 64  # --lr is the learning rate for a global batch of this size
PRINT_FREQ = 25

parser = argparse.ArgumentParser(description="ImageNet-style DDP training (torchrun, launch or srun)")
parser.add_argument("--data", required=True, help="folder holding train/<class>/* and val/<class>/*")
parser.add_argument("--epochs", default=5, type=int)
parser.add_argument("--batch-size", default=64, type=int, help="samples per step in each process")
parser.add_argument("--lr", default=0.05, type=float, help=f"learning rate for a global batch of {REF_BATCH}")
parser.add_argument("--max-steps", default=0, type=int, help="stop each epoch after this many steps (0: all)")
parser.add_argument("--arch", default="small", help="'small' (a small CNN) or a torchvision model: resnet18, resnet50, ...")
parser.add_argument("--workers", default=4, type=int, help="data loading processes per rank")
parser.add_argument("--im-size", default=224, type=int, help="training crop size (ImageNet: 224)")
parser.add_argument("--ckpt", default="checkpoint.pth", help="where rank 0 saves the final checkpoint")
# torch.distributed.launch passes --local-rank=N (--local_rank before torch 2.0); torchrun sets
# LOCAL_RANK in the environment instead.
parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                    default=int(os.environ.get("LOCAL_RANK", 0)), help="set by the launcher")


def first_host(nodelist):
    """The first host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03"."""
    m = re.match(r"([^,\[\]]+)(?:\[(\d+)[-,\d]*\])?(?:,|$)", nodelist)
    if m:
        return m.group(1) + (m.group(2) or "")
    # Forms the pattern does not cover ("r[1-2]n[3-4]"): ask Slurm to expand the list.
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def load_data(root, im_size):
    """(trainset, valset, in_chans, num_classes) from root/train and root/val (ImageNet's layout)."""
    traindir, valdir = os.path.join(root, "train"), os.path.join(root, "val")
    for d in (traindir, valdir):
        if not os.path.isdir(d):
            parser.error(f"--data {root}: {d} is not a folder (expected {root}/train/<class>/* and {root}/val/<class>/*)")
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = T.Compose([T.RandomResizedCrop(im_size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    val_tf = T.Compose([T.Resize(round(im_size / 0.875)), T.CenterCrop(im_size), T.ToTensor(), T.Normalize(mean, std)])
    trainset = torchvision.datasets.ImageFolder(traindir, train_tf)  # images are opened as RGB
    valset = torchvision.datasets.ImageFolder(valdir, val_tf)
    if valset.classes != trainset.classes:  # labels are indices into the sorted class folders
        parser.error(f"--data {root}: train and val hold different class folders")
    return trainset, valset, 3, len(trainset.classes)


def build_net(arch, in_chans, num_classes):
    """A small CNN (fast on a CPU, any image size), or a torchvision model by name."""
    if arch != "small":  # any torchvision classification model, randomly initialised (no download)
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    layers, cin = [], in_chans
    for cout in (16, 32, 64):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        layers += [nn.MaxPool2d(2)] if cout < 64 else []
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))


@torch.no_grad()
def evaluate(model, valset, device, batch_size, rank, world_size, workers):
    """(correct, total) top-1 counts over the whole val set, exact for any number of processes.

    Rank r takes samples r, r + W, r + 2W, ...: the shards are disjoint and cover the set once,
    so the summed counts give total == len(valset). A DistributedSampler would instead pad the
    shards with repeated samples to equal length (drop_last=False) or drop the tail
    (drop_last=True): fine for training, wrong for counting. As shard lengths may differ, pass
    the plain module, not the DDP wrapper, whose forward can start collectives every rank must join.
    """
    shard = torch.utils.data.Subset(valset, range(rank, len(valset), world_size))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, num_workers=workers)
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
    # The data first: a wrong --data stops here, before any rank waits for its peers.
    trainset, valset, in_chans, num_classes = load_data(args.data, args.im_size)

    # 0. the process group: who am I (rank), how many are we (world size), which device is mine
    # (local rank: my index on this node). NCCL for GPUs, gloo for CPUs.
    env = os.environ
    if "RANK" in env:  # torchrun or torch.distributed.launch (also `srun torchrun ...`): as in step 3
        rank, world_size, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), args.local_rank
        init_method = "env://"  # MASTER_ADDR and MASTER_PORT
    elif "SLURM_PROCID" in env:  # srun: as in step 5
        rank, world_size, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST", env["SLURM_NODELIST"]))
        port = int(env.get("MASTER_PORT", 10000 + int(env["SLURM_JOB_ID"]) % 20000))
        init_method = f"tcp://{addr}:{port}"
    else:
        parser.error("start me with torchrun, python -m torch.distributed.launch or srun "
                     "(neither RANK nor SLURM_PROCID is set); one process: torchrun --nproc-per-node 1 ...")
    if torch.cuda.is_available():
        # srun --gpus-per-task=1 shows each task only its own GPU (as cuda:0): SLURM_LOCALID is then no
        # GPU ordinal ("invalid device ordinal"); modulo the visible count it is right in both setups.
        backend, device = "nccl", torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    print(f"[init] == rank: {rank}, local rank: {local_rank}, world size: {world_size}, "
          f"backend: {backend}, device: {device} ==")

    # 1. the network
    net = build_net(args.arch, in_chans, num_classes)
    if device.type == "cuda":  # SyncBN: batch statistics over the global batch (CUDA only in PyTorch)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device)
    # DistributedDataParallel: copies rank 0's weights to every rank once, then all-reduces
    # (averages) the gradients during backward, so every rank takes the same optimizer step.
    net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)

    # 2. the data loader
    workers = args.workers  # decoding and augmenting images takes worker processes
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

    # 5. one model. DDP keeps the weights equal on all ranks, but BatchNorm's running statistics
    # are each rank's own (unless SyncBN): take rank 0's, so that all ranks evaluate one model.
    for buf in net.module.buffers():
        dist.broadcast(buf, src=0)

    # 6. checkpoint: rank 0 writes it (to a temporary name, then renamed, so that a crash never
    # leaves half a file); the barrier keeps the other ranks from reading before it is complete.
    if rank == 0:
        state = {"epoch": args.epochs, "arch": args.arch, "model": net.module.state_dict(),
                 "optimizer": optimizer.state_dict()}
        torch.save(state, args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    # Every rank loads it onto its own device (without map_location, tensors saved from cuda:0
    # would all land on cuda:0) into a fresh model, and checks it against the model it trained.
    ckpt = torch.load(args.ckpt, map_location=device, weights_only=True)
    model = build_net(args.arch, in_chans, num_classes)  # plain BatchNorm: same keys as SyncBN
    model.load_state_dict(ckpt["model"])
    model = model.to(device)
    own = net.module.state_dict()
    same = all(torch.equal(value, own[key]) for key, value in model.state_dict().items())
    print(f"[ckpt] rank {rank}: loaded {args.ckpt} (epoch {ckpt['epoch']}) on {device}, "
          f"weights {'equal' if same else 'DIFFER from'} this rank's model")
    if not same:
        raise RuntimeError(f"rank {rank}: the checkpoint differs from the trained model")

    # 7. evaluate the loaded model
    correct, total = evaluate(model, valset, device, args.batch_size, rank, world_size, workers)
    if rank == 0:
        print(f"val acc: {100.0 * correct / total:.2f}% (n={total})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
