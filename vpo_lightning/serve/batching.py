"""The batching worker of ``vpo serve``: one thread owns the model and generates queued requests with continuous
(iteration-level) batching.

HTTP handler threads validate and tokenize a request (:mod:`vpo_lightning.serve.openai_api`), then queue a :class:`Job`.
The worker keeps the sequences being generated in decode groups (:class:`~vpo_lightning.serve.continuous.DecodeGroup`,
at most ``step_rows`` rows each, one per adapter setting at least) and steps each group in turn, one token per row
and step. Between two group steps it lets pending jobs join: in fair order (the oldest job of the client served the
least work, ``n x max_tokens`` counted per client from the current virtual time for a client that is new or comes
back), while the rows generating stay within ``max_batch_size``; a client that holds fewer rows than another client
may join past it, up to twice ``max_batch_size`` (max-min fairness, as admission does), so clients that fill every
row cannot keep a new one waiting for their sequences to end. A joining job is prefilled at once and gets its first
token from the prefill; each row leaves its group as soon as it is done, and a job is answered when its last row is.
So a new request waits for one group's step (and the prefills joining with it), not for the requests under way:
rows of any sampling parameters share a step, each sampled with its own (a seeded request with its own generator).

A job whose client hung up (``Job.dropped``) is skipped when pending and its rows leave at the next step. A failed
step or prefill answers the jobs of that group with a 500 and is counted in ``stats["errors"]``; the worker keeps
serving. Streaming and log-probs: each generated token is handed to a streamed job's queue as it is sampled, with
its log-prob and the alternatives asked for (:func:`~vpo_lightning.serve.continuous.pick`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from vpo_lightning.serve.jobs import Job
from vpo_lightning.serve.openai_api import APIError

if TYPE_CHECKING:
    from vpo_lightning.serve.continuous import DecodeGroup

log = logging.getLogger(__name__)


SMALL_PROMPT_CHARS = 16_384  # prompts up to this many characters use the shared tokenizer (a few ms each)


def _similar_lengths(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` in order, cut into runs prefilled together: a run's prompts are padded to its longest, so a prompt
    at least twice the length of another starts a new run (a short request never waits for a long prompt's padding)."""
    runs: list[list[Job]] = []
    low = high = 0
    for job in jobs:
        size = max(1, len(job.prompt_ids))
        if runs and max(high, size) <= 2 * min(low, size):
            runs[-1].append(job)
            low, high = min(low, size), max(high, size)
        else:
            runs.append([job])
            low = high = size
    return runs


class BatchGenerator:
    """Owns the model; a worker thread generates queued :class:`Job` s in decode groups (continuous batching).

    Args:
        model: a causal LM, or a PEFT model (``SamplingKey.adapter=False`` runs it with its adapter disabled).
        tokenizer: its tokenizer (pad token set).
        device: where the model lives.
        max_batch_size: most rows generating at once (up to twice this many for clients holding fewer rows than
            another, see the module docstring).
        batch_wait_s: when idle, wait this long after the first request so that concurrent ones prefill together.
        step_rows: most rows in one decode step (0 = ``max_batch_size``): the rows generating are split into groups
            of at most this many, stepped in turn, and a new request joins after one group's step. On a CPU a
            step's time grows with its rows, so small groups cost little throughput and cut the wait.
    """

    def __init__(self, model: Any, tokenizer: Any, device: torch.device | str = "cpu", max_batch_size: int = 64,
                 batch_wait_s: float = 0.01, step_rows: int = 0) -> None:
        from vpo_lightning.generation.engines import eos_token_ids

        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.step_rows = step_rows or max_batch_size
        self.wait_s = 0.0  # how long the last answered job generated: what Retry-After tells a refused client
        self._served: dict[str, int] = {}  # client -> work served (n x max_tokens), from the virtual time on
        self._vtime = 0  # the served work of the last joining job: where a new or returning client starts
        self.eos = eos_token_ids(model, tokenizer)
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to use from several threads at once
        # Prompts longer than SMALL_PROMPT_CHARS are tokenized by a second copy under its own lock (the fast
        # tokenizer releases the GIL while it encodes), so a flood of long prompts queues behind itself while short
        # requests and the worker's decoding keep the first copy: a 1 MB prompt took the shared lock for ~2.5 s.
        self.long_tokenizer = copy.deepcopy(tokenizer)
        self.long_tokenizer_lock = threading.Lock()
        self.groups: list[Any] = []  # DecodeGroup s (or what new_group returns), each with rows generating
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        # batches: prefills (a group's joins at once); steps: decode steps; generate_s: time in both
        self.stats = {"batches": 0, "steps": 0, "requests": 0, "rows": 0, "generated_tokens": 0, "generate_s": 0.0,
                      "max_batch_requests": 0, "max_batch_rows": 0, "errors": 0}

    def new_group(self, adapter: bool) -> DecodeGroup:
        """An empty decode group for rows with the adapter on or off (tests put a scripted stand-in here)."""
        from vpo_lightning.serve.continuous import DecodeGroup

        return DecodeGroup(self.model, self.tokenizer, self.eos, self.device, self.tokenizer_lock, adapter)

    # -- queue ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vpo-serve-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for job in pending:
            job.future.cancel()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._stop:
                raise APIError(503, "the server is shutting down", type="server_error")
            self._pending.append(job)
            self._cond.notify()
        return job.future

    def _rows_by_client(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for group in self.groups:
            for job in group.jobs:
                held[job.client] = held.get(job.client, 0) + job.n
        return held

    def _take(self, block: bool) -> list[Job]:
        """The pending jobs that may join now, in fair order; with ``block``, wait for one first (the worker is
        idle) and then ``batch_wait_s`` for concurrent requests.

        The head is the oldest job of the client served the least work (a new client starts at the virtual time).
        It joins while the rows generating stay within ``max_batch_size``, or, past it, up to twice that when its
        client holds fewer rows than the client holding the most; the first head that cannot join ends the turn.
        """
        with self._cond:
            while block and not self._pending and not self._stop:
                self._cond.wait()
            if self._stop or not self._pending:
                return []
        if block and self.batch_wait_s > 0:
            time.sleep(self.batch_wait_s)  # let concurrent requests prefill together
        held = self._rows_by_client()
        rows = sum(held.values())
        chosen: list[Job] = []
        with self._cond:
            for job in self._pending:
                if job.dropped:
                    job.future.cancel()
            pending = [j for j in self._pending if not j.future.cancelled()]
            while pending:
                head = min(pending, key=lambda j: max(self._served.get(j.client, 0), self._vtime))
                mine, most = held.get(head.client, 0), max(held.values(), default=0)
                if rows + head.n > self.max_batch_size and not (mine < most
                                                                 and rows + head.n <= 2 * self.max_batch_size):
                    break
                pending.remove(head)
                chosen.append(head)
                held[head.client], rows = mine + head.n, rows + head.n
                self._vtime = max(self._served.get(head.client, 0), self._vtime)
                self._served[head.client] = self._vtime + head.n * head.key.max_tokens
            self._pending = pending
            if len(self._served) > 10_000:  # clients at or below the virtual time lose nothing by being forgotten
                self._served = {c: w for c, w in self._served.items() if w > self._vtime}
        return [j for j in chosen if j.future.set_running_or_notify_cancel()]

    # -- the worker -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._join(self._take(block=not self.groups))
            for group in list(self.groups):
                if self._stop:
                    break
                if group.jobs:  # (its jobs may all have ended in their prefill)
                    self._run(group, group.step, [])
                self._join(self._take(block=False))  # a new request waits for one group's step
            self.groups = [g for g in self.groups if g.jobs]
            if self._stop:
                error = APIError(503, "the server is shutting down", type="server_error")
                for job in [job for group in self.groups for job in group.jobs]:
                    job.future.set_exception(error)
                self.groups = []
                return

    def _join(self, jobs: list[Job]) -> None:
        """Prefill ``jobs`` into groups of their adapter setting: the one with the fewest rows that has room for
        them (``step_rows``), else a new one."""
        joining: dict[int, tuple[Any, list[Job]]] = {}  # id(group) -> (group, its joining jobs)
        planned = {id(g): g.size for g in self.groups}  # rows each group will hold once these jobs join
        for job in jobs:
            fits = [g for g in self.groups if g.adapter == job.key.adapter and planned[id(g)] + job.n <= self.step_rows]
            if fits:
                group = min(fits, key=lambda g: planned[id(g)])
            else:
                group = self.new_group(job.key.adapter)
                group.adapter = job.key.adapter  # (a scripted stand-in need not set it)
                self.groups.append(group)
                planned[id(group)] = 0
            planned[id(group)] += job.n
            joining.setdefault(id(group), (group, []))[1].append(job)
            job.joined = time.monotonic()
        for group, batch in joining.values():
            for part in _similar_lengths(batch):
                self.stats["batches"] += 1
                self.stats["requests"] += len(part)
                self.stats["rows"] += sum(j.n for j in part)
                self._run(group, lambda g=group, p=part: g.add(p), part)
        if joining:
            s, running = self.stats, [job for group in self.groups for job in group.jobs]
            s["max_batch_requests"] = max(s["max_batch_requests"], len(running))
            s["max_batch_rows"] = max(s["max_batch_rows"], sum(job.n for job in running))

    def _run(self, group: Any, call: Any, joining: list[Job]) -> None:
        """``call`` (a group's step or prefill): answer the jobs it finished; when it fails, a 500 for every job of
        the group and those joining it, and the group is dropped."""
        t0 = time.perf_counter()
        try:
            finished = call()
        except Exception as err:  # one failed step must not stop the server
            log.exception("generation failed for a group of %d rows", group.size)
            self.stats["errors"] += 1
            error = APIError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error")
            for job in [*group.jobs, *joining]:
                if not job.future.done():
                    job.future.set_exception(error)
            self.groups = [g for g in self.groups if g is not group]
            return
        self.stats["generate_s"] += time.perf_counter() - t0
        if not joining:
            self.stats["steps"] += 1
        for job, choices in finished:
            self.stats["generated_tokens"] += sum(c.tokens for c in choices)
            self.wait_s = time.monotonic() - job.joined
            if not job.future.done():
                job.future.set_result(choices)
