"""The figures a guide quotes are what its command prints: the DPO example's held-out line
(`docs/guides/post_training.md`), rerun whole (100 steps, about 20 s).

The example trains on a fixed text of its own, so the line moves only with the code. The
reward accuracy is a count of held-out pairs, compared exactly; the margin and the loss are
printed to 4 decimals, and must agree to that last digit (one unit: a float sum's
reordering on another CPU moves them far less)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINE = (r"held-out pairs \(sigmoid\): reward accuracy (\d\.\d{3}) -> (\d\.\d{3}), margin "
        r"(\S+) -> (\S+), loss (\S+) -> (\S+) \(100 steps of 8 pairs\)")


def test_the_dpo_guides_line_is_what_the_example_prints(tmp_path):
  guide = (ROOT / "docs" / "guides" / "post_training.md").read_text()
  quoted = re.search(LINE, " ".join(guide.split()))
  assert quoted, "the guide no longer quotes the DPO example's line"
  run = subprocess.run([sys.executable, "examples/preference_lm.py",
                        f"--workdir={tmp_path / 'dpo'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  printed = re.search(LINE, run.stdout)
  assert printed, run.stdout[-3000:]
  want, got = quoted.groups(), printed.groups()
  assert got[:2] == want[:2], (got, want)  # The accuracies: counts of pairs.
  for a, b in zip(got[2:], want[2:], strict=True):
    assert abs(float(a) - float(b)) <= 1e-4 + 1e-9, (got, want)
