"""The README and docs/ cannot rot.

* The generated reference pages (docs/reference/config.md, commands.md,
  errors.md) are what `make docs` writes from today's code.
* Every config key and every subcommand option the pages name exists: a
  `trainer.foo`-style key in backticks is a key of the schema, an option of a
  `recsys predict|evaluate|export|preprocess` command line is a key of that
  command's schema (tests/test_configs.py composes every `recsys train` line).
* The tutorials run: every `recsys` line of their command blocks, in order,
  in a temporary directory, at the tiny sizes each page states (TINY below),
  with the `cat` and `mv` lines that make their input files; the Python
  blocks too. The Kaggle tutorial runs in `make test` and its
  run's summary.json fields are all named in reference/run-directory.md; the
  first-run tutorial (five trainings) in `make verify`.
* The end-of-run table the README's quick start and the first-run tutorial
  show is, but for its timings and peak RSS, what `recsys train` prints today.
* Links between the pages resolve, every source file they name exists, and
  every figure of the README's headline table is in BENCHMARKS.md's
  current-figures table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from commands import RECSYS, in_process_output

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
# Each tutorial's tiny sizes, as the page says: (replace, by) on every command line,
# and overrides added to every `recsys train`.
TINY: dict[str, tuple[list[tuple[str, str]], list[str]]] = {
    "first-run.md": ([("trainer.max_steps=400", "trainer.max_steps=20"), ("trainer.max_steps=800", "trainer.max_steps=40"),
                      ("trainer.checkpoint_every=100", "trainer.checkpoint_every=5")],
                     ["dataset.synthetic.rows=20000"]),
    "criteo-kaggle.md": ([("rows=1100000", "rows=4400")], []),
}
GROUPS = ("dataset", "model", "placement", "precision", "dedup", "optimizer", "trainer")


def page_text(path: Path) -> str:
    return path.read_text()


def code_blocks(text: str, languages: tuple[str, ...] = ("bash", "sh", "")) -> list[str]:
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if lang in languages]


def command_lines(text: str, shell: tuple[str, ...] = ()) -> list[str]:
    """Every `recsys ...` line of a page's shell blocks, continuations joined, comments cut
    (and the lines that start with one of `shell`'s commands, in order among them)."""
    out = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(("recsys ", *(f"{command} " for command in shell))):
                out.append(line)
    return out


# --- the generated reference ------------------------------------------------------------------
def test_the_generated_reference_pages_are_committed_as_generated():
    from recsys_cli.reference_docs import stale_pages

    stale = stale_pages()
    assert not stale, f"{[str(p) for p in stale]} differ from what the code generates: run `make docs`"


def test_the_config_reference_names_every_key_with_type_default_and_range():
    from recsys_cli.config import RANGES
    from recsys_cli.reference_docs import train_keys

    keys = train_keys()
    text = (DOCS / "reference" / "config.md").read_text()
    assert {k.name for k in keys} >= set(RANGES) and len(keys) > 80
    for key in keys:
        assert f"| `{key.name}` |" in text
        assert key.description, f"{key.name} has no comment in the schema: config.md would have no description"
        if key.type.split(" ")[0] in ("int", "float", "list") and key.name.startswith("dataset.synthetic."):
            assert key.allowed != "any", f"{key.name}: data_tools.synthetic.validate states no range for it"


def test_the_error_catalogue_sorts_every_site_into_a_family():
    from recsys_cli.reference_docs import error_sites, family_of

    sites = error_sites()
    assert len(sites) > 150
    assert not [s for s in sites if family_of(s[0]) == "other"]
    assert any("checkpoint file {...} is damaged" in text for _, _, text in sites)  # a UserError subclass's message


# --- what the pages name exists ---------------------------------------------------------------
def schema_keys() -> set[str]:
    from recsys_cli.reference_docs import train_keys

    return {k.name for k in train_keys()}


def test_every_config_key_the_pages_name_exists():
    keys = schema_keys()
    prefixes = {k.rsplit(".", 1)[0] for k in keys} | {".".join(k.split(".")[:2]) for k in keys}
    missing = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page_text(page)):
            for word in re.findall(r"(?<![\w./-])((?:%s)\.[a-z_][\w.]*)" % "|".join(GROUPS), span):
                name = word.split("=")[0].rstrip(".")
                if name.startswith("placement.overrides.") or name.endswith((".py", ".yaml", ".json", ".md")):
                    continue  # {table: placement}: any table name; a file (dedup.py)
                if name not in keys and name not in prefixes:
                    missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, missing


def command_schemas() -> dict[str, type]:
    from data_tools.criteo import CriteoConfig
    from recsys_cli.evaluate import EvaluateConfig
    from recsys_cli.export import ExportConfig
    from recsys_cli.predict import PredictConfig
    from recsys_cli.preprocess import SyntheticPreprocessConfig
    from recsys_cli.report import ReportConfig
    from recsys_cli.verify import VerifyConfig

    return {"predict": PredictConfig, "evaluate": EvaluateConfig, "export": ExportConfig,
            "preprocess criteo": CriteoConfig, "preprocess synthetic": SyntheticPreprocessConfig,
            "report": ReportConfig, "verify": VerifyConfig}


def test_every_option_of_a_documented_command_exists():
    schemas = command_schemas()
    bad = []
    for page in PAGES:
        text = page_text(page)
        inline = [span for span in re.findall(r"`([^`\n]+)`", text) if span.startswith("recsys ")]
        for line in command_lines(text) + inline:
            words = shlex.split(line.replace("[", "").replace("]", ""))[1:]
            if not words:
                continue
            command = " ".join(words[:2]) if words[0] == "preprocess" else words[0]
            if command not in schemas:
                continue
            known = {f.name for f in dataclasses.fields(schemas[command])}
            for word in words[len(command.split()):]:
                key = word.split("=", 1)[0]
                if "=" in word and key not in known:
                    bad.append(f"{page.relative_to(ROOT)}: {line}: {key}")
    assert not bad, bad


def test_every_source_file_the_pages_name_exists():
    """`embeddings/cache.py`, `tests/test_disk.py`, `bench/headline.py`: a file
    moved or renamed without its pages fails here (paths are relative to the
    repository, or to recsys_cli/ and its packages, as the pages write them)."""
    bases = [ROOT, ROOT / "recsys_cli", *[p for p in (ROOT / "recsys_cli").iterdir() if p.is_dir()]]
    missing = []
    for page in PAGES:
        for path in sorted(set(re.findall(r"(?<![\w/.-])((?:[a-z_]+/)+[A-Za-z_]+\.py)\b", page_text(page)))):
            if not any((base / path).exists() for base in bases):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page_text(page)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_readme_fits_two_screens_and_its_figures_are_benchmarks_rows():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    current = (ROOT / "BENCHMARKS.md").read_text().split("# The log", 1)[0]
    head = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in head.splitlines() if r.startswith("| ")][1:]  # under the header row
    assert len(rows) >= 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # the measured figures: a number with a unit, a ratio, or a decimal (an AUC)
        figures = re.findall(r"\d[\d,]*(?:\.\d+)?(?: %|x| MiB| min| s\b)|\d+\.\d+", cells[1])
        date = cells[2]
        assert figures and date in current, row
        for figure in figures:
            assert figure in current, f"{figure} of the README's headline table is not in BENCHMARKS.md's current figures"



def test_every_current_figure_command_names_a_benchmark_that_exists():
    """The command column of BENCHMARKS.md's current figures: a command to
    run names a standard benchmark (bench/standard/), a bench module or a
    make target that exists; a figure whose script is gone says so
    ("script removed in", "the figure from"), and that script is gone."""
    current = (ROOT / "BENCHMARKS.md").read_text().split("# The log", 1)[0]
    rows = [r for r in current.split("## Current figures", 1)[1].splitlines() if r.startswith("| ")][2:]
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    checked = 0
    for row in rows:
        command = row.strip().strip("|").split(" | ")[-1]
        for historical in re.findall(r"(?:last run as|the figure from) `python -m (bench[.\w]+)", command):
            assert not (ROOT / (historical.replace(".", "/") + ".py")).exists(), f"{historical} exists: {row}"
        if command.startswith("(script removed in") or "`" not in command:
            continue
        live = command.split("`")[1].split()
        if live[:3] == ["python", "-m", "bench"]:
            assert (ROOT / "bench" / "standard" / f"{live[3]}.py").is_file(), row
        elif live[:2] == ["python", "-m"]:
            assert (ROOT / (live[2].replace(".", "/") + ".py")).is_file(), row
        elif live[0] == "make":
            assert live[1] in targets, row
        else:
            assert live[0] == "recsys", row
        checked += 1
    assert checked >= 20


# --- the default run's table the pages show -----------------------------------------------------
SUMMARY_PAGES = (ROOT / "README.md", DOCS / "tutorials" / "first-run.md")
# The rows a run's timings and memory fill (the second line of the samples/s row has no value).
VOLATILE = ("samples/s", "without eval and checkpoints", "wall clock", "seconds:", "peak host RSS")


def summary_rows(text: str) -> list[tuple[str, str]]:
    """(what, value) of each row of the first `recsys train: summary` table in text, less VOLATILE's."""
    table = text[text.index("recsys train: summary"):].split("└", 1)[0]  # up to the bottom border
    rows = []
    for line in table.splitlines():
        if line.startswith("│"):
            what, value = (cell.strip() for cell in line.strip().strip("│").split("│"))
            if not what.startswith(VOLATILE):
                rows.append((what, value))
    return rows


def test_the_default_run_the_pages_show_is_what_train_prints_today(tmp_path):
    """The README's quick start (`make train`: `recsys train` at the defaults) and
    the first-run tutorial show the end-of-run table, and say every figure but
    the timings and the peak RSS is the same on every run: one run at the
    defaults (the built-in dataset generated afresh; 10-20 s on 2 cores) must
    print those rows as the pages show them. A change that moves a metric's
    last digit updates the pages with the run's output."""
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"}
    done = subprocess.run([RECSYS, "train", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = summary_rows(done.stdout)
    assert len(printed) >= 10
    for page in SUMMARY_PAGES:
        assert summary_rows(page_text(page)) == printed, f"{page.name}'s table is not what `recsys train` prints"


# --- the tutorials run ------------------------------------------------------------------------
IN_PROCESS = ("preprocess", "predict", "evaluate", "export", "verify", "report")
# The shell commands of the tutorials' blocks that make their input files (the others,
# make, source, ls, are left out).
SHELL = ("cat", "mv")


def run_tutorial(name: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    replace, train_extra = TINY[name]
    text = page_text(DOCS / "tutorials" / name)
    env = {**os.environ, "RECSYS_CACHE": str(workdir / "cache")}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for line in command_lines(text, SHELL):
            for a, b in replace:
                line = line.replace(a, b)
            if not line.startswith("recsys "):  # a file made from the stand-in's
                subprocess.run(line, shell=True, executable="/bin/bash", cwd=workdir, check=True)
                continue
            words = shlex.split(line)[1:]
            if words[0] == "train":
                words += train_extra
            if words[0] in IN_PROCESS:
                code, out, err = in_process_output(words, capsys)
                assert code == 0, f"{line}: {err}"
            else:
                done = subprocess.run([RECSYS, *words], cwd=workdir, env=env, capture_output=True, text=True)
                assert done.returncode == 0, f"{line}: {done.stderr[-2000:]}"
        for block in code_blocks(text, ("python",)):
            exec(compile(block, f"{name} python block", "exec"), {})
    finally:
        os.chdir(cwd)


def test_the_criteo_kaggle_tutorial_runs_and_its_summary_fields_are_documented(tmp_path, capsys):
    run_tutorial("criteo-kaggle.md", tmp_path, capsys)
    assert (tmp_path / "submission.csv").read_text().startswith("Id,Predicted\n60000000,")
    assert (tmp_path / "runs/kaggle/model-int8.scorer.pt").exists()
    assert json.loads((tmp_path / "runs/kaggle/evaluate-test/evaluation.json").read_text())["auc"] > 0
    summary = json.loads((tmp_path / "runs/kaggle/summary.json").read_text())
    page = (DOCS / "reference" / "run-directory.md").read_text()
    assert not [field for field in summary if f"`{field}`" not in page]
    records = [json.loads(line) for line in (tmp_path / "runs/kaggle/metrics.jsonl").read_text().splitlines()]
    assert not {field for record in records for field in record if f"`{field}`" not in page}


@pytest.mark.verify
def test_the_first_run_tutorial_runs(tmp_path, capsys):
    run_tutorial("first-run.md", tmp_path, capsys)
    resumed = [json.loads(line) for line in (tmp_path / "runs/resume/metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in resumed) == 40
    assert (tmp_path / "runs/report.csv").exists() or any((tmp_path / "runs").rglob("report.csv"))


def test_the_tiny_sizes_are_the_ones_the_pages_state():
    """A tutorial that changes a size the test replaces must change TINY too."""
    for name, (replace, _) in TINY.items():
        text = page_text(DOCS / "tutorials" / name)
        for a, _ in replace:
            assert a in text, f"{name} no longer says {a}"
    assert "rows=4400" in page_text(DOCS / "tutorials" / "criteo-kaggle.md")
    assert "dataset.synthetic.rows=20000" in page_text(DOCS / "tutorials" / "first-run.md")
