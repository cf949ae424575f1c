"""Tests of models/data.py: the byte corpus and the image task."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from models import data
from models import gpt2
from models import vit

MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def corpus():
  return data.load_stdlib_corpus(MAX_BYTES)


def spectra(images: np.ndarray) -> np.ndarray:
  """Per image: magnitude of the 2-D spectrum, averaged over channels."""
  power = np.abs(np.fft.fft2(images, axes=(1, 2))).mean(axis=-1)
  return power.reshape(len(images), -1)


class ByteCorpusTest:

  def test_sizes_follow_the_cap(self, corpus):
    validation = int(MAX_BYTES * data.DEFAULT_VALIDATION_FRACTION)
    assert corpus.validation.size == validation
    assert corpus.train.size == MAX_BYTES - validation
    assert corpus.train.dtype == np.uint8
    assert corpus.train_files == tuple(sorted(corpus.train_files))

  def test_split_is_by_file_and_disjoint(self, corpus):
    assert corpus.train_files and corpus.validation_files
    assert not set(corpus.train_files) & set(corpus.validation_files)
    # The split is a property of the file, not of the cap: a bigger cap
    # keeps every file on its side.
    bigger = data.load_stdlib_corpus(2 * MAX_BYTES)
    assert not set(bigger.train_files) & set(corpus.validation_files)
    assert not set(bigger.validation_files) & set(corpus.train_files)
    assert set(corpus.validation_files[:-1]) <= set(bigger.validation_files)

  def test_bytes_are_the_files(self, corpus):
    path = corpus.train_files[0]
    with open(os.path.join(corpus.root, path), "rb") as f:
      head = f.read(200)
    assert corpus.train[:len(head)].tobytes() == head
    assert "site-packages" not in " ".join(corpus.train_files)

  def test_batches_are_deterministic_and_shifted(self, corpus):
    first = corpus.batches("train", batch_size=4, seq_len=32, seed=7)
    second = corpus.batches("train", batch_size=4, seq_len=32, seed=7)
    other = corpus.batches("train", batch_size=4, seq_len=32, seed=8)
    for _ in range(3):
      a, b, c = next(first), next(second), next(other)
      np.testing.assert_array_equal(a["x"], b["x"])
      assert not np.array_equal(a["x"], c["x"])
    assert set(a) == set(gpt2.example_batch(gpt2.tiny()))
    assert a["x"].shape == a["y"].shape == (4, 32)
    assert a["x"].dtype == a["y"].dtype == np.int32
    np.testing.assert_array_equal(a["x"][:, 1:], a["y"][:, :-1])
    assert 0 <= a["x"].min() and a["x"].max() < data.VOCAB_SIZE

  def test_eval_batches_are_fixed_and_from_validation(self, corpus):
    batches = corpus.eval_batches(batch_size=3, seq_len=16, num_batches=2)
    again = corpus.eval_batches(batch_size=3, seq_len=16, num_batches=2)
    assert len(batches) == 2
    for a, b in zip(batches, again):
      np.testing.assert_array_equal(a["x"], b["x"])
    text = corpus.validation.tobytes()
    row = np.concatenate([batches[1]["x"][2], batches[1]["y"][2, -1:]])
    assert bytes(row.astype(np.uint8).tolist()) in text

  def test_a_gpt2_loss_runs_on_a_batch(self, corpus):
    from models import common  # pylint: disable=g-import-not-at-top
    config = gpt2.tiny()
    batch = next(corpus.batches("train", batch_size=2, seq_len=16, seed=0))
    # All-zero weights (no initialisation cost) give uniform logits.
    zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                         common.pure_params(common.abstract_model(config)))
    loss = jax.jit(gpt2.make_loss(config))(zeros, batch)
    np.testing.assert_allclose(loss, np.log(data.VOCAB_SIZE), rtol=1e-6)

  @pytest.mark.parametrize("kwargs, match", [
      (dict(batch_size=0, seq_len=8), "batch_size must be positive"),
      (dict(batch_size=2, seq_len=-1), "seq_len must be positive"),
      (dict(batch_size=2, seq_len=MAX_BYTES), "the validation split holds"),
  ])
  def test_bad_arguments(self, corpus, kwargs, match):
    with pytest.raises(ValueError, match=match):
      corpus.batches("validation", **kwargs)
    with pytest.raises(ValueError, match=match):
      corpus.eval_batches(num_batches=1, **kwargs)

  def test_bad_split_cap_and_count(self, corpus, tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
      corpus.batches("test", batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="num_batches must be positive"):
      corpus.eval_batches(batch_size=1, seq_len=8, num_batches=0)
    with pytest.raises(ValueError, match="max_bytes must be positive"):
      data.load_stdlib_corpus(0)
    with pytest.raises(ValueError, match="validation_fraction must be in"):
      data.load_stdlib_corpus(validation_fraction=1.0)
    with pytest.raises(ValueError, match="no .py sources"):
      data.load_stdlib_corpus(root=str(tmp_path))


class ImageTaskTest:

  def test_matches_the_vit_batch_format(self):
    config = vit.tiny()
    batch = data.ImageTask.for_config(config).batch(5, seed=1)
    example = vit.example_batch(config, batch_size=5)
    assert set(batch) == set(example)
    for key in batch:
      assert batch[key].shape == example[key].shape
      assert batch[key].dtype == example[key].dtype
    assert 0 <= batch["y"].min() and batch["y"].max() < config.num_classes

  def test_deterministic_for_a_seed(self):
    task = data.ImageTask()
    a, b = task.batch(4, seed=3), task.batch(4, seed=3)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert not np.array_equal(a["x"], task.batch(4, seed=4)["x"])
    first, second = task.batches(4, seed=3), task.batches(4, seed=3)
    np.testing.assert_array_equal(next(first)["x"], next(second)["x"])

  def test_classes_are_separable(self):
    # Nearest class mean of the spectra, fitted on one seed and scored on
    # another, is far above chance (1/10): there is structure to learn.
    task = data.ImageTask()
    train, test = task.batch(1000, seed=0), task.batch(300, seed=1)
    features = spectra(train["x"])
    means = np.stack([features[train["y"] == c].mean(0)
                      for c in range(task.num_classes)])
    distances = ((spectra(test["x"])[:, None] - means) ** 2).sum(-1)
    accuracy = np.mean(distances.argmin(1) == test["y"])
    assert accuracy > 0.8

  def test_bad_arguments(self):
    with pytest.raises(ValueError, match="num_classes must be positive"):
      data.ImageTask(num_classes=0)
    with pytest.raises(ValueError, match="noise must be >= 0"):
      data.ImageTask(noise=-1.0)
    with pytest.raises(ValueError, match="batch_size must be positive"):
      data.ImageTask().batch(0)
