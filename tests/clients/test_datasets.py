"""Datasets and partitions of the plaintext lab, checked against files written here."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from clients.datasets import (DatasetError, digits_arrays, load_cifar10, load_dataset, load_digits_dataset,
                              load_idx_dataset, read_idx)
from clients.partition import dirichlet_split, iid_split, label_bias_split

torch.set_num_threads(1)


def write_idx(path: Path, arr: np.ndarray, compress: bool = False) -> None:
    """IDX as on LeCun's page: 0, 0, type 0x08 (ubyte), ndim, big-endian dims, data."""
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw = header + arr.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


def make_mnist_dir(d: Path, compress: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 12),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 5),
    }
    for name, a in arrays.items():
        write_idx(d / name, a, compress)
    return arrays


def test_digits_is_embedded_and_split_stratified():
    ds = load_digits_dataset()
    assert ds.x_train.shape[1:] == (1, 8, 8) and ds.x_test.shape[1:] == (1, 8, 8)
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    counts = torch.bincount(ds.y_test, minlength=10)
    assert int(counts.min()) >= 40  # every class in proportion (~45 each)
    assert torch.equal(load_digits_dataset().y_test, ds.y_test)  # fixed split


def test_digits_file_equals_scikit_learns_loader_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    images, target = digits_arrays()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    probe = ("import sys; from clients.datasets import load_digits_dataset; load_digits_dataset(); "
             "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files_roundtrip(tmp_path, compress):
    arrays = make_mnist_dir(tmp_path, compress)
    ds = load_idx_dataset(tmp_path, "fmnist")
    assert ds.name == "fmnist" and ds.x_train.shape == (12, 1, 28, 28)
    assert np.allclose(ds.x_train[:, 0].numpy() * 255, arrays["train-images-idx3-ubyte"])
    assert np.array_equal(ds.y_test.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert load_dataset("mnist", tmp_path).x_test.shape == (5, 1, 28, 28)


def test_missing_idx_file_is_named(tmp_path):
    make_mnist_dir(tmp_path, False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetError, match="t10k-labels-idx1-ubyte"):
        load_idx_dataset(tmp_path)
    with pytest.raises(DatasetError, match="data-dir"):
        load_dataset("mnist", None)


def test_idx_rejects_truncated_body(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 9)
    with pytest.raises(DatasetError, match="promises"):
        read_idx(p)


def write_cifar(d: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    rng = np.random.default_rng(2)
    batches = {}
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (3, 3072)).astype(np.uint8)
        labels = rng.integers(0, 10, 3).tolist()
        with (d / name).open("wb") as fh:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, fh, protocol=2)
        batches[name] = (data, labels)
    return batches


def test_cifar_batches_roundtrip(tmp_path):
    sub = tmp_path / "cifar-10-batches-py"
    sub.mkdir()
    batches = write_cifar(sub)
    ds = load_cifar10(tmp_path)  # parent directory is accepted too
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    data, labels = batches["data_batch_2"]
    # row layout: 1024 red, 1024 green, 1024 blue, each 32x32 row-major
    assert np.allclose(ds.x_train[3, 1].numpy() * 255, data[0, 1024:2048].reshape(32, 32))
    assert ds.y_train[3:6].tolist() == labels


def test_cifar_missing_batch_and_hostile_pickle(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(DatasetError, match="data_batch_4"):
        load_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    (tmp_path / "data_batch_4").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DatasetError, match="refusing"):
        load_cifar10(tmp_path)
    assert not (tmp_path / "pwned").exists()


def _check_partition(parts, n):
    allidx = np.concatenate(parts)
    assert np.array_equal(np.sort(allidx), np.arange(n))  # disjoint and complete


def test_iid_and_dirichlet_cover_everything():
    y = np.random.default_rng(0).integers(0, 10, 1000)
    parts = iid_split(y, 7, seed=3)
    _check_partition(parts, 1000)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    dparts = dirichlet_split(y, 7, concentration=0.1, seed=3)
    _check_partition(dparts, 1000)
    # small concentration: clients are skewed (some class dominates a client)
    shares = [np.bincount(y[p], minlength=10).max() / len(p) for p in dparts]
    assert max(shares) > 0.5


def test_label_bias_split_follows_q():
    y = np.repeat(np.arange(10), 2000)
    parts = label_bias_split(y, 20, q=1.0, num_classes=10, seed=0)
    _check_partition(parts, len(y))
    for j, p in enumerate(parts):  # q=1: clients 2l, 2l+1 hold only label l
        assert set(np.unique(y[p])) == {j // 2}
    parts = label_bias_split(y, 20, q=0.5, num_classes=10, seed=0)
    _check_partition(parts, len(y))
    group0 = np.concatenate(parts[0:2])
    frac_home = np.mean(y[group0] == 0)
    # group 0 receives 0.5 of label 0 (1000) and 0.5/9 of each other label (~111 x 9)
    assert abs(frac_home - 1000 / (1000 + 9 * 2000 * 0.5 / 9)) < 0.03


def _bilinear_oracle(img: np.ndarray, side: int) -> np.ndarray:
    """Half-pixel-centred bilinear resampling with edge clamping, written from its definition."""
    h, w = img.shape

    def taps(n_out: int, n_in: int):
        src = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        src = np.clip(src, 0.0, None)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, src - lo

    r0, r1, fr = taps(side, h)
    c0, c1, fc = taps(side, w)
    top = img[r0][:, c0] * (1 - fc) + img[r0][:, c1] * fc
    bottom = img[r1][:, c0] * (1 - fc) + img[r1][:, c1] * fc
    return top * (1 - fr)[:, None] + bottom * fr[:, None]


def test_digits_resized_for_the_cnn_match_bilinear_resampling():
    from lab.experiment import CNN_SIDE, image_side

    ds = load_digits_dataset()
    big = ds.resized(CNN_SIDE)
    assert big.input_shape == (1, 28, 28) and len(big.y_train) == len(ds.y_train)
    assert torch.equal(big.y_test, ds.y_test)
    for k in (0, 7, 500):
        want = np.clip(_bilinear_oracle(ds.x_train[k, 0].double().numpy(), 28), 0, 1)
        np.testing.assert_allclose(big.x_train[k, 0].numpy(), want, atol=1e-6)
    assert float(big.x_train.min()) >= 0.0 and float(big.x_train.max()) <= 1.0
    assert ds.resized(None) is ds and ds.resized(8) is ds
    with pytest.raises(ValueError, match="side"):
        ds.resized(0)
    # the CNNs get 28x28 digits by default; other models and explicit sizes are left as asked
    assert image_side(None, "cnn", ds.input_shape) == 28
    assert image_side(None, "cnn-extra-fc", ds.input_shape) == 28
    assert image_side(None, "mlp", ds.input_shape) is None
    assert image_side(None, "cnn", (1, 28, 28)) is None
    assert image_side(16, "logreg", ds.input_shape) == 16


# --------------------------------------------------------------------------- Debian's Fashion-MNIST

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not FMNIST_DIR.is_dir(),
    reason=f"Fashion-MNIST not installed ({FMNIST_DIR} missing): "
           f"`apt-get install dataset-fashion-mnist` (.ci/run does)")


@needs_fmnist
def test_fmnist_found_without_data_dir():
    ds = load_dataset("fmnist")
    assert ds.name == "fmnist"
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    # Fashion-MNIST is balanced: 6,000 training and 1,000 test images per class
    assert torch.equal(torch.bincount(ds.y_train), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(ds.y_test), torch.full((10,), 1000))
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0


@needs_fmnist
def test_fmnist_system_files_match_an_independent_reader():
    # oracle: the first test image parsed by hand with gzip + numpy, not through read_idx
    raw = gzip.decompress((FMNIST_DIR / "t10k-images-idx3-ubyte.gz").read_bytes())
    assert struct.unpack(">4I", raw[:16]) == (0x803, 10000, 28, 28)
    first = np.frombuffer(raw, dtype=np.uint8, count=784, offset=16).reshape(28, 28)
    ds = load_dataset("fmnist")
    assert np.array_equal(np.rint(ds.x_test[0, 0].numpy() * 255).astype(np.uint8), first)


def test_fmnist_without_package_says_how_to_install(tmp_path, monkeypatch):
    import clients.datasets as datasets
    monkeypatch.setitem(datasets.SYSTEM_DATA_DIRS, "fmnist", tmp_path / "absent")
    with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fmnist")
    # a given --data-dir still wins over the system copy
    make_mnist_dir(tmp_path, compress=True)
    assert load_dataset("fmnist", tmp_path).x_train.shape == (12, 1, 28, 28)


def test_fmnist_default_dir_is_the_system_package(tmp_path, monkeypatch):
    import clients.datasets as datasets
    make_mnist_dir(tmp_path, compress=True)
    monkeypatch.setitem(datasets.SYSTEM_DATA_DIRS, "fmnist", tmp_path)
    assert load_dataset("fmnist").x_train.shape == (12, 1, 28, 28)
    # MNIST has no system package: it still needs --data-dir
    with pytest.raises(DatasetError, match="data-dir"):
        load_dataset("mnist", None)
