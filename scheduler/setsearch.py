"""The multi-GPU set choice of ``Policy.choose`` as one compiled loop (numba).

``Policy._choose_set_general`` is the reference: per candidate node, option A
(its k best GPUs) and, on at most ``_SET_SEARCH_NODES`` hopeful nodes, option
B (greedy NVLink growth from every GPU as a seed); see ``scheduler.policies``.
In numpy that is some eighty array operations per decision, each a few
microseconds of call overhead on arrays of a few thousand elements, and on a
1,000-node fleet it was most of a 4-GPU decision (about 450 µs of ~550). Here
the same steps run as one loop over the nodes, compiled by numba, with the
same float operations in the same order, so the placement is the same to the
bit (``tests/test_sched_policies.py`` checks it against the general path on
random fleets, with ties, NVLink needs, stale and NaN rows).

Three ways to run it, the first that works:

1. **ahead of time**: a C extension built from this very file by
   ``gpulb set-search build`` (numba's ``pycc`` and a C
   compiler; ``systemd/install.sh`` runs it), named after the file's
   digest so a changed kernel never loads a stale build, found in
   ``$GPULB_AOT_DIR`` or next to this module. Loading it needs neither numba
   nor executable heap memory, so it works under systemd's
   ``MemoryDenyWriteExecute=yes``, and costs ~1 MiB instead of numba's
   ~110-140 MiB of LLVM;
2. **just in time** with numba (about 5 s the first time, then cached on
   disk, ~0.2 s to load, where the package directory or ``NUMBA_CACHE_DIR``
   is writable); llvmlite needs memory that is writable, then executable,
   which W^X forbids;
3. otherwise (neither, ``GPULB_NO_JIT=1``, or a failure: ``failure`` says
   why) ``ready()`` is False and policies take the numpy paths, which place
   alike, slower.

``warm()`` loads or compiles up front; the coordinator and simulator call it
at start so no decision waits.

The same build carries a second, small kernel: ``add_oom_risk``, the
load-aware ``oom_risk`` term (``scheduler.memgrowth.GrowthTable.add_risk``)
added to every GPU's score in one pass. In numpy it is a comparison, an index
and six array operations over the GPUs at risk (~140 µs a decision at 40,000
GPUs, half of them at risk); compiled, one loop with the same float
operations (~43 µs).

And a third: ``fragmentation_delta``, the ``fgd`` policy's per-GPU change of
fragmentation for a one-GPU task (``scheduler.fragmentation``), some forty
array operations over the GPUs in numpy (~380 µs a decision on the 6,212
GPUs of the openb cluster), one pass per node sum here, with the same float
operations in the same order.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import time
from pathlib import Path

import numpy as np

__all__ = ["available", "ready", "warm", "best_set", "risk_kernel", "frag_kernel", "build_aot", "aot_dir", "failure", "mode", "MAX_K"]

#: sets of at least this many GPUs take the numpy path: numpy's mean of eight
#: or more values sums them pairwise, which this loop does not reproduce
MAX_K = 7

_lock = threading.Lock()
_kernel = None
_risk_kernel = None
_frag_kernel = None
_compile_s: float | None = None
#: how the loop runs once loaded: "aot", "jit", or None
mode: str | None = None
_disabled = os.environ.get("GPULB_NO_JIT", "") not in ("", "0")
try:  # numba is imported when first needed (it takes a few hundred ms)
    _have_numba = importlib.util.find_spec("numba") is not None
except (ImportError, ValueError):  # pragma: no cover
    _have_numba = False

#: the ahead-of-time module's name: this file's digest, so an edited kernel
#: never runs a build of an older one
AOT_MODULE = "gpulb_setsearch_" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def aot_dir() -> Path:
    """Where the ahead-of-time build lives: ``$GPULB_AOT_DIR``, else next to this module."""
    return Path(os.environ.get("GPULB_AOT_DIR") or Path(__file__).parent)


def _aot_file() -> Path | None:
    try:
        names = os.listdir(aot_dir())
    except OSError:
        return None
    for name in names:
        if name.startswith(AOT_MODULE + ".") and name.endswith((".so", ".pyd")):
            return aot_dir() / name
    return None


#: why the loop could not be loaded or compiled (e.g. no executable memory
#: for the JIT under MemoryDenyWriteExecute=yes and no ahead-of-time build);
#: None while it can be
failure: str | None = None


def available() -> bool:
    """Whether the compiled set choice may be used: an ahead-of-time build or
    numba present, not disabled, not failed. Cheap; compiles nothing."""
    return not _disabled and failure is None and (_have_numba or _aot_file() is not None)


def ready() -> bool:
    """Whether the compiled set choice is usable now; loads or compiles it on
    the first call (``warm`` does it at start), False for good on failure."""
    if _kernel is not None:  # the per-decision case: no file lookups
        return True
    return available() and _get() is not None


# The plain functions below are compiled by ``_compile`` or ``build_aot``; the
# kernel calls the helpers through these module globals, bound by ``_bind_helpers``.
_popcount_jit = None
_lowest_rank_jit = None


def _bind_helpers(compile_fn) -> None:
    global _popcount_jit, _lowest_rank_jit
    _popcount_jit = compile_fn(_popcount)
    _lowest_rank_jit = compile_fn(_lowest_rank)


def _popcount(x):
    count = 0
    while x:
        x &= x - 1
        count += 1
    return count


def _lowest_rank(mask):
    rank = 0
    while not (mask >> rank) & 1:
        rank += 1
    return rank


def _kernel_py(scores, usable, adj_bits, local_bit, has_nvlink, width, k, needs, bonus, max_hopeful):
    nodes = scores.shape[0] // width
    full = k * (k - 1) / 2
    inf = np.inf
    values = np.empty((nodes, width))
    positions = np.empty((nodes, width), dtype=np.int64)
    counts = np.zeros(nodes, dtype=np.int64)
    lower = np.full(nodes, inf)
    candidate = np.zeros(nodes, dtype=np.bool_)
    groups = 0
    best_obj = inf
    best_node = -1
    best_links = 0.0
    for n in range(nodes):
        if needs and not has_nvlink[n]:
            continue
        start = n * width
        c = 0
        for p in range(width):
            row = start + p
            v = scores[row]
            if not usable[row] or not np.isfinite(v):
                continue
            # insertion sort, stable: an equal score goes after (lower row first)
            j = c
            while j > 0 and values[n, j - 1] > v:
                values[n, j] = values[n, j - 1]
                positions[n, j] = positions[n, j - 1]
                j -= 1
            values[n, j] = v
            positions[n, j] = p
            c += 1
        counts[n] = c
        if c < k:
            continue
        candidate[n] = True
        groups += 1
        # option A: the k best, their mean as numpy adds fewer than 8 terms
        total = values[n, 0]
        for j in range(1, k):
            total += values[n, j]
        mean = total / k
        top_set = 0
        for j in range(k):
            top_set |= 1 << local_bit[start + positions[n, j]]
        count = 0
        for j in range(k):
            count += _popcount_jit(adj_bits[start + positions[n, j]] & top_set)
        links = count / 2
        objective = mean - bonus * links / full
        if needs and not (links >= k - 1 and k <= 3):
            objective = inf
        if best_node < 0 or objective < best_obj:
            best_obj, best_node, best_links = objective, n, links
        if has_nvlink[n]:
            lower[n] = mean - bonus
    out_rows = np.full(k, -1, dtype=np.int64)
    if groups == 0:
        return inf, out_rows, 0.0, 0
    for j in range(k):
        out_rows[j] = best_node * width + positions[best_node, j]
    best_frac = best_links / full
    # option B on the hopeful nodes: at most max_hopeful, lowest bound first
    # (ties: lower node first), else in node order
    hopeful = np.empty(nodes, dtype=np.int64)
    h = 0
    for n in range(nodes):
        if candidate[n] and (lower[n] < best_obj if best_obj < inf else lower[n] < inf):
            hopeful[h] = n
            h += 1
    if h == 0 or not (bonus > 0 or needs):
        return best_obj, out_rows, best_frac, groups
    hopeful = hopeful[:h]
    if h > max_hopeful:
        hopeful = hopeful[np.argsort(lower[hopeful], kind="mergesort")[:max_hopeful]]
    adjr = np.zeros(width, dtype=np.int64)
    found_obj = inf
    found_node = -1
    found_set = 0
    found_links = 0
    for n in hopeful:
        start = n * width
        c = counts[n]
        # per rank: the bit mask of the ranks of its NVLink neighbours
        for a in range(c):
            adj = adj_bits[start + positions[n, a]]
            mask = 0
            for b in range(c):
                if (adj >> local_bit[start + positions[n, b]]) & 1:
                    mask |= 1 << b
            adjr[a] = mask
        all_ranks = (1 << c) - 1
        for r in range(c):
            chosen = 1 << r
            neighbours = adjr[r]
            total = values[n, r]
            links = 0
            fell_back = False
            for _ in range(k - 1):
                cand = neighbours & ~chosen
                if cand != 0:
                    rank = _lowest_rank_jit(cand)
                else:
                    fell_back = True
                    rank = _lowest_rank_jit(all_ranks & ~chosen)
                peers = adjr[rank]
                links += _popcount_jit(peers & chosen)
                chosen |= 1 << rank
                neighbours |= peers
                total += values[n, rank]
            objective = total / k - bonus * links / full
            if needs and fell_back:
                objective = inf
            if objective < found_obj:
                found_obj, found_node, found_set, found_links = objective, n, chosen, links
    if found_node >= 0 and found_obj < best_obj:
        start = found_node * width
        j = 0
        for r in range(counts[found_node]):
            if (found_set >> r) & 1:
                out_rows[j] = start + positions[found_node, r]
                j += 1
        return found_obj, out_rows, found_links / full, groups
    return best_obj, out_rows, best_frac, groups



def _risk_kernel_py(score, free, scale, offset, limit, weighted_grid):
    """``score[i] += weighted_grid[bin]`` where ``free[i] < limit`` (in place):
    ``GrowthTable.add_risk``'s numpy path, the same float operations."""
    top = weighted_grid.shape[0] - 1.0
    for i in range(score.shape[0]):
        f = free[i]
        if f < limit:
            t = f * scale
            t = t - offset
            if t < 0.0:
                t = 0.0
            elif t > top:
                t = top
            score[i] += weighted_grid[int(t)]


def _frag_kernel_py(delta, memory, share, node, node_count, vram, gpu_share, vram_edges, share_edges,
                    fits_table, single_total, multi_vram, multi_share, p_less, p_equal, p_more):
    """``scheduler.fragmentation.fragmentation_delta`` for a one-GPU task into
    ``delta``: its numpy path, the same float operations in the same order
    (node sums in row order, as ``np.bincount`` adds)."""
    eps = 1e-9
    g = memory.shape[0]
    memory_after = np.empty(g)
    share_after = np.empty(g)
    for i in range(g):
        m = memory[i] - vram
        memory_after[i] = m if m > 0.0 else 0.0
        s = share[i] - gpu_share
        share_after[i] = s if s > 0.0 else 0.0
        if single_total == 0.0:
            delta[i] = 0.0
            continue
        frag_after = 0.0
        for state in range(2):  # after, then before
            m = memory_after[i] if state == 0 else memory[i]
            s = share_after[i] if state == 0 else share[i]
            a = 0
            for axis in range(2):  # searchsorted(edges, x, side="right"), inline
                edges = vram_edges if axis == 0 else share_edges
                x = (m if axis == 0 else s) + eps
                lo, hi = 0, edges.shape[0]
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if edges[mid] <= x:
                        lo = mid + 1
                    else:
                        hi = mid
                if axis == 0:
                    a = lo
            frag = s * (single_total - fits_table[a, lo])
            if state == 0:
                frag_after = frag
            else:
                delta[i] = frag_after - frag
    groups = multi_vram.shape[0]
    if groups == 0:
        return
    total = np.zeros(node_count)
    for i in range(g):
        total[node[i]] += share[i]
    count = np.zeros(node_count)
    small = np.zeros(node_count)
    for q in range(groups):
        v = multi_vram[q]
        s_need = multi_share[q]
        count[:] = 0.0
        small[:] = 0.0
        for i in range(g):
            if memory[i] >= v and share[i] + eps >= s_need:
                count[node[i]] += 1.0
            else:
                small[node[i]] += share[i]
        for i in range(g):
            n = node[i]
            fits = memory[i] >= v and share[i] + eps >= s_need
            fits_after = memory_after[i] >= v and share_after[i] + eps >= s_need
            small_of = 0.0 if fits else share[i]
            d_small = (0.0 if fits_after else share_after[i]) - small_of
            taken = share[i] - share_after[i]
            c = int(count[n])
            delta[i] += p_more[q, c] * d_small
            delta[i] -= p_less[q, c] * taken
            if fits and not fits_after:
                delta[i] += p_equal[q, c] * (total[n] - taken - small[n])
            else:
                delta[i] += p_equal[q, c] * d_small


def _get():
    global failure
    if _kernel is None and failure is None:
        with _lock:
            if _kernel is None and failure is None:
                aot_error = ""
                try:
                    if _load_aot():
                        return _kernel
                except Exception as exc:  # e.g. built against another numpy: the JIT may still do
                    aot_error = f"ahead-of-time build: {type(exc).__name__}: {exc}; "
                try:
                    _compile()
                except Exception as exc:  # numba imports llvmlite, which needs W+X pages
                    failure = f"{aot_error}{type(exc).__name__}: {exc}"
    return _kernel


def _load_aot() -> bool:
    """Import the ahead-of-time build of this kernel, if there is one."""
    global _kernel, _risk_kernel, _frag_kernel, _compile_s, mode
    path = _aot_file()
    if path is None:
        return False
    t0 = time.perf_counter()
    spec = importlib.util.spec_from_file_location(AOT_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _compile_s = time.perf_counter() - t0
    _kernel, _risk_kernel, _frag_kernel = module.best_set, module.add_oom_risk, module.fragmentation_delta
    mode = "aot"
    return True


def _compile() -> None:
    global _kernel, _risk_kernel, _frag_kernel, _compile_s, mode
    if not _have_numba:
        raise ImportError("numba is not installed and there is no ahead-of-time build")
    import numba

    t0 = time.perf_counter()

    def jit(fn):
        try:
            return numba.njit(cache=True, nogil=True)(fn)
        except Exception:  # no writable cache location: compile in memory
            return numba.njit(cache=False, nogil=True)(fn)

    _bind_helpers(jit)
    kernel = jit(_kernel_py)
    # compile now, on a one-node fleet, rather than in a decision
    kernel(np.zeros(2), np.ones(2, dtype=np.bool_), np.zeros(2, dtype=np.int64),
           np.arange(2, dtype=np.int64), np.ones(1, dtype=np.bool_), 2, 2, False, 0.5, 32)
    risk = jit(_risk_kernel_py)
    risk(np.zeros(2), np.array([1.0, 3.0]), 1.0, 0.0, 2.0, np.array([1.0, 0.5, 0.0]))
    frag = jit(_frag_kernel_py)
    frag(np.zeros(2), np.ones(2), np.ones(2), np.zeros(2, dtype=np.int64), 1, 0.5, 0.5, np.ones(1), np.ones(1),
         np.ones((2, 2)), 1.0, np.ones(1), np.ones(1), np.ones((1, 3)), np.ones((1, 3)), np.ones((1, 3)))
    _compile_s = time.perf_counter() - t0
    _kernel, _risk_kernel, _frag_kernel, mode = kernel, risk, frag, "jit"


#: the kernel's types, for the ahead-of-time build (what ``best_set`` passes)
_SIGNATURE = "Tuple((f8, i8[:], f8, i8))(f8[:], b1[:], i8[:], i8[:], b1[:], i8, i8, b1, f8, i8)"
_RISK_SIGNATURE = "void(f8[:], f8[:], f8, f8, f8, f8[:])"
_FRAG_SIGNATURE = (
    "void(f8[:], f8[:], f8[:], i8[:], i8, f8, f8, f8[:], f8[:], f8[:, :], f8, f8[:], f8[:], f8[:, :], f8[:, :], f8[:, :])"
)


def build_aot(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Compile the kernel ahead of time into ``out_dir`` (default ``aot_dir()``)
    as ``AOT_MODULE``; needs numba and a C compiler. Returns the file."""
    import warnings

    import numba

    with warnings.catch_warnings():  # numba.pycc is marked for deprecation; it is what AOT there is
        warnings.simplefilter("ignore")
        from numba.pycc import CC

    out = Path(out_dir) if out_dir is not None else aot_dir()
    out.mkdir(parents=True, exist_ok=True)
    _bind_helpers(numba.njit)
    cc = CC(AOT_MODULE)
    cc.output_dir = str(out)
    cc.verbose = False
    cc.export("best_set", _SIGNATURE)(_kernel_py)
    cc.export("add_oom_risk", _RISK_SIGNATURE)(_risk_kernel_py)
    cc.export("fragmentation_delta", _FRAG_SIGNATURE)(_frag_kernel_py)
    cc.compile()
    for name in os.listdir(out):
        if name.startswith(AOT_MODULE + "."):
            return out / name
    raise RuntimeError(f"numba.pycc built nothing in {out}")


def warm() -> float | None:
    """Compile (or load from the cache) now; seconds it took, None when the
    compiled loop is not used (no numba, disabled, or ``failure``)."""
    return _compile_s if ready() else None


def best_set(
    scores: np.ndarray,
    usable: np.ndarray,
    adj_bits: np.ndarray,
    local_bit: np.ndarray,
    has_nvlink: np.ndarray,
    width: int,
    k: int,
    needs: bool,
    bonus: float,
    max_hopeful: int,
) -> tuple[float, tuple[int, ...], float, int]:
    """``(objective, rows ascending, link fraction, candidate nodes)`` of the best k-set
    of a uniform layout, as ``Policy._choose_set_general`` chooses it; the
    objective is inf when no set qualifies. ``usable``: candidate GPUs (the
    finite scores among them are used)."""
    # the ahead-of-time build has one signature; these are no-ops for the
    # columns policies and views hand over (float64 scores, int64 bits, bools)
    objective, rows, frac, groups = _get()(
        np.asarray(scores, dtype=np.float64), np.asarray(usable, dtype=np.bool_),
        np.asarray(adj_bits, dtype=np.int64), np.asarray(local_bit, dtype=np.int64),
        np.asarray(has_nvlink, dtype=np.bool_), width, k, needs, bonus, max_hopeful,
    )
    return float(objective), tuple(sorted(int(r) for r in rows)), float(frac), int(groups)


def frag_kernel():
    """The compiled one-GPU ``fragmentation_delta`` loop, or None when the
    compiled kernels are not in use (the caller takes its numpy path)."""
    return _frag_kernel if ready() else None


def risk_kernel():
    """The compiled ``add_oom_risk`` loop, or None when the compiled kernels
    are not in use (the caller takes its numpy path)."""
    return _risk_kernel if ready() else None


def main(argv: list[str] | None = None) -> int:
    """``gpulb set-search build [--out DIR]``: the ahead-of-time build;
    ``gpulb set-search status``: how the loop runs here."""
    import argparse

    parser = argparse.ArgumentParser(prog="gpulb set-search", description="the compiled multi-GPU set search")
    parser.add_argument("command", choices=["build", "status"])
    parser.add_argument("--out", help="build: directory (default: $GPULB_AOT_DIR or next to this module)")
    args = parser.parse_args(argv)
    if args.command == "build":
        t0 = time.perf_counter()
        path = build_aot(args.out)
        print(f"built {path} in {time.perf_counter() - t0:.1f} s")
        return 0
    seconds = warm()
    print(f"set search: {mode or 'numpy'}" + (f" (loaded in {seconds:.2f} s)" if seconds is not None else "")
          + (f"; {failure}" if failure else ""))
    return 0

