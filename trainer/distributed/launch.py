r"""Starts one training script as several jax.distributed processes on this machine.

    python -m trainer.distributed.launch --num_processes 2 examples/mnist_ensemble.py \
        --config=configs/mnist_ensemble.py --workdir=/tmp/mnist_2x4

Each process runs `python SCRIPT ARGS...` with the environment a cluster
scheduler would give it (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`; see `trainer.distributed.devices`), and its output lines prefixed with
`[process i]`. On a real cluster run the script itself on every host instead,
with those variables set, or with `TRAINER_DISTRIBUTED=auto` where
`jax.distributed.initialize()` detects the cluster (SLURM, Cloud TPU pods).

SIGTERM or a first SIGINT (Ctrl-C) to the launcher goes to every process as SIGTERM
(they agree on a step, save and exit 0); a second SIGINT kills them at once. When a
process fails, the others cannot go on (they would wait for it in a collective), so the
launcher kills them; the latest complete
checkpoint stays as it was. With `--max_restarts N` it then starts all the
processes again, up to N times (torchrun's elastic restarts): the script
resumes from the latest complete checkpoint in its workdir, as a rerun does.
Each restart is logged with the failure that caused it, and the processes
see `TRAINER_RESTART` (0 on the first attempt). Without restarts left it
exits with the failed process's status. A stop the launcher was asked for
(SIGTERM, SIGINT) is never restarted.
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
import uuid


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


#: The environment variable that tells a process which attempt it belongs to (0: the first).
RESTART_ENV = "TRAINER_RESTART"


#: The environment variable that names the launch, the same in all its attempts: a restart
#: takes over the workdir lock its earlier attempt left (`trainer.run.lock`).
LAUNCH_ENV = "TRAINER_LAUNCH_ID"


def process_env(process_id: int, num_processes: int, coordinator: str,
                restart: int = 0, launch_id: str = "") -> dict[str, str]:
  """The environment of process `process_id`: this one's plus the distributed settings
  that `trainer.distributed.devices.initialize` reads (named there; repeated here so that the
  launcher itself imports no jax), the attempt (`TRAINER_RESTART`) and the launch
  (`TRAINER_LAUNCH_ID`)."""
  env = dict(os.environ)
  env.pop("TRAINER_DISTRIBUTED", None)
  env.update({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(num_processes),
              "JAX_PROCESS_ID": str(process_id), RESTART_ENV: str(restart)})
  if launch_id:
    env[LAUNCH_ENV] = launch_id
  return env


def _relay(process_id: int, stream, out) -> None:
  """Copies a process's output to ours, each line prefixed with the process."""
  for line in stream:
    out.write(f"[process {process_id}] {line}")
    out.flush()


def _say(message: str) -> None:
  sys.stdout.write(f"[launch] {message}\n")
  sys.stdout.flush()


def _attempt(script_and_args: list[str], num_processes: int, port: int, restart: int,
             stop: threading.Event, launch_id: str) -> tuple[int, int | None]:
  """Runs the processes once: `(status, failed process)`; status 0 when all exited 0."""
  coordinator = f"localhost:{port or free_port()}"
  procs, relays = [], []
  for i in range(num_processes):
    p = subprocess.Popen([sys.executable, *script_and_args],
                         env=process_env(i, num_processes, coordinator, restart, launch_id),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # Signals reach a process only through us.
    procs.append(p)
    relays.append(threading.Thread(target=_relay, args=(i, p.stdout, sys.stdout), daemon=True))
    relays[-1].start()

  interrupts = []

  def forward(signum, frame):
    del frame
    stop.set()
    if signum == signal.SIGINT:
      interrupts.append(signum)
    # jax's preemption service agrees on a step for SIGTERM only; a second Ctrl-C: at once.
    sent = signal.SIGKILL if len(interrupts) > 1 else signal.SIGTERM
    for p in procs:
      if p.poll() is None:
        p.send_signal(sent)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  status, failed_process = 0, None
  try:
    while None in [p.poll() for p in procs]:  # A list: every process is polled.
      failed = [(i, p.returncode) for i, p in enumerate(procs)
                if p.returncode not in (None, 0)]
      if failed:
        failed_process, status = failed[0]
        _say(f"process {failed_process} exited with status {status}; stopping the other "
             f"processes, which would wait for it.")
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
    failed_process, status = next(((i, p.returncode) for i, p in enumerate(procs)
                                   if p.returncode), (None, 0))
  return status, failed_process


def launch(script_and_args: list[str], num_processes: int, port: int = 0,
           max_restarts: int = 0) -> int:
  """Runs the processes to the end, starting them all again after a failure up to
  `max_restarts` times; returns 0, or the status of the last failure."""
  stop = threading.Event()
  launch_id = uuid.uuid4().hex
  for restart in range(max_restarts + 1):
    status, failed = _attempt(script_and_args, num_processes, port, restart, stop, launch_id)
    if not status or stop.is_set():
      break
    if restart == max_restarts:
      if max_restarts:
        _say(f"process {failed} failed with status {status} and no restarts are left "
             f"({max_restarts} used); giving up.")
      break
    _say(f"restart {restart + 1} of {max_restarts}: process {failed} failed with status "
         f"{status}; starting all {num_processes} processes again from the latest complete "
         f"checkpoint.")
  return 128 - status if status < 0 else status  # Killed by signal N: 128 + N, as a shell says.


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m trainer.distributed.launch", description=__doc__.split("\n\n")[0],
      usage="python -m trainer.distributed.launch --num_processes N [--max_restarts R] SCRIPT "
          "[ARGS...]")
  parser.add_argument("--num_processes", type=int, required=True,
                      help="how many processes to start (each gets its share of the devices)")
  parser.add_argument("--port", type=int, default=0,
                      help="the coordinator's port on localhost (0: a free one)")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="start all processes again this many times at most when one fails; "
                           "the script resumes from its latest complete checkpoint")
  parser.add_argument("script", help="the training script, e.g. examples/mnist_ensemble.py")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own flags")
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    parser.error(f"--num_processes={args.num_processes} must be >= 1.")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts={args.max_restarts} must be >= 0.")
  if not os.path.isfile(args.script):
    parser.error(f"script {args.script!r} is not a file.")
  return launch([args.script, *args.args], args.num_processes, args.port, args.max_restarts)


if __name__ == "__main__":
  sys.exit(main())
