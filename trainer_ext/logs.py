"""Adding a callback's figures to the Trainer's log entry of this step."""

from __future__ import annotations

__all__ = ["add_to_logs"]


def add_to_logs(state, logs: dict, stats: dict) -> None:
    """Add ``stats`` to ``logs`` (the dict ``on_log`` receives, which reporting callbacks later read), and to the
    ``state.log_history`` entry Trainer already appended for the same step and values, so both show them."""
    history = getattr(state, "log_history", None)
    last = history[-1] if history else None
    same_entry = (
        isinstance(last, dict)
        and last.get("step") == state.global_step
        and all(k in last and last[k] == v for k, v in logs.items())
    )
    logs.update(stats)
    if same_entry:
        last.update(stats)
