"""The embedded engine's request queue and decode worker (``Batcher``, which the engine owns).

Owns what happens between ``generate`` handing over checked rows and their
results coming back: the queue, the one decode worker thread that drains it
into batches of up to ``max_batch_size`` rows, pausing (abort / in place /
retract), aborts, request deadlines and the worker's liveness.

A batch holds rows of one call only, in the call's order. On CPU a row's
logits depend, in their last bits, on what else shares its forward (padding,
batch size); the off-policy loss divides by the engine's logprobs, so mixing
calls by arrival time would make a resumed run differ from an uninterrupted
one. Callers batch by sending rows in one call (``EngineGroup.generate_groups``
sends each engine its whole share at once).

Failure rules, so that one request never takes others down:
- a row whose decode state cannot even be built fails alone;
- a batch whose decode raises fails its own call and no other;
- a request unfinished ``engines.request_timeout_s`` after it was queued ends
  with finish reason abort (paused time counts);
- if the worker thread itself dies (something escaped every handler), every
  waiting call fails with EngineDeadError, new calls fail at once, and
  ``decode_alive`` is False, which ``health_generate`` reports, so the engine
  group restarts the engine instead of sending it more work.
The batcher is handed the engine's ``ServedModel`` (model, ranks, weight
version, step lock and the condition that guards its queue and the version)
and ``Tokens`` at construction, and reads nothing else of the engine. Never
validates requests (``EmbeddedEngine.generate`` does) and never loads weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engines.config import EngineConfig
from engines.embedded.decode import RETRACT, Retract, Row, decode
from engines.embedded.sampling import make_generator
from engines.embedded.served_model import ServedModel
from engines.embedded.tokens import Tokens
from engines.types import EngineDeadError, GenerateResult, PauseMode, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One generate() call: its rows' results and a completion signal."""

    results: list[GenerateResult | None]
    remaining: int
    deadline: float  # time.monotonic() after which its unfinished rows are aborted
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    rids: list[str] | None = None  # request ids, for abort_request(rid)


@dataclass
class _Item:
    """One queued row: its call, place in the call, prompt and settings."""

    call: _Call
    i: int
    prompt: list[int]
    params: SamplingParams
    row: Row | None = None  # the Row of a retracted request, to resume


class Batcher:
    """One engine's queue and decode worker; see the module docstring. The worker
    thread starts with the batcher."""

    def __init__(
        self, served: ServedModel, tokens: Tokens, cfg: EngineConfig, engine_id: int
    ) -> None:
        self.served = served
        self.tokens = tokens
        self.engine_id = engine_id
        self._cfg = cfg
        self._cond = served.cond  # guards the queue state below and the served version
        self._queue: deque[_Item] = deque()
        self._retract = False  # paused with mode "retract"
        self._paused = False
        self._parked = False  # worker is waiting between two steps (paused in place)
        self._inflight = 0  # rows the worker is decoding now
        self._abort_epoch = 0  # bumped to abort everything in flight
        self._abort_msg = ""
        self._running: list[_Item] = []  # rows the worker is decoding now
        self._dead: str | None = None  # why the worker died
        self._worker_thread = threading.Thread(
            target=self._worker, name=f"engine-{self.engine_id}", daemon=True
        )
        self._worker_thread.start()

    def decode_alive(self) -> bool:
        """False once the decode worker thread has died (the engine needs a restart)."""
        return self._dead is None and self._worker_thread.is_alive()

    @property
    def paused(self) -> bool:
        """Paused by ``pause_generation`` (until ``continue_generation``)."""
        return self._paused

    def _check_alive(self) -> None:
        if not self.decode_alive():
            raise EngineDeadError(
                f"engine {self.engine_id}: the decode loop died ({self._dead or 'thread gone'}); "
                "restart the engine (EngineGroup.restart)"
            )

    def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str] | None
    ) -> list[GenerateResult]:
        """Queue checked rows and wait for their results (see the module docstring)."""
        self._check_alive()
        deadline = time.monotonic() + self._cfg.request_timeout_s
        call = _Call([None] * len(prompts), len(prompts), deadline, rids=rids)
        with self._cond:
            while self._paused and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            items = [_Item(call, i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            if self._paused:  # paused past the deadline: never started
                for item in items:
                    self._finish_unstarted(item, self._timeout_msg())
            else:
                self._queue.extend(items)
                self._cond.notify_all()
        while not call.done.wait(timeout=1.0):
            if not self._worker_thread.is_alive():
                self._fail_all(self._dead or "decode thread gone")
        if call.error is not None:
            if self._dead is not None:
                self._check_alive()  # EngineDeadError naming the fix
            raise RuntimeError(f"engine {self.engine_id} failed the request: {call.error}")
        return call.results  # type: ignore[return-value]

    def _timeout_msg(self) -> str:
        return f"deadline exceeded: unfinished after engines.request_timeout_s={self._cfg.request_timeout_s}"

    # ---- the worker -------------------------------------------------------

    def _worker(self) -> None:
        try:
            while True:
                self._run_one_batch()
        except BaseException as e:  # noqa: BLE001  anything that escaped: the loop is dead
            log.exception("engine %s: decode loop died", self.engine_id)
            self._fail_all(f"{type(e).__name__}: {e}")

    def _fail_all(self, reason: str) -> None:
        """Mark the loop dead and fail every queued and running row with ``reason``."""
        with self._cond:
            self._dead = self._dead or reason
            items, self._running = [*self._running, *self._queue], []
            self._queue.clear()
            self._inflight = 0
            for item in items:
                if item.call.results[item.i] is None:
                    self._deliver(item, item.row or self._bare_row(item), reason)
            self._cond.notify_all()

    def _take_batch(self) -> list[_Item]:
        """The next batch (holds cond): up to max_batch_size rows of the call at the
        head of the queue, in its order. Rows of two calls never share a batch, so a
        row's numbers (logprobs to the last bit) depend only on its own call."""
        head = self._queue[0].call
        batch = []
        while self._queue and self._queue[0].call is head and len(batch) < self._cfg.max_batch_size:
            batch.append(self._queue.popleft())
        return batch

    def _run_one_batch(self) -> None:
        with self._cond:
            while not self._queue or self._paused:
                self._cond.wait()
            now, batch = time.monotonic(), []
            for item in self._take_batch():
                try:
                    if now > item.call.deadline:
                        raise TimeoutError(self._timeout_msg())
                    item.row = item.row or self._row(item.prompt, item.params, item.call.deadline)
                    batch.append(item)
                except Exception as e:  # this row's own settings: it fails alone
                    abort = isinstance(e, TimeoutError)
                    self._finish_unstarted(item, str(e), error=not abort)
            self._inflight = len(batch)
            epoch = self._abort_epoch
            self._running = batch
        if not batch:
            return
        rows = [item.row for item in batch]
        error = None
        try:
            decode(
                self.served.runner(),
                rows,
                self.tokens.pad_id(),
                self.served.device,
                between_steps=lambda e=epoch: self._between_steps(e),
                step_lock=self.served.step_lock,
            )
        except Exception as e:  # a failed batch must not kill the worker thread
            log.exception("engine %s: decode failed", self.engine_id)
            error = f"{type(e).__name__}: {e}"
        with self._cond:
            self._inflight = 0
            self._running = []
            again = []
            for item in batch:
                row = item.row
                if row.finish is not None or self._abort_epoch != epoch:
                    self._deliver(item, row, None)
                elif error is None:
                    again.append(item)  # retracted: first in line, in their order
                else:  # the batch is one call's: that call fails, no other
                    self._deliver(item, row, error)
            self._queue.extendleft(reversed(again))
            self._cond.notify_all()

    def _row(self, prompt: list[int], sp: SamplingParams, deadline: float | None) -> Row:
        """The decode state of a request about to start (holds cond): the version now."""
        return Row(
            prompt=prompt,
            params=sp,
            stop_ids=self.tokens.stop_ids(sp),
            generator=make_generator(sp.sampling_seed),
            version_start=self.served.version,
            stop_check=self.tokens.stop_check(sp.stop) if sp.stop else None,
            deadline=deadline,
        )

    def _bare_row(self, item: _Item) -> Row:
        """A Row to carry the result of a request that never decoded (no generator)."""
        stop = frozenset()
        gen = torch.Generator(device="cpu")
        return Row(item.prompt, item.params, stop, gen, self.served.version)

    def _between_steps(self, epoch: int) -> str | Retract | None:
        """Decode hook: park while paused in place; retract; report an abort."""
        with self._cond:

            def holding() -> bool:  # paused in place, and nothing ended the batch
                return self._paused and not self._retract and self._abort_epoch == epoch

            if holding():
                self._parked = True
                self._cond.notify_all()
                while holding():
                    self._cond.wait()
                self._parked = False
            if self._abort_epoch != epoch:
                return self._abort_msg
            return RETRACT if self._paused and self._retract else None

    def _finish_unstarted(self, item: _Item, message: str, error: bool = False) -> None:
        """End a row that never decoded: an abort result, or the call's error (holds cond)."""
        row = item.row or self._bare_row(item)
        row.finish = {"type": "abort", "message": message}
        self._deliver(item, row, message if error else None)

    def _deliver(self, item: _Item, row: Row, error: str | None) -> None:
        """Store one finished row (caller holds the condition)."""
        call = item.call
        if error is not None:
            call.error = error
        if row.finish is None:
            row.finish = {"type": "abort", "message": error or "not finished"}
        text = self.tokens.text(row.output_ids, row.finish.get("matched"))
        call.results[item.i] = row.result(text, self.served.version, self.engine_id)
        call.remaining -= 1
        if call.remaining == 0:
            call.done.set()

    def abort_all(self, message: str) -> None:
        """End in-flight and queued requests with finish reason abort (caller holds
        ``served.cond``)."""
        self._abort_epoch += 1
        self._abort_msg = message
        while self._queue:
            self._finish_unstarted(self._queue.popleft(), message)
        self._cond.notify_all()

    # ---- pause / continue / abort -----------------------------------------

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating; returns once no forward is running."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"mode={mode!r}: use 'abort', 'in_place' or 'retract'")
        with self._cond:
            self._paused = True
            self._retract = mode == "retract"
            if mode == "abort":
                self.abort_all("aborted by pause_generation")
            self._cond.notify_all()
            # In place: until the worker parks. Retract or abort: until it has let go
            # of its batch (or has died).
            while self._inflight and not (self._parked and not self._retract):
                if not self._cond.wait(timeout=1.0) and not self.decode_alive():
                    break

    def paused_requests(self) -> int:
        """Requests held by a pause (not aborted): parked in place, or retracted to
        the queue. SGLang's ``num_paused_requests`` (caller holds ``served.cond``)."""
        if not self._paused:
            return 0
        retracted = sum(item.row is not None for item in self._queue)
        return (self._inflight if self._parked else 0) + retracted

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._retract = False
            self._cond.notify_all()

    def flush_cache(self) -> bool:
        """Drop cached state; refused (False) while any request is queued or running.

        The engine keeps no prefix cache across requests, so an idle flush only
        returns freed device memory to the allocator.
        """
        with self._cond:
            if self._inflight or self._queue:
                return False
        if self.served.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def get_load(self) -> dict[str, int]:
        """Requests decoding now and waiting in the queue (SGLang's ``/get_load`` counts)."""
        with self._cond:
            return {"num_running_reqs": self._inflight, "num_waiting_reqs": len(self._queue)}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang ``/abort_request``: end one request (by rid) or all with finish reason abort.

        Queued requests end at once; running ones at their next decode step.
        Returns how many requests were aborted.
        """
        msg = "aborted by abort_request"
        with self._cond:
            if abort_all:
                n = len(self._queue) + self._inflight
                self.abort_all(msg)
                return n
            n, kept = 0, deque()
            for item in self._queue:
                if item.call.rids is not None and item.call.rids[item.i] == rid:
                    self._finish_unstarted(item, msg)
                    n += 1
                else:
                    kept.append(item)
            self._queue = kept
            for item in self._running:
                row = item.row
                if (
                    item.call.rids is not None
                    and item.call.rids[item.i] == rid
                    and row.finish is None
                ):
                    row.finish = {"type": "abort", "message": msg}
                    n += 1
            self._cond.notify_all()
            return n
