r"""Starts one training script as several jax.distributed processes on this machine.

    python -m trainer.distributed.launch --num_processes 2 examples/mnist_ensemble.py \
        --config=configs/mnist_ensemble.py --workdir=/tmp/mnist_2x4

Each process runs `python SCRIPT ARGS...` with the environment a cluster
scheduler would give it (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`; see `trainer.distributed.devices`), and its output lines prefixed with
`[process i]`. On a real cluster run the script itself on every host instead,
with those variables set, or with `TRAINER_DISTRIBUTED=auto` where
`jax.distributed.initialize()` detects the cluster (SLURM, Cloud TPU pods).

SIGTERM or SIGINT to the launcher goes to every process (they agree on a step,
save and exit 0). When a process fails, the others cannot go on (they would
wait for it in a collective), so the launcher kills them and exits with the
failed process's status; the latest complete checkpoint stays as it was.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator: str) -> dict[str, str]:
  """The environment of process `process_id`: this one's plus the distributed settings
  that `trainer.distributed.devices.initialize` reads (named there; repeated here so that the
  launcher itself imports no jax)."""
  env = dict(os.environ)
  env.pop("TRAINER_DISTRIBUTED", None)
  env.update({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(num_processes),
              "JAX_PROCESS_ID": str(process_id)})
  return env


def _relay(process_id: int, stream, out) -> None:
  """Copies a process's output to ours, each line prefixed with the process."""
  for line in stream:
    out.write(f"[process {process_id}] {line}")
    out.flush()


def launch(script_and_args: list[str], num_processes: int, port: int = 0) -> int:
  """Runs the processes to the end; returns 0, or the status of the first that failed."""
  coordinator = f"localhost:{port or free_port()}"
  procs, relays = [], []
  for i in range(num_processes):
    p = subprocess.Popen([sys.executable, *script_and_args],
                         env=process_env(i, num_processes, coordinator),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # Signals reach a process only through us.
    procs.append(p)
    relays.append(threading.Thread(target=_relay, args=(i, p.stdout, sys.stdout), daemon=True))
    relays[-1].start()

  def forward(signum, frame):
    del frame
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  status = 0
  try:
    while None in [p.poll() for p in procs]:  # A list: every process is polled.
      failed = [(i, p.returncode) for i, p in enumerate(procs)
                if p.returncode not in (None, 0)]
      if failed:
        i, status = failed[0]
        sys.stdout.write(f"[launch] process {i} exited with status {status}; stopping "
                         f"the other processes, which would wait for it.\n")
        for p in procs:
          if p.poll() is None:
            p.kill()
        break
      time.sleep(0.2)
    for p in procs:
      p.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for t in relays:
    t.join(timeout=10)
  if not status:
    status = next((p.returncode for p in procs if p.returncode), 0)
  return 128 - status if status < 0 else status  # Killed by signal N: 128 + N, as a shell says.


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m trainer.distributed.launch", description=__doc__.split("\n\n")[0],
      usage="python -m trainer.distributed.launch --num_processes N SCRIPT [ARGS...]")
  parser.add_argument("--num_processes", type=int, required=True,
                      help="how many processes to start (each gets its share of the devices)")
  parser.add_argument("--port", type=int, default=0,
                      help="the coordinator's port on localhost (0: a free one)")
  parser.add_argument("script", help="the training script, e.g. examples/mnist_ensemble.py")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own flags")
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    parser.error(f"--num_processes={args.num_processes} must be >= 1.")
  if not os.path.isfile(args.script):
    parser.error(f"script {args.script!r} is not a file.")
  return launch([args.script, *args.args], args.num_processes, args.port)


if __name__ == "__main__":
  sys.exit(main())
