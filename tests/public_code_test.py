"""Public training code, verbatim, runs under cxl_offload as under jax.jit.

The train steps below are faithful copies of those in Hugging Face
transformers' Flax examples (examples/flax/language-modeling/run_clm_flax.py,
run_mlm_flax.py and examples/flax/summarization/run_summarization_flax.py):
`labels = batch.pop("labels")` inside the step, `dropout_rng` kept in a
flax TrainState (or passed beside it) and split each step, `optax.adamw`
with a warmup-then-decay schedule and a weight decay mask. Their
`jax.lax.pmean` / `psum` over the pmap axis are left out (one device, under
jax.jit), and the models are tiny Flax modules called as transformers'
`FlaxPreTrainedModel.__call__` is (`**batch, params=, dropout_rng=,
train=`). Each runs 20 steps under jax.jit and under cxl_offload with
update='device', 'host' and 'auto', from the same start.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
from flax import traverse_util
from flax.training import train_state
from flax.training.common_utils import onehot
import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import optax
import pytest

from tests import porting_test

STEPS = 20
BATCH, LENGTH, VOCAB, WIDTH = 4, 8, 32, 16
RTOL, ATOL = 1e-6, 1e-7  # relative, with a floor for values near zero


@pytest.fixture(scope="module")
def pool():
  with jcxl.Pool(host="64MiB", cxl="128MiB", timeout_s=5.0) as p:
    yield p


def assert_close(got, want):
  porting_test.assert_close(got, want, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------ tiny models


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic):
    h = nn.LayerNorm(name="layer_norm")(x)
    h = nn.gelu(nn.Dense(2 * WIDTH, name="fc_in")(h))
    h = nn.Dense(WIDTH, name="fc_out")(h)
    return x + nn.Dropout(0.1)(h, deterministic=deterministic)


class LanguageModel(nn.Module):
  """A tiny causal or masked language model: embeddings, a block that
  mixes positions (a causal or full mean), a head."""
  causal: bool

  @nn.compact
  def __call__(self, input_ids, attention_mask, deterministic=True):
    x = nn.Embed(VOCAB, WIDTH, name="wte")(input_ids)
    x = x * attention_mask[..., None]
    mix = jnp.tril(jnp.ones((LENGTH, LENGTH))) if self.causal else jnp.ones(
        (LENGTH, LENGTH))
    x = x + (mix / mix.sum(-1, keepdims=True)) @ x
    x = Block(name="h_0")(x, deterministic)
    return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


class Seq2Seq(nn.Module):
  """A tiny encoder-decoder: the decoder reads the encoder's mean."""

  @nn.compact
  def __call__(self, input_ids, attention_mask, decoder_input_ids,
               decoder_attention_mask, deterministic=True):
    embed = nn.Embed(VOCAB, WIDTH, name="shared")
    enc = Block(name="encoder")(embed(input_ids), deterministic)
    mask = attention_mask[..., None]
    context = (enc * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True)
    dec = embed(decoder_input_ids) * decoder_attention_mask[..., None]
    dec = Block(name="decoder")(dec + context, deterministic)
    return nn.Dense(VOCAB, name="lm_head")(dec)


class PreTrained:
  """Called as transformers' FlaxPreTrainedModel: the module's inputs by
  name, then `params`, `dropout_rng` and `train`; returns a tuple."""

  def __init__(self, module: nn.Module, inputs: dict[str, jax.Array]):
    self.module = module
    self.params = module.init(jax.random.PRNGKey(0), **inputs)["params"]

  def __call__(self, params=None, dropout_rng=None, train=False, **inputs):
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    return (self.module.apply({"params": params}, **inputs,
                              deterministic=not train, rngs=rngs),)


def lm_batches(seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    ids = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[0, -2:] = 0  # a padded example
    labels = np.where(rng.random((BATCH, LENGTH)) < 0.3, ids, 0)
    out.append({"input_ids": ids, "attention_mask": mask,
                "labels": labels.astype(np.int32)})
  return out


def seq2seq_batches(seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    ids = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    labels = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    decoder_ids = np.concatenate(  # shift_tokens_right
        [np.zeros((BATCH, 1), np.int32), labels[:, :-1]], axis=1)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[1, -3:] = 0
    out.append({"input_ids": ids, "attention_mask": mask,
                "decoder_input_ids": decoder_ids,
                "decoder_attention_mask": mask.copy(), "labels": labels})
  return out


# ------------------------------- from the examples (see the docstring)


class TrainState(train_state.TrainState):
  dropout_rng: jnp.ndarray


def create_learning_rate_fn(
    train_ds_size: int, train_batch_size: int, num_train_epochs: int,
    num_warmup_steps: int, learning_rate: float
) -> Callable[[int], jnp.ndarray]:
  steps_per_epoch = train_ds_size // train_batch_size
  num_train_steps = steps_per_epoch * num_train_epochs
  warmup_fn = optax.linear_schedule(init_value=0.0, end_value=learning_rate,
                                    transition_steps=num_warmup_steps)
  decay_fn = optax.linear_schedule(
      init_value=learning_rate, end_value=0,
      transition_steps=num_train_steps - num_warmup_steps)
  schedule_fn = optax.join_schedules(schedules=[warmup_fn, decay_fn],
                                     boundaries=[num_warmup_steps])
  return schedule_fn


linear_decay_lr_schedule_fn = create_learning_rate_fn(
    STEPS * BATCH, BATCH, 1, 5, 1e-2)


def decay_mask_fn(params):
  flat_params = traverse_util.flatten_dict(params)
  # find out all LayerNorm parameters
  layer_norm_candidates = ["layernorm", "layer_norm", "ln"]
  layer_norm_named_params = {
      layer[-2:]
      for layer_norm_name in layer_norm_candidates
      for layer in flat_params.keys()
      if layer_norm_name in "".join(layer).lower()
  }
  flat_mask = {path: (path[-1] != "bias" and
                      path[-2:] not in layer_norm_named_params)
               for path in flat_params}
  return traverse_util.unflatten_dict(flat_mask)


adamw = optax.adamw(learning_rate=linear_decay_lr_schedule_fn, b1=0.9,
                    b2=0.999, eps=1e-8, weight_decay=0.01,
                    mask=decay_mask_fn)


def clm_loss_fn(logits, labels):
  shift_logits = logits[..., :-1, :]
  shift_labels = labels[..., 1:]
  loss = optax.softmax_cross_entropy(
      shift_logits, onehot(shift_labels, shift_logits.shape[-1]))
  return loss.mean()


# run_clm_flax.py
def clm_train_step(state, batch):
  dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

  def compute_loss(params):
    labels = batch.pop("labels")
    logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng,
                            train=True)[0]
    loss = clm_loss_fn(logits, labels)
    return loss

  grad_fn = jax.value_and_grad(compute_loss)
  loss, grad = grad_fn(state.params)
  new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
  metrics = {"loss": loss,
             "learning_rate": linear_decay_lr_schedule_fn(state.step)}
  return new_state, metrics


# run_mlm_flax.py
def mlm_train_step(state, batch, dropout_rng):
  dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

  def loss_fn(params):
    labels = batch.pop("labels")
    logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng,
                            train=True)[0]
    # compute loss, ignore padded input tokens
    label_mask = jnp.where(labels > 0, 1.0, 0.0)
    loss = optax.softmax_cross_entropy(
        logits, onehot(labels, logits.shape[-1])) * label_mask
    # take average
    loss = loss.sum()
    num_labels = label_mask.sum()
    return loss, num_labels

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, num_labels), grad = grad_fn(state.params)
  loss = jax.tree_util.tree_map(lambda x: x / num_labels, loss)
  grad = jax.tree_util.tree_map(lambda x: x / num_labels, grad)
  new_state = state.apply_gradients(grads=grad)
  metrics = {"loss": loss,
             "learning_rate": linear_decay_lr_schedule_fn(state.step)}
  return new_state, metrics, new_dropout_rng


def summarization_loss_fn(logits, labels, padding_mask,
                          label_smoothing_factor=0.0):
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing_factor
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(
      confidence * jnp.log(confidence) +
      (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  soft_labels = onehot(labels, vocab_size, on_value=confidence,
                       off_value=low_confidence)
  loss = optax.softmax_cross_entropy(logits, soft_labels)
  loss = loss - normalizing_constant
  # ignore padded tokens from loss
  loss = loss * padding_mask
  loss = loss.sum()
  num_labels = padding_mask.sum()
  return loss, num_labels


# run_summarization_flax.py
def summarization_train_step(state, batch, label_smoothing_factor=0.0):
  dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

  def compute_loss(params):
    labels = batch.pop("labels")
    logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng,
                            train=True)[0]
    loss, num_labels = summarization_loss_fn(
        logits, labels, batch["decoder_attention_mask"],
        label_smoothing_factor)
    return loss, num_labels

  grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
  (loss, num_labels), grad = grad_fn(state.params)
  loss = jax.tree_util.tree_map(lambda x: x / num_labels, loss)
  grad = jax.tree_util.tree_map(lambda x: x / num_labels, grad)
  new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
  metrics = {"loss": loss,
             "learning_rate": linear_decay_lr_schedule_fn(state.step)}
  return new_state, metrics


# ------------------------------------------------------------------ tests


def clm_state():
  data = lm_batches()
  model = PreTrained(LanguageModel(causal=True), {
      "input_ids": data[0]["input_ids"],
      "attention_mask": data[0]["attention_mask"]})
  return TrainState.create(apply_fn=model.__call__, params=model.params,
                           tx=adamw, dropout_rng=jax.random.PRNGKey(1)), data


def mlm_state():
  data = lm_batches(seed=1)
  model = PreTrained(LanguageModel(causal=False), {
      "input_ids": data[0]["input_ids"],
      "attention_mask": data[0]["attention_mask"]})
  return train_state.TrainState.create(apply_fn=model.__call__,
                                       params=model.params, tx=adamw), data


def summarization_state():
  data = seq2seq_batches()
  model = PreTrained(Seq2Seq(), {k: v for k, v in data[0].items()
                                 if k != "labels"})
  return TrainState.create(apply_fn=model.__call__, params=model.params,
                           tx=adamw, dropout_rng=jax.random.PRNGKey(1)), data


UPDATES = ["device", "host", "auto"]
EXAMPLES = {
    "run_clm_flax": (clm_state, clm_train_step),
    "run_mlm_flax": (mlm_state, mlm_train_step),
    "run_summarization_flax": (summarization_state,
                               summarization_train_step),
}


def run_steps(state, data, train_step, step):
  """`train_step` (one of the examples') run by `step` (it, jitted or
  offloaded) over `data` from `state`: the final state and every step's
  other results."""
  rng = jax.random.PRNGKey(2)  # run_mlm_flax's, passed beside the state
  results = []
  for batch in data:
    given = dict(batch)
    if train_step is mlm_train_step:
      state, metrics, rng = step(state, given, rng)
      results.append((metrics, rng))
    else:
      state, metrics = step(state, given)
      results.append(metrics)
    assert sorted(given) == sorted(batch)  # the caller's dict, untouched
  return state, results


def run(example, step):
  """`example`'s 20 steps under `step`, from the example's start."""
  make_state, train_step = EXAMPLES[example]
  return run_steps(*make_state(), train_step, step)


_references = {}


def reference(example):
  """The example under plain jax.jit (run once for the three modes)."""
  if example not in _references:
    _references[example] = run(example, jax.jit(EXAMPLES[example][1]))
  return _references[example]


class HuggingFaceExamplesTest:

  @pytest.mark.parametrize("update", UPDATES)
  @pytest.mark.parametrize("example", list(EXAMPLES))
  def test_equals_jit_over_20_steps(self, pool, example, update):
    ref_state, ref_results = reference(example)
    offloaded = jcxl.cxl_offload(EXAMPLES[example][1], update=update)
    placed = {}

    def step(state, *args):
      if "state" not in placed:  # the same start, placed
        placed["state"] = jcxl.place(state, "cxl", pool=pool)
      out = offloaded(placed["state"], *args)
      placed["state"] = out[0]
      return out

    state, results = run(example, step)
    assert_close(results, ref_results)
    # (Each start builds its own model: apply_fn differs by identity.)
    assert_close(state.replace(apply_fn=None),
                 ref_state.replace(apply_fn=None))
    paths = {l.name: l.update for l in offloaded.plan.layers}
    weights = {n: p for n, p in paths.items() if n.startswith("[")}
    if update == "device":
      assert set(paths.values()) == {"device"}, paths
      return
    if update == "host":  # the optimizer's update, for every weight
      assert weights and set(weights.values()) == {"host"}, paths
    for line in offloaded.plan.updates:  # split by the step: no update
      if line.startswith(".dropout_rng:"):
        assert ": device: not an optimizer update" in line, line
