import pytest
import torch
from torch import nn

from lightning_memguard.base.snapshot import MiB
from lightning_memguard.monitor.source_choice import measures_step
from lightning_memguard.sources import CpuTensorAccountant
from tests.helpers import CountingBackend, bytes_saved_by_autograd


def test_one_mib_tensor_shows_in_current_and_peak_and_leaves_when_freed():
    acc = CpuTensorAccountant()
    with acc:
        x = torch.empty(MiB // 4, dtype=torch.float32)
        during = acc.read(reset_peak=False)
        del x
        after = acc.read()
    assert during.allocated_bytes == MiB
    assert during.peak_bytes == MiB
    assert after.allocated_bytes == 0
    assert after.peak_bytes == MiB  # the peak of the window survives the free
    assert acc.read().peak_bytes == 0  # ... and the previous read reset it


def test_views_and_inplace_results_count_once():
    acc = CpuTensorAccountant()
    with acc:
        x = torch.zeros(1024, 256)  # 1 MiB
        y = x.view(-1)
        y.add_(1.0)
        z = x[:10]
        reading = acc.read()
    assert reading.allocated_bytes == MiB
    del x, y, z


def test_tracked_tensors_and_backward_are_counted():
    weight = torch.randn(128, 128, requires_grad=True)  # 64 KiB, exists before counting starts
    acc = CpuTensorAccountant()
    acc.track([weight, weight])  # tracked twice, counted once
    assert acc.read().allocated_bytes == 128 * 128 * 4
    with acc:
        inputs = torch.randn(256, 128)
        (inputs @ weight).relu().sum().backward()
        reading = acc.read()
    # weight + its new gradient + the inputs stay alive; the matmul output and relu mask were freed
    assert reading.allocated_bytes == 2 * 128 * 128 * 4 + 256 * 128 * 4
    assert reading.peak_bytes >= reading.allocated_bytes + 256 * 128 * 4


def test_hard_limit_raises_out_of_memory_and_frees_the_output():
    acc = CpuTensorAccountant(limit_bytes=2 * MiB)
    with acc:
        keep = torch.empty(MiB // 4)
        with pytest.raises(torch.OutOfMemoryError, match="limit"):
            torch.empty(2 * MiB // 4)
        reading = acc.read()
    assert reading.allocated_bytes == MiB
    assert reading.num_ooms == 1
    del keep


def test_capacity_is_budget_then_limit():
    assert CpuTensorAccountant().capacity_bytes() is None
    assert CpuTensorAccountant(budget_bytes=10).capacity_bytes() == 10
    assert CpuTensorAccountant(limit_bytes=20).capacity_bytes() == 20


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB"])
def test_bad_budget_is_rejected(value):
    with pytest.raises(ValueError, match="budget_bytes"):
        CpuTensorAccountant(budget_bytes=value)


def test_stop_ends_counting():
    acc = CpuTensorAccountant()
    acc.start()
    acc.stop()
    x = torch.empty(1024)
    assert acc.read().allocated_bytes == 0
    del x


def test_out_and_resize_growing_a_known_storage_are_counted():
    acc = CpuTensorAccountant()
    with acc:
        a, b = torch.ones(MiB // 4), torch.ones(MiB // 4)
        c = torch.empty(0)
        torch.add(a, b, out=c)  # resizes c from 0 to 1 MiB
        assert acc.read(reset_peak=False).allocated_bytes == 3 * MiB
        c.resize_(2 * MiB // 4)
        assert acc.read(reset_peak=False).allocated_bytes == 4 * MiB
        del a, b, c
    assert acc.read().allocated_bytes == 0


# --- compiled code (torch.compile) ----------------------------------------------------------------------------------
def small_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches (and what it decided to skip) belong to the process: each test starts and ends clean."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_code_is_found_wherever_torch_compile_put_it(fresh_dynamo):
    from lightning_memguard.base.compiled import compiled_code

    plain = small_mlp()
    assert compiled_code(plain) == []
    assert compiled_code(torch.compile(plain, backend="eager")) == ["Sequential (torch.compile(module))"]
    outer = torch.nn.Sequential(small_mlp(), torch.nn.Linear(1, 1))
    outer[0] = torch.compile(outer[0], backend="eager")
    assert compiled_code(outer) == ["0 (torch.compile(module))"]
    in_place = small_mlp()
    in_place[2].compile(backend="eager")
    assert compiled_code(in_place) == ["2 (module.compile())"]
    methods = small_mlp()  # what Lightning does with trainer.fit(torch.compile(lightning_module))
    methods.forward = torch.compile(methods.forward, backend="eager")
    assert compiled_code(methods) == ["Sequential (compiled forward)"]
    assert compiled_code(plain) == []


def _one_step(model, x, acc=None):
    if acc is not None:
        acc.track(model.parameters())
        acc.start()
    try:
        model(x).pow(2).mean().backward()
    finally:
        if acc is not None:
            acc.stop()
    return acc.read() if acc is not None else None


def test_compiled_code_compiles_and_runs_under_the_counting_and_a_later_compile_still_compiles(fresh_dynamo):
    x = torch.randn(32, 16)
    guarded = CountingBackend()
    model = small_mlp()
    compiled = torch.compile(model, backend=guarded)
    _one_step(compiled, x, CpuTensorAccountant())
    # dynamo compiled with the mode on the stack (the mode says ignore_compile_internals) and the graph ran
    assert guarded.compiled >= 1 and guarded.calls >= 1
    # nothing was remembered as "skip": a fresh compile of the same classes, after the counting, compiles and runs
    later = CountingBackend()
    _one_step(torch.compile(small_mlp(1), backend=later), x)
    assert later.compiled >= 1 and later.calls >= 1


def test_counting_sees_all_of_aot_eager_compiled_code(fresh_dynamo):
    # aot_eager runs every aten op of the compiled graph through the dispatcher, so the counts are eager's. (Inductor
    # allocates its kernels' buffers directly, unseen: that is why a guard does not count a compiled model. Not run
    # here: an inductor compile takes tens of seconds.)
    x = torch.randn(256, 16)
    eager = _one_step(small_mlp(), x, CpuTensorAccountant())
    model = small_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    _one_step(compiled, x)  # compiles (uncounted)
    model.zero_grad(set_to_none=True)
    reading = _one_step(compiled, x, CpuTensorAccountant())
    assert reading.allocated_bytes == eager.allocated_bytes
    # the same to a 0-dim scalar (aot_autograd's graph may keep one where eager's autograd keeps none)
    assert abs(reading.peak_bytes - eager.peak_bytes) <= 8 and reading.peak_bytes > 100 * 1024


def test_switched_off_accountant_reads_nothing_and_never_counts():
    acc = CpuTensorAccountant(budget_bytes=10 * MiB, limit_bytes=MiB)
    acc.track([torch.ones(1024)])
    acc.switch_off()
    acc.track([torch.ones(1024)])
    with acc:
        assert not acc.started
        big = torch.empty(2 * MiB // 4)  # over the hard limit: not enforced, nothing is counted
    reading = acc.read()
    assert (reading.allocated_bytes, reading.peak_bytes, reading.num_ooms) == (None, None, None)
    assert acc.capacity_bytes() == 10 * MiB
    del big


def test_compiled_code_runs_eagerly_inside_and_leaves_dynamo_as_it_was(fresh_dynamo):
    from lightning_memguard.sources.cpu import NewTensorMode, compiled_code_runs_eagerly

    x = torch.randn(8, 16)
    backend = CountingBackend()
    compiled = torch.compile(small_mlp(), backend=backend)
    ops = []
    with compiled_code_runs_eagerly(), NewTensorMode(ops.append):
        compiled(x).sum().backward()
    assert backend.compiled == 0 and backend.calls == 0 and ops  # ran uncompiled, every op seen
    with pytest.raises(RuntimeError, match="inside"), compiled_code_runs_eagerly():
        raise RuntimeError("inside")
    compiled(x).sum().backward()  # the stance is back to default: it compiles now
    assert backend.compiled == 1 and backend.calls == 1


def test_unbind_from_original_makes_a_copy_run_its_own_parameters(fresh_dynamo):
    import copy

    from lightning_memguard.sources.cpu import unbind_from_original

    model = small_mlp()
    model.forward = torch.compile(model.forward, backend="eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.zero_()
        twin[2].bias.fill_(3.0)
    x = torch.randn(4, 16)
    assert not torch.equal(twin(x), torch.full((4, 1), 3.0))  # deepcopy kept the original's bound forward
    unbind_from_original(twin)
    assert torch.equal(twin(x), torch.full((4, 1), 3.0))
    assert "forward" in vars(model) and not torch.equal(model(x), twin(x))  # the original is untouched

    in_place = small_mlp()
    in_place.compile(backend="eager")
    wrapped = torch.compile(small_mlp(), backend="eager")
    for original in (in_place, wrapped):
        twin = copy.deepcopy(original)
        unbind_from_original(twin)
        head = list(twin.modules())[-1]
        with torch.no_grad():
            head.weight.zero_()
            head.bias.fill_(3.0)
        assert torch.equal(twin(x), torch.full((4, 1), 3.0))


def test_a_step_recorded_from_a_switched_off_accountant_has_rows_without_values():
    from lightning_memguard.monitor.recorder import StepRecorder

    acc = CpuTensorAccountant(budget_bytes=MiB)
    acc.switch_off()
    recorder = StepRecorder(acc)
    for phase in ("batch_start", "after_forward", "after_backward", "after_forward", "after_backward"):
        recorder.observe(0, phase)  # two micro-batches: the second read of a phase would take a max of peaks
    recorder.observe(0, "after_optimizer_step")
    rows = recorder.finish()
    assert [r.phase for r in rows] == ["batch_start", "after_forward", "after_backward", "after_optimizer_step"]
    assert all(r.allocated_bytes is None and r.peak_bytes is None and r.capacity_bytes == MiB for r in rows)
    assert [r.micro_batches for r in rows] == [2, 2, 2, 2]  # every row of the step says its micro-batches


# --- what steps that are not counted leave alive in the model: counted when counting resumes -----------------------
def counted_then_skipped(model, batch):
    """An accountant that counted step 0 and is off for step 1 (``cpu_sample_every=2``), and its step-0 reading."""
    acc = CpuTensorAccountant()
    assert measures_step(acc, 0, 2, model, list, batch)
    counted = acc.read().allocated_bytes
    assert not measures_step(acc, 1, 2, model, list, batch)
    return acc, counted


def test_tensors_a_skipped_step_kept_in_the_model_are_counted_when_counting_resumes():
    model = nn.Linear(16, 16)
    model.outputs = {"train": []}  # a dict of lists, as a LightningModule might keep them
    acc, counted = counted_then_skipped(model, None)
    model.outputs["train"].append(torch.empty(1024))  # 4 KiB, born while the accountant is off
    model.outputs["train"].append(torch.empty(1024)[:10])  # a view: its storage once
    assert measures_step(acc, 2, 2, model, list, None)
    assert acc.read().allocated_bytes == counted + 2 * 4096
    acc.stop()


@pytest.mark.parametrize("retain_graph", [True, False], ids=["graph_kept", "graph_freed_by_backward"])
def test_a_loss_kept_on_a_skipped_step_is_counted_with_what_its_graph_still_saves(retain_graph):
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(8, 16)
    model.kept = []
    acc, counted = counted_then_skipped(model, (x,))
    loss = model(x).sum()
    loss.backward(retain_graph=retain_graph)
    model.kept.append(loss)
    assert measures_step(acc, 2, 2, model, list, (x,))
    gradients = sum(p.grad.nbytes for p in model.parameters())  # the training state, counted as ever
    allocated = acc.read().allocated_bytes
    acc.stop()  # before the count of what the graph saves: its forward is not the step's
    # a graph backward freed saved nothing that is still alive: the loss counts only itself
    saved = bytes_saved_by_autograd(lambda: model(x).sum(), (*model.parameters(), x)) if retain_graph else 0
    assert allocated == counted + gradients + saved + loss.nbytes


def test_what_runs_while_counting_is_paused_is_not_counted_by_the_accountants_already_counting():
    """An estimate made mid-fit (a plan that waited for a batch, a level estimated when first asked) runs on the
    training thread while the guard's accountant counts: its copies and activations are MemGuard's, not the
    training's, and went into the next step's batch-start peak. An accountant started inside (the estimate's own)
    counts as usual, and none raises at its limit for what it does not count."""
    from lightning_memguard.sources.cpu import counting_paused

    guard = CpuTensorAccountant(limit_bytes=2 * MiB)
    with guard:
        kept = torch.empty(MiB // 4)
        with counting_paused():
            estimates = CpuTensorAccountant()
            with estimates:
                scratch = torch.empty(4 * MiB // 4)  # over the guard's limit: not its to count
            del scratch
        after = torch.empty(MiB // 4)  # counted again
        reading = guard.read()
    assert estimates.read().peak_bytes == 4 * MiB
    assert (reading.allocated_bytes, reading.peak_bytes, reading.num_ooms) == (2 * MiB, 2 * MiB, 0)
    del kept, after
