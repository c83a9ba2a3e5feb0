"""Checkpointing's figures in the tools a framework's users already watch, after every save of an adapter:
the HF Trainer's reporting integrations (TensorBoard, W&B, ... through their ``on_log``), Lightning's loggers
(``log_metrics``), and one log line for Megatron and DeepSpeed (their own loggers).

The figures (``figures``): ``flashckpt/pause_s`` (how long training waited for this save),
``flashckpt/snapshot_mb``, ``flashckpt/durable_step`` (the newest step committed on the checkpoint dir),
``flashckpt/lag_s`` (how far the checkpoint dir is behind the newest storage save), and once a persist of this
rank finished ``flashckpt/persist_s`` (the newest one's seconds) and ``flashckpt/persist_mb_s``; as of the news
the save brought (``CheckpointEngine.stats(refresh=False)``: no round trip). Reporting never fails a save: an
error is logged once and reporting stops for that adapter.
"""

from __future__ import annotations

import logging
from typing import Any

from flashckpt.engine.events import Stats

__all__ = ["figures", "line", "report_hf", "report_lightning", "report_line"]

log = logging.getLogger(__name__)
# (Public, not ``_telemetry``: patches/megatron uses it too, and patches import no private integrations module.)


def figures(s: Stats) -> dict[str, float]:
    """The figures of ``s`` (see the module docstring), all numbers."""
    out = {"flashckpt/pause_s": s.pause_s_last, "flashckpt/snapshot_mb": s.snapshot_bytes / 1e6, "flashckpt/lag_s": s.lag_s}
    if s.durable_step is not None:
        out["flashckpt/durable_step"] = float(s.durable_step)
    if s.persist_s_last is not None:
        out["flashckpt/persist_s"] = s.persist_s_last
    if s.persist_mb_per_s is not None:
        out["flashckpt/persist_mb_s"] = s.persist_mb_per_s
    return out


def line(step: int | None, s: Stats) -> str:
    """The figures as one line (Megatron's and DeepSpeed's logs)."""
    durable = "nothing yet" if s.durable_step is None else f"step {s.durable_step}"
    persist = "" if s.persist_s_last is None else f"; last persist {s.persist_s_last:.2f} s" + (
        f" ({s.persist_mb_per_s:.0f} MB/s)" if s.persist_mb_per_s else "")
    return (f"flashckpt: checkpoint of step {step}: {s.snapshot_bytes / 1e6:.1f} MB in memory, training paused "
            f"{s.pause_s_last * 1e3:.1f} ms; durable: {durable} (lag {s.lag_s:.1f} s){persist}")


class _Once:
    """Reporting that logs its first error and then stops."""

    def __init__(self) -> None:
        self.broken = False

    def run(self, what: str, fn: Any, *args: Any) -> None:
        if self.broken:
            return
        try:
            fn(*args)
        except Exception as e:  # a logger's failure never fails a checkpoint
            self.broken = True
            log.warning("reporting checkpoint figures to %s failed (%s: %s); not reported again", what,
                        type(e).__name__, e)


_hf = _Once()
_lightning = _Once()


def report_hf(trainer: Any, engine: Any) -> None:
    """Hands the figures to the Trainer's reporting integrations (``report_to``: TensorBoard, W&B, MLflow,
    ...), at the Trainer's global step, through their ``on_log``: not to its console printer nor into
    ``state.log_history`` (a resumed run's history stays the Trainer's own)."""
    def send() -> None:
        logs = figures(engine.stats(refresh=False))
        for cb in trainer.callback_handler.callbacks:
            if type(cb).__module__.startswith("transformers.integrations"):
                cb.on_log(trainer.args, trainer.state, trainer.control, logs=dict(logs))
    _hf.run("the Trainer's report_to integrations", send)


def report_lightning(trainer: Any, engine: Any) -> None:
    """Logs the figures to the Lightning ``trainer``'s loggers at its global step (rank zero: Lightning's
    loggers log there only), once the module has logged through them (``trainer.logged_metrics``): a run
    that logs nothing gets no log files from flashckpt either (a vanilla run's loggers write nothing until
    the first ``self.log``)."""
    def send() -> None:
        loggers = list(getattr(trainer, "loggers", None) or [])
        if not loggers or not getattr(trainer, "logged_metrics", None):
            return
        metrics = figures(engine.stats(refresh=False))
        for lg in loggers:
            lg.log_metrics(metrics, step=trainer.global_step)
    _lightning.run("the Lightning Trainer's loggers", send)


def report_line(logger: logging.Logger, step: int | None, engine: Any) -> None:
    """Logs the figures as one line (``line``) at INFO on ``logger`` (the framework's: DeepSpeed's, Megatron's),
    on global rank 0 only, as the frameworks log their own checkpoint lines."""
    if getattr(engine.ranks, "rank", 0) != 0:
        return
    _Once().run(f"the {logger.name} log", lambda: logger.info("%s", line(step, engine.stats(refresh=False))))
