"""Datasets for the plaintext FL lab: an embedded default and loaders for local files.

Why this shape: the lab must run anywhere without a network (docs/design.md 5), so the default
is scikit-learn's handwritten digits, which ships inside the scikit-learn wheel. MNIST,
Fashion-MNIST and CIFAR-10 are read from a directory the user names, in their original
distribution formats (IDX files, CIFAR-10 "python version" pickles). Nothing downloads.

Fashion-MNIST is also packaged by Debian (``apt-get install dataset-fashion-mnist``: the full
60,000 + 10,000 images as gzipped IDX files under ``/usr/share/datasets/fashion-mnist``), so
``fmnist`` falls back to that directory when no ``data_dir`` is given: the paper's real-data
experiment then needs no manual download. MNIST and CIFAR-10 have no such package here and keep
reading the files a user gives.

Every loader returns a :class:`Dataset` with images as float32 tensors of shape
(N, C, H, W) scaled to [0, 1] and int64 labels, so models and attacks (the backdoor
trigger) see one layout.
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "Dataset",
    "DatasetError",
    "DATASET_NAMES",
    "SYSTEM_DATA_DIRS",
    "default_data_dir",
    "load_dataset",
    "load_digits_dataset",
    "load_idx_dataset",
    "load_cifar10",
    "read_idx",
]

DATASET_NAMES = ("digits", "mnist", "fmnist", "cifar10")


class DatasetError(FileNotFoundError):
    """A dataset directory is incomplete or a file is malformed (message names the file)."""


@dataclass(frozen=True)
class Dataset:
    """Train/test images (N, C, H, W) in [0, 1] and int64 labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)

    def subset_train(self, limit: int | None, seed: int = 0) -> Dataset:
        """A seeded uniform random subset of the training split (for quick runs)."""
        if limit is None or limit >= len(self.y_train):
            return self
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(self.y_train), generator=g)[:limit].sort().values
        return Dataset(self.name, self.x_train[idx], self.y_train[idx], self.x_test,
                       self.y_test, self.num_classes)

    def resized(self, side: int | None) -> Dataset:
        """Both splits brought to ``side`` x ``side`` pixels by bilinear interpolation.

        Why: the paper's CNN takes 28x28 inputs (two 5x5 convolutions and two 2x2 poolings
        leave nothing of an 8x8 digit), so the embedded digits are enlarged to its input size.
        Bilinear keeps strokes continuous; values stay in [0, 1] (clamped against overshoot).
        ``None`` or the current size returns the dataset unchanged.
        """
        if side is None:
            return self
        if side < 1:
            raise ValueError(f"image side must be >= 1, got {side}")
        _c, h, w = self.input_shape
        if (h, w) == (side, side):
            return self

        def scale(x: torch.Tensor) -> torch.Tensor:
            if len(x) == 0:
                return x.new_zeros((0, x.shape[1], side, side))
            out = torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear",
                                                  align_corners=False)
            return out.clamp_(0.0, 1.0)

        return Dataset(self.name, scale(self.x_train), self.y_train, scale(self.x_test),
                       self.y_test, self.num_classes)

    def subset_test(self, limit: int | None, seed: int = 0) -> Dataset:
        """A seeded uniform random subset of the test split."""
        if limit is None or limit >= len(self.y_test):
            return self
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randperm(len(self.y_test), generator=g)[:limit].sort().values
        return Dataset(self.name, self.x_train, self.y_train, self.x_test[idx],
                       self.y_test[idx], self.num_classes)


# --------------------------------------------------------------------------- digits

def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' images (1797 x 8 x 8, grey levels 0..16) and labels, read from the CSV file
    that scikit-learn ships (64 pixel columns, then the label).

    Why not ``sklearn.datasets.load_digits``: importing scikit-learn costs about 1.7 s of CPU
    (scipy behind it, measured), paid by every process that loads the digits: each simulated
    client process, each party of a secure lab run. The file is found without importing the
    package; where it is not there, scikit-learn's loader is used."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2)
            return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits  # noqa: PLC0415 - the file moved: the library's loader

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def load_digits_dataset(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 digits (1797 images, 16 grey levels), split with a fixed seed.

    The split is stratified by label so that the small test set (450 images) has every
    class in proportion; a test error rate then moves in steps of 1/450.
    """
    images, target = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    rng = np.random.default_rng(seed)
    test_idx: list[int] = []
    for label in range(10):
        members = np.flatnonzero(target == label)
        rng.shuffle(members)
        test_idx.extend(members[: round(test_fraction * len(members))].tolist())
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test_idx] = True
    tm = torch.from_numpy(test_mask)
    return Dataset("digits", x[~tm], y[~tm], x[tm], y[tm], 10)


# --------------------------------------------------------------------------- IDX (MNIST)

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (optionally gzip-compressed) into a numpy array.

    Format (LeCun's MNIST page): two zero bytes, a type byte, a dimension-count byte,
    then one big-endian uint32 per dimension, then the data in C order.
    """
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path}: not an IDX file (bad magic number)")
    dtype = _IDX_DTYPES.get(raw[2])
    if dtype is None:
        raise DatasetError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if len(raw) - header != count * dtype.itemsize:
        raise DatasetError(
            f"{path}: IDX body has {len(raw) - header} bytes, header promises "
            f"{count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _find_file(directory: Path, name: str, what: str) -> Path:
    """Locate ``name`` or ``name.gz`` in ``directory``; the error names what is missing."""
    for candidate in (name, name + ".gz", name.replace("-idx", ".idx"),
                      name.replace("-idx", ".idx") + ".gz"):
        p = directory / candidate
        if p.is_file():
            return p
    raise DatasetError(
        f"{what}: missing file {name} (or {name}.gz) in {directory}. "
        f"Nothing is downloaded; put the original distribution files there."
    )


def load_idx_dataset(directory: str | Path, name: str = "mnist") -> Dataset:
    """MNIST or Fashion-MNIST from the four original IDX files in ``directory``.

    Both datasets use the same file names, so ``name`` only labels the result.
    """
    d = Path(directory)
    if not d.is_dir():
        raise DatasetError(f"{name}: data directory {d} does not exist")
    arrays = {key: read_idx(_find_file(d, fname, name)) for key, fname in _IDX_FILES.items()}
    for split in ("train", "test"):
        xs, ys = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if xs.ndim != 3 or ys.ndim != 1 or len(xs) != len(ys):
            raise DatasetError(
                f"{name}: {split} images {xs.shape} and labels {ys.shape} do not match"
            )
    def images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    return Dataset(name, images(arrays["x_train"]), labels(arrays["y_train"]),
                   images(arrays["x_test"]), labels(arrays["y_test"]), 10)


# --------------------------------------------------------------------------- CIFAR-10

class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays, so a hostile file cannot run code.

    The CIFAR-10 batches are Python pickles; ``pickle.load`` on a file from an arbitrary
    directory would execute whatever callables the file names. We allow only the
    constructors a pickled ndarray needs.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as fh:
        try:
            obj = _NumpyOnlyUnpickler(fh, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise DatasetError(f"{path}: not a CIFAR-10 python batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: expected a dict, found {type(obj).__name__}")
    data = obj.get(b"data", obj.get("data"))
    labels = obj.get(b"labels", obj.get("labels"))
    if data is None or labels is None:
        raise DatasetError(f"{path}: missing 'data' or 'labels' entry")
    data = np.asarray(data, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DatasetError(f"{path}: data shape {data.shape} is not (N, 3072) with N labels")
    return data, labels


def load_cifar10(directory: str | Path) -> Dataset:
    """CIFAR-10 from the python batches (data_batch_1..5, test_batch).

    Accepts either the directory holding the batches or its parent containing
    ``cifar-10-batches-py``. Rows are 1024 red, 1024 green, 1024 blue bytes (32x32, row-major).
    """
    d = Path(directory)
    if (d / "cifar-10-batches-py").is_dir():
        d = d / "cifar-10-batches-py"
    if not d.is_dir():
        raise DatasetError(f"cifar10: data directory {d} does not exist")
    names = [f"data_batch_{k}" for k in range(1, 6)]
    for n in [*names, "test_batch"]:
        if not (d / n).is_file():
            raise DatasetError(
                f"cifar10: missing file {n} in {d}. Nothing is downloaded; put the "
                f"CIFAR-10 python batches there."
            )
    train = [_load_cifar_batch(d / n) for n in names]
    xs = np.concatenate([t[0] for t in train])
    ys = np.concatenate([t[1] for t in train])
    xt, yt = _load_cifar_batch(d / "test_batch")

    def images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)

    return Dataset("cifar10", images(xs), torch.from_numpy(ys), images(xt),
                   torch.from_numpy(yt), 10)


# --------------------------------------------------------------------------- dispatch

#: Datasets a system package installs, and where (Debian's ``dataset-fashion-mnist``). A
#: module-level mapping so tests can point it at a directory of their own.
SYSTEM_DATA_DIRS: dict[str, Path] = {"fmnist": Path("/usr/share/datasets/fashion-mnist")}
_SYSTEM_PACKAGES = {"fmnist": "dataset-fashion-mnist"}


def default_data_dir(name: str) -> Path | None:
    """The system package's directory for ``name`` if the package is installed, else None."""
    d = SYSTEM_DATA_DIRS.get(name)
    return d if d is not None and d.is_dir() else None


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Load ``name`` (one of DATASET_NAMES); file-based datasets need ``data_dir``, except
    ``fmnist``, which defaults to the Debian package's directory (:data:`SYSTEM_DATA_DIRS`)."""
    if name == "digits":
        return load_digits_dataset()
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if data_dir is None:
        data_dir = default_data_dir(name)
    if data_dir is None:
        if name in _SYSTEM_PACKAGES:
            raise DatasetError(
                f"{name}: no --data-dir given and {SYSTEM_DATA_DIRS[name]} does not exist; install "
                f"it with `apt-get install {_SYSTEM_PACKAGES[name]}` or pass --data-dir "
                f"(nothing is downloaded)")
        raise DatasetError(f"{name}: --data-dir is required (nothing is downloaded)")
    if name in ("mnist", "fmnist"):
        return load_idx_dataset(data_dir, name)
    return load_cifar10(data_dir)
