"""Regeneration through the engine: its store equals static batches', with a head it equals AR,
an interrupted run resumes to the same store, and slots split over devices give one device's."""

import jax
import numpy as np
import pytest

from jetflow_jax.decoding import generate
from jetflow_jax.engine import make_engine
from jetflow_jax.errors import InputError
from jetflow_jax.sampling import Greedy
from jetflow_jax.text import stop_end
from jetflow_jax.train.regenerate import job_for, local_mesh, regenerate
from jetflow_jax.train.regenerate_backends import (Job, engine_generator, finish, jax_batches,
                                                   static_generator)
from jetflow_jax.train.store import TokenStore
from test_speculative import target, trained_head  # noqa: F401 (fixtures)

SLOTS = 4
LENGTHS = [3, 5, 17, 9, 11, 13, 15, 7, 20, 4]
MAX_TOKENS = [24, 6, 16, 3, 20, 10, 1, 12, 24, 8]
STOPPED = (2, 4, 8)  # records given a stop string that ends inside their continuation


def decode(ids):
  """Two letters a token, so a stop string can end inside a token."""
  return "".join(chr(65 + t // 26) + chr(97 + t % 26) for t in ids)


def stored(store_dir) -> list[list[int]]:
  store = TokenStore(str(store_dir))
  return [store.tokens(i).tolist() for i in range(store.num_records)]


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(4)
  return [rng.integers(0, 95, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def greedy(target, prompts):
  config, params = target
  return generate(params, config, prompts, max(MAX_TOKENS), stop_tokens=()).tokens


@pytest.fixture(scope="module")
def records(prompts, greedy):
  """Mixed max_tokens; three records stop at a string that their greedy continuation
  completes halfway through its fifth token (or before)."""
  return [dict(id=f"r{i}", prompt_ids=p, max_tokens=m,
               **({"stop": ["zz", decode(greedy[i][3:5])[1:3]]} if i in STOPPED else {}))
          for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


def regenerated(records, store_dir, make_generator) -> list[list[int]]:
  assert regenerate(records, str(store_dir), make_generator, max_new_tokens=max(MAX_TOKENS),
                    max_prompt_len=64) == len(records)
  return stored(store_dir)


@pytest.fixture(scope="module")
def engine_store(target, records, tmp_path_factory):
  config, params = target
  return regenerated(records, tmp_path_factory.mktemp("engine"), lambda: engine_generator(
      params, config, slots=SLOTS, rounds_per_step=2, decode=decode))


def test_stop_strings_end_at_the_token_that_completes_them():
  assert decode([0, 1, 2, 3]) == "AaAbAcAd"
  assert stop_end([0, 1, 2, 3], ["bA"], decode) == 3  # "b" ends token 1, "A" starts token 2
  assert stop_end([0, 1, 2, 3], ["Ad", "bAc"], decode) == 3
  assert stop_end([0, 1, 2, 3], ["x"], decode) is None
  job = Job("j", 0, [5], max_tokens=3, stop=("Ad",))
  assert finish(job, [0, 1, 2, 3], decode) == [0, 1, 2]  # max_tokens first: "Ad" is cut off
  assert finish(Job("j", 0, [5], 4, ("Ac",)), [0, 1, 2, 3], decode) == [0, 1, 2]
  assert job_for({"prompt_ids": [1], "stop": "\n\n"}, 0, None, 9).stop == ("\n\n",)
  with pytest.raises(InputError, match="record 7: max_tokens must be a positive integer"):
    job_for({"prompt_ids": [1], "max_tokens": 0}, 7, None, 9)
  assert job_for({"prompt_ids": [1], "max_tokens": 50}, 7, None, 9).max_tokens == 9
  with pytest.raises(InputError, match="record x: stop must be a string or a list"):
    job_for({"id": "x", "prompt_ids": [1], "stop": [""]}, 0, None, 9)


def test_engine_store_equals_static_batches(target, records, greedy, engine_store, tmp_path):
  config, params = target
  static = regenerated(records, tmp_path, lambda: static_generator(  # one batch: one compile
      jax_batches(params, config, Greedy()), len(records), decode))
  assert engine_store == static

  def kept(tokens, record):  # through the first token whose text holds a stop string
    ends = [n for n in range(1, len(tokens) + 1)
            if any(s in decode(tokens[:n]) for s in record.get("stop", ()))]
    return tokens[:min(ends, default=record["max_tokens"])]

  assert static == [r["prompt_ids"] + kept(g[:r["max_tokens"]], r)
                    for g, r in zip(greedy, records)]
  assert all(len(static[i]) <= LENGTHS[i] + 5 for i in STOPPED)


def test_speculative_regeneration_equals_ar(target, trained_head, records, engine_store,
                                            tmp_path):
  config, params = target
  head, head_params = trained_head
  assert regenerated(records, tmp_path, lambda: engine_generator(
      params, config, head_params, head, method="jetflow", budget=12, slots=SLOTS,
      rounds_per_step=2, decode=decode)) == engine_store


def test_an_interrupted_run_loses_only_the_records_in_flight(target, records, engine_store,
                                                             tmp_path):
  config, params = target
  committed = []

  def interrupted():
    run = engine_generator(params, config, slots=SLOTS, rounds_per_step=2, decode=decode)

    def three_groups(jobs, seed):
      for group in run(jobs, seed):
        yield group
        committed.extend(job.rid for job, _ in group)
        if len(committed) >= 3:
          raise KeyboardInterrupt
    return three_groups

  with pytest.raises(KeyboardInterrupt):
    regenerate(records, str(tmp_path), interrupted, max_new_tokens=max(MAX_TOKENS), max_prompt_len=64)
  ids = (tmp_path / "shard-00000-of-00001" / "ids.txt").read_text().split()
  assert ids == committed and 3 <= len(ids) < len(records)
  assert regenerate(records, str(tmp_path), lambda: engine_generator(
      params, config, slots=SLOTS, rounds_per_step=2, decode=decode), max_new_tokens=max(MAX_TOKENS),
      max_prompt_len=64) == len(records) - len(ids)
  assert stored(tmp_path) == engine_store


def test_slots_split_over_devices_give_one_devices_records(target, records, engine_store,
                                                           tmp_path):
  """pytest's 4 CPU devices: 4 data-parallel copies of the target, 2 slots each."""
  config, params = target
  mesh = local_mesh()
  placed = jax.device_put(params, mesh.param_shardings(config, params))
  assert regenerated(records, tmp_path, lambda: engine_generator(  # slots rounded up
      placed, config, slots=SLOTS + 1, rounds_per_step=2, decode=decode,
      mesh=mesh)) == engine_store
  state = make_engine(placed, config, method="ar", num_slots=8, max_context=32,
                      mesh=mesh).init_state()
  assert state.rows.cache.k[0].sharding.is_equivalent_to(mesh.cache_sharding(config), 4)
  assert state.rows.tokens_bs.sharding.is_equivalent_to(mesh.rows(), 2)
