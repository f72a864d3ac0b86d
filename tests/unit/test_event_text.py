"""The events as the demo and the report command print them (:func:`~lightning_memguard.monitor.summary.format_events`),
read from a real run's events file where it matters."""

import pandas as pd

from lightning_memguard.monitor.summary import format_events

REASON = ("amp 1, checkpointing 4, microbatch 0 settled at 2649.0 ms a step; timing amp 1, checkpointing 0, "
          "microbatch 1, predicted to fit too (step peak 59.0 MiB, under 66.3 MiB)")


def events(*rows):
    return pd.DataFrame(rows, columns=["step", "action", "rung", "level", "reason"])


def test_a_decision_that_moved_two_rungs_is_said_once_with_both_and_its_reason_wrapped():
    text = format_events(events((4, "speed_trial", "checkpointing", 0, REASON), (4, "speed_trial", "microbatch", 1,
                                                                                REASON)))
    lines = text.splitlines()
    assert lines[0] == "step 4  speed_trial  checkpointing 0, microbatch 1"
    assert all(line.startswith("    ") and len(line) <= 100 for line in lines[1:])
    assert " ".join(line.strip() for line in lines[1:]) == REASON  # said once, whole
    assert text.count("settled at") == 1


def test_events_without_a_rung_or_level_and_the_same_reason_at_other_steps_stay_apart():
    text = format_events(events((0, "plan", float("nan"), float("nan"), "the plan"), (3, "apply", "amp", 1.0, "near"),
                                (5, "apply", "amp", 1.0, "near"), (5, "keep", "amp", 1.0, "near")))
    assert [line for line in text.splitlines() if line.startswith("step")] == [
        "step 0  plan", "step 3  apply  amp 1", "step 5  apply  amp 1", "step 5  keep  amp 1"]
    assert "nan" not in text
    assert format_events(events()) == "(no events)"


def test_the_monitor_says_one_decisions_reason_once_and_keeps_every_event(tmp_path):
    """As the speed trial does: one decision, an event for each rung it moves, with one reason."""
    from lightning_memguard.base.host import Host
    from lightning_memguard.base.snapshot import Event
    from lightning_memguard.monitor.monitor import MemoryMonitor

    said = []
    monitor = MemoryMonitor("the test")
    monitor.host = Host(info=said.append, warn=said.append)
    for rung, level in (("checkpointing", 0), ("microbatch", 1)):
        monitor.record(Event(step=4, action="speed_trial", rung=rung, reason=REASON, level=level))
    monitor.record(Event(step=8, action="speed_trial", rung="checkpointing", reason=REASON, level=4))
    assert said == [f"lightning-memguard step 4: speed_trial checkpointing - {REASON}",
                    "lightning-memguard step 4: speed_trial microbatch - the same decision as the line before",
                    f"lightning-memguard step 8: speed_trial checkpointing - {REASON}"]
    assert list(monitor.events["reason"]) == [REASON] * 3  # the events keep their reasons whole


def test_a_figure_and_its_unit_stay_on_one_line():
    # indented by 4, the figure ends at column 99: its unit would start the next line
    figures = "; ".join(f"amp+{b} blocks: {70 + b}.5 MiB" for b in range(9))
    reason = "x" * 90 + " 77.5 MiB under the capacity; " + figures
    lines = format_events(events((0, "plan", "", None, reason))).splitlines()[1:]
    assert len(lines) > 2 and all(len(line) <= 100 for line in lines)
    assert lines[0] == "    " + "x" * 90 and lines[1].startswith("    77.5 MiB under")
    assert not any(line.strip().split(" ")[0] in ("MiB", "blocks:") for line in lines)
    assert " ".join(line.strip() for line in lines) == reason
