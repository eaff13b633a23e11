"""Real GPU telemetry (Alibaba cluster-trace-v2026-GenAI) as replayable series.

The simulated backend plays one Stable Diffusion serving pod per GPU in
``workload="replay"`` mode, so smoothing, anomaly filters and the telemetry
codec see the shapes of a real cluster rather than synthetic noise. The
tarballs are read in place (streamed through ``tarfile``; nothing is copied
into the repository) and parsed once per process.

Mapping choices, all visible in ``ReplaySeries``:

- Memory bytes become MiB. The publisher scaled the values (pods reach
  50.8 GB, more than the simulated 24 GiB card), so ``memory_mib_at`` maps
  them linearly by one trace-wide factor: the largest reading of the whole
  trace becomes the card's capacity. One factor, not a per-pod one, keeps
  both each pod's shape and the pods' sizes relative to each other (the
  distribution the publisher preserved); scaling each pod by its own maximum
  would make every pod peak at a full card. The result is clipped to the
  capacity as a guard.
- Duty cycle is already a percentage (0..100).
- Time: each pod's series starts at its own first sample (time 0), so every
  simulated GPU has data from the start; the anonymised timestamps step every
  57 s (the README's "one per minute"). A value holds until the next sample
  (step, no interpolation), gaps hold the last value, and the series wraps
  around after its last sample plus one step, so a long simulation keeps
  playing. ``speed`` compresses time: at ``speed=60`` one trace step passes
  in about a second.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ReplaySeries",
    "load_genai",
    "default_trace_dir",
    "GENAI_MEMORY_FILE",
    "GENAI_DUTY_FILE",
]

GENAI_MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.tar.gz"
GENAI_DUTY_FILE = "pod_gpu_duty_cycle_anon.tar.gz"
_GENAI_SUBDIR = "alibaba-genai"
_MIB = 1024 * 1024
_DEFAULT_CAPACITY_MIB = 24 * 1024
_FALLBACK_STEP_S = 60.0


@dataclass(frozen=True, eq=False)
class ReplaySeries:
    """One pod's GPU memory and duty cycle over time.

    Times are seconds since the pod's first sample (either metric), sorted.
    A pod missing from one metric's file has empty arrays for it, and that
    metric reads as ``None``.
    """

    pod_id: str
    memory_t: np.ndarray  # float64 seconds
    memory_mib: np.ndarray  # float64, unscaled MiB as published
    duty_t: np.ndarray  # float64 seconds
    duty_pct: np.ndarray  # float64, 0..100
    #: the trace-wide largest memory reading (MiB): maps to a card's capacity
    memory_ref_mib: float
    #: the trace's sampling step (seconds)
    step_s: float

    @property
    def period_s(self) -> float:
        """Length of one pass through the series; replay wraps after it."""
        last = 0.0
        if self.memory_t.size:
            last = max(last, float(self.memory_t[-1]))
        if self.duty_t.size:
            last = max(last, float(self.duty_t[-1]))
        return last + self.step_s

    def _trace_time(self, t: float, speed: float) -> float:
        if not math.isfinite(t) or not math.isfinite(speed) or speed <= 0:
            raise ValueError(f"replay time {t!r} at speed {speed!r} is not usable")
        return (t * speed) % self.period_s

    @staticmethod
    def _step_value(ts: np.ndarray, vs: np.ndarray, at: float) -> float | None:
        i = int(np.searchsorted(ts, at, side="right")) - 1
        if i < 0:
            return None
        return float(vs[i])

    def duty_pct_at(self, t: float, speed: float = 1.0) -> float | None:
        """Duty cycle (%) at virtual time ``t`` seconds; ``None`` before the
        metric's first sample or when the pod has no duty series."""
        return self._step_value(self.duty_t, self.duty_pct, self._trace_time(t, speed))

    def memory_mib_at(
        self, t: float, capacity_mib: int = _DEFAULT_CAPACITY_MIB, speed: float = 1.0
    ) -> int | None:
        """Memory used at virtual time ``t``, mapped into ``capacity_mib``
        (see the module docstring); ``None`` where the pod has no reading."""
        raw = self._step_value(self.memory_t, self.memory_mib, self._trace_time(t, speed))
        if raw is None:
            return None
        if self.memory_ref_mib <= 0:
            return 0
        return min(capacity_mib, max(0, round(raw * capacity_mib / self.memory_ref_mib)))


def default_trace_dir() -> Path:
    """``$GPULB_TRACES`` if set, else ``<repo>/../shared/traces``."""
    env = os.environ.get("GPULB_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def _genai_dir(trace_dir: Path) -> Path:
    # Accept both the traces root and the alibaba-genai folder itself.
    sub = trace_dir / _GENAI_SUBDIR
    return sub if sub.is_dir() else trace_dir


_PodArrays = dict[str, tuple[np.ndarray, np.ndarray]]


@functools.lru_cache(maxsize=8)
def _read_metric(path: str, mtime_ns: int, size: int) -> _PodArrays:
    """Pod id -> (absolute timestamps, values), each sorted by time.

    Cached per process; ``mtime_ns`` and ``size`` are part of the key so a
    replaced file is read again.
    """
    del mtime_ns, size  # cache key only
    times: dict[str, list[float]] = {}
    values: dict[str, list[float]] = {}
    with tarfile.open(path, "r:gz") as tf:
        member = next((m for m in tf.getmembers() if m.isfile() and m.name.endswith(".csv")), None)
        if member is None:
            raise ValueError(f"{path}: no CSV inside")
        raw = tf.extractfile(member)
        assert raw is not None  # isfile() above
        with io.TextIOWrapper(raw, encoding="utf-8", newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader)
            # The two files order their columns differently; go by name.
            try:
                ti = header.index("timestamp_anon")
                vi = header.index("value")
                pi = header.index("container_ip")
            except ValueError as exc:
                raise ValueError(f"{path}: unexpected header {header}") from exc
            for row in reader:
                try:
                    t = float(row[ti])
                    v = float(row[vi])
                    pod = row[pi]
                except (IndexError, ValueError):
                    continue
                if not (math.isfinite(t) and math.isfinite(v)):
                    continue
                times.setdefault(pod, []).append(t)
                values.setdefault(pod, []).append(v)
    out: _PodArrays = {}
    for pod, ts in times.items():
        t_arr = np.asarray(ts, dtype=np.float64)
        v_arr = np.asarray(values[pod], dtype=np.float64)
        order = np.argsort(t_arr, kind="stable")
        out[pod] = (t_arr[order], v_arr[order])
    return out


def _load(path: Path) -> _PodArrays:
    st = path.stat()  # FileNotFoundError names the missing file
    return _read_metric(str(path.resolve()), st.st_mtime_ns, st.st_size)


def _trace_step(*metrics: _PodArrays) -> float:
    steps = [
        float(np.min(d[d > 0]))
        for m in metrics
        for ts, _ in m.values()
        if ts.size > 1 and np.any((d := np.diff(ts)) > 0)
    ]
    return min(steps) if steps else _FALLBACK_STEP_S


def load_genai(trace_dir: str | os.PathLike[str] | None = None, max_pods: int | None = None) -> list[ReplaySeries]:
    """Every pod of the GenAI trace (or the first ``max_pods`` by id) as a
    ``ReplaySeries``, sorted by pod id.

    ``trace_dir`` is the traces root or its ``alibaba-genai`` folder; by
    default ``default_trace_dir()``. Raises ``FileNotFoundError`` when the
    tarballs are not there.
    """
    if max_pods is not None and max_pods < 0:
        raise ValueError("max_pods must be >= 0")
    root = _genai_dir(Path(trace_dir) if trace_dir is not None else default_trace_dir())
    memory = _load(root / GENAI_MEMORY_FILE)
    duty = _load(root / GENAI_DUTY_FILE)
    step = _trace_step(memory, duty)
    # Trace-wide, over all pods, so the mapping does not depend on max_pods.
    ref_mib = max((float(v.max()) for _, v in memory.values() if v.size), default=0.0) / _MIB
    empty = np.empty(0, dtype=np.float64)
    pods = sorted(set(memory) | set(duty))
    if max_pods is not None:
        pods = pods[:max_pods]
    series = []
    for pod in pods:
        mt, mv = memory.get(pod, (empty, empty))
        dt, dv = duty.get(pod, (empty, empty))
        t0 = min(float(a[0]) for a in (mt, dt) if a.size)
        series.append(
            ReplaySeries(
                pod_id=pod,
                memory_t=mt - t0,
                memory_mib=mv / _MIB,
                duty_t=dt - t0,
                duty_pct=dv,
                memory_ref_mib=ref_mib,
                step_s=step,
            )
        )
    return series
