"""The asynchronous rollout worker: a process that samples while the trainer trains.

With ``max_staleness > 0`` the training loop starts one worker process. It
builds its own copy of the policy from the run's config, loads the trainer's
weights, and loops over rollout batches n = start + 1, start + 2, ...: it
samples batch n (the prompts and seeds the synchronous loop's step n uses),
grades every response once, and sends each group, tagged with the version of
the weights that sampled it, to the trainer. At most ``async_queue_size``
rollout batches' groups are in flight; a worker with a full queue waits. The
trainer takes the groups of one rollout batch per step, drops those over the
bound (``async_admission`` drop) and sends its weights back every
``weight_sync_every`` steps (:mod:`grpo_lab.training.staleness`).

Choices, and why:

- **spawn**, not fork: the worker starts a fresh interpreter (a few seconds of
  imports) instead of copying the trainer mid-run. A forked child inherits
  torch's thread pools, a notebook kernel's sockets and a CUDA context, none
  of which survive a fork reliably.
- **one torch thread each**: the worker samples on one thread; the trainer
  keeps its own count (1 for the tiny model): on two cores each side has one.
- **weights through a file, groups through a pipe**: the trainer writes
  ``rollout_weights.pt`` in the run folder (atomically replaced) and raises a
  shared version counter; the worker loads it before its next batch. Groups
  travel over a one-way pipe whose only writer is the worker, so a worker
  killed mid-send leaves the trainer an end-of-file, not a hang.
- **dies with the trainer**: the worker asks Linux to kill it when its parent
  dies (``PR_SET_PDEATHSIG``), and a watchdog thread exits it when its parent
  changes (other systems); the trainer polls the worker while it waits and
  stops the run with :class:`RolloutWorkerDied` when it is gone.
- **the queue is re-sampled on resume**, not checkpointed: the groups in
  flight when a run stops are lost, and a resumed run's worker starts from
  the checkpoint's weights (version = its step) at batch step + 1.

Described in ``docs/asynchronous.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from grpo_lab.models import load_pretrained
from grpo_lab.rollouts import build_backend
from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks.base import Example
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.dynamic_sampling import GradedRollouts, assemble_groups
from grpo_lab.training.policy import Policy
from grpo_lab.training.rollout_batch import grade_rollouts
from grpo_lab.training.run_parts import (
    autocast,
    build_task,
    derived_seed,
    sampling_settings,
    tiny_model,
)
from grpo_lab.training.staleness import (
    Admission,
    TaggedGroup,
    admission_metrics,
    admit,
    paced_version,
)

WEIGHTS_FILE = "rollout_weights.pt"
# How often a waiting side looks at the other (seconds).
POLL_SECONDS = 0.05
# How long the trainer lets a stopping worker finish before killing it.
STOP_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1


class RolloutWorkerDied(RuntimeError):
    """The rollout worker process ended while the trainer waited for groups."""


@dataclass
class TaggedRollouts(GradedRollouts):
    """A step's admitted groups as one rollout batch, with each row's staleness."""

    # Staleness of each response's group, (B·G,) in row order.
    row_staleness: list[int] | None = None


@dataclass
class _WorkerFailure:
    """An exception in the worker, sent to the trainer as text."""

    text: str


# --- the trainer's side -------------------------------------------------------------


class RolloutWorker:
    """The trainer's handle on the worker: start, take a step's groups, send
    weights, stop. Use as a context manager (the worker stops on exit)."""

    def __init__(
        self, config: TrainConfig, run_dir: Path, model: torch.nn.Module, start: int
    ) -> None:
        self.config, self.model, self.start = config, model, start
        self.weights_path = Path(run_dir) / WEIGHTS_FILE
        context = multiprocessing.get_context("spawn")
        self.version = context.Value("q", -1)
        self.stop_event = context.Event()
        capacity = config.async_queue_size * config.prompts_per_step
        self.free_slots = context.Semaphore(capacity)
        self.capacity = capacity
        self.receiver, sender = context.Pipe(duplex=False)
        self.publish(start)
        self.process = context.Process(
            target=worker_main,
            args=(config, self.weights_path, start, sender, self.version),
            kwargs={
                "free_slots": self.free_slots,
                "stop_event": self.stop_event,
                "parent_pid": os.getpid(),
            },
            name="grpo-lab-rollout-worker",
            daemon=True,
        )
        self.process.start()
        sender.close()  # the worker holds the only writing end now

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, version: int) -> None:
        """Write the trainer's weights as ``version`` and tell the worker."""
        write_weights(self.weights_path, self.model, version)
        self.version.value = version

    def updated(self, step: int) -> None:
        """After step ``step``'s update: send the weights every k steps."""
        if step % self.config.weight_sync_every == 0:
            self.publish(step)

    def take(self, step: int) -> tuple[TaggedRollouts, list[Example]]:
        """One rollout batch of admitted groups for step ``step`` (B groups),
        with the step's ``async/`` metrics in its ``sampling_metrics``."""
        trainer_version = step - 1
        admission = Admission(queue_depth=self.queue_depth())
        while len(admission.kept) < self.config.prompts_per_step:
            started = time.perf_counter()
            group = self._receive()
            admission.trainer_wait_seconds += time.perf_counter() - started
            kept, dropped = admit([group], trainer_version, self.config.max_staleness)
            admission.kept += kept
            admission.dropped += dropped
        graded, examples = assemble_groups(
            [(g.rollouts, g.reward_results, g.example, 0) for g in admission.kept],
            self.config.group_size,
        )
        ages = [trainer_version - g.version for g in admission.kept]
        rollouts = TaggedRollouts(
            **{name: getattr(graded, name) for name in graded.__dataclass_fields__},
            row_staleness=[a for a in ages for _ in range(self.config.group_size)],
        )
        rollouts.sampling_metrics = admission_metrics(admission, trainer_version)
        return rollouts, examples

    def queue_depth(self) -> int:
        """Groups sent (or being sent) and not yet taken."""
        return self.capacity - self.free_slots.get_value()

    def _receive(self) -> TaggedGroup:
        while not self.receiver.poll(POLL_SECONDS):
            if not self.process.is_alive():
                raise self._died()
        try:
            item = self.receiver.recv()
        except (EOFError, OSError) as error:  # its end closed: it is exiting
            raise self._died() from error
        self.free_slots.release()
        if isinstance(item, _WorkerFailure):
            raise RuntimeError(f"the rollout worker failed:\n{item.text}")
        return item

    def _died(self) -> RolloutWorkerDied:
        self.process.join(STOP_SECONDS)
        hint = ""
        if self.process.exitcode == 1:  # what a spawned child's failed start gives
            hint = (
                ". A script that trains asynchronously must guard its entry with "
                "if __name__ == '__main__': the worker is a spawned process that "
                "imports the script"
            )
        return RolloutWorkerDied(
            f"the rollout worker (pid {self.process.pid}) exited with code "
            f"{self.process.exitcode} while the trainer waited for groups; the run "
            f"stops here (resume it to continue){hint}"
        )

    def close(self) -> None:
        """Stop the worker: ask, drain its pipe while it finishes, then kill."""
        self.stop_event.set()
        deadline = time.monotonic() + STOP_SECONDS
        while self.process.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(EOFError, OSError):
                while self.receiver.poll(POLL_SECONDS):
                    self.receiver.recv()
                    self.free_slots.release()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.receiver.close()
        self.weights_path.unlink(missing_ok=True)


def write_weights(path: Path, model: torch.nn.Module, version: int) -> None:
    """``model``'s weights as ``version``, replacing ``path`` atomically (a
    reader gets the old file or the new one, never half of one)."""
    temporary = path.with_name(f".{path.name}.tmp")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"version": version, "state_dict": state}, temporary)
    os.replace(temporary, path)


@contextlib.contextmanager
def rollout_worker(
    config: TrainConfig, run_dir: Path, model: torch.nn.Module, start: int
) -> Iterator[RolloutWorker]:
    """A started :class:`RolloutWorker`, stopped (never left behind) on exit."""
    worker = RolloutWorker(config, run_dir, model, start)
    try:
        yield worker
    finally:
        worker.close()


# --- the worker's side ----------------------------------------------------------------


def worker_main(
    config: TrainConfig,
    weights_path: Path,
    start: int,
    sender: Connection,
    version: Any,
    *,
    free_slots: Any,
    stop_event: Any,
    parent_pid: int,
) -> None:
    """The worker process: sample, grade and send groups until told to stop."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the trainer, which saves its checkpoint, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        sampler = RolloutSampler(config, weights_path)
        for batch_index in range(start + 1, 2**62):
            waited = sampler.wait_for_weights(batch_index, version, stop_event)
            if stop_event.is_set():
                return
            groups = sampler.sample_batch(batch_index)
            groups[0].worker_wait_seconds += waited
            for group in groups:
                if not _wait_for_slot(free_slots, stop_event, group):
                    return
                sender.send(group)
    except Exception:
        with contextlib.suppress(OSError):
            sender.send(_WorkerFailure(traceback.format_exc()))
    finally:
        sender.close()


def _wait_for_slot(free_slots: Any, stop_event: Any, group: TaggedGroup) -> bool:
    """Block until the queue has room (time added to the group's wait);
    False when the worker is told to stop first."""
    started = time.perf_counter()
    while not free_slots.acquire(timeout=POLL_SECONDS):
        if stop_event.is_set():
            return False
    group.worker_wait_seconds += time.perf_counter() - started
    return not stop_event.is_set()


class RolloutSampler:
    """The worker's copy of the policy: loads published weights, samples and
    grades tagged groups. Runs in the worker process (and in tests, in place)."""

    def __init__(self, config: TrainConfig, weights_path: Path) -> None:
        self.config, self.weights_path = config, Path(weights_path)
        if config.model == "tiny":
            model, tokenizer = tiny_model(config)
        else:
            model, tokenizer = load_pretrained(config.model, dtype=config.dtype)
        model.to(dtype=getattr(torch, config.dtype)).eval()
        self.task = build_task(config, tokenizer)
        backend = build_backend(config, model, tokenizer)
        self.policy = Policy(model, tokenizer, None, backend)  # no optimizer
        self.version = -1
        self.load_weights()

    def load_weights(self) -> int:
        """Load the newest published weights; return their version."""
        payload = torch.load(self.weights_path, map_location="cpu", weights_only=True)
        self.policy.model.load_state_dict(payload["state_dict"])
        self.policy.backend.sync(self.policy.model)
        self.version = int(payload["version"])
        return self.version

    def wait_for_weights(
        self, batch_index: int, version: Any, stop_event: Any
    ) -> float:
        """Load newer weights if published; when pacing, wait until they are new
        enough for ``batch_index``. Returns the seconds waited."""
        started = time.perf_counter()
        needed = self.version
        if self.config.async_admission == "pace":
            needed = paced_version(batch_index, self.config.max_staleness)
        while version.value < needed and not stop_event.is_set():
            time.sleep(POLL_SECONDS)
        if version.value > self.version:
            self.load_weights()
        return time.perf_counter() - started

    def sample_batch(self, batch_index: int) -> list[TaggedGroup]:
        """Rollout batch ``batch_index``: B prompts x G responses, graded, as B
        tagged groups (the synchronous loop's step-n prompts and seeds)."""
        config, task = self.config, self.task
        examples = task.train(
            config.prompts_per_step, derived_seed(config, "prompts", batch_index)
        )
        sampling = sampling_settings(
            config, task, derived_seed(config, "rollouts", batch_index)
        )
        with torch.no_grad(), autocast(config):
            rollouts = self.policy.backend.generate(
                [e.prompt for e in examples], config.group_size, sampling
            )
        results = grade_rollouts(config, task, self.policy, rollouts, examples)
        size = config.group_size
        return [
            TaggedGroup(
                batch_index=batch_index,
                version=self.version,
                example=example,
                rollouts=_group_rows(rollouts, index * size, (index + 1) * size),
                reward_results=results[index * size : (index + 1) * size],
            )
            for index, example in enumerate(examples)
        ]


def _group_rows(rollouts: Rollouts, start: int, stop: int) -> Rollouts:
    """Rows ``start:stop`` of a Rollouts (each list column sliced)."""
    names = (
        "prompts",
        "responses",
        "prompt_token_ids",
        "response_token_ids",
        "sampler_log_probs",
    )
    values = {n: getattr(rollouts, n) for n in names}
    return Rollouts(
        **{n: None if v is None else v[start:stop] for n, v in values.items()}
    )


def die_with_parent(parent_pid: int) -> None:
    """Exit when the trainer (``parent_pid``) dies, even by kill -9: Linux's
    PR_SET_PDEATHSIG, and a watchdog thread for systems without it."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the request was made
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
