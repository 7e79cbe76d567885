r"""One command for a lent GPU: the benchmarks whose meaning is an accelerator's, one results file.

    python benchmarks/gpu.py [--out /tmp/gpu_results.md] [--budget 470] [--only mfu,moe]
    python benchmarks/gpu.py --size smoke      # what a CPU runs (the default there)

Each stage is one of the project's benchmark scripts, run as a subprocess at the
size that stage means on one GPU (`--size gpu`, the default when jax's default
backend is a GPU) or at a smoke size that checks the command end to end in
seconds (`--size smoke`, the default elsewhere):

- `attention` (first): the LM's step on one long sequence (`long_context.py` with no
  context axis), its temporaries and time at 1K, 4K and 8K tokens, one device, in
  bfloat16: plain attention against the blockwise method in XLA (`blockwise:xla`) and as
  cuDNN's fused kernel (`blockwise:cudnn`, `config.attention.implementation`; where
  cuDNN cannot take the call, that row says why);
- `attention_wide`: the same three at 8K tokens with heads 64 wide (`--head-dim 64`);
- `mfu`: the transformer LM's tokens/s, TFLOP/s and MFU at two sizes
  (`lm_mfu.py`, 27M and 740M parameters, bfloat16) beside a bare matmul;
- `steps_per_call`: `fit` with k steps per call, host and device data, against
  a hand-written `lax.scan` loop (`steps_per_call.py`);
- `sweep`: 8 learning rates as one ensemble program against 8 separate runs
  (`sweep_vs_runs.py`);
- `moe`: grouped `ragged_dot` experts against the one-hot einsum dispatch and the
  dense model (`moe.py`);
- `generation`: the key/value-cache decoder against recomputing the window for every
  token, a GPT-2 of 12 x 768 (`generation.py`);
- `preference`: a DPO step against a fine-tuning step on the same tokens, and each
  reference's cost (a frozen copy, precomputed log-probs, SimPO's none, LoRA's adapters
  off), a GPT-2 of 12 x 768 (`preference.py`);
- `ensemble`: 4 members on one device, looped against `vmap`ped, against 4
  single-model steps (`ensemble_step_time.py --groups 4on1`);
- `rl`: an RL step's time split into rollout, rewards, log-probs and update, and its
  rollout's tokens/s against `Generator` alone and a generate-then-train loop over two
  states, a GPT-2 of 12 x 768 (`rl.py`);
- `rl_tools`: multi-turn rollouts of 4 tool turns continued from the cache against the
  prefix run again at each turn, and a multi-turn step's parts, a GPT-2 of 12 x 768
  (`rl_tools.py`);
- `distill`: an on-policy distillation step's parts (the student's sampling, the teacher's
  forward, the update) against an SFT step on the same tokens, a GPT-2 of 12 x 768 taught
  by one of 24 x 1024, and the teacher's bytes in float32, int8 and NF4 (`distill.py`).

The parent process never starts jax on the accelerator (a probe subprocess names
the device), so each stage has the whole GPU. Stages run in order; one that
would start with less than a minute of `--budget` left is skipped, and each is
stopped at what is left. The results file (Markdown) is rewritten after every
stage: the device, the versions, and each stage's command, status, wall time
and output, so a run cut short still leaves what it measured. It goes to `--out`, by
default `gpu_results.md` in the system's temporary directory (never the working tree).
The exit status is 0 when every stage ran to the end, 1 when one failed, and 2 when
none failed but one was stopped at the budget or skipped: a partial run is not a
success.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")

#: name -> {size -> the script's arguments}. The first item is the script.
STAGES = {
    # First: the one stage whose kernel (cuDNN's fused attention) has not yet run here.
    "attention": {
        "gpu": ["long_context.py", "--seqs", "1024,4096,8192", "--contexts", "", "--attention",
                "plain,blockwise:xla,blockwise:cudnn", "--compute-dtype", "bfloat16",
                "--rounds", "3"],
        "smoke": ["long_context.py", "--seqs", "32", "--contexts", "", "--attention",
                  "plain,blockwise:xla,blockwise:cudnn", "--block-size", "8", "--rounds", "1",
                  "--block-seconds", "0.01"],
    },
    # The same rows at 8K tokens with heads 64 wide, a width models use (cuDNN's kernels are
    # tuned for such widths; the stage above keeps the LM's 8 for comparison with earlier runs).
    "attention_wide": {
        "gpu": ["long_context.py", "--seqs", "8192", "--contexts", "", "--attention",
                "plain,blockwise:xla,blockwise:cudnn", "--compute-dtype", "bfloat16",
                "--head-dim", "64", "--rounds", "3"],
        "smoke": ["long_context.py", "--seqs", "32", "--contexts", "", "--attention",
                  "plain,blockwise:xla,blockwise:cudnn", "--block-size", "8", "--head-dim",
                  "16", "--rounds", "1", "--block-seconds", "0.01"],
    },
    "mfu": {
        "gpu": ["lm_mfu.py", "--sizes", "gpu,gpu_large", "--steps", "10", "--repeats", "3"],
        "smoke": ["lm_mfu.py", "--sizes", "cpu", "--layers", "1", "--batch", "2", "--steps",
                  "1", "--repeats", "1", "--matmul", "256"],
    },
    "steps_per_call": {
        "gpu": ["steps_per_call.py", "--ks", "1,8,64", "--steps", "256", "--repeats", "1"],
        "smoke": ["steps_per_call.py", "--ks", "1,2", "--models", "one", "--steps", "2",
                  "--repeats", "1", "--batch", "8"],
    },
    "sweep": {
        "gpu": ["sweep_vs_runs.py", "--members", "8", "--steps", "100", "--batch", "128"],
        # tests/doc_commands.py runs sweep_vs_runs.py's documented command at this size too.
        "smoke": ["sweep_vs_runs.py", "--members", "2", "--steps", "3", "--batch", "16",
                  "--devices", "2"],
    },
    "moe": {
        "gpu": ["moe.py", "--experts", "8,32", "--seq", "1024", "--batch", "16", "--embed",
                "512", "--expert-width", "1024", "--rounds", "2", "--block-seconds", "0.5"],
        "smoke": ["moe.py", "--experts", "4", "--seq", "16", "--batch", "2", "--embed", "16",
                  "--expert-width", "16", "--rounds", "1", "--block-seconds", "0.01"],
    },
    "generation": {
        "gpu": ["generation.py", "--family", "gpt2", "--layers", "12", "--embed", "768",
                "--vocab", "32000", "--batch", "16", "--prompt", "128", "--new", "32,256",
                "--repeats", "2"],
        "smoke": ["generation.py", "--new", "4", "--batch", "2", "--prompt", "8", "--layers",
                  "1", "--embed", "64", "--vocab", "64", "--repeats", "1"],
    },
    "preference": {  # A DPO step against a fine-tuning step, and each reference's cost.
        "gpu": ["preference.py", "--layers", "12", "--embed", "768", "--vocab", "32000",
                "--seq", "512", "--pairs", "16", "--devices", "1", "--compute-dtype",
                "bfloat16", "--steps", "10", "--repeats", "2"],
        "smoke": ["preference.py", "--layers", "1", "--embed", "64", "--vocab", "64", "--seq",
                  "32", "--pairs", "4", "--steps", "2", "--repeats", "1", "--devices", "2"],
    },
    "ensemble": {
        "gpu": ["ensemble_step_time.py", "--groups", "4on1", "--steps", "50"],
        "smoke": ["ensemble_step_time.py", "--groups", "4on1", "--steps", "2", "--batch", "4",
                  "--repeats", "1"],
    },
    "rl": {  # An RL step's parts; its rollout against Generator alone and a two-state loop.
        "gpu": ["rl.py", "--layers", "12", "--embed", "768", "--vocab", "32000", "--prompts",
                "8", "--group", "8", "--prompt-len", "128", "--new", "256", "--devices", "1",
                "--compute-dtype", "bfloat16", "--steps", "2", "--repeats", "2"],
        "smoke": ["rl.py", "--layers", "1", "--embed", "64", "--vocab", "64", "--prompts", "2",
                  "--group", "2", "--prompt-len", "8", "--new", "4", "--steps", "1",
                  "--repeats", "1", "--devices", "2"],
    },
    "distill": {  # A distillation step's parts against an SFT step; the teacher's bytes.
        "gpu": ["distill.py", "--workdir", os.path.join(tempfile.gettempdir(), "distill_gpu"),
                "--steps", "0", "--timing-steps", "5", "--student-layers", "12",
                "--student-embed", "768", "--teacher-layers", "24", "--teacher-embed", "1024",
                "--teacher-steps", "20", "--devices", "1", "--compute-dtype", "bfloat16"],
        "smoke": ["distill.py", "--workdir", os.path.join(tempfile.gettempdir(),
                                                          "distill_smoke"),
                  "--steps", "0", "--timing-steps", "1", "--teacher-steps", "2"],
    },
    "shared_lora": {  # 16 adapters over one base against stacked bases and 16 runs.
        "gpu": ["shared_lora.py", "--devices", "1", "--layers", "12", "--embed", "768",
                "--vocab", "32000", "--seq", "512", "--batch", "8", "--bytes-members",
                "1,8,16,64", "--memory-gib", "80", "--max-members", "256",
                "--timing-members", "16", "--steps", "5", "--compute-dtype", "bfloat16"],
        "smoke": ["shared_lora.py", "--devices", "2", "--layers", "1", "--embed", "64",
                  "--vocab", "64", "--seq", "16", "--batch", "4", "--bytes-members", "2",
                  "--memory-gib", "0.01", "--max-members", "8", "--timing-members", "2",
                  "--steps", "1"],
    },
    "rl_tools": {  # Tool turns from the cache against the prefix run again; a step's parts.
        "gpu": ["rl_tools.py", "--layers", "12", "--embed", "768", "--prompts", "8", "--group",
                "8", "--turns", "4", "--compute-dtype", "bfloat16", "--steps", "2",
                "--repeats", "2"],
        "smoke": ["rl_tools.py", "--layers", "1", "--embed", "64", "--prompts", "2", "--group",
                  "2", "--turns", "2", "--steps", "1", "--repeats", "1"],
    },
}

PROBE = ("import json, jax, flax, optax; d = jax.devices()[0]; print(json.dumps(dict("
         "backend=jax.default_backend(), kind=d.device_kind, count=len(jax.devices()), "
         "jax=jax.__version__, flax=flax.__version__, optax=optax.__version__)))")


def _env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
  env["PYTHONUNBUFFERED"] = "1"
  return env


def probe() -> dict:
  """The default backend, its first device and the versions, from a subprocess."""
  done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                        env=_env(), timeout=300, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def write(path: str, device: dict, size: str, results: list) -> None:
  lines = [f"# GPU benchmarks: {device['kind']} ({device['backend']}, "
           f"{device['count']} device{'s' * (device['count'] > 1)})", "",
           f"jax {device['jax']}, flax {device['flax']}, optax {device['optax']}; size "
           f"`{size}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
  for r in results:
    lines += [f"## {r['stage']}: {r['status']} ({r['seconds']:.0f} s)", "",
              "```", "python benchmarks/" + " ".join(
                  repr(a) if not a or " " in a else a for a in r["argv"]),
              "```", "", "```", r["output"].rstrip(), "```", ""]
  with open(path, "w") as f:
    f.write("\n".join(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "gpu_results.md"),
                      help="the results file (Markdown); default: in the temporary directory")
  parser.add_argument("--size", choices=("gpu", "smoke"), default=None,
                      help="default: gpu where jax's default backend is a GPU, else smoke")
  parser.add_argument("--only", default=",".join(STAGES),
                      help=f"stages to run, comma-separated, of {','.join(STAGES)}")
  parser.add_argument("--budget", type=float, default=470.0,
                      help="seconds for all stages; a stage is stopped at what is left")
  args = parser.parse_args()
  only = args.only.split(",")
  unknown = [s for s in only if s not in STAGES]
  if unknown:
    parser.error(f"--only: {unknown} not among {list(STAGES)}")
  started = time.monotonic()
  device = probe()
  size = args.size or ("gpu" if device["backend"] == "gpu" else "smoke")
  print(f"{device['kind']} ({device['backend']}); size {size}; results to {args.out}",
        flush=True)
  results = []
  for stage in only:
    argv = STAGES[stage][size]
    left = args.budget - (time.monotonic() - started)
    if left < 60 and size == "gpu":
      results.append(dict(stage=stage, argv=argv, status="skipped: budget spent", seconds=0,
                          output=""))
      write(args.out, device, size, results)
      continue
    print(f"== {stage}: python benchmarks/{' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
      done = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), timeout=max(left, 1.0), cwd=ROOT)
      status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
      output = done.stdout
    except subprocess.TimeoutExpired as e:
      status = f"stopped at the budget ({left:.0f} s)"
      output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    results.append(dict(stage=stage, argv=argv, status=status,
                        seconds=time.monotonic() - t0, output=output))
    print(output, flush=True)
    write(args.out, device, size, results)
  bad = [r["stage"] for r in results if r["status"] != "ok"]
  print(f"{len(results) - len(bad)} of {len(results)} stages ok; results in {args.out}")
  if any(r["status"].startswith("failed") for r in results):
    sys.exit(1)
  sys.exit(2 if bad else 0)  # Stopped at the budget, or skipped: not all was measured.


if __name__ == "__main__":
  main()
