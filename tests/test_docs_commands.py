"""Every shell command in README.md and docs/*.md runs as written, so the docs cannot drift.

Each document's commands run in order, in its own scratch copy of the repository's ``profiles/``,
``docs/`` and ``benchmarks/`` (so a command may use what an earlier one of the same document
wrote, never what another document wrote), with ``pipeplan`` on PATH as this checkout; two
documents run at a time. Each ``pipeplan`` command is a process of its own, forked from one
that imported the CLI once (tests/fork_cli.py: the import is about 1.1 s of CPU, most of a
planning command's); the ``..._subprocess`` tests start ``python -m pipeplan`` itself. Nothing lies beside that copy (no ``../shared``), so every
command runs as it would from a fresh clone; the data the docs use ship in ``profiles/``
(PipeDream's graphs in ``profiles/pipedream/``). Which commands count:

- ```bash / ```sh blocks: the whole block, as one script (``set -e``);
- plain ``` blocks: the lines after a ``$ `` prompt, or, in a block without prompts, lines that
  start with a command (``pipeplan``, ``python``, ``pip``, ...).

Slow commands run at small sizes (``SMALL``: fewer repeats and steps, a smaller model), and a
few are not run at all, each for the reason given in ``SKIP``; a SKIP entry that matches no
command fails the test, so the list cannot outlive the docs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fork_cli
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_WORDS = ("pipeplan ", "python ", "python3 ", "pip ", "pytest ", "PYTHONPATH=", "source ", "torchrun ",
                 ".venv/bin/")

#: Commands (a substring of the line) not run, and why.
SKIP = {
    "python3 -m venv .venv && .venv/bin/pip install -e .":
        "README's install-and-plan command: .ci/run runs exactly it (test_ci_runs_the_two_readme_commands)",
    '.venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q':
        "README's test command: .ci/run runs exactly it, and this test is part of it",
    "pipeplan profile mypkg.models:build": "a placeholder module; the worked example (mymodels:build) runs",
    "pipeplan run plan.json --model mypkg.models:build": "a placeholder module",
    "pipeplan diff old-plan.json new-plan.json": "placeholder file names (the diff of two plans runs in docs/ci.md)",
    "benchmarks/bench_schedule_auto.py": "a benchmark script, minutes long; docs/benchmarks.md reports its output",
    "benchmarks/validate_megatron_bridge.py": "plans 15 published runs (minutes); docs/cluster-validation.md "
        "reports its output, and the GPT-OSS row's own commands beside it run",
    "benchmarks/validate_torchtitan.py --markdown": "plans 10 published runs (about 95 s); docs/cluster-validation.md "
        "reports its output, and its one-row command beside it runs",
    "pipeplan run plan-1f1b-2.json --profile gpt2-6.json --steps 5 -q": "needs the plan of the loop above",
    "pipeplan run plan-d2.json --profile profiles/gpt2-tiny-cpu.json": "a 4-rank torchrun job (d = 2, p = 2): "
        "tests/test_run_data_parallel.py runs one",
    "--rdzv-endpoint 127.0.0.1:29512": "two nodes on one rendezvous: tests/test_run_torch.py runs it",
    "pipeplan run bad-plan.json": "bad-plan.json is made by hand in the prose",
    "PYTHONPATH=. pipeplan run tagger-plan.json": "a torchrun job (tests/test_run_torch.py runs real jobs)",
    "pipeplan run plan.json --model gpt2-tiny --steps 20 --threads 1": "a torchrun job of 20 steps",
    "pipeplan calibrate plan.json report.json -o calibrated.json [--profile profile.json]": "a usage synopsis",
    "python -m torch.distributed.run --standalone": "what `pipeplan run` starts; CONFIG.json is a placeholder",
    "pipeplan check profiles/ --baseline profiles/baselines/ [--tolerance 0.02]": "a usage synopsis",
    "pipeplan diff A B [--format table|markdown]": "a usage synopsis",
    "pipeplan diff old-profile.json new-profile.json [--settings-from": "a usage synopsis",
    "pipeplan export PLAN --format torchtitan|megatron|deepspeed|torch": "a usage synopsis",
    "source plan.sh": "needs Megatron-LM's pretrain_gpt.py and GPUs",
    "torchrun --nproc-per-node 4 pretrain_gpt.py": "needs Megatron-LM's pretrain_gpt.py and GPUs",
    "pip install --no-deps megatron-core": "installs packages (the test extras have them)",
    "pipeplan profile my/config.json --analytic --gpu-spec my-gpu.toml": "placeholder files (a config and a GPU spec)",
    "pipeplan doctor megatron train_mixtral_8x7b_distributed.sh": "NVIDIA's Megatron-LM script, not shipped: "
        "tests/test_expert_parallel.py runs doctor on its flags",
    "pipeplan calibrate llama3-8b-h100.json --measured measured.json": "placeholder files (a measured profile)",
    "pytest tests/test_export.py": "the test suite runs it",
    ".venv/bin/python -m pytest -q": "the test suite itself, of which this test is part (docs/ci.md: the full "
        "command and the quick loop)",
    "pipeplan doctor megatron train.sh --profile model.json": "placeholder files (train.sh, model.json)",
    "pipeplan doctor torchtitan job.toml --profile model.json": "placeholder files (job.toml, model.json)",
    "pipeplan doctor deepspeed ds_config.json --profile model.json": "placeholder files (ds_config.json, model.json)",
    "pipeplan doctor ... ": "a usage synopsis (`...` stands for a launcher and its file)",
    "pipeplan doctor megatron scripts/train.sh --profile profiles/llama3-8b.json": "a user's CI step: their "
        "script and profile (docs/doctor-megatron.md runs doctor on a shipped example)",
    "pipeplan doctor megatron train.sh --profile llama3-8b.json": "a placeholder script (docs/doctor-megatron.md "
        "runs doctor on a shipped example)",
    "pipeplan plan gpt-175b-a100.json --gpus 64": "needs the analytic A100 profile that "
        "benchmarks/validate_korthikanti.py builds; tests/test_cluster_validation.py predicts these runs",
    "benchmarks/models_table.py": "a benchmark: minutes of torchrun jobs; docs/models.md reports its output",
    "validate_korthikanti.py --search": "the free search over the table's models (a benchmark; the table "
        "itself runs above, and tests/test_cluster_validation.py checks the search against fixed layouts)",
    "pipeplan profile hf:llama --config config.json": "a placeholder config.json (hf:gpt2 with sizes runs)",
    "pipeplan profile hf:path/to/config.json": "a placeholder config path",
    "pipeplan profile hf:llama --config path/to/config.json": "a placeholder config path",
    "PYTHONPATH=. pipeplan profile mymodels:build --layers 4": "the module of docs/profiling.md's worked example, "
        "which runs there",
    "pipeplan plan tagger.json --stages 2 --global-batch 8 --schedule zbv": "plans the profile of the line above",
    "pipeplan run plan-bert.json --profile bert.json": "sample output of a 4-rank torchrun job; "
        "tests/test_run_hf.py runs --verify on BERT",
}

#: Blocks not run, named by a substring of one of their lines, and why: torch runs of more than a
#: few seconds (a ``pipeplan profile`` of the smallest model takes 10-20 s on a shared 2-core
#: runner, a torchrun job more). README's walk-through (profile, plan, run, calibrate, plan) and
#: docs/profiling.md's worked example do run, at small sizes: every command kind below is in them.
SKIP_BLOCK = {
    "pipeplan profile gpt2-tiny --microbatch-sizes 1,2,4 --seq-len 128 -o profiles/gpt2-tiny-cpu.json":
        "five torch profile runs of built-ins (README's walk-through profiles one)",
    "pipeplan profile gpt2-tiny --layers 6 --microbatch-sizes 1,2,4 -o profile.json":
        "docs/running.md's walk-through: the same commands as README's, which runs",
    "for p in 2 4; do": "twelve torchrun jobs, one per schedule and size (tests/test_run_torch.py runs every schedule)",
    "pipeplan profile gpt2 --microbatch-sizes 1,2,4 --seq-len 128 --dtype fp32 --repeats 3": "how the shipped "
        "profile was measured (a torch profile of GPT-2, minutes)",
    "for i in 1 2 3 4 5; do for s in 1f1b auto; do": "a measurement: ten torchrun jobs of 20 steps",
    "python -c \"import json, sys": "reads the reports of that measurement",
    "pipeplan profile gpt2-tiny --layers 2 --hidden 32 --heads 2 --vocab 64 --seq-len 8": "a measurement: six plans "
        "of 20 steps on torchrun",
    "pipeplan run plan-1f1b.json --profile profile.json --steps 20 --report r-1f1b-1.json":
        "a measurement (torch profile and torchrun jobs)",
}

#: (pattern, replacement, why): the same commands at sizes that take seconds.
SMALL = [
    (r"path/to/config\.json", "llama3-70b", "a placeholder path: the shipped config of the same model"),
    (r"(--gpus 64 --cluster dgx-h100)", r"\1 --tensor-parallel 4 --stages 4 --zero 1",
     "the whole search takes about a minute on 2 cores (docs/benchmarks.md): t, p and ZeRO fixed to its answer"),
    (r"(pipeplan profile gpt2)(?= )(?![^\n]*--layers)", r"\1 --layers 2 --hidden 64 --heads 2 --vocab 256",
     "the full GPT-2 takes minutes to profile on a CPU"),
    (r"(pipeplan profile hf:gpt2 [^\n]*?)--vocab \d+", r"\1--vocab 256", "a small vocabulary: the LM head "
     "of 50257 words is most of a small model's time"),
    (r"(pipeplan profile hf:gpt2)(?= )(?![^\n]*--vocab)", r"\1 --vocab 256", "the same, where the default applies"),
    (r"(pipeplan profile hf:gpt2)(?= )(?![^\n]*--layers)", r"\1 --layers 2 --hidden 64 --heads 2",
     "GPT-2 small's 12 blocks of 768 take most of a minute to profile and to run --verify on 2 ranks"),
    (r"(pipeplan profile hf:gpt2 [^\n]*?)--hidden 256 --heads 4", r"\1--hidden 64 --heads 2", "narrower blocks"),
    (r"(pipeplan profile .*?)--seq-len 128", r"\1--seq-len 32", "shorter sequences"),
    (r"(pipeplan profile (?![^\n]*--analytic)[^\n]*?)( -o )", r"\1 --repeats 1 --warmup 0\2", "one timed repeat"),
    (r"(pipeplan profile [^\n]*?)--layers \d+", r"\1--layers 2", "two blocks"),
    (r"(pipeplan profile [^\n]*?)--microbatch-sizes 1,2,4", r"\1--microbatch-sizes 1,2", "two sizes"),
    (r"(pipeplan run [^\n]*?)--steps \d+", r"\1--steps 2 --alone-repeats 0", "two steps, no re-timing"),
]


def _blocks(text: str):
    """(language, body) of every fenced code block."""
    for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        yield match.group(1), match.group(2)


def _logical_lines(body: str) -> list[str]:
    return body.replace("\\\n", " ").splitlines()


def doc_commands(path: Path) -> list[tuple[str, str]]:
    """(kind, text) in document order: kind "script" (a bash block) or "line" (one command)."""
    out = []
    for lang, body in _blocks(path.read_text(encoding="utf-8")):
        if lang in ("bash", "sh", "shell"):
            out.append(("script", body))
        elif lang in ("", "console"):
            lines = _logical_lines(body)
            prompts = [line[2:] for line in lines if line.startswith("$ ")]
            if prompts:
                out.extend(("line", line) for line in prompts)
            else:
                out.extend(("line", line.strip()) for line in lines if line.strip().startswith(COMMAND_WORDS))
    return out


def _skip_reason(text: str) -> str | None:
    return next((reason for key, reason in SKIP.items() if key in text), None)


def _shrink(text: str) -> str:
    for pattern, replacement, _ in SMALL:
        text = re.sub(pattern, replacement, text)
    return text


def _prepare_script(body: str) -> str | None:
    """The block with skipped commands taken out; None when a skip sits inside a loop or here-doc."""
    if any(key in body for key in SKIP_BLOCK):
        return None
    compound = bool(re.search(r"^\s*(for|while)\b|<<", body, re.M))
    lines = _logical_lines(body)
    kept = []
    for line in lines:
        if _skip_reason(line):
            if compound:
                return None
            kept.append(": skipped")
        else:
            kept.append(_shrink(line))
    return "\n".join(kept) + "\n"


def _make_workspace(root: Path, cli_socket: str | None = None) -> tuple[Path, dict]:
    """A scratch copy of the repository's data under ``root``, and the environment to run in it.

    With ``cli_socket``, ``pipeplan`` asks the server there (tests/fork_cli.py) to fork the
    command from its imported CLI; without, or when no server answers, it is ``python -m
    pipeplan.cli``.
    """
    work = root / "repo"
    work.mkdir()
    for name in ("profiles", "docs", "benchmarks"):
        shutil.copytree(REPO / name, work / name)
    # Nothing beside the copy: a command that reads outside the clone (../shared) fails here.
    bin_dir = root / "bin"
    bin_dir.mkdir()
    python_path = f"{REPO}"
    wrapper = f'#!/bin/sh\nPYTHONPATH="{python_path}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" '
    if cli_socket:
        (bin_dir / "pipeplan").write_text(fork_cli.client_script(sys.executable, cli_socket, python_path))
    else:
        (bin_dir / "pipeplan").write_text(wrapper + '-m pipeplan.cli "$@"\n')
    (bin_dir / "python").write_text(wrapper + '"$@"\n')
    for tool in ("pipeplan", "python"):
        (bin_dir / tool).chmod(0o755)
    venv_bin = work / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(bin_dir / "python")
    (venv_bin / "pipeplan").symlink_to(bin_dir / "pipeplan")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    return work, env


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return _make_workspace(tmp_path_factory.mktemp("docs"))


def _run(kind: str, text: str, work: Path, env: dict) -> subprocess.CompletedProcess:
    args = ["bash", "-e", "-o", "pipefail", "-c", text] if kind == "script" else ["bash", "-o", "pipefail", "-c", text]
    return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)


def _needs_torch(text: str) -> bool:
    measured = [line for line in text.splitlines() if re.search(r"pipeplan profile\b", line) and "--analytic" not in line]
    return bool(measured or re.search(r"pipeplan run\b|run_plans|import torch", text))


#: Set-up the prose asks for before a document's commands.
SETUP = {
    "ci.md": "cp docs/examples/llama-16.json profiles/",
    "profiling.md": None,  # mymodels.py: written from the document's own python block
    "running.md": None,
}


def _run_doc(doc: Path, root: Path, cli_socket: str | None = None) -> tuple[str, str]:
    """Run every command of ``doc`` in order in a fresh workspace under ``root``.

    Returns ("ok", ""), ("skip", why) or ("fail", what failed); the document's seconds go into
    ``DOC_SECONDS`` (printed beside the run's slowest tests, tests/conftest.py).
    """
    start = time.perf_counter()
    try:
        return _run_doc_commands(doc, root, cli_socket)
    finally:
        DOC_SECONDS[doc.name] = time.perf_counter() - start


#: Wall seconds of each document's commands in this run.
DOC_SECONDS: dict[str, float] = {}


def _run_doc_commands(doc: Path, root: Path, cli_socket: str | None) -> tuple[str, str]:
    work, env = _make_workspace(root, cli_socket)
    commands = doc_commands(doc)
    if not commands:
        return "skip", f"{doc.name} has no shell commands"
    have_torch = shutil.which("true") and _torch_available()
    if SETUP.get(doc.name):
        subprocess.run(["bash", "-c", SETUP[doc.name]], cwd=work, env=env, check=True)
    text = doc.read_text(encoding="utf-8")
    for lang, body in _blocks(text):
        if lang == "python" and "def build(" in body and "class Tagger" in body:
            (work / "mymodels.py").write_text(body)
    ran = 0
    for kind, command in commands:
        prepared = _prepare_script(command) if kind == "script" else (None if _skip_reason(command) else _shrink(command))
        if prepared is None or not prepared.strip(": skipped\n"):
            continue
        if _needs_torch(prepared) and not have_torch:
            continue
        done = _run(kind, prepared, work, env)
        # check's and doctor's verdict (a regression, an error finding) is exit 1 with a report.
        verdict = kind == "line" and re.match(r"(\$ )?pipeplan (check|doctor)\b", prepared) and done.returncode == 1
        if not (done.returncode == 0 or (verdict and "error:" not in done.stderr)):
            return "fail", (f"{doc.name}: this command failed (exit {done.returncode}):\n{prepared}\n"
                            f"stderr: {done.stderr[-2000:]}")
        if "Traceback" in done.stderr:
            return "fail", f"{doc.name}: {prepared}\n{done.stderr[-2000:]}"
        ran += 1
    if ran == 0:
        return "skip", f"{doc.name}: every command is skipped, each for its reason in SKIP"
    return "ok", ""


#: Documents with torch runs first, so that the long ones start early (longest first balances
#: the two workers).
_FIRST = ("README.md", "models.md", "running.md", "profiling.md", "doctor-megatron.md", "launchers.md")


@pytest.fixture(scope="module")
def doc_results(request, tmp_path_factory):
    """Every selected document's commands, two documents at a time.

    Each document runs in its own fresh workspace (as a reader who follows only that page
    would), so documents do not wait for each other: on a 2-core machine two run at once, and
    the commands of one are planning and doctor runs of a second or so each, single-threaded.
    """
    selected = [item.callspec.params["doc"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_every_command_in_the_docs_runs"]
    order = sorted(selected, key=lambda d: (_FIRST.index(d.name) if d.name in _FIRST else len(_FIRST), d.name))
    root = tmp_path_factory.mktemp("docs-each")
    roots = {doc: root / doc.stem for doc in order}
    for path in roots.values():
        path.mkdir()
    with _cli_server() as cli_socket, ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {doc: pool.submit(_run_doc, doc, roots[doc], cli_socket) for doc in order}
        return {doc.name: future.result() for doc, future in futures.items()}


@contextlib.contextmanager
def _cli_server():
    """The socket of a server that forks each ``pipeplan`` command from one import of the CLI
    (tests/fork_cli.py: about 1.1 s of CPU saved per command, some 80 commands)."""
    folder = tempfile.mkdtemp(prefix="pipeplan-cli-")  # short: a Unix socket's path has 107 bytes
    path = os.path.join(folder, "cli.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    server = subprocess.Popen([sys.executable, fork_cli.__file__, path], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "the CLI server did not start"
        yield path
    finally:
        server.terminate()  # it waits for its children (their CPU time counts in this process's)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_the_docs_runs(doc, doc_results):
    outcome, message = doc_results[doc.name]
    if outcome == "skip":
        pytest.skip(message)
    assert outcome == "ok", message


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def test_every_skip_names_a_command_in_the_docs():
    everything = "\n".join(text for doc in DOCS for _, text in doc_commands(doc))
    stale = [key for key in [*SKIP, *SKIP_BLOCK] if key not in everything]
    assert stale == [], f"SKIP entries that match no command in the docs (remove them): {stale}"


def test_no_command_reads_outside_the_clone():
    """A fresh clone has nothing beside it: no command may name ../shared or another absolute data path."""
    outside = [(doc.name, text) for doc in DOCS for _, text in doc_commands(doc)
               if re.search(r"\.\./shared\b|/work/shared\b|\$PIPEPLAN_(PIPEDREAM|SHARED)\b", text)]
    assert outside == [], f"commands that read outside the repository (ship the data in profiles/): {outside}"


def test_the_workspace_has_nothing_beside_it(workspace):
    work, _ = workspace
    assert sorted(p.name for p in work.parent.iterdir()) == ["bin", "repo"]
    assert (work / "profiles" / "pipedream" / "resnet50.graph.txt").is_file()


def test_ci_runs_the_two_readme_commands():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = next(body for lang, body in _blocks(readme) if lang == "bash")
    commands = [line.strip() for line in _logical_lines(first) if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == commands
    # The first installs only what planning needs (no extra), the second the test extras.
    assert "pip install -e . " in commands[0] and "[" not in commands[0].split("pip install")[1].split("&&")[0]
    assert '".[test]"' in commands[1] and "pytest" in commands[1]
