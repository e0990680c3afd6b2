"""Many processes: start-up, the process flags, and what one process (or every one) must do.

JAX runs one process per host (or per GPU), each running the same program over one global
mesh. `initialize` must run before anything touches a device:

- `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` start process I of N,
  process 0 serving as the coordinator (all three or none);
- with none of them, on a cluster JAX detects (SLURM, Open MPI, a TPU pod) with more than
  one process, `jax.distributed.initialize()` reads everything from the environment;
- otherwise (one plain host) nothing happens: one process owns every local device.

A process that dies makes the others abort within `--heartbeat_timeout_s` (JAX's coordination
service watches every process), so a job never hangs on a lost peer.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import jax
import numpy as np
from absl import flags

from jetflow_jax.errors import ConfigError, InputError

HEARTBEAT_TIMEOUT_S = 30  # JAX's default (100 s) leaves a survivor waiting ~90 s for a dead peer

_initialized = False


def define_flags() -> None:
  """Defines the process flags (once per interpreter) for an absl command line."""
  if "coordinator_address" in flags.FLAGS:
    return
  flags.DEFINE_string("coordinator_address", None,
                      "HOST:PORT where process 0 serves the coordinator (multi-process runs)")
  flags.DEFINE_integer("num_processes", None, "number of processes in the job")
  flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)")
  flags.DEFINE_integer("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S,
                       "seconds after which the job aborts when a process stops responding")


def initialize_from_flags() -> None:
  f = flags.FLAGS
  initialize(f.coordinator_address, f.num_processes, f.process_id, f.heartbeat_timeout_s)


def check_process_flags(coordinator_address: str | None, num_processes: int | None,
                        process_id: int | None) -> bool:
  """Whether the three flags are given (all of them); raises on a partial or bad set."""
  given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
           "--process_id": process_id}
  named = [name for name, value in given.items() if value is not None]
  if not named:
    return False
  if len(named) < 3:
    missing = [name for name in given if name not in named]
    raise InputError(f"{', '.join(given)} go together: got {', '.join(named)} without "
                     f"{', '.join(missing)}")
  if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", coordinator_address):
    raise InputError(f"--coordinator_address must be HOST:PORT (got {coordinator_address!r})")
  if num_processes < 1:
    raise InputError(f"--num_processes must be >= 1 (got {num_processes})")
  if not 0 <= process_id < num_processes:
    raise InputError(f"--process_id={process_id} is outside [0, {num_processes}) "
                     f"(--num_processes={num_processes})")
  return True


def detected_cluster_processes() -> int:
  """Processes of the cluster job JAX would detect (SLURM, Open MPI, TPU pod); 0 if none."""
  try:  # JAX's own detectors; private, so a JAX without them means "no cluster"
    from jax._src import clusters
    types = clusters.ClusterEnv._cluster_types
  except (ImportError, AttributeError):
    return 0
  for cluster in types:
    if not getattr(cluster, "opt_in_only_method", False) and cluster.is_env_present():
      try:
        return int(cluster.get_process_count())
      except Exception:  # an environment half present (a TPU VM without its metadata)
        return 0
  return 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> None:
  """Starts this process's part of a multi-process job, or nothing on a single plain host."""
  global _initialized
  explicit = check_process_flags(coordinator_address, num_processes, process_id)
  if heartbeat_timeout_s < 1:
    raise InputError(f"--heartbeat_timeout_s must be >= 1 (got {heartbeat_timeout_s})")
  if explicit and num_processes == 1:
    return
  if not explicit and detected_cluster_processes() <= 1:
    return
  # CPU processes exchange collectives over gloo (the CPU default today; said for clarity).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(heartbeat_timeout_seconds=heartbeat_timeout_s)
  if explicit:
    # "deactivate": the flags say it all. Detection would also pin each process to the one GPU
    # of its SLURM_LOCALID, wrong for one process per host.
    kwargs.update(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id, cluster_detection_method="deactivate")
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # a busy port, an unreachable coordinator, a JAX call made too early
    where = coordinator_address or "the cluster's coordinator"
    raise ConfigError(f"cannot join the job through {where}: {str(e).splitlines()[0]}") from None
  _initialized = True
  _native_stdout_to_stderr()


def _native_stdout_to_stderr() -> None:
  """Native code's stdout goes to stderr; Python's `sys.stdout` keeps the real one.

  Gloo prints a line to stdout as each group of devices first connects, from its own threads,
  at any point of what the process prints there: inside a token stream, or before the JSON
  line a caller parses.
  """
  if sys.stdout is not sys.__stdout__:
    return  # already redirected by the caller: theirs to keep
  try:
    if sys.stdout.fileno() != 1:
      return
  except (AttributeError, OSError, ValueError):
    return
  sys.stdout.flush()
  stream = os.dup(1)
  os.dup2(2, 1)
  sys.stdout = open(stream, "w", buffering=1 if sys.stdout.line_buffering else -1,
                    encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def is_initialized() -> bool:
  """Whether this process joined a multi-process job."""
  return _initialized


def is_multiprocess() -> bool:
  return jax.process_count() > 1


def is_main_process() -> bool:
  """Process 0: the one that writes metrics, plots, exports and shared files."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (no-op for one process)."""
  if is_multiprocess():
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def agreed(value: np.ndarray) -> np.ndarray:
  """Process 0's `value` (a NumPy array, the same shape on every process) on every process.

  A host decision taken from a clock (how long a round took, whether to stream now) differs
  between processes; if they then dispatch different programs or different round counts, their
  collectives no longer pair up and the job hangs. Such decisions go through here.
  """
  if not is_multiprocess():
    return value
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def to_host(tree):
  """A pytree of arrays as NumPy arrays: a process-spanning one gathered (the same on every
  process), one on this process's devices alone (a local mesh) read as it is."""
  if not is_multiprocess():
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  def read(x):
    if getattr(x, "is_fully_addressable", True):
      return jax.device_get(x)
    return multihost_utils.process_allgather(x, tiled=True)
  return jax.tree.map(read, tree)


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
  """The rows (axis 0) of a global array that this process's devices hold: one contiguous run."""
  indices = sharding.addressable_devices_indices_map(global_shape).values()
  runs = sorted({(i[0].start or 0, global_shape[0] if i[0].stop is None else i[0].stop)
                 for i in indices})
  starts, stops = np.array(runs).T
  if (starts[1:] != stops[:-1]).any():
    raise ConfigError("this process's devices hold rows of the batch that are not contiguous; "
                      "order the mesh's devices by process")
  return slice(int(starts[0]), int(stops[-1]))


PEER_EXIT_WAIT_S = 20


def exit_now(code: int, wait_for_peers: bool = False) -> None:
  """Exits at once: in a multi-process job, normal exit would wait for the peers at shutdown.

  `wait_for_peers` (an error every process meets, such as a bad config): first wait, at most
  PEER_EXIT_WAIT_S, for the others to stop too, and if they all do, leave the job together
  (JAX's shutdown, which closes the coordinator last). Process 0 holds the coordinator, and a
  peer that loses it first, before or after reaching the same error, aborts (SIGABRT).
  """
  sys.stdout.flush()
  sys.stderr.flush()
  if _initialized:
    if wait_for_peers:
      try:
        from jax._src import distributed as jax_distributed  # the coordinator's own barrier
        jax_distributed.global_state.client.wait_at_barrier("exit", PEER_EXIT_WAIT_S * 1000)
        jax.distributed.shutdown()
      except Exception:  # a peer that never comes (or is gone) only delays this exit
        pass
    os._exit(code)
  sys.exit(code)


class Preemption:
  """Tells the training loop when to stop for a SIGTERM (what SLURM and cloud VMs send).

  One process: a SIGTERM handler notes the request. Several: JAX's preemption service
  (started by `jax.distributed.initialize`) receives the signal on any process and agrees
  on one step for all, so every process saves the same checkpoint and none waits for another.
  `reached(step)` must then be called at every step by every process.
  """

  def __init__(self):
    self._requested = False
    self._previous = None
    # Python can take signals only on its main thread (a loop started elsewhere gets none).
    if not is_multiprocess() and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._note)

  def _note(self, signum, frame):
    del signum, frame
    self._requested = True

  def reached(self, step: int) -> bool:
    if is_multiprocess():
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
