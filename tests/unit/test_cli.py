"""The three commands: the examples their help prints run as printed; bad input is one line on stderr and exit code
2, never a traceback; `report` reads runs that are partial or broken in every way a killed or edited run can be."""

import csv
import json
import os
import re
import shlex
import subprocess
import sys

import pandas as pd
import pytest

from lightning_memguard.base.snapshot import SNAPSHOT_COLUMNS
from lightning_memguard.commands.cli import main

FACTORY = "lightning_memguard.commands.demo:TinyGPT"


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["estimate", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
    (["estimate", "lightning_memguard.commands.demo:Nope"], "has no attribute 'Nope'"),
    (["estimate", "lightning_memguard.commands.demo"], "expected an importable 'module:callable'"),
    (["estimate", "lightning_memguard.commands.demo:__doc__"], "not a callable"),
    (["estimate", "lightning_memguard.commands.demo:DemoTransformer", "--batch", "2x-3"], "--batch '2x-3'"),
    (["estimate", FACTORY, "--batch", "2x16:int64:0"], "--batch '2x16:int64:0'"),
    (["estimate", FACTORY, "--batch", "2x16:complex"], "--batch '2x16:complex'"),
    (["estimate", FACTORY, "--batch", "2x16:abs"], "--batch '2x16:abs'"),
    (["estimate", FACTORY, "--batch", ""], "--batch ''"),
    (["estimate", FACTORY, "--batch", "99999x99999x99"], "elements"),
    (["estimate", FACTORY, "--batch", "2x16:float32"], "does not fit TinyGPT's training step"),
    (["estimate", FACTORY, "--precision", "64"], "invalid choice"),
    (["estimate", FACTORY, "--strategy", "zero3"], "invalid choice"),
    (["estimate", FACTORY, "--strategy", "fsdp", "--world-size", "0"], "world_size=0"),
    (["estimate", FACTORY, "--world-size", "4"], "world_size=4 needs strategy="),
    (["demo", "--steps", "0"], "'0' must be a positive int"),
    (["demo", "--steps", "many"], "'many' must be a positive int"),
    (["demo", "--budget", "5XB"], "unknown unit"),
    (["demo", "--budget=-1MiB"], "--budget='-1MiB' is not a size"),
    (["report"], "the following arguments are required: run"),
    (["teleport"], "invalid choice"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv, says, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and says in err, err


def write_history(path, rows, cut_last=False):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SNAPSHOT_COLUMNS)
        writer.writerows(rows)
    if cut_last:  # a process killed in the middle of writing its last row
        with open(path, "rb+") as f:
            f.truncate(f.seek(0, 2) - 40)


def row(step, phase, peak):
    values = dict.fromkeys(SNAPSHOT_COLUMNS, "")
    values.update(step=step, phase=phase, device="cpu", allocated_bytes=peak // 2, peak_bytes=peak,
                  capacity_bytes=10 * 2**20, micro_batches=1, time=0.0)
    return [values[c] for c in SNAPSHOT_COLUMNS]


ROWS = [row(s, p, (s + 1) * 2**20) for s in range(3) for p in ("batch_start", "after_forward", "after_backward",
                                                                 "after_optimizer_step")]


def test_header_only_history_says_no_steps_yet(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", [])
    assert main(["report", str(tmp_path)]) == 0
    assert "no steps recorded yet" in capsys.readouterr().out


def test_a_cut_last_row_is_skipped_with_a_note(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", ROWS, cut_last=True)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "note: the last row of memguard_history.csv was cut off" in out
    assert "steps 0-2" in out and (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.parametrize("content,says", [
    (b"", "is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "cannot be read as text"),
    (b"a,b,c\n1,2,3\n", "lacks the column(s)"),
    ((",".join(SNAPSHOT_COLUMNS) + "\n" + ",".join(["1"] * 20) + "\n" + ",".join(["1"] * 14) + "\n").encode(),
     "not a readable CSV"),
    ((",".join(SNAPSHOT_COLUMNS) + "\n" + ",".join(["oops"] * len(SNAPSHOT_COLUMNS)) + "\n").encode(),
     "steps that are not numbers"),
])
def test_an_unreadable_history_is_one_line(tmp_path, capsys, content, says):
    (tmp_path / "memguard_history.csv").write_bytes(content)
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("events,settings,note", [
    ("step,reason\n1,x\n", None, "events left out"),
    (None, "{not json", "memguard_run.json left out"),
    (None, "[1, 2]", "memguard_run.json left out"),
])
def test_broken_events_or_settings_are_left_out_with_a_note(tmp_path, capsys, events, settings, note):
    write_history(tmp_path / "memguard_history.csv", ROWS)
    if events is not None:
        (tmp_path / "memguard_events.csv").write_text(events)
    if settings is not None:
        (tmp_path / "memguard_run.json").write_text(settings)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert f"note: {note}" in out and "Per-phase peaks" in out


def test_report_reads_events_and_threshold(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", ROWS)
    (tmp_path / "memguard_run.json").write_text(json.dumps({"threshold": 0.8}))
    (tmp_path / "memguard_events.csv").write_text("step,action,rung,reason,level\n1,apply,amp,near the limit,1\n")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "threshold 0.8" in out and "near the limit" in out and "note:" not in out


def test_demo_prints_commands_that_run_as_printed(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "8",
                 "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = [line for line in lines if "-m lightning_memguard report" in line]
    board = [line for line in lines if "-m tensorboard.main --logdir" in line]
    assert report and report[0].startswith(sys.executable + " ")
    assert board and board[0].startswith(sys.executable + " ")


def test_the_demo_without_a_budget_guards_one_it_derived_and_acts(tmp_path, capsys):
    """Without --budget the demo must still show what MemGuard does (on an 80 GB GPU a fixed small model would draw
    flat lines): it derives a budget from the first batch's estimate, says so, and the ladder acts."""
    assert main(["demo", "--steps", "3", "--layers", "2", "--batch-size", "16", "--seq-len", "32",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    said = re.search(r"so the demo guards ([0-9.]+) MiB", out)
    assert said, out
    events = pd.read_csv(next(tmp_path.rglob("memguard_events.csv")))
    assert set(events["action"]) & {"plan", "apply", "rescue", "predicted_split"}, events
    run = json.loads(next(tmp_path.rglob("memguard_run.json")).read_text())
    assert run["budget_bytes"] == pytest.approx(float(said.group(1)) * 2**20, abs=0.05 * 2**20)  # printed: 0.1 MiB


def test_the_demo_monitor_only_guards_no_budget(tmp_path, capsys):
    assert main(["demo", "--steps", "1", "--layers", "1", "--batch-size", "2", "--seq-len", "8", "--monitor-only",
                 "--out", str(tmp_path)]) == 0
    assert "demo guards" not in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one or the other
        main(["demo", "--budget", "10MiB", "--monitor-only"])


# --- the help's examples, run as printed -------------------------------------------------------------------------

EXAMPLE_LINE = re.compile(r"^  \S+ -m lightning_memguard (.+)$", re.MULTILINE)
INTERPRETER = re.compile(r"^  (\S+) -m lightning_memguard ", re.MULTILINE)


def test_the_help_names_an_interpreter_that_runs_it(tmp_path):
    """The examples start with the interpreter the help ran in, as the reader can type it: its path where plain
    ``python`` is another one (a virtual environment not activated), so they run as printed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # a shell whose python is not this environment's
    shown = subprocess.run([sys.executable, "-m", "lightning_memguard", "--help"], capture_output=True, cwd=root,
                           text=True, timeout=300, check=True, env=env).stdout
    interpreters = set(INTERPRETER.findall(shown))
    assert len(interpreters) == 1
    (interpreter,) = interpreters
    assert os.path.realpath(os.path.join(root, interpreter)) == os.path.realpath(sys.executable)


def help_text(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_command_help_ends_in_examples_of_that_command(capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
    everything = subprocess.run([sys.executable, "-m", "lightning_memguard", "--help"], capture_output=True, cwd=root,
                                text=True, timeout=300, check=True).stdout  # the help as a user's shell prints it
    listed = EXAMPLE_LINE.findall(everything)
    for command in ("demo", "report", "estimate"):
        own = EXAMPLE_LINE.findall(help_text([command], capsys))
        assert own and all(shlex.split(line)[0] == command for line in own), own
        assert all(line in listed for line in own)  # the top-level help lists every command's examples
    assert len(listed) == len(set(listed)) >= 4


def test_the_help_examples_run_as_printed(tmp_path, monkeypatch, capsys):
    """Every example line of ``--help``, in the printed order, from an empty directory: the demo trains (on CPU the
    budget is crossed and a rung applied), the report reads that run and draws it, the estimates print their peaks."""
    examples = EXAMPLE_LINE.findall(help_text([], capsys))
    monkeypatch.chdir(tmp_path)
    ran = []
    for line in examples:
        argv = shlex.split(line)
        assert main(argv) == 0, line
        out = capsys.readouterr().out
        command = argv[0]
        ran.append(command)
        if command == "demo":
            assert "Per-phase memory" in out and "memguard_history.csv" in out
            if not torch.cuda.is_available():  # live CPU tensors are deterministic: 41 MiB against 0.9 x 40 MiB
                # over 95 % of the budget: the plan sets the rungs before the first step (else a rung is applied)
                assert re.search(r"^step \d+  (apply|plan)\b", out, re.MULTILINE), out
        elif command == "report":
            assert "Per-phase peaks" in out and os.path.getsize(out.split("plot: ")[1].strip()) > 1000
        else:
            assert "PEAK" in out and "on cuda" in out, out
            if "--variants" in argv:
                assert "checkpoint 6/6 blocks" in out
            if "bf16-mixed" in argv:
                assert "(bf16-mixed" in out
    assert ran[:2] == ["demo", "report"] and "estimate" in ran
    assert {p.name for p in tmp_path.iterdir()} == {"memguard_runs"}  # nothing written elsewhere


# --- estimate: any model (transformers models, dict batches, factories that return a batch, --loss) -------------

from collections import Counter  # noqa: E402

import torch  # noqa: E402

from lightning_memguard import estimate_memory  # noqa: E402
from lightning_memguard.estimate.losses import default_loss  # noqa: E402
from tests.models import pl  # noqa: E402
from tests.zoo.models import build, loss_of  # noqa: E402

HERE = __name__  # the factories below are importable as tests.unit.test_cli:NAME
CALLS = Counter()


def gpt2():
    CALLS["gpt2"] += 1
    return build("gpt2")[0]


def gpt2_and_batch():
    CALLS["gpt2_and_batch"] += 1
    model, make = build("gpt2")
    return model, make(0, batch_size=4, padded=False)


def gpt2_and_encoding():
    model, make = build("gpt2")
    return model, make(0, batch_size=4, padded=True, encoding=True)


def counting_loss(model, batch):
    CALLS["counting_loss"] += 1
    return model(**batch).loss


# stays here: a factory these tests name (tests.unit.test_cli:no_data), with no data on purpose
class NoDataModule(pl.LightningModule):
    """A LightningModule whose data come from elsewhere (a DataModule): no train_dataloader of its own."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def no_data():
    CALLS["no_data"] += 1
    return NoDataModule()


def fails_with_its_repr():
    model = build("gpt2")[0]
    raise TypeError(f"cannot train {model!r}\nbecause n_head=4 does not divide n_embd=30")


def returns_three():
    return build("gpt2")[0], {}, 1


def estimate_output(argv, capsys):
    assert main(["estimate", *argv, "--target", "cpu"]) == 0
    return capsys.readouterr().out


def line(output: str, label: str) -> str:
    return next(row for row in output.splitlines() if row.strip().startswith(label))


GPT2_BATCH = ["--batch", "input_ids=4x16:int64:128", "--batch", "labels=4x16:int64:128"]


def test_a_transformers_model_with_a_dict_batch_is_estimated_with_its_own_loss(capsys):
    out = estimate_output([f"{HERE}:gpt2", *GPT2_BATCH], capsys)
    ids = torch.randint(0, 128, (4, 16))
    model = build("gpt2")[0]
    with_loss = estimate_memory(model, {"input_ids": ids, "labels": ids}, loss_fn=loss_of, target="cpu")
    # no labels, no loss in the output: the logits' sum stands in
    stand_in = estimate_memory(model, {"input_ids": ids}, loss_fn=default_loss, target="cpu")
    assert with_loss.activations_bytes != stand_in.activations_bytes  # the check below can tell them apart
    assert line(out, "PEAK") == line(str(with_loss), "PEAK")
    assert line(out, "activations ") == line(str(with_loss), "activations ")


@pytest.mark.parametrize("loss", ["loss", "tests.zoo.models.loss_of", "tests.zoo.models:loss_of"])
def test_loss_by_attribute_or_dotted_path_gives_the_default_loss_estimate(loss, capsys):
    default = estimate_output([f"{HERE}:gpt2", *GPT2_BATCH], capsys)
    given = estimate_output([f"{HERE}:gpt2", *GPT2_BATCH, "--loss", loss], capsys)
    assert line(given, "PEAK") == line(default, "PEAK") and line(given, "activations ") == line(default, "activations ")


def test_a_loss_by_dotted_path_is_the_one_called(capsys):
    CALLS.clear()
    estimate_output([f"{HERE}:gpt2", *GPT2_BATCH, "--loss", f"{HERE}.counting_loss"], capsys)
    assert CALLS["counting_loss"] == 1  # the warm-up step; the measured step replays it (estimate/step_replay.py)
    assert CALLS["gpt2"] == 1


@pytest.mark.parametrize("factory", ["gpt2_and_batch", "gpt2_and_encoding"])
def test_a_factory_may_return_the_model_and_its_batch_and_is_called_once(factory, capsys):
    CALLS.clear()
    out = estimate_output([f"{HERE}:{factory}"], capsys)
    model, batch = globals()[factory]()
    expected = estimate_memory(model, batch, loss_fn=loss_of, target="cpu")
    assert line(out, "PEAK") == line(str(expected), "PEAK")
    assert CALLS["gpt2_and_batch"] == (2 if factory == "gpt2_and_batch" else 0)  # once by the CLI, once here


def test_a_model_from_its_train_dataloader_is_built_once(capsys):
    CALLS.clear()
    assert main(["estimate", f"{HERE}:no_data", "--batch", "8x16", "--target", "cpu"]) == 0
    assert "PEAK" in capsys.readouterr().out and CALLS["no_data"] == 1


def test_a_lightning_module_without_train_dataloader_is_one_line_that_says_give_a_batch(capsys):
    CALLS.clear()
    code, err = run_cli(["estimate", f"{HERE}:no_data"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "NoDataModule.train_dataloader() gave no batch" in err and "give --batch" in err
    assert CALLS["no_data"] == 1


@pytest.mark.parametrize("argv,says,not_said", [
    ([f"{HERE}:fails_with_its_repr"], "because n_head=4 does not divide n_embd=30", "(transformer)"),
    ([f"{HERE}:fails_with_its_repr"], "TypeError: cannot train GPT2LMHeadModel(...)", "\n  "),
    ([f"{HERE}:returns_three"], "returned a tuple of 3 (GPT2LMHeadModel, dict, int)", "(transformer)"),
    ([f"{HERE}:gpt2", "--batch", "input_ids=4x16:int64:128", "--loss", "loss"],  # no labels: no loss
     "has no tensor under 'loss': give another --loss",
     "(transformer)"),
    ([f"{HERE}:gpt2", "--batch", "pixel_values=4x3x8x8"], "You have to specify either input_ids", "(wte)"),
    ([f"{HERE}:gpt2", "--batch", "input_ids=4x16:int64:128", "--batch", "4x16"], "not both", "Traceback"),
    ([f"{HERE}:gpt2", "--batch", "ids=4x16:int64:128", "--batch", "ids=4x16:int64:128"], "given twice", "Traceback"),
    ([f"{HERE}:gpt2", "--batch", "input-ids=4x16:int64:128"], "not a keyword name", "Traceback"),
    ([f"{HERE}:gpt2", "--batch", "input_ids=4x0:int64:128"], "--batch 'input_ids=4x0:int64:128'", "Traceback"),
    ([f"{HERE}:gpt2", *GPT2_BATCH, "--loss", "no_such_module_xyz.loss"], "cannot import 'no_such_module_xyz'", "\n "),
    ([f"{HERE}:gpt2", *GPT2_BATCH, "--loss", "tests.zoo.models.VOCAB"], "not a callable", "\n "),
])
def test_estimate_errors_are_one_line_with_the_reason(argv, says, not_said, capsys):
    code, err = run_cli(["estimate", *argv, "--target", "cpu"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert says in err and not_said not in err, err


# stays here: the shapes of its return value are what the test below checks
class Returns(torch.nn.Module):
    """A plain module whose forward returns its loss in one of the shapes models use."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape, self.layer = shape, torch.nn.Linear(4, 4)

    def forward(self, x, y=None):
        out = self.layer(x)
        loss = (out - (x if y is None else y)).square().mean()
        return {"dict": {"loss": loss, "logits": out}, "scalar": loss, "tuple": (out, out * 2)}[self.shape]


@pytest.mark.parametrize("shape,batch,expected", [
    ("dict", {"x": torch.ones(2, 4), "y": torch.zeros(2, 4)}, lambda m, b: m(**b)["loss"]),  # the "loss" key
    ("scalar", (torch.ones(2, 4),), lambda m, b: m(*b)),  # a scalar tensor is the loss
    ("tuple", torch.ones(2, 4), lambda m, b: sum(t.sum() for t in m(b))),  # no loss: the outputs' sum stands in
])
def test_the_default_loss_reads_the_loss_a_model_returns(shape, batch, expected):
    model = Returns(shape)
    assert torch.equal(default_loss(model, batch), expected(model, batch))


def test_estimate_one_rank_of_an_fsdp_run(capsys):
    one = estimate_output([FACTORY, "--optimizer", "adamw"], capsys)
    rank = estimate_output([FACTORY, "--optimizer", "adamw", "--strategy", "fsdp", "--world-size", "8"], capsys)
    assert "one rank of 8 under fsdp" in rank and "fsdp_gathered" in rank
    parameters = [line(out, "parameters").split()[-2:] for out in (one, rank)]
    assert parameters[0] != parameters[1]  # each rank holds an eighth of the parameters
