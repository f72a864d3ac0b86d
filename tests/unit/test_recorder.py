from lightning_memguard.monitor.recorder import StepRecorder
from tests.helpers import ScriptedSource, r


def test_accumulation_takes_the_max_peak_over_micro_batches():
    source = ScriptedSource([r(10, 11), r(50, 90), r(20, 70),  # micro-batch 1
                             r(12, 30), r(55, 80), r(22, 95),  # micro-batch 2
                             r(15, 40)])                       # optimizer step
    recorder = StepRecorder(source)
    for phase in ("batch_start", "after_forward", "after_backward") * 2:
        assert recorder.observe(3, phase) == []
    recorder.observe(3, "after_optimizer_step")
    snaps = {s.phase: s for s in recorder.finish()}
    assert snaps["after_forward"].peak_bytes == 90
    assert snaps["after_backward"].peak_bytes == 95
    assert snaps["after_forward"].allocated_bytes == 55  # the last micro-batch's
    # every row of the step counts its micro-batches, the optimizer step's too (it ran once, for both)
    assert {s.micro_batches for s in snaps.values()} == {2}
    assert all(s.step == 3 and s.capacity_bytes == 1000 for s in snaps.values())
    assert recorder.pending_step is None


def test_a_step_without_optimizer_step_is_handed_back_not_lost():
    recorder = StepRecorder(ScriptedSource([r(1, 1), r(2, 2), r(3, 3)]))
    recorder.observe(0, "batch_start")
    recorder.observe(0, "after_forward")
    leftover = recorder.observe(1, "batch_start")
    assert [(s.step, s.phase) for s in leftover] == [(0, "batch_start"), (0, "after_forward")]
    assert recorder.pending_step == 1


def test_a_failed_attempts_passes_are_not_counted_but_its_peaks_are_kept():
    source = ScriptedSource([r(10, 10), r(30, 30),          # batch start, a forward counted before the attempt
                             r(40, 90),                     # a failed attempt's forward: it reached 90
                             r(35, 60), r(20, 50),          # the attempt run again: two micro-batches
                             r(36, 65), r(21, 55), r(15, 40)])  # ... and the optimizer step
    recorder = StepRecorder(source)
    recorder.begin_attempt()
    for phase in ("batch_start", "after_forward"):
        recorder.observe(0, phase)
    recorder.begin_attempt()
    recorder.observe(0, "after_forward")
    recorder.forget_attempt()
    recorder.begin_attempt()
    for phase in ("after_forward", "after_backward", "after_forward", "after_backward", "after_optimizer_step"):
        recorder.observe(0, phase)
    snaps = {s.phase: s for s in recorder.finish()}
    # the failed attempt's forward is not counted: 3 forwards, not 4, on every row of the step
    assert {phase: s.micro_batches for phase, s in snaps.items()} == {
        "batch_start": 3, "after_forward": 3, "after_backward": 3, "after_optimizer_step": 3}
    assert snaps["after_forward"].peak_bytes == 90 and snaps["after_forward"].allocated_bytes == 36
