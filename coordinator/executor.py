"""Carrying out the rebalance advisor's plans (``gpulb advisor execute``).

The advisor proposes; an executor moves. For each move of a plan, in order:

1. ``GetTask``: the plan may be stale (the task was cancelled, completed,
   preempted or migrated since it was made). Unless the task is still LEASED
   under the plan's lease on the plan's GPUs, the move is left out (outcome
   "stale", the detail says the task's state or the lease it holds now):
   nothing runs, for a checkpoint would stop a workload the move cannot take
   and a restart would run it under a lease that is over. When ``GetTask``
   fails, nothing runs either (outcome "unchecked");
2. the operator's *checkpoint* command, if any (the task's workload saves its
   state and stops; ``GPULB_TO_*`` names where it goes, so the command can
   stage its data there); when it fails the move is skipped and the task
   runs on where it is;
3. ``MigrateTask``: the task's lease moves to the plan's destination GPU in
   one step (``Scheduler.migrate``). The coordinator may refuse it (the lease
   changed, the destination no longer fits). Then ``GetTask`` again: only
   when the task still holds the plan's lease on the GPUs it came from does
   the *restart* command run there, under that lease, so the checkpointed
   task resumes where it was. Otherwise (it ended or moved meanwhile, or
   ``GetTask`` failed) nothing is restarted: a workload under a lease that is
   over, or on GPUs another lease now holds, is one gpulb no longer accounts
   for (double booking); the detail says "not restarted: ..." and why;
4. the operator's *restart* command, if any (the workload starts again from
   its checkpoint on the new GPU, under the new lease).

Each command runs without a shell, with the move in its environment:
``GPULB_TASK_ID``, ``GPULB_LEASE_ID`` (the lease to run under: the new one
for a restart after a move), ``GPULB_FROM_NODE``, ``GPULB_FROM_GPU_INDEX``,
``GPULB_FROM_GPU_UUID``, ``GPULB_TO_NODE``, ``GPULB_TO_GPU_INDEX``,
``GPULB_TO_GPU_UUID`` (where the task goes, for the checkpoint; where it
restarts, for the restart: the new GPU, or the old one after a refused move;
the first GPU of a multi-GPU task), ``GPULB_FROM_GPU_INDEXES``, ``GPULB_FROM_GPU_UUIDS``,
``GPULB_TO_GPU_INDEXES``, ``GPULB_TO_GPU_UUIDS`` (every GPU, comma-separated:
ready for ``CUDA_VISIBLE_DEVICES``), ``GPULB_PLAN_ID``. On a cluster of
simulated agents no command is needed: the agents stop and start the task
themselves when the coordinator releases and places it.

A command has done its part when it *exits*: a restart command typically
starts the workload in the background and exits at once, and that workload
may keep the command's output pipes open for days. So the executor waits for
the command's exit (at most ``command_timeout_s``), then reads what is left
in its pipes for ``_PIPE_GRACE_S`` only and closes them (a workload that goes
on writing to them gets EPIPE: it should send its output to its own log).
Each command runs in a session (process group) of its own, standing in for
nothing else: when the coordinator's hook timeout ends the executor's group,
a workload a restart command already started runs on. On its own timeout a
command's group is killed, and so it is when the executor is stopped
(SIGTERM, as the coordinator's hook timeout sends first; Ctrl-C) while the
command runs, so a hung checkpoint is not left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from protos import advisor_pb2 as apb
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

__all__ = ["MoveOutcome", "PlanExecutor", "move_env", "move_gpus"]


@dataclass(frozen=True)
class MoveOutcome:
    """What became of one move."""

    plan_id: int
    task_id: str
    from_gpu: str  # NODE:INDEX
    to_gpu: str  # NODE:INDEX
    # "moved", "skipped" (checkpoint failed), "refused" (MigrateTask said no;
    # restarted in place when the task still holds the plan's lease there, else
    # the detail says "not restarted: ..."), "restart failed" (moved, but the
    # restart command failed), "stale" (the task no longer holds the plan's
    # lease: nothing ran), "unchecked" (GetTask failed before the checkpoint:
    # nothing ran)
    outcome: str
    lease_id: str  # the lease the task runs under now ("" when it holds none)
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def move_gpus(move: apb.Migration, side: str) -> tuple[list[int], list[str]]:
    """Every GPU of one side (``"from"`` or ``"to"``) of a move, as (indexes,
    uuids): a plan from a coordinator before multi-GPU moves names only the first."""
    uuids = list(getattr(move, f"{side}_gpu_uuids"))
    if uuids:
        return list(getattr(move, f"{side}_gpu_indexes")), uuids
    return [getattr(move, f"{side}_gpu_index")], [getattr(move, f"{side}_gpu_uuid")]


def move_env(plan_id: int, move: apb.Migration, *, lease_id: str, to_node: str, to_indexes: Sequence[int],
             to_uuids: Sequence[str]) -> dict[str, str]:
    """The environment of a checkpoint or restart command (module docstring)."""
    from_indexes, from_uuids = move_gpus(move, "from")
    return {
        "GPULB_PLAN_ID": str(plan_id),
        "GPULB_TASK_ID": move.task_id,
        "GPULB_LEASE_ID": lease_id,
        "GPULB_FROM_NODE": move.from_node_id,
        "GPULB_FROM_GPU_INDEX": str(from_indexes[0]),
        "GPULB_FROM_GPU_UUID": from_uuids[0],
        "GPULB_FROM_GPU_INDEXES": ",".join(map(str, from_indexes)),
        "GPULB_FROM_GPU_UUIDS": ",".join(from_uuids),
        "GPULB_TO_NODE": to_node,
        "GPULB_TO_GPU_INDEX": str(to_indexes[0]),
        "GPULB_TO_GPU_UUID": to_uuids[0],
        "GPULB_TO_GPU_INDEXES": ",".join(map(str, to_indexes)),
        "GPULB_TO_GPU_UUIDS": ",".join(to_uuids),
    }


class PlanExecutor:
    """Carries out plans through a Scheduler stub (module docstring)."""

    def __init__(
        self,
        scheduler: tpb_grpc.SchedulerStub,
        *,
        checkpoint: Sequence[str] = (),
        restart: Sequence[str] = (),
        command_timeout_s: float = 600.0,
        rpc_timeout_s: float = 10.0,
    ) -> None:
        self.scheduler = scheduler
        self.checkpoint = list(checkpoint)
        self.restart = list(restart)
        self.command_timeout_s = command_timeout_s
        self.rpc_timeout_s = rpc_timeout_s

    def _run(self, argv: list[str], env: dict[str, str]) -> str:
        """'' when the command succeeded (or there is none), else why not."""
        if not argv:
            return ""
        try:
            # its own session: a hook timeout (which ends the executor's process
            # group) must not end the workload a restart command started
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return f"{argv[0]}: {exc}"
        with _taken_along(proc):
            out, err, timed_out = _wait_and_read(proc, self.command_timeout_s)
        if timed_out:
            return f"{argv[0]} ran past {self.command_timeout_s:g} s"
        if proc.returncode != 0:
            tail = (err or out).strip().splitlines()[-1:] or [""]
            return f"{argv[0]} exited {proc.returncode}: {tail[0]}".rstrip(": ")
        return ""

    def _holds_plan_lease(self, move: apb.Migration) -> tuple[bool, str, str]:
        """Whether the task still holds the plan's lease on the GPUs the move
        takes it from, asked of the coordinator: (known, why not: '' when it
        does, the lease it holds now: '' when none). ``known`` is False when
        GetTask failed; the lease is then the plan's, the last one known."""
        try:
            task = self.scheduler.GetTask(tpb.GetTaskRequest(task_id=move.task_id), timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # finished long ago and forgotten (retain_finished)
                return True, f"the coordinator has no task {move.task_id!r} any more ({exc.details()})", ""
            return False, (f"GetTask failed ({exc.code().name}: {exc.details()}), so whether the task still holds "
                           f"lease {move.lease_id} is unknown"), move.lease_id
        a = task.assignment
        where = f"{a.node_id}:{','.join(map(str, a.gpu_index))}"
        from_indexes, from_uuids = move_gpus(move, "from")
        if task.state != tpb.TASK_STATE_LEASED:
            state = tpb.TaskState.Name(task.state).removeprefix("TASK_STATE_").lower()
            return True, f"the task is {state}" + (f" ({task.reason})" if task.reason else ""), ""
        if a.lease_id != move.lease_id:
            why = f"the task holds lease {a.lease_id} on {where} now, not the plan's lease {move.lease_id}"
            return True, why, a.lease_id
        # a plan from a coordinator before multi-GPU moves names only the first GPU
        if a.node_id != move.from_node_id or list(a.gpu_uuid)[:len(from_uuids)] != from_uuids:
            src = f"{move.from_node_id}:{','.join(map(str, from_indexes))}"
            return True, f"the task runs on {where} now, not on the plan's {src}", a.lease_id
        return True, "", a.lease_id

    def execute(self, plan: apb.RebalancePlan) -> list[MoveOutcome]:
        out = []
        for m in plan.moves:
            from_indexes, from_uuids = move_gpus(m, "from")
            to_indexes, to_uuids = move_gpus(m, "to")
            src = f"{m.from_node_id}:{','.join(map(str, from_indexes))}"
            dst = f"{m.to_node_id}:{','.join(map(str, to_indexes))}"
            # the checkpoint learns where the task goes; a restart in place (refused) where it was
            going = move_env(plan.plan_id, m, lease_id=m.lease_id, to_node=m.to_node_id, to_indexes=to_indexes,
                             to_uuids=to_uuids)
            here = move_env(plan.plan_id, m, lease_id=m.lease_id, to_node=m.from_node_id, to_indexes=from_indexes,
                            to_uuids=from_uuids)
            # a stale plan's checkpoint would stop a workload the move cannot take
            known, problem, lease_now = self._holds_plan_lease(m)
            if not known:
                out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "unchecked", m.lease_id,
                                       f"{problem}; the move was not tried (no checkpoint, no MigrateTask)"))
                continue
            if problem:
                out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "stale", lease_now,
                                       f"stale plan: {problem}; nothing was run"))
                continue
            failed = self._run(self.checkpoint, going)
            if failed:
                out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "skipped", m.lease_id, f"checkpoint: {failed}"))
                continue
            try:
                task = self.scheduler.MigrateTask(
                    tpb.MigrateTaskRequest(task_id=m.task_id, lease_id=m.lease_id, to_gpu_uuid=to_uuids),
                    timeout=self.rpc_timeout_s,
                ).task
            except grpc.RpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                # The task may have ended or moved since the check above: restarting it
                # then would run a workload under a lease that is over (double booking)
                known, problem, lease_now = self._holds_plan_lease(m)
                if not known or problem:
                    out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "refused", lease_now,
                                           f"{why}; not restarted: {problem}"))
                    continue
                again = self._run(self.restart, here)
                detail = why if not again else f"{why}; restart in place: {again}"
                out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "refused", m.lease_id, detail))
                continue
            a = task.assignment
            there = move_env(plan.plan_id, m, lease_id=a.lease_id, to_node=a.node_id, to_indexes=a.gpu_index,
                             to_uuids=a.gpu_uuid)
            failed = self._run(self.restart, there)
            out.append(MoveOutcome(plan.plan_id, m.task_id, src, dst, "restart failed" if failed else "moved",
                                   a.lease_id, failed))
        return out


#: s a command's pipes are read after it exited: its own output is in them by
#: then; what it left running in the background may hold them for days
_PIPE_GRACE_S = 1.0
#: s between checks whether a command exited while its pipes stay open
_POLL_S = 0.05
#: bytes of a command's stdout and stderr kept (each): only the last line is reported
_OUTPUT_TAIL = 65536


def signal_group(proc: subprocess.Popen | asyncio.subprocess.Process, signum: int) -> None:
    """``signum`` to the process group a command leads (it and what it
    started); to the process alone where the group cannot be signalled.
    The coordinator's hook and the executor's commands alike."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)


def _wait_and_read(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str, bool]:
    """(stdout tail, stderr tail, timed out): waits for ``proc`` to exit, at
    most ``timeout_s`` (then kills its group), reading its pipes meanwhile and
    for ``_PIPE_GRACE_S`` after, not until they close (module docstring)."""
    tails = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in tails:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    ended_at: float | None = None
    timed_out = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            elif ended_at is None and now >= deadline:
                _kill_group(proc)
                proc.wait()
                ended_at, timed_out = now, True
            if ended_at is not None and now - ended_at >= _PIPE_GRACE_S:
                break
            wait = ended_at + _PIPE_GRACE_S - now if ended_at is not None else min(deadline - now, _POLL_S)
            for key, _ in sel.select(max(0.0, wait)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                tail = tails[key.fileobj]
                tail += chunk
                if len(tail) > 2 * _OUTPUT_TAIL:
                    del tail[:-_OUTPUT_TAIL]
        if ended_at is None:  # it closed its output and runs on
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                timed_out = True
    except BaseException:  # Ctrl-C, SIGTERM (_taken_along): the command goes with the executor
        if proc.poll() is None:  # once it exited, its group is the workload it started: that runs on
            _kill_group(proc)
        proc.wait()
        raise
    finally:
        sel.close()
        for pipe in tails:
            pipe.close()
    out, err = (bytes(t[-_OUTPUT_TAIL:]).decode("utf-8", "replace") for t in tails.values())
    return out, err, timed_out


@contextlib.contextmanager
def _taken_along(proc: subprocess.Popen) -> Iterator[None]:
    """While ``proc`` runs, a SIGTERM to the executor (the coordinator's hook
    timeout sends it before SIGKILL, systemd on stop) kills ``proc``'s group
    first: in a session of its own it would outlive the executor. Only in the
    main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ended(signum, frame) -> None:
        # while the command runs; once it has exited (its output still read for
        # _PIPE_GRACE_S) what is left in its group is the workload a restart started
        if proc.poll() is None:
            _kill_group(proc)
        signal.signal(signum, previous)
        os.kill(os.getpid(), signum)  # as the executor would have ended (or the handler before ours)

    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:  # installed outside Python: put back the default
        previous = signal.SIG_DFL
    signal.signal(signal.SIGTERM, ended)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
