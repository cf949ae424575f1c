"""Hugging Face transformers' own Flax models under cxl_offload, trained by
the examples' train steps.

FlaxGPT2LMHeadModel and FlaxLlamaForCausalLM with run_clm_flax's step and
FlaxBertForMaskedLM with run_mlm_flax's (the verbatim copies in
public_code_test: `batch.pop("labels")`, `dropout_rng` in the state,
adamw with a schedule and a decay mask), from tiny random configs (no
downloads): 20 steps under jax.jit and under cxl_offload with
update='device', 'host' and 'auto', from the same start.

FlaxT5ForConditionalGeneration does not run under this project's jax
(transformers 4.x calls ``jnp.clip(a_max=)``, which jax has dropped), so
run_summarization_flax's step runs on public_code_test's stand-in only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jcxl
import numpy as np
import pytest
import transformers
from flax.training import train_state

from tests import public_code_test as examples

# Of each leaf's largest magnitude. adamw's moments are sums of gradients,
# whose rounding differs between two compiled programs by a few parts in
# 1e7 (1.4e-6 of a LayerNorm scale's first moment, the largest seen).
RTOL, MOMENT_RTOL = 1e-6, 1e-5
# BERT's query biases: one element of 16 ends 20 steps 1.06e-6 of its
# leaf's scale from jax.jit's (25 float32 ulps; update='device' as much as
# 'host', the same element): its gradient is small, and adam's m / sqrt(v)
# brings the two programs' rounding of it up to the size of the step.
PARAM_RTOL = {"FlaxBertForMaskedLM": 2e-6}
E = 16  # width


def gpt2():
  return transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=examples.VOCAB, n_positions=examples.LENGTH, n_embd=E,
      n_layer=2, n_head=2), seed=0)


def llama():
  # Its rotary table keeps max_position_embeddings of 2 x head_dim values:
  # it must be at least 2 x head_dim.
  return transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=examples.VOCAB, hidden_size=E, intermediate_size=2 * E,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
      max_position_embeddings=2 * E), seed=0)


def bert():
  return transformers.FlaxBertForMaskedLM(transformers.BertConfig(
      vocab_size=examples.VOCAB, hidden_size=E, num_hidden_layers=2,
      num_attention_heads=2, intermediate_size=2 * E,
      max_position_embeddings=examples.LENGTH), seed=0)


# An attention key bias adds the same q . b to every score of a query, which
# the softmax takes away: its gradient is zero but for float rounding, and
# adamw turns that noise into steps of the learning rate's size whose signs
# differ between any two compiled programs (jax.jit's own included, given
# another fusion). Those elements are not compared; the test below checks
# that their gradient is noise.
def key_bias_noise(path: str, shape: tuple[int, ...]) -> np.ndarray:
  """Which elements of the leaf at `path` (a parameter, or adamw's moment
  of one) have a gradient that is float noise."""
  mask = np.zeros(shape, bool)
  if path.endswith("['attn']['c_attn']['bias']"):  # GPT-2: q, k, v
    mask[E:2 * E] = True
  elif path.endswith("['self']['key']['bias']"):  # BERT
    mask[...] = True
  return mask


MODELS = {
    "FlaxGPT2LMHeadModel": (gpt2, examples.clm_train_step),
    "FlaxLlamaForCausalLM": (llama, examples.clm_train_step),
    "FlaxBertForMaskedLM": (bert, examples.mlm_train_step),
}


def start(name):
  make, train_step = MODELS[name]
  model = make()
  if train_step is examples.mlm_train_step:
    state = train_state.TrainState.create(
        apply_fn=model.__call__, params=model.params, tx=examples.adamw)
  else:
    state = examples.TrainState.create(
        apply_fn=model.__call__, params=model.params, tx=examples.adamw,
        dropout_rng=jax.random.PRNGKey(1))
  return state, examples.lm_batches(seed=1)


_references = {}


def reference(name):
  if name not in _references:
    train_step = MODELS[name][1]
    _references[name] = examples.run_steps(*start(name), train_step,
                                           jax.jit(train_step))
  return _references[name]


def assert_state_close(got, want, rtol):
  got = jax.tree_util.tree_flatten_with_path(jcxl.gather(got))[0]
  want = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [jax.tree_util.keystr(p) for p, _ in got] == [
      jax.tree_util.keystr(p) for p, _ in want]
  for (path, g), (_, w) in zip(got, want):
    g, w = jnp.asarray(g), jnp.asarray(w)
    if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    g, w = np.asarray(g), np.asarray(w)
    keep = ~key_bias_noise(jax.tree_util.keystr(path), w.shape)
    scale = np.abs(w[keep]).max() if keep.any() else 0.0
    np.testing.assert_allclose(g[keep], w[keep], rtol=0,
                               atol=rtol * max(scale, 1e-30),
                               err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def pool():
  with jcxl.Pool(host="64MiB", cxl="128MiB", timeout_s=5.0) as p:
    yield p


class TransformersTest:

  @pytest.mark.parametrize("update", examples.UPDATES)
  @pytest.mark.parametrize("name", list(MODELS))
  def test_equals_jit_over_20_steps(self, pool, name, update):
    ref_state, ref_results = reference(name)
    train_step = MODELS[name][1]
    offloaded = jcxl.cxl_offload(train_step, update=update)
    placed = {}

    def step(state, *args):
      if "state" not in placed:
        placed["state"] = jcxl.place(state, "cxl", pool=pool)
      out = offloaded(placed["state"], *args)
      placed["state"] = out[0]
      return out

    state, results = examples.run_steps(*start(name), train_step, step)
    examples.assert_close(results, ref_results)  # losses, lr, rng keys
    assert_state_close(state.replace(apply_fn=None, opt_state=None),
                       ref_state.replace(apply_fn=None, opt_state=None),
                       PARAM_RTOL.get(name, RTOL))
    assert_state_close(state.opt_state, ref_state.opt_state, MOMENT_RTOL)
    weights = {l.name: l.update for l in offloaded.plan.layers
               if l.name.startswith("[")}
    if update != "auto":
      assert weights and set(weights.values()) == {update}, weights

  @pytest.mark.parametrize("name", ["FlaxGPT2LMHeadModel",
                                    "FlaxBertForMaskedLM"])
  def test_the_elements_left_out_have_a_noise_gradient(self, name):
    state, data = start(name)
    batch = dict(data[0])
    labels = batch.pop("labels")

    def loss(params):
      logits = state.apply_fn(**batch, params=params, train=False)[0]
      return jnp.mean((logits - jax.nn.one_hot(labels, logits.shape[-1]))
                      ** 2)
    grads = jax.tree_util.tree_flatten_with_path(
        jax.grad(loss)(state.params))[0]
    noise, signal = [], []
    for path, g in grads:
      mask = key_bias_noise(jax.tree_util.keystr(path), g.shape)
      noise += list(np.abs(np.asarray(g)[mask]))
      if mask.any() or jax.tree_util.keystr(path).endswith(
          "['query']['bias']"):
        signal += list(np.abs(np.asarray(g)[~mask]))
    assert noise and signal
    assert max(noise) <= 1e-5 * max(signal), (max(noise), max(signal))
