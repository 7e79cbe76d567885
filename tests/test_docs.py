"""The docs site: the README's docs command builds it with warnings as errors (a broken
cross-reference, a public module or name missing from the API reference, a notebook cell
that fails), serves it, and a real headless browser shows the getting-started page.

The build executes the MNIST ensemble notebook on the real MNIST files, which the docs
command names (`TFDS_MANUAL_DIR`), in a fresh shell's environment (`doc_commands.Runner`):
an empty TFDS data directory and none of the tests' variables, as on a new machine.
"""

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import doc_commands as docs
import pytest

DOCS = docs.ROOT / "docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclasses.dataclass
class Site:
  command: str  # The README's docs command.
  html: pathlib.Path  # Where its build step wrote the site.
  result: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
  """The README's docs command's build step, run as written (its `/tmp/` path moved), in
  a fresh shell's environment: an empty TFDS data directory, no variable of the tests'."""
  command = next(c for c in docs.commands([docs.README]) if docs.is_docs_command(c))
  build = next(s for s in docs.steps(command) if "sphinx-build" in s)
  runner = docs.Runner(root=tmp_path_factory.mktemp("docs"))
  assert not runner.data_dir.exists()
  result = runner.run(command, extra=[], step=build, timeout=1200)
  html = runner.path(re.search(r"\s/tmp/(\S+)", build).group(1))
  return Site(command, html, result)


def test_the_docs_build_with_warnings_as_errors(site):
  output = site.result.stdout + site.result.stderr
  assert re.search(r"(^|\s)-W(\s|$)", site.command) and "-E" in site.command.split()
  assert site.result.returncode == 0, output[-6000:]
  assert "build succeeded" in output and "warning" not in output.split("build succeeded")[1]
  for page in ("index", "getting_started", "architecture", "benchmarks", "guides/sweeps",
               "notebooks/mnist_ensemble", "api/index",
               "api/_autosummary/trainer.trainer", "api/_autosummary/trainer.run.runner",
               "api/_autosummary/strategies.base", "api/_autosummary/trainer.sweep.report"):
    assert (site.html / f"{page}.html").is_file(), page


def test_the_notebook_ran_and_shows_what_the_ensemble_did(site):
  text = re.sub(r"<[^>]+>", "", (site.html / "notebooks" / "mnist_ensemble.html").read_text())
  assert re.search(r"8 devices", text), text[:3000]
  accuracy = re.search(r"accuracy\s+ensemble (\d\.\d{4})\s+mean member (\d\.\d{4})", text)
  assert accuracy, text[:5000]
  assert float(accuracy.group(1)) > 0.8  # 120 steps of 8 CNNs learn MNIST.
  assert "Traceback" not in text


def test_the_api_reference_documents_the_trainers_hooks_in_order(site):
  page = (site.html / "api" / "_autosummary" / "trainer.trainer.html").read_text()
  hooks = ["build_model", "loss", "model_inputs", "apply_model", "step_rngs"]
  where = [page.index(f'id="trainer.trainer.Trainer.{h}"') for h in hooks]
  assert where == sorted(where)
  assert page.index('id="trainer.trainer.Trainer.loss"') < page.index(
      'id="trainer.trainer.Trainer.fit"')
  # The page opens with the Trainer, not with internal tables such as the moved names'.
  assert "MOVED" not in page and page.index('id="trainer.trainer.Trainer"') < page.index(
      'id="trainer.trainer.Trainer.build_model"')


def test_a_public_module_missing_from_the_reference_is_a_warning(monkeypatch):
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    import api_coverage
  finally:
    sys.path.pop(0)
  assert {"trainer.trainer", "trainer.run.runner", "trainer.sweep.members",
          "strategies.base", "models.cnn"} <= set(api_coverage.public_modules())
  warned = []
  monkeypatch.setattr(api_coverage.logger, "warning", lambda *a, **k: warned.append(a))

  class Domain:
    modules = {m: None for m in api_coverage.public_modules() if m != "trainer.run.calls"}
    objects = {}

  class Env:
    def get_domain(self, name):
      return Domain()

  api_coverage._check(None, Env())
  missing = [a for a in warned if "has no page" in a[0]]
  assert [a[1] for a in missing] == ["trainer.run.calls"]
  assert any(a[1:3] == ("trainer.loop.builtin", "Checkpoint") for a in warned)  # __all__ too.


@pytest.fixture
def served(site):
  """The docs command's serve step (`http.server`), on a free port instead of 8000."""
  if site.result.returncode:
    pytest.skip("the docs did not build")
  serve = docs.steps(site.command)[-1]
  assert "http.server" in serve and serve.split()[-1] == "8000"
  runner = docs.Runner(root=site.html.parent)
  argv = runner.argv(site.command, extra=[], step=serve)[:-1] + ["0", "--bind", "127.0.0.1"]
  env = {**runner.env(), "PYTHONUNBUFFERED": "1"}  # Its "Serving HTTP on ... port" line.
  server = subprocess.Popen(argv, cwd=docs.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
  try:
    line, deadline = "", time.monotonic() + 60
    while "port" not in line and time.monotonic() < deadline:
      line = server.stdout.readline()
      assert line or server.poll() is None, "the docs server exited"
    port = int(re.search(r"port (\d+)", line).group(1))
    yield f"http://127.0.0.1:{port}"
  finally:
    server.terminate()
    server.wait(timeout=30)


def test_a_browser_shows_the_install_command_and_the_example(served, tmp_path):
  if CHROMIUM is None:
    if os.environ.get("CI") == "true":
      pytest.fail("Debian's chromium is not installed; .ci/run installs it "
                  "(apt-get install chromium) for this test")
    pytest.skip("chromium is not installed (apt-get install chromium)")
  from playwright.sync_api import sync_playwright
  with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    try:
      page = browser.new_page(viewport={"width": 1280, "height": 900})
      page.goto(f"{served}/getting_started.html")
      main = page.locator("main")
      text = main.inner_text()
      page.screenshot(path=str(tmp_path / "getting_started.png"), full_page=True)
      shown = [block for block in page.locator("div.highlight pre").all() if block.is_visible()]
    finally:
      browser.close()
  assert "Getting started" in text
  install = next(c for c in docs.commands([docs.README]) if "pip install -q -e . &&" in c)
  assert install in " ".join(text.split()), text[:3000]
  for line in ("class RegressionTrainer(Trainer):", "def build_model(self):",
               "return models.MLP(num_layers=2, depth=16)", "def loss(self, outputs, batch):"):
    assert line in text, line
  assert len(shown) >= 5  # The code blocks are rendered, not hidden.
  assert (tmp_path / "getting_started.png").stat().st_size > 10_000
