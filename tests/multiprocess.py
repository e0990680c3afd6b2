"""Several JAX processes on this machine: a coordinator on a free loopback port, K fake CPU
devices each, output to files, and every child killed when the block ends."""

import contextlib
import os
import socket
import subprocess
import sys
import time

from conftest import CLI_ENV, ROOT


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """`num_processes` copies of `python ARGS` joined into one JAX job."""

  def __init__(self, args, num_processes, devices_per_process, log_dir, name="job"):
    port = free_port()
    env = dict(CLI_ENV, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    self.logs = [os.path.join(log_dir, f"{name}.{p}.log") for p in range(num_processes)]
    self.errs = [os.path.join(log_dir, f"{name}.{p}.err") for p in range(num_processes)]
    self.processes = []
    try:
      for p, (log, err) in enumerate(zip(self.logs, self.errs)):
        with open(log, "w") as out, open(err, "w") as errors:
          self.processes.append(subprocess.Popen(
              [sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}",
               f"--num_processes={num_processes}", f"--process_id={p}"],
              cwd=ROOT, env=env, stdout=out, stderr=errors))
    except BaseException:  # a later start failed: the ones already started must not outlive it
      self.kill()
      raise

  def wait(self, timeout: float) -> list[int]:
    """Every process's exit code; raises if any is still running after `timeout` seconds."""
    deadline = time.time() + timeout
    for p in self.processes:
      p.wait(max(deadline - time.time(), 0.1))
    return [p.returncode for p in self.processes]

  def stdout(self, p: int) -> str:
    with open(self.logs[p]) as f:
      return f.read()

  def output(self, p: int) -> str:
    """Process p's stdout, then its stderr (where XLA's and Gloo's own log lines go, at any
    time: a slow compile under load prints several)."""
    with open(self.errs[p]) as f:
      return self.stdout(p) + f.read()

  def kill(self) -> None:
    for p in self.processes:
      if p.poll() is None:
        p.kill()
        p.wait()


@contextlib.contextmanager
def job(*args, **kwargs):
  """A `Job` whose processes are all dead when the block ends, however it ends."""
  running = Job(*args, **kwargs)
  try:
    yield running
  finally:
    running.kill()


def wait_for(predicate, timeout: float, what: str) -> None:
  deadline = time.time() + timeout
  while not predicate():
    if time.time() > deadline:
      raise TimeoutError(f"gave up waiting for {what} after {timeout} s")
    time.sleep(0.05)
