"""A memory probe of the trained engine's phases, loaded by Python itself (sitecustomize) in
every process that has this folder on PYTHONPATH and STEPMEM_OUT set; nothing else changes.

Why: the records hold reserved peaks only, and whether ZeRO-1/2's optimizer step lands its new
tensors (the flat bf16 gradient partition, its fp32 copy, Adam's m and v at the first step) in
blocks the forward and backward left cached or in newly mapped memory is what pipeline/plan/
memory.py `_fragmentation` needs to know (benchmarks/gpu/stepmem_session.sh runs it).

It wraps `stages.engine.initialize` as that module is imported, and on the engine it returns:
  engine.backward                 points "before backward" (forward and loss done), "after backward"
  engine.step                     point "after step" at a gradient-accumulation boundary
  optimizer.step                  points "step begin", "step end"
  optimizer.flatten / flatten_dense_tensors_aligned
                                  point "bf16 flattened g<i>" (the flat gradient partition made)
  optimizer._optimizer_step       points "fp32 made g<i>" (before Adam), "adam done g<i>"
At each point: torch.cuda.memory_stats()' allocated / reserved / active / inactive-split bytes,
the segment count and cumulative counters, and the allocated and reserved peaks since the
previous point (it resets the peak counters: the stage's own gpu_mem_peak_gib then covers the
last interval only; the reserved peak stays whole, as reserved memory is never given back here).
At some points a layout: torch.cuda.memory_snapshot() summarised to segments, their free blocks
and the free tail. From the engine's start to the end of optimizer step 2 the allocator's
history (torch.cuda.memory._record_memory_history, no stacks) is recorded, and summarised per
interval after each point: bytes allocated and freed, bytes newly mapped, and every event of
STEPMEM_EVENT_MIB (512) MiB or more with its offset in the address range and the bytes mapped
just before it. Small marker allocations (unique sizes in the small pool) separate the points
in the trace. Everything goes to STEPMEM_OUT/stepmem-<pid>.json, rewritten after each step.
The probe never stops the run: an error is written into the file instead.

STEPMEM_FAKE=1 (tests, CPU): memory figures come from a synthetic allocator instead of CUDA.
"""

import os
import sys

_OUT = os.environ.get("STEPMEM_OUT")


def _install_import_hook():
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        busy = False

        def find_spec(self, name, path, target=None):
            if name != "stages.engine" or self.busy:
                return None
            self.busy = True
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self.busy = False
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                try:
                    _patch_initialize(module)
                except Exception as error:  # noqa: BLE001 - the probe never stops the run
                    print(f"stepmem: not installed: {error!r}", file=sys.stderr, flush=True)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def _patch_initialize(module):
    original = module.initialize

    def initialize(*args, **kwargs):
        engine = original(*args, **kwargs)
        try:
            Probe(engine, _OUT).install()
        except Exception as error:  # noqa: BLE001
            print(f"stepmem: probe not installed: {error!r}", file=sys.stderr, flush=True)
        return engine

    module.initialize = initialize


GiB = 1024**3
MiB = 1024**2
STAT_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "active": "active_bytes.all.current",
    "inactive_split": "inactive_split_bytes.all.current",
    "segments": "segment.all.current",
    "allocated_total": "allocated_bytes.all.allocated",  # cumulative bytes handed out
    "reserved_total": "reserved_bytes.all.allocated",  # cumulative bytes reserved (mapped) from the device
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
}
LAYOUT_AT = ("after backward", "step begin", "bf16 flattened g0", "fp32 made g0", "adam done g0", "step end")
TRACE_STEPS = 2  # history recorded until the end of this optimizer step
MARK_BASE = 512 * 1100  # marker sizes: MARK_BASE + 512*k, then MARK_END (small pool, < 1 MiB)
MARK_END = 512 * 2047


class Cuda:
    """The few torch.cuda calls the probe makes."""

    def __init__(self):
        import torch

        self.torch = torch

    def stats(self):
        return self.torch.cuda.memory_stats()

    def reset_peaks(self):
        self.torch.cuda.reset_peak_memory_stats()

    def synchronize(self):
        self.torch.cuda.synchronize()

    def segments(self):
        return self.torch.cuda.memory_snapshot()

    def record(self, on: bool, max_entries: int = 400_000):
        memory = self.torch.cuda.memory
        if on:
            memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=max_entries)
        else:
            memory._record_memory_history(enabled=None)

    def traces(self):
        return self.torch.cuda.memory._snapshot()["device_traces"]

    def mark(self, size: int):
        x = self.torch.empty(size, dtype=self.torch.uint8, device="cuda")
        y = self.torch.empty(MARK_END, dtype=self.torch.uint8, device="cuda")
        del x, y


class Probe:
    def __init__(self, engine, out, cuda=None):
        self.engine, self.out = engine, out
        self.cuda = cuda
        self.step = 1  # the optimizer step being worked on
        self.micro = 0
        self.points: list[dict] = []
        self.layouts: list[dict] = []
        self.errors: list[str] = []
        self.recording = False
        self.trace_summary = None
        self.path = os.path.join(out, f"stepmem-{os.getpid()}.json")

    # ------------------------------------------------------------------ install

    def install(self):
        if self.cuda is None:
            if os.environ.get("STEPMEM_FAKE"):
                self.cuda = FakeCuda()
            else:
                import torch

                if not torch.cuda.is_available():
                    return
                self.cuda = Cuda()
        os.makedirs(self.out, exist_ok=True)
        e, opt = self.engine, self.engine.optimizer
        self._wrap(e, "backward", "before backward", "after backward", count_micro=True)
        step = e.step

        def engine_step(*args, **kwargs):
            boundary = e.is_gradient_accumulation_boundary()
            result = step(*args, **kwargs)
            if boundary:
                self.point("after step")
                self.finish_step()
            return result

        e.step = engine_step
        self._wrap(opt, "step", "step begin", "step end", in_step=True)
        self.group, self.in_step, self.depth = 0, False, 0
        # The flat gradient partition step() makes: the outermost flatten inside optimizer.step
        # (the backward's buckets use flatten too; flatten_dense_tensors_aligned calls flatten).
        for name in ("flatten", "flatten_dense_tensors_aligned"):
            if hasattr(opt, name):
                self._wrap(opt, name, None, "bf16 flattened", grouped=True, only_in_step=True)
        if hasattr(opt, "_optimizer_step"):
            self._wrap(opt, "_optimizer_step", "fp32 made", "adam done", grouped=True)
        self.meta = {
            "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
            "optimizer": type(opt).__name__,
            "zero_stage": e.zero_optimization_stage() if hasattr(e, "zero_optimization_stage") else None,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "group_params": [sum(p.numel() for p in g) for g in getattr(opt, "bit16_groups", [])],
        }
        self.cuda.reset_peaks()
        self.point("engine ready")
        self.layout("engine ready")
        try:
            self.cuda.record(True)
            self.recording = True
            self.mark_count = 0
        except Exception as error:  # noqa: BLE001
            self.errors.append(f"record history: {error!r}")
        self.save()

    def _wrap(self, obj, name, before, after, count_micro=False, grouped=False, in_step=False, only_in_step=False):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if only_in_step:
                if not self.in_step or self.depth:
                    return original(*args, **kwargs)
                self.depth += 1
                try:
                    result = original(*args, **kwargs)
                finally:
                    self.depth -= 1
                self.point(after + f" g{self.group}")
                return result
            if count_micro:
                self.micro += 1
            if before:
                self.point(before + (f" g{self.group}" if grouped else ""))
            if in_step:
                self.in_step = True
            try:
                result = original(*args, **kwargs)
            finally:
                if in_step:
                    self.in_step = False
            if after:
                self.point(after + (f" g{self.group}" if grouped else ""))
            if grouped and name == "_optimizer_step":
                self.group += 1
            return result

        setattr(obj, name, wrapped)

    # ------------------------------------------------------------------ points

    def point(self, label: str):
        try:
            # No synchronize: the allocator's books are kept on the host, and a sync would let
            # cross-stream frees complete earlier than in an unprobed run.
            raw = self.cuda.stats()
            p = {"step": self.step, "micro": self.micro, "label": label}
            for key, name in STAT_KEYS.items():
                if name in raw:
                    p[key] = raw[name]
            p["allocated_peak"] = raw.get("allocated_bytes.all.peak")
            p["reserved_peak"] = raw.get("reserved_bytes.all.peak")
            self.cuda.reset_peaks()
            if self.recording:
                p["mark"] = MARK_BASE + 512 * self.mark_count
                self.mark_count += 1
                self.cuda.mark(p["mark"])
            self.points.append(p)
            if self.step <= 3 and any(label.startswith(x) for x in LAYOUT_AT) and (
                    label != "after backward" or self._last_micro()):
                self.layout(label)
        except Exception as error:  # noqa: BLE001
            self.errors.append(f"{label}: {error!r}")

    def _last_micro(self) -> bool:
        try:
            return bool(self.engine.is_gradient_accumulation_boundary())
        except Exception:  # noqa: BLE001
            return True

    def layout(self, label: str):
        try:
            self.layouts.append({"step": self.step, "label": label, **summarise_segments(self.cuda.segments())})
        except Exception as error:  # noqa: BLE001
            self.errors.append(f"layout {label}: {error!r}")

    def finish_step(self):
        if self.recording and self.step >= TRACE_STEPS:
            try:
                traces = self.cuda.traces()
                self.cuda.record(False)
                self.recording = False
                marks = {p["mark"]: f"s{p['step']} m{p['micro']} {p['label']}" for p in self.points if "mark" in p}
                self.trace_summary = summarise_trace(traces[0] if traces else [], marks)
            except Exception as error:  # noqa: BLE001
                self.errors.append(f"trace: {error!r}")
                self.recording = False
        self.step += 1
        self.micro = 0
        self.group = 0
        self.save()

    def save(self):
        import json

        data = {"meta": getattr(self, "meta", {}), "points": self.points, "layouts": self.layouts,
                "trace": self.trace_summary, "errors": self.errors}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------- summaries


def summarise_segments(segments) -> dict:
    """Segments (large pool), what each holds, its free blocks of 16 MiB or more, and its free tail."""
    out, small = [], {"count": 0, "bytes": 0}
    for s in segments:
        if s.get("segment_type") == "small":
            small["count"] += 1
            small["bytes"] += s["total_size"]
            continue
        blocks = sorted(s.get("blocks", []), key=lambda b: b.get("address", 0))
        base, offset = s.get("address", 0), 0
        free = []
        for b in blocks:
            addr = b.get("address", base + offset)
            if b.get("state") == "inactive" and b["size"] >= 16 * MiB:
                free.append([round((addr - base) / GiB, 3), round(b["size"] / GiB, 3)])
            offset += b["size"]
        tail = blocks[-1]["size"] if blocks and blocks[-1].get("state") == "inactive" else 0
        out.append({
            "size": round(s["total_size"] / GiB, 3),
            "allocated": round(s.get("allocated_size", 0) / GiB, 3),
            "expandable": s.get("is_expandable"),
            "blocks": len(blocks),
            "free_ge_16MiB": sorted(free, key=lambda f: -f[1])[:8],
            "free_ge_16MiB_total": round(sum(f[1] for f in free), 3),
            "tail_free": round(tail / GiB, 3),
        })
    out.sort(key=lambda s: -s["size"])
    return {"segments": out[:6], "segments_total": len(out), "small_pool": small}


def summarise_trace(events, marks: dict, event_mib: float = None) -> dict:
    """Per interval between marker allocations: bytes allocated, freed, mapped and unmapped, and
    the large events in order as [action, MiB, offset GiB from the lowest address seen, MiB mapped
    since the previous allocation] (offset and mapping only where they apply)."""
    event_mib = event_mib or float(os.environ.get("STEPMEM_EVENT_MIB", 512))
    large = event_mib * MiB
    addrs = [e["addr"] for e in events if e.get("action") in ("alloc", "segment_map", "segment_alloc")
             and e.get("size", 0) >= 2 * MiB]
    base = min(addrs) if addrs else 0
    intervals, current = [], {"label": "start", "alloc": 0, "free": 0, "mapped": 0, "unmapped": 0,
                              "n_alloc": 0, "events": [], "dropped": 0}
    mapped_since = 0
    top = 0
    order = sorted(marks)  # marker sizes grow with each point: one is taken only as the next expected
    following = 0
    for e in events:
        action, size = e.get("action"), e.get("size", 0)
        if action == "alloc" and following < len(order) and size == order[following]:
            following += 1
            intervals.append(current)
            current = {"label": marks[size], "alloc": 0, "free": 0, "mapped": 0, "unmapped": 0,
                       "n_alloc": 0, "events": [], "dropped": 0}
            continue
        if size < MiB and size >= MARK_BASE:  # the markers themselves (and small blocks of their sizes)
            continue
        offset = round((e.get("addr", base) - base) / GiB, 2)
        if action == "alloc":
            current["alloc"] += size
            current["n_alloc"] += 1
            if size >= large:
                item = ["alloc", round(size / MiB), offset, round(mapped_since / MiB)]
                _add(current, item)
            mapped_since = 0
            top = max(top, e.get("addr", base) + size - base)
        elif action == "free_completed":
            current["free"] += size
            if size >= large:
                _add(current, ["free", round(size / MiB), offset])
        elif action in ("segment_map", "segment_alloc"):
            current["mapped"] += size
            mapped_since += size
            if size >= large:
                _add(current, [action, round(size / MiB), offset])
        elif action in ("segment_unmap", "segment_free"):
            current["unmapped"] += size
            _add(current, [action, round(size / MiB), offset])
        elif action == "oom":
            _add(current, ["oom", round(size / MiB), offset])
    intervals.append(current)
    for i in intervals:
        for key in ("alloc", "free", "mapped", "unmapped"):
            i[key] = round(i[key] / GiB, 3)
    return {"event_mib": event_mib, "events_total": len(events), "highest_offset_gib": round(top / GiB, 3),
            "intervals": intervals}


def _add(interval, item, cap=60):
    if len(interval["events"]) < cap:
        interval["events"].append(item)
    else:
        interval["dropped"] += 1


# ---------------------------------------------------------------------- a synthetic allocator (tests)


class FakeCuda:
    """Stands in for torch.cuda on a CPU: a bump allocator over the probe's own marker calls, so
    that every path of the probe runs (stats, layouts, a trace with markers) without a GPU."""

    def __init__(self):
        self.events, self.top, self.allocated, self.peak, self.on = [], 0, 0, 0, False

    def _alloc(self, size):
        addr = 1 << 40
        if self.on:
            self.events.append({"action": "segment_map", "addr": addr + self.top, "size": size})
            self.events.append({"action": "alloc", "addr": addr + self.top, "size": size})
            self.events.append({"action": "free_completed", "addr": addr + self.top, "size": size})
        self.top += size

    def stats(self):
        self._alloc(3 * GiB)
        return {"allocated_bytes.all.current": self.top, "reserved_bytes.all.current": self.top,
                "allocated_bytes.all.peak": self.top, "reserved_bytes.all.peak": self.top,
                "segment.all.current": 1, "num_device_alloc": 1}

    def reset_peaks(self):
        pass

    def synchronize(self):
        pass

    def segments(self):
        blocks = [{"address": 1 << 40, "size": self.top, "state": "active_allocated"},
                  {"address": (1 << 40) + self.top, "size": GiB, "state": "inactive"}]
        return [{"segment_type": "large", "address": 1 << 40, "total_size": self.top + GiB, "allocated_size": self.top,
                 "is_expandable": True, "blocks": blocks},
                {"segment_type": "small", "total_size": 2 * MiB, "blocks": []}]

    def record(self, on, max_entries=0):
        self.on = on

    def traces(self):
        return [list(self.events)]

    def mark(self, size):
        if self.on:
            self.events.append({"action": "alloc", "addr": 1, "size": size})
            self.events.append({"action": "alloc", "addr": 2, "size": MARK_END})
            self.events.append({"action": "free_completed", "addr": 1, "size": size})
            self.events.append({"action": "free_completed", "addr": 2, "size": MARK_END})


if _OUT:
    _install_import_hook()
