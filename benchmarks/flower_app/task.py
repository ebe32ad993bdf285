"""The PyTorch half of the Flower app (the `task.py` of Flower's quickstart-pytorch): model, data and the
train/test loops, in plain PyTorch and torchvision, without flwr (tests/test_vs_flower.py imports it).

The work is that of CleanFL's `fedavg.py --model cnn --iid` on the CIFAR-10 image folder: McMahan's CNN,
an IID split into equal parts, SGD with momentum, no augmentation, per-channel normalization. The data
path is the quickstart's: a torch Dataset that turns one stored image into a normalized tensor per
access (the quickstart's per-sample ToTensor + Normalize on Hugging Face images; here torchvision's
ImageFolder on the JPEG files, as the quickstart's dataset cannot be downloaded offline), and a
DataLoader per client over its partition. With in_memory=True (vs_flower.py --flower-data memory) each
process decodes the images once into a uint8 tensor and each access only normalizes one stored tensor, as
CleanFL keeps its data: that variant separates the cost of the framework from that of the data path.
"""

import numpy as np
import torch
import torch.nn as nn

# Per-channel mean and std of the training images of the CIFAR-10 JPEG folder, in [0, 1] pixel units: what
# CleanFL computes from the same folder (common.load_data). JPEG moves them slightly from the well-known
# values of the original (lossless) CIFAR-10 (std 0.2470, 0.2435, 0.2616).
MEAN = (0.4913, 0.4821, 0.4465)
STD = (0.2452, 0.2428, 0.2606)
# CPU only: on a GPU, Flower's actors would need client_resources num_gpus > 0 (Ray hides the GPUs from actors
# that reserve none), which is not either side's default
DEVICE = "cpu"
PARTITION_SEED = 42  # flwr_datasets' IidPartitioner default: shuffle with seed 42, then equal consecutive parts


class Net(nn.Module):
    """McMahan et al. 2017 CNN: conv5x5-32, pool, conv5x5-64, pool, fc 512, head (CleanFL's `cnn`, same layers
    in the same order, so state_dict shapes match one to one; 2,156,490 parameters at 3x32x32, 10 classes)."""

    def __init__(self, in_channels=3, num_classes=10, image_size=32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * (image_size // 4) ** 2, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


_train_set = None  # one training set per process (a Ray actor serves many clients), as the quickstart's `fds`


class Decoded(torch.utils.data.Dataset):
    """An image folder decoded once into uint8 [N, C, H, W]; an access normalizes one image."""

    def __init__(self, folder):
        self.x = torch.stack(
            [torch.from_numpy(np.array(folder.loader(path))).permute(2, 0, 1) for path, _ in folder.samples]
        )
        self.y = torch.tensor(folder.targets)
        self.mean, self.std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.x[i].float() / 255 - self.mean) / self.std, self.y[i]


def image_folder(path, in_memory=False):
    """torchvision's ImageFolder with ToTensor + Normalize (decodes a file per access), or Decoded."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import Compose, Normalize, ToTensor

    if in_memory:
        return Decoded(ImageFolder(path))
    return ImageFolder(path, transform=Compose([ToTensor(), Normalize(MEAN, STD)]))


def load_data(data_dir, partition_id, num_partitions, batch_size, in_memory=False):
    """DataLoader over client `partition_id`'s IID share of data_dir/train (shuffled each epoch)."""
    from torch.utils.data import DataLoader, Subset

    global _train_set
    if _train_set is None:
        _train_set = image_folder(f"{data_dir}/train", in_memory)
    order = np.random.default_rng(PARTITION_SEED).permutation(len(_train_set))
    part = np.array_split(order, num_partitions)[partition_id]
    return DataLoader(Subset(_train_set, part.tolist()), batch_size=batch_size, shuffle=True)


def load_test(data_dir, in_memory=False, batch_size=128):
    """DataLoader over all of data_dir/test (the quickstart's centralized test set, batch 128)."""
    from torch.utils.data import DataLoader

    return DataLoader(image_folder(f"{data_dir}/test", in_memory), batch_size=batch_size)


def train(net, loader, epochs, lr, momentum, device=DEVICE):
    """Local SGD (no weight decay); returns the mean training loss over the batches."""
    net.to(device).train()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    running_loss, steps = 0.0, 0
    for _ in range(epochs):
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            steps += 1
    return running_loss / max(steps, 1)


def test(net, loader, device=DEVICE):
    """Mean cross-entropy and accuracy of net on loader."""
    net.to(device).eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss, correct = 0.0, 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(loader.dataset), correct / len(loader.dataset)
