"""Training data that needs no download: bytes of Python's own sources, and
synthetic images.

Text: ``load_stdlib_corpus`` reads the standard library's ``.py`` files (the
directory ``sysconfig.get_paths()['stdlib']``; ``site-packages`` and caches
left out), in order of their relative paths, as one byte string per split.
Tokens are bytes (vocabulary 256). A file belongs to the validation split
when a SHA-256 hash of its relative path falls in the lowest
`validation_fraction` of the hash range: the split is fixed per file, so no
validation file is ever in the training split, whatever the byte cap. Each
split takes files until its share of `max_bytes` is full (the last one cut
short), so a run reads a few MiB, not the whole library.

Images: ``ImageTask`` draws class-dependent oriented gratings with random
phase, plus noise, for the ViT (``{'x': float32[B, H, W, C], 'y':
int32[B]}``). A class is an orientation and a spatial frequency, which a
patch-based model can learn; the phase, contrast and noise vary per image.

Example:
  >>> corpus = data.load_stdlib_corpus(max_bytes=2 << 20)
  >>> batch = next(corpus.batches("train", batch_size=8, seq_len=128, seed=0))
  >>> batch["x"].shape, batch["y"].shape  # next tokens, as gpt2.make_loss
  ((8, 128), (8, 128))
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np

VOCAB_SIZE = 256
SPLITS = ("train", "validation")
DEFAULT_MAX_BYTES = 4 << 20
DEFAULT_VALIDATION_FRACTION = 0.05
# Not the standard library itself: third-party packages and bytecode.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Between files, so that no window silently joins two unrelated sources
# without a visible boundary.
_FILE_SEPARATOR = b"\n\n"


def _is_validation(relative_path: str, fraction: float) -> bool:
  """Whether a file belongs to the validation split (stable across runs)."""
  digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def _source_files(root: str) -> list[str]:
  """``.py`` files under `root`, relative paths, sorted."""
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
    for name in files:
      if name.endswith(".py"):
        found.append(os.path.relpath(os.path.join(directory, name), root))
  return sorted(found)


def _check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, "
                     f"but got {split!r}")
  return split


def _check_positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, but got {value!r}")
  if value <= 0:
    raise ValueError(f"{name} must be positive, but got {value}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  """Two splits of byte tokens and the files they came from.

  Attributes:
    root: the directory the files were read from.
    train: uint8 bytes of the training files, concatenated.
    validation: uint8 bytes of the validation files, concatenated.
    train_files: relative paths of the training files, in order.
    validation_files: relative paths of the validation files, in order.
  """
  root: str
  train: np.ndarray
  validation: np.ndarray
  train_files: tuple[str, ...]
  validation_files: tuple[str, ...]

  def tokens(self, split: str) -> np.ndarray:
    """The uint8 tokens of `split` ('train' or 'validation')."""
    return getattr(self, _check_split(split))

  def _check_window(self, split: str, batch_size: Any, seq_len: Any
                    ) -> tuple[np.ndarray, int, int]:
    tokens = self.tokens(split)
    batch_size = _check_positive_int("batch_size", batch_size)
    seq_len = _check_positive_int("seq_len", seq_len)
    if seq_len + 1 > tokens.size:
      raise ValueError(
          f"seq_len {seq_len} needs windows of {seq_len + 1} tokens, but the "
          f"{split} split holds only {tokens.size}; use a shorter seq_len or "
          "a larger max_bytes")
    return tokens, batch_size, seq_len

  def batches(self, split: str, batch_size: int, seq_len: int, *,
              seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of random windows of `split`.

    Each batch is ``{'x': int32[batch_size, seq_len], 'y': ...}``, ``y``
    being ``x`` shifted by one token (the format of ``gpt2.make_loss``).
    The same `seed` gives the same sequence of batches.

    Raises:
      ValueError: `split` is unknown, `batch_size` or `seq_len` is not
        positive, or `seq_len` + 1 is longer than the split.
    """
    tokens, batch_size, seq_len = self._check_window(split, batch_size,
                                                     seq_len)
    return self._random_windows(tokens, batch_size, seq_len, seed)

  @staticmethod
  def _random_windows(tokens: np.ndarray, batch_size: int, seq_len: int,
                      seed: int) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    while True:
      starts = rng.integers(0, tokens.size - seq_len, batch_size)
      yield _windows(tokens, starts, seq_len)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int, *,
                   split: str = "validation") -> list[dict[str, np.ndarray]]:
    """A fixed set of batches covering `split` evenly, for evaluation.

    Window starts are spread evenly over the split (no randomness), so every
    call, and every run, evaluates on the same tokens.

    Raises:
      ValueError: as ``batches``, or `num_batches` is not positive.
    """
    tokens, batch_size, seq_len = self._check_window(split, batch_size,
                                                     seq_len)
    num_batches = _check_positive_int("num_batches", num_batches)
    starts = np.linspace(0, tokens.size - seq_len - 1,
                         num_batches * batch_size).astype(np.int64)
    return [_windows(tokens, chunk, seq_len)
            for chunk in starts.reshape(num_batches, batch_size)]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int
             ) -> dict[str, np.ndarray]:
  index = starts[:, None] + np.arange(seq_len + 1)
  window = tokens[index].astype(np.int32)
  return {"x": window[:, :-1], "y": window[:, 1:]}


def load_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, *,
                       validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                       root: str | None = None) -> ByteCorpus:
  """Reads the standard library's sources as byte tokens (see module doc).

  Args:
    max_bytes: bytes read in all; the validation split gets
      `validation_fraction` of them, the training split the rest.
    validation_fraction: share of files (by path hash) and of `max_bytes`
      that go to validation; in (0, 1).
    root: directory to read instead of the standard library's.

  Returns:
    A ``ByteCorpus``; the same arguments give the same bytes.

  Raises:
    ValueError: a bad argument, or too few sources under `root` for a split.
  """
  max_bytes = _check_positive_int("max_bytes", max_bytes)
  if not 0 < validation_fraction < 1:
    raise ValueError(f"validation_fraction must be in (0, 1), but got "
                     f"{validation_fraction!r}")
  root = os.path.abspath(root or sysconfig.get_paths()["stdlib"])
  if not os.path.isdir(root):
    raise ValueError(f"root {root!r} is not a directory")
  return _load(max_bytes, float(validation_fraction), root)


@functools.lru_cache(maxsize=4)
def _load(max_bytes: int, validation_fraction: float, root: str
          ) -> ByteCorpus:
  caps = {"validation": max(1, int(max_bytes * validation_fraction))}
  caps["train"] = max(1, max_bytes - caps["validation"])
  parts = {split: [] for split in SPLITS}
  files = {split: [] for split in SPLITS}
  sizes = dict.fromkeys(SPLITS, 0)
  for path in _source_files(root):
    split = ("validation" if _is_validation(path, validation_fraction)
             else "train")
    room = caps[split] - sizes[split]
    if room <= 0:
      if all(sizes[s] >= caps[s] for s in SPLITS):
        break
      continue
    try:
      with open(os.path.join(root, path), "rb") as f:
        text = f.read(room)
    except OSError:
      continue  # unreadable: the corpus is what can be read
    if not text:
      continue
    text = (text + _FILE_SEPARATOR)[:room]
    parts[split].append(text)
    files[split].append(path)
    sizes[split] += len(text)
  for split in SPLITS:
    if not files[split]:
      raise ValueError(f"no .py sources for the {split} split under {root!r}")
  as_array = lambda chunks: np.frombuffer(b"".join(chunks), np.uint8)
  return ByteCorpus(root=root, train=as_array(parts["train"]),
                    validation=as_array(parts["validation"]),
                    train_files=tuple(files["train"]),
                    validation_files=tuple(files["validation"]))


def decode(tokens: Any) -> str:
  """Byte tokens back to text (invalid UTF-8 shown as replacement marks)."""
  return bytes(np.asarray(tokens, np.uint8).tolist()).decode(
      "utf-8", errors="replace")


# ---------------------------------------------------------------------------
# Images.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageTask:
  """Oriented gratings, one orientation and frequency per class, plus noise.

  Class ``c`` of ``n`` is a sinusoidal grating at angle ``pi * c / n`` with
  ``2 + c % 3`` cycles per image, each channel a slightly shifted copy;
  every image gets a random phase, a random contrast in [0.6, 1] and
  Gaussian noise of standard deviation `noise`.

  Attributes:
    image_size: height and width.
    channels: channels (images are NHWC).
    num_classes: number of classes.
    noise: standard deviation of the added noise.
  """
  image_size: int = 32
  channels: int = 3
  num_classes: int = 10
  noise: float = 0.5

  def __post_init__(self):
    for name in ("image_size", "channels", "num_classes"):
      _check_positive_int(name, getattr(self, name))
    if not self.noise >= 0:
      raise ValueError(f"noise must be >= 0, but got {self.noise!r}")

  @classmethod
  def for_config(cls, config: Any, **overrides: Any) -> ImageTask:
    """The task matching a ``vit.ViTConfig`` (image size, channels, classes)."""
    fields = dict(image_size=config.image_size, channels=config.in_channels,
                  num_classes=config.num_classes)
    return cls(**(fields | overrides))

  def batch(self, batch_size: int, *, seed: int = 0
            ) -> dict[str, np.ndarray]:
    """One batch ``{'x': float32[B, H, W, C], 'y': int32[B]}`` for `seed`."""
    batch_size = _check_positive_int("batch_size", batch_size)
    return self._draw(np.random.default_rng(seed), batch_size)

  def batches(self, batch_size: int, *, seed: int = 0
              ) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches; the same `seed` gives the same sequence."""
    batch_size = _check_positive_int("batch_size", batch_size)
    rng = np.random.default_rng(seed)
    while True:
      yield self._draw(rng, batch_size)

  def _draw(self, rng: np.random.Generator, batch_size: int
            ) -> dict[str, np.ndarray]:
    labels = rng.integers(0, self.num_classes, batch_size).astype(np.int32)
    angle = math.pi * labels / self.num_classes
    cycles = 2.0 + labels % 3
    phase = rng.uniform(0, 2 * math.pi, batch_size)
    contrast = rng.uniform(0.6, 1.0, batch_size)
    grid = np.arange(self.image_size, dtype=np.float64) / self.image_size
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    # Position along each image's grating direction: [B, H, W].
    along = (np.cos(angle)[:, None, None] * xx +
             np.sin(angle)[:, None, None] * yy)
    channel_shift = np.linspace(0, math.pi / 2, self.channels)
    wave = np.sin(2 * math.pi * cycles[:, None, None, None] *
                  along[..., None] + phase[:, None, None, None] +
                  channel_shift)
    images = contrast[:, None, None, None] * wave + self.noise * (
        rng.standard_normal(wave.shape))
    return {"x": images.astype(np.float32), "y": labels}
