"""AR decoding: greedy equals transformers.generate; the KV cache equals a full re-forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jetflow_jax
from jetflow_jax.decoding import generate
from jetflow_jax.decoding.loop import CompileCache, memory_maps
from jetflow_jax.model import KVCache, forward, lm_logits
from jetflow_jax.sampling import Greedy, make_sampler

NEW_TOKENS = 32


@pytest.mark.parametrize("case", [dict(), dict(tie_word_embeddings=True, num_key_value_heads=1),
                                  dict(moe=True)], ids=["dense", "tied_gqa4", "moe"])
def test_greedy_equals_transformers_generate(case, make_checkpoint, rng):
  directory, hf_model = make_checkpoint(**case)
  config, params = jetflow_jax.load_qwen3(directory)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (7, 3, 12)]

  result = generate(params, config, prompts, NEW_TOKENS, sampler=Greedy())

  for prompt, tokens in zip(prompts, result.tokens):
    with torch.no_grad():
      expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False)
    assert tokens == expected[0, len(prompt):].tolist()
  assert result.num_forwards == NEW_TOKENS  # prefill + 31 decode steps


def test_cached_forward_equals_full_reforward_at_every_step(make_checkpoint, rng):
  directory, _ = make_checkpoint(moe=True)
  config, params = jetflow_jax.load_qwen3(directory)
  tokens = rng.integers(0, config.vocab_size, (2, 20))
  full = np.asarray(jetflow_jax.qwen3_forward(params, config, tokens))

  @jax.jit
  def cached_logits(tokens_bt, cache, start_b):
    hidden, cache, _ = forward(params, config, tokens_bt, cache=cache, cache_index_b=start_b)
    return lm_logits(params, config, hidden), cache

  prompt = 5
  logits, cache = cached_logits(tokens[:, :prompt], KVCache.zeros(config, 2, 32, jnp.float32),
                                jnp.zeros(2, jnp.int32))
  np.testing.assert_allclose(logits, full[:, :prompt], atol=1e-4)
  for t in range(prompt, tokens.shape[1]):
    logits, cache = cached_logits(tokens[:, t:t + 1], cache, jnp.full(2, t, jnp.int32))
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-4)


def test_generated_tokens_are_argmax_of_full_reforward(make_checkpoint, rng):
  directory, _ = make_checkpoint()
  config, params = jetflow_jax.load_qwen3(directory)
  prompt = rng.integers(0, config.vocab_size, 6).tolist()
  generated = generate(params, config, [prompt], 16).tokens[0]
  sequence = prompt + generated
  logits = np.asarray(jetflow_jax.qwen3_forward(params, config, [sequence]))[0]
  assert generated == logits[len(prompt) - 1:-1].argmax(-1).tolist()


def test_stop_token_ends_a_row_early(make_checkpoint, rng):
  directory, _ = make_checkpoint()
  config, params = jetflow_jax.load_qwen3(directory)
  prompt = rng.integers(0, config.vocab_size, 6).tolist()
  free_run = generate(params, config, [prompt], 12).tokens[0]
  stop = free_run[4]
  stopped = generate(params, config, [prompt], 12, stop_tokens=[stop]).tokens[0]
  assert stopped == free_run[:free_run.index(stop) + 1]


def test_sampling_is_reproducible_for_a_seed(make_checkpoint, rng):
  directory, _ = make_checkpoint()
  config, params = jetflow_jax.load_qwen3(directory)
  prompts = [rng.integers(0, config.vocab_size, 5).tolist()] * 2
  sampler = make_sampler(temperature=1.0, top_k=20, top_p=0.95)
  first = generate(params, config, prompts, 24, sampler=sampler, seed=7).tokens
  again = generate(params, config, prompts, 24, sampler=sampler, seed=7).tokens
  other = generate(params, config, prompts, 24, sampler=sampler, seed=8).tokens
  assert first == again
  assert first != other
  assert first[0] != first[1]  # rows of one batch draw independently


def test_streaming_yields_the_same_tokens(make_checkpoint, rng):
  directory, _ = make_checkpoint()
  config, params = jetflow_jax.load_qwen3(directory)
  prompt = rng.integers(0, config.vocab_size, 5).tolist()
  seen = []
  streamed = generate(params, config, [prompt], 20, on_tokens=lambda t: seen.append(t[0]),
                      stream_every=4)
  assert streamed.tokens == generate(params, config, [prompt], 20).tokens
  # Chunks start at 4 steps and grow while they are quick; every view extends the last one.
  lengths = [len(s) for s in seen]
  assert lengths[:2] == [1, 5] and lengths[-1] == 20 and lengths == sorted(set(lengths))
  assert all(s == seen[-1][:len(s)] for s in seen)


def test_data_parallel_generate_equals_one_device(make_checkpoint, rng):
  """Rows split over a mesh of 4 devices, a copy of the target on each: the same tokens."""
  from jetflow_jax.mesh import DecodeMesh
  directory, _ = make_checkpoint()
  config, params = jetflow_jax.load_qwen3(directory)
  mesh = DecodeMesh.create(data=4)
  copies = jax.device_put(params, mesh.param_shardings(config, params))
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (7, 3, 12, 5)]
  want = generate(params, config, prompts, 10, sampler=Greedy()).tokens
  assert generate(copies, config, prompts, 10, sampler=Greedy(), mesh=mesh).tokens == want
  with pytest.raises(jetflow_jax.InputError, match="3 prompts do not split over the mesh's 4 data-parallel rows"):
    generate(copies, config, prompts[:3], 10, mesh=mesh)


def test_a_crowded_process_lets_go_of_its_executables():
  """Past the share of memory maps it may hold, the compile cache empties (an XLA:CPU
  executable holds hundreds; at vm.max_map_count the next compile would crash), below it keeps."""
  if memory_maps() is None:
    pytest.skip("no /proc: the process's memory maps cannot be counted here")
  cache = CompileCache()
  build = lambda: jax.jit(lambda x: x * 3 + 1).lower(jnp.zeros(257)).compile()
  program = cache.get("program", build)
  cache.warmed.add(id(program))
  assert not cache.release_if_crowded(share=1.0) and "program" in cache.entries
  held = memory_maps()[0]
  del program
  assert cache.release_if_crowded(share=0.0)
  assert cache.entries == {} and cache.warmed == set()
  assert memory_maps()[0] < held  # the executable's code and data are unmapped
  again = cache.get("program", build)
  np.testing.assert_array_equal(np.asarray(again(jnp.ones(257))), np.full(257, 4.0))
