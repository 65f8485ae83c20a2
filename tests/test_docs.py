"""The docs run as written.

Every ```python block of README.md and docs/*.md runs in a process of its own with a fresh namespace (forked from one
that has imported torch and the library: FORKED_BLOCKS), and every command of the README's ```bash blocks runs in
short form (the tiny model for 2 steps, sweeps cut to their first two jobs, a short sample), each expected to exit
with status 0. A block that is not meant to run is preceded by the line ``<!-- no-test -->``;
keep those rare. A README command this file cannot shorten fails its test, so a new command gets a short form here.

Most of each process is imports and start-up, so the independent ones start together and each test awaits its own,
and the README's single train.py runs share one process (SHARED_RUNS).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One xdist worker runs this module: its fixtures start every command at once, and must do so once.
pytestmark = pytest.mark.xdist_group("docs")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NO_TEST = "<!-- no-test -->"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Commands that cannot run inside the suite: installing packages, the test suite itself, and its lint step.
NOT_RUN = (("pip", "install"), ("python", "-m", "pytest"), ("bash", ".ci/run"), ("ruff", "check"))
SHORT_TRAIN = ["trainer.max_steps=2"]
PLACEHOLDER = "DATE/TIME"  # README paths that name a run dir the user reads off their own run
TIMEOUT = 600


def fenced_blocks(path: Path, language: str) -> list[tuple[str, str]]:
    """(``file:line``, code) of every block in ``language`` that is not marked NO_TEST."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != language or text[:match.start()].rstrip().endswith(NO_TEST):
            continue
        line = text.count("\n", 0, match.start()) + 1
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        blocks.append((f"{name}:{line}", match.group(2)))
    return blocks


def shell_lines(code: str) -> list[list[str]]:
    """The commands of a bash block as argument lists, comments dropped, ``\\`` continuations joined."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


PYTHON_BLOCKS = [block for path in DOCS for block in fenced_blocks(path, "python")]
README_COMMANDS = [argv for _, code in fenced_blocks(README, "bash") for argv in shell_lines(code)]
COMMANDS = [argv for argv in README_COMMANDS if not any(tuple(argv[:len(skip)]) == skip for skip in NOT_RUN)]


def environment() -> dict:
    # One thread per process: many run side by side on few cores, where spinning intra-op threads stall each other.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=cwd, env=environment(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def report(result: subprocess.CompletedProcess) -> str:
    command = shlex.join(map(str, result.args))
    return f"exit {result.returncode}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@dataclass
class ShortForm:
    """How a README command runs in the suite: its argv, the dir it writes, and whether it reads an earlier run's."""

    argv: list[str] | None = None
    out: Path | None = None  # a run dir (single run) or a sweep dir (-m)
    sweep: bool = False
    needs_earlier: bool = False
    error: str | None = None


def train_short_form(program: list[str], args: list[str], out: Path) -> ShortForm:
    sweep = "-m" in args
    if sweep:  # the first two jobs of every swept value list
        args = [arg if "=" not in arg else arg.split("=", 1)[0] + "=" + ",".join(arg.split("=", 1)[1].split(",")[:2])
                for arg in args]
    extra = [] if any(arg.startswith("experiment=") for arg in args) else ["experiment=tiny"]
    extra += [*SHORT_TRAIN, f"hydra.{'sweep' if sweep else 'run'}.dir={out}"]
    return ShortForm([*program, *args, *extra], out, sweep)


def short_form(argv: list[str], out: Path) -> ShortForm:
    """The short form of README command ``argv``; ``out`` is the dir it may write."""
    if argv[:2] == ["python", "train.py"]:
        return train_short_form([sys.executable, str(ROOT / "train.py")], argv[2:], out)
    if argv[0] == "vqattn-train":
        script = shutil.which("vqattn-train")
        if script is None:
            return ShortForm(error="vqattn-train is not installed (pip install -e '.[train]')")
        return train_short_form([script], argv[1:], out)
    if argv[:2] == ["python", "benchmarks/far_recall.py"]:  # hours of training: check the plan it would run
        return ShortForm([sys.executable, str(ROOT / "benchmarks" / "far_recall.py"), str(out), *argv[3:], "--dry-run"])
    if argv[:3] == ["python", "-m", "vqattn.train.report"] and PLACEHOLDER in argv[3]:
        return ShortForm([sys.executable, "-m", "vqattn.train.report", "{sweep}", *argv[4:]], needs_earlier=True)
    if argv[:3] == ["python", "-m", "vqattn.train.sample"] and PLACEHOLDER in argv[3]:
        rest = argv[4:]
        if "--max-new-tokens" in rest:
            rest[rest.index("--max-new-tokens") + 1] = "8"
        return ShortForm([sys.executable, "-m", "vqattn.train.sample", "{checkpoint}", *rest], needs_earlier=True)
    return ShortForm(error=f"no short form for this README command: {shlex.join(argv)}")


def resolve(form: ShortForm, earlier: list[ShortForm]) -> list[str]:
    """Fill a command's placeholder with the last earlier sweep dir, or the checkpoint of the first earlier run (the
    README's default run)."""
    sweeps = [f.out for f in earlier if f.sweep and f.argv]
    runs = [f.out for f in earlier if not f.sweep and f.out is not None and f.argv]
    fill = {"{sweep}": str(sweeps[-1]) if sweeps else "no-sweep-before-this-command",
            "{checkpoint}": str(runs[0] / "checkpoints" / "last.ckpt") if runs else "no-run-before-this-command"}
    return [fill.get(arg, arg) for arg in form.argv]


# The README's single train.py runs: one process runs them one after another, as a multirun runs its jobs (their
# overrides are what each checks; the script's start-up is checked by the DDP and sweep commands, which run train.py
# as processes, and vqattn-train's; each process is seconds of imports). It prints a header line before each run and
# writes their exit statuses to the file named by its second argument.
SHARED_RUNS = r"""
import json, sys, traceback
from vqattn.train.entry import main

commands, path, statuses = json.loads(sys.argv[1]), sys.argv[2], []
for index, argv in enumerate(commands):
    for stream in (sys.stdout, sys.stderr):
        print(f"--- command {index} ---", file=stream, flush=True)
    sys.argv = argv
    try:
        main()
        statuses.append(0)
    except SystemExit as exit:
        statuses.append(exit.code if isinstance(exit.code, int) else int(exit.code is not None))
    except BaseException:
        traceback.print_exc()
        statuses.append(1)
with open(path, "w") as f:
    json.dump(statuses, f)
"""


def shares_a_process(form: ShortForm) -> bool:
    """A single run of train.py (not a sweep, not DDP): the README commands that may share one process."""
    return (form.argv is not None and form.argv[:2] == [sys.executable, str(ROOT / "train.py")] and not form.sweep
            and "trainer=ddp" not in form.argv and not form.needs_earlier)


def shared_part(text: str, index: int) -> str:
    """What the shared process wrote for its ``index``-th command."""
    parts = re.split(r"^--- command \d+ ---\n", text, flags=re.M)
    return parts[index + 1] if index + 1 < len(parts) else ""


class CommandRuns:
    """The README commands in short form, all in one directory. The independent ones start at once; those that read
    an earlier run start together once the independent ones are done. The single train.py runs share one process
    (SHARED_RUNS)."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.forms = [short_form(argv, cwd / f"command_{i}") for i, argv in enumerate(COMMANDS)]
        self.shared = [i for i, form in enumerate(self.forms) if shares_a_process(form)]
        self.statuses = cwd / "shared_statuses.json"
        self.shared_run = start([sys.executable, "-c", SHARED_RUNS,
                                 json.dumps([[str(ROOT / "train.py"), *self.forms[i].argv[2:]] for i in self.shared]),
                                 str(self.statuses)], cwd) if self.shared else None
        self.shared_result = None
        self.running = self._start(needs_earlier=False)
        self.results = {}

    def _start(self, needs_earlier: bool) -> dict[int, subprocess.Popen]:
        return {i: start(resolve(form, self.forms[:i]), self.cwd) for i, form in enumerate(self.forms)
                if form.argv and form.needs_earlier == needs_earlier and i not in self.shared}

    def _finish_shared(self) -> None:
        if self.shared_run is not None and self.shared_result is None:
            self.shared_result = finish(self.shared_run)

    def result(self, index: int) -> subprocess.CompletedProcess:
        if index in self.shared:
            self._finish_shared()
            done, k = self.shared_result, self.shared.index(index)
            statuses = json.loads(self.statuses.read_text()) if self.statuses.exists() else []
            status = statuses[k] if k < len(statuses) else done.returncode or 1  # the process ended before it
            return subprocess.CompletedProcess(self.forms[index].argv, status, shared_part(done.stdout, k),
                                               shared_part(done.stderr, k) or done.stderr)
        if index not in self.results and self.forms[index].needs_earlier:
            self._finish_shared()
            self.results.update({i: finish(proc) for i, proc in self.running.items() if i not in self.results})
            self.running = self._start(needs_earlier=True)
        if index not in self.results:
            self.results[index] = finish(self.running[index])
        return self.results[index]

    def kill(self):
        for proc in [*self.running.values(), *([self.shared_run] if self.shared_run else [])]:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def command_runs(tmp_path_factory):
    runs = CommandRuns(tmp_path_factory.mktemp("readme_commands"))
    yield runs
    runs.kill()


# The Python blocks: each in a process of its own, forked from one that has imported torch and the library (most of a
# block's time, when each was an interpreter of its own), in an empty directory and a fresh namespace, so a block
# still needs its own imports. The parent writes each block's exit status to BLOCK.status and its output to
# BLOCK/stdout and BLOCK/stderr.
FORKED_BLOCKS = r"""
import json, os, sys, traceback
from pathlib import Path

import torch  # noqa: F401
import vqattn.codebook, vqattn.feature_maps, vqattn.functional, vqattn.layers, vqattn.model  # noqa: F401, E401

root = Path(sys.argv[1])
children = {}
for index, code in enumerate(json.loads((root / "blocks.json").read_text())):
    directory = root / str(index)
    directory.mkdir()
    pid = os.fork()
    if pid == 0:  # the block, as python -c would run it
        os.chdir(directory)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-c"]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        raise SystemExit(0)  # (an exception: its traceback and status 1, as python -c; interpreter shutdown as ever)
    children[pid] = index
while children:
    pid, status = os.wait()
    (root / f"{children.pop(pid)}.status").write_text(str(os.waitstatus_to_exitcode(status)))
"""


class BlockRuns:
    """Every Python block, started together (with the README commands) as forks of one process (FORKED_BLOCKS)."""

    def __init__(self, root: Path):
        self.root = root
        (root / "blocks.json").write_text(json.dumps([code for _, code in PYTHON_BLOCKS]))
        self.proc = subprocess.Popen([sys.executable, "-c", FORKED_BLOCKS, str(root)], cwd=root, env=environment(),
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)  # the blocks in its group, killed with it
        self.done = None

    def result(self, index: int) -> subprocess.CompletedProcess:
        if self.done is None:
            self.done = finish(self.proc)  # all of them
        status, block = self.root / f"{index}.status", self.root / str(index)
        if not status.exists():  # the parent died or timed out first
            return subprocess.CompletedProcess(self.proc.args, self.done.returncode or 1, self.done.stdout,
                                               self.done.stderr)
        return subprocess.CompletedProcess(["python", "-c", PYTHON_BLOCKS[index][0]], int(status.read_text()),
                                           (block / "stdout").read_text(), (block / "stderr").read_text())

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate()


@pytest.fixture(scope="module")
def python_block_runs(tmp_path_factory, command_runs):
    """Every Python block, started together with the README commands."""
    runs = BlockRuns(tmp_path_factory.mktemp("python_blocks"))
    yield runs
    runs.kill()


def test_this_module_runs_on_one_worker(request):
    """Under pytest-xdist's loadgroup a group's node ids end in "@group"; without it every worker would start all of
    this module's commands."""
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@docs"), "xdist_group has no effect: see pyproject.toml's dev extra"


def test_the_docs_have_python_blocks_and_readme_commands():
    assert len([name for name, _ in PYTHON_BLOCKS if name.startswith("README.md")]) >= 3
    assert any(argv[:2] == ["python", "train.py"] and "-m" in argv for argv in COMMANDS)
    assert any(argv[:3] == ["python", "-m", "vqattn.train.sample"] for argv in COMMANDS)


def test_no_test_marker_skips_a_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"text\n\n```python\nprint(1)\n```\n\n{NO_TEST}\n```python\nraise SystemExit(1)\n```\n")
    assert fenced_blocks(doc, "python") == [("doc.md:3", "print(1)\n")]


def backticked_names(line: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", line))


def test_every_registered_attention_is_in_the_training_docs_table_and_the_readmes():
    from vqattn.layers import ATTENTIONS

    training = (ROOT / "docs" / "training.md").read_text().splitlines()
    row = next(line for line in training if line.startswith("| `attention` |"))
    assert backticked_names(row.split("|")[2]) == set(ATTENTIONS)  # the options column
    readme = README.read_text().split("| name | what | decoding state |")[1].split("\n\n")[0]
    listed = set().union(*(backticked_names(line.split("|")[1]) for line in readme.splitlines()[2:]))
    assert listed == set(ATTENTIONS)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    titles = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


@pytest.mark.parametrize("path", DOCS, ids=[str(path.relative_to(ROOT)) for path in DOCS])
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", FENCE.sub("", path.read_text())):
        file, anchor = target
        if file.startswith(("http://", "https://")):
            continue
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to missing {file}"
        if anchor:
            assert anchor in heading_anchors(linked), f"{path.name} links to missing #{anchor} in {linked.name}"


def test_short_forms(tmp_path):
    sweep = short_form(shlex.split("python train.py -m attention=softmax,vq_hard,vq_soft model.n_layer=2"), tmp_path)
    assert sweep.argv[2:] == ["-m", "attention=softmax,vq_hard", "model.n_layer=2", "experiment=tiny",
                              *SHORT_TRAIN, f"hydra.sweep.dir={tmp_path}"]
    run = short_form(shlex.split("python train.py experiment=mqar"), tmp_path / "run")
    assert "experiment=tiny" not in run.argv and f"hydra.run.dir={tmp_path / 'run'}" in run.argv
    sample = short_form(shlex.split("python -m vqattn.train.sample DATE/TIME/last.ckpt --max-new-tokens 300"), tmp_path)
    later = short_form(["python", "train.py"], tmp_path / "later")
    checkpoint = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert resolve(sample, [sweep, run, later])[3:] == [checkpoint, "--max-new-tokens", "8"]
    far = short_form(shlex.split("python benchmarks/far_recall.py sweeps/far --attentions ovq --seeds 0"), tmp_path)
    assert far.argv[1:] == [str(ROOT / "benchmarks" / "far_recall.py"), str(tmp_path), "--attentions", "ovq",
                            "--seeds", "0", "--dry-run"]
    assert short_form(["make", "docs"], tmp_path).error.startswith("no short form")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=[name for name, _ in PYTHON_BLOCKS])
def test_python_block_runs(python_block_runs, index):
    result = python_block_runs.result(index)
    assert result.returncode == 0, f"{PYTHON_BLOCKS[index][0]}\n{report(result)}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[shlex.join(argv)[:60] for argv in COMMANDS])
def test_readme_command_runs(command_runs, index):
    form = command_runs.forms[index]
    assert form.error is None, form.error
    result = command_runs.result(index)
    assert result.returncode == 0, report(result)
    if form.out is not None and form.sweep:
        assert len(list(form.out.glob("*/results.json"))) == 2, report(result)
    elif form.out is not None:
        assert (form.out / "results.json").exists(), report(result)
        results = json.loads((form.out / "results.json").read_text())
        if "trainer=ddp" in form.argv:  # the ranks' codebook statistics stayed identical
            assert results["world_size"] == 2 and results["ddp_buffer_divergence"] == 0.0, results
    if form.argv is not None and form.argv[1:3] == ["-m", "vqattn.train.report"]:
        check_report(Path(resolve(form, command_runs.forms[:index])[3]))


def check_report(sweep: Path) -> None:
    """The report of a sweep: a table row per run, with its throughput, and the validation curves drawn."""
    table = (sweep / "report.md").read_text()
    names = [json.loads(path.read_text())["attention"] for path in sweep.glob("*/results.json")]
    assert len(names) == 2 and all(f"| {name} |" in table for name in names) and "tokens/s" in table, table
    assert (sweep / "val_bpb.png").read_bytes()[:4] == b"\x89PNG"


RUN_TIMES = json.loads((ROOT / "docs" / "run_times.json").read_text())
MINUTES = re.compile(r"(\d+(?:\.\d+)?) min(?:utes)?\b")


def section(path: Path, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of any level, whitespace collapsed."""
    text = path.read_text()
    start = text.index(f"{heading}\n")
    end = re.compile(r"^#", re.M).search(text, start + len(heading) + 1)
    return " ".join(text[start:end.start() if end else None].split())


def quoted_run_times(text: str) -> list[tuple[str, float, str]]:
    """Each run time quoted in running text, as (attention, minutes, condition): the condition is the key of
    run_times.json's conditions whose words follow the figure ("" when none do), the attention the last one named
    before it in its sentence (the default run's, vq_soft, when none is)."""
    phrases = RUN_TIMES["conditions"]
    quoted = []
    for match in MINUTES.finditer(text):
        after = text[match.end():]
        condition = max((key for key, words in phrases.items() if after.startswith(f" {words}")),
                        key=lambda key: len(phrases[key]), default="")  # the longest: "fresh" begins as "idle"
        sentence = re.split(r"\.\s", text[:match.start()])[-1]
        named = re.findall(r"`?(\b(?:" + "|".join(r["attention"] for r in RUN_TIMES["runs"]) + r")\b)", sentence)
        quoted.append((named[-1] if named else "vq_soft", float(match.group(1)), condition))
    return quoted


def test_run_times_in_the_readme_and_docs_agree_with_their_one_source():
    """The default run's time was "about 4 minutes" in the README, 4.2 in training.md and 11.2 in the results table,
    each right for conditions no reader could see: now every figure comes from docs/run_times.json and is followed
    by the conditions it was measured under."""
    measured = {(r["attention"], r["minutes"], r["load"]) for r in RUN_TIMES["runs"]}
    passages = [section(README, "## Install and the two commands"), section(README, "## Results"),
                section(ROOT / "docs" / "training.md", "## The default run"),
                section(ROOT / "docs" / "experiments.md", "## Short context: notes on the default run")]
    quotes = [quote for text in passages for quote in quoted_run_times(re.sub(r"\|[^\n]*\|", "", text))]
    conditions = {q[2] for q in quotes}
    assert len(quotes) >= 5 and "busy" in conditions and conditions <= set(RUN_TIMES["conditions"])
    assert [q for q in quotes if q not in measured] == []
    table = README.read_text().split("## Results", 1)[1].split("\n\n")[2]  # the results table
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    busy = {r["attention"]: r["minutes"] for r in RUN_TIMES["runs"] if r["load"] == "busy"}
    assert {cells[0].strip(): float(cells[3].split()[0]) for cells in rows} == busy
    caption = section(README, "## Results").split("|")[0]
    assert RUN_TIMES["conditions"]["busy"].replace("on one thread", "one thread") in caption or (
        "one thread" in caption and "other work" in caption)


def test_the_suites_times_in_the_readme_are_measured_with_their_conditions():
    """The README said the suite took "about 9 min on 2 idle cores" when a fresh clone took 12.6: each figure of its
    test commands is now an entry of run_times.json's suite, followed by the conditions it was measured under."""
    block = README.read_text().split("## Tests", 1)[1].split("```")[1]
    quoted = []
    for line in block.splitlines():
        command, _, comment = line.partition("#")
        for match in MINUTES.finditer(comment):
            after = comment[match.end():]
            condition = max((key for key, words in RUN_TIMES["conditions"].items() if after.startswith(f" {words}")),
                            key=lambda key: len(RUN_TIMES["conditions"][key]), default="")
            quoted.append((command.strip(), float(match.group(1)), condition))
    measured = {(r["command"], r["minutes"], r["load"]) for r in RUN_TIMES["suite"]}
    assert len(quoted) == 2 and all(q in measured for q in quoted), (quoted, measured)


def test_no_readme_claim_rests_on_a_run_the_docs_call_outdated():
    """A section of docs/ that says its run was measured under older defaults ("not re-run since") is quoted nowhere
    in the README: not linked, and none of its percentages or 3-decimal figures repeated (the README once led with
    "ovq is level with softmax at every position with 6% of its state" from such a run)."""
    readme = " ".join(README.read_text().split())
    outdated = 0
    for path in DOCS[1:]:
        for part in re.split(r"^(?=#)", path.read_text(), flags=re.M):
            if not re.search(r"older defaults|not re-run since", " ".join(part.split()), re.I):
                continue
            outdated += 1
            heading = part.splitlines()[0].lstrip("# ").strip()
            anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
            assert f"{path.name}#{anchor}" not in readme
            claims = set(re.findall(r"\b\d+(?:\.\d+)?% of\b|\b\d\.\d{3}\b", part))
            assert claims and [claim for claim in claims if claim in readme] == []
    assert outdated  # docs/evaluation.md's experiment=long table, at least


def test_the_readme_says_what_the_held_out_task_scores():
    """vqattn_heldout scores the first DOCS x DOC_BYTES bytes of the held-out split, not the trainer's validation
    windows (1.9065 against 2.0092 bpb for the default run): the README's one line says so."""
    from vqattn.hf.tasks.data import DOC_BYTES
    from vqattn.hf.tasks.data import DOCS as TASK_DOCS

    line = section(README, "## Hugging Face: export, generate, lm-eval")
    assert "the trainer's validation bpb on the same text" not in line
    assert f"first {TASK_DOCS * DOC_BYTES // 1024} KB of the default corpus's held-out split" in line
    assert "not the trainer's val bpb" in line
